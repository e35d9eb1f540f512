//! Model hyperparameters, read from GGUF metadata as llama.cpp b11434 reads them.

use crate::error::ModelError;
use muser_gguf::{Array, GgufFile, Value};

/// The architectures Muser runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `muse-glimmer`: sandwich norms, gated attention, RoPE on sliding layers only.
    MuseGlimmer,
    /// `llama` (SmolLM2 and friends).
    Llama,
}

impl Arch {
    /// The `general.architecture` string.
    pub fn name(self) -> &'static str {
        match self {
            Arch::MuseGlimmer => "muse-glimmer",
            Arch::Llama => "llama",
        }
    }
}

/// Geometry and scalars of a loaded model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelInfo {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_ctx_train: u32,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_rot: usize,
    /// Sliding window (0 when no layer slides).
    pub n_swa: u32,
    /// Per layer: sliding-window attention.
    pub is_swa: Vec<bool>,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// RoPE base of sliding layers (muse-glimmer); equals `rope_base` otherwise.
    pub rope_base_swa: f32,
    /// `q·k` scale.
    pub attn_scale: f32,
    /// Logits are multiplied by this (1 when the arch has none).
    pub logit_scale: f32,
    /// Final logit softcap (0 = none).
    pub softcap: f32,
    /// Bytes of the model file.
    pub file_bytes: u64,
}

/// Upper bounds on what a file may declare, so a corrupt header cannot drive huge allocations.
const MAX_LAYERS: u64 = 512;
const MAX_DIM: u64 = 1 << 20;
const MAX_HEADS: u64 = 4096;

fn key(arch: &str, k: &str) -> String {
    format!("{arch}.{k}")
}

fn bounded(g: &GgufFile, k: &str, max: u64) -> Result<usize, ModelError> {
    let v = g.get_uint(k)?;
    if v == 0 || v > max {
        return Err(ModelError::BadModel(format!(
            "{k} = {v} is outside 1..={max}"
        )));
    }
    Ok(v as usize)
}

fn opt_uint(g: &GgufFile, k: &str) -> Result<Option<u64>, ModelError> {
    match g.get(k) {
        None => Ok(None),
        Some(_) => Ok(Some(g.get_uint(k)?)),
    }
}

/// A per-layer or scalar count key: llama.cpp accepts either; muser needs one value.
fn uniform(g: &GgufFile, k: &str, n_layer: usize, max: u64) -> Result<Option<usize>, ModelError> {
    let vals: Vec<u64> = match g.get(k) {
        None => return Ok(None),
        Some(Value::Array(Array::U32(a))) => a.iter().map(|&x| x as u64).collect(),
        Some(Value::Array(Array::I32(a))) => a.iter().map(|&x| x.max(0) as u64).collect(),
        Some(_) => vec![g.get_uint(k)?],
    };
    let first = *vals
        .first()
        .ok_or_else(|| ModelError::BadModel(format!("{k} is an empty array")))?;
    if vals.iter().take(n_layer).any(|&v| v != first) {
        return Err(ModelError::BadModel(format!(
            "{k} varies per layer, which muser does not support"
        )));
    }
    if first == 0 || first > max {
        return Err(ModelError::BadModel(format!(
            "{k} = {first} is outside 1..={max}"
        )));
    }
    Ok(Some(first as usize))
}

fn vocab_size(g: &GgufFile, arch: &str, token_embd_rows: Option<u64>) -> Result<usize, ModelError> {
    if let Some(v) = opt_uint(g, &key(arch, "vocab_size"))? {
        return Ok(v as usize);
    }
    if let Some(Value::Array(a)) = g.get("tokenizer.ggml.tokens") {
        return Ok(a.len());
    }
    token_embd_rows.map(|r| r as usize).ok_or_else(|| {
        ModelError::BadModel(
            "no vocabulary size: no tokenizer.ggml.tokens and no token_embd".into(),
        )
    })
}

/// Sliding-window pattern (spec §1.3): an array is copied per layer (missing trailing layers are
/// dense); otherwise a period `n` (default 4) makes layer `il` sliding iff `il % n < n - 1`.
fn swa_pattern(g: &GgufFile, k: &str, n_layer: usize) -> Result<Vec<bool>, ModelError> {
    let mut is_swa = vec![false; n_layer];
    match g.get(k) {
        Some(Value::Array(a)) => {
            let flags: Vec<bool> = match a {
                Array::Bool(v) => v.clone(),
                Array::U32(v) => v.iter().map(|&x| x != 0).collect(),
                Array::I32(v) => v.iter().map(|&x| x != 0).collect(),
                _ => {
                    return Err(ModelError::BadModel(format!(
                        "{k} must be a bool, u32 or i32 array"
                    )))
                }
            };
            for (d, s) in is_swa.iter_mut().zip(flags) {
                *d = s;
            }
        }
        other => {
            let n = match other {
                None => 4,
                Some(_) => g.get_u32(k)?,
            };
            for (il, s) in is_swa.iter_mut().enumerate() {
                *s = n == 0 || (il as u32 % n) < n - 1;
            }
        }
    }
    Ok(is_swa)
}

