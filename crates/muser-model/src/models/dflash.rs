//! `dflash`: the block drafter of DFlash speculative decoding, as llama.cpp b11434 runs it
//! (`src/models/dflash.cpp`, driven by `common/speculative.cpp`'s `draft-dflash`). It has no
//! token history of its own: its K/V cache holds the target's hidden states.
//!
//! - **Injection** (after every target batch): the inputs of the target layers
//!   `dflash.target_layers` at each position, side by side, are fused
//!   `g = RMSNorm(fc·F) * enc.output_norm`; every drafter layer stores
//!   `K = RoPE_NEOX(RMSNorm_head(Wk·g) * k_norm)` and `V = Wv·g` at the target's position.
//! - **Drafting**: the block `[id_last, MASK × n]` at positions `pos0, pos0+1, …` runs through
//!   the layers (pre-norm attention with per-head Q/K norms and NEOX RoPE, SwiGLU FFN);
//!   attention is **not causal**: every block row sees the whole injected context and every
//!   row of the block. The drafts are the argmax of rows `1..=n`.
//!
//! Embedding and output matrices are the drafter's own when the file has them, else the
//! target's (the published drafters borrow them). The draft cache is F16 as llama.cpp's
//! (`-ctkd f16`), and its attention rounds as ggml's CPU flash attention does for one chunk
//! (Q rounded to f16, f16 V accumulator).

use super::{linear, swiglu_ffn, Tensors, WRef};
use crate::backend::{Backend, RopeMode};
use crate::cpu::CpuBackend;
use crate::error::ModelError;
use crate::Model;
use half::f16;
use muser_gguf::GgufFile;
use std::path::Path;

/// Longest block a drafter may declare (llama.cpp's published drafters use 16).
pub const BLOCK_SIZE_MAX: u32 = 64;

/// The drafter's hyperparameters.
#[derive(Clone, Debug, PartialEq)]
pub struct DflashInfo {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// The trained block: at most `block_size - 1` drafts per step.
    pub block_size: u32,
    /// Target layers whose inputs feed the drafter, in the order they are concatenated.
    pub target_layers: Vec<u32>,
    pub mask_token: u32,
    pub n_vocab: usize,
    pub attn_scale: f32,
    pub embedding_scale: Option<f32>,
    pub value_scale: Option<f32>,
}

