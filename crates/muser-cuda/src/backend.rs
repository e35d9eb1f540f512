//! The CUDA implementation of muser-model's [`Backend`](muser_model::Backend) trait, so the
//! model files (`models/llama.rs`, `models/muse_glimmer.rs`) run on the GPU unchanged.
//!
//! - Activations ([`DevMat`]) are f32 `[rows × cols]` device buffers.
//! - Weight matrices are uploaded once ([`Backend::prepare_weight`]). In exact [`Precision`]
//!   (the default) they are dequantized exactly to f32 and each matmul first rounds the
//!   activations as the CPU does for that weight type (`op_fakequant`, see `exact.rs`), then
//!   multiplies in f32 (GEMV up to [`GEMV_ROWS_MAX`] rows, cuBLAS above). In fast precision
//!   they stay in this crate's quantized layouts ([`DevWeight`]): up to [`GEMV_ROWS_MAX`] rows
//!   through the int8 decode GEMVs, larger batches through bf16 cuBLAS.
//! - The KV cache ([`CudaKv`]) is f16 in device memory with the host cache's layout
//!   (`[n_seq][cells][row]` per layer), so snapshots and kvpack packs are the same as the CPU's.
//! - Element-wise ops, norms, RoPE and attention are the simple f32 kernels of `ops.cu`.
//!
//! This path is for correctness and for every architecture; the fast Muse Glimmer path is
//! [`crate::glimmer`]. The pieces that need no GPU (kernel names, attention metadata) are
//! plain functions, tested everywhere.

use muser_gguf::GgmlType;
use muser_model::backend::AttnInput;
use muser_model::{KvCache, ModelError};

use crate::layout::WType;

pub use crate::exact::{
    fakequant_block, fakequant_kind, fakequant_reference, fakequant_reference_sums, has_mins,
    split_mins, Precision,
};

/// Kernels of `ops.cu`, loaded as a second module when a [`CudaBackend`] starts.
pub const OPS_KERNELS: [&str; 14] = [
    "op_add",
    "op_add_row",
    "op_mul_sigmoid",
    "op_swiglu",
    "op_scale",
    "op_softcap",
    "op_to_bf16",
    "op_select_rows",
    "op_pad_cols",
    "op_rms_norm",
    "op_rope",
    "op_kv_store",
    "op_attention",
    "op_fakequant",
];

/// Largest head size the attention kernel holds in registers (`OPS_ATT_PER_LANE` · 32).
pub const MAX_HEAD_DIM: usize = 512;

/// What `op_kv_store` and `op_attention` read for one layer of one batch, all `i32` (the
/// kernels' `int`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttnMeta {
    /// Per token: the cache row (`seq · cells + cell`) its K/V go to.
    pub dst_row: Vec<i32>,
    /// `[kv_base | cp_off | n_kv | qpos]`, each one entry per token: the first cache row of
    /// the token's sequence, the offset of that sequence's cell positions in `cpos`, the cells
    /// to visit, the token's position.
    pub meta: Vec<i32>,
    /// Cell positions (-1 = empty) of every sequence in the batch, `n_kv` each.
    pub cpos: Vec<i32>,
    /// Per token: how many query rows its sequence has in the batch (the CPU picks its
    /// attention kernel, and so its rounding, by that).
    pub seq_rows: Vec<i32>,
}

fn to_i32(v: usize, what: &str) -> Result<i32, ModelError> {
    i32::try_from(v).map_err(|_| ModelError::Device(format!("{what} {v} does not fit in i32")))
}

/// The metadata of layer `at.layer` for a batch already placed in `kv` (the host
/// bookkeeping): where each token's K/V go and which cells each token's query visits.
pub fn attn_meta(kv: &KvCache, at: &AttnInput) -> Result<AttnMeta, ModelError> {
    let il = at.layer;
    let swa = *kv
        .layout()
        .is_swa
        .get(il)
        .ok_or_else(|| ModelError::Device(format!("layer {il} is outside the cache")))?;
    let n_tok = at.pos.len();
    let mut dst_row = vec![0i32; n_tok];
    let mut meta = vec![0i32; 4 * n_tok];
    let mut cpos = Vec::new();
    let mut seq_rows = vec![0i32; n_tok];
    if at.plan.n_kv.len() != at.groups.len()
        || at.plan.base_cell.len() != n_tok
        || at.plan.swa_cell.len() != n_tok
    {
        return Err(ModelError::Device(
            "the batch plan does not match its groups".into(),
        ));
    }
    for (g, (seq, idx)) in at.groups.iter().enumerate() {
        let cells = kv.cell_pos(*seq, il);
        let n_cells = cells.len();
        let (_, nb, ns) = at.plan.n_kv[g];
        let n_kv = (if swa { ns } else { nb } as usize).min(n_cells);
        let base = *seq as usize * n_cells;
        let off = cpos.len();
        cpos.extend_from_slice(&cells[..n_kv]);
        for &t in idx {
            if t >= n_tok {
                return Err(ModelError::Device(format!("token index {t} >= {n_tok}")));
            }
            let cell = if swa {
                at.plan.swa_cell[t]
            } else {
                at.plan.base_cell[t]
            } as usize;
            if cell >= n_cells {
                return Err(ModelError::Device(format!(
                    "cell {cell} >= {n_cells} cells of layer {il}"
                )));
            }
            dst_row[t] = to_i32(base + cell, "cache row")?;
            meta[t] = to_i32(base, "cache row")?;
            meta[n_tok + t] = to_i32(off, "cell offset")?;
            meta[2 * n_tok + t] = to_i32(n_kv, "cell count")?;
            meta[3 * n_tok + t] = to_i32(at.pos[t] as usize, "position")?;
            seq_rows[t] = to_i32(idx.len(), "query rows")?;
        }
    }
    Ok(AttnMeta {
        dst_row,
        meta,
        cpos,
        seq_rows,
    })
}

