//! The neutral KV state that packs carry (the engine converts its own snapshot type).

use crate::error::{KvpackError, Result};
use crate::identity::KvLayoutAbi;
use std::ops::Range;

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
        (0..self.layers.len())
            .map(|l| 2 * self.layer_bytes(l) as u64)
            .sum()
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

    /// `self` followed by `next` (which starts where `self` ends): the state a full restore
    /// of `self.start .. next.end` would give.
    pub fn append(&self, next: &KvState) -> Result<KvState> {
        if self.layout != next.layout {
            return Err(KvpackError::DeltaBase("layouts differ"));
        }
        if self.positions.end != next.positions.start {
            return Err(KvpackError::DeltaBase(
                "delta does not start where the base ends",
            ));
        }
        self.validate()?;
        next.validate()?;
        let positions = self.positions.start..next.positions.end;
        let rb = self.layout.row_bytes();
        let layers = (0..self.layers.len())
            .map(|l| {
                let want = self.layout.layer_range(l, &positions);
                let n = next.layer_range(l);
                // Rows before the delta's own range come from the base; the base holds them
                // because its window ends at the delta's start.
                let from_base = want.start..n.start;
                let mut k = Vec::with_capacity(want.len() * rb);
                let mut v = Vec::with_capacity(want.len() * rb);
                if !from_base.is_empty() {
                    let (bk, bv) = self.rows(l, &from_base);
                    k.extend_from_slice(bk);
                    v.extend_from_slice(bv);
                }
                k.extend_from_slice(&next.layers[l].k);
                v.extend_from_slice(&next.layers[l].v);
                LayerKv { k, v }
            })
            .collect();
        let out = KvState {
            layout: self.layout.clone(),
            positions,
            layers,
        };
        out.validate()?;
        Ok(out)
    }
}
