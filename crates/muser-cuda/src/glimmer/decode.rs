//! One decode step of the fused forward (every sequence one token), its capture as CUDA graphs
//! (one per kernel variant) and the generation loops that replay them.

use super::{CudaGlimmer, Layer, Result, HEAD_DIM};
use crate::runtime::Arg;
use crate::CudaError;

impl CudaGlimmer {
    /// Enqueues one decode step for `nb` sequences: sequence b's token in `tokens[b]` at
    /// `pos[b]`; the greedy next token lands in `tokens[b]`, and when `advance`, `pos[b]`
    /// advances and `history[b][pos]` records it. Reads nothing from the host, so it can be
    /// captured into a graph. `at` (a position at least the latest one's variant threshold)
    /// picks the attention kernels ([`crate::plan::DecodePlan::attention`]); every choice gives
    /// the same result up to rounding.
    ///
    /// The steps of `models/muse_glimmer.rs`, each norm fused with the residual add before it
    /// and with the int8 quantization of the GEMV after it: the residual stream moves to `x2`
    /// and back within a layer, so no norm updates it in place and the norms run in slices.
    pub(super) fn enqueue_decode(&self, nb: usize, advance: bool, at: usize) -> Result<()> {
        let s = &self.s;
        self.tok_embd
            .get_rows(&self.gpu, s.tokens.ptr(), nb, s.x.ptr())?;
        // Embedding RMSNorm (no weight), in place; then layer 0's attention norm.
        self.norm(nb, s.x.ptr(), (0, 1), None, 0, s.x.ptr(), 0, false)?;
        let first = self.layers[0].attn_norm.ptr();
        self.norm(nb, s.x.ptr(), (0, 1), None, first, s.hf.ptr(), 0, true)?;
        for (il, l) in self.layers.iter().enumerate() {
            self.attention_block(il, l, nb, at)?;
            self.ffn_block(il, l, nb)?;
        }
        let g = &self.gpu;
        self.output
            .gemv(g, nb, self.qact(), s.hf.ptr(), s.logits.ptr())?;
        self.finish_logits(nb, advance)
    }

    /// The attention block of layer `il` (its input norm ran before): QKV and gate projection,
    /// Q/K norm + RoPE + K/V store + attention + gate (one kernel), output projection, then the
    /// post-attention norm with the residual add and the FFN's input norm.
    fn attention_block(&self, il: usize, l: &Layer, nb: usize, at: usize) -> Result<()> {
        let (g, s, qa) = (&self.gpu, &self.s, self.qact());
        l.qkvg.gemv(g, nb, qa, s.hf.ptr(), s.y_qkvg.ptr())?;
        self.attention(il, l, nb, at)?;
        l.wo.gemv(g, nb, qa, s.hf.ptr(), s.y_o.ptr())?;
        let post = Some((s.y_o.ptr(), l.post_attn_norm.ptr(), 1e-8));
        let to = (s.x2.ptr(), self.plan.norm_slices);
        let w = l.ffn_norm.ptr();
        self.norm(nb, s.x.ptr(), to, post, w, s.hf.ptr(), 0, true)
    }

    /// The FFN block of layer `il`: gate and up projection, SwiGLU, down projection, then the
    /// post-FFN norm with the residual add and the next layer's (or the output) norm.
    fn ffn_block(&self, il: usize, l: &Layer, nb: usize) -> Result<()> {
        let (g, s, qa) = (&self.gpu, &self.s, self.qact());
        l.gate_up.gemv(g, nb, qa, s.hf.ptr(), s.y_gu.ptr())?;
        let block = self.plan.swiglu_block as usize;
        self.swiglu(l, nb, block, (s.hf.ptr(), 0), Some(qa))?;
        l.down.gemv(g, nb, qa, s.hf.ptr(), s.y_d.ptr())?;
        let next = match self.layers.get(il + 1) {
            Some(n) => n.attn_norm.ptr(),
            None => self.output_norm.ptr(),
        };
        let post = Some((s.y_d.ptr(), l.post_ffw_norm.ptr(), 1e-8));
        let to = (s.x.ptr(), self.plan.norm_slices);
        self.norm(nb, s.x2.ptr(), to, post, next, s.hf.ptr(), 0, true)
    }

    /// Layer `il`'s decode attention as the plan says for position `at`: one kernel that
    /// normalizes and rotates Q and K, stores K and V, attends and gates the output into the
    /// output projection's int8 activations (or leaves split records that `attn_combine_gate`
    /// merges and gates).
    fn attention(&self, il: usize, l: &Layer, nb: usize, at: usize) -> Result<()> {
        let (i, s, qa) = (&self.info, &self.s, self.qact());
        let a = self.plan.attention(self.kind(il), at);
        let (nq, nkv) = (i.n_head, i.n_head_kv);
        let ld = 2 * nq * HEAD_DIM + 2 * nkv * HEAD_DIM;
        let mut args = vec![
            Arg::P(s.y_qkvg.ptr()),
            Arg::L(ld as i64),
            Arg::I(nq as i32),
            Arg::I(nkv as i32),
            Arg::P(l.q_norm.ptr()),
            Arg::P(l.k_norm.ptr()),
            Arg::F(i.rms_eps),
            Arg::P(s.pos.ptr()),
            Arg::I(i.is_swa[il] as i32),
            Arg::F(self.theta_scale()),
            Arg::P(l.k_cache),
            Arg::P(l.v_cache),
            Arg::L(self.slot_stride(l) as i64),
            Arg::P(s.slots.ptr()),
            Arg::I(self.window(il)),
            Arg::F(i.attn_scale),
            Arg::P(s.part.ptr()),
            Arg::I(a.splits as i32),
            Arg::I(a.min_keys as i32),
        ];
        if !a.per_group {
            // The per-head kernel's split counters (the last split merges).
            args.push(Arg::P(s.attn_cnt.ptr()));
        }
        if !a.combine {
            args.extend([Arg::P(s.hf.ptr()), Arg::P(qa.q), Arg::P(qa.d), Arg::P(qa.s)]);
        }
        args.push(Arg::I(l.ring as i32));
        let blocks = if a.per_group { nkv } else { nq };
        let grid = (blocks as u32, nb as u32, a.splits);
        if a.cluster > 0 {
            self.gpu
                .launch_cluster(a.kernel, grid, a.block, a.cluster, &args)?;
        } else {
            self.gpu.launch(a.kernel, grid, a.block, &args)?;
        }
        if a.combine {
            self.combine_gate(il, nb, a.splits as usize, a.min_keys as usize)?;
        }
        Ok(())
    }

