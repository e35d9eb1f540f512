//! Prefill of the fused forward: chunks of prompt tokens through bf16 cuBLAS GEMMs, writing
//! the KV cache as decode reads it. Attention: the flash kernel `attn_prefill_flash` (online
//! softmax over staged key tiles, no score matrix in memory). A chunk's
//! rows given as embeddings (an image's rows, `InputEmbd`) are copied over the gathered token
//! rows before the first norm, so from there they are computed as any token row.

use muser_model::InputEmbd;

use super::{CudaGlimmer, Result, HEAD_DIM};
use crate::layout::{FA_SMEM_BYTES, FA_WARPS};
use crate::runtime::Arg;
use crate::CudaError;

impl CudaGlimmer {
    /// Prefill `tokens` at positions `pos..`, in chunks of at most `max_chunk`; returns the
    /// last token's logits and its greedy next token.
    pub fn prefill(&mut self, tokens: &[u32], pos: usize) -> Result<(Vec<f32>, u32)> {
        self.prefill_seq(tokens, pos, 0)
    }

    /// [`Self::prefill`] into sequence `seq` of the KV cache.
    pub fn prefill_seq(
        &mut self,
        tokens: &[u32],
        pos: usize,
        seq: usize,
    ) -> Result<(Vec<f32>, u32)> {
        if seq >= self.kv_seqs {
            return Err(CudaError::Shape(format!(
                "sequence {seq} (the cache holds {})",
                self.kv_seqs
            )));
        }
        if tokens.is_empty() {
            return Err(CudaError::Shape("empty prompt".into()));
        }
        self.check_pos(pos, tokens.len())?;
        let mut p = pos;
        for chunk in tokens.chunks(self.opts.max_chunk) {
            self.enqueue_prefill_seq(chunk, p, seq, true, &InputEmbd::default())?;
            p += chunk.len();
        }
        self.read_logits()
    }

    /// Enqueues a prefill chunk (used by `prefill` and timed by the bench).
    pub fn enqueue_prefill_chunk(&self, tokens: &[u32], p0: usize) -> Result<()> {
        self.enqueue_prefill_seq(tokens, p0, 0, true, &InputEmbd::default())
    }

    /// Enqueues a prefill chunk of sequence `seq` at positions `p0..`; with `last_logits` the
    /// last token's logits (and greedy token) land in row 0 of the logits, else the chunk's
    /// final residual rows stay in the scratch for [`Self::chunk_outputs`]. The rows of
    /// `embd` (chunk-relative) take its values in place of their token's embedding; their
    /// token ids are not read.
    pub(super) fn enqueue_prefill_seq(
        &self,
        tokens: &[u32],
        p0: usize,
        seq: usize,
        last_logits: bool,
        embd: &InputEmbd,
    ) -> Result<()> {
        let i = &self.info;
        let g = &self.gpu;
        let s = &self.s;
        let t = tokens.len();
        if t == 0 || t > self.opts.max_chunk {
            return Err(CudaError::Shape(format!(
                "chunk of {t} tokens (max {})",
                self.opts.max_chunk
            )));
        }
        self.check_pos(p0, t)?;
        let (nq, nkv) = (i.n_head, i.n_head_kv);
        let qw = nq * HEAD_DIM;
        let ld = 2 * qw + 2 * nkv * HEAD_DIM;
        let e = i.n_embd;
        if embd.rows.windows(2).any(|w| w[0] >= w[1])
            || embd.rows.last().is_some_and(|&r| r >= t)
            || embd.values.len() != embd.rows.len() * e
        {
            return Err(CudaError::Shape(format!(
                "embedding rows of a {t}-token chunk must ascend within it and hold {e} values each"
            )));
        }
        // an embedding row gathers token 0's row (its id may lie past the table), then is
        // overwritten
        let ids: Vec<i32> = tokens
            .iter()
            .enumerate()
            .map(|(k, &x)| match embd.rows.binary_search(&k) {
                Ok(_) => 0,
                Err(_) => x as i32,
            })
            .collect();
        let poss: Vec<i32> = (0..t).map(|k| (p0 + k) as i32).collect();
        g.upload(&s.tokens, 0, &ids)?;
        g.upload(&s.pos, 0, &poss)?;
        self.tok_embd.get_rows(g, s.tokens.ptr(), t, s.x.ptr())?;
        let pairs = embd.rows.iter().enumerate().map(|(j, &r)| (r, j));
        for (r, j, n) in muser_model::kv::runs(pairs) {
            g.upload(&s.x, 4 * r * e, &embd.values[j * e..(j + n) * e])?;
        }
        self.norm(t, s.x.ptr(), (0, 1), None, 0, s.x.ptr(), 0, false)?;
        self.norm(
            t,
            s.x.ptr(),
            (0, 1),
            None,
            self.layers[0].attn_norm.ptr(),
            0,
            s.hb.ptr(),
            false,
        )?;
        for (il, l) in self.layers.iter().enumerate() {
            l.qkvg
                .gemm(g, t, s.hb.ptr(), s.y_qkvg.ptr(), s.wbuf.ptr())?;
            self.qk_norm_rope(l, il, t, ld, s.q_h.ptr(), seq as i32)?;
            let w = self.window(il);
            let seq_off = 2 * seq * self.slot_stride(l);
            g.launch_smem(
                "attn_prefill_flash",
                (t.div_ceil(FA_WARPS) as u32, nkv as u32, 1),
                (32 * FA_WARPS) as u32,
                FA_SMEM_BYTES,
                &[
                    Arg::P(s.q_h.ptr()),
                    Arg::I(t as i32),
                    Arg::I(nq as i32),
                    Arg::I(nkv as i32),
                    Arg::P(l.k_cache + seq_off as u64),
                    Arg::P(l.v_cache + seq_off as u64),
                    Arg::I(p0 as i32),
                    Arg::I(w),
                    Arg::F(i.attn_scale),
                    Arg::I(l.ring as i32),
                    Arg::P(s.o_heads.ptr()),
                ],
            )?;
            g.launch(
                "gate_heads_bf16",
                ((t * qw).div_ceil(256) as u32, 1, 1),
                256,
                &[
                    Arg::P(s.o_heads.ptr()),
                    Arg::P(s.y_qkvg.at(4 * (qw + 2 * nkv * HEAD_DIM))),
                    Arg::L(ld as i64),
                    Arg::I(t as i32),
                    Arg::I(nq as i32),
                    Arg::P(s.hb.ptr()),
                ],
            )?;
            l.wo.gemm(g, t, s.hb.ptr(), s.y_o.ptr(), s.wbuf.ptr())?;
            self.norm(
                t,
                s.x.ptr(),
                (0, 1),
                Some((s.y_o.ptr(), l.post_attn_norm.ptr(), 1e-8)),
                l.ffn_norm.ptr(),
                0,
                s.hb.ptr(),
                false,
            )?;
            l.gate_up
                .gemm(g, t, s.hb.ptr(), s.y_gu.ptr(), s.wbuf.ptr())?;
            self.swiglu(l, t, 256, (0, s.hb.ptr()), None)?;
            l.down.gemm(g, t, s.hb.ptr(), s.y_d.ptr(), s.wbuf.ptr())?;
            let last = il + 1 == self.layers.len();
            let next = if last {
                self.output_norm.ptr()
            } else {
                self.layers[il + 1].attn_norm.ptr()
            };
            self.norm(
                t,
                s.x.ptr(),
                (0, 1),
                Some((s.y_d.ptr(), l.post_ffw_norm.ptr(), 1e-8)),
                next,
                0,
                if last { 0 } else { s.hb.ptr() },
                false,
            )?;
        }
        if last_logits {
            self.chunk_outputs(t - 1..t)?;
        }
        Ok(())
    }

