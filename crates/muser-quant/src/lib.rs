//! ggml block formats: layouts, dequantization, reference quantizers (byte-identical to ggml),
//! activation quantizers (Q8_0, Q8_1, Q8_K) and dot products (scalar reference + AVX2/AVX512
//! chosen at run time).
//!
//! Everything here reproduces llama.cpp b11434's CPU numerics, bit for bit:
//! - [`dequantize_row`] equals ggml's `dequantize_row_*` (same operation order).
//! - [`quantize_row`] equals ggml's `quantize_row_*_ref` (what `llama-quantize` runs without an
//!   importance matrix) for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q4_K, Q5_K, Q6_K,
//!   Q8_K, MXFP4 and NVFP4.
//! - [`quantize_activations`] equals what ggml's x86 CPU build (AVX2 and up) does to the
//!   activation row before a matmul: for Q8_0 and Q8_1 that is the AVX kernel (multiplier
//!   `127/amax`, round half to even), which differs from the `_ref` quantizer (`1/d`, round half
//!   away from zero) in a few quants per thousand; Q8_K is the `_ref` quantizer on every target.
//! - [`vec_dot`] equals ggml's `ggml_vec_dot_*` of that build: integer partial sums per SIMD lane,
//!   f32 lanes combined with fused multiply-adds, reduced in ggml's tree order. The scalar
//!   reference ([`scalar::vec_dot`]) emulates the same lanes, so scalar, SIMD and llama.cpp agree
//!   exactly (tests check scalar against SIMD and both against goldens from ggml itself).
//!
//! # Which arithmetic llama.cpp uses where
//! ggml's CPU matmul takes different paths, each with its own float order:
//! - one activation row, or types without a faster path: [`vec_dot`];
//! - two or more activation rows against a multiple of 4 weight rows of F32, F16, BF16, Q8_0,
//!   Q4_0 or Q5_0: llamafile's tinyBLAS, reproduced by [`vec_dot_gemm`] (see
//!   [`uses_gemm_path`]; for the Q0 types it equals [`vec_dot`]);
//! - Q4_K/Q5_K/Q6_K against eight or more activation rows: ggml's tiled K-quant kernel, which
//!   the model crate implements (`muser-model/src/cpu/kquant.rs`).
//!
//! # Throughput API
//! [`vec_dot_rows`] dots one activation row against several consecutive weight rows (a slice of
//! a weight matrix), choosing the kernel once. A matmul calls it per activation row and per
//! block of output rows; decode (one activation row) is bound by reading the weights, so the
//! kernels stream each weight byte once and keep the activation row in L1/L2.
//!
//! # Kernels
//! Run-time dispatch ([`detected_isa`], capped by [`ISA_ENV`]): AVX2+FMA+F16C kernels for every
//! type (and 4-row × 4-token tile kernels for the 32-value byte formats), and on AVX512-VNNI
//! hosts the byte-dot formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, NVFP4) use EVEX `vpdpbusd`
//! like ggml's AVX512 build; both give the same bits. Scales are read through the same lookup tables
//! ggml uses (f16, E8M0, UE4M3). `scripts/quant-bench.sh` times them beside ggml's own kernels
//! (`docs/benchmarks.md`).

// The block loops mirror ggml's index arithmetic (element e of block b), which is easier to
// check against the C than iterator chains.
#![allow(clippy::needless_range_loop)]

mod dequant;
pub mod fp;
mod quantize;
pub mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use muser_gguf::GgmlType;

/// Values per K-quant super-block.
pub const QK_K: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{op} is not implemented for tensor type {ty}")]
    Unsupported { op: &'static str, ty: GgmlType },
    #[error("{n} values is not a whole number of {ty} blocks ({block} values each)")]
    PartialBlock {
        ty: GgmlType,
        n: usize,
        block: usize,
    },
    #[error("{ty} buffer holds {got} bytes where {n} values need {expected}")]
    BufferSize {
        ty: GgmlType,
        n: usize,
        expected: usize,
        got: usize,
    },
}

/// Bytes of a row of `n` values of type `ty`, checking that `n` fills whole blocks.
pub fn row_size(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let block = ty.block_size();
    if !n.is_multiple_of(block) {
        return Err(QuantError::PartialBlock { ty, n, block });
    }
    Ok(n / block * ty.type_size())
}

