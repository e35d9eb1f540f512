//! The KV cache pool, sized once at start-up.
//!
//! Layout (the same logical layout a CUDA backend will use):
//! - one *stream* per sequence (slot); streams never share cells;
//! - per stream two sub-caches as in llama.cpp's iSWA cache: the *base* cache for full-attention
//!   layers with `n_ctx` cells, and the *SWA* cache for sliding-window layers with
//!   `pad256(min(n_ctx, n_swa + n_ubatch))` cells used as a ring;
//! - per layer one buffer `[n_seq][n_cells][n_head_kv · head_dim]` for K and one for V (not
//!   transposed), in F16 (default) or F32. A row is head-major: head `h` at `[h·hd, (h+1)·hd)`.
//!
//! Cell placement ([`Placement::LlamaCpp`], the default) follows llama.cpp's
//! `find_slot`/`apply_ubatch` exactly (search from the head, reuse a SWA cell once its position
//! left the window, purge older positions that a reuse would leave dangling). The attention
//! kernels visit cells in index order, so reproducing the placement reproduces llama.cpp's
//! accumulation order. [`Placement::Positional`] puts position `p` in cell `p % cells` (the
//! same cells in every flow that never truncates across a ring wrap), for device kernels that
//! address rows by position.

mod cells;
mod store;
#[cfg(test)]
mod tests;

use crate::error::ModelError;
use std::ops::Range;

use cells::{cells_of, Cells, EMPTY, PAD};
pub use store::{runs, HostKv, KvStore, RowMap, RowRead, RowWrite};

/// Element type of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvType {
    #[default]
    F16,
    F32,
}

impl KvType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvType::F16 => 2,
            KvType::F32 => 4,
        }
    }

    /// ggml's name ("f16", "f32").
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
        }
    }
}

/// How a cache chooses the cells of new positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Placement {
    /// llama.cpp's `find_slot`: the first free (or out-of-window) cells from the search head.
    #[default]
    LlamaCpp,
    /// Position `p` in cell `p % cells`: the base cache holds position `p` in cell `p`, the
    /// sliding-window ring in cell `p % ring` (the ring holds `n_swa + n_ubatch` or more cells,
    /// so a batch never overwrites a key that one of its queries still sees).
    Positional,
}

/// What a cache (or a snapshot of one) holds: enough to check that a snapshot fits a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layer: usize,
    /// Per layer: true when the layer uses sliding-window attention (its K/V live in the ring).
    pub is_swa: Vec<bool>,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Sliding window: a key is visible iff `q_pos - k_pos < n_swa`. 0 when no layer slides.
    pub n_swa: u32,
    pub dtype: KvType,
}

impl KvLayout {
    /// Bytes of one K (or V) row: one position of one layer.
    pub fn row_bytes(&self) -> usize {
        self.n_head_kv * self.head_dim * self.dtype.size()
    }
}

/// The K/V of one layer for a range of positions, rows in ascending position order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerKv {
    pub k: Vec<u8>,
    pub v: Vec<u8>,
}

/// A sequence's K/V for a position range, in a device-neutral layout: per layer, rows of
/// `row_bytes()` in ascending position order. Full-attention layers hold every position of the
/// range; sliding layers hold only the last `min(n_swa, len)` positions of it (older ones can
/// never be attended to again).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSnapshot {
    pub layout: KvLayout,
    pub positions: Range<u32>,
    pub layers: Vec<LayerKv>,
}

impl KvSnapshot {
    /// Positions stored for layer `il`.
    pub fn layer_positions(&self, il: usize) -> Range<u32> {
        layer_positions(&self.layout, il, &self.positions)
    }
}

/// Runs of consecutive cells an export reads one by one; past this many (cells scattered by
/// many sequences' placements) it reads the span once and reorders on the host.
const MAX_EXPORT_RUNS: usize = 8;

fn layer_positions(layout: &KvLayout, il: usize, r: &Range<u32>) -> Range<u32> {
    if layout.is_swa[il] && r.end - r.start > layout.n_swa {
        r.end - layout.n_swa..r.end
    } else {
        r.clone()
    }
}

/// One sequence's bookkeeping: the two sub-caches.
#[derive(Clone, Debug)]
struct Stream {
    base: Cells,
    swa: Cells,
}