/// Blocks for a grid-stride kernel over `n` values with 256-thread blocks.
pub fn grid_1d(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 1 << 20) as u32
}

#[cfg(feature = "cuda")]
pub use dev::{CudaBackend, CudaKv, DevMat};

/// Rows up to which a matmul of this backend runs the decode GEMVs (cuBLAS above).
pub const GEMV_ROWS_MAX: usize = 8;

/// How [`CudaBackend`] holds a weight of type `ty` with `n_in` inputs: its device type and
/// columns. Fast precision keeps a type that has kernels in its own layout when `n_in` is a
/// whole number of that layout's columns; every other weight is f32 rows, widened with zero
/// columns to the f32 kernels' multiple (the vision patch embedding's 14·14·3 = 588 inputs
/// become 608), and its activations get as many zero columns before the product. Zero times
/// zero adds exactly 0 to a sum, so each output sums the same products as the narrow matrix
/// would (in the kernel's order, as at any width).
pub fn weight_plan(ty: GgmlType, n_in: usize, precision: Precision) -> (WType, usize) {
    let native = WType::from_ggml(ty.id())
        .filter(|t| n_in.is_multiple_of(t.col_multiple()))
        .filter(|_| precision == Precision::Fast);
    match native {
        Some(t) => (t, n_in),
        None => (WType::F32, n_in.next_multiple_of(WType::F32.col_multiple())),
    }
}

#[cfg(feature = "cuda")]
mod dev {
    use super::{
        attn_meta, grid_1d, has_mins, split_mins, weight_plan, Precision, GEMV_ROWS_MAX,
        MAX_HEAD_DIM, OPS_KERNELS,
    };
    use crate::runtime::{Arg, DevBuf, GemmIn, Gpu, OPS_CU};
    use crate::weights::{DevWeight, QAct, QActBufs, WType};
    use crate::CudaError;
    use muser_gguf::GgmlType;
    use muser_model::backend::{AttnInput, RopeMode};
    use muser_model::kv::{RowMap, RowRead, RowWrite};
    use muser_model::{Backend, KvCache, KvLayout, KvStore, KvType, ModelError, Weight};
    use std::any::Any;
    use std::collections::HashMap;
    use std::ops::Range;
    use std::sync::{Arc, Mutex};

    impl From<CudaError> for ModelError {
        fn from(e: CudaError) -> ModelError {
            ModelError::Device(e.to_string())
        }
    }

    type Result<T> = std::result::Result<T, ModelError>;

    /// An f32 `[rows × cols]` matrix in device memory (this backend's activations, and the
    /// GPU image encoder's).
    pub struct DevMat {
        buf: DevBuf,
        rows: usize,
        cols: usize,
    }

    impl DevMat {
        /// A `rows × cols` matrix in fresh device memory; a size past `usize` is `Shape`.
        pub fn alloc(
            gpu: &Gpu,
            rows: usize,
            cols: usize,
        ) -> std::result::Result<DevMat, CudaError> {
            let bytes = rows
                .checked_mul(cols)
                .and_then(|n| n.checked_mul(4))
                .ok_or_else(|| CudaError::Shape(format!("a {rows}×{cols} matrix")))?;
            Ok(DevMat {
                buf: gpu.alloc(bytes)?,
                rows,
                cols,
            })
        }

        /// Device address of the first value.
        pub fn ptr(&self) -> u64 {
            self.buf.ptr()
        }

        /// Its buffer.
        pub fn buf(&self) -> &DevBuf {
            &self.buf
        }

        /// Rows.
        pub fn rows(&self) -> usize {
            self.rows
        }

        /// Values per row.
        pub fn cols(&self) -> usize {
            self.cols
        }

        /// Values in all.
        pub fn len(&self) -> usize {
            self.rows * self.cols
        }

        /// No values.
        pub fn is_empty(&self) -> bool {
            self.len() == 0
        }
    }

    /// The KV rows of a cache in device memory: per layer one f16 K and one V buffer,
    /// `[n_seq][cells][row]`.
    pub struct CudaKv {
        gpu: Arc<Gpu>,
        map: RowMap,
        k: Vec<DevBuf>,
        v: Vec<DevBuf>,
    }

    impl CudaKv {
        pub(crate) fn new(
            gpu: Arc<Gpu>,
            layout: &KvLayout,
            cells: &[usize],
            n_seq: usize,
        ) -> Result<CudaKv> {
            if layout.dtype != KvType::F16 {
                return Err(ModelError::Device(format!(
                    "the CUDA backend keeps the KV cache in f16, not {}",
                    layout.dtype.name()
                )));
            }
            let map = RowMap::new(layout, cells, n_seq)?;
            let mut k = Vec::with_capacity(cells.len());
            let mut v = Vec::with_capacity(cells.len());
            for il in 0..cells.len() {
                k.push(gpu.alloc_zeroed(map.layer_bytes(il))?);
                v.push(gpu.alloc_zeroed(map.layer_bytes(il))?);
            }
            gpu.sync()?;
            Ok(CudaKv { gpu, map, k, v })
        }