fn check_buffer(ty: GgmlType, n: usize, got: usize) -> Result<(), QuantError> {
    let expected = row_size(ty, n)?;
    if got != expected {
        return Err(QuantError::BufferSize {
            ty,
            n,
            expected,
            got,
        });
    }
    Ok(())
}

/// Whether [`dequantize_row`] handles `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_1
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
            | MXFP4
            | NVFP4
    )
}

/// Whether [`quantize_row`] handles `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_1
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
            | MXFP4
            | NVFP4
    )
}

/// Whether [`vec_dot`] handles weights of type `ty`.
pub fn has_vec_dot(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | MXFP4
            | NVFP4
    )
}

/// Decodes `dst.len()` values of type `ty` from `src` (exactly that many values' bytes).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !can_dequantize(ty) {
        return Err(QuantError::Unsupported {
            op: "dequantization",
            ty,
        });
    }
    check_buffer(ty, dst.len(), src.len())?;
    dequant::dequantize_blocks(ty, src, dst);
    Ok(())
}

/// Encodes `src` as type `ty` with ggml's reference quantizer (`quantize_row_*_ref`).
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    if !can_quantize(ty) {
        return Err(QuantError::Unsupported {
            op: "quantization",
            ty,
        });
    }
    check_buffer(ty, src.len(), dst.len())?;
    quantize::quantize_blocks(ty, src, dst);
    Ok(())
}

/// The activation format ggml's CPU backend converts the other operand to before dotting it
/// with a weight row of type `ty` (`type_traits_cpu[ty].vec_dot_type`).
pub fn vec_dot_type(ty: GgmlType) -> GgmlType {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | MXFP4 | NVFP4 => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => Q8_K,
        F16 => F16,
        BF16 => BF16,
        other => other,
    }
}

/// Converts an activation row to `vec_dot_ty` exactly as ggml's x86 CPU build does
/// (`type_traits_cpu[ty].from_float`); see the crate docs for how that differs from
/// [`quantize_row`] for Q8_0 and Q8_1.
pub fn quantize_activations(
    vec_dot_ty: GgmlType,
    src: &[f32],
    dst: &mut [u8],
) -> Result<(), QuantError> {
    if !can_quantize(vec_dot_ty) {
        return Err(QuantError::Unsupported {
            op: "activation quantization",
            ty: vec_dot_ty,
        });
    }
    check_buffer(vec_dot_ty, src.len(), dst.len())?;
    quantize::quantize_act_blocks(vec_dot_ty, src, dst);
    Ok(())
}

/// Checks a dot product's arguments; returns the rows cut to exactly `n` values.
pub(crate) fn check_dot<'a>(
    ty: GgmlType,
    n: usize,
    w: &'a [u8],
    a: &'a [u8],
) -> (&'a [u8], &'a [u8]) {
    assert!(has_vec_dot(ty), "no dot product for weight type {ty}");
    let wb = row_size(ty, n).expect("n must be a whole number of weight blocks");
    let ab = row_size(vec_dot_type(ty), n).expect("n must be a whole number of activation blocks");
    assert!(
        w.len() >= wb && a.len() >= ab,
        "rows shorter than {n} values of {ty}"
    );
    (&w[..wb], &a[..ab])
}

/// Which kernel family [`vec_dot`] uses on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 + AVX512F/DQ/BW/VL/VNNI (wider float loops, VNNI integer dots).
    Avx512,
}

impl Isa {
    /// The name used by [`ISA_ENV`] and in benchmark receipts.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The family named `s` ([`Isa::name`]), if any.
    pub fn parse(s: &str) -> Option<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .find(|i| i.name() == s)
    }
}

/// Environment variable that caps the kernel family below what the CPU has (`avx2` on an
/// AVX512 host runs every kernel an AVX2-only host would run), for tests and benchmarks.
pub const ISA_ENV: &str = "MUSER_ISA";

