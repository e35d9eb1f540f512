//! Synthetic Muse Glimmer GGUFs: the real architecture and geometry with random weights, for
//! benchmarks and for tests against llama.cpp (`muser synth`).
//!
//! - [`presets::preset`] names a geometry: `muse-glimmer-30b` (the published model's exact
//!   shape, 27,854,794,240 parameters), `bench-310m` (the CPU benchmark model of
//!   `ANCHORS.md`), `tiny` (default SWA pattern) and `tiny-array` (bool-array pattern and a
//!   different layout).
//! - [`WeightType`] picks the tensor types: one type for every matrix (`f32`, `f16`, `q8_0`,
//!   `q4_0`, `q4_k`, `q6_k`, `nvfp4`) or `q4_k_m`, llama-quantize's mix (spec §6.3). Norms
//!   stay F32. A row whose width is not a whole number of blocks falls back the way
//!   llama-quantize does (Q4_K→Q5_0, Q6_K→Q8_0, otherwise F16).
//! - [`Vocab`]: no tokenizer (`tokenizer.ggml.model = "none"`, enough for llama-bench) or a
//!   donor GGUF's tokenizer with the Muse special tokens appended as control tokens,
//!   `eot_token_id` set to `<|eot|>`, and the Muse chat template.
//! - [`dflash::write_drafter`] writes a DFlash drafter for a given target (`dflash-*` presets).
//! - [`Plan`] is the whole file before any byte is written (metadata, tensors and their types),
//!   so parameter counts are known without writing; [`Plan::write`] streams it, a chunk of
//!   rows at a time, generating rows in parallel.
//!
//! Weights are deterministic in the seed: matrices are N(0, 1/fan_in) (the output matrix
//! 4× wider, so greedy picks are clear; the embedding N(0, 1) since it is RMS-normed before
//! use), norms 1 + N(0, 0.1²), `attn_q_norm` the constant [`presets::QK_NORM_SCALE`],
//! `attn_k_norm` ones, all encoded with muser-quant's reference quantizers. Presets marked
//! `raw_blocks` (the 30B one: quantizing 28e9 normal samples would take an hour on two cores)
//! instead get random quant bits in valid blocks with fixed small scales chosen to give the
//! same standard deviation, as llama.cpp's `synth_muse.py` does.

pub mod dflash;
pub mod presets;
mod weights;

pub use weights::{random_row, write_random_tensors, RandomTensor};

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use muser_gguf::{Array, GgmlType, GgufFile, GgufWriter, Value};
use rayon::prelude::*;

use presets::{Preset, Role, SwaPattern, TensorSpec};

/// The architecture name written to `general.architecture`.
pub const ARCH: &str = "muse-glimmer";

/// Errors of the synthetic writer.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown preset '{name}' (known: {})", presets::PRESET_NAMES.join(", "))]
    UnknownPreset { name: String },
    #[error("unknown weight type '{name}' (known: {})", WeightType::NAMES.join(", "))]
    UnknownType { name: String },
    #[error("donor vocabulary: {0}")]
    Donor(String),
    #[error(transparent)]
    Gguf(#[from] muser_gguf::Error),
    #[error(transparent)]
    Quant(#[from] muser_quant::QuantError),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// The `--type` of `muser synth`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum WeightType {
    F32,
    F16,
    Q8_0,
    Q4_0,
    Q4_K,
    Q6_K,
    NVFP4,
    /// llama-quantize's Q4_K_M recipe for muse-glimmer.
    Q4_K_M,
}

impl WeightType {
    /// Accepted names.
    pub const NAMES: [&'static str; 8] = [
        "f32", "f16", "q8_0", "q4_0", "q4_k", "q6_k", "nvfp4", "q4_k_m",
    ];

    const ALL: [WeightType; 8] = [
        WeightType::F32,
        WeightType::F16,
        WeightType::Q8_0,
        WeightType::Q4_0,
        WeightType::Q4_K,
        WeightType::Q6_K,
        WeightType::NVFP4,
        WeightType::Q4_K_M,
    ];

    /// Parses a name (case-insensitive).
    pub fn from_name(name: &str) -> Result<WeightType, SynthError> {
        Self::NAMES
            .iter()
            .position(|n| n.eq_ignore_ascii_case(name))
            .map(|i| Self::ALL[i])
            .ok_or_else(|| SynthError::UnknownType {
                name: name.to_string(),
            })
    }

    /// The name `from_name` accepts.
    pub fn name(self) -> &'static str {
        Self::NAMES[Self::ALL.iter().position(|t| *t == self).unwrap_or(0)]
    }

    /// llama.cpp's `general.file_type` (`enum llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            WeightType::F32 => 0,
            WeightType::F16 => 1,
            WeightType::Q4_0 => 2,
            WeightType::Q8_0 => 7,
            WeightType::Q4_K => 14,
            WeightType::Q4_K_M => 15,
            WeightType::Q6_K => 18,
            WeightType::NVFP4 => 39,
        }
    }

    fn base(self) -> GgmlType {
        match self {
            WeightType::F32 => GgmlType::F32,
            WeightType::F16 => GgmlType::F16,
            WeightType::Q8_0 => GgmlType::Q8_0,
            WeightType::Q4_0 => GgmlType::Q4_0,
            WeightType::Q4_K | WeightType::Q4_K_M => GgmlType::Q4_K,
            WeightType::Q6_K => GgmlType::Q6_K,
            WeightType::NVFP4 => GgmlType::NVFP4,
        }
    }
}

