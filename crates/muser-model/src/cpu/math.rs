//! Scalar models of ggml's CPU vector primitives, written so that each result is bit-identical
//! to what one build of ggml b11434 computes: the [`Order`] argument names the build (AVX512 or
//! AVX2), whose register width, `expf` and reduction trees differ.
//!
//! The order of every floating-point operation matters here: the functions mirror the lane
//! structure of the SIMD code (16- or 8-lane accumulators, the reduction trees of
//! `_mm512_reduce_add_ps` and of AVX2's `hadd`s, fused multiply-adds where ggml uses them) rather
//! than the mathematically obvious loop.
//! Callers run them inside `fma_fn!` functions so that `mul_add` is one instruction.

use super::numerics::Order;

/// Lanes of an AVX512 f32 register.
pub const LANES: usize = 16;

/// Defines `fn name(args) -> ret` that runs `body` compiled with AVX2+FMA+F16C when the CPU has
/// them (checked at run time), and as plain code otherwise. The numerics are the same either
/// way (`mul_add` is always a fused multiply-add); only the speed differs.
macro_rules! fma_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident $(<$lt:lifetime>)? ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name $(<$lt>)? ($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp $(<$lt>)? ($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn fast $(<$lt>)? ($($arg: $ty),*) $(-> $ret)? { imp($($arg),*) }
                if std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
                {
                    // SAFETY: the features `fast` is compiled for were detected just above.
                    return unsafe { fast($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}
pub(crate) use fma_fn;

/// The halving reduction of 16 or 8 lanes: upper half plus lower half down to four values,
/// then `(t0 + t2) + (t1 + t3)`. `_mm512_reduce_add_ps` on 16 lanes; on 8 lanes, the
/// extract/`movehl`/`movehdup` sum of AVX2's `ggml_vec_soft_max_f32` and of tinyBLAS's `hsum`.
#[inline(always)]
fn reduce_halves(v: &[f32]) -> f32 {
    let mut t = [0f32; LANES];
    t[..v.len()].copy_from_slice(v);
    let mut w = v.len();
    while w > 4 {
        w /= 2;
        for i in 0..w {
            t[i] += t[i + w];
        }
    }
    (t[0] + t[2]) + (t[1] + t[3])
}

/// The reduction of `GGML_F32x8_REDUCE` (AVX2 `ggml_vec_dot_f16`/`_f32`): upper half plus lower
/// half, then two horizontal adds, `(t0 + t1) + (t2 + t3)`.
#[inline(always)]
fn reduce_hadd_8(v: &[f32]) -> f32 {
    let t: [f32; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
    (t[0] + t[1]) + (t[2] + t[3])
}

/// The lane reduction of `ggml_vec_dot_f16`/`_f32` in `order`.
#[inline(always)]
fn reduce_dot(order: Order, v: &[f32]) -> f32 {
    match order {
        Order::GgmlAvx512 => reduce_halves(v),
        Order::GgmlAvx2 => reduce_hadd_8(v),
    }
}

/// `j · 2^n` for integral `n` in `[-192, 192]` with one rounding, as `_mm512_scalef_ps` does.
#[inline(always)]
fn scalef(j: f32, n: f32) -> f32 {
    // The f64 product is exact (a power of two times a 24-bit significand), so the cast is the
    // only rounding, including into the subnormal range. `2^n` is built from its exponent bits
    // (n is within f64's normal range); a NaN `n` gives exponent 0 here and a NaN `j` anyway.
    let e = (n as i32).clamp(-192, 192) + 1023;
    (f64::from(j) * f64::from_bits((e as u64) << 52)) as f32
}

/// ggml's vectorised exponential (`ggml_v_expf`) for one lane, in the flavour of `order`'s
/// build. It is not libm's `expf`: its error is up to 1.5 ulp, and it saturates to 0 / +inf
/// beyond |n| > 192.
#[inline(always)]
pub fn v_expf(order: Order, x: f32) -> f32 {
    match order {
        Order::GgmlAvx512 => v_expf_avx512(x),
        Order::GgmlAvx2 => v_expf_avx2(x),
    }
}

/// `ggml_v_expf`, AVX512 flavour: degree-5 polynomial, `_mm512_scalef_ps`.
#[inline(always)]
fn v_expf_avx512(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000);
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),
        (-n).mul_add(f32::from_bits(0x3f31_7200), x),
    );
    let u = b * b;
    let j = f32::from_bits(0x3c07_2010)
        .mul_add(b, f32::from_bits(0x3d2b_9f17))
        .mul_add(
            u,
            f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)),
        )
        .mul_add(u, f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    scalef(j, n)
}

/// `ggml_v_expf`, AVX2 flavour: the same reduction, a polynomial without the constant term,
/// `2^n` built from the exponent bits of `z`, and a two-factor path past `|n| > 126`.
#[inline(always)]
fn v_expf_avx2(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000);
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),
        (-n).mul_add(f32::from_bits(0x3f31_7200), x),
    );
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = f32::from_bits(0x3c07_2010)
        .mul_add(b, f32::from_bits(0x3d2b_9f17))
        .mul_add(
            u,
            f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)),
        )
        .mul_add(u, f32::from_bits(0x3f7f_fff6) * b);
    // `_CMP_GT_OQ`: false for a NaN `n`, which takes the plain path.
    let two_factors = n.abs() > 126.0;
    if !two_factors {
        return k.mul_add(j, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// ggml's vectorised SiLU lane: `x / (1 + v_expf(0 - x))`.
#[inline(always)]
pub fn v_silu(order: Order, x: f32) -> f32 {
    x / (1.0 + v_expf(order, 0.0 - x))
}

/// `ggml_vec_swiglu_f32`: `silu(g) * u`, `order.lanes()` at a time with the vector SiLU, the
/// tail with libm's `expf`. (The model of [`swiglu_fast`], which the tests compare it with.)
#[cfg_attr(not(test), allow(dead_code))]
#[inline(always)]
pub fn swiglu(order: Order, g: &[f32], u: &[f32], out: &mut [f32]) {
    let n = out.len();
    let body = n - n % order.lanes();
    for i in 0..body {
        out[i] = v_silu(order, g[i]) * u[i];
    }
    for i in body..n {
        out[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
    }
}

/// `ggml_vec_soft_max_f32`: writes `exp(x - max)` (vector exp, `order.lanes()` at a time; libm
/// for the tail) and returns the sum, accumulated per lane group in f32 and across groups in f64.
#[inline(always)]
pub fn soft_max_tile(order: Order, x: &mut [f32], max: f32) -> f64 {
    let w = order.lanes();
    let n = x.len();
    let body = n - n % w;
    let mut sum = 0f64;
    for chunk in x[..body].chunks_exact_mut(w) {
        for e in chunk.iter_mut() {
            *e = v_expf(order, *e - max);
        }
        sum += f64::from(reduce_halves(chunk));
    }
    for e in &mut x[body..] {
        *e = (*e - max).exp();
        sum += f64::from(*e);
    }
    sum
}

/// `ggml_vec_dot_f16` / `ggml_vec_dot_f32` in `order` (F16 values widened exactly, no FP16
/// arithmetic): four accumulators of `order.lanes()` lanes over steps of four registers, reduced
/// `(a0+a2) + (a1+a3)` then across lanes; the tail in f64.
#[inline(always)]
pub fn vec_dot<T: Copy + Into<f32>>(order: Order, x: &[T], y: &[T]) -> f32 {
    match order {
        Order::GgmlAvx512 => vec_dot_lanes::<16, T>(order, x, y),
        Order::GgmlAvx2 => vec_dot_lanes::<8, T>(order, x, y),
    }
}

#[inline(always)]
fn vec_dot_lanes<const W: usize, T: Copy + Into<f32>>(order: Order, x: &[T], y: &[T]) -> f32 {
    let n = x.len();
    let body = n - n % (4 * W);
    let mut acc = [[0f32; W]; 4];
    for (cx, cy) in x[..body]
        .chunks_exact(4 * W)
        .zip(y[..body].chunks_exact(4 * W))
    {
        for (j, a) in acc.iter_mut().enumerate() {
            for l in 0..W {
                a[l] = cx[j * W + l].into().mul_add(cy[j * W + l].into(), a[l]);
            }
        }
    }
    let s: [f32; W] = std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let mut sum = f64::from(reduce_dot(order, &s));
    for k in body..n {
        sum += f64::from(x[k].into() * y[k].into());
    }
    sum as f32
}

/// One tinyBLAS dot product (llamafile `sgemm` on x86, F16 or F32 values, `KN =
/// order.lanes()`): lane `l` accumulates elements `l, l+KN, ...` with FMA in order; the last
/// `n % KN` values are loaded partially (the other lanes add `0·0`); then `hsum`.
#[inline(always)]
pub fn tinyblas_dot<T: Copy + Into<f32>>(order: Order, x: &[T], y: &[T]) -> f32 {
    match order {
        Order::GgmlAvx512 => tinyblas_lanes::<16, T>(x, y),
        Order::GgmlAvx2 => tinyblas_lanes::<8, T>(x, y),
    }
}

#[inline(always)]
fn tinyblas_lanes<const W: usize, T: Copy + Into<f32>>(x: &[T], y: &[T]) -> f32 {
    let mut acc = [0f32; W];
    let (mut cx, mut cy) = (x.chunks_exact(W), y.chunks_exact(W));
    for (a, b) in (&mut cx).zip(&mut cy) {
        for l in 0..W {
            acc[l] = a[l].into().mul_add(b[l].into(), acc[l]);
        }
    }
    let (rx, ry) = (cx.remainder(), cy.remainder());
    if !rx.is_empty() {
        for l in 0..W {
            acc[l] = if l < rx.len() {
                rx[l].into().mul_add(ry[l].into(), acc[l])
            } else {
                acc[l] + 0.0
            };
        }
    }
    reduce_halves(&acc)
}

/// Weight rows and activation rows of one [`tinyblas_tile`].
pub const TILE_ROWS: usize = 4;
pub const TILE_TOKENS: usize = 4;

/// [`tinyblas_dot`] of each of `TILE_ROWS` weight rows `w` with each of `TILE_TOKENS`
/// activation rows `x` (all `n` long, `n` a multiple of `order.lanes()`): `out[i][j]` has the
/// bits of `tinyblas_dot(order, w[i], x[j])`. Every dot keeps its own lanes, each summing its
/// elements with FMA in order as the one-dot kernel does; the tile only loads each value once
/// for the dots that share it (llamafile's `tinyBLAS::gemm` tiles the same way).
#[inline(always)]
pub fn tinyblas_tile(
    order: Order,
    w: [&[f32]; TILE_ROWS],
    x: [&[f32]; TILE_TOKENS],
    out: &mut [[f32; TILE_TOKENS]; TILE_ROWS],
) {
    let n = w[0].len();
    assert!(
        n.is_multiple_of(order.lanes()) && w.iter().chain(&x).all(|r| r.len() == n),
        "tinyblas_tile: rows of one length, a multiple of the lanes"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if order == Order::GgmlAvx512 && has_avx512() {
            // SAFETY: AVX512F/DQ detected; the rows' lengths were checked above.
            return unsafe { x86::tinyblas_tile(w, x, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: AVX2 and FMA detected; the rows' lengths were checked above.
            return unsafe {
                match order {
                    Order::GgmlAvx512 => x86_avx2::tinyblas_tile::<16>(w, x, out),
                    Order::GgmlAvx2 => x86_avx2::tinyblas_tile::<8>(w, x, out),
                }
            };
        }
    }
    match order {
        Order::GgmlAvx512 => tinyblas_tile_lanes::<16>(w, x, out),
        Order::GgmlAvx2 => tinyblas_tile_lanes::<8>(w, x, out),
    }
}

#[inline(always)]
fn tinyblas_tile_lanes<const W: usize>(
    w: [&[f32]; TILE_ROWS],
    x: [&[f32]; TILE_TOKENS],
    out: &mut [[f32; TILE_TOKENS]; TILE_ROWS],
) {
    let n = w[0].len();
    let mut acc = [[[0f32; W]; TILE_TOKENS]; TILE_ROWS];
    for k in (0..n).step_by(W) {
        let wk: [&[f32; W]; TILE_ROWS] =
            std::array::from_fn(|i| w[i][k..k + W].try_into().expect("W values"));
        let xk: [&[f32; W]; TILE_TOKENS] =
            std::array::from_fn(|j| x[j][k..k + W].try_into().expect("W values"));
        for (acc_i, wi) in acc.iter_mut().zip(wk) {
            for (a, xj) in acc_i.iter_mut().zip(xk) {
                for l in 0..W {
                    a[l] = wi[l].mul_add(xj[l], a[l]);
                }
            }
        }
    }
    for (o_i, acc_i) in out.iter_mut().zip(&acc) {
        for (o, a) in o_i.iter_mut().zip(acc_i) {
            *o = reduce_halves(a);
        }
    }
}

/// ggml's RMS norm scale for one row: the sum of squares (each square rounded to f32) in f64,
/// the mean cast to f32, then `1/sqrtf(mean + eps)`.
#[inline(always)]
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let mut sum = 0f64;
    for &v in x {
        sum += f64::from(v * v);
    }
    let mean = (sum / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// Whether the AVX512 kernels ([`x86`]) run: the CPU has them and `MUSER_ISA` does not cap
/// the dispatch below (see [`muser_quant::detected_isa`]).
pub fn has_avx512() -> bool {
    muser_quant::detected_isa() == muser_quant::Isa::Avx512
}

/// `g = silu(g) * u` in place (`ggml_vec_swiglu_f32`) in `order`, with the AVX512 kernel
/// (AVX512 order) or the AVX2 kernel (either order) when the CPU has it.
pub fn swiglu_fast(order: Order, g: &mut [f32], u: &[f32]) {
    assert!(u.len() >= g.len());
    #[cfg(target_arch = "x86_64")]
    if order == Order::GgmlAvx512 && has_avx512() {
        // SAFETY: the features were detected; the lengths were checked above.
        unsafe { x86::swiglu(g, u) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if muser_quant::detected_isa() >= muser_quant::Isa::Avx2 {
        // SAFETY: as above.
        unsafe { x86_avx2::swiglu(order, g, u) };
        return;
    }
    swiglu_scalar(order, g, u);
}

fma_fn! {
fn swiglu_scalar(order: Order, g: &mut [f32], u: &[f32]) {
    let n = g.len();
    let body = n - n % order.lanes();
    for i in 0..body {
        g[i] = v_silu(order, g[i]) * u[i];
    }
    for i in body..n {
        g[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
    }
}
}

/// The AVX512 build of ggml's vector primitives, instruction for instruction, so results equal
/// the scalar models above bit for bit (tests below compare them).
#[cfg(target_arch = "x86_64")]
pub mod x86 {
    use super::{LANES, TILE_ROWS, TILE_TOKENS};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn c(bits: u32) -> __m512 {
        _mm512_set1_ps(f32::from_bits(bits))
    }

    /// `ggml_v_expf` (AVX512F + DQ).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn v_expf(x: __m512) -> __m512 {
        let r = c(0x4b40_0000);
        let z = _mm512_fmadd_ps(x, c(0x3fb8_aa3b), r);
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(n, c(0x35bf_be8e), _mm512_fnmadd_ps(n, c(0x3f31_7200), x));
        let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
                u,
                _mm512_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
            ),
            u,
            _mm512_fmadd_ps(c(0x3f7f_fff6), b, _mm512_set1_ps(1.0)),
        );
        let res = _mm512_scalef_ps(j, n);
        if d == 0 {
            return res;
        }
        let zero = _mm512_setzero_ps();
        let alt = _mm512_mask_blend_ps(
            _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero),
            _mm512_set1_ps(f32::INFINITY),
            zero,
        );
        _mm512_mask_blend_ps(d, res, alt)
    }

    /// `ggml_v_silu`: `x / (1 + v_expf(0 - x))`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn v_silu(x: __m512) -> __m512 {
        let e = v_expf(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), e))
    }

    /// `_mm512_reduce_add_ps` as GCC expands it (see [`super::reduce_halves`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn reduce_add(v: __m512) -> f32 {
        let t8 = _mm256_add_ps(_mm512_extractf32x8_ps::<1>(v), _mm512_castps512_ps256(v));
        let t4 = _mm_add_ps(_mm256_extractf128_ps::<1>(t8), _mm256_castps256_ps128(t8));
        let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)))
    }

    /// [`super::tinyblas_tile`] in the AVX512 order: one register of 16 lanes per dot (16
    /// accumulators and the tile's 4 activation registers: 21 of 32).
    /// Every row is `n` long, `n` a multiple of 16.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn tinyblas_tile(
        w: [&[f32]; TILE_ROWS],
        x: [&[f32]; TILE_TOKENS],
        out: &mut [[f32; TILE_TOKENS]; TILE_ROWS],
    ) {
        let n = w[0].len();
        let mut acc = [[_mm512_setzero_ps(); TILE_TOKENS]; TILE_ROWS];
        let mut xv = [_mm512_setzero_ps(); TILE_TOKENS];
        let mut k = 0;
        while k < n {
            for j in 0..TILE_TOKENS {
                xv[j] = _mm512_loadu_ps(x[j].as_ptr().add(k));
            }
            for i in 0..TILE_ROWS {
                let wv = _mm512_loadu_ps(w[i].as_ptr().add(k));
                for j in 0..TILE_TOKENS {
                    acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
                }
            }
            k += LANES;
        }
        for i in 0..TILE_ROWS {
            for j in 0..TILE_TOKENS {
                out[i][j] = reduce_add(acc[i][j]);
            }
        }
    }

    /// [`super::swiglu`] in place on `g`; `u` at least as long.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn swiglu(g: &mut [f32], u: &[f32]) {
        let n = g.len();
        let body = n - n % LANES;
        let (gp, up) = (g.as_mut_ptr(), u.as_ptr());
        let mut i = 0;
        while i < body {
            let s = v_silu(_mm512_loadu_ps(gp.add(i)));
            _mm512_storeu_ps(gp.add(i), _mm512_mul_ps(s, _mm512_loadu_ps(up.add(i))));
            i += LANES;
        }
        for i in body..n {
            g[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
        }
    }

    /// [`super::soft_max_tile`] (the tiled attention kernel does it lane-wise instead).
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn soft_max_tile(x: &mut [f32], max: f32) -> f64 {
        let n = x.len();
        let body = n - n % LANES;
        let p = x.as_mut_ptr();
        let vm = _mm512_set1_ps(max);
        let mut sum = 0f64;
        let mut i = 0;
        while i < body {
            let v = v_expf(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), vm));
            _mm512_storeu_ps(p.add(i), v);
            sum += f64::from(reduce_add(v));
            i += LANES;
        }
        for e in &mut x[body..] {
            *e = (*e - max).exp();
            sum += f64::from(*e);
        }
        sum
    }
}