/// A forward pass's changes to one sequence, as [`KvCache::mark`] saved them.
#[derive(Debug)]
pub struct KvMark {
    seq: u32,
    start: u32,
    n: u32,
    before: Stream,
    /// (layer, cell, K row, V row) of ring cells the batch reuses.
    rows: Vec<(usize, usize, Vec<u8>, Vec<u8>)>,
}

/// The (base, ring) cells the attention of one-token steps would visit, row by row, as
/// `positions` go into the cells `base` and `swa` (empty where a sub-cache is unused) of
/// `stream`: each step's view, after the rows before it and itself were stored. The base
/// cache only fills empty cells, so its view follows the highest cell used; a ring may free
/// cells as it overwrites them, so its steps are replayed on a copy (a ring is small).
fn one_token_views(
    stream: &Stream,
    base: &[u32],
    swa: &[u32],
    positions: &[i32],
) -> Vec<(u32, u32)> {
    let mut hi = stream.base.used_max_p1();
    let mut ring = (!swa.is_empty()).then(|| stream.swa.clone());
    (0..positions.len())
        .map(|r| {
            let nb = base.get(r).map_or(0, |&c| {
                hi = hi.max(c + 1);
                stream.base.n_kv_for(hi)
            });
            let ns = match (&mut ring, swa.get(r)) {
                (Some(ring), Some(&c)) => {
                    ring.apply(&[c], &positions[r..r + 1]);
                    ring.n_kv()
                }
                _ => 0,
            };
            (nb, ns)
        })
        .collect()
}

/// The cells of a sub-cache holding `positions` (in order; empty for a sub-cache no layer
/// uses), `None` when one is missing.
fn held_cells(c: &Cells, positions: &Range<u32>) -> Option<Vec<u32>> {
    if c.size() == 0 || c.max == EMPTY {
        return Some(Vec::new());
    }
    cells_of(&c.pos, positions)
        .into_iter()
        .map(|i| (i != usize::MAX).then_some(i as u32))
        .collect()
}

/// Where the tokens of one forward pass went: per token, its cell in each sub-cache, and the
/// cell counts the attention of each stream must visit.
#[derive(Clone, Debug, Default)]
pub struct KvPlan {
    pub base_cell: Vec<u32>,
    pub swa_cell: Vec<u32>,
    /// Per stream touched by the batch: (seq, n_kv base, n_kv swa).
    pub n_kv: Vec<(u32, u32, u32)>,
    /// Per stream, in the order of `n_kv`: empty, or for a sequence computed alone, per row
    /// the (base, swa) cells a one-token step at that row's position would visit.
    pub alone_n_kv: Vec<Vec<(u32, u32)>>,
}

/// The KV cache pool.
#[derive(Debug)]
pub struct KvCache {
    layout: KvLayout,
    n_ctx: u32,
    n_ubatch: u32,
    streams: Vec<Stream>,
    /// The K and V rows, wherever the backend keeps them.
    store: Box<dyn KvStore>,
    placement: Placement,
}

/// Most sequences one pool holds (llama.cpp's `LLAMA_MAX_SEQ`).
pub const MAX_SEQ: usize = 256;

impl KvCache {
    /// A pool for `n_seq` sequences of up to `n_ctx` positions each, stored in host memory.
    /// `n_ubatch` is the largest batch one forward pass will place (it sizes the SWA ring, as
    /// in llama.cpp).
    pub fn new(
        layout: KvLayout,
        n_ctx: u32,
        n_seq: usize,
        n_ubatch: u32,
    ) -> Result<KvCache, ModelError> {
        KvCache::with_store(layout, n_ctx, n_seq, n_ubatch, |l, cells, n| {
            Ok(Box::new(HostKv::new(l, cells, n)?))
        })
    }

