//! Model geometries `muser synth` can write, and the tensor list of Muse Glimmer
//! (spec §2.1) they expand to.

use super::SynthError;

/// Which layers use sliding-window attention.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SwaPattern {
    /// Written as the scalar u32 `n`: layer `il` is SWA iff `il % n < n - 1` (llama.cpp's
    /// default is 4: three SWA layers, then one full).
    Period(u32),
    /// Written as a bool array, true = SWA, one per layer.
    Layers(Vec<bool>),
}

/// Hyperparameters of a Muse Glimmer model.
#[derive(Clone, Debug, PartialEq)]
pub struct Geometry {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    /// Vocabulary size when no donor vocabulary is given.
    pub n_vocab: usize,
    pub n_swa: u32,
    pub n_ctx_train: u32,
    pub pattern: SwaPattern,
    pub rope_freq_base: f32,
    pub rope_freq_base_swa: f32,
    pub logit_scale: f32,
    pub final_logit_softcap: f32,
    pub rms_eps: f32,
}

/// A named geometry.
#[derive(Clone, Debug, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub geometry: Geometry,
    /// Write cheap random bytes (valid blocks with small fixed scales, uniform floats) instead
    /// of quantizing normal samples: for presets too large to quantize in reasonable time.
    pub raw_blocks: bool,
}

/// Names accepted by [`preset`].
pub const PRESET_NAMES: [&str; 4] = ["muse-glimmer-30b", "bench-310m", "tiny", "tiny-array"];

/// The preset called `name`.
pub fn preset(name: &str) -> Result<Preset, SynthError> {
    let muse = Geometry {
        n_layer: 52,
        n_embd: 6656,
        n_head: 32,
        n_head_kv: 2,
        head_dim: 128,
        n_ff: 19968,
        n_vocab: 202048,
        n_swa: 2048,
        n_ctx_train: 131072,
        pattern: SwaPattern::Period(4),
        rope_freq_base: 500_000.0,
        rope_freq_base_swa: 500_000.0,
        logit_scale: 1.0 / 26f32.sqrt(),
        final_logit_softcap: 20.0,
        rms_eps: 1e-5,
    };
    let (geometry, raw_blocks) = match name {
        "muse-glimmer-30b" => (muse, true),
        "bench-310m" => (
            Geometry {
                n_layer: 16,
                n_embd: 1024,
                n_head: 8,
                n_ff: 3072,
                n_vocab: 49152,
                n_swa: 512,
                ..muse
            },
            false,
        ),
        "tiny" => (
            Geometry {
                n_layer: 4,
                n_embd: 256,
                n_head: 4,
                head_dim: 64,
                n_ff: 512,
                n_vocab: 512,
                n_swa: 32,
                n_ctx_train: 4096,
                ..muse
            },
            false,
        ),
        // A different layout on every axis the code branches on: bool-array pattern, GQA ratio
        // 2, head_dim 32, distinct RoPE bases, other scale and cap.
        "tiny-array" => (
            Geometry {
                n_layer: 5,
                n_embd: 512,
                n_head: 8,
                n_head_kv: 4,
                head_dim: 32,
                n_ff: 768,
                n_vocab: 640,
                n_swa: 16,
                n_ctx_train: 4096,
                pattern: SwaPattern::Layers(vec![true, false, true, true, false]),
                rope_freq_base: 1_000_000.0,
                rope_freq_base_swa: 10_000.0,
                logit_scale: 0.5,
                final_logit_softcap: 30.0,
                rms_eps: 1e-6,
            },
            false,
        ),
        _ => {
            return Err(SynthError::UnknownPreset {
                name: name.to_string(),
            })
        }
    };
    Ok(Preset {
        name: PRESET_NAMES
            .iter()
            .find(|n| **n == name)
            .copied()
            .unwrap_or("custom"),
        geometry,
        raw_blocks,
    })
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// N(0, std²).
    Normal { std: f32 },
    /// 1 + N(0, 0.1²): RMS-norm weights with the +1 already folded in.
    NearOne,
    /// Every value equal (attn_q_norm carries the constant qk scale, attn_k_norm is ones).
    Constant(f32),
}

