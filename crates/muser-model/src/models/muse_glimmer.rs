//! Muse Glimmer (`general.architecture = "muse-glimmer"`), as llama.cpp b11434 runs it
//! (`src/models/muse-glimmer.cpp`; spec §2.2). Per layer:
//!
//! ```text
//! h  = RMSNorm(x)·attn_norm
//! q,k,v = Wq·h, Wk·h, Wv·h (+bias, ·scale sidecar);  gate = Wgate·h (its scale is ignored)
//! q,k = per-head RMSNorm · q_norm / k_norm;  RoPE NORM with freq_base_swa on sliding layers only
//! a  = attention(q, k, v) · sigmoid(gate);  a = Wo·a (·scale)
//! x  = x + RMSNorm(a, 1e-8)·post_attention_norm
//! x  = x + RMSNorm(Wdown·(silu(Wgate_ffn·h2) ⊙ Wup·h2), 1e-8)·post_ffw_norm,  h2 = RMSNorm(x)·ffn_norm
//! ```
//! The embedding is RMS-normalised without a weight first; the head is
//! `softcap(logit_scale · Woutput·RMSNorm(x)·output_norm)`.

use super::{attend, embed, linear, rope_qk, swiglu_ffn, Capture, Head, Prepared, Tensors, WRef};
use crate::backend::Backend;
use crate::error::ModelError;
use crate::info::ModelInfo;
use crate::kv::KvCache;
use crate::InputEmbd;
use muser_gguf::GgufFile;

/// Epsilon of the post-attention and post-FFN norms, fixed by the architecture.
const POST_NORM_EPS: f32 = 1e-8;

struct Layer {
    attn_norm: Vec<f32>,
    wq: WRef,
    wk: WRef,
    wv: WRef,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    sq: Option<f32>,
    sk: Option<f32>,
    sv: Option<f32>,
    wgate: WRef,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    wo: WRef,
    so: Option<f32>,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    ffn_gate: WRef,
    ffn_up: WRef,
    ffn_down: WRef,
    post_ffw_norm: Vec<f32>,
}

pub struct MuseGlimmer {
    tok_embd: WRef,
    output_norm: Vec<f32>,
    output: WRef,
    output_scale: Option<f32>,
    layers: Vec<Layer>,
}

