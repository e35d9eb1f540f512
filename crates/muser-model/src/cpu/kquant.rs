//! ggml's tiled K-quant matmul (`ggml-cpu/tiled`, b11434), which ggml runs instead of the
//! per-row dot products whenever a Q2_K..Q6_K weight meets eight or more activation rows.
//!
//! Its numerics, per 256-value block `b` of weight row `i` and Q8_K activation row `j`:
//! integer sums `s1 = Σ_sub scale·Σ q·a` (and `s2 = Σ_sub min·bsum` for formats with mins) are
//! exact; then `r = fma(-dmin, s2, d·s1)` (or `d·s1`) and `acc = fma(r, d_act, acc)` (GCC
//! contracts ggml's vector multiply and add into one FMA), blocks in order.
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
        // GCC contracts ggml's `add(buf, mul(result, d))` into one FMA.
        acc = r.mul_add(da, acc);
    }
    acc
}
}

/// Q8_K activation rows repacked for the VNNI kernel: tokens in bands of 16; per band and
/// block, 64 groups of 4 codes laid out `[group][token][4]` (one 64-byte vector per group),
/// the 16 scales and, per 16-code sub-block, the 16 tokens' sums as i32.
pub struct Packed {
    n_blocks: usize,
    pub n_bands: usize,
    q: Vec<u8>,
    d: Vec<f32>,
    bsum: Vec<i32>,
}

const BAND: usize = 16;

impl Packed {
    /// Repack `n_rows` Q8_K rows of `n_blocks` blocks each.
    pub fn new(acts: &[u8], n_rows: usize, n_blocks: usize) -> Packed {
        let n_bands = n_rows.div_ceil(BAND);
        let mut p = Packed {
            n_blocks,
            n_bands,
            q: vec![0; n_bands * n_blocks * 256 * BAND],
            d: vec![0.0; n_bands * n_blocks * BAND],
            bsum: vec![0; n_bands * n_blocks * 16 * BAND],
        };
        for t in 0..n_rows {
            let (band, lane) = (t / BAND, t % BAND);
            for b in 0..n_blocks {
                let a = &acts[(t * n_blocks + b) * Q8K_BYTES..][..Q8K_BYTES];
                let bb = band * n_blocks + b;
                p.d[bb * BAND + lane] = f32::from_le_bytes([a[0], a[1], a[2], a[3]]);
                let q = &mut p.q[bb * 256 * BAND..(bb + 1) * 256 * BAND];
                for g in 0..64 {
                    q[(g * BAND + lane) * 4..(g * BAND + lane) * 4 + 4]
                        .copy_from_slice(&a[4 + 4 * g..8 + 4 * g]);
                }
                for j in 0..16 {
                    p.bsum[(bb * 16 + j) * BAND + lane] =
                        i16::from_le_bytes([a[260 + 2 * j], a[261 + 2 * j]]) as i32;
                }
            }
        }
        p
    }
}

/// Whether the VNNI kernel runs on this CPU.
pub fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One unpacked weight row against every token band; `out[t]` for token `t < out.len()`.
/// Same integer sums and float roundings as [`dot`].
pub fn dot_packed(w: &Unpacked, p: &Packed, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_vnni() {
            // SAFETY: the required features were detected.
            unsafe { vnni::dot_packed(w, p, out) };
            return;
        }
    }
    // Portable fallback: rebuild each token's Q8_K row view and use the scalar kernel.
    let mut row = vec![0u8; p.n_blocks * Q8K_BYTES];
    for (t, o) in out.iter_mut().enumerate() {
        let (band, lane) = (t / BAND, t % BAND);
        for b in 0..p.n_blocks {
            let bb = band * p.n_blocks + b;
            let r = &mut row[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            r[0..4].copy_from_slice(&p.d[bb * BAND + lane].to_le_bytes());
            for g in 0..64 {
                let at = (bb * 256 * BAND) + (g * BAND + lane) * 4;
                r[4 + 4 * g..8 + 4 * g].copy_from_slice(&p.q[at..at + 4]);
            }
            for j in 0..16 {
                r[260 + 2 * j..262 + 2 * j]
                    .copy_from_slice(&(p.bsum[(bb * 16 + j) * BAND + lane] as i16).to_le_bytes());
            }
        }
        *o = dot(w, &row);
    }
}