    /// The token embedding rows of `tokens` as the prefill gathers them (f32, `n_embd` values
    /// each): what a row given as an embedding holds to be computed as that token.
    pub fn embedding_rows(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (g, s, e, t) = (&self.gpu, &self.s, self.info.n_embd, tokens.len());
        if t == 0
            || t > self.opts.max_chunk
            || tokens.iter().any(|&x| x as usize >= self.info.n_vocab)
        {
            return Err(CudaError::Shape(format!(
                "{t} tokens (at most {}, each below {})",
                self.opts.max_chunk, self.info.n_vocab
            )));
        }
        let ids: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
        g.upload(&s.tokens, 0, &ids)?;
        self.tok_embd.get_rows(g, s.tokens.ptr(), t, s.x.ptr())?;
        let mut rows = vec![0f32; t * e];
        g.download(s.x.ptr(), &mut rows)?;
        Ok(rows)
    }

    /// Logits of rows `rows` of the prefill chunk just run (its final residual rows), at most
    /// `GpuOptions::n_seq` rows, into output rows `0..rows.len()` (with their final-norm
    /// hidden states: [`Self::download_output`]).
    pub(super) fn chunk_outputs(&self, rows: std::ops::Range<usize>) -> Result<()> {
        let (s, e, n) = (&self.s, self.info.n_embd, rows.len());
        if n == 0 || n > self.opts.n_seq || rows.end > self.opts.max_chunk {
            return Err(CudaError::Shape(format!("output rows {rows:?}")));
        }
        self.norm(
            n,
            s.x.at(4 * rows.start * e),
            (0, 1),
            None,
            self.output_norm.ptr(),
            s.hf.ptr(),
            0,
            true,
        )?;
        self.output
            .gemv(&self.gpu, n, self.qact(), s.hf.ptr(), s.logits.ptr())?;
        self.finish_logits(n, false)
    }

    /// Output rows `j..j + n`: logits into `logits` (`n · n_vocab` values) and, when given,
    /// final-norm hidden states into `hidden` (`n · n_embd`), after a decode step or
    /// [`Self::chunk_outputs`].
    pub(super) fn download_outputs(
        &self,
        j: usize,
        n: usize,
        logits: &mut [f32],
        hidden: Option<&mut [f32]>,
    ) -> Result<()> {
        let (v, e) = (self.info.n_vocab, self.info.n_embd);
        if j + n > self.opts.n_seq
            || logits.len() != n * v
            || hidden.as_ref().is_some_and(|h| h.len() != n * e)
        {
            return Err(CudaError::Shape(format!("output rows {j}..{}", j + n)));
        }
        self.gpu.download(self.s.logits.at(4 * j * v), logits)?;
        if let Some(h) = hidden {
            self.gpu.download(self.s.hf.at(4 * j * e), h)?;
        }
        Ok(())
    }
}
