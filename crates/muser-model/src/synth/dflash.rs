//! Synthetic DFlash drafters (`muser synth --preset dflash-*`): llama.cpp's `dflash`
//! architecture (`src/models/dflash.cpp`) with random weights, made for one target model. The
//! drafter's width is the target's (llama.cpp requires it), its tokenizer is the target's, and
//! like the published drafters it has no embedding or output matrix of its own: it borrows the
//! target's. Random weights propose tokens the target rarely accepts; these files are for
//! checking the computation against llama.cpp, not for speed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use muser_gguf::{Array, GgmlType, GgufFile, GgufWriter, Value};

use super::presets::Init;
use super::{write_random_tensors, RandomTensor, SynthError};

/// A drafter geometry; the width and vocabulary come from the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DflashPreset {
    pub name: &'static str,
    pub n_layer: usize,
    pub head_dim: usize,
    /// Feed-forward width as a multiple of the embedding width.
    pub ff_mult: usize,
    /// `dflash.block_size`: the mask block it was trained on (at most `block_size - 1` drafts).
    pub block_size: u32,
    /// How many target layers feed it, spread over the target's depth.
    pub n_target_layers: usize,
}

/// `dflash-tiny`: one layer, three target layers, blocks of 8.
pub const PRESETS: [DflashPreset; 1] = [DflashPreset {
    name: "dflash-tiny",
    n_layer: 1,
    head_dim: 64,
    ff_mult: 2,
    block_size: 8,
    n_target_layers: 3,
}];

/// Names accepted by [`preset`].
pub const PRESET_NAMES: [&str; 1] = ["dflash-tiny"];

/// The drafter preset called `name`, if it is one.
pub fn preset(name: &str) -> Option<DflashPreset> {
    PRESETS.iter().find(|p| p.name == name).copied()
}

/// The target layers (inputs of layers `1..n_layer`) a drafter of `n` of them reads: the
/// second layer's input, the last's, and evenly between.
pub fn target_layers(n: usize, n_layer_target: usize) -> Vec<u32> {
    let (lo, hi) = (1, n_layer_target.saturating_sub(1).max(1));
    if n <= 1 {
        return vec![hi as u32];
    }
    (0..n)
        .map(|k| (lo + k * (hi - lo) / (n - 1)) as u32)
        .collect()
}

/// Writes a drafter for `target` at `path`, matrices in `matrix` (f32 or f16).
pub fn write_drafter(
    path: &Path,
    p: &DflashPreset,
    target: &GgufFile,
    matrix: GgmlType,
    seed: u64,
) -> Result<(), SynthError> {
    if !matches!(matrix, GgmlType::F32 | GgmlType::F16) {
        return Err(SynthError::Donor(format!(
            "a synthetic drafter's matrices are f32 or f16, not {matrix}"
        )));
    }
    let arch = target.architecture()?;
    let n_embd = target.get_uint(&format!("{arch}.embedding_length"))? as usize;
    let n_layer_target = target.get_uint(&format!("{arch}.block_count"))? as usize;
    let n_vocab = target.get_str_array("tokenizer.ggml.tokens")?.len();
    if n_embd == 0 || !n_embd.is_multiple_of(p.head_dim) || n_layer_target < 2 {
        return Err(SynthError::Donor(format!(
            "the target ({n_embd} wide, {n_layer_target} layers) needs a width that is a \
             multiple of {} and at least 2 layers",
            p.head_dim
        )));
    }
    let n_head = n_embd / p.head_dim;
    let layers = target_layers(p.n_target_layers, n_layer_target);
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::from("dflash")),
        (
            "general.name".into(),
            Value::from(format!("synthetic-{}", p.name).as_str()),
        ),
        (
            "general.file_type".into(),
            Value::U32(if matrix == GgmlType::F16 { 1 } else { 0 }),
        ),
    ];
    let k = |s: &str| format!("dflash.{s}");
    let u = |x: usize| Value::U32(x as u32);
    meta.extend([
        (k("block_count"), u(p.n_layer)),
        (k("context_length"), u(8192)),
        (k("embedding_length"), u(n_embd)),
        (k("feed_forward_length"), u(p.ff_mult * n_embd)),
        (k("attention.head_count"), u(n_head)),
        (k("attention.head_count_kv"), u(n_head)),
        (k("attention.key_length"), u(p.head_dim)),
        (k("attention.value_length"), u(p.head_dim)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (k("rope.freq_base"), Value::F32(1_000_000.0)),
        (k("block_size"), Value::U32(p.block_size)),
        (
            k("target_layers"),
            Value::Array(Array::I32(layers.iter().map(|&l| l as i32).collect())),
        ),
    ]);
    for (key, value) in target.metadata() {
        if key.starts_with("tokenizer.") && key != "tokenizer.ggml.mask_token_id" {
            meta.push((key.clone(), value.clone()));
        }
    }
    // The target's last token stands in for the mask token a trained drafter brings.
    let mask = target
        .get_opt_u32("tokenizer.ggml.mask_token_id")?
        .unwrap_or(n_vocab as u32 - 1);
    meta.push(("tokenizer.ggml.mask_token_id".into(), Value::U32(mask)));

    let list = tensors(p, n_embd, layers.len(), matrix);
    let io = |source| SynthError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::create(path).map_err(io)?;
    let mut w = GgufWriter::new(BufWriter::new(file), 3)?;
    for (key, value) in meta {
        w.add(&key, value)?;
    }
    write_random_tensors(w, &list, seed)?.flush().map_err(io)?;
    Ok(())
}

/// The tensors of llama.cpp's plain DFlash drafter without its optional ones.
fn tensors(p: &DflashPreset, e: usize, n_tl: usize, matrix: GgmlType) -> Vec<RandomTensor> {
    let (e, ff, hd) = (e as u64, (p.ff_mult as u64) * e as u64, p.head_dim as u64);
    let mat = |name: String, n_in: u64, n_out: u64| RandomTensor {
        name,
        dims: vec![n_in, n_out],
        init: Init::Normal {
            std: 1.0 / (n_in as f32).sqrt(),
        },
        ty: matrix,
    };
    let norm = |name: String, n: u64| RandomTensor {
        name,
        dims: vec![n],
        init: Init::NearOne,
        ty: GgmlType::F32,
    };
    let mut out = vec![
        mat("fc.weight".into(), n_tl as u64 * e, e),
        norm("enc.output_norm.weight".into(), e),
        norm("output_norm.weight".into(), e),
    ];
    for il in 0..p.n_layer {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        out.extend([
            norm(n("attn_norm"), e),
            mat(n("attn_q"), e, e),
            mat(n("attn_k"), e, e),
            mat(n("attn_v"), e, e),
            mat(n("attn_output"), e, e),
            norm(n("attn_q_norm"), hd),
            norm(n("attn_k_norm"), hd),
            norm(n("ffn_norm"), e),
            mat(n("ffn_gate"), e, ff),
            mat(n("ffn_up"), e, ff),
            mat(n("ffn_down"), ff, e),
        ]);
    }
    out
}