/// llama-quantize's `use_more_bits(i, n)`: the layers that get Q6_K under Q4_K_M.
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// `n` pseudo-random token ids below `n_vocab` from `seed` (a 64-bit LCG, high bits): the
/// fixed prompts of synthetic-model tests and benchmarks, which need no tokenizer.
pub fn random_tokens(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % n_vocab.max(1) as u64) as u32
        })
        .collect()
}

/// The type of one tensor under weight type `wt` (norms are F32).
pub fn tensor_type(wt: WeightType, spec: &TensorSpec, n_layer: usize) -> GgmlType {
    let wanted = match (wt, spec.role, spec.layer) {
        (_, Role::Norm, _) => return GgmlType::F32,
        (WeightType::Q4_K_M, Role::Output, _) => GgmlType::Q6_K,
        (WeightType::Q4_K_M, Role::AttnV | Role::FfnDown, Some(il))
            if use_more_bits(il, n_layer) =>
        {
            GgmlType::Q6_K
        }
        (wt, _, _) => wt.base(),
    };
    fallback(wanted, spec.dims[0])
}

/// llama-quantize's `tensor_type_fallback` for rows that are not whole blocks.
fn fallback(ty: GgmlType, ne0: u64) -> GgmlType {
    let fits = |t: GgmlType| ne0.is_multiple_of(t.block_size() as u64);
    if fits(ty) {
        return ty;
    }
    let next = match ty {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q6_K => GgmlType::Q8_0,
        _ => GgmlType::F16,
    };
    if fits(next) {
        next
    } else {
        GgmlType::F16
    }
}

/// The tokenizer part of the file.
#[derive(Clone, Debug, PartialEq)]
pub struct Vocab {
    pub n_tokens: usize,
    metadata: Vec<(String, Value)>,
}

impl Vocab {
    /// No tokenizer: `tokenizer.ggml.model = "none"` and `n_tokens` dummy tokens (llama.cpp
    /// reads the count from `<arch>.vocab_size`).
    pub fn none(n_tokens: usize) -> Vocab {
        Vocab {
            n_tokens,
            metadata: vec![("tokenizer.ggml.model".into(), Value::from("none"))],
        }
    }

