//! Dequantization of one block at a time, in ggml's operation order (`ggml-quants.c`), so the
//! floats are bit-identical to `dequantize_row_*`.

use crate::fp::{e8m0_half, f16_to_f32, read_f16, ue4m3_half, KVALUES_FP4};
use crate::GgmlType;

/// Dequantizes whole blocks of `ty` from `src` into `dst`. Lengths are checked by the caller.
pub(crate) fn dequantize_blocks(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let halves = || {
        src.chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    match ty {
        GgmlType::F32 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            return;
        }
        GgmlType::F16 => {
            for (y, h) in dst.iter_mut().zip(halves()) {
                *y = f16_to_f32(h);
            }
            return;
        }
        GgmlType::BF16 => {
            for (y, h) in dst.iter_mut().zip(halves()) {
                *y = crate::fp::bf16_to_f32(h);
            }
            return;
        }
        _ => {}
    }
    let per_block: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q8_1 => q8_1,
        GgmlType::Q2_K => q2_k,
        GgmlType::Q3_K => q3_k,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q5_K => q5_k,
        GgmlType::Q6_K => q6_k,
        GgmlType::Q8_K => q8_k,
        GgmlType::MXFP4 => mxfp4,
        GgmlType::NVFP4 => nvfp4,
        _ => unreachable!("checked by dequantize_row"),
    };
    for (b, y) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(bs)) {
        per_block(b, y);
    }
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = ((q & 15) as i32 - 8) as f32 * d;
        y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (read_f16(b, 0), read_f16(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = (q & 15) as f32 * d + m;
        y[j + 16] = (q >> 4) as f32 * d + m;
    }
}

/// The 32 five-bit values of a Q5_0/Q5_1 block (low nibbles are 0..15, high nibbles 16..31).
pub(crate) fn q5_values(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut v = [0u8; 32];
    for j in 0..16 {
        v[j] = (qs[j] & 15) | ((((h >> j) & 1) as u8) << 4);
        v[j + 16] = (qs[j] >> 4) | ((((h >> (j + 16)) & 1) as u8) << 4);
    }
    v
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    for (yj, v) in y.iter_mut().zip(q5_values(&b[2..6], &b[6..22])) {
        *yj = (v as i32 - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (read_f16(b, 0), read_f16(b, 2));
    for (yj, v) in y.iter_mut().zip(q5_values(&b[4..8], &b[8..24])) {
        *yj = v as f32 * d + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

fn q8_1(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    for j in 0..32 {
        y[j] = (b[4 + j] as i8) as f32 * d;
    }
}

fn mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_half(b[0]);
    for j in 0..16 {
        let q = b[1 + j];
        y[j] = KVALUES_FP4[(q & 15) as usize] as f32 * d;
        y[j + 16] = KVALUES_FP4[(q >> 4) as usize] as f32 * d;
    }
}

fn nvfp4(b: &[u8], y: &mut [f32]) {
    for s in 0..4 {
        let d = ue4m3_half(b[s]);
        for j in 0..8 {
            let q = b[4 + 8 * s + j];
            y[16 * s + j] = KVALUES_FP4[(q & 15) as usize] as f32 * d;
            y[16 * s + j + 8] = KVALUES_FP4[(q >> 4) as usize] as f32 * d;
        }
    }
}

/// `get_scale_min_k4`: the 6-bit (scale, min) pair `j` of a Q4_K/Q5_K block.
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (read_f16(b, 80), read_f16(b, 82));
    let mut out = 0;
    for (n, q) in qs.chunks_exact(32).enumerate() {
        for j in 0..4 {
            let shift = 2 * j;
            for half in 0..2 {
                let sc = scales[8 * n + 2 * j + half];
                let (dl, ml) = (d * (sc & 15) as f32, dmin * (sc >> 4) as f32);
                for l in 0..16 {
                    y[out] = dl * ((q[16 * half + l] >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

/// The 16 signed 6-bit scales of a Q3_K block, minus 32.
pub(crate) fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for j in 0..16 {
        let low = if j < 8 { s[j] & 15 } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        out[j] = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// The 256 signed 3-bit values (-4..3) of a Q3_K block, in element order.
pub(crate) fn q3_k_values(b: &[u8]) -> [i8; 256] {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let mut v = [0i8; 256];
    for e in 0..256 {
        let (n, r) = (e / 128, e % 128);
        let (j, l) = (r / 32, r % 32);
        let low = (qs[32 * n + l] >> (2 * j)) & 3;
        let high = hmask[l] & (1 << (4 * n + j)) != 0;
        v[e] = low as i8 - if high { 0 } else { 4 };
    }
    v
}

fn q3_k(b: &[u8], y: &mut [f32]) {
    let d_all = read_f16(b, 108);
    let scales = q3_k_scales(&b[96..108]);
    let v = q3_k_values(b);
    for e in 0..256 {
        let dl = d_all * scales[e / 16] as f32;
        y[e] = dl * v[e] as f32;
    }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (read_f16(b, 0), read_f16(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            let q = qs[32 * c + l];
            y[64 * c + l] = d1 * (q & 15) as f32 - m1;
            y[64 * c + 32 + l] = d2 * (q >> 4) as f32 - m2;
        }
    }
}

/// The 256 five-bit values (0..31) of a Q5_K block, in element order.
pub(crate) fn q5_k_values(b: &[u8]) -> [u8; 256] {
    let (qh, qs) = (&b[16..48], &b[48..176]);
    let mut v = [0u8; 256];
    for c in 0..4 {
        for l in 0..32 {
            let q = qs[32 * c + l];
            v[64 * c + l] = (q & 15) | (((qh[l] >> (2 * c)) & 1) << 4);
            v[64 * c + 32 + l] = (q >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
        }
    }
    v
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (read_f16(b, 0), read_f16(b, 2));
    let scales = &b[4..16];
    let v = q5_k_values(b);
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            y[64 * c + l] = d1 * v[64 * c + l] as f32 - m1;
            y[64 * c + 32 + l] = d2 * v[64 * c + 32 + l] as f32 - m2;
        }
    }
}

/// The 256 unsigned six-bit values (0..63) of a Q6_K block, in element order.
pub(crate) fn q6_k_values(b: &[u8]) -> [u8; 256] {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    let mut v = [0u8; 256];
    for n in 0..2 {
        let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
        for l in 0..32 {
            let o = 128 * n + l;
            v[o] = (ql[l] & 15) | ((qh[l] & 3) << 4);
            v[o + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
            v[o + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            v[o + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    v
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 208);
    let v = q6_k_values(b);
    for e in 0..256 {
        let sc = b[192 + e / 16] as i8;
        y[e] = d * sc as f32 * (v[e] as i32 - 32) as f32;
    }
}

fn q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for j in 0..256 {
        y[j] = d * (b[4 + j] as i8) as f32;
    }
}