        /// Device addresses of layer `il`'s K and V buffers.
        pub(crate) fn layer_ptrs(&self, il: usize) -> Option<(u64, u64)> {
            Some((self.k.get(il)?.ptr(), self.v.get(il)?.ptr()))
        }
    }

    impl KvStore for CudaKv {
        fn read_rows(
            &self,
            il: usize,
            seq: u32,
            cells: Range<usize>,
            k_out: &mut [u8],
            v_out: &mut [u8],
        ) -> Result<()> {
            let r = self
                .map
                .read_range(il, seq, &cells, k_out.len(), v_out.len())?;
            if r.is_empty() {
                return Ok(());
            }
            self.gpu.download(self.k[il].at(r.start), k_out)?;
            self.gpu.download(self.v[il].at(r.start), v_out)?;
            Ok(())
        }

        fn write_rows(
            &mut self,
            il: usize,
            seq: u32,
            first_cell: usize,
            k: &[u8],
            v: &[u8],
        ) -> Result<()> {
            let r = self
                .map
                .write_range(il, seq, first_cell, k.len(), v.len())?;
            if r.is_empty() {
                return Ok(());
            }
            self.gpu.upload(&self.k[il], r.start, k)?;
            self.gpu.upload(&self.v[il], r.start, v)?;
            Ok(())
        }

        fn read_many(&self, seq: u32, reads: &mut [RowRead<'_>]) -> Result<()> {
            let mut pieces = Vec::with_capacity(2 * reads.len());
            for r in reads.iter_mut() {
                let at = self
                    .map
                    .read_range(r.layer, seq, &r.cells, r.k.len(), r.v.len())?;
                if at.is_empty() {
                    continue;
                }
                pieces.push((self.k[r.layer].at(at.start), &mut *r.k));
                pieces.push((self.v[r.layer].at(at.start), &mut *r.v));
            }
            Ok(self.gpu.download_many(&mut pieces)?)
        }

        fn write_many(&mut self, seq: u32, writes: &[RowWrite<'_>]) -> Result<()> {
            let mut pieces = Vec::with_capacity(2 * writes.len());
            for w in writes {
                let at = self
                    .map
                    .write_range(w.layer, seq, w.first_cell, w.k.len(), w.v.len())?;
                if at.is_empty() {
                    continue;
                }
                pieces.push((self.k[w.layer].at(at.start), w.k));
                pieces.push((self.v[w.layer].at(at.start), w.v));
            }
            Ok(self.gpu.upload_many(&pieces)?)
        }

        fn bytes(&self) -> usize {
            self.k.iter().chain(&self.v).map(DevBuf::bytes).sum()
        }

        fn as_any(&self) -> &dyn Any {
            self
        }

        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }

    /// A small host vector (norm weight, bias) kept on the device, with the host copy it was
    /// made from (a lookup by address is confirmed by content).
    struct DevVec {
        host: Vec<f32>,
        buf: DevBuf,
    }

    /// Muser's [`Backend`] on one CUDA device.
    pub struct CudaBackend {
        gpu: Arc<Gpu>,
        precision: Precision,
        /// Weight matrices by (data address, length).
        weights: Mutex<HashMap<(usize, usize), Arc<DevWeight>>>,
        /// Exact precision, weights with mins (Q4_1, Q5_1): the mins `[n_out][n_in / 32]` in
        /// f32, by the weight's key (the matrix itself holds the `d·q` part).
        mins: Mutex<HashMap<(usize, usize), Arc<DevBuf>>>,
        /// Norm weights and biases by (address, length).
        vecs: Mutex<HashMap<(usize, usize), Arc<DevVec>>>,
    }

    /// Every row of `w` as little-endian f32 bytes, `cols >= w.n_in` values a row (zeros
    /// after the weight's own).
    fn dequantize_all(w: &Weight, cols: usize) -> Result<Vec<u8>> {
        let rb = w.row_bytes();
        let mut row = vec![0f32; cols];
        let mut out = Vec::with_capacity(4 * cols * w.n_out);
        for r in 0..w.n_out {
            muser_quant::dequantize_row(w.ty, &w.data[r * rb..(r + 1) * rb], &mut row[..w.n_in])
                .map_err(|e| ModelError::Quant(format!("{}: {e}", w.name)))?;
            out.extend(row.iter().flat_map(|v| v.to_le_bytes()));
        }
        Ok(out)
    }

    fn shape(msg: String) -> ModelError {
        ModelError::Device(format!("bad shape: {msg}"))
    }

    impl CudaBackend {
        /// Opens device `ordinal`, compiles (or loads from the cache) the kernels; exact mode.
        pub fn new(ordinal: usize) -> std::result::Result<CudaBackend, CudaError> {
            CudaBackend::with_precision(ordinal, Precision::Exact)
        }

        /// [`CudaBackend::new`] with a choice of [`Precision`].
        pub fn with_precision(
            ordinal: usize,
            precision: Precision,
        ) -> std::result::Result<CudaBackend, CudaError> {
            let mut gpu = Gpu::new(ordinal)?;
            gpu.load_module(OPS_CU, &OPS_KERNELS)?;
            Ok(CudaBackend {
                gpu: Arc::new(gpu),
                precision,
                weights: Mutex::new(HashMap::new()),
                mins: Mutex::new(HashMap::new()),
                vecs: Mutex::new(HashMap::new()),
            })
        }

        /// The device.
        pub fn gpu(&self) -> &Gpu {
            &self.gpu
        }

        /// How matmuls are computed.
        pub fn precision(&self) -> Precision {
            self.precision
        }

        /// Changes the precision; only before the first weight is uploaded (the weights'
        /// device form depends on it).
        pub fn set_precision(&mut self, precision: Precision) -> Result<()> {
            if precision != self.precision && self.weight_bytes() > 0 {
                return Err(ModelError::Device(
                    "the precision is fixed once weights are on the device".into(),
                ));
            }
            self.precision = precision;
            Ok(())
        }

        /// Bytes of weights uploaded so far.
        pub fn weight_bytes(&self) -> usize {
            let w = self.weights.lock().unwrap_or_else(|e| e.into_inner());
            w.values().map(|d| d.device_bytes()).sum()
        }

        fn weight(&self, w: &Weight) -> Result<Arc<DevWeight>> {
            let key = (w.data.as_ptr() as usize, w.data.len());
            if let Some(d) = self
                .weights
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&key)
            {
                return Ok(d.clone());
            }
            let rb = w.ty.row_bytes(w.n_in).unwrap_or(0);
            if rb == 0 || rb.checked_mul(w.n_out) != Some(w.data.len()) {
                return Err(shape(format!(
                    "{}: {} bytes for {} rows of {} {} values",
                    w.name,
                    w.data.len(),
                    w.n_out,
                    w.n_in,
                    w.ty.name()
                )));
            }
            let (ty, cols) = weight_plan(w.ty, w.n_in, self.precision);
            // The file's bytes as they are: a kernel's own type at the file's width.
            let as_stored = WType::from_ggml(w.ty.id()) == Some(ty) && cols == w.n_in;
            let uploaded = if as_stored {
                DevWeight::upload(&self.gpu, ty, cols, &[w.data])
            } else if self.precision == Precision::Exact && has_mins(w.ty) {
                // Exact mode with mins: the d·q part here, the mins beside it.
                let (scaled, mins) = split_mins(w)?;
                let buf = self.gpu.alloc(mins.len())?;
                self.gpu.upload(&buf, 0, &mins)?;
                self.mins
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, Arc::new(buf));
                DevWeight::upload(&self.gpu, WType::F32, w.n_in, &[&scaled])
            } else {
                // Exact mode, a type without a CUDA kernel, or a width its kernels do not
                // take: exact f32 rows from the host dequantizer (the CPU's own), zero-padded.
                let f = dequantize_all(w, cols)?;
                DevWeight::upload(&self.gpu, WType::F32, cols, &[&f])
            };
            let d = Arc::new(uploaded.map_err(|e| ModelError::Device(format!("{}: {e}", w.name)))?);
            self.weights
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key, d.clone());
            Ok(d)
        }

