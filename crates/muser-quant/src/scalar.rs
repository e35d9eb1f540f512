//! Scalar dot products: the reference the SIMD kernels are tested against, and the path on
//! machines without AVX2.
//!
//! They reproduce the *float arithmetic* of ggml's x86 CPU build (AVX2 kernels in
//! `ggml-cpu/arch/x86/quants.c`, AVX512 loops in `ggml-cpu/vec.cpp`), not just its value:
//! integer partial sums are formed per 32-bit SIMD lane, scaled into eight f32 lanes with fused
//! multiply-adds and reduced in the same tree. So scalar, SIMD and llama.cpp agree bit for bit.
//! (Inputs whose Q8 activation bytes hold -128 are outside this promise: ggml's sign trick
//! overflows there; our quantizers never produce -128.)

use crate::dequant::{q3_k_scales, q3_k_values, q5_k_values, q5_values, q6_k_values, scale_min_k4};
use crate::fp::{bf16_to_f32, e8m0_half, f16_to_f32, read_f16, ue4m3_half, KVALUES_FP4};
use crate::{check_dot, GgmlType};

/// `w · a` for `n` values: `w` is a row of type `ty`, `a` a row of `vec_dot_type(ty)`.
///
/// # Panics
/// If `ty` has no dot product, `n` is not a multiple of the block size, or a row is shorter
/// than `n` values (programming errors: the model validates shapes when it loads).
pub fn vec_dot(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = check_dot(ty, n, w, a);
    match ty {
        GgmlType::F32 => dot_f32(w, a),
        GgmlType::F16 => dot_f16(w, a),
        GgmlType::BF16 => dot_bf16(w, a),
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => dot_x_q8_0(ty, w, a),
        GgmlType::Q4_1 | GgmlType::Q5_1 => dot_x_q8_1(ty, w, a),
        GgmlType::MXFP4 => dot_mxfp4(w, a),
        GgmlType::NVFP4 => dot_nvfp4(w, a),
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            dot_k(ty, w, a)
        }
        _ => unreachable!("check_dot rejects {ty}"),
    }
}

/// `hsum_float_8`: (l0+l4 + l2+l6) + (l1+l5 + l3+l7) in ggml's order.
#[inline]
pub(crate) fn hsum8(a: &[f32; 8]) -> f32 {
    let r = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// The eight 32-bit lane sums of a 32-value integer dot (lane k holds values 4k..4k+3).
#[inline]
fn lanes32(w: impl Fn(usize) -> i32, a: &[u8]) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for (k, lane) in lanes.iter_mut().enumerate() {
        for j in 4 * k..4 * k + 4 {
            *lane += w(j) * (a[j] as i8) as i32;
        }
    }
    lanes
}

#[inline]
fn fma_lanes(acc: &mut [f32; 8], d: impl Fn(usize) -> f32, lanes: &[i32; 8]) {
    for k in 0..8 {
        acc[k] = d(k).mul_add(lanes[k] as f32, acc[k]);
    }
}

fn dot_x_q8_0(ty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
    let ts = ty.type_size();
    let mut acc = [0.0f32; 8];
    for (x, y) in w.chunks_exact(ts).zip(a.chunks_exact(34)) {
        let d = read_f16(x, 0) * read_f16(y, 0);
        let ya = &y[2..];
        let lanes = match ty {
            GgmlType::Q4_0 => lanes32(|j| ((x[2 + j % 16] >> (4 * (j / 16))) & 15) as i32 - 8, ya),
            GgmlType::Q5_0 => {
                let v = q5_values(&x[2..6], &x[6..22]);
                lanes32(|j| v[j] as i32 - 16, ya)
            }
            _ => lanes32(|j| (x[2 + j] as i8) as i32, ya),
        };
        fma_lanes(&mut acc, |_| d, &lanes);
    }
    hsum8(&acc)
}

fn dot_x_q8_1(ty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
    let ts = ty.type_size();
    let mut acc = [0.0f32; 8];
    let mut summs = 0.0f32;
    for (x, y) in w.chunks_exact(ts).zip(a.chunks_exact(36)) {
        let d = read_f16(x, 0) * read_f16(y, 0);
        summs = read_f16(x, 2).mul_add(read_f16(y, 2), summs);
        let ya = &y[4..];
        let lanes = match ty {
            GgmlType::Q4_1 => lanes32(|j| ((x[4 + j % 16] >> (4 * (j / 16))) & 15) as i32, ya),
            _ => {
                let v = q5_values(&x[4..8], &x[8..24]);
                lanes32(|j| v[j] as i32, ya)
            }
        };
        fma_lanes(&mut acc, |_| d, &lanes);
    }
    hsum8(&acc) + summs
}