/// The same vector primitives on AVX2 (8 lanes): each lane computes what an AVX512 lane
/// computes (`_mm512_scalef_ps` emulated in f64, exact), so results equal the scalar models
/// above bit for bit, and with them ggml's AVX512 build.
#[cfg(target_arch = "x86_64")]
pub mod x86_avx2 {
    use super::{reduce_halves, Order, TILE_ROWS, TILE_TOKENS};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn c(bits: u32) -> __m256 {
        _mm256_set1_ps(f32::from_bits(bits))
    }

    /// [`super::tinyblas_tile`] in `W` lanes (16: the AVX512 order, two registers per dot;
    /// 8: the AVX2 order, one), each lane as the scalar model's. Every row is `n` long, `n`
    /// a multiple of `W`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tinyblas_tile<const W: usize>(
        w: [&[f32]; TILE_ROWS],
        x: [&[f32]; TILE_TOKENS],
        out: &mut [[f32; TILE_TOKENS]; TILE_ROWS],
    ) {
        // 2×2 dots at a time: with two registers a dot, more would not stay in 16 registers
        const S: usize = 2;
        let (n, regs) = (w[0].len(), W / 8);
        let mut lanes = [0f32; 16];
        for i0 in (0..TILE_ROWS).step_by(S) {
            for j0 in (0..TILE_TOKENS).step_by(S) {
                let mut acc = [[[_mm256_setzero_ps(); 2]; S]; S];
                let mut xv = [[_mm256_setzero_ps(); 2]; S];
                let mut k = 0;
                while k < n {
                    for j in 0..S {
                        for h in 0..regs {
                            xv[j][h] = _mm256_loadu_ps(x[j0 + j].as_ptr().add(k + 8 * h));
                        }
                    }
                    for i in 0..S {
                        for h in 0..regs {
                            let wv = _mm256_loadu_ps(w[i0 + i].as_ptr().add(k + 8 * h));
                            for j in 0..S {
                                acc[i][j][h] = _mm256_fmadd_ps(wv, xv[j][h], acc[i][j][h]);
                            }
                        }
                    }
                    k += W;
                }
                for i in 0..S {
                    for j in 0..S {
                        for h in 0..regs {
                            _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * h), acc[i][j][h]);
                        }
                        out[i0 + i][j0 + j] = reduce_halves(&lanes[..W]);
                    }
                }
            }
        }
    }

    /// `j · 2^n` for integral `n` with one rounding, as `_mm512_scalef_ps` (see
    /// [`super::scalef`]: the f64 product is exact, the conversion rounds once).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scalef(j: __m256, n: __m256) -> __m256 {
        let ni = _mm256_cvtps_epi32(n);
        let ni = _mm256_min_epi32(
            _mm256_max_epi32(ni, _mm256_set1_epi32(-192)),
            _mm256_set1_epi32(192),
        );
        let e = _mm256_add_epi32(ni, _mm256_set1_epi32(1023));
        let pow =
            |e: __m128i| _mm256_castsi256_pd(_mm256_slli_epi64::<52>(_mm256_cvtepi32_epi64(e)));
        let lo = _mm256_mul_pd(
            _mm256_cvtps_pd(_mm256_castps256_ps128(j)),
            pow(_mm256_castsi256_si128(e)),
        );
        let hi = _mm256_mul_pd(
            _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(j)),
            pow(_mm256_extracti128_si256::<1>(e)),
        );
        _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo))
    }

    /// `ggml_v_expf`, AVX512 flavour, on eight lanes ([`super::v_expf`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn v_expf(x: __m256) -> __m256 {
        let r = c(0x4b40_0000);
        let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), _mm256_fnmadd_ps(n, c(0x3f31_7200), x));
        let abs_n = _mm256_and_ps(n, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)));
        let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
                u,
                _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
            ),
            u,
            _mm256_fmadd_ps(c(0x3f7f_fff6), b, _mm256_set1_ps(1.0)),
        );
        let res = scalef(j, n);
        if _mm256_movemask_ps(d) == 0 {
            return res;
        }
        let zero = _mm256_setzero_ps();
        let alt = _mm256_blendv_ps(
            _mm256_set1_ps(f32::INFINITY),
            zero,
            _mm256_cmp_ps::<_CMP_LE_OQ>(n, zero),
        );
        _mm256_blendv_ps(res, alt, d)
    }

    /// `ggml_v_expf`, AVX2 flavour ([`super::v_expf`] in [`Order::GgmlAvx2`]): ggml's own
    /// instructions.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn v_expf_avx2_order(x: __m256) -> __m256 {
        let r = c(0x4b40_0000);
        let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), _mm256_fnmadd_ps(n, c(0x3f31_7200), x));
        let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
        let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(c(0x3f80_0000))));
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let cm = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
                u,
                _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
            ),
            u,
            _mm256_mul_ps(c(0x3f7f_fff6), b),
        );
        if _mm256_movemask_ps(cm) == 0 {
            return _mm256_fmadd_ps(j, k, k);
        }
        let g = _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
            _mm256_set1_epi32(0x8200_0000u32 as i32),
        );
        let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
        let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
        let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
        _mm256_or_ps(
            _mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
            _mm256_andnot_ps(
                d,
                _mm256_or_ps(
                    _mm256_and_ps(cm, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                    _mm256_andnot_ps(cm, _mm256_fmadd_ps(k, j, k)),
                ),
            ),
        )
    }

    /// `GGML_F32x8_REDUCE`'s last step ([`super::reduce_hadd_8`]): `hi + lo`, two `hadd`s.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn reduce_hadd_8(v: __m256) -> f32 {
        let t0 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let t1 = _mm_hadd_ps(t0, t0);
        _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
    }

    /// `_mm512_reduce_add_ps` (GCC's tree, [`super::reduce_halves`]) of the 16 lanes `lo`, `hi`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn reduce_add_16(lo: __m256, hi: __m256) -> f32 {
        let t8 = _mm256_add_ps(hi, lo);
        let t4 = _mm_add_ps(_mm256_extractf128_ps::<1>(t8), _mm256_castps256_ps128(t8));
        let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)))
    }

    /// [`super::swiglu`] in `order`, in place on `g`; `u` at least as long.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn swiglu(order: Order, g: &mut [f32], u: &[f32]) {
        let n = g.len();
        let body = n - n % order.lanes();
        let (gp, up) = (g.as_mut_ptr(), u.as_ptr());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i < body {
            let x = _mm256_loadu_ps(gp.add(i));
            let neg = _mm256_sub_ps(_mm256_setzero_ps(), x);
            let e = match order {
                Order::GgmlAvx512 => v_expf(neg),
                Order::GgmlAvx2 => v_expf_avx2_order(neg),
            };
            let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(gp.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(up.add(i))));
            i += 8;
        }
        for i in body..n {
            g[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
        }
    }
}