#[cfg(target_arch = "x86_64")]
// AVX512 intrinsics are stable since Rust 1.89; the workspace MSRV (1.85) predates them.
#[allow(clippy::incompatible_msrv, clippy::needless_range_loop)]
mod vnni {
    use super::{Packed, Unpacked, BAND};
    use muser_gguf::GgmlType;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn dot_packed(w: &Unpacked, p: &Packed, out: &mut [f32]) {
        let nb = p.n_blocks;
        let q6 = w.ty == GgmlType::Q6_K;
        for band in 0..p.n_bands {
            let mut acc = _mm512_setzero_ps();
            for b in 0..nb {
                let bb = band * nb + b;
                let aq = p.q.as_ptr().add(bb * 256 * BAND);
                let bs = p.bsum.as_ptr().add(bb * 16 * BAND);
                let codes = w.q.as_ptr().add(b * 256);
                let sm = &w.sm[b];
                let (d, dmin) = w.d[b];
                let mut s1 = _mm512_setzero_si512();
                let res = if q6 {
                    for s in 0..16 {
                        let mut sum = _mm512_setzero_si512();
                        for g in 4 * s..4 * s + 4 {
                            let w4 = (codes.add(4 * g) as *const i32).read_unaligned();
                            let a = _mm512_loadu_si512(aq.add(g * 64) as *const _);
                            sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi32(w4), a);
                        }
                        let bsum = _mm512_loadu_si512(bs.add(s * BAND) as *const _);
                        sum =
                            _mm512_sub_epi32(sum, _mm512_mullo_epi32(bsum, _mm512_set1_epi32(32)));
                        s1 =
                            _mm512_add_epi32(s1, _mm512_mullo_epi32(sum, _mm512_set1_epi32(sm[s])));
                    }
                    _mm512_mul_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(d))
                } else {
                    let mut s2 = _mm512_setzero_si512();
                    for s in 0..8 {
                        let mut sum = _mm512_setzero_si512();
                        for g in 8 * s..8 * s + 8 {
                            let w4 = (codes.add(4 * g) as *const i32).read_unaligned();
                            let a = _mm512_loadu_si512(aq.add(g * 64) as *const _);
                            sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi32(w4), a);
                        }
                        s1 =
                            _mm512_add_epi32(s1, _mm512_mullo_epi32(sum, _mm512_set1_epi32(sm[s])));
                        let b2 = _mm512_add_epi32(
                            _mm512_loadu_si512(bs.add(2 * s * BAND) as *const _),
                            _mm512_loadu_si512(bs.add((2 * s + 1) * BAND) as *const _),
                        );
                        s2 = _mm512_add_epi32(
                            s2,
                            _mm512_mullo_epi32(b2, _mm512_set1_epi32(sm[8 + s])),
                        );
                    }
                    let r = _mm512_mul_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(d));
                    _mm512_fnmadd_ps(_mm512_set1_ps(dmin), _mm512_cvtepi32_ps(s2), r)
                };
                let da = _mm512_loadu_ps(p.d.as_ptr().add(bb * BAND));
                acc = _mm512_fmadd_ps(res, da, acc);
            }
            let mut lanes = [0f32; BAND];
            _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
            let t0 = band * BAND;
            let n = BAND.min(out.len().saturating_sub(t0));
            out[t0..t0 + n].copy_from_slice(&lanes[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(ty: GgmlType, n: usize, seed: u64) -> (Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>) {
        let mut x = seed;
        let mut rnd = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let w: Vec<f32> = (0..n).map(|_| rnd()).collect();
        let a: Vec<f32> = (0..n).map(|_| rnd() * 3.0).collect();
        let mut wq = vec![0u8; ty.row_bytes(n).unwrap()];
        muser_quant::quantize_row(ty, &w, &mut wq).unwrap();
        let mut aq = vec![0u8; GgmlType::Q8_K.row_bytes(n).unwrap()];
        muser_quant::quantize_activations(GgmlType::Q8_K, &a, &mut aq).unwrap();
        let mut wd = vec![0f32; n];
        muser_quant::dequantize_row(ty, &wq, &mut wd).unwrap();
        let mut ad = vec![0f32; n];
        muser_quant::dequantize_row(GgmlType::Q8_K, &aq, &mut ad).unwrap();
        (wq, aq, wd, ad)
    }

    #[test]
    fn tiled_numerics_agree_with_exact_dot_and_packed_kernel() {
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            let n = 1024;
            let mut acts = Vec::new();
            let mut want = Vec::new();
            let (wq, _, wd, _) = rows(ty, n, 1);
            let u = unpack(ty, &wq, n);
            for t in 0..19u64 {
                let (_, aq, _, ad) = rows(ty, n, 100 + t);
                let exact: f64 = wd.iter().zip(&ad).map(|(&a, &b)| a as f64 * b as f64).sum();
                let tiled = dot(&u, &aq);
                let per_row = muser_quant::vec_dot(ty, n, &wq, &aq);
                assert!(
                    (tiled as f64 - exact).abs() < 1e-5 * exact.abs().max(1.0),
                    "{ty:?}: tiled {tiled} vs exact {exact}"
                );
                assert!(
                    (per_row as f64 - exact).abs() < 1e-5 * exact.abs().max(1.0),
                    "{ty:?}: vec_dot {per_row} vs exact {exact}"
                );
                acts.extend_from_slice(&aq);
                want.push(tiled);
            }
            let p = Packed::new(&acts, 19, n / 256);
            let mut got = vec![0f32; 19];
            dot_packed(&u, &p, &mut got);
            assert_eq!(
                got, want,
                "{ty:?}: packed kernel differs from the scalar model"
            );
        }
    }
}