fn fp4_lanes(qs: &[u8], ya: &[u8]) -> [i32; 8] {
    lanes32(
        |j| KVALUES_FP4[((qs[j % 16] >> (4 * (j / 16))) & 15) as usize] as i32,
        ya,
    )
}

fn dot_mxfp4(w: &[u8], a: &[u8]) -> f32 {
    let nb = w.len() / 17;
    let mut acc = [[0.0f32; 8]; 2];
    let pairs = nb / 2 * 2;
    for ib in 0..pairs {
        let (x, y) = (&w[17 * ib..17 * ib + 17], &a[34 * ib..34 * ib + 34]);
        let d = read_f16(y, 0) * e8m0_half(x[0]);
        fma_lanes(&mut acc[ib % 2], |_| d, &fp4_lanes(&x[1..], &y[2..]));
    }
    let mut sum = [0.0f32; 8];
    for k in 0..8 {
        sum[k] = acc[0][k] + acc[1][k];
    }
    let mut sumf = hsum8(&sum);
    for ib in pairs..nb {
        let (x, y) = (&w[17 * ib..17 * ib + 17], &a[34 * ib..34 * ib + 34]);
        let d = read_f16(y, 0) * e8m0_half(x[0]);
        sumf = d.mul_add(fp4_block_sum(&x[1..], &y[2..]) as f32, sumf);
    }
    sumf
}

/// Σ kvalue·a over one 32-value FP4 block (`qs` 16 bytes, `a` 32 Q8 bytes).
pub(crate) fn fp4_block_sum(qs: &[u8], a: &[u8]) -> i32 {
    fp4_lanes(qs, a).iter().sum()
}

fn dot_nvfp4(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in w.chunks_exact(36).zip(a.chunks_exact(68)) {
        for half in 0..2 {
            let yb = &y[34 * half..34 * half + 34];
            let dy = read_f16(yb, 0);
            let s = [
                ue4m3_half(x[2 * half]) * dy,
                ue4m3_half(x[2 * half + 1]) * dy,
            ];
            let qs = &x[4 + 16 * half..20 + 16 * half];
            // values 0..15 are sub-block 2·half, 16..31 sub-block 2·half+1; each sub-block keeps
            // element j in the low nibble of byte j and element j+8 in the high nibble.
            let lanes = lanes32(
                |j| {
                    let (sub, e) = (j / 16, j % 16);
                    KVALUES_FP4[((qs[8 * sub + e % 8] >> (4 * (e / 8))) & 15) as usize] as i32
                },
                &yb[2..],
            );
            fma_lanes(&mut acc, |k| s[k / 4], &lanes);
        }
    }
    hsum8(&acc)
}

/// Q8_K block fields: (d, qs, bsums).
#[inline]
pub(crate) fn q8k_parts(y: &[u8]) -> (f32, &[u8], [i32; 16]) {
    let d = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
    let mut bsums = [0i32; 16];
    for (j, s) in bsums.iter_mut().enumerate() {
        *s = i16::from_le_bytes([y[260 + 2 * j], y[261 + 2 * j]]) as i32;
    }
    (d, &y[4..260], bsums)
}