impl DflashInfo {
    fn from_gguf(g: &GgufFile) -> Result<DflashInfo, ModelError> {
        let arch = g.architecture()?;
        if arch != "dflash" {
            return Err(ModelError::BadModel(format!(
                "a DFlash drafter has architecture \"dflash\", this file {arch:?}"
            )));
        }
        let u = |k: &str| -> Result<usize, ModelError> {
            Ok(g.get_uint(&format!("dflash.{k}"))? as usize)
        };
        let bad = |m: String| Err(ModelError::BadModel(m));
        let (n_layer, n_embd, n_ff) = (
            u("block_count")?,
            u("embedding_length")?,
            u("feed_forward_length")?,
        );
        let (n_head, n_head_kv) = (u("attention.head_count")?, u("attention.head_count_kv")?);
        let head_dim = match g.get("dflash.attention.key_length") {
            Some(_) => u("attention.key_length")?,
            None => n_embd / n_head.max(1),
        };
        if !(1..=256).contains(&n_layer)
            || !(1..=65536).contains(&n_embd)
            || !(1..=1 << 20).contains(&n_ff)
            || !(1..=1024).contains(&head_dim)
            || n_head == 0
            || n_head_kv == 0
            || n_head % n_head_kv != 0
            || n_head * head_dim > 1 << 20
        {
            return bad(format!(
                "drafter geometry out of range ({n_layer} layers, {n_embd} wide, {n_head}/{n_head_kv} heads of {head_dim}, ffn {n_ff})"
            ));
        }
        if let Some(v) = g.get("dflash.attention.value_length") {
            if v.as_u64_lossless() != Some(head_dim as u64) {
                return bad("the drafter's value and key head widths differ".into());
            }
        }
        let target_layers: Vec<u32> = match g.get("dflash.target_layers") {
            Some(muser_gguf::Value::Array(muser_gguf::Array::I32(v))) => v
                .iter()
                .map(|&l| u32::try_from(l).unwrap_or(u32::MAX))
                .collect(),
            Some(muser_gguf::Value::Array(muser_gguf::Array::U32(v))) => v.clone(),
            _ => return bad("dflash.target_layers (an integer array) is missing".into()),
        };
        if target_layers.is_empty() || target_layers.len() > 64 {
            return bad(format!("{} target layers (1..=64)", target_layers.len()));
        }
        let block_size = g.get_opt_u32("dflash.block_size")?.unwrap_or(16);
        if !(2..=BLOCK_SIZE_MAX).contains(&block_size) {
            return bad(format!(
                "dflash.block_size {block_size} is outside 2..={BLOCK_SIZE_MAX}"
            ));
        }
        if let Some(act) = g.get_opt_str("dflash.hidden_activation")? {
            if act != "silu" {
                return bad(format!(
                    "drafter activation {act:?}: only silu is supported"
                ));
            }
        }
        if g.get_opt_u32("dflash.attention.sliding_window")?
            .unwrap_or(0)
            > 0
        {
            return bad("sliding-window drafters are not supported".into());
        }
        let mask_token = g
            .get_opt_u32("tokenizer.ggml.mask_token_id")?
            .ok_or_else(|| {
                ModelError::BadModel(
                    "the drafter names no mask token (tokenizer.ggml.mask_token_id)".into(),
                )
            })?;
        let n_vocab = g.get_str_array("tokenizer.ggml.tokens")?.len();
        if mask_token as usize >= n_vocab {
            return bad(format!(
                "mask token {mask_token} is outside the vocabulary of {n_vocab}"
            ));
        }
        let nonzero = |k: &str| -> Result<Option<f32>, ModelError> {
            Ok(g.get_opt_f32(&format!("dflash.{k}"))?.filter(|&x| x != 0.0))
        };
        Ok(DflashInfo {
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            rms_eps: g.get_f32("dflash.attention.layer_norm_rms_epsilon")?,
            rope_base: g.get_opt_f32("dflash.rope.freq_base")?.unwrap_or(10_000.0),
            block_size,
            target_layers,
            mask_token,
            n_vocab,
            attn_scale: nonzero("attention.scale")?.unwrap_or(1.0 / (head_dim as f32).sqrt()),
            embedding_scale: nonzero("embedding_scale")?,
            value_scale: nonzero("attention.value_scale")?,
        })
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: WRef,
    wk: WRef,
    /// Absent: V is the RMS-normed raw K (shared K/V).
    wv: Option<WRef>,
    wo: WRef,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    ffn_gate: WRef,
    ffn_up: WRef,
    ffn_down: WRef,
}

/// A loaded drafter.
pub struct Dflash {
    gguf: GgufFile,
    info: DflashInfo,
    be: CpuBackend,
    fc: WRef,
    enc_norm: Vec<f32>,
    output_norm: Vec<f32>,
    tok_embd: Option<WRef>,
    output: Option<WRef>,
    layers: Vec<Layer>,
}

impl std::fmt::Debug for Dflash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dflash")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

/// Tensors of llama.cpp's drafter variants this file does not implement (DSpark's Markov head,
/// DFlash2's selector, a reduced vocabulary, and optional per-layer extras); `*.scale`
/// sidecars are refused as well.
const UNSUPPORTED: [&str; 8] = [
    "d2t",
    "markov_w1.weight",
    "selector_hidden.weight",
    "post_attention_norm.weight",
    "post_ffw_norm.weight",
    "layer_output_scale.weight",
    "rope_freqs.weight",
    "attn_sinks.weight",
];

impl Dflash {
    /// Loads a drafter with `threads` compute threads (0 = one per core).
    pub fn load(path: &Path, threads: usize) -> Result<Dflash, ModelError> {
        let gguf = GgufFile::open(path).map_err(|source| ModelError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Dflash::from_gguf(gguf, threads)
    }

    pub fn from_gguf(gguf: GgufFile, threads: usize) -> Result<Dflash, ModelError> {
        let info = DflashInfo::from_gguf(&gguf)?;
        if let Some(t) = gguf.tensors().iter().find(|t| {
            UNSUPPORTED
                .iter()
                .any(|u| t.name == *u || t.name.ends_with(&format!(".{u}")))
                || t.name.ends_with(".scale")
        }) {
            return Err(ModelError::BadModel(format!(
                "drafter tensor {}: this DFlash variant is not supported (plain DFlash only)",
                t.name
            )));
        }
        let be = CpuBackend::new(threads)?;
        let supports = |ty| be.supports(ty);
        let t = Tensors::new(&gguf, &supports);
        let (e, hd, ff) = (info.n_embd, info.head_dim, info.n_ff);
        let (qw, kvw) = (info.n_head * hd, info.n_head_kv * hd);
        let mut layers = Vec::with_capacity(info.n_layer);
        for il in 0..info.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}.weight");
            let wk = t.mat(&n("attn_k"), e, kvw)?;
            layers.push(Layer {
                attn_norm: t.vec(&n("attn_norm"), e)?,
                wq: t.mat(&n("attn_q"), e, qw)?,
                wk,
                wv: t.opt_mat(&n("attn_v"), e, kvw)?,
                wo: t.mat(&n("attn_output"), qw, e)?,
                q_norm: t.vec(&n("attn_q_norm"), hd)?,
                k_norm: t.vec(&n("attn_k_norm"), hd)?,
                ffn_norm: t.vec(&n("ffn_norm"), e)?,
                ffn_gate: t.mat(&n("ffn_gate"), e, ff)?,
                ffn_up: t.mat(&n("ffn_up"), e, ff)?,
                ffn_down: t.mat(&n("ffn_down"), ff, e)?,
            });
        }
        let fc = t.mat("fc.weight", info.target_layers.len() * e, e)?;
        let tok_embd = t.opt_mat("token_embd.weight", e, info.n_vocab)?;
        let output = match t.opt_mat("output.weight", e, info.n_vocab)? {
            Some(o) => Some(o),
            None => tok_embd.clone(),
        };
        let (enc_norm, output_norm) = (
            t.vec("enc.output_norm.weight", e)?,
            t.vec("output_norm.weight", e)?,
        );
        drop(t);
        Ok(Dflash {
            gguf,
            info,
            be,
            fc,
            enc_norm,
            output_norm,
            tok_embd,
            output,
            layers,
        })
    }