/// What role a tensor plays; decides its type under each weight type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    TokenEmbd,
    Output,
    Norm,
    AttnQ,
    AttnK,
    AttnV,
    AttnGate,
    AttnOutput,
    FfnGate,
    FfnUp,
    FfnDown,
}

/// One tensor of the model before a type is chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    /// ggml order: `dims[0]` is the input width of a weight matrix.
    pub dims: Vec<u64>,
    pub role: Role,
    /// Layer index for per-layer tensors.
    pub layer: Option<usize>,
    pub init: Init,
}

/// attn_q_norm's constant: the qk scale the converter folds into it.
pub const QK_NORM_SCALE: f32 = 1.5;

/// Every tensor of a Muse Glimmer model with `n_vocab` tokens, in the order written.
pub fn tensor_specs(g: &Geometry, n_vocab: usize) -> Vec<TensorSpec> {
    let (e, v, q, kv, ff) = (
        g.n_embd as u64,
        n_vocab as u64,
        (g.n_head * g.head_dim) as u64,
        (g.n_head_kv * g.head_dim) as u64,
        g.n_ff as u64,
    );
    let proj = |fan_in: u64| Init::Normal {
        std: 1.0 / (fan_in as f32).sqrt(),
    };
    let spec = |name: String, dims: Vec<u64>, role, layer, init| TensorSpec {
        name,
        dims,
        role,
        layer,
        init,
    };
    let mut out = vec![
        // The embedding row is RMS-normed before use, so its scale is free.
        spec(
            "token_embd.weight".into(),
            vec![e, v],
            Role::TokenEmbd,
            None,
            Init::Normal { std: 1.0 },
        ),
        spec(
            "output_norm.weight".into(),
            vec![e],
            Role::Norm,
            None,
            Init::NearOne,
        ),
        // Four times the fan-in scale spreads the logits enough that greedy picks are clear.
        spec(
            "output.weight".into(),
            vec![e, v],
            Role::Output,
            None,
            Init::Normal {
                std: 4.0 / (e as f32).sqrt(),
            },
        ),
    ];
    for il in 0..g.n_layer {
        let l = Some(il);
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        out.extend([
            spec(n("attn_norm"), vec![e], Role::Norm, l, Init::NearOne),
            spec(n("attn_q"), vec![e, q], Role::AttnQ, l, proj(e)),
            spec(n("attn_k"), vec![e, kv], Role::AttnK, l, proj(e)),
            spec(n("attn_v"), vec![e, kv], Role::AttnV, l, proj(e)),
            spec(
                n("attn_q_norm"),
                vec![g.head_dim as u64],
                Role::Norm,
                l,
                Init::Constant(QK_NORM_SCALE),
            ),
            spec(
                n("attn_k_norm"),
                vec![g.head_dim as u64],
                Role::Norm,
                l,
                Init::Constant(1.0),
            ),
            spec(n("attn_gate"), vec![e, q], Role::AttnGate, l, proj(e)),
            spec(n("attn_output"), vec![q, e], Role::AttnOutput, l, proj(q)),
            spec(
                n("post_attention_norm"),
                vec![e],
                Role::Norm,
                l,
                Init::NearOne,
            ),
            spec(n("ffn_norm"), vec![e], Role::Norm, l, Init::NearOne),
            spec(n("ffn_gate"), vec![e, ff], Role::FfnGate, l, proj(e)),
            spec(n("ffn_up"), vec![e, ff], Role::FfnUp, l, proj(e)),
            spec(n("ffn_down"), vec![ff, e], Role::FfnDown, l, proj(ff)),
            spec(n("post_ffw_norm"), vec![e], Role::Norm, l, Init::NearOne),
        ]);
    }
    out
}
