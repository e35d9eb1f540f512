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

mod store;

use crate::error::ModelError;
use std::ops::Range;

pub use store::{runs, HostKv, KvStore, RowMap};

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

fn layer_positions(layout: &KvLayout, il: usize, r: &Range<u32>) -> Range<u32> {
    if layout.is_swa[il] && r.end - r.start > layout.n_swa {
        r.end - layout.n_swa..r.end
    } else {
        r.clone()
    }
}

/// The cell holding each position of `want` (`usize::MAX` where none does), in one pass
/// over the cells: a 131k-token export looks up every position of every layer.
fn cells_of(cells: &[i32], want: &Range<u32>) -> Vec<usize> {
    let mut at = vec![usize::MAX; want.len()];
    for (c, &p) in cells.iter().enumerate() {
        if p >= 0 && want.contains(&(p as u32)) {
            let slot = &mut at[(p as u32 - want.start) as usize];
            if *slot == usize::MAX {
                *slot = c; // the first cell, as a linear search would find
            }
        }
    }
    at
}

const EMPTY: i32 = -1;
const PAD: u32 = 256;

/// Cell bookkeeping of one sub-cache of one stream (llama.cpp's `llama_kv_cells` for one seq).
#[derive(Clone, Debug)]
struct Cells {
    pos: Vec<i32>,
    head: u32,
    used: u32,
    /// Window for cell reuse; 0 for the base cache (never reuses occupied cells).
    n_swa: u32,
    placement: Placement,
    /// The largest stored position (EMPTY when none) and one past the last used cell: kept
    /// up to date so that a decode step costs no scan of a long cache.
    max: i32,
    hi: u32,
}

impl Cells {
    fn new(size: u32, n_swa: u32, placement: Placement) -> Cells {
        Cells {
            pos: vec![EMPTY; size as usize],
            head: 0,
            used: 0,
            n_swa,
            placement,
            max: EMPTY,
            hi: 0,
        }
    }

    fn size(&self) -> u32 {
        self.pos.len() as u32
    }

    fn pos_max(&self) -> i32 {
        self.max
    }

    fn pos_min(&self) -> i32 {
        self.pos
            .iter()
            .copied()
            .filter(|&p| p >= 0)
            .min()
            .unwrap_or(EMPTY)
    }

    fn used_max_p1(&self) -> u32 {
        self.hi
    }

    /// Recomputes `max` and `hi` from the cells (after cells were freed).
    fn rescan(&mut self) {
        self.max = self.pos.iter().copied().max().unwrap_or(EMPTY);
        self.hi = self
            .pos
            .iter()
            .rposition(|&p| p >= 0)
            .map_or(0, |i| i as u32 + 1);
    }

    /// Cells the attention kernels look at: llama.cpp pads this to 256 so graphs stay constant.
    fn n_kv(&self) -> u32 {
        let padded = self.used_max_p1().div_ceil(PAD) * PAD;
        self.size().min(PAD.max(padded))
    }

    fn masked_swa(&self, p0: i32, p1: i32) -> bool {
        self.n_swa > 0 && p1 - p0 >= self.n_swa as i32
    }

    /// The cells `positions` of one sequence would take (llama.cpp's `find_slot`,
    /// non-contiguous, or by position), changing nothing; None when they do not fit.
    fn find(&self, positions: &[i32]) -> Option<Vec<u32>> {
        let n = positions.len() as u32;
        if n == 0 || n > self.size() {
            return None;
        }
        match self.placement {
            Placement::LlamaCpp => self.find_slot(n),
            Placement::Positional => self.positional_slot(positions),
        }
    }

    /// `apply_ubatch`: stores `positions` in the cells `find` chose for them.
    fn apply(&mut self, idxs: &[u32], positions: &[i32]) {
        let mut max_rm = EMPTY;
        for (&idx, &p) in idxs.iter().zip(positions) {
            let cell = &mut self.pos[idx as usize];
            if *cell != EMPTY {
                max_rm = max_rm.max(*cell);
                self.used -= 1;
            }
            *cell = p;
            self.used += 1;
            self.max = self.max.max(p);
            self.hi = self.hi.max(idx + 1);
        }
        if max_rm != EMPTY {
            let min = self.pos_min();
            if min <= max_rm {
                self.remove(min, max_rm + 1);
            }
        }
        if let Some(&last) = idxs.last() {
            self.head = last + 1;
        }
    }

