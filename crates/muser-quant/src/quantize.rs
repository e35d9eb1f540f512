//! Quantizers. Weight quantizers are byte-identical to ggml's `quantize_row_*_ref`
//! (`ggml-quants.c`, compiled without FMA contraction, which plain Rust arithmetic matches).
//! Activation quantizers reproduce what ggml's x86 CPU build (AVX2 and up) runs:
//! - Q8_0 and Q8_1 use the AVX path of `ggml-cpu/arch/x86/quants.c`: the multiplier is
//!   `127/amax` (not `1/d`) and rounding is to nearest even (`_mm256_round_ps`), unlike the
//!   `_ref` versions (`1/d`, `roundf` half away from zero). Q8_1's `s` is `d·Σq` with the f32 `d`.
//! - Q8_K is `quantize_row_q8_K_ref` on every target (`nearest_int`, half to even).

use crate::fp::{
    f32_to_bf16, f32_to_f16, f32_to_ue4m3, nearest_int, ue4m3_half, write_f16, KVALUES_FP4,
};
use crate::GgmlType;

pub(crate) fn quantize_blocks(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let per_block: fn(&[f32], &mut [u8]) = match ty {
        GgmlType::F32 => |x, b| b.copy_from_slice(&x[0].to_le_bytes()),
        GgmlType::F16 => |x, b| b.copy_from_slice(&f32_to_f16(x[0]).to_le_bytes()),
        GgmlType::BF16 => |x, b| b.copy_from_slice(&f32_to_bf16(x[0]).to_le_bytes()),
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0_ref,
        GgmlType::Q8_1 => q8_1_ref,
        GgmlType::Q4_K => |x, b| qk_min(x, b, KQuant::Q4),
        GgmlType::Q5_K => |x, b| qk_min(x, b, KQuant::Q5),
        GgmlType::Q6_K => q6_k,
        GgmlType::Q8_K => q8_k,
        GgmlType::MXFP4 => mxfp4,
        GgmlType::NVFP4 => nvfp4,
        _ => unreachable!("checked by quantize_row"),
    };
    for (x, b) in src.chunks_exact(bs).zip(dst.chunks_exact_mut(ts)) {
        per_block(x, b);
    }
}

/// Activation quantization as ggml's x86 CPU build does it (see the module docs).
pub(crate) fn quantize_act_blocks(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::detected_isa() != crate::Isa::Scalar {
        // SAFETY: AVX2, FMA and F16C were detected.
        unsafe { act_blocks_avx2(ty, src, dst) };
        return;
    }
    act_blocks(ty, src, dst);
}

/// [`act_blocks`] compiled for AVX2 (vector rounding instead of a libm call per value). Plain
/// Rust arithmetic is never contracted into FMAs, so the results are the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn act_blocks_avx2(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    act_blocks(ty, src, dst);
}

#[inline(always)]
fn act_blocks(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    match ty {
        GgmlType::Q8_K => {
            for (x, b) in src.chunks_exact(256).zip(dst.chunks_exact_mut(292)) {
                q8_k(x, b);
            }
        }
        GgmlType::Q8_0 => {
            for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(34)) {
                let (d, _) = q8_cpu(x, &mut b[2..]);
                write_f16(b, 0, d);
            }
        }
        GgmlType::Q8_1 => {
            for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(36)) {
                let (d, sum) = q8_cpu(x, &mut b[4..]);
                write_f16(b, 0, d);
                write_f16(b, 2, d * sum as f32);
            }
        }
        _ => quantize_blocks(ty, src, dst),
    }
}

/// The largest |v| of `x` (NaN ignored, 0 for none), in eight lanes: `max` is exact, so the
/// order does not matter.
#[inline(always)]
fn abs_max(x: &[f32]) -> f32 {
    let mut m = [0f32; 8];
    let mut c = x.chunks_exact(8);
    for v in &mut c {
        for l in 0..8 {
            m[l] = m[l].max(v[l].abs());
        }
    }
    let tail = c.remainder().iter().fold(0.0f32, |a, v| a.max(v.abs()));
    m.iter().fold(tail, |a, &v| a.max(v))
}

/// The AVX Q8 kernel on one block of 32 values: writes the quants, returns (d, Σq).
#[inline(always)]
fn q8_cpu(x: &[f32], qs: &mut [u8]) -> (f32, i32) {
    let amax = abs_max(x);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0;
    if x.len() == 32 && id.is_finite() && x.iter().all(|v| v.is_finite()) {
        // Finite values and scale: |v·id| <= 127 (plus rounding), so the rounded value
        // converts exactly without the saturating (NaN-checking) cast, and the loop vectorizes.
        let mut r = [0i32; 32];
        for l in 0..32 {
            // SAFETY: finite, integral and within ±128 (see above).
            r[l] = unsafe { (x[l] * id).round_ties_even().to_int_unchecked::<i32>() };
        }
        for l in 0..32 {
            let v = r[l].clamp(-128, 127);
            qs[l] = v as i8 as u8;
            sum += v;
        }
        return (d, sum);
    }
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = ((v * id).round_ties_even() as i32).clamp(-128, 127);
        *q = r as i8 as u8;
        sum += r;
    }
    (d, sum)
}