/// The best kernel family this CPU runs ([`hardware_isa`]), capped by [`ISA_ENV`] when it is
/// set; decided once per process. Every SIMD dispatch in the workspace goes through this.
///
/// # Panics
/// If [`ISA_ENV`] is set to something other than `scalar`, `avx2` or `avx512`.
pub fn detected_isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let hw = hardware_isa();
        // an empty value is the same as unset (`MUSER_ISA= cmd` in a script)
        match std::env::var(ISA_ENV).ok().filter(|v| !v.is_empty()) {
            Some(v) => {
                let cap = Isa::parse(&v)
                    .unwrap_or_else(|| panic!("{ISA_ENV}={v:?}: expected scalar, avx2 or avx512"));
                cap.min(hw)
            }
            None => hw,
        }
    })
}

/// The best kernel family the CPU itself supports (ignoring [`ISA_ENV`]).
pub fn hardware_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        x86::detect()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Isa::Scalar
    }
}

/// `w · a` for `n` values: `w` a row of type `ty`, `a` a row already converted with
/// [`quantize_activations`]`(vec_dot_type(ty), ..)`. Uses the best SIMD kernel of this CPU.
///
/// # Panics
/// Same as [`scalar::vec_dot`]: unsupported `ty` or rows shorter than `n` values.
pub fn vec_dot(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    vec_dot_isa(detected_isa(), ty, n, w, a)
}

/// [`vec_dot`] with an explicit kernel family (for tests and benchmarks). A family this CPU
/// lacks falls back to the best one it has.
pub fn vec_dot_isa(isa: Isa, ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = if isa > detected_isa() {
            detected_isa()
        } else {
            isa
        };
        if isa != Isa::Scalar {
            let (w, a) = check_dot(ty, n, w, a);
            if let Some(s) = x86::vec_dot(isa, ty, w, a) {
                return s;
            }
        }
    }
    let _ = isa;
    scalar::vec_dot(ty, n, w, a)
}

/// Whether ggml's CPU backend computes a matmul of `n_rows` weight rows of type `ty` against
/// `n_tokens` activation rows with llamafile's tinyBLAS (prompt processing) instead of
/// `vec_dot`, on x86 with AVX512: two or more tokens, a multiple of 4 weight rows, and a type
/// tinyBLAS handles. Then [`vec_dot_gemm`] gives its numbers; otherwise [`vec_dot`] does.
pub fn uses_gemm_path(ty: GgmlType, n_rows: usize, n_tokens: usize) -> bool {
    use GgmlType::*;
    n_tokens >= 2 && n_rows.is_multiple_of(4) && matches!(ty, F32 | F16 | BF16 | Q8_0 | Q4_0 | Q5_0)
}

/// `w · a` as llama.cpp's prompt-processing matmul computes it (see [`uses_gemm_path`] and
/// [`scalar::vec_dot_gemm`]); SIMD where available.
///
/// # Panics
/// As [`vec_dot`].
pub fn vec_dot_gemm(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    vec_dot_gemm_isa(detected_isa(), ty, n, w, a)
}

/// [`vec_dot_gemm`] with an explicit kernel family (for tests and benchmarks).
pub fn vec_dot_gemm_isa(isa: Isa, ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        return vec_dot_isa(isa, ty, n, w, a);
    }
    #[cfg(target_arch = "x86_64")]
    if isa.min(detected_isa()) != Isa::Scalar {
        let (w, a) = check_dot(ty, n, w, a);
        if let Some(s) = x86::vec_dot_gemm(ty, w, a) {
            return s;
        }
    }
    scalar::vec_dot_gemm(ty, n, w, a)
}

/// Dots one activation row `a` (of `vec_dot_type(ty)`, `n` values) against `out.len()`
/// consecutive weight rows of `n` values stored back to back in `w`; `out[r] = w_r · a`.
///
/// # Panics
/// As [`vec_dot`], or if `w` holds fewer than `out.len()` rows.
pub fn vec_dot_rows(ty: GgmlType, n: usize, w: &[u8], a: &[u8], out: &mut [f32]) {
    let isa = detected_isa();
    let rb = row_size(ty, n).expect("n must be a whole number of weight blocks");
    assert!(
        w.len() >= rb * out.len(),
        "weight slice holds fewer than {} rows",
        out.len()
    );
    for (r, o) in out.iter_mut().enumerate() {
        *o = vec_dot_isa(isa, ty, n, &w[r * rb..(r + 1) * rb], a);
    }
}