    /// Cells `p % size` for `positions`, when each is free or holds a position that left the
    /// window of every query from the current end of the sequence on.
    fn positional_slot(&self, positions: &[i32]) -> Option<Vec<u32>> {
        let size = self.size();
        let seq_max_p1 = self.pos_max() + 1;
        let mut idxs = Vec::with_capacity(positions.len());
        for &p in positions {
            let idx = u32::try_from(p).ok()? % size;
            let held = self.pos[idx as usize];
            if held != EMPTY && !self.masked_swa(held, seq_max_p1) {
                return None;
            }
            idxs.push(idx);
        }
        Some(idxs)
    }

    /// llama.cpp's `find_slot` (non-contiguous): `n` cells from the search head.
    fn find_slot(&self, n: u32) -> Option<Vec<u32>> {
        let size = self.size();
        let mut head = self.head;
        if head > self.used + 2 * n {
            head = 0;
        }
        let seq_max_p1 = self.pos_max() + 1;
        let mut idxs = Vec::with_capacity(n as usize);
        let mut tested = 0u32;
        loop {
            if head + 1 > size {
                tested += size - head;
                head = 0;
                continue;
            }
            let idx = head;
            head += 1;
            tested += 1;
            let p = self.pos[idx as usize];
            if p == EMPTY || self.masked_swa(p, seq_max_p1) {
                idxs.push(idx);
            }
            if idxs.len() as u32 == n {
                break;
            }
            if tested >= size {
                return None;
            }
        }
        Some(idxs)
    }

    /// llama.cpp's `seq_rm(seq, p0, p1)`: free the cells with positions in `[p0, p1)`.
    fn remove(&mut self, p0: i32, p1: i32) {
        let size = self.size();
        let mut new_head = size;
        for (i, p) in self.pos.iter_mut().enumerate() {
            if *p != EMPTY && *p >= p0 && *p < p1 {
                *p = EMPTY;
                self.used -= 1;
                if new_head == size {
                    new_head = i as u32;
                }
            }
        }
        if new_head != self.size() && new_head < self.head {
            self.head = new_head;
        }
        if new_head != size {
            self.rescan();
        }
    }