impl MuseGlimmer {
    pub fn load(t: &Tensors, i: &ModelInfo) -> Result<MuseGlimmer, ModelError> {
        let (e, hd, ff) = (i.n_embd, i.head_dim, i.n_ff);
        let (qw, kvw) = (i.n_head * hd, i.n_head_kv * hd);
        if t.g.tensor("blk.0.attn_qkv.weight").is_some() {
            return Err(ModelError::BadModel(
                "fused attn_qkv tensors are not supported yet".into(),
            ));
        }
        let mut layers = Vec::with_capacity(i.n_layer);
        for il in 0..i.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            layers.push(Layer {
                attn_norm: t.vec(&n("attn_norm.weight"), e)?,
                wq: t.mat(&n("attn_q.weight"), e, qw)?,
                wk: t.mat(&n("attn_k.weight"), e, kvw)?,
                wv: t.mat(&n("attn_v.weight"), e, kvw)?,
                bq: t.opt_vec(&n("attn_q.bias"), qw)?,
                bk: t.opt_vec(&n("attn_k.bias"), kvw)?,
                bv: t.opt_vec(&n("attn_v.bias"), kvw)?,
                sq: t.opt_scale(&n("attn_q.scale"))?,
                sk: t.opt_scale(&n("attn_k.scale"))?,
                sv: t.opt_scale(&n("attn_v.scale"))?,
                wgate: t.mat(&n("attn_gate.weight"), e, qw)?,
                q_norm: t.vec(&n("attn_q_norm.weight"), hd)?,
                k_norm: t.vec(&n("attn_k_norm.weight"), hd)?,
                wo: t.mat(&n("attn_output.weight"), qw, e)?,
                so: t.opt_scale(&n("attn_output.scale"))?,
                post_attn_norm: t.vec(&n("post_attention_norm.weight"), e)?,
                ffn_norm: t.vec(&n("ffn_norm.weight"), e)?,
                ffn_gate: t.mat(&n("ffn_gate.weight"), e, ff)?,
                ffn_up: t.mat(&n("ffn_up.weight"), e, ff)?,
                ffn_down: t.mat(&n("ffn_down.weight"), ff, e)?,
                post_ffw_norm: t.vec(&n("post_ffw_norm.weight"), e)?,
            });
        }
        Ok(MuseGlimmer {
            tok_embd: t.mat("token_embd.weight", e, i.n_vocab)?,
            output_norm: t.vec("output_norm.weight", e)?,
            output: t.mat("output.weight", e, i.n_vocab)?,
            output_scale: t.opt_scale("output.scale")?,
            layers,
        })
    }

    pub fn head(&self) -> Head {
        Head {
            tok_embd: self.tok_embd.clone(),
            output: self.output.clone(),
            output_scale: self.output_scale,
        }
    }

    /// Runs the batch; returns the final-norm hidden states of `prep.out_rows` and their logits.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<B: Backend>(
        &self,
        be: &B,
        g: &GgufFile,
        i: &ModelInfo,
        kv: &mut KvCache,
        prep: &Prepared,
        tokens: &[u32],
        embd: &InputEmbd,
        pos: &[u32],
        cap: &mut Capture,
    ) -> Result<(B::Act, B::Act), ModelError> {
        let eps = i.rms_eps;
        let mut x = embed(be, &self.tok_embd.view(g), tokens, embd, prep)?;
        be.rms_norm_mut(&mut x, i.n_embd, eps, None)?;
        let mut pos = pos.to_vec();
        // Each intermediate is dropped as soon as it is used, so a large batch holds few of
        // them at once.
        for (il, l) in self.layers.iter().enumerate() {
            cap.layer(be, il, &x)?;
            let a = {
                let h = be.rms_norm(&x, i.n_embd, eps, Some(&l.attn_norm))?;
                let mut q = linear(be, g, &l.wq, l.bq.as_deref(), l.sq, &h)?;
                let mut k = linear(be, g, &l.wk, l.bk.as_deref(), l.sk, &h)?;
                let v = linear(be, g, &l.wv, l.bv.as_deref(), l.sv, &h)?;
                let gate = linear(be, g, &l.wgate, None, None, &h)?;
                drop(h);
                be.rms_norm_mut(&mut q, i.head_dim, eps, Some(&l.q_norm))?;
                be.rms_norm_mut(&mut k, i.head_dim, eps, Some(&l.k_norm))?;
                if i.is_swa[il] {
                    rope_qk(be, i, &mut q, &mut k, &pos, i.rope_base_swa)?;
                }
                let mut a = attend(be, i, kv, prep, &pos, il, &q, &k, &v)?;
                drop((q, k, v));
                be.mul_sigmoid(&mut a, &gate)?;
                drop(gate);
                linear(be, g, &l.wo, None, l.so, &a)?
            };
            let mut a = a;
            be.rms_norm_mut(&mut a, i.n_embd, POST_NORM_EPS, Some(&l.post_attn_norm))?;
            if il + 1 == self.layers.len() {
                // Only the rows that produce outputs go through the last FFN.
                a = be.select_rows(&a, &prep.out_rows)?;
                x = be.select_rows(&x, &prep.out_rows)?;
                pos = prep.out_rows.iter().map(|&r| pos[r]).collect();
            }
            be.add(&mut a, &x)?;
            drop(x);
            let ffn_inp = a;
            let h2 = be.rms_norm(&ffn_inp, i.n_embd, eps, Some(&l.ffn_norm))?;
            let mut f = swiglu_ffn(be, g, &l.ffn_gate, &l.ffn_up, &l.ffn_down, h2)?;
            be.rms_norm_mut(&mut f, i.n_embd, POST_NORM_EPS, Some(&l.post_ffw_norm))?;
            be.add(&mut f, &ffn_inp)?;
            x = f;
        }
        let mut hidden = x;
        be.rms_norm_mut(&mut hidden, i.n_embd, eps, Some(&self.output_norm))?;
        let mut logits = linear(be, g, &self.output, None, self.output_scale, &hidden)?;
        be.scale(&mut logits, i.logit_scale)?;
        if i.softcap != 0.0 {
            be.softcap(&mut logits, i.softcap)?;
        }
        Ok((hidden, logits))
    }
}