        fn vec(&self, v: &[f32]) -> Result<Arc<DevVec>> {
            let key = (v.as_ptr() as usize, v.len());
            let mut vecs = self.vecs.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(d) = vecs.get(&key) {
                if d.host == v {
                    return Ok(d.clone());
                }
            }
            let buf = self.gpu.alloc(4 * v.len())?;
            self.gpu.upload(&buf, 0, v)?;
            let d = Arc::new(DevVec {
                host: v.to_vec(),
                buf,
            });
            vecs.insert(key, d.clone());
            Ok(d)
        }

        fn alloc_mat(&self, rows: usize, cols: usize) -> Result<DevMat> {
            Ok(DevMat::alloc(&self.gpu, rows, cols)?)
        }

        fn ints(&self, v: &[i32]) -> Result<DevBuf> {
            let buf = self.gpu.alloc(4 * v.len().max(1))?;
            if !v.is_empty() {
                self.gpu.upload(&buf, 0, v)?;
            }
            Ok(buf)
        }

        /// An element-wise kernel `name(x, other args..., n)` over all of `x`.
        fn each(&self, name: &str, n: usize, args: &[Arg]) -> Result<()> {
            if n == 0 {
                return Ok(());
            }
            let mut a = args.to_vec();
            a.push(Arg::L(n as i64));
            Ok(self.gpu.launch(name, (grid_1d(n), 1, 1), 256, &a)?)
        }

        /// `x` with zero columns after its own up to `cols` (for a weight [`weight_plan`]
        /// widened), or `None` when it has `cols` already.
        fn widen(&self, x: &DevMat, cols: usize) -> Result<Option<DevMat>> {
            if x.cols == cols {
                return Ok(None);
            }
            let y = self.alloc_mat(x.rows, cols)?;
            self.gpu.launch(
                "op_pad_cols",
                (grid_1d(y.len()), 1, 1),
                256,
                &[
                    Arg::P(x.ptr()),
                    Arg::P(y.ptr()),
                    Arg::L(x.cols as i64),
                    Arg::L(cols as i64),
                    Arg::L(y.len() as i64),
                ],
            )?;
            Ok(Some(y))
        }

        fn same_dims(&self, what: &str, x: &DevMat, y: &DevMat) -> Result<()> {
            if (x.rows, x.cols) != (y.rows, y.cols) {
                return Err(shape(format!(
                    "{what}: {}×{} with {}×{}",
                    x.rows, x.cols, y.rows, y.cols
                )));
            }
            Ok(())
        }

