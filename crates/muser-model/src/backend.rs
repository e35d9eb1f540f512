//! The operations model code is written against. A backend owns the activations (`Act`, a
//! row-major `[rows × cols]` f32 matrix on its device) and implements each op with the numerics
//! of llama.cpp's corresponding ggml op. Model files (`models/*.rs`) use nothing else, so a new
//! backend touches no model file.

use crate::error::ModelError;
use crate::kv::{HostKv, KvCache, KvLayout, KvPlan, KvStore};
use muser_gguf::GgmlType;

/// A weight matrix `{n_in, n_out}` (ggml order), borrowed from the memory-mapped file: `n_out`
/// rows of `n_in` values in type `ty`.
#[derive(Clone, Copy, Debug)]
pub struct Weight<'a> {
    pub name: &'a str,
    pub ty: GgmlType,
    pub n_in: usize,
    pub n_out: usize,
    pub data: &'a [u8],
}

impl Weight<'_> {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.n_out.max(1)
    }
}

/// RoPE flavour: which pairs rotate together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// Adjacent pairs `(x[2i], x[2i+1])` (ggml mode 0; llama, muse-glimmer).
    Norm,
    /// Halves `(x[i], x[i + n_rot/2])` (ggml mode 2).
    Neox,
}

/// Everything the attention op needs besides Q, K and V.
#[derive(Clone, Copy, Debug)]
pub struct AttnInput<'a> {
    pub layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Scale applied to `q·k` before the softmax.
    pub scale: f32,
    /// Per sequence in the batch: its id and its token indices (ascending).
    pub groups: &'a [(u32, Vec<usize>)],
    /// Every token's position.
    pub pos: &'a [u32],
    /// Where the batch's tokens were placed in the cache.
    pub plan: &'a KvPlan,
}

/// The operations of a forward pass. Every op returns a typed error (a device backend can fail
/// anywhere; the CPU backend fails only on bad input).
pub trait Backend: Send + Sync {
    /// Activations: a row-major `[rows × cols]` f32 matrix.
    type Act: Send;

    /// Names the numerics this backend computes K/V with (part of a cache's `engine_abi`,
    /// [`crate::Model::engine_abi`]): two backends with the same name must write the same
    /// K/V bytes for the same batch.
    fn numerics(&self) -> String;
    /// Whether matrices of this type can be multiplied (checked for every matrix at load).
    fn supports(&self, ty: GgmlType) -> bool;
    /// Whether [`Backend::compute_alone`] is honoured. False unless the backend can.
    fn computes_rows_alone(&self) -> bool {
        false
    }
    /// Marks the rows of `x` (flags per row) that every later op, and every op on a result
    /// computed from them, must compute as it computes a one-row batch at the same position:
    /// the one-row matmul kernels, the attention kernel and cells a lone query row takes. The
    /// marks travel with the rows (through [`Backend::select_rows`] too). Only called where
    /// [`Backend::computes_rows_alone`].
    fn compute_alone(&self, _x: &mut Self::Act, _rows: &[bool]) -> Result<(), ModelError> {
        Err(ModelError::BadBatch(
            "this backend cannot compute rows alone".into(),
        ))
    }
    /// Called once per weight matrix when a model is loaded (a device backend uploads it here).
    fn prepare_weight(&self, _w: &Weight) -> Result<(), ModelError> {
        Ok(())
    }
    /// Storage for a KV cache of `cells[il]` cells per sequence in layer `il`: host memory
    /// unless the backend keeps K/V on its device.
    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError> {
        Ok(Box::new(HostKv::new(layout, cells, n_seq)?))
    }
    /// Runs a whole forward pass (the CPU backend runs it inside its thread pool).
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }
    /// Compute threads on the host.
    fn threads(&self) -> usize {
        1
    }
    /// The numerics profile this backend computes in (`cpu::numerics::Numerics::tag`), when it
    /// reproduces one of llama.cpp's CPU orders.
    fn numerics_tag(&self) -> Option<String> {
        None
    }

    /// A matrix from host data (`data.len() == rows * cols`).
    fn upload(&self, rows: usize, cols: usize, data: Vec<f32>) -> Result<Self::Act, ModelError>;
    /// The matrix as host data, row-major.
    fn download(&self, a: &Self::Act) -> Result<Vec<f32>, ModelError>;
    /// `(rows, cols)`.
    fn dims(&self, a: &Self::Act) -> (usize, usize);

    /// Rows `ids` of an embedding table, dequantized exactly.
    fn get_rows(&self, table: &Weight, ids: &[u32]) -> Result<Self::Act, ModelError>;
    /// `y = x · Wᵀ` (`[rows × n_in]` → `[rows × n_out]`), with ggml's CPU activation
    /// quantization and kernel choice for the weight type and row count.
    fn matmul(&self, w: &Weight, x: &Self::Act) -> Result<Self::Act, ModelError>;
    /// RMS norm of every `group`-wide slice of every row (group = cols for a plain norm, head_dim
    /// for a per-head norm), times `weight` (length `group`) when given.
    fn rms_norm(
        &self,
        x: &Self::Act,
        group: usize,
        eps: f32,
        weight: Option<&[f32]>,
    ) -> Result<Self::Act, ModelError>;
    /// [`Backend::rms_norm`] in place.
    fn rms_norm_mut(
        &self,
        x: &mut Self::Act,
        group: usize,
        eps: f32,
        weight: Option<&[f32]>,
    ) -> Result<(), ModelError>;
    /// Rotate every head of every row in place; row `r` is at position `pos[r]`.
    fn rope(
        &self,
        x: &mut Self::Act,
        head_dim: usize,
        n_rot: usize,
        pos: &[u32],
        base: f32,
        mode: RopeMode,
    ) -> Result<(), ModelError>;
    /// `x += y`.
    fn add(&self, x: &mut Self::Act, y: &Self::Act) -> Result<(), ModelError>;
    /// `x += b` for a bias row broadcast over rows.
    fn add_row(&self, x: &mut Self::Act, b: &[f32]) -> Result<(), ModelError>;
    /// `x *= sigmoid(gate)`.
    fn mul_sigmoid(&self, x: &mut Self::Act, gate: &Self::Act) -> Result<(), ModelError>;
    /// `gate = silu(gate) * up`.
    fn swiglu(&self, gate: &mut Self::Act, up: &Self::Act) -> Result<(), ModelError>;
    /// `x *= s`.
    fn scale(&self, x: &mut Self::Act, s: f32) -> Result<(), ModelError>;
    /// `x = cap · tanh(x · (1/cap))`.
    fn softcap(&self, x: &mut Self::Act, cap: f32) -> Result<(), ModelError>;
    /// The listed rows, in that order.
    fn select_rows(&self, x: &Self::Act, rows: &[usize]) -> Result<Self::Act, ModelError>;
    /// Store K and V of the batch into the cache cells of `at.plan`, then attend: for every
    /// token, softmax over the visible cells of its sequence (causal, and the sliding window on
    /// SWA layers). Q is `[tokens × n_head·hd]`, K and V `[tokens × n_head_kv·hd]`; returns
    /// `[tokens × n_head·hd]`.
    fn attention(
        &self,
        kv: &mut KvCache,
        at: &AttnInput,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
    ) -> Result<Self::Act, ModelError>;
}