    fn clear(&mut self) {
        self.pos.fill(EMPTY);
        self.head = 0;
        self.used = 0;
        self.max = EMPTY;
        self.hi = 0;
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

    /// The cells the attention of `seq` would visit, per sub-cache (base, ring; 0 for one no
    /// layer uses), after one batch appends `n` positions; `None` when they do not fit.
    pub fn cells_in_view(&self, seq: u32, n: u32) -> Option<(u32, u32)> {
        let s = self.streams.get(seq as usize)?;
        let start = self.seq_len(seq);
        let positions: Vec<i32> = (start..start + n).map(|p| p as i32).collect();
        let after = |c: &Cells, used: bool| -> Option<u32> {
            if !used {
                return Some(0);
            }
            let cells = c.find(&positions)?;
            let mut c = c.clone();
            c.apply(&cells, &positions);
            Some(c.n_kv())
        };
        let has_swa = self.layout.is_swa.iter().any(|&f| f);
        let has_base = self.layout.is_swa.iter().any(|&f| !f);
        Some((after(&s.base, has_base)?, after(&s.swa, has_swa)?))
    }

    /// The most positions, up to `max`, that one batch may append to `seq` while every
    /// sub-cache shows its attention as many cells as a one-token step from the same end would
    /// (the count visited is padded to 256, and the attention's rounding depends on it). A
    /// verification batch within it gives each row a one-token step's view of the cache.
    pub fn uniform_extent(&self, seq: u32, max: u32) -> u32 {
        let Some(one) = self.cells_in_view(seq, 1) else {
            return 0;
        };
        if max <= 1 || self.cells_in_view(seq, max) == Some(one) {
            return max;
        }
        (1..max)
            .rev()
            .find(|&n| self.cells_in_view(seq, n) == Some(one))
            .unwrap_or(1)
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
    /// and `pos` holds every token's position. Fails without changing anything when a sequence
    /// does not fit.
    pub(crate) fn place(
        &mut self,
        groups: &[(u32, Vec<usize>)],
        pos: &[u32],
    ) -> Result<KvPlan, ModelError> {
        let mut plan = KvPlan {
            base_cell: vec![0; pos.len()],
            swa_cell: vec![0; pos.len()],
            n_kv: Vec::with_capacity(groups.len()),
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
        for ((seq, idx), (positions, base, swa)) in groups.iter().zip(found) {
            let stream = &mut self.streams[*seq as usize];
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
        let mut layers = Vec::with_capacity(self.layout.n_layer);
        for il in 0..self.layout.n_layer {
            let want = layer_positions(&self.layout, il, &positions);
            let at = cells_of(self.cell_pos(seq, il), &want);
            if let Some(i) = at.iter().position(|&c| c == usize::MAX) {
                let p = want.start + i as u32;
                return Err(ModelError::Kv(format!(
                    "position {p} of seq {seq} is no longer cached in layer {il}"
                )));
            }
            // One read of the cells spanned, then the wanted rows in position order.
            let span = match (at.iter().min(), at.iter().max()) {
                (Some(&lo), Some(&hi)) => lo..hi + 1,
                _ => 0..0,
            };
            let (mut k, mut v) = (vec![0u8; span.len() * row], vec![0u8; span.len() * row]);
            self.store
                .read_rows(il, seq, span.clone(), &mut k, &mut v)?;
            if at.iter().enumerate().all(|(i, &c)| c == span.start + i) {
                // the cells hold the positions in order (a full-attention layer's usual
                // layout): the read is the layer's rows, no second copy
                layers.push(LayerKv { k, v });
                continue;
            }
            let mut lk = Vec::with_capacity(at.len() * row);
            let mut lv = Vec::with_capacity(at.len() * row);
            for c in at {
                let r = (c - span.start) * row..(c - span.start + 1) * row;
                lk.extend_from_slice(&k[r.clone()]);
                lv.extend_from_slice(&v[r]);
            }
            layers.push(LayerKv { k: lk, v: lv });
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
        // Place in ubatch-sized steps so the SWA ring sees what a forward pass would do.
        let mut p = r.start;
        while p < r.end {
            let end = (p + self.n_ubatch).min(r.end);
            let pos: Vec<u32> = (p..end).collect();
            let plan = self.place(&[(seq, (0..pos.len()).collect())], &pos)?;
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
                    let (k, v) = (&snap.layers[il].k[r.clone()], &snap.layers[il].v[r]);
                    self.store.write_rows(il, seq, dst, k, v)?;
                }
            }
            p = end;
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::any::Any;

    fn layout() -> KvLayout {
        KvLayout {
            n_layer: 2,
            is_swa: vec![false, true],
            n_head_kv: 1,
            head_dim: 4,
            n_swa: 4,
            dtype: KvType::F32,
        }
    }

    fn fill(kv: &mut KvCache, seq: u32, range: Range<u32>, chunk: usize) {
        let all: Vec<u32> = range.collect();
        for c in all.chunks(chunk) {
            kv.place(&[(seq, (0..c.len()).collect())], c).unwrap();
        }
    }

    /// Places `positions` of `seq` as one batch and writes each position's number into its
    /// rows, as a forward pass would write its K/V.
    fn put(kv: &mut KvCache, seq: u32, positions: Range<u32>) {
        let pos: Vec<u32> = positions.collect();
        let plan = kv.place(&[(seq, (0..pos.len()).collect())], &pos).unwrap();
        let row = kv.layout.row_bytes();
        for il in 0..kv.layout.n_layer {
            let cells = if kv.layout.is_swa[il] {
                &plan.swa_cell
            } else {
                &plan.base_cell
            };
            for (&p, &c) in pos.iter().zip(cells) {
                let bytes = vec![(p % 251) as u8 + il as u8; row];
                kv.store
                    .write_rows(il, seq, c as usize, &bytes, &bytes)
                    .unwrap();
            }
        }
    }

    /// Everything of `seq` a later step can observe: bookkeeping and the rows of held cells.
    fn observe(kv: &KvCache, seq: u32) -> (String, Vec<Vec<u8>>) {
        let row = kv.layout.row_bytes();
        let rows = (0..kv.layout.n_layer)
            .flat_map(|il| {
                let cells = kv.cell_pos(seq, il);
                let n = cells.len();
                let (mut k, mut v) = (vec![0u8; n * row], vec![0u8; n * row]);
                kv.store.read_rows(il, seq, 0..n, &mut k, &mut v).unwrap();
                (0..n)
                    .filter(|&c| cells[c] != EMPTY)
                    .map(|c| [&k[c * row..(c + 1) * row], &v[c * row..(c + 1) * row]].concat())
                    .collect::<Vec<_>>()
            })
            .collect();
        (format!("{:?}", kv.streams[seq as usize]), rows)
    }

    /// A verification batch rolled back to its accepted prefix leaves exactly what one-token
    /// steps over that prefix leave, ring wraps included (the batch reuses ring cells whose old
    /// rows come back).
    #[test]
    fn rollback_after_a_verification_batch_equals_one_token_steps() {
        for placement in [Placement::LlamaCpp, Placement::Positional] {
            for start in [0u32, 5, 250, 253, 600] {
                for keep in 1..=8u32 {
                    let fresh = || {
                        let mut kv = KvCache::new(layout(), 1024, 1, 8)
                            .unwrap()
                            .with_placement(placement);
                        let mut p = 0;
                        while p < start {
                            let e = (p + 7).min(start);
                            put(&mut kv, 0, p..e);
                            p = e;
                        }
                        kv
                    };
                    let mut plain = fresh();
                    for p in start..start + keep {
                        put(&mut plain, 0, p..p + 1);
                    }
                    let mut spec = fresh();
                    let mark = spec.mark(0, 8).unwrap();
                    put(&mut spec, 0, start..start + 8);
                    spec.rollback(mark, keep).unwrap();
                    assert!(
                        observe(&spec, 0) == observe(&plain, 0),
                        "{placement:?} start {start} keep {keep}"
                    );
                    // and both go on the same way
                    put(&mut plain, 0, start + keep..start + keep + 3);
                    put(&mut spec, 0, start + keep..start + keep + 3);
                    assert!(
                        observe(&spec, 0) == observe(&plain, 0),
                        "then {start} {keep}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_rollback_that_does_not_match_the_cache_is_refused() {
        let mut kv = KvCache::new(layout(), 64, 1, 8).unwrap();
        put(&mut kv, 0, 0..4);
        assert!(kv.mark(0, 61).is_err());
        let mark = kv.mark(0, 4).unwrap();
        put(&mut kv, 0, 4..6);
        assert!(kv.rollback(mark, 2).is_err());
        assert_eq!(kv.seq_len(0), 6);
    }

    #[test]
    fn base_cells_fill_in_order_and_swa_ring_reuses_old_cells() {
        let mut kv = KvCache::new(layout(), 1024, 1, 8).unwrap();
        assert_eq!(kv.cell_pos(0, 1).len(), 256);
        fill(&mut kv, 0, 0..300, 1);
        assert_eq!(kv.seq_len(0), 300);
        let base = kv.cell_pos(0, 0);
        assert!((0..300).all(|i| base[i] == i as i32));
        // The ring wrapped: every SWA cell is in use, and the newest 4 positions are present.
        let swa = kv.cell_pos(0, 1);
        for p in 296..300 {
            assert!(swa.contains(&p));
        }
        assert_eq!(kv.streams[0].base.n_kv(), 512);
        assert_eq!(kv.streams[0].swa.n_kv(), 256);
    }

    #[test]
    fn positional_placement_equals_llama_cpp_in_order_and_keeps_positions_after_a_wrapped_truncation(
    ) {
        for chunk in [1, 3, 8] {
            let mut a = KvCache::new(layout(), 1024, 1, 8).unwrap();
            let mut b = KvCache::new(layout(), 1024, 1, 8)
                .unwrap()
                .with_placement(Placement::Positional);
            assert_eq!(b.placement(), Placement::Positional);
            fill(&mut a, 0, 0..700, chunk);
            fill(&mut b, 0, 0..700, chunk);
            for il in 0..2 {
                assert_eq!(
                    a.cell_pos(0, il),
                    b.cell_pos(0, il),
                    "chunk {chunk} layer {il}"
                );
            }
        }
        // Positions 250..260 sit in ring cells 250..255 and 0..3; dropping them makes
        // llama.cpp's search restart at cell 0, while the positional cache keeps p % 256.
        let mut a = KvCache::new(layout(), 1024, 1, 8).unwrap();
        let mut b = KvCache::new(layout(), 1024, 1, 8)
            .unwrap()
            .with_placement(Placement::Positional);
        for kv in [&mut a, &mut b] {
            fill(kv, 0, 0..260, 4);
            kv.truncate(0, 250);
            assert_eq!(kv.seq_len(0), 250);
            fill(kv, 0, 250..300, 5);
            assert!(kv.holds(0, 296..300));
        }
        assert_ne!(a.cell_pos(0, 1), b.cell_pos(0, 1));
        let ring = b.cell_pos(0, 1);
        assert!((250..300).all(|p| ring[p % 256] == p as i32));
        assert!((0..300).all(|p| b.cell_pos(0, 0)[p] == p as i32));
    }

    #[test]
    fn positional_placement_never_overwrites_a_key_still_in_the_window() {
        let lay = KvLayout {
            n_swa: 252,
            ..layout()
        };
        // n_ubatch 4: a ring of 256 cells.
        let mut kv = KvCache::new(lay, 1024, 1, 4)
            .unwrap()
            .with_placement(Placement::Positional);
        fill(&mut kv, 0, 0..300, 4);
        let before: Vec<Vec<i32>> = (0..2).map(|il| kv.cell_pos(0, il).to_vec()).collect();
        // 8 tokens at 300..308 would land on cells holding 44..51, of which 49..51 are still
        // within 252 positions of the sequence's end.
        let pos: Vec<u32> = (300..308).collect();
        let e = kv.place(&[(0, (0..8).collect())], &pos).unwrap_err();
        assert!(matches!(e, ModelError::KvFull { seq: 0, .. }), "{e}");
        for (il, b) in before.iter().enumerate() {
            assert_eq!(kv.cell_pos(0, il), &b[..]);
        }
        assert_eq!(kv.seq_len(0), 300);
    }

    /// The kept largest position and used-cell bound equal a scan of the cells after any mix
    /// of batches, truncations and clears, in both placements.
    #[test]
    fn cached_cell_bounds_follow_every_change() {
        let mut rng = 0x9e3779b97f4a7c15u64;
        let mut next = |n: u32| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as u32
        };
        for placement in [Placement::LlamaCpp, Placement::Positional] {
            let mut kv = KvCache::new(layout(), 300, 2, 8)
                .unwrap()
                .with_placement(placement);
            for _ in 0..3000 {
                let seq = next(2);
                match next(20) {
                    0 => kv.clear(seq),
                    1 => {
                        let len = kv.seq_len(seq);
                        kv.truncate(seq, next(len + 1));
                    }
                    _ => {
                        let p0 = kv.seq_len(seq);
                        let n = 1 + next(8);
                        if p0 + n <= 300 {
                            let pos: Vec<u32> = (p0..p0 + n).collect();
                            kv.place(&[(seq, (0..n as usize).collect())], &pos).unwrap();
                        } else {
                            kv.clear(seq);
                        }
                    }
                }
                for s in &kv.streams {
                    for c in [&s.base, &s.swa] {
                        let mut scanned = c.clone();
                        scanned.rescan();
                        assert_eq!((c.max, c.hi), (scanned.max, scanned.hi), "{placement:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn truncate_rolls_back_and_reuses_cells() {
        let mut kv = KvCache::new(layout(), 64, 2, 8).unwrap();
        fill(&mut kv, 1, 0..20, 7);
        kv.truncate(1, 10);
        assert_eq!(kv.seq_len(1), 10);
        assert_eq!(kv.seq_len(0), 0);
        fill(&mut kv, 1, 10..12, 2);
        assert_eq!(kv.cell_pos(1, 0)[10], 10);
        kv.clear(1);
        assert_eq!(kv.seq_len(1), 0);
    }

    #[test]
    fn cells_of_maps_each_position_to_its_first_cell() {
        // cells hold positions 7, 5, empty, 6, 5 (a duplicate); want 4..8
        let at = cells_of(&[7, 5, EMPTY, 6, 5], &(4..8));
        assert_eq!(at, vec![usize::MAX, 1, 3, 0]);
        assert!(cells_of(&[], &(0..0)).is_empty());
    }

    #[test]
    fn export_import_round_trip_keeps_window_rows() {
        let mut kv = KvCache::new(layout(), 64, 2, 8).unwrap();
        fill(&mut kv, 0, 0..10, 3);
        for il in 0..2 {
            let cells = kv.cell_pos(0, il).to_vec();
            let host = kv
                .store_mut()
                .as_any_mut()
                .downcast_mut::<HostKv>()
                .unwrap();
            let (k, v) = host.layer_mut(0, il);
            for (c, &p) in cells.iter().enumerate() {
                if p >= 0 {
                    k[c * 16..c * 16 + 4].copy_from_slice(&(p as f32).to_le_bytes());
                    v[c * 16..c * 16 + 4].copy_from_slice(&(-(p as f32)).to_le_bytes());
                }
            }
        }
        let snap = kv.export(0, 0..10).unwrap();
        assert_eq!(snap.layers[0].k.len(), 10 * 16);
        assert_eq!(snap.layer_positions(1), 6..10);
        assert_eq!(snap.layers[1].k.len(), 4 * 16);
        kv.import(1, &snap).unwrap();
        assert_eq!(kv.seq_len(1), 10);
        assert_eq!(kv.export(1, 0..10).unwrap(), snap);
        assert!(
            kv.import(1, &snap).is_err(),
            "a second import must start at position 10"
        );
    }

    /// A store that keeps rows elsewhere (as a device would): export and import go through
    /// the trait, so the snapshot equals the host cache's.
    #[derive(Debug)]
    struct Boxed(HostKv, usize);

    impl KvStore for Boxed {
        fn read_rows(
            &self,
            il: usize,
            seq: u32,
            cells: Range<usize>,
            k: &mut [u8],
            v: &mut [u8],
        ) -> Result<(), ModelError> {
            self.0.read_rows(il, seq, cells, k, v)
        }
        fn write_rows(
            &mut self,
            il: usize,
            seq: u32,
            first: usize,
            k: &[u8],
            v: &[u8],
        ) -> Result<(), ModelError> {
            self.1 += 1;
            self.0.write_rows(il, seq, first, k, v)
        }
        fn bytes(&self) -> usize {
            self.0.bytes()
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }

    #[test]
    fn snapshot_moves_between_stores() {
        let mut host = KvCache::new(layout(), 64, 1, 8).unwrap();
        fill(&mut host, 0, 0..10, 3);
        let mut x = 1u8;
        for il in 0..2 {
            let h = host
                .store_mut()
                .as_any_mut()
                .downcast_mut::<HostKv>()
                .unwrap();
            let (k, v) = h.layer_mut(0, il);
            k.iter_mut().chain(v.iter_mut()).for_each(|b| {
                x = x.wrapping_mul(31).wrapping_add(7);
                *b = x;
            });
        }
        let snap = host.export(0, 0..10).unwrap();
        let mut other = KvCache::with_store(layout(), 64, 2, 8, |l, c, n| {
            Ok(Box::new(Boxed(HostKv::new(l, c, n)?, 0)))
        })
        .unwrap();
        other.import(1, &snap).unwrap();
        let writes = other.store().as_any().downcast_ref::<Boxed>().unwrap().1;
        // Two ubatch steps of consecutive cells: one write per layer per step.
        assert_eq!(writes, 4);
        assert_eq!(other.export(1, 0..10).unwrap(), snap);
        assert_eq!(
            other.export(1, 6..10).unwrap(),
            host.export(0, 6..10).unwrap()
        );
    }
}
