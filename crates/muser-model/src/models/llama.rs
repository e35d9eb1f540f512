//! `llama` (SmolLM2 and friends), as llama.cpp b11434 runs it (`src/models/llama.cpp`):
//! pre-norm blocks, RoPE NORM on Q and K, grouped-query attention, SwiGLU FFN, and the token
//! embedding reused as the output matrix when `output.weight` is absent (tied embeddings).

use super::{attend, embed, linear, rope_qk, swiglu_ffn, Capture, Head, Prepared, Tensors, WRef};
use crate::backend::Backend;
use crate::error::ModelError;
use crate::info::ModelInfo;
use crate::kv::KvCache;
use crate::InputEmbd;
use muser_gguf::GgufFile;

struct Layer {
    attn_norm: Vec<f32>,
    wq: WRef,
    wk: WRef,
    wv: WRef,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    wo: WRef,
    bo: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    ffn_gate: WRef,
    ffn_up: WRef,
    ffn_down: WRef,
}

pub struct Llama {
    tok_embd: WRef,
    output_norm: Vec<f32>,
    output: WRef,
    layers: Vec<Layer>,
}

impl Llama {
    pub fn load(t: &Tensors, i: &ModelInfo) -> Result<Llama, ModelError> {
        let (e, hd, ff) = (i.n_embd, i.head_dim, i.n_ff);
        let (qw, kvw) = (i.n_head * hd, i.n_head_kv * hd);
        if i.n_rot != hd {
            return Err(ModelError::BadModel(format!(
                "llama needs rope.dimension_count == head dim ({hd})"
            )));
        }
        let mut layers = Vec::with_capacity(i.n_layer);
        for il in 0..i.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            if t.g.tensor(&n("ffn_gate_inp.weight")).is_some() {
                return Err(ModelError::BadModel(
                    "mixture-of-experts llama models are not supported".into(),
                ));
            }
            layers.push(Layer {
                attn_norm: t.vec(&n("attn_norm.weight"), e)?,
                wq: t.mat(&n("attn_q.weight"), e, qw)?,
                wk: t.mat(&n("attn_k.weight"), e, kvw)?,
                wv: t.mat(&n("attn_v.weight"), e, kvw)?,
                bq: t.opt_vec(&n("attn_q.bias"), qw)?,
                bk: t.opt_vec(&n("attn_k.bias"), kvw)?,
                bv: t.opt_vec(&n("attn_v.bias"), kvw)?,
                wo: t.mat(&n("attn_output.weight"), qw, e)?,
                bo: t.opt_vec(&n("attn_output.bias"), e)?,
                ffn_norm: t.vec(&n("ffn_norm.weight"), e)?,
                ffn_gate: t.mat(&n("ffn_gate.weight"), e, ff)?,
                ffn_up: t.mat(&n("ffn_up.weight"), e, ff)?,
                ffn_down: t.mat(&n("ffn_down.weight"), ff, e)?,
            });
        }
        let tok_embd = t.mat("token_embd.weight", e, i.n_vocab)?;
        let output = t
            .opt_mat("output.weight", e, i.n_vocab)?
            .unwrap_or_else(|| tok_embd.clone());
        Ok(Llama {
            tok_embd,
            output_norm: t.vec("output_norm.weight", e)?,
            output,
            layers,
        })
    }

    pub fn head(&self) -> Head {
        Head {
            tok_embd: self.tok_embd.clone(),
            output: self.output.clone(),
            output_scale: None,
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
        // Each intermediate is dropped as soon as it is used, so a large batch holds few of
        // them at once.
        for (il, l) in self.layers.iter().enumerate() {
            cap.layer(be, il, &x)?;
            let a = {
                let h = be.rms_norm(&x, i.n_embd, eps, Some(&l.attn_norm))?;
                let mut q = linear(be, g, &l.wq, l.bq.as_deref(), None, &h)?;
                let mut k = linear(be, g, &l.wk, l.bk.as_deref(), None, &h)?;
                let v = linear(be, g, &l.wv, l.bv.as_deref(), None, &h)?;
                drop(h);
                rope_qk(be, i, &mut q, &mut k, pos, i.rope_base)?;
                let a = attend(be, i, kv, prep, pos, il, &q, &k, &v)?;
                drop((q, k, v));
                linear(be, g, &l.wo, l.bo.as_deref(), None, &a)?
            };
            let mut a = a;
            if il + 1 == self.layers.len() {
                a = be.select_rows(&a, &prep.out_rows)?;
                x = be.select_rows(&x, &prep.out_rows)?;
            }
            be.add(&mut a, &x)?;
            drop(x);
            let ffn_inp = a;
            let h2 = be.rms_norm(&ffn_inp, i.n_embd, eps, Some(&l.ffn_norm))?;
            let mut f = swiglu_ffn(be, g, &l.ffn_gate, &l.ffn_up, &l.ffn_down, h2)?;
            be.add(&mut f, &ffn_inp)?;
            x = f;
        }
        let mut hidden = x;
        be.rms_norm_mut(&mut hidden, i.n_embd, eps, Some(&self.output_norm))?;
        let logits = linear(be, g, &self.output, None, None, &hidden)?;
        Ok((hidden, logits))
    }
}
