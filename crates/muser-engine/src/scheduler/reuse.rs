//! Prefix reuse: a slot's K/V from its own prefix, the prompt cache or a producer, and back.

use std::sync::Arc;

use super::{Row, Scheduler};
use crate::engine::{contained, GenerateRequest};
use crate::kvpack_bridge::{snapshot_to_state, state_to_snapshot};
use crate::prompt_cache::Resume;

impl Scheduler<'_> {
    /// Installs a producer's K/V of `prompt[state.positions]` on the slot, which holds the
    /// prompt's first `have` tokens. Returns the tokens the slot now holds, or `None` when it
    /// is unchanged (the state is not longer than what the slot has, or a delta's base is
    /// not on this slot).
    pub(super) fn install(
        &mut self,
        slot: usize,
        p: Arc<crate::engine::Prefilled>,
        prompt: &[u32],
        have: usize,
        producer: &mut Option<Arc<str>>,
    ) -> Option<usize> {
        let p = Arc::try_unwrap(p).unwrap_or_else(|p| crate::engine::Prefilled {
            state: p.state.clone(),
            producer: p.producer.clone(),
            took: p.took,
            foreign_abi: p.foreign_abi,
        });
        let r = p.state.positions.clone();
        let (base, n) = (r.start as usize, r.end as usize);
        let seq = slot as u32;
        if n <= have || n >= prompt.len() || base > have || !self.holds_window(seq, base) {
            tracing::info!(
                producer = %p.producer,
                "prefill lane: the slot does not hold the delta's base; computing the prompt here"
            );
            return None;
        }
        let snap = match state_to_snapshot(p.state, self.kv.layout()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "prefill lane: the state does not fit the cache");
                return None;
            }
        };
        if base == 0 {
            self.kv.clear(seq);
        } else {
            self.kv.truncate(seq, base as u32);
        }
        let s = &mut self.slots[slot];
        s.tokens.truncate(base);
        match self.kv.import(seq, &snap) {
            Ok(()) => {
                s.tokens.extend_from_slice(&prompt[base..n]);
                s.foreign |= p.foreign_abi;
                *producer = Some(p.producer);
                Some(n)
            }
            Err(e) => {
                tracing::warn!(error = %e, "prefill lane: importing the state failed");
                self.kv.clear(seq);
                s.tokens.clear();
                s.foreign = false;
                Some(0)
            }
        }
    }

    /// Whether a token at position `at` finds every row it attends to in the slot.
    fn holds_window(&self, seq: u32, at: usize) -> bool {
        self.kv.holds_window(seq, at as u32)
    }

    /// Imports a prefix of `prompt` resumed from the prompt cache into the slot when it is
    /// longer than the slot's own `have` tokens. Returns the tokens the slot now holds, or
    /// `None` when it is unchanged.
    pub(super) fn resume(
        &mut self,
        slot: usize,
        r: Resume,
        prompt: &[u32],
        have: usize,
    ) -> Option<usize> {
        let n = r.state.positions.end as usize;
        if n <= have || n >= prompt.len() {
            return None;
        }
        let snap = match state_to_snapshot(r.state, self.kv.layout()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "prompt cache: resumed state does not fit the cache");
                return None;
            }
        };
        let seq = slot as u32;
        self.kv.clear(seq);
        self.slots[slot].foreign = false;
        let tokens = &mut self.slots[slot].tokens;
        tokens.clear();
        match self.kv.import(seq, &snap) {
            Ok(()) => {
                tokens.extend_from_slice(&prompt[..n]);
                Some(n)
            }
            Err(e) => {
                tracing::warn!(error = %e, "prompt cache: importing a resumed prefix failed");
                self.kv.clear(seq);
                Some(0)
            }
        }
    }

    /// Offers the slot's first `n` tokens' K/V to the prompt cache (when the cache holds every
    /// row an export needs). True when offered.
    pub(super) fn offer(&mut self, slot: usize, n: usize) -> bool {
        let Some(pc) = self.cfg.prompt_cache.clone() else {
            return false;
        };
        let seq = slot as u32;
        if n == 0 || self.slots[slot].foreign || !self.kv.holds(seq, 0..n as u32) {
            return false;
        }
        let exported = contained(|| {
            let snap = self
                .kv
                .export(seq, 0..n as u32)
                .map_err(|e| e.to_string())?;
            let tokens = self.slots[slot].tokens[..n].to_vec();
            pc.offer(tokens, snapshot_to_state(snap));
            Ok::<_, String>(())
        });
        match exported {
            Ok(Ok(())) => true,
            Ok(Err(e)) | Err(e) => {
                tracing::debug!(error = %e, "prompt cache: export");
                false
            }
        }
    }

    /// Offers the prefixes of prefills that just reached their publish cut.
    pub(super) fn offer_prefixes(&mut self, rows: &[Row]) {
        if self.cfg.prompt_cache.is_none() {
            return;
        }
        let mut touched: Vec<usize> = rows.iter().map(|r| r.slot).collect();
        touched.dedup();
        for slot in touched {
            let s = &self.slots[slot];
            let Some(t) = &s.task else { continue };
            let Some(cut) = t.publish_at.filter(|&c| c == s.tokens.len()) else {
                continue;
            };
            let offered = self.offer(slot, cut);
            if let Some(t) = &mut self.slots[slot].task {
                t.publish_at = None;
                if offered {
                    t.published = cut;
                }
            }
        }
    }

    /// How many leading prompt tokens the slot's cache can serve. At least one prompt token is
    /// always processed (its logits start the generation). For sliding-window models a cache
    /// cut back below its end is used only if the window before the cut is still stored.
    pub(super) fn reusable_prefix(&self, slot: usize, req: &GenerateRequest) -> usize {
        if !req.cache_prompt {
            return 0;
        }
        let cached = &self.slots[slot].tokens;
        let keep = common_prefix(cached, &req.prompt).min(req.prompt.len() - 1);
        if keep == 0 || keep == cached.len() || self.holds_window(slot as u32, keep) {
            keep
        } else {
            0
        }
    }
}

pub(super) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