    /// [`KvCache::new`] with the rows kept by `make_store(layout, cells_per_layer, n_seq)`
    /// (a device backend's memory).
    pub fn with_store(
        layout: KvLayout,
        n_ctx: u32,
        n_seq: usize,
        n_ubatch: u32,
        make_store: impl FnOnce(&KvLayout, &[usize], usize) -> Result<Box<dyn KvStore>, ModelError>,
    ) -> Result<KvCache, ModelError> {
        if n_seq == 0 || n_seq > MAX_SEQ {
            return Err(ModelError::Kv(format!(
                "n_seq {n_seq} is outside 1..={MAX_SEQ}"
            )));
        }
        if n_ctx == 0 || n_ubatch == 0 {
            return Err(ModelError::Kv("n_ctx and n_ubatch must be positive".into()));
        }
        if layout.is_swa.len() != layout.n_layer {
            return Err(ModelError::Kv(format!(
                "{} sliding flags for {} layers",
                layout.is_swa.len(),
                layout.n_layer
            )));
        }
        let base_size = n_ctx;
        let swa_size = if layout.n_swa == 0 {
            0
        } else {
            n_ctx.min(layout.n_swa + n_ubatch).div_ceil(PAD) * PAD
        };
        let cells: Vec<usize> = layout
            .is_swa
            .iter()
            .map(|&swa| if swa { swa_size } else { base_size } as usize)
            .collect();
        let store = make_store(&layout, &cells, n_seq)?;
        let placement = Placement::default();
        let streams = (0..n_seq)
            .map(|_| Stream {
                base: Cells::new(base_size, 0, placement),
                swa: Cells::new(swa_size, layout.n_swa, placement),
            })
            .collect();
        Ok(KvCache {
            layout,
            n_ctx,
            n_ubatch,
            streams,
            store,
            placement,
        })
    }

    /// The same cache with cells chosen by `placement` from now on (meant for a fresh cache).
    pub fn with_placement(mut self, placement: Placement) -> KvCache {
        self.placement = placement;
        for s in &mut self.streams {
            s.base.placement = placement;
            s.swa.placement = placement;
        }
        self
    }

    /// How cells are chosen.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Positions per sequence.
    pub fn n_ctx(&self) -> u32 {
        self.n_ctx
    }

    /// Largest batch one forward pass may place.
    pub fn n_ubatch(&self) -> u32 {
        self.n_ubatch
    }

    pub fn n_seq(&self) -> usize {
        self.streams.len()
    }

    /// Bytes held by K and V buffers.
    pub fn bytes(&self) -> usize {
        self.store.bytes()
    }

    /// Where the K and V rows live.
    pub fn store(&self) -> &dyn KvStore {
        &*self.store
    }

    /// [`KvCache::store`], mutable (a backend writes its batch's rows through it).
    pub fn store_mut(&mut self) -> &mut dyn KvStore {
        &mut *self.store
    }

    /// The next position of `seq` (one past the largest stored), 0 when empty.
    pub fn seq_len(&self, seq: u32) -> u32 {
        self.streams.get(seq as usize).map_or(0, |s| {
            let m = s.base.pos_max().max(s.swa.pos_max());
            (m + 1) as u32
        })
    }

    /// Drop every position `>= pos` of `seq` (rollback).
    pub fn truncate(&mut self, seq: u32, pos: u32) {
        if let Some(s) = self.streams.get_mut(seq as usize) {
            s.base.remove(pos as i32, i32::MAX);
            s.swa.remove(pos as i32, i32::MAX);
        }
    }

    /// What a forward pass over `n` tokens of `seq` from its current end would change, saved
    /// so that [`KvCache::rollback`] can undo the part past an accepted prefix (speculative
    /// verification). The batch must be placed next, as one group, with nothing else touching
    /// `seq` in between. A sliding-window ring reuses cells whose positions left every future
    /// query's window; their rows are copied here, so a rollback restores exactly what one-token
    /// steps would have left (the same cells, positions and rows), and an export or a prefix
    /// reuse afterwards sees the same cache as plain decoding.
    pub fn mark(&self, seq: u32, n: u32) -> Result<KvMark, ModelError> {
        self.check_seq(seq)?;
        let start = self.seq_len(seq);
        if n == 0 || start + n > self.n_ctx {
            return Err(ModelError::Kv(format!(
                "cannot mark {n} positions from {start} of seq {seq} (n_ctx {})",
                self.n_ctx
            )));
        }
        let positions: Vec<i32> = (start..start + n).map(|p| p as i32).collect();
        let s = &self.streams[seq as usize];
        let has_swa = self.layout.is_swa.iter().any(|&f| f);
        let mut rows = Vec::new();
        if has_swa {
            let full = || ModelError::KvFull {
                seq,
                n_tokens: n as usize,
            };
            let cells = s.swa.find(&positions).ok_or_else(full)?;
            let row = self.layout.row_bytes();
            for c in cells
                .into_iter()
                .filter(|&c| s.swa.pos[c as usize] != EMPTY)
            {
                for il in (0..self.layout.n_layer).filter(|&il| self.layout.is_swa[il]) {
                    let (mut k, mut v) = (vec![0u8; row], vec![0u8; row]);
                    let c = c as usize;
                    self.store.read_rows(il, seq, c..c + 1, &mut k, &mut v)?;
                    rows.push((il, c, k, v));
                }
            }
        }
        Ok(KvMark {
            seq,
            start,
            n,
            before: s.clone(),
            rows,
        })
    }