        fn gemv(&self, dw: &DevWeight, x: &DevMat, y: &DevMat) -> Result<()> {
            let (n, k) = (x.rows, x.cols);
            if !dw.ty.int_activations() {
                return Ok(dw.gemv(
                    &self.gpu,
                    n,
                    QAct { q: 0, d: 0, s: 0 },
                    x.ptr(),
                    y.ptr(),
                    dw.rows,
                )?);
            }
            let qa = QActBufs::quantize(&self.gpu, x.ptr(), k, n)?;
            // The scratch is freed on return, in stream order after the GEMV (DevBuf).
            dw.gemv(&self.gpu, n, qa.act(), 0, y.ptr(), dw.rows)?;
            Ok(())
        }

        /// Exact mode: `x` rounded as the CPU rounds activations for weights of type `ty`,
        /// times the f32 weight `dw`.
        fn matmul_exact(
            &self,
            ty: GgmlType,
            dw: &DevWeight,
            mins: Option<&DevBuf>,
            x: &DevMat,
            y: &DevMat,
        ) -> Result<()> {
            let (n, k, m) = (x.rows, x.cols, dw.rows);
            if dw.ty != WType::F32 {
                return Err(ModelError::Device("exact mode holds weights in f32".into()));
            }
            let kind = super::fakequant_kind(ty);
            let qk = super::fakequant_block(kind);
            if !k.is_multiple_of(qk) {
                return Err(shape(format!(
                    "{k} columns are not whole activation blocks of {qk}"
                )));
            }
            let xr = self.alloc_mat(n, k)?;
            self.gpu.copy(xr.ptr(), x.ptr(), 4 * n * k)?;
            // Q8_1 activations: each block's stored sum, for the weight's mins.
            let sums = match mins {
                Some(_) if kind == 4 => Some(self.alloc_mat(n, k / 32)?),
                Some(_) => {
                    return Err(ModelError::Device(format!(
                        "{ty:?}: mins without Q8_1 activations"
                    )))
                }
                None => None,
            };
            if kind != 0 {
                let work = if qk > 1 { n * (k / qk) } else { n * k };
                self.gpu.launch(
                    "op_fakequant",
                    (grid_1d(work), 1, 1),
                    256,
                    &[
                        Arg::P(xr.ptr()),
                        Arg::L(n as i64),
                        Arg::L(k as i64),
                        Arg::I(kind),
                        Arg::P(sums.as_ref().map_or(0, |s| s.ptr())),
                    ],
                )?;
            }
            if n <= GEMV_ROWS_MAX {
                dw.gemv(
                    &self.gpu,
                    n,
                    QAct { q: 0, d: 0, s: 0 },
                    xr.ptr(),
                    y.ptr(),
                    dw.rows,
                )?;
            } else {
                self.gpu
                    .gemm(y.ptr(), m, xr.ptr(), dw.ptr(), (n, m, k), GemmIn::F32)?;
            }
            if let (Some(mb), Some(sx)) = (mins, &sums) {
                // y += sums · minsᵀ: the min of each weight block times the activation block's sum.
                let ym = self.alloc_mat(n, m)?;
                self.gpu
                    .gemm(ym.ptr(), m, sx.ptr(), mb.ptr(), (n, m, k / 32), GemmIn::F32)?;
                self.each("op_add", n * m, &[Arg::P(y.ptr()), Arg::P(ym.ptr())])?;
            }
            // The rounded copy is freed on return, in stream order after the product.
            Ok(())
        }

