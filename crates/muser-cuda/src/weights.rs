//! Weights on the device, kept in their quantized form. Q4_K and the float types are uploaded
//! byte for byte; Q6_K blocks are padded to 224 bytes and Q8_0 / NVFP4 are split into a quant
//! array and a scale array, so every kernel load is 16-byte aligned.

use crate::runtime::{Arg, DevBuf, Gpu, MAX_GEMV_BATCH};
use crate::CudaError;

type Result<T> = std::result::Result<T, CudaError>;

/// Weight types the kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WType {
    /// f32.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 32 int8 values and one f16 scale.
    Q8_0,
    /// 256-value super-blocks, 4-bit with 6-bit scales and mins.
    Q4K,
    /// 256-value super-blocks, 6-bit with int8 scales.
    Q6K,
    /// 64-value blocks of E2M1 with four UE4M3 scales.
    NvFp4,
}

impl WType {
    /// From a ggml type id.
    pub fn from_ggml(id: u32) -> Option<WType> {
        Some(match id {
            0 => WType::F32,
            1 => WType::F16,
            8 => WType::Q8_0,
            12 => WType::Q4K,
            14 => WType::Q6K,
            30 => WType::BF16,
            40 => WType::NvFp4,
            _ => return None,
        })
    }

    /// The ggml type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            WType::F32 => 0,
            WType::F16 => 1,
            WType::Q8_0 => 8,
            WType::Q4K => 12,
            WType::Q6K => 14,
            WType::BF16 => 30,
            WType::NvFp4 => 40,
        }
    }

    /// (values per block, bytes per block) in the ggml file format.
    pub fn block(self) -> (usize, usize) {
        match self {
            WType::F32 => (1, 4),
            WType::F16 | WType::BF16 => (1, 2),
            WType::Q8_0 => (32, 34),
            WType::Q4K => (256, 144),
            WType::Q6K => (256, 210),
            WType::NvFp4 => (64, 36),
        }
    }

    /// Bytes of one row of `cols` values in the file format.
    pub fn row_bytes(self, cols: usize) -> usize {
        let (n, b) = self.block();
        cols / n * b
    }

    fn kernel(self) -> &'static str {
        match self {
            WType::F32 => "f32",
            WType::F16 => "f16",
            WType::BF16 => "bf16",
            WType::Q8_0 => "q80",
            WType::Q4K => "q4k",
            WType::Q6K => "q6k",
            WType::NvFp4 => "nvfp4",
        }
    }

    /// Whether the GEMV reads int8-quantized activations (else f32 activations).
    pub fn int_activations(self) -> bool {
        !matches!(self, WType::F32 | WType::F16 | WType::BF16)
    }

    /// Column count the kernels need to be a multiple of.
    pub fn col_multiple(self) -> usize {
        match self {
            WType::Q4K | WType::Q6K => 256,
            WType::NvFp4 => 64,
            _ => 32,
        }
    }
}

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
        if cols == 0 || cols % ty.col_multiple() != 0 {
            return Err(CudaError::Unsupported(format!(
                "{ty:?} matrix with {cols} columns (need a multiple of {})",
                ty.col_multiple()
            )));
        }
        let rb = ty.row_bytes(cols);
        let mut rows = 0usize;
        for p in pieces {
            if p.len() % rb != 0 {
                return Err(CudaError::Shape(format!("{} bytes is not a whole number of {rb}-byte rows", p.len())));
            }
            rows += p.len() / rb;
        }
        match ty {
            WType::F32 | WType::F16 | WType::BF16 | WType::Q4K => {
                let buf = gpu.alloc(rows * rb)?;
                let mut off = 0;
                for p in pieces {
                    gpu.upload(&buf, off, p)?;
                    off += p.len();
                }
                Ok(DevWeight { ty, rows, cols, buf, aux_off: 0 })
            }
            WType::Q6K => {
                let nb = rows * cols / 256;
                let mut host = vec![0u8; nb * 224];
                let mut k = 0;
                for p in pieces {
                    for blk in p.chunks_exact(210) {
                        host[k * 224..k * 224 + 210].copy_from_slice(blk);
                        k += 1;
                    }
                }
                let buf = gpu.alloc(host.len())?;
                gpu.upload(&buf, 0, &host)?;
                Ok(DevWeight { ty, rows, cols, buf, aux_off: 0 })
            }
            WType::Q8_0 => {
                let nb = rows * cols / 32;
                let mut host = vec![0u8; nb * 34];
                let (qs, ds) = host.split_at_mut(nb * 32);
                let mut k = 0;
                for p in pieces {
                    for blk in p.chunks_exact(34) {
                        ds[2 * k..2 * k + 2].copy_from_slice(&blk[..2]);
                        qs[32 * k..32 * k + 32].copy_from_slice(&blk[2..]);
                        k += 1;
                    }
                }
                let buf = gpu.alloc(host.len())?;
                gpu.upload(&buf, 0, &host)?;
                Ok(DevWeight { ty, rows, cols, buf, aux_off: nb * 32 })
            }
            WType::NvFp4 => {
                let nb = rows * cols / 64;
                let mut host = vec![0u8; nb * 36];
                let (qs, ds) = host.split_at_mut(nb * 32);
                let mut k = 0;
                for p in pieces {
                    for blk in p.chunks_exact(36) {
                        ds[4 * k..4 * k + 4].copy_from_slice(&blk[..4]);
                        qs[32 * k..32 * k + 32].copy_from_slice(&blk[4..]);
                        k += 1;
                    }
                }
                let buf = gpu.alloc(host.len())?;
                gpu.upload(&buf, 0, &host)?;
                Ok(DevWeight { ty, rows, cols, buf, aux_off: nb * 32 })
            }
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.buf.bytes()
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
    pub fn gemv(&self, gpu: &Gpu, batch: usize, qa: QAct, xf: u64, y: u64, ldy: usize) -> Result<()> {
        if batch == 0 || batch > MAX_GEMV_BATCH {
            return Err(CudaError::Shape(format!("GEMV batch {batch} (1..={MAX_GEMV_BATCH})")));
        }
        let name = format!("gemv_{}_b{batch}", self.ty.kernel());
        // Rows per 4-warp block (kernels.cu: Q4_K splits a row over 2 or 4 warps).
        let rows_per_block = match self.ty {
            WType::Q4K if self.cols / 256 >= 48 => 1,
            WType::Q4K => 2,
            _ => 4,
        };
        let grid = self.rows.div_ceil(rows_per_block) as u32;
        gpu.launch(
            &name,
            (grid, 1, 1),
            128,
            &[
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
            ],
        )
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
pub fn quantize_act(gpu: &Gpu, x: u64, n: usize, batch: usize, qa: QAct) -> Result<()> {
    let groups = batch * n / 16;
    gpu.launch(
        "quantize_act",
        (groups.div_ceil(256) as u32, 1, 1),
        256,
        &[Arg::P(x), Arg::L(n as i64), Arg::L(groups as i64), Arg::P(qa.q), Arg::P(qa.d), Arg::P(qa.s)],
    )
}