/// The dot product of one weight type and row length with its kernel chosen once, for loops
/// that call it many times (a matmul): no per-call feature detection or length arithmetic.
/// Every result has the bits of [`vec_dot`].
#[derive(Clone, Copy, Debug)]
pub struct RowDot {
    ty: GgmlType,
    n: usize,
    w_bytes: usize,
    a_bytes: usize,
    isa: Isa,
}

impl RowDot {
    /// The kernel for rows of `n` values of weight type `ty`.
    pub fn new(ty: GgmlType, n: usize) -> Result<RowDot, QuantError> {
        RowDot::with_isa(ty, n, detected_isa())
    }

    /// [`RowDot::new`] with an explicit kernel family (for tests and benchmarks); a family
    /// this CPU lacks falls back to the best one it has. Every family gives the same bits.
    pub fn with_isa(ty: GgmlType, n: usize, isa: Isa) -> Result<RowDot, QuantError> {
        if !has_vec_dot(ty) {
            return Err(QuantError::Unsupported {
                op: "dot product",
                ty,
            });
        }
        Ok(RowDot {
            ty,
            n,
            w_bytes: row_size(ty, n)?,
            a_bytes: row_size(vec_dot_type(ty), n)?,
            isa: isa.min(hardware_isa()),
        })
    }

    /// Bytes of one weight row.
    pub fn weight_row_bytes(&self) -> usize {
        self.w_bytes
    }

    /// Bytes of one activation row (of `vec_dot_type(ty)`).
    pub fn act_row_bytes(&self) -> usize {
        self.a_bytes
    }

    /// `w · a` (one weight row, one activation row), as [`vec_dot`].
    ///
    /// # Panics
    /// If a row is shorter than its size.
    #[inline]
    pub fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let (w, a) = (&w[..self.w_bytes], &a[..self.a_bytes]);
        #[cfg(target_arch = "x86_64")]
        if self.isa != Isa::Scalar {
            if let Some(s) = x86::vec_dot(self.isa, self.ty, w, a) {
                return s;
            }
        }
        scalar::vec_dot(self.ty, self.n, w, a)
    }

    /// Every weight row of `w` (rows back to back) against every activation row of `a`:
    /// `out[t * out_stride + r] = w_r · a_t` (token-major, as a matmul's output), each value
    /// with the bits of [`vec_dot`]. With SIMD (AVX2 or AVX512-VNNI) the 32-value formats run a
    /// kernel that takes 4 weight rows × 4 tokens at a time; one activation row (decode) streams the
    /// weight rows one by one with software prefetch.
    ///
    /// # Panics
    /// If `w` or `a` is not a whole number of rows, `out_stride` is less than the number of
    /// weight rows, or `out` is too short.
    pub fn dot_tile(&self, w: &[u8], a: &[u8], out: &mut [f32], out_stride: usize) {
        assert!(self.w_bytes > 0 && self.a_bytes > 0, "empty rows");
        assert!(
            w.len().is_multiple_of(self.w_bytes) && a.len().is_multiple_of(self.a_bytes),
            "not a whole number of rows"
        );
        let (n_w, n_a) = (w.len() / self.w_bytes, a.len() / self.a_bytes);
        if n_w == 0 || n_a == 0 {
            return;
        }
        assert!(out_stride >= n_w && out.len() >= (n_a - 1) * out_stride + n_w);
        #[cfg(target_arch = "x86_64")]
        if self.isa != Isa::Scalar {
            let nb = self.n / self.ty.block_size();
            // SAFETY: the ISA was detected; the row counts and `out`'s extent were checked above.
            let done = unsafe {
                x86::tile_run(
                    self.isa,
                    self.ty,
                    w.as_ptr(),
                    self.w_bytes,
                    n_w,
                    a.as_ptr(),
                    self.a_bytes,
                    n_a,
                    nb,
                    out.as_mut_ptr(),
                    out_stride,
                )
            };
            if done {
                return;
            }
        }
        // each weight row read once, dotted with every (cache-resident) activation row
        for (r, wr) in w.chunks_exact(self.w_bytes).enumerate() {
            for (t, ar) in a.chunks_exact(self.a_bytes).enumerate() {
                out[t * out_stride + r] = self.dot(wr, ar);
            }
        }
    }
}
