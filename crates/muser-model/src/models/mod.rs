//! Architectures: one file each, written against [`Backend`](crate::backend::Backend) only.
//! This module holds what they share: tensor lookup with shape checks, and the pieces of a
//! forward pass every architecture has (embedding lookup, attention plumbing, the output head).

pub mod dflash;
pub mod llama;
pub mod muse_glimmer;

use crate::backend::{AttnInput, Backend, RopeMode, Weight};
use crate::error::ModelError;
use crate::info::ModelInfo;
use crate::kv::{KvCache, KvPlan};
use muser_gguf::{GgmlType, GgufFile, TensorInfo};
use std::cell::RefCell;

/// The batch's input rows: each token's row of `table`, or the caller's embedding for the
/// rows `input` names; the rows to compute alone are marked ([`Prepared::lone`]).
pub(crate) fn embed<B: Backend>(
    be: &B,
    table: &Weight,
    tokens: &[u32],
    input: &crate::InputEmbd,
    prep: &Prepared,
) -> Result<B::Act, ModelError> {
    // an embedding row's token id is ignored (it may lie outside the vocabulary)
    let mut x = if input.is_empty() {
        be.get_rows(table, tokens)?
    } else {
        let mut ids = tokens.to_vec();
        for &r in &input.rows {
            ids[r] = 0;
        }
        be.get_rows(table, &ids)?
    };
    if !input.is_empty() {
        let (rows, cols) = be.dims(&x);
        let mut host = be.download(&x)?;
        for (k, &r) in input.rows.iter().enumerate() {
            host[r * cols..(r + 1) * cols].copy_from_slice(&input.values[k * cols..(k + 1) * cols]);
        }
        x = be.upload(rows, cols, host)?;
    }
    if !prep.lone.is_empty() {
        be.compute_alone(&mut x, &prep.lone)?;
    }
    Ok(x)
}

/// The layer inputs a batch asked for ([`crate::Batch::capture_layers`]), copied to the host
/// as the layers are entered. With no layers asked for it copies nothing.
pub struct Capture {
    /// The layers, in the order the caller wants them.
    layers: Vec<u32>,
    /// Per model layer: its input rows, once captured.
    got: Vec<Option<Vec<f32>>>,
}

impl Capture {
    pub fn new(layers: &[u32], n_layer: usize) -> Capture {
        Capture {
            layers: layers.to_vec(),
            got: if layers.is_empty() {
                Vec::new()
            } else {
                vec![None; n_layer]
            },
        }
    }

    /// Called with `x`, the rows entering layer `il` (all of the batch's rows).
    pub fn layer<B: Backend>(&mut self, be: &B, il: usize, x: &B::Act) -> Result<(), ModelError> {
        if self.layers.contains(&(il as u32)) {
            self.got[il] = Some(be.download(x)?);
        }
        Ok(())
    }

    /// Row by row, the asked-for layers side by side (`n_rows × layers × n_embd`).
    pub fn into_rows(self, n_rows: usize, n_embd: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n_rows * self.layers.len() * n_embd);
        for r in 0..n_rows {
            for &l in &self.layers {
                if let Some(Some(x)) = self.got.get(l as usize) {
                    out.extend_from_slice(&x[r * n_embd..(r + 1) * n_embd]);
                }
            }
        }
        out
    }
}

/// A model's embedding table and output matrix (with its per-tensor scale), which a DFlash
/// drafter without its own borrows.
#[derive(Clone, Debug)]
pub struct Head {
    pub tok_embd: WRef,
    pub output: WRef,
    pub output_scale: Option<f32>,
}

/// A weight matrix in the file: which tensor, and its `{n_in, n_out}` shape.
#[derive(Clone, Debug)]
pub struct WRef {
    info: TensorInfo,
    pub n_in: usize,
    pub n_out: usize,
}

impl WRef {
    pub fn ty(&self) -> GgmlType {
        self.info.ty
    }

    pub fn view<'a>(&'a self, g: &'a GgufFile) -> Weight<'a> {
        Weight {
            name: &self.info.name,
            ty: self.info.ty,
            n_in: self.n_in,
            n_out: self.n_out,
            data: g.tensor_data(&self.info),
        }
    }
}

/// Tensor lookup for a model being loaded.
pub struct Tensors<'a> {
    pub g: &'a GgufFile,
    /// Whether the backend multiplies matrices of a type.
    pub supports: &'a dyn Fn(GgmlType) -> bool,
    /// Every matrix handed out so far, for the backend to prepare once.
    pub mats: RefCell<Vec<WRef>>,
}