        fn gemm(&self, dw: &DevWeight, x: &DevMat, y: &DevMat) -> Result<()> {
            let (n, k, m) = (x.rows, x.cols, dw.rows);
            let wb = self.gpu.alloc(2 * m * k)?;
            let xb = self.gpu.alloc(2 * n * k)?;
            dw.dequant_bf16(&self.gpu, wb.ptr())?;
            self.each("op_to_bf16", n * k, &[Arg::P(x.ptr()), Arg::P(xb.ptr())])?;
            self.gpu
                .gemm_bf16(y.ptr(), m, xb.ptr(), wb.ptr(), n, m, k)?;
            Ok(())
        }
    }

    impl Backend for CudaBackend {
        type Act = DevMat;

        fn numerics(&self) -> String {
            match self.precision {
                Precision::Exact => "cuda-exact",
                Precision::Fast => "cuda-fast",
            }
            .to_string()
        }

        fn supports(&self, ty: GgmlType) -> bool {
            WType::from_ggml(ty.id()).is_some() || muser_quant::can_dequantize(ty)
        }

        fn prepare_weight(&self, w: &Weight) -> Result<()> {
            self.weight(w).map(drop)
        }

        fn new_kv_store(
            &self,
            layout: &KvLayout,
            cells: &[usize],
            n_seq: usize,
        ) -> Result<Box<dyn KvStore>> {
            Ok(Box::new(CudaKv::new(
                self.gpu.clone(),
                layout,
                cells,
                n_seq,
            )?))
        }

        fn upload(&self, rows: usize, cols: usize, data: Vec<f32>) -> Result<DevMat> {
            if data.len() != rows * cols {
                return Err(shape(format!("{} values for {rows}×{cols}", data.len())));
            }
            let m = self.alloc_mat(rows, cols)?;
            if !data.is_empty() {
                self.gpu.upload(&m.buf, 0, &data)?;
            }
            Ok(m)
        }

        fn download(&self, a: &DevMat) -> Result<Vec<f32>> {
            let mut out = vec![0f32; a.len()];
            if !out.is_empty() {
                self.gpu.download(a.ptr(), &mut out)?;
            }
            Ok(out)
        }

        fn dims(&self, a: &DevMat) -> (usize, usize) {
            (a.rows, a.cols)
        }

        fn get_rows(&self, table: &Weight, ids: &[u32]) -> Result<DevMat> {
            let rb = table.row_bytes();
            if table.ty.row_bytes(table.n_in) != Some(rb) || rb * table.n_out != table.data.len() {
                return Err(shape(format!(
                    "{}: {} bytes for {} rows of {} {} values",
                    table.name,
                    table.data.len(),
                    table.n_out,
                    table.n_in,
                    table.ty.name()
                )));
            }
            let mut data = vec![0f32; ids.len() * table.n_in];
            for (out, &id) in data.chunks_exact_mut(table.n_in.max(1)).zip(ids) {
                if id as usize >= table.n_out {
                    return Err(ModelError::BadBatch(format!(
                        "token id {id} >= n_vocab {}",
                        table.n_out
                    )));
                }
                let id = id as usize;
                muser_quant::dequantize_row(table.ty, &table.data[id * rb..(id + 1) * rb], out)
                    .map_err(|e| ModelError::Quant(format!("{}: {e}", table.name)))?;
            }
            self.upload(ids.len(), table.n_in, data)
        }

        fn matmul(&self, w: &Weight, x: &DevMat) -> Result<DevMat> {
            if x.cols != w.n_in {
                return Err(shape(format!(
                    "{}: {} inputs for a matrix of {}",
                    w.name, x.cols, w.n_in
                )));
            }
            let dw = self.weight(w)?;
            let y = self.alloc_mat(x.rows, w.n_out)?;
            if x.rows == 0 {
                return Ok(y);
            }
            let wide = self.widen(x, dw.cols)?;
            let x = wide.as_ref().unwrap_or(x);
            if self.precision == Precision::Exact {
                let key = (w.data.as_ptr() as usize, w.data.len());
                let mins = self
                    .mins
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&key)
                    .cloned();
                self.matmul_exact(w.ty, &dw, mins.as_deref(), x, &y)?;
                return Ok(y);
            }
            if x.rows <= GEMV_ROWS_MAX {
                self.gemv(&dw, x, &y)?;
            } else {
                self.gemm(&dw, x, &y)?;
            }
            Ok(y)
        }

        fn rms_norm(
            &self,
            x: &DevMat,
            group: usize,
            eps: f32,
            weight: Option<&[f32]>,
        ) -> Result<DevMat> {
            let y = self.alloc_mat(x.rows, x.cols)?;
            self.norm(x.ptr(), &y, group, eps, weight)?;
            Ok(y)
        }

        fn rms_norm_mut(
            &self,
            x: &mut DevMat,
            group: usize,
            eps: f32,
            weight: Option<&[f32]>,
        ) -> Result<()> {
            let src = x.ptr();
            self.norm(src, x, group, eps, weight)
        }

        fn rope(
            &self,
            x: &mut DevMat,
            head_dim: usize,
            n_rot: usize,
            pos: &[u32],
            base: f32,
            mode: RopeMode,
        ) -> Result<()> {
            if head_dim == 0
                || !x.cols.is_multiple_of(head_dim)
                || n_rot > head_dim
                || !n_rot.is_multiple_of(2)
                || pos.len() != x.rows
            {
                return Err(shape(format!(
                    "rope of {}×{} with head_dim {head_dim}, n_rot {n_rot}, {} positions",
                    x.rows,
                    x.cols,
                    pos.len()
                )));
            }
            if n_rot == 0 || x.rows == 0 {
                return Ok(());
            }
            let p: Vec<i32> = pos.iter().map(|&p| p as i32).collect();
            let pd = self.ints(&p)?;
            let theta_scale = base.powf(-2.0 / n_rot as f32);
            let pairs = x.rows * (x.cols / head_dim) * (n_rot / 2);
            self.gpu.launch(
                "op_rope",
                (grid_1d(pairs), 1, 1),
                256,
                &[
                    Arg::P(x.ptr()),
                    Arg::L(x.rows as i64),
                    Arg::I(x.cols as i32),
                    Arg::I(head_dim as i32),
                    Arg::I(n_rot as i32),
                    Arg::P(pd.ptr()),
                    Arg::F(theta_scale),
                    Arg::I(i32::from(mode == RopeMode::Neox)),
                ],
            )?;
            Ok(())
        }

        fn add(&self, x: &mut DevMat, y: &DevMat) -> Result<()> {
            self.same_dims("add", x, y)?;
            self.each("op_add", x.len(), &[Arg::P(x.ptr()), Arg::P(y.ptr())])
        }

        fn add_row(&self, x: &mut DevMat, b: &[f32]) -> Result<()> {
            if b.len() != x.cols {
                return Err(shape(format!("bias of {} for {} columns", b.len(), x.cols)));
            }
            let d = self.vec(b)?;
            if x.is_empty() {
                return Ok(());
            }
            self.gpu.launch(
                "op_add_row",
                (grid_1d(x.len()), 1, 1),
                256,
                &[
                    Arg::P(x.ptr()),
                    Arg::P(d.buf.ptr()),
                    Arg::L(x.len() as i64),
                    Arg::L(x.cols as i64),
                ],
            )?;
            Ok(())
        }

        fn mul_sigmoid(&self, x: &mut DevMat, gate: &DevMat) -> Result<()> {
            self.same_dims("mul_sigmoid", x, gate)?;
            self.each(
                "op_mul_sigmoid",
                x.len(),
                &[Arg::P(x.ptr()), Arg::P(gate.ptr())],
            )
        }

        fn swiglu(&self, gate: &mut DevMat, up: &DevMat) -> Result<()> {
            self.same_dims("swiglu", gate, up)?;
            self.each(
                "op_swiglu",
                gate.len(),
                &[Arg::P(gate.ptr()), Arg::P(up.ptr())],
            )
        }

        fn scale(&self, x: &mut DevMat, s: f32) -> Result<()> {
            self.each("op_scale", x.len(), &[Arg::P(x.ptr()), Arg::F(s)])
        }

        fn softcap(&self, x: &mut DevMat, cap: f32) -> Result<()> {
            self.each("op_softcap", x.len(), &[Arg::P(x.ptr()), Arg::F(cap)])
        }

        fn select_rows(&self, x: &DevMat, rows: &[usize]) -> Result<DevMat> {
            let mut idx = Vec::with_capacity(rows.len());
            for &r in rows {
                if r >= x.rows {
                    return Err(shape(format!("row {r} of {}", x.rows)));
                }
                idx.push(r as i32);
            }
            let y = self.alloc_mat(rows.len(), x.cols)?;
            if y.is_empty() {
                return Ok(y);
            }
            let d = self.ints(&idx)?;
            self.gpu.launch(
                "op_select_rows",
                (grid_1d(y.len()), 1, 1),
                256,
                &[
                    Arg::P(x.ptr()),
                    Arg::P(y.ptr()),
                    Arg::P(d.ptr()),
                    Arg::L(x.cols as i64),
                    Arg::L(y.len() as i64),
                ],
            )?;
            Ok(y)
        }

        fn attention(
            &self,
            kv: &mut KvCache,
            at: &AttnInput,
            q: &DevMat,
            k: &DevMat,
            v: &DevMat,
        ) -> Result<DevMat> {
            let (hd, nh, nkv) = (at.head_dim, at.n_head, at.n_head_kv);
            let n_tok = at.pos.len();
            let row = nkv * hd;
            if hd == 0 || hd > MAX_HEAD_DIM || nkv == 0 || !nh.is_multiple_of(nkv) {
                return Err(shape(format!(
                    "attention with {nh} heads, {nkv} KV heads of {hd} (head size 1..={MAX_HEAD_DIM})"
                )));
            }
            if (q.rows, q.cols) != (n_tok, nh * hd)
                || (k.rows, k.cols) != (n_tok, row)
                || (v.rows, v.cols) != (n_tok, row)
            {
                return Err(shape(format!(
                    "attention q {}×{}, k {}×{}, v {}×{} for {n_tok} tokens",
                    q.rows, q.cols, k.rows, k.cols, v.rows, v.cols
                )));
            }
            let layout = kv.layout();
            if layout.n_head_kv != nkv || layout.head_dim != hd {
                return Err(shape("the KV cache was made for another model".into()));
            }
            let n_swa = if layout.is_swa.get(at.layer) == Some(&true) {
                layout.n_swa
            } else {
                0
            };
            let m = attn_meta(kv, at)?;
            let store = kv
                .store()
                .as_any()
                .downcast_ref::<CudaKv>()
                .ok_or_else(|| {
                    ModelError::Kv(
                        "the CUDA backend needs a KV cache made by its model (Model::new_kv)"
                            .into(),
                    )
                })?;
            let (kc, vc) = (&store.k[at.layer], &store.v[at.layer]);
            let out = self.alloc_mat(n_tok, nh * hd)?;
            if n_tok == 0 {
                return Ok(out);
            }
            let dst = self.ints(&m.dst_row)?;
            let meta = self.ints(&m.meta)?;
            let cpos = self.ints(&m.cpos)?;
            let seq_rows = self.ints(&m.seq_rows)?;
            // Exact precision follows the CPU's attention rounding for short query runs.
            let rows_ptr = if self.precision == Precision::Exact {
                seq_rows.ptr()
            } else {
                0
            };
            self.gpu.launch(
                "op_kv_store",
                (grid_1d(n_tok * row), 1, 1),
                256,
                &[
                    Arg::P(k.ptr()),
                    Arg::P(v.ptr()),
                    Arg::P(kc.ptr()),
                    Arg::P(vc.ptr()),
                    Arg::P(dst.ptr()),
                    Arg::I(row as i32),
                    Arg::L(n_tok as i64),
                ],
            )?;
            let grid_y = u32::try_from(n_tok)
                .ok()
                .filter(|&n| n <= 65_535)
                .ok_or_else(|| shape(format!("{n_tok} tokens in one attention call")))?;
            self.gpu.launch(
                "op_attention",
                (nh as u32, grid_y, 1),
                128,
                &[
                    Arg::P(q.ptr()),
                    Arg::P(kc.ptr()),
                    Arg::P(vc.ptr()),
                    Arg::P(out.ptr()),
                    Arg::P(meta.ptr()),
                    Arg::P(cpos.ptr()),
                    Arg::L(n_tok as i64),
                    Arg::I(nh as i32),
                    Arg::I(nkv as i32),
                    Arg::I(hd as i32),
                    Arg::F(at.scale),
                    Arg::I(n_swa as i32),
                    Arg::P(rows_ptr),
                ],
            )?;
            Ok(out)
        }
    }

    impl CudaBackend {
        /// RMS norm of `src` (`y`'s shape) into `y`; `src` may be `y` itself.
        fn norm(
            &self,
            src: u64,
            y: &DevMat,
            group: usize,
            eps: f32,
            weight: Option<&[f32]>,
        ) -> Result<()> {
            if group == 0
                || !y.cols.is_multiple_of(group)
                || weight.is_some_and(|w| w.len() != group)
            {
                return Err(shape(format!(
                    "rms_norm of {}×{} in groups of {group}",
                    y.rows, y.cols
                )));
            }
            let groups = y.len() / group;
            if groups == 0 {
                return Ok(());
            }
            let w = weight.map(|w| self.vec(w)).transpose()?;
            self.gpu.launch(
                "op_rms_norm",
                (
                    u32::try_from(groups).map_err(|_| shape(format!("{groups} groups")))?,
                    1,
                    1,
                ),
                256,
                &[
                    Arg::P(src),
                    Arg::P(y.ptr()),
                    Arg::P(w.as_ref().map_or(0, |w| w.buf.ptr())),
                    Arg::I(group as i32),
                    Arg::F(eps),
                ],
            )?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use muser_model::kv::KvPlan;
    use muser_model::{KvLayout, KvSnapshot, KvType, LayerKv};

    /// A width the f32 kernels do not take is widened with zero columns, in both precisions;
    /// fast precision keeps a kernel's own type at a width it takes.
    #[test]
    fn weight_plan_widens_what_the_kernels_do_not_take() {
        for precision in [Precision::Exact, Precision::Fast] {
            assert_eq!(
                weight_plan(GgmlType::F16, 588, precision),
                (WType::F32, 608)
            );
            assert_eq!(
                weight_plan(GgmlType::F32, 588, precision),
                (WType::F32, 608)
            );
            assert_eq!(
                weight_plan(GgmlType::F32, 1536, precision),
                (WType::F32, 1536)
            );
        }
        assert_eq!(
            weight_plan(GgmlType::Q4_K, 2048, Precision::Exact),
            (WType::F32, 2048)
        );
        assert_eq!(
            weight_plan(GgmlType::Q4_K, 2048, Precision::Fast),
            (WType::Q4K, 2048)
        );
        assert_eq!(
            weight_plan(GgmlType::F16, 1536, Precision::Fast),
            (WType::F16, 1536)
        );
    }

    /// Seq 1 holds positions 0..3 of a two-layer cache (full, sliding); a fourth token at
    /// position 3 goes to cell 3 of both layers.
    #[test]
    fn attention_metadata_points_at_the_sequence_rows() {
        let layout = KvLayout {
            n_layer: 2,
            is_swa: vec![false, true],
            n_head_kv: 1,
            head_dim: 4,
            n_swa: 4,
            dtype: KvType::F16,
        };
        let mut kv = KvCache::new(layout.clone(), 64, 2, 8).unwrap();
        let rows = LayerKv {
            k: vec![0; 3 * 8],
            v: vec![0; 3 * 8],
        };
        let snap = KvSnapshot {
            layout,
            positions: 0..3,
            layers: vec![rows.clone(), rows],
        };
        kv.import(1, &snap).unwrap();
        let groups = vec![(1u32, vec![1usize])];
        let plan = KvPlan {
            base_cell: vec![0, 3],
            swa_cell: vec![0, 3],
            n_kv: vec![(1, 64, 256)],
            ..Default::default()
        };
        let pos = [0u32, 3];
        for (il, cells) in [(0usize, 64i32), (1, 256)] {
            let at = AttnInput {
                layer: il,
                n_head: 2,
                n_head_kv: 1,
                head_dim: 4,
                scale: 0.5,
                groups: &groups,
                pos: &pos,
                plan: &plan,
            };
            let m = attn_meta(&kv, &at).unwrap();
            assert_eq!(m.dst_row, vec![0, cells + 3]);
            // [kv_base | cp_off | n_kv | qpos] for tokens 0 (not in a group) and 1.
            assert_eq!(m.meta, vec![0, cells, 0, 0, 0, cells, 0, 3]);
            assert_eq!(m.cpos.len(), cells as usize);
            assert_eq!(&m.cpos[..4], &[0, 1, 2, -1]);
        }
        let bad = KvPlan {
            base_cell: vec![0, 64],
            ..plan.clone()
        };
        let at = AttnInput {
            layer: 0,
            n_head: 2,
            n_head_kv: 1,
            head_dim: 4,
            scale: 0.5,
            groups: &groups,
            pos: &pos,
            plan: &bad,
        };
        assert!(attn_meta(&kv, &at).is_err(), "a cell past the cache");
    }

    #[test]
    fn grid_covers_every_value() {
        assert_eq!(grid_1d(0), 1);
        assert_eq!(grid_1d(256), 1);
        assert_eq!(grid_1d(257), 2);
        assert_eq!(grid_1d(usize::MAX / 2), 1 << 20);
    }

    #[test]
    fn op_kernels_exist_in_the_source() {
        let src = include_str!("ops.cu");
        for name in OPS_KERNELS {
            assert!(
                src.contains(&format!("__global__ void {name}(")),
                "kernel {name} not found in ops.cu"
            );
        }
    }
}
