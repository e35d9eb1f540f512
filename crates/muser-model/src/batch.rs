//! A forward pass's rows in and out: [`Batch`] and [`Output`].

/// Tokens to run through the model: token `i` of sequence `seq[i]` at position `pos[i]`; its
/// logits are returned when `logits[i]`. Within a sequence, positions must continue the cache
/// (`kv.seq_len(seq)`, `+1`, ...) in batch order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub pos: Vec<u32>,
    pub seq: Vec<u32>,
    pub logits: Vec<bool>,
    /// Also return the final-norm hidden state of the output rows.
    pub embeddings: bool,
    /// Empty, or per token: the caller needs only the argmax of this output row (the highest
    /// logit, the lowest id on a tie, NaN as -inf). A forward pass may then answer the row with
    /// that token in [`Output::argmax`] instead of its logits (the fused CUDA decode step
    /// does: its graph already takes the argmax, so 4 bytes cross instead of the whole row);
    /// others return the logits as usual.
    pub argmax_only: Vec<bool>,
    /// Rows given as embeddings instead of token embeddings (an image's rows).
    pub input_embd: InputEmbd,
    /// Sequences whose rows are each computed as a one-row batch at the same position
    /// computes it (the kernels a lone row takes, its view of the cache), so that their logits
    /// and K/V equal one-token steps bit for bit whatever else the batch holds: speculative
    /// verification. Only where [`Model::computes_rows_alone`]; a batch asking elsewhere is
    /// refused.
    pub lone_seqs: Vec<u32>,
    /// Layers whose input (the residual stream entering the layer, llama.cpp's
    /// `t_layer_inp`) to return for every row of the batch, in this order
    /// ([`Output::layer_inp`]): the target features a DFlash drafter reads. Empty: nothing is
    /// copied.
    pub capture_layers: Vec<u32>,
}

/// Batch rows whose input is an embedding (`n_embd` values each, e.g. an image encoder's
/// output) rather than their token's row of the embedding table; their token ids are ignored.
/// The architecture treats the row as it treats a token embedding from there on (Muse
/// Glimmer RMS-normalizes it, as llama.cpp does for multimodal rows).
#[derive(Clone, Debug, Default)]
pub struct InputEmbd {
    /// Batch rows, ascending.
    pub rows: Vec<usize>,
    /// `rows.len() × n_embd` values, row by row.
    pub values: Vec<f32>,
}

impl InputEmbd {
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// Equal when the same rows hold the same bits.
impl PartialEq for InputEmbd {
    fn eq(&self, other: &InputEmbd) -> bool {
        self.rows == other.rows
            && self.values.len() == other.values.len()
            && self
                .values
                .iter()
                .zip(&other.values)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

impl Eq for InputEmbd {}

impl Batch {
    /// `tokens` of one sequence starting at `start_pos`; logits for every token, or only the
    /// last when `last_logits_only`.
    pub fn single(seq: u32, tokens: &[u32], start_pos: u32, last_logits_only: bool) -> Batch {
        let n = tokens.len();
        Batch {
            tokens: tokens.to_vec(),
            pos: (0..n as u32).map(|i| start_pos + i).collect(),
            seq: vec![seq; n],
            logits: (0..n).map(|i| !last_logits_only || i + 1 == n).collect(),
            embeddings: false,
            argmax_only: Vec::new(),
            input_embd: InputEmbd::default(),
            lone_seqs: Vec::new(),
            capture_layers: Vec::new(),
        }
    }

    /// Append one token.
    pub fn push(&mut self, token: u32, pos: u32, seq: u32, logits: bool) {
        self.tokens.push(token);
        self.pos.push(pos);
        self.seq.push(seq);
        self.logits.push(logits);
        if !self.argmax_only.is_empty() {
            self.argmax_only.push(false);
        }
    }

    /// Append one token whose output the caller needs only as its argmax
    /// ([`Batch::argmax_only`]).
    pub fn push_argmax(&mut self, token: u32, pos: u32, seq: u32) {
        self.push(token, pos, seq, true);
        self.argmax_only.resize(self.tokens.len(), false);
        if let Some(last) = self.argmax_only.last_mut() {
            *last = true;
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// Results of a forward pass, one row per batch entry with `logits[i] == true`, in batch order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Output {
    /// `n_out × n_vocab`.
    pub logits: Vec<f32>,
    /// `n_out × n_embd` when the batch asked for embeddings, else empty.
    pub embeddings: Vec<f32>,
    /// Batch indices of the rows, in order.
    pub rows: Vec<usize>,
    /// (batch index, token) of the output rows answered by their argmax instead of logits
    /// (only rows marked in [`Batch::argmax_only`]; they are not in `rows`).
    pub argmax: Vec<(usize, u32)>,
    /// `n_tokens × capture_layers.len() × n_embd`: for every batch row (output or not), the
    /// inputs of [`Batch::capture_layers`] side by side.
    pub layer_inp: Vec<f32>,
}

impl Output {
    /// Logits of output row `r`.
    pub fn row(&self, r: usize, n_vocab: usize) -> &[f32] {
        &self.logits[r * n_vocab..(r + 1) * n_vocab]
    }
}