    /// The donor's `tokenizer.*` entries, with each of `specials` that the donor lacks
    /// appended as a control token, `eot_token_id` pointing at `<|eot|>` (when listed), and
    /// `chat_template` as the template.
    pub fn from_donor(
        donor: &GgufFile,
        specials: &[&str],
        chat_template: &str,
    ) -> Result<Vocab, SynthError> {
        let mut tokens: Vec<String> = donor
            .get_str_array("tokenizer.ggml.tokens")?
            .into_iter()
            .map(str::to_string)
            .collect();
        let n_donor = tokens.len();
        for s in specials {
            if !tokens.iter().any(|t| t == s) {
                tokens.push(s.to_string());
            }
        }
        let n_added = tokens.len() - n_donor;
        let eot = tokens.iter().position(|t| t == "<|eot|>");
        let mut metadata = Vec::new();
        for (key, value) in donor.metadata() {
            if !key.starts_with("tokenizer.")
                || key.starts_with("tokenizer.chat_template")
                || key == "tokenizer.ggml.eot_token_id"
            {
                continue;
            }
            let value = match (key.as_str(), value) {
                ("tokenizer.ggml.tokens", _) => Value::Array(Array::String(tokens.clone())),
                ("tokenizer.ggml.token_type", Value::Array(Array::I32(types))) => {
                    let mut types = types.clone();
                    types.resize(n_donor, 1);
                    types.extend(std::iter::repeat_n(3, n_added)); // CONTROL
                    Value::Array(Array::I32(types))
                }
                ("tokenizer.ggml.scores", Value::Array(Array::F32(scores))) => {
                    let mut scores = scores.clone();
                    scores.resize(n_donor, 0.0);
                    scores.extend(std::iter::repeat_n(0.0, n_added));
                    Value::Array(Array::F32(scores))
                }
                (_, Value::Array(a)) if a.len() == n_donor && n_added > 0 => {
                    return Err(SynthError::Donor(format!(
                        "per-token array '{key}' of type {} cannot be extended",
                        a.type_desc()
                    )))
                }
                _ => value.clone(),
            };
            metadata.push((key.clone(), value));
        }
        if let Some(eot) = eot {
            metadata.push(("tokenizer.ggml.eot_token_id".into(), Value::U32(eot as u32)));
        }
        metadata.push(("tokenizer.chat_template".into(), Value::from(chat_template)));
        Ok(Vocab {
            n_tokens: tokens.len(),
            metadata,
        })
    }
}

/// One tensor as it will be written.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTensor {
    pub spec: TensorSpec,
    pub ty: GgmlType,
}

impl PlannedTensor {
    fn row_len(&self) -> usize {
        self.spec.dims[0] as usize
    }

    fn n_rows(&self) -> u64 {
        self.spec.dims[1..].iter().product()
    }

    fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.row_len()).unwrap_or(0)
    }

    /// Values in the tensor.
    pub fn n_elements(&self) -> u64 {
        self.spec.dims.iter().product()
    }

    /// Bytes of data in the tensor.
    pub fn n_bytes(&self) -> u64 {
        self.row_bytes() as u64 * self.n_rows()
    }
}

/// Progress of [`Plan::write`].
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    pub tensor: &'a str,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// A whole synthetic file, before writing.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub preset: Preset,
    pub weight_type: WeightType,
    pub seed: u64,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<PlannedTensor>,
}

/// Rows are generated and written this many output bytes at a time.
const CHUNK_BYTES: usize = 8 << 20;

impl Plan {
    /// Lays out the file: metadata, tensors and their types. `vocab` defaults to
    /// [`Vocab::none`] with the preset's vocabulary size.
    pub fn new(preset: Preset, weight_type: WeightType, seed: u64, vocab: Option<Vocab>) -> Plan {
        let g = &preset.geometry;
        let vocab = vocab.unwrap_or_else(|| Vocab::none(g.n_vocab));
        let tensors = presets::tensor_specs(g, vocab.n_tokens)
            .into_iter()
            .map(|spec| PlannedTensor {
                ty: tensor_type(weight_type, &spec, g.n_layer),
                spec,
            })
            .collect();
        let k = |s: &str| format!("{ARCH}.{s}");
        let u = |x: usize| Value::U32(x as u32);
        let mut metadata = vec![
            ("general.architecture".to_string(), Value::from(ARCH)),
            ("general.name".into(), Value::from(format!("muse-glimmer-synthetic-{}", preset.name).as_str())),
            (
                "general.description".into(),
                Value::from(
                    format!(
                        "synthetic Muse Glimmer with random weights (muser synth, preset {}, type {}, seed {seed})",
                        preset.name,
                        weight_type.name()
                    )
                    .as_str(),
                ),
            ),
            ("general.file_type".into(), Value::U32(weight_type.file_type())),
            ("general.quantization_version".into(), Value::U32(2)),
            (k("block_count"), u(g.n_layer)),
            (k("context_length"), Value::U32(g.n_ctx_train)),
            (k("embedding_length"), u(g.n_embd)),
            (k("feed_forward_length"), u(g.n_ff)),
            (k("attention.head_count"), u(g.n_head)),
            (k("attention.head_count_kv"), u(g.n_head_kv)),
            (k("attention.key_length"), u(g.head_dim)),
            (k("attention.value_length"), u(g.head_dim)),
            (k("attention.layer_norm_rms_epsilon"), Value::F32(g.rms_eps)),
            (k("attention.sliding_window"), Value::U32(g.n_swa)),
            (
                k("attention.sliding_window_pattern"),
                match &g.pattern {
                    SwaPattern::Period(n) => Value::U32(*n),
                    SwaPattern::Layers(v) => Value::Array(Array::Bool(v.clone())),
                },
            ),
            (k("rope.freq_base"), Value::F32(g.rope_freq_base)),
            (k("rope.freq_base_swa"), Value::F32(g.rope_freq_base_swa)),
            (k("logit_scale"), Value::F32(g.logit_scale)),
            (k("final_logit_softcapping"), Value::F32(g.final_logit_softcap)),
            (k("vocab_size"), u(vocab.n_tokens)),
        ];
        metadata.extend(vocab.metadata);
        Plan {
            preset,
            weight_type,
            seed,
            metadata,
            tensors,
        }
    }