    pub fn info(&self) -> &DflashInfo {
        &self.info
    }

    /// Whether this drafter can serve `target`: the same width and vocabulary, target layers
    /// that exist.
    pub fn check_target(&self, target: &Model) -> Result<(), ModelError> {
        let ti = target.info();
        let bad = |m: String| Err(ModelError::BadModel(m));
        if ti.n_embd != self.info.n_embd {
            return bad(format!(
                "the drafter is {} wide, the target {} (they must be equal)",
                self.info.n_embd, ti.n_embd
            ));
        }
        if ti.n_vocab != self.info.n_vocab {
            return bad(format!(
                "the drafter's vocabulary has {} tokens, the target's {}",
                self.info.n_vocab, ti.n_vocab
            ));
        }
        if let Some(l) = self
            .info
            .target_layers
            .iter()
            .find(|&&l| l as usize >= ti.n_layer)
        {
            return bad(format!(
                "the drafter reads target layer {l}, the target has {} layers",
                ti.n_layer
            ));
        }
        Ok(())
    }

    /// An empty draft cache for one sequence.
    pub fn new_context(&self) -> DraftContext {
        DraftContext {
            pos: Vec::new(),
            k: vec![Vec::new(); self.info.n_layer],
            v: vec![Vec::new(); self.info.n_layer],
            kv_width: self.info.n_head_kv * self.info.head_dim,
        }
    }

    /// Width of one feature row: the target layers' inputs side by side.
    pub fn feature_width(&self) -> usize {
        self.info.target_layers.len() * self.info.n_embd
    }