/// K-quant · Q8_K. Every format forms the same per-lane integer sums
/// Σ scale(e)·q(e)·a(e) over the values e ≡ 4k..4k+3 (mod 32); they differ in how the minimums
/// enter (the bsums terms) and where that float sum is added.
fn dot_k(ty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
    let ts = ty.type_size();
    let mut acc = [0.0f32; 8];
    let mut acc_m = [0.0f32; 4];
    let mut summs = 0.0f32;
    for (x, y) in w.chunks_exact(ts).zip(a.chunks_exact(292)) {
        let (yd, q8, bsums) = q8k_parts(y);
        let mut lanes = [0i32; 8];
        let mut add = |scale: &dyn Fn(usize) -> i32, q: &dyn Fn(usize) -> i32| {
            for e in 0..256 {
                lanes[(e % 32) / 4] += scale(e) * q(e) * (q8[e] as i8) as i32;
            }
        };
        match ty {
            GgmlType::Q2_K => {
                let d = yd * read_f16(x, 80);
                let dmin = -yd * read_f16(x, 82);
                let sc = &x[0..16];
                let mut mins = [0i32; 8];
                for (k, m) in mins.iter_mut().enumerate() {
                    *m = (sc[2 * k] >> 4) as i32 * bsums[2 * k]
                        + (sc[2 * k + 1] >> 4) as i32 * bsums[2 * k + 1];
                }
                fma_lanes(&mut acc, |_| dmin, &mins);
                let qs = &x[16..80];
                add(&|e| (sc[e / 16] & 15) as i32, &|e| {
                    let (n, r) = (e / 128, e % 128);
                    ((qs[32 * n + r % 32] >> (2 * (r / 32))) & 3) as i32
                });
                fma_lanes(&mut acc, |_| d, &lanes);
            }
            GgmlType::Q3_K => {
                let d = yd * read_f16(x, 108);
                let sc = q3_k_scales(&x[96..108]);
                let v = q3_k_values(x);
                add(&|e| sc[e / 16] as i32, &|e| v[e] as i32);
                fma_lanes(&mut acc, |_| d, &lanes);
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let d = yd * read_f16(x, 0);
                let dmin = -yd * read_f16(x, 2);
                let scales = &x[4..16];
                let (mut sc, mut mn) = ([0i32; 8], [0i32; 8]);
                for j in 0..8 {
                    let (s, m) = scale_min_k4(j, scales);
                    sc[j] = s as i32;
                    mn[j] = m as i32;
                }
                // prod lane l = m[2l]·(b[4l]+b[4l+1]) + m[2l+1]·(b[4l+2]+b[4l+3])
                let mut prod = [0i32; 4];
                for (l, p) in prod.iter_mut().enumerate() {
                    *p = mn[2 * l] * (bsums[4 * l] + bsums[4 * l + 1])
                        + mn[2 * l + 1] * (bsums[4 * l + 2] + bsums[4 * l + 3]);
                }
                if ty == GgmlType::Q4_K {
                    let qs = &x[16..144];
                    add(&|e| sc[e / 32], &|e| {
                        ((qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 15) as i32
                    });
                    for l in 0..4 {
                        acc_m[l] = dmin.mul_add(prod[l] as f32, acc_m[l]);
                    }
                } else {
                    let v = q5_k_values(x);
                    add(&|e| sc[e / 32], &|e| v[e] as i32);
                    let total: i32 = prod.iter().sum();
                    summs = dmin.mul_add(total as f32, summs);
                }
                fma_lanes(&mut acc, |_| d, &lanes);
            }
            GgmlType::Q6_K => {
                let d = yd * read_f16(x, 208);
                let sc = |e: usize| (x[192 + e / 16] as i8) as i32;
                let v = q6_k_values(x);
                add(&sc, &|e| v[e] as i32);
                for (k, lane) in lanes.iter_mut().enumerate() {
                    *lane -= 32 * (bsums[2 * k] * sc(32 * k) + bsums[2 * k + 1] * sc(32 * k + 16));
                }
                fma_lanes(&mut acc, |_| d, &lanes);
            }
            _ => unreachable!(),
        }
    }
    let m = (acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]);
    match ty {
        GgmlType::Q4_K => hsum8(&acc) + m,
        GgmlType::Q5_K => hsum8(&acc) + summs,
        _ => hsum8(&acc),
    }
}

/// Reduction of ggml's AVX512 F32/F16 dot: four 16-lane accumulators (64 values per step),
/// folded x0+x2, x1+x3, x0+x1, then `_mm512_reduce_add_ps`.
pub(crate) fn reduce_4x16(acc: &[[f32; 16]; 4]) -> f32 {
    let mut x = *acc;
    for l in 0..16 {
        x[0][l] += x[2][l];
        x[1][l] += x[3][l];
    }
    for l in 0..16 {
        x[0][l] += x[1][l];
    }
    reduce16(&x[0])
}

/// GCC's `_mm512_reduce_add_ps`: halves 8+8, 4+4, then (t0+t2) + (t1+t3).
pub(crate) fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t3 = [0.0f32; 8];
    for i in 0..8 {
        t3[i] = v[i + 8] + v[i];
    }
    let t6 = [t3[4] + t3[0], t3[5] + t3[1], t3[6] + t3[2], t3[7] + t3[3]];
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

