//! The DFlash drafter's driver: one draft cache per sequence, fed with the target's layer
//! inputs after every target batch, asked for a block after each sequence's last token
//! (docs/speculative.md, "The DFlash drafter"). The drafter itself is
//! `muser_model::models::dflash`.

use std::sync::Arc;

use muser_model::models::dflash::{Dflash, DraftContext};
use muser_model::{Batch, Model, ModelError, Output};

/// A drafter and the draft caches of `n_seq` sequences.
pub struct DflashDrafter {
    model: Arc<Dflash>,
    ctx: Vec<DraftContext>,
}

impl DflashDrafter {
    pub fn new(model: Arc<Dflash>, n_seq: usize) -> DflashDrafter {
        let ctx = (0..n_seq).map(|_| model.new_context()).collect();
        DflashDrafter { model, ctx }
    }

    /// The target layers whose inputs every target batch must capture
    /// ([`Batch::capture_layers`]).
    pub fn target_layers(&self) -> &[u32] {
        &self.model.info().target_layers
    }

    /// Most drafts one block gives.
    pub fn max_drafts(&self) -> usize {
        self.model.info().block_size as usize - 1
    }

    /// Injects the features of a target batch that captured [`DflashDrafter::target_layers`]:
    /// each sequence's rows (in batch order, ascending positions) replace what its cache held
    /// from their first position on. A sequence whose rows cannot be injected starts over
    /// empty (its drafts get worse, never wrong: the target verifies them).
    pub fn observe(&mut self, batch: &Batch, out: &Output) {
        let w = self.model.feature_width();
        if out.layer_inp.len() != batch.len() * w {
            return;
        }
        for (seq, ctx) in self.ctx.iter_mut().enumerate() {
            let rows: Vec<usize> = (0..batch.len())
                .filter(|&r| batch.seq[r] == seq as u32)
                .collect();
            let Some(&first) = rows.first() else {
                continue;
            };
            ctx.truncate(batch.pos[first]);
            let pos: Vec<u32> = rows.iter().map(|&r| batch.pos[r]).collect();
            let features: Vec<f32> = rows
                .iter()
                .flat_map(|&r| &out.layer_inp[r * w..(r + 1) * w])
                .copied()
                .collect();
            if self.model.inject(ctx, &pos, &features).is_err() {
                *ctx = self.model.new_context();
            }
        }
    }

    /// Up to `n` drafts to follow `id_last`, the token about to be decoded at `pos0` in
    /// sequence `seq`, from the target states before `pos0`.
    pub fn propose(
        &mut self,
        target: &Model,
        seq: u32,
        id_last: u32,
        pos0: u32,
        n: usize,
    ) -> Result<Vec<u32>, ModelError> {
        let n = n.min(self.max_drafts());
        let Some(ctx) = self.ctx.get_mut(seq as usize) else {
            return Err(ModelError::BadBatch(format!(
                "no draft cache for sequence {seq}"
            )));
        };
        ctx.truncate(pos0);
        if n == 0 || ctx.is_empty() {
            return Ok(Vec::new());
        }
        self.model.draft(target, ctx, id_last, pos0, n)
    }
}