    /// Undoes the marked batch past its first `keep` positions: the cells of the rest get back
    /// the positions and rows they held, and the bookkeeping is that of a cache which took only
    /// the kept positions. `keep == mark.n` keeps everything.
    pub fn rollback(&mut self, mark: KvMark, keep: u32) -> Result<(), ModelError> {
        let KvMark {
            seq,
            start,
            n,
            before,
            rows,
        } = mark;
        if keep > n || self.seq_len(seq) != start + n {
            return Err(ModelError::Kv(format!(
                "rollback of seq {seq} to {keep} of {n} marked positions from {start} does not \
                 match the cache ({} held)",
                self.seq_len(seq)
            )));
        }
        if keep == n {
            return Ok(());
        }
        let kept: Vec<i32> = (start..start + keep).map(|p| p as i32).collect();
        let has_swa = self.layout.is_swa.iter().any(|&f| f);
        let has_base = self.layout.is_swa.iter().any(|&f| !f);
        let s = &mut self.streams[seq as usize];
        let lost = || ModelError::Kv(format!("seq {seq} lost a marked position"));
        let base_cells = held_cells(&s.base, &(start..start + keep)).ok_or_else(lost)?;
        let swa_cells = held_cells(&s.swa, &(start..start + keep)).ok_or_else(lost)?;
        *s = before;
        if !kept.is_empty() {
            if has_base {
                s.base.apply(&base_cells, &kept);
            }
            if has_swa {
                s.swa.apply(&swa_cells, &kept);
            }
        }
        // the rows of ring cells that went back to their old positions
        for (il, cell, k, v) in rows {
            if !swa_cells.contains(&(cell as u32)) {
                self.store.write_rows(il, seq, cell, &k, &v)?;
            }
        }
        Ok(())
    }

    /// Forget `seq` entirely.
    pub fn clear(&mut self, seq: u32) {
        if let Some(s) = self.streams.get_mut(seq as usize) {
            s.base.clear();
            s.swa.clear();
        }
    }

    /// Place the tokens of a batch. `groups` lists, per sequence, its token indices (ascending)
    /// and `pos` holds every token's position; `alone[g]` (or nothing) asks for the cells each
    /// row of group `g` would see as a one-token step. Fails without changing anything when a
    /// sequence does not fit.
    pub(crate) fn place(
        &mut self,
        groups: &[(u32, Vec<usize>)],
        pos: &[u32],
        alone: &[bool],
    ) -> Result<KvPlan, ModelError> {
        let mut plan = KvPlan {
            base_cell: vec![0; pos.len()],
            swa_cell: vec![0; pos.len()],
            n_kv: Vec::with_capacity(groups.len()),
            alone_n_kv: Vec::with_capacity(groups.len()),
        };
        let has_swa = self.layout.is_swa.iter().any(|&s| s);
        let has_base = self.layout.is_swa.iter().any(|&s| !s);
        // Every group's cells first (the groups are distinct sequences, so nothing one of them
        // takes changes what another finds), then the writes: a batch that does not fit
        // changes nothing.
        let mut found = Vec::with_capacity(groups.len());
        for (seq, idx) in groups {
            let positions: Vec<i32> = idx.iter().map(|&i| pos[i] as i32).collect();
            let stream = &self.streams[*seq as usize];
            let full = || ModelError::KvFull {
                seq: *seq,
                n_tokens: idx.len(),
            };
            let base = if has_base {
                stream.base.find(&positions).ok_or_else(full)?
            } else {
                Vec::new()
            };
            let swa = if has_swa {
                stream.swa.find(&positions).ok_or_else(full)?
            } else {
                Vec::new()
            };
            found.push((positions, base, swa));
        }
        for (g, ((seq, idx), (positions, base, swa))) in groups.iter().zip(found).enumerate() {
            let stream = &mut self.streams[*seq as usize];
            let steps = match alone.get(g).copied().unwrap_or(false) {
                true => one_token_views(stream, &base, &swa, &positions),
                false => Vec::new(),
            };
            plan.alone_n_kv.push(steps);
            if has_base {
                stream.base.apply(&base, &positions);
                idx.iter()
                    .zip(&base)
                    .for_each(|(&i, &c)| plan.base_cell[i] = c);
            }
            if has_swa {
                stream.swa.apply(&swa, &positions);
                idx.iter()
                    .zip(&swa)
                    .for_each(|(&i, &c)| plan.swa_cell[i] = c);
            }
            plan.n_kv
                .push((*seq, stream.base.n_kv(), stream.swa.n_kv()));
        }
        Ok(plan)
    }

