//! Scalar models of ggml's CPU vector primitives, written so that each result is bit-identical
//! to what the AVX512 build of ggml b11434 computes on this class of machine.
//!
//! The order of every floating-point operation matters here: the functions mirror the lane
//! structure of the SIMD code (16-lane accumulators, the reduction tree of `_mm512_reduce_add_ps`,
//! fused multiply-adds where ggml uses them) rather than the mathematically obvious loop.
//! Callers run them inside `fma_fn!` functions so that `mul_add` is one instruction.

use half::f16;

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

/// `_mm512_reduce_add_ps` as GCC expands it: upper half plus lower half, then quarters, then
/// `(t0 + t2) + (t1 + t3)`.
#[inline(always)]
pub fn reduce_add_16(v: &[f32; LANES]) -> f32 {
    let mut t8 = [0f32; 8];
    for i in 0..8 {
        t8[i] = v[i + 8] + v[i];
    }
    let mut t4 = [0f32; 4];
    for i in 0..4 {
        t4[i] = t8[i + 4] + t8[i];
    }
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// `j · 2^n` for integral `n` with one rounding, as `_mm512_scalef_ps` does.
#[inline(always)]
fn scalef(j: f32, n: f32) -> f32 {
    // The f64 product is exact (a power of two times a 24-bit significand), so the cast is the
    // only rounding, including into the subnormal range.
    (f64::from(j) * 2f64.powi(n as i32)) as f32
}

/// ggml's vectorised exponential (`ggml_v_expf`, AVX512 flavour) for one lane. It is not libm's
/// `expf`: its error is up to 1.5 ulp, and it saturates to 0 / +inf beyond |n| > 192.
#[inline(always)]
pub fn v_expf(x: f32) -> f32 {
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

/// ggml's vectorised SiLU lane: `x / (1 + v_expf(0 - x))`.
#[inline(always)]
pub fn v_silu(x: f32) -> f32 {
    x / (1.0 + v_expf(0.0 - x))
}

/// `ggml_vec_swiglu_f32`: `silu(g) * u`, 16 lanes at a time with the vector SiLU, the tail with
/// libm's `expf`.
#[inline(always)]
pub fn swiglu(g: &[f32], u: &[f32], out: &mut [f32]) {
    let n = out.len();
    let body = n - n % LANES;
    for i in 0..body {
        out[i] = v_silu(g[i]) * u[i];
    }
    for i in body..n {
        out[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
    }
}

/// `ggml_vec_soft_max_f32`: writes `exp(x - max)` (vector exp, 16 lanes at a time; libm for the
/// tail) and returns the sum, accumulated per 16-lane group in f32 and across groups in f64.
#[inline(always)]
pub fn soft_max_tile(x: &mut [f32], max: f32) -> f64 {
    let n = x.len();
    let body = n - n % LANES;
    let mut sum = 0f64;
    for chunk in x[..body].chunks_exact_mut(LANES) {
        let mut v = [0f32; LANES];
        for (l, e) in chunk.iter_mut().enumerate() {
            *e = v_expf(*e - max);
            v[l] = *e;
        }
        sum += f64::from(reduce_add_16(&v));
    }
    for e in &mut x[body..] {
        *e = (*e - max).exp();
        sum += f64::from(*e);
    }
    sum
}

/// `ggml_vec_dot_f16` on AVX512 without FP16 arithmetic: four 16-lane f32 accumulators over
/// 64-element steps, reduced `(a0+a2) + (a1+a3)` then across lanes; the tail in f64.
#[inline(always)]
pub fn dot_f16(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len();
    let body = n - n % (4 * LANES);
    let mut acc = [[0f32; LANES]; 4];
    let mut i = 0;
    while i < body {
        for (j, a) in acc.iter_mut().enumerate() {
            let o = i + j * LANES;
            for l in 0..LANES {
                a[l] = x[o + l].to_f32().mul_add(y[o + l].to_f32(), a[l]);
            }
        }
        i += 4 * LANES;
    }
    let mut s = [0f32; LANES];
    for l in 0..LANES {
        let a02 = acc[0][l] + acc[2][l];
        let a13 = acc[1][l] + acc[3][l];
        s[l] = a02 + a13;
    }
    let mut sum = f64::from(reduce_add_16(&s));
    for k in body..n {
        sum += f64::from(x[k].to_f32() * y[k].to_f32());
    }
    sum as f32
}

/// One tinyBLAS dot product (llamafile `sgemm`, `KN = 16` lanes): lane `l` accumulates elements
/// `l, l+16, ...` with FMA in order, then the lanes are reduced. Used for F16 weights with two or
/// more activation rows. `n` must be a multiple of 16.
#[inline(always)]
pub fn dot_f16_tinyblas(x: &[f16], y: &[f16]) -> f32 {
    let mut acc = [0f32; LANES];
    for (cx, cy) in x.chunks_exact(LANES).zip(y.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] = cx[l].to_f32().mul_add(cy[l].to_f32(), acc[l]);
        }
    }
    reduce_add_16(&acc)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v_expf_is_close_to_exp_and_saturates() {
        for i in -800..800 {
            let x = i as f32 * 0.1;
            let want = (x as f64).exp();
            let got = v_expf(x) as f64;
            assert!(
                ((got - want) / want).abs() < 4e-7,
                "x={x} got={got} want={want}"
            );
        }
        assert_eq!(v_expf(-200.0), 0.0);
        assert_eq!(v_expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(v_expf(200.0), f32::INFINITY);
    }

    #[test]
    fn reduce_order_matches_the_tree() {
        let mut v = [0f32; LANES];
        v[0] = 1e8;
        v[8] = -1e8;
        v[1] = 1.0;
        // t8[0] = 0 exactly, so the small value survives.
        assert_eq!(reduce_add_16(&v), 1.0);
    }

    #[test]
    fn dot_f16_is_exact_for_small_integers() {
        let x: Vec<f16> = (0..130).map(|i| f16::from_f32((i % 7) as f32)).collect();
        let y: Vec<f16> = (0..130)
            .map(|i| f16::from_f32((i % 5) as f32 - 2.0))
            .collect();
        let want: f32 = (0..130).map(|i: i32| ((i % 7) * (i % 5 - 2)) as f32).sum();
        assert_eq!(dot_f16(&x, &y), want);
    }
}