fn amax_signed(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// C's `(int8_t)(float)` on x86: truncate toward zero through a 32-bit integer.
#[inline]
fn trunc_i8(v: f32) -> i32 {
    (v as i32) as i8 as i32
}

fn q4_0(x: &[f32], b: &mut [u8]) {
    let (_, max) = amax_signed(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    write_f16(b, 0, d);
    for j in 0..16 {
        let x0 = 15.min(trunc_i8(x[j] * id + 8.5)) as u8;
        let x1 = 15.min(trunc_i8(x[j + 16] * id + 8.5)) as u8;
        b[2 + j] = x0 | (x1 << 4);
    }
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn q4_1(x: &[f32], b: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    write_f16(b, 0, d);
    write_f16(b, 2, min);
    for j in 0..16 {
        let x0 = 15.min(trunc_i8((x[j] - min) * id + 0.5)) as u8;
        let x1 = 15.min(trunc_i8((x[j + 16] - min) * id + 0.5)) as u8;
        b[4 + j] = x0 | (x1 << 4);
    }
}

fn pack_q5(v: &[u8; 32], qh: &mut [u8], qs: &mut [u8]) {
    let mut h = 0u32;
    for j in 0..16 {
        qs[j] = (v[j] & 15) | ((v[j + 16] & 15) << 4);
        h |= (((v[j] & 0x10) >> 4) as u32) << j;
        h |= (((v[j + 16] & 0x10) >> 4) as u32) << (j + 16);
    }
    qh.copy_from_slice(&h.to_le_bytes());
}

fn q5_0(x: &[f32], b: &mut [u8]) {
    let (_, max) = amax_signed(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    write_f16(b, 0, d);
    let mut v = [0u8; 32];
    for (q, &xv) in v.iter_mut().zip(x) {
        *q = 31.min(trunc_i8(xv * id + 16.5)) as u8;
    }
    let (qh, qs) = b[2..].split_at_mut(4);
    pack_q5(&v, qh, qs);
}

fn q5_1(x: &[f32], b: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    write_f16(b, 0, d);
    write_f16(b, 2, min);
    let mut v = [0u8; 32];
    for (q, &xv) in v.iter_mut().zip(x) {
        *q = (((xv - min) * id + 0.5) as i32) as u8;
    }
    let (qh, qs) = b[4..].split_at_mut(4);
    pack_q5(&v, qh, qs);
}

fn q8_0_ref(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    write_f16(b, 0, d);
    for j in 0..32 {
        b[2 + j] = ((x[j] * id).round() as i32) as i8 as u8;
    }
}

fn q8_1_ref(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    write_f16(b, 0, d);
    let mut sum = 0i32;
    for j in 0..32 {
        let q = ((x[j] * id).round() as i32) as i8;
        b[4 + j] = q as u8;
        sum += q as i32;
    }
    write_f16(b, 2, sum as f32 * d);
}

fn best_index_fp4(x: f32, e: f32) -> u8 {
    let mut best = 0;
    let mut best_err = (KVALUES_FP4[0] as f32 * e - x).abs();
    for (i, &k) in KVALUES_FP4.iter().enumerate().skip(1) {
        let err = (k as f32 * e - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

fn mxfp4(x: &[f32], b: &mut [u8]) {
    let amax = x
        .iter()
        .fold(0.0f32, |m, &v| if m < v.abs() { v.abs() } else { m });
    let e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0) as i32 as u8
    } else {
        0
    };
    let d = crate::fp::e8m0_half(e);
    b[0] = e;
    for j in 0..16 {
        b[1 + j] = best_index_fp4(x[j], d) | (best_index_fp4(x[j + 16], d) << 4);
    }
}

fn nvfp4(x: &[f32], b: &mut [u8]) {
    for s in 0..4 {
        let xb = &x[16 * s..16 * s + 16];
        let amax = xb
            .iter()
            .fold(0.0f32, |m, &v| if m < v.abs() { v.abs() } else { m });
        let ue = f32_to_ue4m3(amax / 6.0);
        b[s] = ue;
        let d = ue4m3_half(ue);
        for j in 0..8 {
            b[4 + 8 * s + j] = best_index_fp4(xb[j], d) | (best_index_fp4(xb[j + 8], d) << 4);
        }
    }
}

#[inline(always)]
fn q8_k(x: &[f32], b: &mut [u8]) {
    // amax_signed: the first value of the largest magnitude, found in two vector passes
    let amax = abs_max(x);
    if amax == 0.0 {
        b.fill(0);
        return;
    }
    let max = x[x.iter().position(|v| v.abs() == amax).unwrap_or(0)];
    let iscale = -127.0 / max;
    let (qs, sums) = b[4..].split_at_mut(256);
    for (j, (xs, qs)) in x.chunks_exact(16).zip(qs.chunks_exact_mut(16)).enumerate() {
        // |iscale·x| <= 127: every q fits an i8
        let mut q = [0i32; 16];
        for l in 0..16 {
            q[l] = nearest_int(iscale * xs[l]).min(127);
        }
        let sum: i32 = q.iter().sum();
        for l in 0..16 {
            qs[l] = q[l] as i8 as u8;
        }
        sums[2 * j..2 * j + 2].copy_from_slice(&(sum as i16).to_le_bytes());
    }
    b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

/// `make_qkx2_quants`: a scale and a min for `x` (weights `w`), levels 0..=nmax in `l`.
/// Returns (scale, -min).
#[allow(clippy::too_many_arguments)]
fn make_qkx2(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += w[i] * (diff * diff);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let lf = q as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += w[i] * (diff * diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

#[derive(Clone, Copy, PartialEq)]
enum KQuant {
    Q4,
    Q5,
}

/// `quantize_row_q4_K_ref` and `quantize_row_q5_K_ref` (they differ in nmax and search range).
fn qk_min(x: &[f32], b: &mut [u8], kind: KQuant) {
    let (nmax, rmin, nstep) = match kind {
        KQuant::Q4 => (15, -1.0, 20),
        KQuant::Q5 => (31, -0.5, 15),
    };
    let mut l = [0u8; 256];
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut w = [0.0f32; 32];
        for (wi, &v) in w.iter_mut().zip(xs) {
            *wi = av_x + v.abs();
        }
        let (s, m) = make_qkx2(xs, &w, nmax, &mut l[32 * j..32 * j + 32], rmin, 0.1, nstep);
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut sc = [0u8; 12];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 15) | ((lm & 15) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let d16 = f32_to_f16(max_scale / 63.0);
    let dmin16 = f32_to_f16(max_min / 63.0);
    let (d_all, dmin_all) = (crate::fp::f16_to_f32(d16), crate::fp::f16_to_f32(dmin16));
    for j in 0..8 {
        let (s, m) = crate::dequant::scale_min_k4(j, &sc);
        let d = d_all * s as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    b[0..2].copy_from_slice(&d16.to_le_bytes());
    b[2..4].copy_from_slice(&dmin16.to_le_bytes());
    b[4..16].copy_from_slice(&sc);
    match kind {
        KQuant::Q4 => {
            let q = &mut b[16..144];
            for c in 0..4 {
                for i in 0..32 {
                    q[32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
                }
            }
        }
        KQuant::Q5 => {
            let (qh, ql) = b[16..176].split_at_mut(32);
            qh.fill(0);
            for c in 0..4 {
                for i in 0..32 {
                    let mut l1 = l[64 * c + i];
                    let mut l2 = l[64 * c + 32 + i];
                    if l1 > 15 {
                        l1 -= 16;
                        qh[i] |= 1 << (2 * c);
                    }
                    if l2 > 15 {
                        l2 -= 16;
                        qh[i] |= 2 << (2 * c);
                    }
                    ql[32 * c + i] = l1 | (l2 << 4);
                }
            }
        }
    }
}

/// `make_qx_quants(16, 32, x, L, rmse_type = 1, NULL)` as used by the Q6_K reference.
fn make_qx_q6(x: &[f32], l: &mut [i8]) -> f32 {
    const NMAX: i32 = 32;
    let (amax, max) = amax_signed(x);
    if amax < 1e-15 {
        l.fill(0);
        return 0.0;
    }
    let mut iscale = -(NMAX as f32) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..x.len() {
        let q = nearest_int(iscale * x[i]).clamp(-NMAX, NMAX - 1);
        l[i] = (q + NMAX) as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(NMAX as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &xi in x {
            let q = nearest_int(iscale * xi).clamp(-NMAX, NMAX - 1);
            let w = xi * xi;
            sumlx += w * xi * q as f32;
            suml2 += w * q as f32 * q as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..x.len() {
                let q = nearest_int(iscale * x[i]).clamp(-NMAX, NMAX - 1);
                l[i] = (q + NMAX) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

fn q6_k(x: &[f32], b: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for ib in 0..16 {
        let s = make_qx_q6(&x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = s;
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    b.fill(0);
    if max_abs_scale < 1e-15 {
        return;
    }
    let iscale = -128.0 / max_scale;
    let d16 = f32_to_f16(1.0 / iscale);
    b[208..210].copy_from_slice(&d16.to_le_bytes());
    let d_all = crate::fp::f16_to_f32(d16);
    for ib in 0..16 {
        b[192 + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
    }
    for j in 0..16 {
        let d = d_all * (b[192 + j] as i8) as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let q = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
            l[16 * j + ii] = (q + 32) as i8;
        }
    }
    let (ql, rest) = b.split_at_mut(128);
    let qh = &mut rest[..64];
    for n in 0..2 {
        let (ql, qh, l) = (&mut ql[64 * n..], &mut qh[32 * n..], &l[128 * n..]);
        for i in 0..32 {
            let q = |k: usize| l[i + 32 * k] as u8;
            ql[i] = (q(0) & 15) | ((q(2) & 15) << 4);
            ql[i + 32] = (q(1) & 15) | ((q(3) & 15) << 4);
            qh[i] = (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
}
