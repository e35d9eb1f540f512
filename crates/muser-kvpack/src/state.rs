//! The neutral KV state that packs carry (the engine converts its own snapshot type).

use crate::error::{KvpackError, Result};
use crate::identity::KvLayoutAbi;
use std::ops::Range;

/// The smallest page size of the platforms we run on: one write per page maps it.
const PAGE_BYTES: usize = 4096;
/// Bytes per task when pages are written on several threads.
const TOUCH_CHUNK: usize = 4 << 20;

/// K and V rows of one layer for the positions [`KvLayoutAbi::layer_range`] gives.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LayerKv {
    pub k: Vec<u8>,
    pub v: Vec<u8>,
}

/// KV contents of one sequence over `positions`. Full-attention layers hold every position;
/// sliding-window layers hold only the last `n_swa` positions of the range (what the next
/// token can still attend to). Rows are token-major ([`crate::CellLayout::TokenMajor`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvState {
    pub layout: KvLayoutAbi,
    pub positions: Range<u32>,
    pub layers: Vec<LayerKv>,
}

impl KvState {
    /// Checks that every layer holds exactly the rows its range needs.
    pub fn validate(&self) -> Result<()> {
        self.layout.validate()?;
        if self.positions.start > self.positions.end {
            return Err(KvpackError::InvalidState(
                "position range is reversed".into(),
            ));
        }
        if self.layers.len() != self.layout.n_layer as usize {
            return Err(KvpackError::InvalidState(format!(
                "{} layers present, layout has {}",
                self.layers.len(),
                self.layout.n_layer
            )));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let want = self.layer_bytes(l);
            if layer.k.len() != want || layer.v.len() != want {
                return Err(KvpackError::InvalidState(format!(
                    "layer {l}: K {} / V {} bytes, expected {want}",
                    layer.k.len(),
                    layer.v.len()
                )));
            }
        }
        Ok(())
    }

    /// Positions layer `layer` holds.
    pub fn layer_range(&self, layer: usize) -> Range<u32> {
        self.layout.layer_range(layer, &self.positions)
    }

    /// Bytes of K (equally of V) of layer `layer`.
    pub fn layer_bytes(&self, layer: usize) -> usize {
        self.layer_range(layer).len() * self.layout.row_bytes()
    }

    /// Total K+V bytes.
    pub fn total_bytes(&self) -> u64 {
        self.layout.state_bytes(&self.positions)
    }

    /// Rows `pos` of layer `layer` (K, V). `pos` must lie within the layer's range.
    pub fn rows(&self, layer: usize, pos: &Range<u32>) -> (&[u8], &[u8]) {
        let r = self.layer_range(layer);
        debug_assert!(pos.start >= r.start && pos.end <= r.end);
        let rb = self.layout.row_bytes();
        let a = (pos.start - r.start) as usize * rb;
        let b = (pos.end - r.start) as usize * rb;
        (&self.layers[layer].k[a..b], &self.layers[layer].v[a..b])
    }

    /// An empty (zero-filled) state to be written into, after checking `max_bytes`.
    pub(crate) fn zeroed(layout: KvLayoutAbi, positions: Range<u32>) -> KvState {
        let mut s = KvState {
            layout,
            positions,
            layers: Vec::new(),
        };
        s.layers = (0..s.layout.n_layer as usize)
            .map(|l| LayerKv {
                k: vec![0; s.layer_bytes(l)],
                v: vec![0; s.layer_bytes(l)],
            })
            .collect();
        s
    }

    /// [`KvState::zeroed`] with every page of its buffers written on `threads` threads, so
    /// that copies into it run at memory speed. The first write to fresh memory costs a page
    /// fault per page, several times the copy itself; a state made ahead of the bytes that
    /// fill it (while a producer prefills them) takes the faults off the transfer's path.
    pub fn prefaulted(layout: KvLayoutAbi, positions: Range<u32>, threads: usize) -> KvState {
        let mut s = KvState::zeroed(layout, positions);
        let pieces: Vec<&mut [u8]> = s
            .layers
            .iter_mut()
            .flat_map(|l| [&mut l.k, &mut l.v])
            .flat_map(|b| b.chunks_mut(TOUCH_CHUNK))
            .collect();
        crate::par::par_map(pieces, threads, |_, piece| {
            for i in (0..piece.len()).step_by(PAGE_BYTES) {
                // an opaque zero: the store must happen, and the page it falls in is mapped
                piece[i] = std::hint::black_box(0);
            }
        });
        s
    }