    /// Cell positions (-1 = empty) of `seq`'s sub-cache for layer `il`, one per cell.
    pub fn cell_pos(&self, seq: u32, il: usize) -> &[i32] {
        let s = &self.streams[seq as usize];
        if self.layout.is_swa[il] {
            &s.swa.pos
        } else {
            &s.base.pos
        }
    }

    /// Whether [`KvCache::export`] of `positions` would find every row it needs (a sliding
    /// layer's ring may have dropped them), checked without copying anything.
    pub fn holds(&self, seq: u32, positions: Range<u32>) -> bool {
        if self.check_seq(seq).is_err()
            || positions.start > positions.end
            || positions.end > self.seq_len(seq)
        {
            return false;
        }
        (0..self.layout.n_layer).all(|il| {
            let want = layer_positions(&self.layout, il, &positions);
            let at = cells_of(self.cell_pos(seq, il), &want);
            at.iter().all(|&c| c != usize::MAX)
        })
    }

    /// Whether a token at position `at` finds every row it attends to in `seq`, which holds
    /// at least `at` positions: always without sliding-window layers; with them, the window
    /// before `at` must still be in the ring (a cache cut back to `at` can resume there only
    /// then).
    pub fn holds_window(&self, seq: u32, at: u32) -> bool {
        if self.layout.n_swa == 0 || !self.layout.is_swa.iter().any(|&s| s) {
            return true;
        }
        // the token at `at` attends to positions `at - n_swa + 1 ..`
        self.holds(seq, at.saturating_sub(self.layout.n_swa)..at)
    }

    /// Copy out `seq`'s K/V for `positions` (see [`KvSnapshot`] for what each layer holds).
    pub fn export(&self, seq: u32, positions: Range<u32>) -> Result<KvSnapshot, ModelError> {
        self.check_seq(seq)?;
        if positions.start > positions.end || positions.end > self.seq_len(seq) {
            return Err(ModelError::Kv(format!(
                "export range {positions:?} is outside the {} stored positions of seq {seq}",
                self.seq_len(seq)
            )));
        }
        let row = self.layout.row_bytes();
        // Per layer: the cell of each wanted position, as runs of consecutive cells.
        let mut plans = Vec::with_capacity(self.layout.n_layer);
        for il in 0..self.layout.n_layer {
            let want = layer_positions(&self.layout, il, &positions);
            let at = cells_of(self.cell_pos(seq, il), &want);
            if let Some(i) = at.iter().position(|&c| c == usize::MAX) {
                let p = want.start + i as u32;
                return Err(ModelError::Kv(format!(
                    "position {p} of seq {seq} is no longer cached in layer {il}"
                )));
            }
            let runs = store::runs(at.iter().enumerate().map(|(i, &c)| (c, i)));
            plans.push((at, runs));
        }
        let mut layers: Vec<LayerKv> = plans
            .iter()
            .map(|(at, _)| LayerKv {
                k: vec![0u8; at.len() * row],
                v: vec![0u8; at.len() * row],
            })
            .collect();
        // Each run of consecutive cells straight into its rows (a window's ring wraps once:
        // two runs), all layers in one call so a device store moves them together.
        let mut reads = Vec::new();
        for (il, ((_, runs), layer)) in plans.iter().zip(&mut layers).enumerate() {
            if runs.len() > MAX_EXPORT_RUNS {
                continue;
            }
            let (mut k, mut v) = (&mut layer.k[..], &mut layer.v[..]);
            for &(c, _, n) in runs {
                let (kh, kt) = std::mem::take(&mut k).split_at_mut(n * row);
                let (vh, vt) = std::mem::take(&mut v).split_at_mut(n * row);
                (k, v) = (kt, vt);
                reads.push(RowRead {
                    layer: il,
                    cells: c..c + n,
                    k: kh,
                    v: vh,
                });
            }
        }
        self.store.read_many(seq, &mut reads)?;
        drop(reads);
        // Scattered cells (many sequences' placements): one read of the span, then the rows
        // in position order.
        for (il, ((at, runs), layer)) in plans.iter().zip(&mut layers).enumerate() {
            if runs.len() <= MAX_EXPORT_RUNS {
                continue;
            }
            let span = match (at.iter().min(), at.iter().max()) {
                (Some(&lo), Some(&hi)) => lo..hi + 1,
                _ => 0..0,
            };
            let (mut sk, mut sv) = (vec![0u8; span.len() * row], vec![0u8; span.len() * row]);
            self.store
                .read_rows(il, seq, span.clone(), &mut sk, &mut sv)?;
            for (i, &c) in at.iter().enumerate() {
                let from = (c - span.start) * row..(c - span.start + 1) * row;
                layer.k[i * row..(i + 1) * row].copy_from_slice(&sk[from.clone()]);
                layer.v[i * row..(i + 1) * row].copy_from_slice(&sv[from]);
            }
        }
        Ok(KvSnapshot {
            layout: self.layout.clone(),
            positions,
            layers,
        })
    }

