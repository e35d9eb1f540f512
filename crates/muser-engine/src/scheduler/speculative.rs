//! Speculative decoding: a slot's drafts, their verification row by row, and the rollback.
//!
//! A generating slot may follow its decode token with draft tokens (muser-spec). Every row is
//! sampled in order as a plain step would sample it; a draft is accepted while it equals the
//! token sampled before it, the first token that differs (or the token after the last draft) is
//! the bonus, and the cache rolls back to the accepted prefix
//! ([`KvCache::rollback`](muser_model::KvCache::rollback)). Sampling from the target and
//! comparing is speculative rejection sampling for a drafter that proposes one token with
//! certainty: a draft `d` is accepted with probability `p(d)`, and the emitted token is
//! distributed as `p`. A verifying slot's rows are computed alone (`Batch::lone_seqs`: each row
//! with the kernels and the view of the cache of a one-token step at its position), so
//! verification never changes a token; drafts are made only where the model can
//! (`Model::computes_rows_alone`).

use muser_model::{Batch, KvMark};
use muser_spec::SpecMode;

use super::{Answer, Scheduler, Slot, Verify};
use crate::engine::contained;

impl Scheduler<'_> {
    /// Draft tokens to follow slot `i`'s decode token `id`: at most `room`, none past the
    /// context or the request's token budget, and none from an end-of-generation token on.
    pub(super) fn drafts(&mut self, i: usize, id: u32, room: usize) -> Vec<u32> {
        let (n_ctx, tok) = (self.cfg.n_ctx, self.tok);
        let row_cost = self.row_cost.row_ratio();
        let Slot { tokens, task, .. } = &mut self.slots[i];
        let (model, dflash) = (&self.model, &mut self.dflash);
        let Some(t) = task else {
            return Vec::new();
        };
        let Some(d) = &mut t.drafting else {
            return Vec::new();
        };
        // a verification emits up to one token more than it drafts
        let left = t
            .req
            .max_tokens
            .map_or(usize::MAX, |m| (m as usize).saturating_sub(t.n_gen + 1));
        let room = room.min(left).min(n_ctx.saturating_sub(tokens.len() + 1));
        if room == 0 {
            return Vec::new();
        }
        let mut drafts = match (d.mode(), dflash) {
            (SpecMode::Dflash, Some(df)) => {
                let pos = tokens.len() as u32;
                d.propose_with(room, row_cost, |max| {
                    // a failed draft is no draft: the slot decodes plainly this step
                    df.propose(model, i as u32, id, pos, max)
                        .unwrap_or_default()
                })
            }
            _ => {
                tokens.push(id);
                let drafts = d.propose(tokens, room, row_cost);
                tokens.pop();
                drafts
            }
        };
        // a draft never names an image row (it lies outside the vocabulary)
        if let Some(i) = drafts.iter().position(|&t| t >= crate::IMAGE_ID_BASE) {
            drafts.truncate(i);
        }
        // no draft is an end of generation: the row before it samples that token itself, and
        // the rows from it on would be verified for nothing (the n-gram drafter copies the
        // chat template's turn ends, and the next turn's header, from the prompt)
        if let Some(i) = drafts
            .iter()
            .position(|&t| tok.is_some_and(|tk| tk.is_eog(t)))
        {
            drafts.truncate(i);
        }
        drafts
    }

    /// Samples a speculating slot's rows in order: each draft is taken while it equals the
    /// token sampled before it; the first token that differs, or the one after the last
    /// draft, ends the step, and the cache rolls back to what was taken.
    pub(super) fn verify(
        &mut self,
        v: Verify,
        batch: &Batch,
        slot: usize,
        answers: &[Option<Answer>],
    ) {
        let Verify {
            first,
            n_drafts,
            mark,
        } = v;
        let mut mark = Some(mark);
        self.stats.draft_verifications_total += 1;
        self.stats.draft_tokens_total += n_drafts as u64;
        if let Some(t) = &mut self.slots[slot].task {
            t.draft_n += n_drafts;
        }
        let handled = contained(|| {
            for j in 0..=n_drafts {
                let Some(answer) = answers[first + j] else {
                    break;
                };
                let Some(t) = &mut self.slots[slot].task else {
                    break;
                };
                let sampled = t.pick(answer);
                let next = (j < n_drafts).then(|| batch.tokens[first + j + 1]);
                let takes = next == Some(sampled.id);
                if !takes {
                    self.settle(slot, &mut mark, n_drafts, j);
                }
                self.emit(slot, sampled);
                if !takes {
                    break;
                }
                if self.slots[slot].task.is_none() {
                    // the request ended on this token: the draft equal to it stays out
                    self.settle(slot, &mut mark, n_drafts, j);
                    break;
                }
                if let Some(id) = next {
                    self.slots[slot].tokens.push(id);
                    self.stats.draft_accepted_total += 1;
                    if let Some(t) = &mut self.slots[slot].task {
                        t.draft_n_accepted += 1;
                    }
                }
            }
        });
        match handled {
            Err(msg) => self.fail(slot, &format!("sampling failed: {msg}")),
            Ok(()) if mark.is_some() => self.fail(slot, "speculative verification ended early"),
            Ok(()) => {}
        }
    }

    /// Ends a verification with `accepted` of `n_drafts` drafts taken: tells the slot's gate
    /// and rolls the slot's cache back to its decode token and those drafts.
    fn settle(&mut self, slot: usize, mark: &mut Option<KvMark>, n_drafts: usize, accepted: usize) {
        let Some(mark) = mark.take() else {
            return;
        };
        let row_cost = self.row_cost.row_ratio();
        if let Some(d) = self.slots[slot]
            .task
            .as_mut()
            .and_then(|t| t.drafting.as_mut())
        {
            d.record(n_drafts, accepted, row_cost);
        }
        if let Err(e) = self.kv.rollback(mark, 1 + accepted as u32) {
            self.fail(slot, &format!("speculative rollback failed: {e}"));
        }
    }
}
