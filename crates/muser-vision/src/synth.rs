//! Synthetic Muse Glimmer projectors (`muser synth --preset vision-*`): the keys and tensor
//! names of llama.cpp's converter (`MuseGlimmerVisionModel` over `MmprojModel`), random
//! weights drawn with muser-model's synthetic generator, so the encoder can be tested against
//! llama.cpp's mtmd without the real weights.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use muser_gguf::{Array, GgmlType, GgufWriter, Value};
use muser_model::synth::presets::Init;
use muser_model::synth::{write_random_tensors, RandomTensor};

use crate::projector::PROJECTOR_TYPE;
use crate::VisionError;

/// A projector geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VisionPreset {
    pub name: &'static str,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_ff: usize,
    pub n_layer: usize,
    pub patch_size: usize,
    /// Side of the learned position grid.
    pub pos_side: usize,
    /// Widths of the adapter (`mm.0`, `mm.1` outputs).
    pub adapter: [usize; 2],
    /// The text model's width (`mm.2` output); pairs with the text preset named in `text`.
    pub proj_dim: usize,
    /// The `muser synth` text preset of the same width.
    pub text: &'static str,
}

const TINY: VisionPreset = VisionPreset {
    name: "vision-tiny",
    n_embd: 64,
    n_head: 4,
    n_ff: 128,
    n_layer: 5,
    patch_size: 8,
    pos_side: 4,
    adapter: [128, 128],
    proj_dim: 256,
    text: "tiny",
};

/// `vision-glimmer`: the published encoder's geometry (50 blocks, 1536 wide, 16 heads of 96,
/// patch 14, a 32×32 position grid, the 6144→4096→4096→6656 projector; the MLP width, which
/// the model card does not give, taken as 4×). `vision-tiny`: the same structure small enough
/// for tests (5 layers: windows on 0-2, global on 3 and the last); `vision-310m`: the tiny
/// encoder projecting into the `bench-310m` text preset's 1024 (head size 128: a text model
/// the fused CUDA forward runs).
pub const PRESETS: [VisionPreset; 3] = [
    VisionPreset {
        name: "vision-glimmer",
        n_embd: 1536,
        n_head: 16,
        n_ff: 6144,
        n_layer: 50,
        patch_size: 14,
        pos_side: 32,
        adapter: [4096, 4096],
        proj_dim: 6656,
        text: "muse-glimmer-30b",
    },
    TINY,
    VisionPreset {
        name: "vision-310m",
        proj_dim: 1024,
        text: "bench-310m",
        ..TINY
    },
];

/// The names of [`PRESETS`].
pub const PRESET_NAMES: [&str; 3] = [PRESETS[0].name, PRESETS[1].name, PRESETS[2].name];

/// The preset called `name`.
pub fn preset(name: &str) -> Option<VisionPreset> {
    PRESETS.iter().copied().find(|p| p.name == name)
}

/// CLIP's normalization constants (the values HF image processors of this family carry).
const IMAGE_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
const IMAGE_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];
const LAYER_NORM_EPS: f32 = 1e-6;

fn tensors(p: &VisionPreset, matrix: GgmlType) -> Vec<RandomTensor> {
    let (e, ff, ps) = (p.n_embd as u64, p.n_ff as u64, p.patch_size as u64);
    let w = |name: String, n_in: u64, n_out: u64| RandomTensor {
        name,
        dims: vec![n_in, n_out],
        ty: matrix,
        init: Init::Normal {
            std: 1.0 / (n_in as f32).sqrt(),
        },
    };
    let vec = |name: String, n: u64, init| RandomTensor {
        name,
        dims: vec![n],
        ty: GgmlType::F32,
        init,
    };
    let bias = Init::Normal { std: 0.02 };
    let mut out = vec![
        RandomTensor {
            name: "v.patch_embd.weight".into(),
            dims: vec![ps, ps, 3, e],
            // the converter keeps the patch embedding f16 in an f16 file, else f32
            ty: if matrix == GgmlType::F16 {
                GgmlType::F16
            } else {
                GgmlType::F32
            },
            init: Init::Normal {
                std: 1.0 / ((3 * ps * ps) as f32).sqrt(),
            },
        },
        vec("v.patch_embd.bias".into(), e, bias),
        RandomTensor {
            name: "v.position_embd.weight".into(),
            dims: vec![e, (p.pos_side * p.pos_side) as u64],
            ty: GgmlType::F32,
            init: Init::Normal { std: 0.5 },
        },
        vec("v.pre_ln.weight".into(), e, Init::NearOne),
        vec("v.pre_ln.bias".into(), e, bias),
    ];
    for il in 0..p.n_layer {
        let b = |s: &str| format!("v.blk.{il}.{s}");
        out.push(vec(b("ln1.weight"), e, Init::NearOne));
        out.push(vec(b("ln1.bias"), e, bias));
        for m in ["attn_q", "attn_k", "attn_v", "attn_out"] {
            out.push(w(b(&format!("{m}.weight")), e, e));
            out.push(vec(b(&format!("{m}.bias")), e, bias));
        }
        out.push(vec(b("ln2.weight"), e, Init::NearOne));
        out.push(vec(b("ln2.bias"), e, bias));
        out.push(w(b("ffn_up.weight"), e, ff));
        out.push(vec(b("ffn_up.bias"), ff, bias));
        out.push(w(b("ffn_down.weight"), ff, e));
        out.push(vec(b("ffn_down.bias"), e, bias));
    }
    out.push(vec("v.post_ln.weight".into(), e, Init::NearOne));
    out.push(vec("v.post_ln.bias".into(), e, bias));
    let [a1, a2] = p.adapter.map(|a| a as u64);
    out.push(w("mm.0.weight".into(), e * 4, a1));
    out.push(w("mm.1.weight".into(), a1, a2));
    out.push(w("mm.2.weight".into(), a2, p.proj_dim as u64));
    out
}