    /// Append a snapshot to `seq`, whose length must equal `snap.positions.start`. Cells are
    /// placed as a forward pass over those positions would place them.
    pub fn import(&mut self, seq: u32, snap: &KvSnapshot) -> Result<(), ModelError> {
        self.check_seq(seq)?;
        if snap.layout != self.layout {
            return Err(ModelError::Kv(format!(
                "snapshot layout {:?} does not match the cache's {:?}",
                snap.layout, self.layout
            )));
        }
        let r = snap.positions.clone();
        if r.start != self.seq_len(seq) {
            return Err(ModelError::Kv(format!(
                "snapshot starts at position {} but seq {seq} holds {}",
                r.start,
                self.seq_len(seq)
            )));
        }
        if r.end > self.n_ctx {
            return Err(ModelError::Kv(format!(
                "snapshot ends at {} beyond n_ctx {}",
                r.end, self.n_ctx
            )));
        }
        let row = self.layout.row_bytes();
        if snap.layers.len() != self.layout.n_layer
            || (0..self.layout.n_layer).any(|il| {
                let n = snap.layer_positions(il).len() * row;
                snap.layers[il].k.len() != n || snap.layers[il].v.len() != n
            })
        {
            return Err(ModelError::Kv(
                "snapshot layer sizes do not match its positions".into(),
            ));
        }
        // Place in ubatch-sized steps so the SWA ring sees what a forward pass would do; the
        // rows move in one call, in that order.
        let mut writes = Vec::new();
        let mut p = r.start;
        while p < r.end {
            let end = (p + self.n_ubatch).min(r.end);
            let pos: Vec<u32> = (p..end).collect();
            let plan = self.place(&[(seq, (0..pos.len()).collect())], &pos, &[])?;
            for il in 0..self.layout.n_layer {
                let have = snap.layer_positions(il);
                let cells = if self.layout.is_swa[il] {
                    &plan.swa_cell
                } else {
                    &plan.base_cell
                };
                // (first cell, first source row, rows): consecutive cells in one write.
                let pairs = pos
                    .iter()
                    .enumerate()
                    .filter(|(_, pp)| have.contains(pp))
                    .map(|(t, &pp)| (cells[t] as usize, (pp - have.start) as usize));
                for (dst, src, n) in runs(pairs) {
                    let r = src * row..(src + n) * row;
                    writes.push(RowWrite {
                        layer: il,
                        first_cell: dst,
                        k: &snap.layers[il].k[r.clone()],
                        v: &snap.layers[il].v[r],
                    });
                }
            }
            p = end;
        }
        self.store.write_many(seq, &writes)
    }

    fn check_seq(&self, seq: u32) -> Result<(), ModelError> {
        if seq as usize >= self.streams.len() {
            return Err(ModelError::Kv(format!(
                "seq {seq} is outside the pool's {} sequences",
                self.streams.len()
            )));
        }
        Ok(())
    }
}
