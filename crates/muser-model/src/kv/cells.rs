//! One sub-cache's cell bookkeeping for one sequence (llama.cpp's `llama_kv_cells`): which
//! position each cell holds, where new positions go, what a window frees.

use super::Placement;
use std::ops::Range;

/// The cell holding each position of `want` (`usize::MAX` where none does), in one pass
/// over the cells: a 131k-token export looks up every position of every layer.
pub(super) fn cells_of(cells: &[i32], want: &Range<u32>) -> Vec<usize> {
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

pub(super) const EMPTY: i32 = -1;
pub(super) const PAD: u32 = 256;

/// Cell bookkeeping of one sub-cache of one stream (llama.cpp's `llama_kv_cells` for one seq).
#[derive(Clone, Debug)]
pub(super) struct Cells {
    pub(super) pos: Vec<i32>,
    pub(super) head: u32,
    pub(super) used: u32,
    /// Window for cell reuse; 0 for the base cache (never reuses occupied cells).
    pub(super) n_swa: u32,
    pub(super) placement: Placement,
    /// The largest stored position (EMPTY when none) and one past the last used cell: kept
    /// up to date so that a decode step costs no scan of a long cache.
    pub(super) max: i32,
    pub(super) hi: u32,
}

impl Cells {
    pub(super) fn new(size: u32, n_swa: u32, placement: Placement) -> Cells {
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

    pub(super) fn size(&self) -> u32 {
        self.pos.len() as u32
    }

    pub(super) fn pos_max(&self) -> i32 {
        self.max
    }

    pub(super) fn pos_min(&self) -> i32 {
        self.pos
            .iter()
            .copied()
            .filter(|&p| p >= 0)
            .min()
            .unwrap_or(EMPTY)
    }

    pub(super) fn used_max_p1(&self) -> u32 {
        self.hi
    }

    /// Recomputes `max` and `hi` from the cells (after cells were freed).
    pub(super) fn rescan(&mut self) {
        self.max = self.pos.iter().copied().max().unwrap_or(EMPTY);
        self.hi = self
            .pos
            .iter()
            .rposition(|&p| p >= 0)
            .map_or(0, |i| i as u32 + 1);
    }

    /// Cells the attention kernels look at: llama.cpp pads this to 256 so graphs stay constant.
    pub(super) fn n_kv(&self) -> u32 {
        self.n_kv_for(self.used_max_p1())
    }

    /// [`Cells::n_kv`] once the cells up to `hi` (one past the last) are used.
    pub(super) fn n_kv_for(&self, hi: u32) -> u32 {
        let padded = hi.div_ceil(PAD) * PAD;
        self.size().min(PAD.max(padded))
    }

    pub(super) fn masked_swa(&self, p0: i32, p1: i32) -> bool {
        self.n_swa > 0 && p1 - p0 >= self.n_swa as i32
    }

    /// The cells `positions` of one sequence would take (llama.cpp's `find_slot`,
    /// non-contiguous, or by position), changing nothing; None when they do not fit.
    pub(super) fn find(&self, positions: &[i32]) -> Option<Vec<u32>> {
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
    pub(super) fn apply(&mut self, idxs: &[u32], positions: &[i32]) {
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
    pub(super) fn positional_slot(&self, positions: &[i32]) -> Option<Vec<u32>> {
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
    pub(super) fn find_slot(&self, n: u32) -> Option<Vec<u32>> {
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
    pub(super) fn remove(&mut self, p0: i32, p1: i32) {
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

    pub(super) fn clear(&mut self) {
        self.pos.fill(EMPTY);
        self.head = 0;
        self.used = 0;
        self.max = EMPTY;
        self.hi = 0;
    }
}