    /// Stores the K/V of target positions `pos` (ascending, past `ctx`'s last) from their
    /// features (`pos.len()` rows of [`Dflash::feature_width`]).
    pub fn inject(
        &self,
        ctx: &mut DraftContext,
        pos: &[u32],
        features: &[f32],
    ) -> Result<(), ModelError> {
        let w = self.feature_width();
        if features.len() != pos.len() * w || pos.is_empty() {
            return Err(ModelError::BadBatch(format!(
                "{} feature values for {} positions of width {w}",
                features.len(),
                pos.len()
            )));
        }
        let last = ctx.pos.last().copied();
        if pos.windows(2).any(|p| p[0] >= p[1]) || last.is_some_and(|l| pos[0] <= l) {
            return Err(ModelError::BadBatch(
                "injected positions must ascend past the draft cache".into(),
            ));
        }
        let (be, g, i) = (&self.be, &self.gguf, &self.info);
        be.run(|| -> Result<(), ModelError> {
            let f = be.upload(pos.len(), w, features.to_vec())?;
            let mut x = linear(be, g, &self.fc, None, None, &f)?;
            drop(f);
            be.rms_norm_mut(&mut x, i.n_embd, i.rms_eps, Some(&self.enc_norm))?;
            for (il, l) in self.layers.iter().enumerate() {
                let (k, v) = self.kv_rows(l, &x, pos)?;
                ctx.k[il].extend(k.iter().map(|&a| f16::from_f32(a)));
                ctx.v[il].extend(v.iter().map(|&a| f16::from_f32(a)));
            }
            Ok(())
        })?;
        ctx.pos.extend_from_slice(pos);
        Ok(())
    }

