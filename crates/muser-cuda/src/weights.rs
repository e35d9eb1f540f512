//! Weights on the device, kept in their quantized form (layouts in [`crate::layout`]).

use crate::layout::repack;
pub use crate::layout::WType;
use crate::runtime::{Arg, DevBuf, Gpu, MAX_GEMV_BATCH};
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

    /// Device address of the weight bytes.
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
        let l = crate::plan::gemv(
            self.ty,
            self.rows,
            self.cols,
            batch,
            gpu.overrides().tile_from,
        );
        let n = if l.takes_batch {
            args.len()
        } else {
            args.len() - 1
        };
        gpu.launch_smem(&l.kernel, l.grid, l.block, l.smem, &args[..n])
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
