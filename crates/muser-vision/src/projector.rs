//! The projector file: clip's keys and tensors for `clip.projector_type = "muse-glimmer"`,
//! read and checked once (`clip_model_loader::load_hparams`/`load_tensors`).

use std::path::Path;

use muser_gguf::{GgmlType, GgufFile, TensorInfo};
use muser_model::Weight;

use crate::preprocess::{grid_size, preprocess, Pixels, Rgb8};
use crate::VisionError;

/// `clip.projector_type` of a Muse Glimmer projector.
pub const PROJECTOR_TYPE: &str = "muse-glimmer";

/// The text mtmd wraps an image's rows in for this projector (`img_beg`, `img_end` in
/// `mtmd.cpp`); each is one special token of Muse Glimmer's vocabulary.
pub const IMAGE_BEGIN: &str = "<|image_start|>";
pub const IMAGE_END: &str = "<|image_end|>";

/// Output tokens an image may have (`set_limit_image_tokens(1, 4096)`).
pub const MAX_IMAGE_TOKENS: u32 = 4096;

/// Bounds on the geometry a file may declare (the real encoder is far inside them).
const MAX_WIDTH: u64 = 1 << 16;
const MAX_LAYERS: u64 = 256;
const MAX_PATCH: u64 = 64;

/// The encoder's geometry and constants.
#[derive(Clone, Debug, PartialEq)]
pub struct Hparams {
    pub n_embd: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_layer: usize,
    pub patch_size: usize,
    /// Spatial merge (pixel-shuffle) factor, 2 unless the file says otherwise.
    pub n_merge: usize,
    /// Width of the text model the embeddings are for.
    pub proj_dim: usize,
    pub eps: f32,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// Side of the learned position grid (also the attention window, in patches).
    pub pos_side: usize,
    /// Every this many layers one is global (and the last one).
    pub sparse_factor: usize,
    pub rope_theta: f32,
}

impl Hparams {
    /// Pixels a side of one output token (`patch_size × n_merge`).
    pub fn cell(&self) -> u32 {
        (self.patch_size * self.n_merge) as u32
    }

    /// Whether layer `il` attends over the whole image (else within windows).
    pub fn is_global(&self, il: usize) -> bool {
        il + 1 == self.n_layer || (il + 1).is_multiple_of(self.sparse_factor)
    }
}

/// One encoder layer's tensors (biases optional, as clip loads them).
#[derive(Clone, Debug)]
pub(crate) struct Layer {
    pub ln1: Norm,
    pub ln2: Norm,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub up: Linear,
    pub down: Linear,
}

/// A LayerNorm's weight and bias, decoded.
#[derive(Clone, Debug)]
pub(crate) struct Norm {
    pub w: Vec<f32>,
    pub b: Option<Vec<f32>>,
}

/// A matrix (borrowed from the file at use) and its decoded bias.
#[derive(Clone, Debug)]
pub(crate) struct Linear {
    pub w: TensorInfo,
    pub b: Option<Vec<f32>>,
}

/// A loaded projector.
pub struct Projector {
    pub(crate) gguf: GgufFile,
    pub(crate) hp: Hparams,
    pub(crate) patch: Linear,
    /// `pos_side² × n_embd`, row `y·side + x`.
    pub(crate) pos_embd: Vec<f32>,
    pub(crate) pre_ln: Option<Norm>,
    pub(crate) post_ln: Option<Norm>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) mm: [TensorInfo; 3],
}

impl std::fmt::Debug for Projector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Projector").field("hp", &self.hp).finish()
    }
}

fn bad(msg: impl Into<String>) -> VisionError {
    VisionError::Projector(msg.into())
}

fn key_u32(g: &GgufFile, key: &str, max: u64) -> Result<usize, VisionError> {
    let v = u64::from(g.get_u32(key)?);
    if v == 0 || v > max {
        return Err(bad(format!("{key} = {v} is out of range (1..={max})")));
    }
    Ok(v as usize)
}