    /// `self` followed by `next` (which starts where `self` ends): the state a full restore
    /// of `self.start .. next.end` would give.
    pub fn append(&self, next: &KvState) -> Result<KvState> {
        if self.positions.end != next.positions.start {
            return Err(KvpackError::DeltaBase(
                "delta does not start where the base ends",
            ));
        }
        let mut out = self.clone();
        out.extend(next)?;
        Ok(out)
    }

    /// Grows `self` in place by the positions of `next` past `self`'s end; `next` may start
    /// anywhere from `self`'s start to its end (positions both hold keep `self`'s rows).
    /// Sliding-window layers drop the rows that fall out of the window.
    pub fn extend(&mut self, next: &KvState) -> Result<()> {
        if self.layout != next.layout {
            return Err(KvpackError::DeltaBase("layouts differ"));
        }
        if next.positions.start > self.positions.end
            || next.positions.start < self.positions.start
            || next.positions.end < self.positions.end
        {
            return Err(KvpackError::DeltaBase(
                "the next state does not continue this one",
            ));
        }
        self.validate()?;
        next.validate()?;
        let positions = self.positions.start..next.positions.end;
        let rb = self.layout.row_bytes();
        for l in 0..self.layers.len() {
            let have = self.layer_range(l);
            let want = self.layout.layer_range(l, &positions);
            let n = next.layer_range(l);
            // rows up to `split` are this state's, the rest the next one's
            let split = n.start.max(self.positions.end);
            let drop = (want.start.min(self.positions.end) - have.start) as usize * rb;
            let (a, b) = (
                (split - n.start) as usize * rb,
                (n.end - n.start) as usize * rb,
            );
            let layer = &mut self.layers[l];
            for (mine, theirs) in [
                (&mut layer.k, &next.layers[l].k),
                (&mut layer.v, &next.layers[l].v),
            ] {
                mine.drain(..drop);
                mine.extend_from_slice(&theirs[a..b]);
            }
        }
        self.positions = positions;
        self.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::{CellLayout, KvDtype};

    fn layout() -> KvLayoutAbi {
        KvLayoutAbi {
            n_layer: 3,
            swa_layers: vec![false, true, true],
            n_head_kv: 1,
            head_dim: 2,
            n_swa: 5,
            dtype: KvDtype::F16,
            cell_layout: CellLayout::TokenMajor,
        }
    }

    /// The state of `positions` whose every row names its layer, position and K or V.
    fn truth(positions: Range<u32>) -> KvState {
        let mut s = KvState::zeroed(layout(), positions);
        let rb = s.layout.row_bytes();
        for l in 0..s.layers.len() {
            let r = s.layer_range(l);
            let layer = &mut s.layers[l];
            for (i, p) in r.enumerate() {
                for (kv, buf) in [&mut layer.k, &mut layer.v].into_iter().enumerate() {
                    buf[i * rb..(i + 1) * rb].fill((l * 64 + kv * 32) as u8 ^ p as u8);
                }
            }
        }
        s
    }

    #[test]
    fn extend_equals_the_whole_range_for_every_overlap() {
        for a in 0..4u32 {
            for b in a..12 {
                for c in a..=b {
                    for d in b..16 {
                        let mut s = truth(a..b);
                        s.extend(&truth(c..d)).unwrap();
                        assert_eq!(s, truth(a..d), "{a}..{b} then {c}..{d}");
                    }
                }
            }
        }
    }

    #[test]
    fn extend_refuses_a_gap_or_a_state_that_goes_back() {
        let mut s = truth(0..6);
        assert!(s.extend(&truth(7..9)).is_err());
        assert!(s.extend(&truth(2..5)).is_err());
        assert_eq!(s, truth(0..6));
        assert!(truth(0..6).append(&truth(5..9)).is_err());
        assert_eq!(truth(0..6).append(&truth(6..9)).unwrap(), truth(0..9));
    }
}
