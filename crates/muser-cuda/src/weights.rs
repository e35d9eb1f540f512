//! Weights on the device, kept in their quantized form (layouts in [`crate::layout`]).

pub use crate::layout::WType;
use crate::layout::{
    nvfp4_kernel, q4k_kernel, q4k_kernel_r2, q4k_kernel_r4, q4k_legacy_wpr, q4k_shape,
    q4k_shape_r4, q4k_tile, repack, seq_gemv, Q4K_SHAPE_MAX_BATCH, Q4K_TILE_ROWS, Q4K_TILE_SEQS,
};
use crate::runtime::{Arg, DevBuf, Gpu, Q4kShape, MAX_GEMV_BATCH};
use crate::CudaError;

type Result<T> = std::result::Result<T, CudaError>;

/// A weight matrix `[rows][cols]` on the device.
pub struct DevWeight {
    /// Element type.
    pub ty: WType,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    buf: DevBuf,
    aux_off: usize,
}

/// Int8 activations as the GEMV kernels read them.
#[derive(Clone, Copy, Debug)]
pub struct QAct {
    /// int8 quants `[B][n]`.
    pub q: u64,
    /// scales `[B][n/16]`.
    pub d: u64,
    /// scale × sum of quants `[B][n/16]`.
    pub s: u64,
}

impl DevWeight {
    /// Uploads a matrix given as consecutive pieces of ggml rows (pieces concatenate row-wise:
    /// e.g. the q, k, v and gate projections become one matrix).
    pub fn upload(gpu: &Gpu, ty: WType, cols: usize, pieces: &[&[u8]]) -> Result<DevWeight> {
        if cols == 0 || !cols.is_multiple_of(ty.col_multiple()) {
            return Err(CudaError::Unsupported(format!(
                "{ty:?} matrix with {cols} columns (need a multiple of {})",
                ty.col_multiple()
            )));
        }
        let rb = ty.row_bytes(cols);
        let mut rows = 0usize;
        for p in pieces {
            if p.len() % rb != 0 {
                return Err(CudaError::Shape(format!(
                    "{} bytes is not a whole number of {rb}-byte rows",
                    p.len()
                )));
            }
            rows += p.len() / rb;
        }
        if let Some((host, aux_off)) = repack(ty, rows, cols, pieces) {
            let buf = gpu.alloc(host.len())?;
            gpu.upload(&buf, 0, &host)?;
            return Ok(DevWeight {
                ty,
                rows,
                cols,
                buf,
                aux_off,
            });
        }
        // Layout unchanged: upload the pieces in place, no host copy.
        let buf = gpu.alloc(rows * rb)?;
        let mut off = 0;
        for p in pieces {
            gpu.upload(&buf, off, p)?;
            off += p.len();
        }
        Ok(DevWeight {
            ty,
            rows,
            cols,
            buf,
            aux_off: 0,
        })
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.buf.bytes()
    }

    /// Device address of the weight bytes (for L2 prefetch hints).
    pub fn ptr(&self) -> u64 {
        self.buf.ptr()
    }

    fn aux(&self) -> u64 {
        if self.aux_off == 0 {
            0
        } else {
            self.buf.at(self.aux_off)
        }
    }