    /// The same file without tensors: geometry and tokenizer only (a vocabulary file, small
    /// enough to carry, that `--vocab-from` takes as a donor again).
    pub fn without_tensors(mut self) -> Plan {
        self.tensors.clear();
        self
    }

    /// Total parameters (values in all tensors).
    pub fn n_params(&self) -> u64 {
        self.tensors.iter().map(PlannedTensor::n_elements).sum()
    }

    /// Total bytes of tensor data (without alignment padding).
    pub fn n_bytes(&self) -> u64 {
        self.tensors.iter().map(PlannedTensor::n_bytes).sum()
    }

    /// Streams the file to `out`, calling `progress` after each chunk.
    pub fn write<W: Write>(
        &self,
        out: W,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<W, SynthError> {
        let mut w = GgufWriter::new(out, 3)?;
        for (key, value) in &self.metadata {
            w.add(key, value.clone())?;
        }
        for t in &self.tensors {
            w.add_tensor_info(&t.spec.name, &t.spec.dims, t.ty)?;
        }
        w.write_header()?;
        let bytes_total = self.n_bytes();
        let mut bytes_done = 0;
        let mut buf = Vec::new();
        for t in &self.tensors {
            let row_bytes = t.row_bytes();
            let rows_per_chunk = (CHUNK_BYTES / row_bytes.max(1)).max(1) as u64;
            let mut row = 0;
            while row < t.n_rows() {
                let n = rows_per_chunk.min(t.n_rows() - row);
                buf.resize(n as usize * row_bytes, 0);
                self.fill_rows(t, row, &mut buf)?;
                w.write_tensor_chunk(&t.spec.name, &buf)?;
                row += n;
                bytes_done += buf.len() as u64;
                progress(Progress {
                    tensor: &t.spec.name,
                    bytes_done,
                    bytes_total,
                });
            }
        }
        Ok(w.finish()?)
    }

    /// Generates rows `first..` of `t` into `buf` (whole rows), in parallel.
    fn fill_rows(&self, t: &PlannedTensor, first: u64, buf: &mut [u8]) -> Result<(), SynthError> {
        let encode = if self.preset.raw_blocks {
            weights::raw_row
        } else {
            weights::quantized_row
        };
        buf.par_chunks_mut(t.row_bytes())
            .enumerate()
            .try_for_each_init(Vec::new, |scratch, (i, out)| {
                let mut rng = weights::row_rng(self.seed, &t.spec.name, first + i as u64);
                encode(t.ty, t.spec.init, &mut rng, scratch, t.row_len(), out)
            })
    }

    /// Writes the file at `path` (removed again if writing fails).
    pub fn write_file(
        &self,
        path: &Path,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<(), SynthError> {
        let io = |source| SynthError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::create(path).map_err(io)?;
        let result = self
            .write(BufWriter::with_capacity(1 << 20, file), progress)
            .and_then(|w| w.into_inner().map_err(|e| io(e.into_error())))
            .and_then(|f| f.sync_all().map_err(io));
        if result.is_err() {
            let _ = std::fs::remove_file(path);
        }
        result
    }
}

#[cfg(test)]
mod tests;
