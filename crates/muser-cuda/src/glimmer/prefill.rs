//! Prefill of the fused forward: chunks of prompt tokens through bf16 cuBLAS GEMMs, writing
//! the KV cache as decode reads it. Attention: two GEMMs around a masked softmax over scores in
//! memory, or with `Tuning::flash_prefill` the flash kernel `attn_prefill_flash`. A chunk's
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
        self.norm(t, s.x.ptr(), (0, 1), None, 0, s.x.ptr(), 0, false, (0, 0))?;
        self.norm(
            t,
            s.x.ptr(),
            (0, 1),
            None,
            self.layers[0].attn_norm.ptr(),
            0,
            s.hb.ptr(),
            false,
            (0, 0),
        )?;
        for (il, l) in self.layers.iter().enumerate() {
            l.qkvg
                .gemm(g, t, s.hb.ptr(), s.y_qkvg.ptr(), s.wbuf.ptr())?;
            self.qk_norm_rope(l, il, t, ld, 0, s.q_h.ptr(), seq as i32, (0, 0))?;
            let w = self.window(il);
            let seq_off = 2 * seq * self.slot_stride(l);
            if g.tuning().flash_prefill {
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
            } else {
                self.attention_gemms(l, t, p0, seq_off, w)?;
            }
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
                (0, 0),
            )?;
            l.gate_up
                .gemm(g, t, s.hb.ptr(), s.y_gu.ptr(), s.wbuf.ptr())?;
            self.swiglu(l, t, 256, (0, s.hb.ptr()), None, (0, 0))?;
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
                (0, 0),
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

    /// The chunk's attention through bf16 GEMMs: scores `[nkv][group * t][nk]` in memory, the
    /// masked softmax over them (`softmax_mask`), then probabilities times values into
    /// `o_heads` (`fa=0`; the default, `Tuning::flash_prefill`, runs `attn_prefill_flash`).
    fn attention_gemms(
        &self,
        l: &super::Layer,
        t: usize,
        p0: usize,
        seq_off: usize,
        w: i32,
    ) -> Result<()> {
        let (i, g, s) = (&self.info, &self.gpu, &self.s);
        let (nq, nkv) = (i.n_head, i.n_head_kv);
        let k_lo = if w > 0 {
            (p0 + 1).saturating_sub(w as usize)
        } else {
            0
        };
        let nk = p0 + t - k_lo;
        let rows = nq / nkv * t;
        let kvw = nkv * HEAD_DIM;
        // Keys [k_lo, k_lo + nk) as at most two contiguous row ranges (a ring wraps once):
        // (first key, count, column of the first key).
        let mut segs = vec![(k_lo, nk, 0usize)];
        if l.ring > 0 {
            let first = nk.min(l.ring - k_lo % l.ring);
            segs = vec![(k_lo, first, 0)];
            if first < nk {
                segs.push((k_lo + first, nk - first, first));
            }
        }
        let row_of = |p: usize| if l.ring > 0 { p % l.ring } else { p };
        let (scores, probs) = self.gemm_attn_buffers()?;
        // scores[g][r][j] = q_h[g][r] · k[k_lo + j]   (r = head-in-group * t + token)
        for &(k0, n, col) in &segs {
            g.gemm_f16_batched(
                true,
                n,
                rows,
                HEAD_DIM,
                l.k_cache + (seq_off + 2 * row_of(k0) * kvw) as u64,
                kvw,
                HEAD_DIM,
                s.q_h.ptr(),
                HEAD_DIM,
                rows * HEAD_DIM,
                scores + 4 * col as u64,
                nk,
                rows * nk,
                nkv,
                0.0,
            )?;
        }
        // Rows up to 12288 keys stay in shared memory (one read of the scores).
        let cached = nk <= 12288;
        g.launch_smem(
            "softmax_mask",
            ((nkv * rows) as u32, 1, 1),
            256,
            if cached { 4 * nk as u32 } else { 0 },
            &[
                Arg::P(scores),
                Arg::P(probs),
                Arg::I(t as i32),
                Arg::I(nk as i32),
                Arg::I(p0 as i32),
                Arg::I(k_lo as i32),
                Arg::I(w),
                Arg::F(i.attn_scale),
                Arg::I(cached as i32),
            ],
        )?;
        // o[g][r][d] = Σ_j p[g][r][j] · v[k_lo + j][d]
        for (k, &(k0, n, col)) in segs.iter().enumerate() {
            g.gemm_f16_batched(
                false,
                HEAD_DIM,
                rows,
                n,
                l.v_cache + (seq_off + 2 * row_of(k0) * kvw) as u64,
                kvw,
                HEAD_DIM,
                probs + 2 * col as u64,
                nk,
                rows * nk,
                s.o_heads.ptr(),
                HEAD_DIM,
                rows * HEAD_DIM,
                nkv,
                if k == 0 { 0.0 } else { 1.0 },
            )?;
        }
        Ok(())
    }

    /// The score and probability buffers of [`Self::attention_gemms`], allocated on first use.
    fn gemm_attn_buffers(&self) -> Result<(u64, u64)> {
        let mut b = self.s.gemm_attn.lock().unwrap_or_else(|e| e.into_inner());
        let n = self.info.n_head * self.opts.max_chunk.max(1) * self.opts.n_ctx;
        if b.as_ref().is_none_or(|(_, _, held)| *held < n) {
            *b = None;
            *b = Some((self.gpu.alloc(4 * n)?, self.gpu.alloc(2 * n)?, n));
        }
        match b.as_ref() {
            Some((s, p, _)) => Ok((s.ptr(), p.ptr())),
            None => Err(CudaError::Shape("no attention score buffers".into())),
        }
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
            (0, 0),
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