    /// K (normed, rotated) and V of the rows `h` at positions `pos`, on the host.
    fn kv_rows(
        &self,
        l: &Layer,
        h: &<CpuBackend as Backend>::Act,
        pos: &[u32],
    ) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let (be, g, i) = (&self.be, &self.gguf, &self.info);
        let mut k = linear(be, g, &l.wk, None, None, h)?;
        let v = match &l.wv {
            Some(wv) => linear(be, g, wv, None, None, h)?,
            None => be.rms_norm(&k, i.head_dim, i.rms_eps, None)?,
        };
        be.rms_norm_mut(&mut k, i.head_dim, i.rms_eps, Some(&l.k_norm))?;
        be.rope(
            &mut k,
            i.head_dim,
            i.head_dim,
            pos,
            i.rope_base,
            RopeMode::Neox,
        )?;
        Ok((be.download(&k)?, be.download(&v)?))
    }

    /// Drafts `n` tokens (at most `block_size - 1`) to follow `id_last` at position `pos0`,
    /// reading `ctx` (the target's states before `pos0`). `target` lends the embedding and
    /// output matrices the drafter does not have.
    pub fn draft(
        &self,
        target: &Model,
        ctx: &DraftContext,
        id_last: u32,
        pos0: u32,
        n: usize,
    ) -> Result<Vec<u32>, ModelError> {
        let i = &self.info;
        if n == 0 || n >= i.block_size as usize {
            return Err(ModelError::BadBatch(format!(
                "{n} drafts: the drafter's block allows 1..={}",
                i.block_size - 1
            )));
        }
        if id_last as usize >= i.n_vocab {
            return Err(ModelError::BadBatch(format!(
                "token {id_last} is outside the vocabulary"
            )));
        }
        let head = target.head();
        let (tg, own) = (target.gguf(), &self.gguf);
        let (embd, eg) = match &self.tok_embd {
            Some(w) => (w.clone(), own),
            None => (head.tok_embd, tg),
        };
        let (out, og, out_scale) = match &self.output {
            Some(w) => (w.clone(), own, None),
            None => (head.output, tg, head.output_scale),
        };
        let tokens: Vec<u32> = std::iter::once(id_last)
            .chain(std::iter::repeat_n(i.mask_token, n))
            .collect();
        let pos: Vec<u32> = (0..=n as u32).map(|k| pos0 + k).collect();
        let (be, g) = (&self.be, &self.gguf);
        let logits = be.run(|| -> Result<Vec<f32>, ModelError> {
            let mut x = be.get_rows(&embd.view(eg), &tokens)?;
            if let Some(s) = i.embedding_scale {
                be.scale(&mut x, s)?;
            }
            for (il, l) in self.layers.iter().enumerate() {
                let h = be.rms_norm(&x, i.n_embd, i.rms_eps, Some(&l.attn_norm))?;
                let mut q = linear(be, g, &l.wq, None, None, &h)?;
                be.rms_norm_mut(&mut q, i.head_dim, i.rms_eps, Some(&l.q_norm))?;
                be.rope(
                    &mut q,
                    i.head_dim,
                    i.head_dim,
                    &pos,
                    i.rope_base,
                    RopeMode::Neox,
                )?;
                let (k, v) = self.kv_rows(l, &h, &pos)?;
                drop(h);
                let a = self.attend(ctx, il, &be.download(&q)?, &k, &v);
                let mut o = linear(
                    be,
                    g,
                    &l.wo,
                    None,
                    None,
                    &be.upload(tokens.len(), i.n_head * i.head_dim, a)?,
                )?;
                if let Some(s) = i.value_scale {
                    be.scale(&mut o, s)?;
                }
                be.add(&mut o, &x)?;
                let h2 = be.rms_norm(&o, i.n_embd, i.rms_eps, Some(&l.ffn_norm))?;
                let mut f = swiglu_ffn(be, g, &l.ffn_gate, &l.ffn_up, &l.ffn_down, h2)?;
                be.add(&mut f, &o)?;
                x = f;
            }
            let rows: Vec<usize> = (1..=n).collect();
            let mut x = be.select_rows(&x, &rows)?;
            be.rms_norm_mut(&mut x, i.n_embd, i.rms_eps, Some(&self.output_norm))?;
            let y = linear(be, og, &out, None, out_scale, &x)?;
            be.download(&y)
        })?;
        Ok(logits.chunks(i.n_vocab).map(crate::argmax_logits).collect())
    }

    /// Non-causal attention of the block's rows over the context's cells and the block's own
    /// (K/V rounded to f16 as the draft cache stores them), in cache order.
    fn attend(&self, ctx: &DraftContext, il: usize, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let i = &self.info;
        let (hd, kvw) = (i.head_dim, ctx.kv_width);
        let group = i.n_head / i.n_head_kv;
        let n_rows = q.len() / (i.n_head * hd);
        let bk: Vec<f16> = k.iter().map(|&a| f16::from_f32(a)).collect();
        let bv: Vec<f16> = v.iter().map(|&a| f16::from_f32(a)).collect();
        let cells = ctx.pos.len() + n_rows;
        let cell = |c: usize, h: usize| -> (&[f16], &[f16]) {
            let (ks, vs, r) = if c < ctx.pos.len() {
                (&ctx.k[il], &ctx.v[il], c)
            } else {
                (&bk, &bv, c - ctx.pos.len())
            };
            let at = r * kvw + h * hd;
            (&ks[at..at + hd], &vs[at..at + hd])
        };
        let mut out = vec![0f32; q.len()];
        let mut q16 = vec![f16::ZERO; hd];
        let mut acc = vec![f16::ZERO; hd];
        for r in 0..n_rows {
            for h in 0..i.n_head {
                let qr = &q[(r * i.n_head + h) * hd..][..hd];
                for (d, &x) in q16.iter_mut().zip(qr) {
                    *d = f16::from_f32(x);
                }
                acc.fill(f16::ZERO);
                let (mut m, mut s) = (f32::NEG_INFINITY, 0f32);
                for c in 0..cells {
                    let (kc, vc) = cell(c, h / group);
                    let score = q16
                        .iter()
                        .zip(kc)
                        .map(|(a, b)| a.to_f32() * b.to_f32())
                        .sum::<f32>()
                        * i.attn_scale;
                    let (ms, vs) = if score > m {
                        let ms = (m - score).exp();
                        m = score;
                        (ms, 1.0)
                    } else {
                        (1.0, (score - m).exp())
                    };
                    if ms != 1.0 {
                        for a in acc.iter_mut() {
                            *a = f16::from_f32(a.to_f32() * ms);
                        }
                    }
                    for (a, &x) in acc.iter_mut().zip(vc) {
                        *a = f16::from_f32(a.to_f32() + x.to_f32() * vs);
                    }
                    s = s * ms + vs;
                }
                let o = &mut out[(r * i.n_head + h) * hd..][..hd];
                for (d, a) in o.iter_mut().zip(&acc) {
                    *d = a.to_f32() / s;
                }
            }
        }
        out
    }
}

/// One sequence's draft cache: the K/V of the target positions injected so far.
#[derive(Clone, Debug, Default)]
pub struct DraftContext {
    pos: Vec<u32>,
    /// Per drafter layer, `pos.len()` rows of `kv_width`.
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    kv_width: usize,
}

impl DraftContext {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.pos.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }

    /// Forgets every position from `pos` on (rejected drafts, a shortened sequence).
    pub fn truncate(&mut self, pos: u32) {
        let keep = self.pos.partition_point(|&p| p < pos);
        self.pos.truncate(keep);
        for rows in self.k.iter_mut().chain(self.v.iter_mut()) {
            rows.truncate(keep * self.kv_width);
        }
    }
}