fn triple(g: &GgufFile, key: &str) -> Result<[f32; 3], VisionError> {
    let a = g.get_f32_array(key)?;
    if a.len() < 3 {
        return Err(bad(format!("{key} has {} values, needs 3", a.len())));
    }
    Ok([a[0], a[1], a[2]])
}

impl Projector {
    /// Opens and checks a projector file.
    pub fn open(path: &Path) -> Result<Projector, VisionError> {
        Projector::from_gguf(GgufFile::open(path)?)
    }

    /// Opens a projector for a text model `n_embd` wide; one whose embeddings have another
    /// width is refused.
    pub fn open_for(path: &Path, n_embd: usize) -> Result<Projector, VisionError> {
        let p = Projector::open(path)?;
        if p.hp.proj_dim != n_embd {
            return Err(bad(format!(
                "{}: its embeddings are {} wide but the text model's are {n_embd}; use the projector made for this model",
                path.display(),
                p.hp.proj_dim
            )));
        }
        Ok(p)
    }

    /// Checks a projector already opened: its type, every key clip requires, every tensor's
    /// presence, type and shape.
    pub fn from_gguf(gguf: GgufFile) -> Result<Projector, VisionError> {
        let g = &gguf;
        let ty = g
            .get_opt_str("clip.projector_type")?
            .or(g.get_opt_str("clip.vision.projector_type")?)
            .ok_or_else(|| bad("no clip.projector_type: not a projector file"))?;
        if ty != PROJECTOR_TYPE {
            return Err(bad(format!(
                "projector type '{ty}' is not '{PROJECTOR_TYPE}'"
            )));
        }
        if g.get_opt_bool("clip.has_vision_encoder")? != Some(true) {
            return Err(bad("clip.has_vision_encoder is not true"));
        }
        let n_embd = key_u32(g, "clip.vision.embedding_length", MAX_WIDTH)?;
        let n_head = key_u32(g, "clip.vision.attention.head_count", MAX_WIDTH)?;
        let head_dim = match g.get_opt_u32("clip.vision.attention.head_dim")? {
            Some(d) => d as usize,
            None => n_embd / n_head,
        };
        if head_dim * n_head != n_embd || head_dim % 4 != 0 {
            return Err(bad(format!(
                "{n_head} heads of {head_dim} do not tile a width of {n_embd} (2D RoPE needs head_dim % 4 == 0)"
            )));
        }
        let n_merge = match g.get_opt_u32("clip.vision.spatial_merge_size")? {
            Some(m) if (1..=8).contains(&m) => m as usize,
            Some(m) => return Err(bad(format!("clip.vision.spatial_merge_size = {m}"))),
            None => 2,
        };
        let eps = g.get_f32("clip.vision.attention.layer_norm_epsilon")?;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(bad(format!("layer_norm_epsilon = {eps}")));
        }
        let image_std = triple(g, "clip.vision.image_std")?;
        if image_std.iter().any(|s| !s.is_normal()) {
            return Err(bad(format!(
                "image_std {image_std:?} has a zero or non-finite value"
            )));
        }
        let mut hp = Hparams {
            n_embd,
            n_head,
            head_dim,
            n_ff: key_u32(g, "clip.vision.feed_forward_length", MAX_WIDTH * 4)?,
            n_layer: key_u32(g, "clip.vision.block_count", MAX_LAYERS)?,
            patch_size: key_u32(g, "clip.vision.patch_size", MAX_PATCH)?,
            n_merge,
            proj_dim: key_u32(g, "clip.vision.projection_dim", MAX_WIDTH)?,
            eps,
            image_mean: triple(g, "clip.vision.image_mean")?,
            image_std,
            pos_side: 0,
            sparse_factor: 4,
            rope_theta: 10000.0,
        };
        // clip requires the key, though this projector sizes images by their grid
        key_u32(g, "clip.vision.image_size", MAX_WIDTH)?;

