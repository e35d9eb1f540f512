//! ggml's tiled K-quant matmul (`ggml-cpu/tiled`, b11434), which ggml runs instead of the
//! per-row dot products whenever a Q2_K..Q6_K weight meets eight or more activation rows.
//!
//! Its numerics, per 256-value block `b` of weight row `i` and Q8_K activation row `j`:
//! integer sums `s1 = Σ_sub scale·Σ q·a` (and `s2 = Σ_sub min·bsum` for formats with mins) are
//! exact; then `r = fma(-dmin, s2, d·s1)` (or `d·s1`) and `acc += r·d_act`, blocks in order.
//! Those roundings differ from the per-row kernels, so batched prefill needs this path to
//! match llama.cpp.

use super::math::fma_fn;
use muser_gguf::GgmlType;

/// Bytes of a Q8_K block: f32 d, 256 i8 codes, 16 i16 sums of 16 codes.
pub const Q8K_BYTES: usize = 4 + 256 + 32;

/// Whether ggml takes the tiled path for this weight type and row count.
pub fn applies(ty: GgmlType, n_rows: usize) -> bool {
    n_rows >= 8 && matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

/// One weight row unpacked per 256-block: codes (unsigned), per-sub-block scales and mins.
pub struct Unpacked {
    /// Codes, `n_blocks × 256`.
    q: Vec<u8>,
    /// Per block: d, dmin.
    d: Vec<(f32, f32)>,
    /// Per block: 16 scales (Q6_K) or 8 scales then 8 mins (Q4_K/Q5_K).
    sm: Vec<[i32; 16]>,
    ty: GgmlType,
}

fn f16le(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

fn scale_min_k4(j: usize, q: &[u8]) -> (i32, i32) {
    if j < 4 {
        ((q[j] & 63) as i32, (q[j + 4] & 63) as i32)
    } else {
        (
            ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)) as i32,
            ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as i32,
        )
    }
}

/// Unpack one weight row (`n_in` values) of type `ty` (Q4_K, Q5_K or Q6_K).
pub fn unpack(ty: GgmlType, row: &[u8], n_in: usize) -> Unpacked {
    let nb = n_in / 256;
    let bs = ty.type_size();
    let mut u = Unpacked {
        q: vec![0; nb * 256],
        d: Vec::with_capacity(nb),
        sm: Vec::with_capacity(nb),
        ty,
    };
    for b in 0..nb {
        let blk = &row[b * bs..(b + 1) * bs];
        let q = &mut u.q[b * 256..(b + 1) * 256];
        let mut sm = [0i32; 16];
        match ty {
            GgmlType::Q4_K | GgmlType::Q5_K => {
                u.d.push((f16le(&blk[0..2]), f16le(&blk[2..4])));
                let scales = &blk[4..16];
                for j in 0..8 {
                    let (s, m) = scale_min_k4(j, scales);
                    sm[j] = s;
                    sm[8 + j] = m;
                }
                let (qh, qs) = if ty == GgmlType::Q5_K {
                    (Some(&blk[16..48]), &blk[48..176])
                } else {
                    (None, &blk[16..144])
                };
                for c in 0..4 {
                    for l in 0..32 {
                        let byte = qs[32 * c + l];
                        let (mut lo, mut hi) = (byte & 0xF, byte >> 4);
                        if let Some(qh) = qh {
                            lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                            hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                        }
                        q[64 * c + l] = lo;
                        q[64 * c + 32 + l] = hi;
                    }
                }
            }
            GgmlType::Q6_K => {
                let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
                u.d.push((f16le(&blk[208..210]), 0.0));
                for (j, s) in sc.iter().enumerate() {
                    sm[j] = *s as i8 as i32;
                }
                for n in 0..2 {
                    let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                    let y = &mut q[128 * n..];
                    for l in 0..32 {
                        y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                        y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                        y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                        y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                    }
                }
            }
            _ => unreachable!("kquant::unpack called for {ty:?}"),
        }
        u.sm.push(sm);
    }
    u
}

#[inline(always)]
fn idot(w: &[u8], a: &[u8]) -> i32 {
    let mut s = 0i32;
    for (&x, &y) in w.iter().zip(a) {
        s += x as i32 * (y as i8) as i32;
    }
    s
}

fma_fn! {
/// Dot of one unpacked weight row with one Q8_K activation row, with the tiled kernel's
/// rounding sequence.
pub fn dot(w: &Unpacked, act: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (b, (&(d, dmin), sm)) in w.d.iter().zip(&w.sm).enumerate() {
        let a = &act[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
        let da = f32::from_le_bytes([a[0], a[1], a[2], a[3]]);
        let qa = &a[4..260];
        let bsum = |j: usize| i16::from_le_bytes([a[260 + 2 * j], a[261 + 2 * j]]) as i32;
        let q = &w.q[b * 256..(b + 1) * 256];
        let r = if w.ty == GgmlType::Q6_K {
            let mut s1 = 0i32;
            for s in 0..16 {
                let raw = idot(&q[16 * s..16 * s + 16], &qa[16 * s..16 * s + 16]);
                s1 += sm[s] * (raw - 32 * bsum(s));
            }
            d * s1 as f32
        } else {
            let (mut s1, mut s2) = (0i32, 0i32);
            for s in 0..8 {
                s1 += sm[s] * idot(&q[32 * s..32 * s + 32], &qa[32 * s..32 * s + 32]);
                s2 += sm[8 + s] * (bsum(2 * s) + bsum(2 * s + 1));
            }
            (-dmin).mul_add(s2 as f32, d * s1 as f32)
        };
        acc += r * da;
    }
    acc
}
}
