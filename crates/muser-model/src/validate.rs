//! The checks around a forward pass: the batch and its K/V placement before, the answer after.

use crate::models::Prepared;
use crate::{Batch, FusedOutput, KvCache, Model, ModelError};

impl Model {
    pub(crate) fn prepare(&self, kv: &mut KvCache, b: &Batch) -> Result<Prepared, ModelError> {
        let n = b.tokens.len();
        if n == 0 {
            return Err(ModelError::BadBatch("empty batch".into()));
        }
        if b.pos.len() != n || b.seq.len() != n || b.logits.len() != n {
            return Err(ModelError::BadBatch(
                "tokens, pos, seq and logits differ in length".into(),
            ));
        }
        if !b.argmax_only.is_empty() {
            if b.argmax_only.len() != n {
                return Err(ModelError::BadBatch(
                    "argmax_only is neither empty nor one flag per token".into(),
                ));
            }
            if let Some(i) = (0..n).find(|&i| b.argmax_only[i] && !b.logits[i]) {
                return Err(ModelError::BadBatch(format!(
                    "token {i} asks for its argmax but not for an output"
                )));
            }
        }
        if let Some(&l) = b
            .capture_layers
            .iter()
            .find(|&&l| l as usize >= self.info.n_layer)
        {
            return Err(ModelError::BadBatch(format!(
                "layer {l}'s input cannot be captured: the model has {} layers",
                self.info.n_layer
            )));
        }
        if n > kv.n_ubatch() as usize {
            return Err(ModelError::BadBatch(format!(
                "{n} tokens exceed the cache's batch limit {}",
                kv.n_ubatch()
            )));
        }
        if *kv.layout() != self.kv_layout(kv.layout().dtype) {
            return Err(ModelError::BadBatch(
                "the KV cache was made for another model".into(),
            ));
        }
        self.exec.accepts(kv)?;
        let mut groups: Vec<(u32, Vec<usize>)> = Vec::new();
        for i in 0..n {
            let (tok, seq, pos) = (b.tokens[i], b.seq[i], b.pos[i]);
            if tok as usize >= self.info.n_vocab && b.input_embd.rows.binary_search(&i).is_err() {
                return Err(ModelError::BadBatch(format!(
                    "token {tok} >= n_vocab {}",
                    self.info.n_vocab
                )));
            }
            if seq as usize >= kv.n_seq() {
                return Err(ModelError::BadBatch(format!(
                    "seq {seq} >= n_seq {}",
                    kv.n_seq()
                )));
            }
            if pos >= kv.n_ctx() {
                return Err(ModelError::BadBatch(format!(
                    "position {pos} >= n_ctx {}",
                    kv.n_ctx()
                )));
            }
            match groups.iter_mut().find(|(s, _)| *s == seq) {
                Some((_, idx)) => {
                    let prev = b.pos[*idx.last().unwrap_or(&i)];
                    if pos != prev + 1 {
                        return Err(ModelError::BadBatch(format!(
                            "seq {seq}: position {pos} does not follow {prev}"
                        )));
                    }
                    idx.push(i);
                }
                None => {
                    let next = kv.seq_len(seq);
                    if pos != next {
                        return Err(ModelError::BadBatch(format!(
                            "seq {seq}: first position {pos} but the cache holds {next}"
                        )));
                    }
                    groups.push((seq, vec![i]));
                }
            }
        }
        let ie = &b.input_embd;
        if !ie.is_empty() && !self.exec.takes_input_embd() {
            return Err(ModelError::BadBatch(
                "this fused forward takes no embedding rows (images)".into(),
            ));
        }
        if ie.rows.windows(2).any(|w| w[0] >= w[1])
            || ie.rows.last().is_some_and(|&r| r >= n)
            || ie.values.len() != ie.rows.len() * self.info.n_embd
        {
            return Err(ModelError::BadBatch(format!(
                "embedding rows must ascend within the batch and hold {} values each",
                self.info.n_embd
            )));
        }
        if !b.lone_seqs.is_empty() && !self.exec.computes_rows_alone() {
            return Err(ModelError::BadBatch(
                "this backend cannot compute a sequence's rows alone (lone_seqs)".into(),
            ));
        }
        if let Some(s) = b.lone_seqs.iter().find(|&&s| s as usize >= kv.n_seq()) {
            return Err(ModelError::BadBatch(format!(
                "lone seq {s} >= n_seq {}",
                kv.n_seq()
            )));
        }
        let alone: Vec<bool> = groups
            .iter()
            .map(|(seq, _)| b.lone_seqs.contains(seq))
            .collect();
        let lone = match alone.iter().any(|&a| a) {
            true => b.seq.iter().map(|s| b.lone_seqs.contains(s)).collect(),
            false => Vec::new(),
        };
        let out_rows: Vec<usize> = (0..n).filter(|&i| b.logits[i]).collect();
        let plan = kv.place(&groups, &b.pos, &alone)?;
        Ok(Prepared {
            groups,
            plan,
            out_rows,
            lone,
        })
    }

    /// A forward pass's answer covers the batch's output rows exactly once (logits rows in
    /// order, argmax only where it was asked for) with buffers of the right sizes.
    pub(crate) fn check_answer(
        &self,
        batch: &Batch,
        out_rows: &[usize],
        a: &FusedOutput,
    ) -> Result<(), ModelError> {
        let bad = |what: &str| Err(ModelError::Device(format!("the forward pass {what}")));
        let (v, e) = (self.info.n_vocab, self.info.n_embd);
        if a.logits.len() != a.rows.len() * v {
            return bad("returned logits of the wrong size");
        }
        if a.hidden.len()
            != if batch.embeddings {
                a.rows.len() * e
            } else {
                0
            }
        {
            return bad("returned hidden states of the wrong size");
        }
        if a.rows.windows(2).any(|w| w[0] >= w[1]) {
            return bad("returned rows out of order");
        }
        for &(i, t) in &a.argmax {
            if !batch.argmax_only.get(i).copied().unwrap_or(false) || t as usize >= v {
                return bad("answered a row with an argmax it was not asked for");
            }
        }
        let mut got = a.rows.to_vec();
        got.extend(a.argmax.iter().map(|&(i, _)| i));
        got.sort_unstable();
        if got != out_rows {
            return bad("did not answer exactly the output rows");
        }
        Ok(())
    }
}