fma_fn! {
/// [`rms_scale`] and the scaling (times `weight` when given) of every `group`-wide slice of
/// `data`, in place. Four slices at a time, so that their serial f64 sums overlap.
pub fn rms_norm_groups(data: &mut [f32], group: usize, eps: f32, weight: Option<&[f32]>) {
    let scale_of = |sum: f64| {
        let mean = (sum / group as f64) as f32;
        1.0 / (mean + eps).sqrt()
    };
    let apply = |g: &mut [f32], scale: f32| match weight {
        Some(w) => g.iter_mut().zip(w).for_each(|(v, &w)| *v = *v * scale * w),
        None => g.iter_mut().for_each(|v| *v *= scale),
    };
    let mut quads = data.chunks_exact_mut(4 * group);
    for q in &mut quads {
        let (a, rest) = q.split_at_mut(group);
        let (b, rest) = rest.split_at_mut(group);
        let (c, d) = rest.split_at_mut(group);
        let mut s = [0f64; 4];
        for i in 0..group {
            s[0] += f64::from(a[i] * a[i]);
            s[1] += f64::from(b[i] * b[i]);
            s[2] += f64::from(c[i] * c[i]);
            s[3] += f64::from(d[i] * d[i]);
        }
        apply(a, scale_of(s[0]));
        apply(b, scale_of(s[1]));
        apply(c, scale_of(s[2]));
        apply(d, scale_of(s[3]));
    }
    for g in quads.into_remainder().chunks_exact_mut(group) {
        let sc = rms_scale(g, eps);
        apply(g, sc);
    }
}
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDERS: [Order; 2] = [Order::GgmlAvx512, Order::GgmlAvx2];

    /// Every tile kernel this CPU runs (scalar, AVX2 in 16 and 8 lanes, AVX512) gives each dot
    /// the bits of [`tinyblas_dot`].
    #[test]
    fn tinyblas_tile_kernels_equal_one_dot_each() {
        let n = 160;
        let v = |seed: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0 - 1.0) * 1.3)
                .collect()
        };
        let (wv, xv): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (
            (0..TILE_ROWS).map(v).collect(),
            (0..TILE_TOKENS).map(|j| v(TILE_ROWS + j)).collect(),
        );
        let w: [&[f32]; TILE_ROWS] = std::array::from_fn(|i| &wv[i][..]);
        let x: [&[f32]; TILE_TOKENS] = std::array::from_fn(|j| &xv[j][..]);
        for order in ORDERS {
            let want: Vec<f32> = w
                .iter()
                .flat_map(|wi| x.iter().map(move |xj| tinyblas_dot(order, wi, xj)))
                .collect();
            let mut runs: Vec<(&str, [[f32; TILE_TOKENS]; TILE_ROWS])> = Vec::new();
            let mut out = [[0f32; TILE_TOKENS]; TILE_ROWS];
            match order {
                Order::GgmlAvx512 => tinyblas_tile_lanes::<16>(w, x, &mut out),
                Order::GgmlAvx2 => tinyblas_tile_lanes::<8>(w, x, &mut out),
            }
            runs.push(("scalar", out));
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: AVX2 and FMA detected; rows of one length, a multiple of 16.
                    unsafe {
                        match order {
                            Order::GgmlAvx512 => x86_avx2::tinyblas_tile::<16>(w, x, &mut out),
                            Order::GgmlAvx2 => x86_avx2::tinyblas_tile::<8>(w, x, &mut out),
                        }
                    }
                    runs.push(("avx2", out));
                }
                if order == Order::GgmlAvx512 && has_avx512() {
                    // SAFETY: AVX512F/DQ detected; rows as above.
                    unsafe { x86::tinyblas_tile(w, x, &mut out) };
                    runs.push(("avx512", out));
                }
            }
            for (name, got) in runs {
                let got: Vec<u32> = got.iter().flatten().map(|v| v.to_bits()).collect();
                let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "{name} {order:?}");
            }
        }
    }

    #[test]
    fn v_expf_is_close_to_exp_and_saturates() {
        for order in ORDERS {
            // Past |x| > 87 the results are subnormal or infinite (AVX2's two-factor path).
            for i in -870..870 {
                let x = i as f32 * 0.1;
                let want = (x as f64).exp();
                let got = v_expf(order, x) as f64;
                assert!(
                    ((got - want) / want).abs() < 4e-7,
                    "{order:?} x={x} got={got} want={want}"
                );
            }
            assert_eq!(v_expf(order, -200.0), 0.0, "{order:?}");
            assert_eq!(v_expf(order, f32::NEG_INFINITY), 0.0, "{order:?}");
            assert_eq!(v_expf(order, 200.0), f32::INFINITY, "{order:?}");
            assert!(v_expf(order, -95.0) > 0.0, "{order:?}: subnormal results");
        }
    }

    /// The two builds' exponentials are different functions: the AVX2 order must not be the
    /// AVX512 one renamed.
    #[test]
    fn the_orders_round_differently() {
        let differ = (0..10_000)
            .map(|i| -20.0 + i as f32 * 0.004)
            .filter(|&x| v_expf(Order::GgmlAvx2, x) != v_expf(Order::GgmlAvx512, x))
            .count();
        assert!(differ > 100, "{differ}");
        // The two 8-lane trees: `(t0+t1)+(t2+t3)` cancels the large pair first.
        let v = [1e8, -1e8, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(reduce_hadd_8(&v), 1.0);
        assert_eq!(reduce_halves(&v), 0.0);
    }

    /// The AVX512 exp against the scalar model on every `step`-th f32 bit pattern.
    #[cfg(target_arch = "x86_64")]
    fn check_v_expf_avx512(step: usize) {
        use std::arch::x86_64::*;
        if !has_avx512() {
            return;
        }
        fma_fn! {
        fn scalar(x: &[f32], out: &mut [f32]) {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = v_expf(Order::GgmlAvx512, v);
            }
        }
        }
        #[target_feature(enable = "avx512f,avx512dq")]
        unsafe fn simd(x: &[f32], out: &mut [f32]) {
            for (o, v) in out.chunks_exact_mut(LANES).zip(x.chunks_exact(LANES)) {
                _mm512_storeu_ps(o.as_mut_ptr(), x86::v_expf(_mm512_loadu_ps(v.as_ptr())));
            }
        }
        let mut xs = Vec::with_capacity(1 << 16);
        let (mut a, mut b) = (vec![0f32; 1 << 16], vec![0f32; 1 << 16]);
        let mut bits = 0u64;
        while bits < 1 << 32 {
            xs.clear();
            while xs.len() < 1 << 16 && bits < 1 << 32 {
                xs.push(f32::from_bits(bits as u32));
                bits += step as u64;
            }
            xs.resize(xs.len().next_multiple_of(LANES), 0.0);
            let n = xs.len();
            scalar(&xs, &mut a[..n]);
            // SAFETY: features detected above.
            unsafe { simd(&xs, &mut b[..n]) };
            for i in 0..n {
                assert!(
                    a[i].to_bits() == b[i].to_bits() || (a[i].is_nan() && b[i].is_nan()),
                    "x={:e} ({:#x}): scalar {:e} simd {:e}",
                    xs[i],
                    xs[i].to_bits(),
                    a[i],
                    b[i]
                );
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx512_expf_equals_the_scalar_model() {
        check_v_expf_avx512(997);
    }

    /// The AVX2 exp (AVX512 order), swiglu and 16-lane reduction against the scalar models,
    /// on AVX2 and AVX512 hosts alike.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_primitives_equal_the_scalar_models() {
        use std::arch::x86_64::*;
        if muser_quant::hardware_isa() < muser_quant::Isa::Avx2 {
            return;
        }
        fma_fn! {
        fn scalar(order: Order, x: &[f32], out: &mut [f32]) {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = v_expf(order, v);
            }
        }
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn simd(order: Order, x: &[f32], out: &mut [f32]) {
            for (o, v) in out.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
                let v = _mm256_loadu_ps(v.as_ptr());
                let e = match order {
                    Order::GgmlAvx512 => x86_avx2::v_expf(v),
                    Order::GgmlAvx2 => x86_avx2::v_expf_avx2_order(v),
                };
                _mm256_storeu_ps(o.as_mut_ptr(), e);
            }
        }
        // every 997th bit pattern, plus the saturation and subnormal edges
        let mut xs: Vec<f32> = (0..1u64 << 32)
            .step_by(997)
            .map(|b| f32::from_bits(b as u32))
            .collect();
        xs.extend([
            -87.5, -88.7, -103.0, -104.0, 88.7, 133.0, 134.0, -133.0, -134.0, 0.0, -0.0,
        ]);
        xs.resize(xs.len().next_multiple_of(8), 1.0);
        let g: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) * 0.37).collect();
        let u: Vec<f32> = (0..100).map(|i| (i as f32) * 0.11 - 3.0).collect();
        for order in ORDERS {
            let (mut a, mut b) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
            scalar(order, &xs, &mut a);
            // SAFETY: AVX2/FMA/F16C checked above.
            unsafe { simd(order, &xs, &mut b) };
            for i in 0..xs.len() {
                assert!(
                    a[i].to_bits() == b[i].to_bits() || (a[i].is_nan() && b[i].is_nan()),
                    "{order:?} x={:e}: scalar {:e} avx2 {:e}",
                    xs[i],
                    a[i],
                    b[i]
                );
            }
            let mut want = g.clone();
            swiglu_scalar(order, &mut want, &u);
            let mut got = g.clone();
            // SAFETY: as above.
            unsafe { x86_avx2::swiglu(order, &mut got, &u) };
            assert_eq!(want, got, "swiglu {order:?}");
        }
        for c in g.chunks_exact(LANES) {
            let arr: [f32; LANES] = c.try_into().unwrap();
            // SAFETY: as above.
            let r = unsafe {
                x86_avx2::reduce_add_16(
                    _mm256_loadu_ps(c.as_ptr()),
                    _mm256_loadu_ps(c.as_ptr().add(8)),
                )
            };
            assert_eq!(reduce_halves(&arr).to_bits(), r.to_bits());
        }
    }

    /// Every f32 input (about a minute): `cargo test --release -- --ignored exhaustive`.
    #[test]
    #[ignore]
    #[cfg(target_arch = "x86_64")]
    fn avx512_expf_equals_the_scalar_model_exhaustive() {
        check_v_expf_avx512(1);
    }

    #[test]
    fn fast_swiglu_and_softmax_equal_the_scalar_models() {
        let mut seed = 7u32;
        let mut rnd = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 40.0 - 20.0
        };
        for n in [1usize, 15, 16, 17, 64, 100, 3072] {
            let g: Vec<f32> = (0..n).map(|_| rnd()).collect();
            let u: Vec<f32> = (0..n).map(|_| rnd()).collect();
            fma_fn! {
            fn model(order: Order, g: &[f32], u: &[f32], out: &mut [f32]) {
                swiglu(order, g, u, out);
            }
            }
            for order in ORDERS {
                let mut want = vec![0f32; n];
                model(order, &g, &u, &mut want);
                let mut got = g.clone();
                swiglu_fast(order, &mut got, &u);
                assert_eq!(want, got, "swiglu {order:?} n={n}");
                let mut got = g.clone();
                swiglu_scalar(order, &mut got, &u);
                assert_eq!(want, got, "swiglu scalar {order:?} n={n}");
            }
            #[cfg(target_arch = "x86_64")]
            if has_avx512() {
                let max = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                fma_fn! {
                fn sm(x: &mut [f32], max: f32) -> f64 {
                    soft_max_tile(Order::GgmlAvx512, x, max)
                }
                }
                let mut a = g.clone();
                let mut b = g.clone();
                let sa = sm(&mut a, max);
                // SAFETY: features detected.
                let sb = unsafe { x86::soft_max_tile(&mut b, max) };
                assert_eq!((a, sa.to_bits()), (b, sb.to_bits()), "softmax n={n}");
                let v: Vec<f32> = g[..n - n % LANES].to_vec();
                for c in v.chunks_exact(LANES) {
                    let arr: [f32; LANES] = c.try_into().unwrap();
                    // SAFETY: features detected.
                    let r =
                        unsafe { x86::reduce_add(std::arch::x86_64::_mm512_loadu_ps(c.as_ptr())) };
                    assert_eq!(reduce_halves(&arr).to_bits(), r.to_bits());
                }
            }
        }
    }

    #[test]
    fn grouped_rms_norm_equals_one_group_at_a_time() {
        let mut seed = 11u32;
        let data: Vec<f32> = (0..7 * 96)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (seed >> 8) as f32 / (1u32 << 24) as f32 * 6.0 - 3.0
            })
            .collect();
        let w: Vec<f32> = (0..96).map(|i| 0.5 + i as f32 / 64.0).collect();
        for weight in [None, Some(&w[..])] {
            let mut want = data.clone();
            for g in want.chunks_exact_mut(96) {
                let sc = rms_scale(g, 1e-6);
                match weight {
                    Some(w) => g.iter_mut().zip(w).for_each(|(v, &w)| *v = *v * sc * w),
                    None => g.iter_mut().for_each(|v| *v *= sc),
                }
            }
            let mut got = data.clone();
            rms_norm_groups(&mut got, 96, 1e-6, weight);
            assert_eq!(want, got);
        }
    }

    #[test]
    fn reduce_order_matches_the_tree() {
        let mut v = [0f32; LANES];
        v[0] = 1e8;
        v[8] = -1e8;
        v[1] = 1.0;
        // t8[0] = 0 exactly, so the small value survives.
        assert_eq!(reduce_halves(&v), 1.0);
    }

    #[test]
    fn dot_f16_is_exact_for_small_integers() {
        use half::f16;
        let x: Vec<f16> = (0..130).map(|i| f16::from_f32((i % 7) as f32)).collect();
        let y: Vec<f16> = (0..130)
            .map(|i| f16::from_f32((i % 5) as f32 - 2.0))
            .collect();
        let want: f32 = (0..130).map(|i: i32| ((i % 7) * (i % 5 - 2)) as f32).sum();
        assert_eq!(vec_dot(Order::GgmlAvx512, &x, &y), want);
    }
}