impl<'a> Tensors<'a> {
    pub fn new(g: &'a GgufFile, supports: &'a dyn Fn(GgmlType) -> bool) -> Tensors<'a> {
        Tensors {
            g,
            supports,
            mats: RefCell::new(Vec::new()),
        }
    }

    fn find(&self, name: &str) -> Option<&TensorInfo> {
        self.g.tensor(name)
    }

    /// A required matrix `{n_in, n_out}` of a type the backend multiplies.
    pub fn mat(&self, name: &str, n_in: usize, n_out: usize) -> Result<WRef, ModelError> {
        self.opt_mat(name, n_in, n_out)?
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })
    }

    pub fn opt_mat(
        &self,
        name: &str,
        n_in: usize,
        n_out: usize,
    ) -> Result<Option<WRef>, ModelError> {
        let Some(t) = self.find(name) else {
            return Ok(None);
        };
        let want = vec![n_in as u64, n_out as u64];
        if t.dims != want {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                got: t.dims.clone(),
                want,
            });
        }
        if !(self.supports)(t.ty) || t.ty.row_bytes(n_in).is_none() {
            return Err(ModelError::UnsupportedType {
                name: name.to_string(),
                ty: t.ty.name(),
            });
        }
        let w = WRef {
            info: t.clone(),
            n_in,
            n_out,
        };
        self.mats.borrow_mut().push(w.clone());
        Ok(Some(w))
    }

    /// A required vector of `n` values (norm weights, biases), as f32.
    pub fn vec(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        self.opt_vec(name, n)?
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })
    }

    pub fn opt_vec(&self, name: &str, n: usize) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(t) = self.find(name) else {
            return Ok(None);
        };
        if t.n_elements() != n as u64 || t.dims.first().copied() != Some(n as u64) {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                got: t.dims.clone(),
                want: vec![n as u64],
            });
        }
        let mut out = vec![0f32; n];
        muser_quant::dequantize_row(t.ty, self.g.tensor_data(t), &mut out)
            .map_err(|e| ModelError::Quant(format!("{name}: {e}")))?;
        Ok(Some(out))
    }

    /// An optional `{1}` per-tensor scale sidecar.
    pub fn opt_scale(&self, name: &str) -> Result<Option<f32>, ModelError> {
        Ok(self.opt_vec(name, 1)?.map(|v| v[0]))
    }
}

/// A batch after validation: tokens grouped per sequence and placed in the cache.
pub struct Prepared {
    pub groups: Vec<(u32, Vec<usize>)>,
    pub plan: KvPlan,
    /// Token indices whose outputs are wanted, in batch order.
    pub out_rows: Vec<usize>,
    /// Empty, or per token: computed alone ([`crate::Batch::lone_seqs`]).
    pub lone: Vec<bool>,
}

/// Projection `y = W·x (+ b) (· s)` as llama.cpp's `build_lora_mm` + bias.
/// The SwiGLU feed-forward block: `down(silu(gate(h)) * up(h))`, each intermediate dropped as
/// soon as it is used.
pub fn swiglu_ffn<B: Backend>(
    be: &B,
    g: &GgufFile,
    gate: &WRef,
    up: &WRef,
    down: &WRef,
    h: B::Act,
) -> Result<B::Act, ModelError> {
    let mut fg = linear(be, g, gate, None, None, &h)?;
    let fu = linear(be, g, up, None, None, &h)?;
    drop(h);
    be.swiglu(&mut fg, &fu)?;
    drop(fu);
    linear(be, g, down, None, None, &fg)
}

pub fn linear<B: Backend>(
    be: &B,
    g: &GgufFile,
    w: &WRef,
    bias: Option<&[f32]>,
    scale: Option<f32>,
    x: &B::Act,
) -> Result<B::Act, ModelError> {
    let mut y = be.matmul(&w.view(g), x)?;
    if let Some(s) = scale {
        be.scale(&mut y, s)?;
    }
    if let Some(b) = bias {
        be.add_row(&mut y, b)?;
    }
    Ok(y)
}

/// Attention of one layer with the shared plumbing.
#[allow(clippy::too_many_arguments)]
pub fn attend<B: Backend>(
    be: &B,
    info: &ModelInfo,
    kv: &mut KvCache,
    prep: &Prepared,
    pos: &[u32],
    layer: usize,
    q: &B::Act,
    k: &B::Act,
    v: &B::Act,
) -> Result<B::Act, ModelError> {
    let at = AttnInput {
        layer,
        n_head: info.n_head,
        n_head_kv: info.n_head_kv,
        head_dim: info.head_dim,
        scale: info.attn_scale,
        groups: &prep.groups,
        pos,
        plan: &prep.plan,
    };
    be.attention(kv, &at, q, k, v)
}

/// NORM RoPE of the query and key rows (heads of `i.head_dim`, `i.n_rot` rotated dims) at
/// positions `pos` with frequency base `base`.
pub fn rope_qk<B: Backend>(
    be: &B,
    i: &ModelInfo,
    q: &mut B::Act,
    k: &mut B::Act,
    pos: &[u32],
    base: f32,
) -> Result<(), ModelError> {
    be.rope(q, i.head_dim, i.n_rot, pos, base, RopeMode::Norm)?;
    be.rope(k, i.head_dim, i.n_rot, pos, base, RopeMode::Norm)
}