    /// One decode step: `token` at `pos`; returns the logits (after scale and softcap) and the
    /// greedy next token.
    pub fn decode(&mut self, token: u32, pos: usize) -> Result<(Vec<f32>, u32)> {
        self.check_pos(pos, 1)?;
        self.upload_step(&[token], &[pos])?;
        self.enqueue_decode(1, false, pos)?;
        self.read_logits()
    }

    /// Uploads a decode step's inputs (row b: `tokens[b]` at `pos[b]`); returns the latest
    /// position, which picks the graph variant.
    pub(super) fn upload_step(&self, tokens: &[u32], pos: &[usize]) -> Result<usize> {
        let t: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
        let p: Vec<i32> = pos.iter().map(|&x| x as i32).collect();
        self.gpu.upload(&self.s.tokens, 0, &t)?;
        self.gpu.upload(&self.s.pos, 0, &p)?;
        Ok(pos.iter().copied().max().unwrap_or(0))
    }

    /// Captures one decode step (token and position read from device memory) as a graph.
    pub fn capture_decode(&self) -> Result<DecodeGraph> {
        self.capture_decode_batch(1)
    }

    /// Captures one decode step of sequences `0..nb` (one token each) as a graph.
    pub fn capture_decode_batch(&self, nb: usize) -> Result<DecodeGraph> {
        self.capture_steps(nb, true)
    }

    /// Captures one decode step of `nb` rows; with `advance`, each replay moves the positions
    /// on and records the greedy tokens (generation loops), else it only computes the logits.
    pub(super) fn capture_steps(&self, nb: usize, advance: bool) -> Result<DecodeGraph> {
        if nb == 0 || nb > self.opts.n_seq {
            return Err(CudaError::Shape(format!(
                "decode batch {nb} (the cache holds {} sequences)",
                self.opts.n_seq
            )));
        }
        self.gpu.sync()?;
        let mut graphs = Vec::new();
        for at in self.plan.variants(self.opts.n_ctx) {
            self.gpu.begin_capture()?;
            let r = self.enqueue_decode(nb, advance, at);
            let graph = self.gpu.end_capture();
            r?;
            graphs.push((at, graph?));
        }
        Ok(DecodeGraph { graphs, nb })
    }

    /// Greedy generation for `graph.nb` sequences at once: sequence b continues from
    /// `tokens[b]` at `pos[b]`, `n` steps; returns each sequence's generated tokens.
    pub fn generate_batch(
        &self,
        graph: &DecodeGraph,
        tokens: &[u32],
        pos: &[usize],
        n: usize,
    ) -> Result<Vec<Vec<u32>>> {
        let nb = graph.nb;
        if tokens.len() != nb || pos.len() != nb {
            return Err(CudaError::Shape(format!(
                "{} tokens and {} positions for a batch of {nb}",
                tokens.len(),
                pos.len()
            )));
        }
        for &p in pos {
            self.check_pos(p, n)?;
        }
        let latest = self.upload_step(tokens, pos)?;
        for step in 0..n {
            graph.replay(latest + step)?;
        }
        let hl = self.opts.n_ctx + 1;
        let mut out = Vec::with_capacity(nb);
        for (b, &p0) in pos.iter().enumerate() {
            let mut hist = vec![0i32; n];
            self.gpu
                .download(self.s.history.at(4 * (b * hl + p0 + 1)), &mut hist)?;
            out.push(hist.into_iter().map(|t| t as u32).collect());
        }
        Ok(out)
    }

    /// Greedy generation of `n` tokens after `token` at `pos` by replaying `graph`; returns the
    /// generated tokens. The KV cache must hold positions before `pos`.
    pub fn generate(
        &self,
        graph: &DecodeGraph,
        token: u32,
        pos: usize,
        n: usize,
    ) -> Result<Vec<u32>> {
        let mut out = self.generate_batch(graph, &[token], &[pos], n)?;
        Ok(out.pop().unwrap_or_default())
    }
}

/// A captured decode step: one graph per kernel variant, each with the position from which
/// it is replayed (ascending, the first at 0).
pub struct DecodeGraph {
    graphs: Vec<(usize, cudarc::driver::CudaGraph)>,
    nb: usize,
}

impl DecodeGraph {
    /// The variant for a step whose latest position is `pos`.
    fn for_position(&self, pos: usize) -> &cudarc::driver::CudaGraph {
        let i = self.graphs.partition_point(|(from, _)| *from <= pos);
        &self.graphs[i.saturating_sub(1)].1
    }

    /// Launches the variant for a step whose latest position is `pos`.
    pub(super) fn replay(&self, pos: usize) -> Result<()> {
        self.for_position(pos)
            .launch()
            .map_err(crate::runtime::drv_err)
    }
}