fn dot_floats(
    w: &[u8],
    a: &[u8],
    width: usize,
    load: impl Fn(&[u8]) -> f32,
) -> ([[f32; 16]; 4], usize) {
    let n = w.len() / width;
    let np = n & !63;
    let mut acc = [[0.0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, accj) in acc.iter_mut().enumerate() {
            for (l, s) in accj.iter_mut().enumerate() {
                let e = (i + 16 * j + l) * width;
                *s = load(&w[e..e + width]).mul_add(load(&a[e..e + width]), *s);
            }
        }
    }
    (acc, np)
}

fn dot_f32(w: &[u8], a: &[u8]) -> f32 {
    let load = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let (acc, np) = dot_floats(w, a, 4, load);
    let mut sum = reduce_4x16(&acc);
    for e in np..w.len() / 4 {
        // GCC vectorizes the products of the leftover loop: no fused multiply-add there
        sum += load(&w[4 * e..]) * load(&a[4 * e..]);
    }
    sum
}

fn dot_f16(w: &[u8], a: &[u8]) -> f32 {
    let load = |b: &[u8]| f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    let (acc, np) = dot_floats(w, a, 2, load);
    let mut sum = reduce_4x16(&acc) as f64;
    for e in np..w.len() / 2 {
        sum += (load(&w[2 * e..]) * load(&a[2 * e..])) as f64;
    }
    sum as f32
}

/// ggml's AVX512-BF16 loop: two `vdpbf16ps` accumulators over 64 values per step (each lane adds
/// the odd pair product, then the even one), then f64 accumulation of the rest.
fn dot_bf16(w: &[u8], a: &[u8]) -> f32 {
    let load = |b: &[u8], e: usize| bf16_to_f32(u16::from_le_bytes([b[2 * e], b[2 * e + 1]]));
    let n = w.len() / 2;
    let np = n / 64 * 64;
    let mut c = [[0.0f32; 16]; 2];
    for i in (0..np).step_by(64) {
        for (h, ch) in c.iter_mut().enumerate() {
            for (l, s) in ch.iter_mut().enumerate() {
                let e = i + 32 * h + 2 * l;
                *s += load(w, e + 1) * load(a, e + 1);
                *s += load(w, e) * load(a, e);
            }
        }
    }
    let mut sum = reduce16(&c[0]) as f64;
    sum += reduce16(&c[1]) as f64;
    for e in np..n {
        sum += (load(w, e) * load(a, e)) as f64;
    }
    sum as f32
}

/// `w · a` in the arithmetic of llama.cpp's prompt-processing matmul (llamafile's tinyBLAS),
/// which ggml's CPU backend uses instead of `vec_dot` when [`crate::uses_gemm_path`] holds.
/// F32, F16: one 16-lane accumulator fed 16 values a step (the tail zero-padded), reduced by
/// `_mm512_reduce_add_ps`. BF16: one `vdpbf16ps` accumulator fed 32 values a step. The Q8_0,
/// Q4_0 and Q5_0 tiles do the same arithmetic as `vec_dot`; every other type is `vec_dot`.
///
/// # Panics
/// As [`vec_dot`].
pub fn vec_dot_gemm(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = check_dot(ty, n, w, a);
    match ty {
        GgmlType::F32 => gemm_floats(w, a, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => gemm_floats(w, a, 2, |b| f16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
        GgmlType::BF16 => gemm_bf16(w, a),
        _ => vec_dot(ty, n, w, a),
    }
}

fn gemm_floats(w: &[u8], a: &[u8], width: usize, load: impl Fn(&[u8]) -> f32) -> f32 {
    let n = w.len() / width;
    let mut acc = [0.0f32; 16];
    for l in (0..n).step_by(16) {
        for (lane, s) in acc.iter_mut().enumerate() {
            let e = l + lane;
            let (x, y) = if e < n {
                (load(&w[e * width..]), load(&a[e * width..]))
            } else {
                (0.0, 0.0)
            };
            *s = x.mul_add(y, *s);
        }
    }
    reduce16(&acc)
}

fn gemm_bf16(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len() / 2;
    let load = |b: &[u8], e: usize| {
        if e < n {
            bf16_to_f32(u16::from_le_bytes([b[2 * e], b[2 * e + 1]]))
        } else {
            0.0
        }
    };
    let mut acc = [0.0f32; 16];
    for l in (0..n).step_by(32) {
        for (lane, s) in acc.iter_mut().enumerate() {
            let e = l + 2 * lane;
            *s += load(w, e + 1) * load(a, e + 1);
            *s += load(w, e) * load(a, e);
        }
    }
    reduce16(&acc)
}