        let (e, ff) = (n_embd as u64, hp.n_ff as u64);
        let tensor = |name: &str, dims: &[u64]| -> Result<TensorInfo, VisionError> {
            let t = g
                .tensor(name)
                .ok_or_else(|| bad(format!("tensor {name} is missing")))?;
            if t.dims != dims {
                return Err(bad(format!(
                    "tensor {name} has shape {:?}, expected {dims:?}",
                    t.dims
                )));
            }
            Ok(t.clone())
        };
        let vector = |name: &str, n: u64| -> Result<Option<Vec<f32>>, VisionError> {
            if g.tensor(name).is_none() {
                return Ok(None);
            }
            let t = tensor(name, &[n])?;
            let mut out = vec![0f32; n as usize];
            muser_quant_dequant(&t, g.tensor_data(&t), &mut out)?;
            Ok(Some(out))
        };
        let norm = |prefix: &str| -> Result<Option<Norm>, VisionError> {
            Ok(match vector(&format!("{prefix}.weight"), e)? {
                Some(w) => Some(Norm {
                    w,
                    b: vector(&format!("{prefix}.bias"), e)?,
                }),
                None => None,
            })
        };
        let required_norm = |prefix: &str| {
            norm(prefix)?.ok_or_else(|| bad(format!("tensor {prefix}.weight is missing")))
        };
        let linear = |prefix: &str, n_in: u64, n_out: u64| -> Result<Linear, VisionError> {
            let w = tensor(&format!("{prefix}.weight"), &[n_in, n_out])?;
            if !muser_quant::has_vec_dot(w.ty) {
                return Err(bad(format!(
                    "tensor {prefix}.weight: type {} has no CPU kernel",
                    w.ty
                )));
            }
            Ok(Linear {
                w,
                b: vector(&format!("{prefix}.bias"), n_out)?,
            })
        };

        let ps = hp.patch_size as u64;
        let patch_w = tensor("v.patch_embd.weight", &[ps, ps, 3, e])?;
        if !matches!(patch_w.ty, GgmlType::F32 | GgmlType::F16) {
            return Err(bad(format!(
                "v.patch_embd.weight is {}, expected f32 or f16",
                patch_w.ty
            )));
        }
        let patch = Linear {
            w: patch_w,
            b: vector("v.patch_embd.bias", e)?,
        };
        let pos = g
            .tensor("v.position_embd.weight")
            .ok_or_else(|| bad("tensor v.position_embd.weight is missing"))?
            .clone();
        let n_pos = pos.dims.get(1).copied().unwrap_or(0);
        let side = (n_pos as f64).sqrt() as u64;
        if pos.dims.len() != 2 || pos.dims[0] != e || side == 0 || side * side != n_pos {
            return Err(bad(format!(
                "v.position_embd.weight has shape {:?}, expected [{e}, side²]",
                pos.dims
            )));
        }
        hp.pos_side = side as usize;
        let mut pos_embd = vec![0f32; (e * n_pos) as usize];
        muser_quant_dequant(&pos, g.tensor_data(&pos), &mut pos_embd)?;

        let layers = (0..hp.n_layer)
            .map(|il| {
                let p = format!("v.blk.{il}");
                Ok(Layer {
                    ln1: required_norm(&format!("{p}.ln1"))?,
                    ln2: required_norm(&format!("{p}.ln2"))?,
                    q: linear(&format!("{p}.attn_q"), e, e)?,
                    k: linear(&format!("{p}.attn_k"), e, e)?,
                    v: linear(&format!("{p}.attn_v"), e, e)?,
                    o: linear(&format!("{p}.attn_out"), e, e)?,
                    up: linear(&format!("{p}.ffn_up"), e, ff)?,
                    down: linear(&format!("{p}.ffn_down"), ff, e)?,
                })
            })
            .collect::<Result<Vec<_>, VisionError>>()?;