impl ModelInfo {
    pub fn from_gguf(g: &GgufFile, file_bytes: u64) -> Result<ModelInfo, ModelError> {
        let arch_s = g.get_str("general.architecture")?;
        let arch = match arch_s {
            "muse-glimmer" => Arch::MuseGlimmer,
            "llama" => Arch::Llama,
            other => return Err(ModelError::UnsupportedArch(other.to_string())),
        };
        let a = arch_s;
        let n_layer = bounded(g, &key(a, "block_count"), MAX_LAYERS)?;
        let n_embd = bounded(g, &key(a, "embedding_length"), MAX_DIM)?;
        let n_ctx_train = g.get_uint(&key(a, "context_length"))?.min(u32::MAX as u64) as u32;
        let n_ff = uniform(g, &key(a, "feed_forward_length"), n_layer, MAX_DIM)?
            .ok_or_else(|| ModelError::BadModel(format!("{a}.feed_forward_length is missing")))?;
        let n_head = uniform(g, &key(a, "attention.head_count"), n_layer, MAX_HEADS)?
            .ok_or_else(|| ModelError::BadModel(format!("{a}.attention.head_count is missing")))?;
        let n_head_kv =
            uniform(g, &key(a, "attention.head_count_kv"), n_layer, MAX_HEADS)?.unwrap_or(n_head);
        if n_head % n_head_kv != 0 {
            return Err(ModelError::BadModel(format!(
                "n_head {n_head} is not a multiple of n_head_kv {n_head_kv}"
            )));
        }
        let head_dim = match opt_uint(g, &key(a, "attention.key_length"))? {
            Some(v) => v as usize,
            None => n_embd / n_head,
        };
        let v_len =
            opt_uint(g, &key(a, "attention.value_length"))?.map_or(head_dim, |v| v as usize);
        if head_dim == 0 || head_dim > 1024 || v_len != head_dim {
            return Err(ModelError::BadModel(format!(
                "head dims k={head_dim} v={v_len} unsupported"
            )));
        }
        let n_rot = opt_uint(g, &key(a, "rope.dimension_count"))?.map_or(head_dim, |v| v as usize);
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(ModelError::BadModel(format!(
                "rope.dimension_count {n_rot} vs head dim {head_dim}"
            )));
        }
        let rms_eps = g.get_f32(&key(a, "attention.layer_norm_rms_epsilon"))?;
        let rope_base = g.get_opt_f32(&key(a, "rope.freq_base"))?.unwrap_or(10000.0);
        let attn_scale = match g.get_opt_f32(&key(a, "attention.scale"))? {
            Some(s) if s != 0.0 && arch == Arch::Llama => s,
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        let token_rows = g
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied());
        let n_vocab = vocab_size(g, a, token_rows)?;
        let mut info = ModelInfo {
            arch,
            n_vocab,
            n_ctx_train,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            n_rot,
            n_swa: 0,
            is_swa: vec![false; n_layer],
            rms_eps,
            rope_base,
            rope_base_swa: rope_base,
            attn_scale,
            logit_scale: 1.0,
            softcap: 0.0,
            file_bytes,
        };
        if arch == Arch::MuseGlimmer {
            info.n_swa = g.get_u32(&key(a, "attention.sliding_window"))?;
            if info.n_swa == 0 {
                return Err(ModelError::BadModel(
                    "attention.sliding_window must be positive".into(),
                ));
            }
            info.is_swa = swa_pattern(g, &key(a, "attention.sliding_window_pattern"), n_layer)?;
            info.rope_base_swa = g
                .get_opt_f32(&key(a, "rope.freq_base_swa"))?
                .unwrap_or(rope_base);
            info.logit_scale = g.get_f32(&key(a, "logit_scale"))?;
            info.softcap = g
                .get_opt_f32(&key(a, "final_logit_softcapping"))?
                .unwrap_or(30.0);
            if !info.is_swa.iter().any(|&s| s) {
                info.n_swa = 0;
            }
        }
        Ok(info)
    }

    /// K (or V) bytes one position occupies across all layers for a cache element size.
    pub fn kv_bytes_per_token(&self, elem: usize) -> usize {
        2 * self.n_layer * self.n_head_kv * self.head_dim * elem
    }
}