/// Writes the projector of preset `p` with matrices of type `matrix` (F32 or F16) and
/// weights from `seed` (same seed, same bytes).
pub fn write_projector(
    path: &Path,
    p: &VisionPreset,
    matrix: GgmlType,
    seed: u64,
) -> Result<(), VisionError> {
    if !matches!(matrix, GgmlType::F32 | GgmlType::F16) {
        return Err(VisionError::Projector(format!(
            "projector matrices are f32 or f16, not {matrix}"
        )));
    }
    let io = |source| VisionError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::create(path).map_err(io)?;
    let mut w = GgufWriter::new(BufWriter::new(file), 3)?;
    let u = |x: usize| Value::U32(x as u32);
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::from("clip")),
        ("general.type", Value::from("mmproj")),
        (
            "general.name",
            Value::from(format!("muse-glimmer-synthetic-{}", p.name).as_str()),
        ),
        (
            "general.file_type",
            Value::U32(if matrix == GgmlType::F16 { 1 } else { 0 }),
        ),
        ("clip.projector_type", Value::from(PROJECTOR_TYPE)),
        ("clip.has_vision_encoder", Value::Bool(true)),
        ("clip.vision.projection_dim", u(p.proj_dim)),
        ("clip.vision.image_size", u(p.pos_side * p.patch_size * 2)),
        ("clip.vision.patch_size", u(p.patch_size)),
        ("clip.vision.embedding_length", u(p.n_embd)),
        ("clip.vision.feed_forward_length", u(p.n_ff)),
        ("clip.vision.block_count", u(p.n_layer)),
        ("clip.vision.attention.head_count", u(p.n_head)),
        (
            "clip.vision.attention.layer_norm_epsilon",
            Value::F32(LAYER_NORM_EPS),
        ),
        (
            "clip.vision.image_mean",
            Value::Array(Array::F32(IMAGE_MEAN.to_vec())),
        ),
        (
            "clip.vision.image_std",
            Value::Array(Array::F32(IMAGE_STD.to_vec())),
        ),
        ("clip.vision.spatial_merge_size", u(2)),
    ];
    for (k, v) in meta {
        w.add(k, v)?;
    }
    let list = tensors(p, matrix);
    write_random_tensors(w, &list, seed)?.flush().map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Projector;

    #[test]
    fn tiny_projector_loads_with_its_geometry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.gguf");
        let p = preset("vision-tiny").unwrap();
        write_projector(&path, &p, GgmlType::F16, 7).unwrap();
        let proj = Projector::open(&path).unwrap();
        let hp = proj.hparams();
        assert_eq!((hp.n_embd, hp.head_dim, hp.n_layer), (64, 16, 5));
        assert_eq!((hp.pos_side, hp.cell(), hp.proj_dim), (4, 16, 256));
        assert!(!hp.is_global(0) && hp.is_global(3) && hp.is_global(4));
    }

    /// Every matrix the encoder multiplies, in every preset and file type, is one the CUDA
    /// backend holds in either precision: its device columns are whole multiples of its
    /// kernels' (the real geometry's 588-input patch embedding once was not).
    #[test]
    fn every_matrix_fits_the_cuda_backend() {
        use muser_cuda::backend::{weight_plan, Precision};
        for p in PRESETS {
            for matrix in [GgmlType::F16, GgmlType::F32] {
                for t in tensors(&p, matrix) {
                    if t.dims.len() < 2 || t.name == "v.position_embd.weight" {
                        continue;
                    }
                    let n_in = t.dims[..t.dims.len() - 1].iter().product::<u64>() as usize;
                    for precision in [Precision::Exact, Precision::Fast] {
                        let (ty, cols) = weight_plan(t.ty, n_in, precision);
                        assert!(
                            cols.is_multiple_of(ty.col_multiple())
                                && (n_in..n_in + ty.col_multiple()).contains(&cols),
                            "{}: {} inputs held as {cols} {ty:?} columns ({precision:?})",
                            t.name,
                            n_in
                        );
                    }
                }
            }
        }
    }

    /// Every matrix the GPU encoder multiplies, in every preset and file type, has a device
    /// form (`muser_cuda::vision::weight_form`): f16 as it is, anything else as f32 rows with
    /// the CPU's activation rounding in whole blocks.
    #[test]
    fn every_matrix_has_a_gpu_encoder_form() {
        use muser_cuda::vision::{weight_form, WeightForm};
        for p in PRESETS {
            for matrix in [GgmlType::F16, GgmlType::F32] {
                for t in tensors(&p, matrix) {
                    if t.dims.len() < 2 || t.name == "v.position_embd.weight" {
                        continue;
                    }
                    let n_in = t.dims[..t.dims.len() - 1].iter().product::<u64>() as usize;
                    let want = match t.ty {
                        GgmlType::F16 => WeightForm::F16,
                        _ => WeightForm::F32 { kind: 0 },
                    };
                    assert_eq!(weight_form(t.ty, n_in), Ok(want), "{}", t.name);
                }
            }
        }
    }
}