        let merged = e * (n_merge * n_merge) as u64;
        let mm0 = g
            .tensor("mm.0.weight")
            .ok_or_else(|| bad("tensor mm.0.weight is missing"))?;
        let a1 = mm0.dims.get(1).copied().unwrap_or(0);
        let mm1 = g
            .tensor("mm.1.weight")
            .ok_or_else(|| bad("tensor mm.1.weight is missing"))?;
        let a2 = mm1.dims.get(1).copied().unwrap_or(0);
        let mm = [
            linear("mm.0", merged, a1)?.w,
            linear("mm.1", a1, a2)?.w,
            linear("mm.2", a2, hp.proj_dim as u64)?.w,
        ];
        if a1 == 0 || a2 == 0 || a1 > MAX_WIDTH || a2 > MAX_WIDTH {
            return Err(bad(format!("adapter widths {a1}, {a2} out of range")));
        }
        Ok(Projector {
            pre_ln: norm("v.pre_ln")?,
            post_ln: norm("v.post_ln")?,
            hp,
            patch,
            pos_embd,
            layers,
            mm,
            gguf,
        })
    }

    /// The encoder's geometry.
    pub fn hparams(&self) -> &Hparams {
        &self.hp
    }

    /// The tokens a decoded image takes in the context (mtmd's grid of cells), or its refusal
    /// when that grid would pass [`MAX_IMAGE_TOKENS`].
    pub fn n_tokens(&self, img: &Rgb8) -> Result<usize, VisionError> {
        let cell = self.hp.cell();
        let (w, h) = grid_size(img.width, img.height, cell, MAX_IMAGE_TOKENS);
        let tokens = u64::from(w / cell) * u64::from(h / cell);
        if tokens > u64::from(MAX_IMAGE_TOKENS) {
            return Err(VisionError::TooLarge(format!(
                "a {}x{} image would take {tokens} tokens (at most {MAX_IMAGE_TOKENS}): its aspect ratio is too extreme",
                img.width, img.height
            )));
        }
        Ok(tokens as usize)
    }

    /// The encoder input for a decoded image: mtmd's grid, Lanczos resize, this file's
    /// normalization. mtmd's grid can exceed [`MAX_IMAGE_TOKENS`] for extreme aspect ratios
    /// (its fallback rounds without capping); such an image is refused here, before any work.
    pub fn preprocess(&self, img: &Rgb8) -> Result<Pixels, VisionError> {
        let hp = &self.hp;
        self.n_tokens(img)?;
        Ok(preprocess(
            img,
            hp.cell(),
            MAX_IMAGE_TOKENS,
            hp.image_mean,
            hp.image_std,
        ))
    }

    /// The patch embedding's conv kernel as a matrix: `patch² · 3` inputs ([channel][row][col],
    /// the order of [`Projector::prepare`]'s patches) to `n_embd` outputs.
    pub(crate) fn patch_weight(&self) -> Weight<'_> {
        let pw = &self.patch.w;
        let ps = self.hp.patch_size;
        Weight {
            name: &pw.name,
            ty: pw.ty,
            n_in: ps * ps * 3,
            n_out: self.hp.n_embd,
            data: self.gguf.tensor_data(pw),
        }
    }

    /// The borrowed weight of a matrix tensor.
    pub(crate) fn weight<'a>(&'a self, t: &'a TensorInfo) -> Weight<'a> {
        Weight {
            name: &t.name,
            ty: t.ty,
            n_in: t.row_len() as usize,
            n_out: t.n_rows() as usize,
            data: self.gguf.tensor_data(t),
        }
    }
}

fn muser_quant_dequant(t: &TensorInfo, bytes: &[u8], out: &mut [f32]) -> Result<(), VisionError> {
    muser_quant::dequantize_row(t.ty, bytes, out)
        .map_err(|e| bad(format!("tensor {}: {e}", t.name)))
}