    /// `y[b][row] = W[row] · x[b]` for `batch` rows of activations; `y` rows are `ldy` floats.
    /// Integer types read `qa`, float types read `xf` (`[B][cols]` f32).
    pub fn gemv(
        &self,
        gpu: &Gpu,
        batch: usize,
        qa: QAct,
        xf: u64,
        y: u64,
        ldy: usize,
    ) -> Result<()> {
        if batch == 0 || batch > MAX_GEMV_BATCH {
            return Err(CudaError::Shape(format!(
                "GEMV batch {batch} (1..={MAX_GEMV_BATCH})"
            )));
        }
        let t = gpu.tuning();
        let args = [
            Arg::P(self.buf.ptr()),
            Arg::P(self.aux()),
            Arg::L(self.rows as i64),
            Arg::L(self.cols as i64),
            Arg::P(qa.q),
            Arg::P(qa.d),
            Arg::P(qa.s),
            Arg::P(xf),
            Arg::P(y),
            Arg::L(ldy as i64),
            Arg::I(batch as i32),
        ];
        if batch > Q4K_SHAPE_MAX_BATCH {
            // The batched kernels split a Q4_K row over as many warps as the one-sequence
            // GEMV below does for this matrix, so each sequence gets its one-sequence sums.
            let nsb = self.cols / 256;
            let wpr = match t.q4k {
                Q4kShape::Legacy => q4k_legacy_wpr(nsb),
                Q4kShape::Tuned => q4k_shape(nsb).0,
                Q4kShape::Fixed(w, u) if gpu.has_kernel(&q4k_kernel(w, u, 0, 1)) => w,
                Q4kShape::Fixed(..) => q4k_legacy_wpr(nsb),
            };
            if self.ty == WType::Q4K && batch >= t.q4k_tile_from {
                if let Some(l) = q4k_tile(wpr) {
                    // Sequence blocks vary fastest: a row tile's blocks run together.
                    let grid = (
                        batch.div_ceil(Q4K_TILE_SEQS) as u32,
                        self.rows.div_ceil(Q4K_TILE_ROWS) as u32,
                        1,
                    );
                    return gpu.launch(&l.name, grid, l.threads, &args);
                }
            }
            let (name, rows_per_block) = seq_gemv(self.ty, self.cols, wpr);
            let grid = self.rows.div_ceil(rows_per_block) as u32;
            return gpu.launch(&name, (grid, 1, 1), 128, &args);
        }
        let mut name = format!("gemv_{}_b{batch}", self.ty.kernel());
        // Rows per 4-warp block (kernels.cu: Q4_K splits a row over 1, 2 or 4 warps).
        let mut rows_per_block = match self.ty {
            WType::Q4K if self.cols / 256 >= 48 => 1,
            WType::Q4K => 2,
            // gemv_nvfp4_b*: two rows per warp.
            WType::NvFp4 => 8,
            _ => 4,
        };
        if self.ty == WType::Q4K {
            let shape = match t.q4k {
                Q4kShape::Legacy => None,
                Q4kShape::Tuned => Some(q4k_shape(self.cols / 256)),
                Q4kShape::Fixed(w, u) => Some((w, u)),
            };
            if let Some((w, u)) = shape {
                let n = q4k_kernel(w, u, t.l2_256 as u32, batch);
                let n2 = q4k_kernel_r2(w, u, batch);
                let (w4, u4) = q4k_shape_r4(self.cols / 256);
                let n4 = q4k_kernel_r4(w4, u4, batch);
                // Every rows-per-warp choice sums a row in the same order (q4k_shape_r4 keeps
                // the warps per row), so a batched step may share more rows per warp than a
                // single-sequence one without changing any sequence's tokens.
                let rpw = match (batch, t.batch_rows_per_warp, t.rows_per_warp) {
                    (2.., b, _) if b > 0 => b,
                    (_, _, 0) => 2,
                    (_, _, r) => r,
                };
                // (A fixed shape keeps its own warps per row: the four-row kernel only when its
                // shape splits rows the same way.)
                if rpw == 4 && w4 == w && gpu.has_kernel(&n4) {
                    name = n4;
                    rows_per_block = 4 * 4 / w4 as usize;
                } else if rpw >= 2 && gpu.has_kernel(&n2) {
                    name = n2;
                    rows_per_block = 2 * 4 / w as usize;
                } else if gpu.has_kernel(&n) {
                    name = n;
                    rows_per_block = 4 / w as usize;
                }
            }
        }
        if let (WType::NvFp4, Some((r, u))) = (self.ty, t.nvfp4) {
            let n = nvfp4_kernel(r, u, batch);
            if gpu.has_kernel(&n) {
                name = n;
                rows_per_block = 4 * r as usize;
            }
        }
        let grid = self.rows.div_ceil(rows_per_block) as u32;
        gpu.launch(&name, (grid, 1, 1), 128, &args[..args.len() - 1])
    }

    /// Dequantizes the whole matrix to bf16 `[rows][cols]` at `out`.
    pub fn dequant_bf16(&self, gpu: &Gpu, out: u64) -> Result<()> {
        let groups = self.rows * self.cols / 16;
        gpu.launch(
            "dequant_bf16",
            (groups.div_ceil(256) as u32, 1, 1),
            256,
            &[
                Arg::I(self.ty.ggml_id() as i32),
                Arg::P(self.buf.ptr()),
                Arg::P(self.aux()),
                Arg::L(self.rows as i64),
                Arg::L(self.cols as i64),
                Arg::P(out),
            ],
        )
    }

    /// Rows `tokens[t]` (device int array of `n` entries) dequantized to f32 `x [n][cols]`.
    pub fn get_rows(&self, gpu: &Gpu, tokens: u64, n: usize, x: u64) -> Result<()> {
        let groups = self.cols / 16;
        gpu.launch(
            "get_rows",
            (groups.div_ceil(128) as u32, n as u32, 1),
            128,
            &[
                Arg::I(self.ty.ggml_id() as i32),
                Arg::P(self.buf.ptr()),
                Arg::P(self.aux()),
                Arg::L(self.cols as i64),
                Arg::P(tokens),
                Arg::P(x),
            ],
        )
    }
}

/// Quantizes `batch` rows of `n` f32 activations at `x` into `qa`.
/// Device buffers holding quantized activations for `batch` rows of `n` values, owned.
pub struct QActBufs {
    q: DevBuf,
    d: DevBuf,
    s: DevBuf,
}

impl QActBufs {
    /// Buffers for `batch` rows of `n` values (`n` a multiple of 16).
    pub fn alloc(gpu: &Gpu, n: usize, batch: usize) -> Result<QActBufs> {
        let groups = batch * n / 16;
        Ok(QActBufs {
            q: gpu.alloc(batch * n)?,
            d: gpu.alloc(4 * groups)?,
            s: gpu.alloc(4 * groups)?,
        })
    }

    /// The buffers as the GEMV kernels take them.
    pub fn act(&self) -> QAct {
        QAct {
            q: self.q.ptr(),
            d: self.d.ptr(),
            s: self.s.ptr(),
        }
    }

    /// Allocates buffers for `x` (`batch` rows of `n` f32 values at device address `x`) and
    /// enqueues its quantization into them.
    pub fn quantize(gpu: &Gpu, x: u64, n: usize, batch: usize) -> Result<QActBufs> {
        let b = QActBufs::alloc(gpu, n, batch)?;
        quantize_act(gpu, x, n, batch, b.act())?;
        Ok(b)
    }
}

pub fn quantize_act(gpu: &Gpu, x: u64, n: usize, batch: usize, qa: QAct) -> Result<()> {
    let groups = batch * n / 16;
    gpu.launch(
        "quantize_act",
        (groups.div_ceil(256) as u32, 1, 1),
        256,
        &[
            Arg::P(x),
            Arg::L(n as i64),
            Arg::L(groups as i64),
            Arg::P(qa.q),
            Arg::P(qa.d),
            Arg::P(qa.s),
        ],
    )
}
