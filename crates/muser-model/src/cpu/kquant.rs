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
    /// Per block (Q4_K/Q5_K): mins 2k and 2k+1 as the low and high i16 of word k.
    mp: Vec<[i32; 4]>,
    ty: GgmlType,
}

#[inline(always)]
fn f16le(b: &[u8]) -> f32 {
    muser_quant::fp::F16_TABLE[u16::from_le_bytes([b[0], b[1]]) as usize]
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

#[cfg(test)]
/// Unpack one weight row (`n_in` values) of type `ty` (Q4_K, Q5_K or Q6_K).
pub fn unpack(ty: GgmlType, row: &[u8], n_in: usize) -> Unpacked {
    let mut u = Unpacked::new(ty, n_in / 256);
    u.fill(row);
    u
}

impl Unpacked {
    /// Room for one row of `n_blocks` blocks of `ty` (filled by [`Unpacked::fill`]).
    pub fn new(ty: GgmlType, n_blocks: usize) -> Unpacked {
        Unpacked {
            q: vec![0; n_blocks * 256],
            d: vec![(0.0, 0.0); n_blocks],
            sm: vec![[0; 16]; n_blocks],
            mp: vec![[0; 4]; n_blocks],
            ty,
        }
    }

    /// Unpack `row` (this buffer's type and block count) in place, reusing the buffers.
    pub fn fill(&mut self, row: &[u8]) {
        #[cfg(target_arch = "x86_64")]
        if muser_quant::detected_isa() >= muser_quant::Isa::Avx2 {
            // SAFETY: AVX2 was detected.
            unsafe { self.fill_avx2(row) };
            return;
        }
        self.fill_any::<false>(row);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn fill_avx2(&mut self, row: &[u8]) {
        self.fill_any::<true>(row);
    }

    /// `AVX2`: only when called from [`Unpacked::fill_avx2`].
    #[inline(always)]
    fn fill_any<const AVX2: bool>(&mut self, row: &[u8]) {
        let ty = self.ty;
        let bs = ty.type_size();
        let nb = self.d.len();
        for b in 0..nb {
            let blk = &row[b * bs..(b + 1) * bs];
            let q = &mut self.q[b * 256..(b + 1) * 256];
            let sm = &mut self.sm[b];
            match ty {
                GgmlType::Q4_K | GgmlType::Q5_K => {
                    self.d[b] = (f16le(&blk[0..2]), f16le(&blk[2..4]));
                    let scales = &blk[4..16];
                    for j in 0..8 {
                        let (s, m) = scale_min_k4(j, scales);
                        sm[j] = s;
                        sm[8 + j] = m;
                    }
                    for k in 0..4 {
                        self.mp[b][k] = sm[8 + 2 * k] | (sm[9 + 2 * k] << 16);
                    }
                    let qs = if ty == GgmlType::Q5_K {
                        &blk[48..176]
                    } else {
                        &blk[16..144]
                    };
                    #[cfg(target_arch = "x86_64")]
                    if AVX2 && ty == GgmlType::Q4_K {
                        // SAFETY: AVX2 is enabled in the caller; 128 bytes in, 256 out.
                        unsafe { simd::nibbles_q4k(qs.as_ptr(), q.as_mut_ptr()) };
                        continue;
                    }
                    for c in 0..4 {
                        let (src, dst) = (&qs[32 * c..32 * c + 32], &mut q[64 * c..64 * c + 64]);
                        let (lo, hi) = dst.split_at_mut(32);
                        for l in 0..32 {
                            lo[l] = src[l] & 0xF;
                            hi[l] = src[l] >> 4;
                        }
                    }
                    if ty == GgmlType::Q5_K {
                        let qh = &blk[16..48];
                        for c in 0..4 {
                            let dst = &mut q[64 * c..64 * c + 64];
                            for l in 0..32 {
                                dst[l] |= ((qh[l] >> (2 * c)) & 1) << 4;
                                dst[32 + l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                            }
                        }
                    }
                }
                GgmlType::Q6_K => {
                    let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
                    self.d[b] = (f16le(&blk[208..210]), 0.0);
                    for (j, s) in sc.iter().enumerate() {
                        sm[j] = *s as i8 as i32;
                    }
                    #[cfg(target_arch = "x86_64")]
                    if AVX2 {
                        // SAFETY: AVX2 is enabled in the caller; 192 bytes in, 256 out.
                        unsafe { simd::codes_q6k(ql.as_ptr(), qh.as_ptr(), q.as_mut_ptr()) };
                        continue;
                    }
                    for n in 0..2 {
                        let (ql, qh) = (&ql[64 * n..64 * n + 64], &qh[32 * n..32 * n + 32]);
                        let y = &mut q[128 * n..128 * n + 128];
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
        }
    }
}

/// AVX2 code unpacking for [`Unpacked::fill`] (the same bytes as its scalar loops).
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// Q4_K: 128 packed bytes → per 32-byte chunk c, low nibbles to `q[64c..]`, high to
    /// `q[64c + 32..]`.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn nibbles_q4k(qs: *const u8, q: *mut u8) {
        let m4 = _mm256_set1_epi8(0xF);
        for c in 0..4 {
            let v = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
            let lo = _mm256_and_si256(v, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            _mm256_storeu_si256(q.add(64 * c) as *mut __m256i, lo);
            _mm256_storeu_si256(q.add(64 * c + 32) as *mut __m256i, hi);
        }
    }

    /// Q6_K: 128 low-nibble bytes and 64 high-bit bytes → 256 six-bit codes.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn codes_q6k(ql: *const u8, qh: *const u8, q: *mut u8) {
        let m4 = _mm256_set1_epi8(0xF);
        let m30 = _mm256_set1_epi8(0x30);
        for n in 0..2 {
            let a = _mm256_loadu_si256(ql.add(64 * n) as *const __m256i);
            let b = _mm256_loadu_si256(ql.add(64 * n + 32) as *const __m256i);
            let h = _mm256_loadu_si256(qh.add(32 * n) as *const __m256i);
            let y = q.add(128 * n);
            let y0 = _mm256_or_si256(
                _mm256_and_si256(a, m4),
                _mm256_and_si256(_mm256_slli_epi16(h, 4), m30),
            );
            let y1 = _mm256_or_si256(
                _mm256_and_si256(b, m4),
                _mm256_and_si256(_mm256_slli_epi16(h, 2), m30),
            );
            let y2 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                _mm256_and_si256(h, m30),
            );
            let y3 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(h, 2), m30),
            );
            _mm256_storeu_si256(y as *mut __m256i, y0);
            _mm256_storeu_si256(y.add(32) as *mut __m256i, y1);
            _mm256_storeu_si256(y.add(64) as *mut __m256i, y2);
            _mm256_storeu_si256(y.add(96) as *mut __m256i, y3);
        }
    }
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
    /// Per band, block, k < 4 and token: the sums of 32-code sub-blocks 2k and 2k+1 as the
    /// low and high i16 (each |sum| <= 32·128 fits).
    b2: Vec<i32>,
    /// Per band, block, k < 8 and token: the sums of 16-code sub-blocks 2k and 2k+1 as the
    /// low and high i16 (each |sum| <= 16·128 fits).
    b16: Vec<i32>,
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
            b2: vec![0; n_bands * n_blocks * 4 * BAND],
            b16: vec![0; n_bands * n_blocks * 8 * BAND],
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
                let bs = |j: usize| i16::from_le_bytes([a[260 + 2 * j], a[261 + 2 * j]]) as i32;
                for j in 0..16 {
                    p.bsum[(bb * 16 + j) * BAND + lane] = bs(j);
                }
                for k in 0..4 {
                    let lo = bs(4 * k) + bs(4 * k + 1);
                    let hi = bs(4 * k + 2) + bs(4 * k + 3);
                    p.b2[(bb * 4 + k) * BAND + lane] = (lo & 0xFFFF) | (hi << 16);
                }
                for k in 0..8 {
                    p.b16[(bb * 8 + k) * BAND + lane] =
                        (bs(2 * k) & 0xFFFF) | (bs(2 * k + 1) << 16);
                }
            }
        }
        p
    }
}

/// Whether the VNNI kernel runs (see [`muser_quant::detected_isa`]).
pub fn has_vnni() -> bool {
    muser_quant::detected_isa() == muser_quant::Isa::Avx512
}

#[cfg(test)]
/// One unpacked weight row against every token band; `out[t]` for token `t < out.len()`.
/// Same integer sums and float roundings as [`dot`].
pub fn dot_packed(w: &Unpacked, p: &Packed, out: &mut [f32]) {
    dot_packed_rows(std::slice::from_ref(w), p, out);
}

/// Several unpacked weight rows (of one type) against every token band: `out` holds
/// `ws.len()` rows of `n` values, `out[r * n + t]` for token `t < n`. Each output value has
/// the integer sums and float roundings of [`dot`].
#[cfg(test)]
pub fn dot_packed_rows(ws: &[Unpacked], p: &Packed, out: &mut [f32]) {
    if ws.is_empty() {
        return;
    }
    let n = out.len() / ws.len();
    assert!(n * ws.len() == out.len() && n <= p.n_bands * BAND);
    // SAFETY: every index r * n + t (r < ws.len(), t < n) is inside `out`.
    unsafe { dot_packed_rows_to(ws, p, out.as_mut_ptr(), n, 1, n) }
}

/// [`dot_packed_rows`] writing row r's token t to `out[r * row_stride + t * tok_stride]` for
/// `t < n` (so a caller can write straight into a token-major matrix).
///
/// # Safety
/// Every such index must be inside one allocation that nothing else reads or writes
/// meanwhile, and `n <= p.n_bands * 16`.
pub unsafe fn dot_packed_rows_to(
    ws: &[Unpacked],
    p: &Packed,
    out: *mut f32,
    row_stride: usize,
    tok_stride: usize,
    n: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_vnni() {
            let mut r = 0;
            while r < ws.len() {
                let o = out.add(r * row_stride);
                let left = ws.len() - r;
                // SAFETY: the required features were detected; the caller vouches for `out`.
                if left >= 8 {
                    vnni::dot_rows::<8>(&ws[r..r + 8], p, o, row_stride, tok_stride, n);
                    r += 8;
                } else if left >= 4 {
                    vnni::dot_rows::<4>(&ws[r..r + 4], p, o, row_stride, tok_stride, n);
                    r += 4;
                } else {
                    vnni::dot_rows::<1>(&ws[r..r + 1], p, o, row_stride, tok_stride, n);
                    r += 1;
                }
            }
            return;
        }
        if muser_quant::detected_isa() >= muser_quant::Isa::Avx2 {
            let mut r = 0;
            while r < ws.len() {
                let o = out.add(r * row_stride);
                // SAFETY: AVX2 was detected; the caller vouches for `out`.
                if ws.len() - r >= 4 {
                    avx2::dot_rows::<4>(&ws[r..r + 4], p, o, row_stride, tok_stride, n);
                    r += 4;
                } else {
                    avx2::dot_rows::<1>(&ws[r..r + 1], p, o, row_stride, tok_stride, n);
                    r += 1;
                }
            }
            return;
        }
    }
    // Portable fallback: rebuild each token's Q8_K row view and use the scalar kernel.
    let mut row = vec![0u8; p.n_blocks * Q8K_BYTES];
    for t in 0..n {
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
        for (r, w) in ws.iter().enumerate() {
            *out.add(r * row_stride + t * tok_stride) = dot(w, &row);
        }
    }
}

#[cfg(target_arch = "x86_64")]
// AVX512 intrinsics are stable since Rust 1.89 (the workspace MSRV).
#[allow(clippy::needless_range_loop)]
mod vnni {
    use super::{Packed, Unpacked, BAND};
    use muser_gguf::GgmlType;
    use std::arch::x86_64::*;

    /// `R` weight rows × 16 tokens per pass (ggml's 8x16 band pass): each activation vector is
    /// loaded once for `R` rows. Rows are `ws[..R]`; row r's token t goes to
    /// `out[r * row_stride + t * tok_stride]` for `t < n_tok`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn dot_rows<const R: usize>(
        ws: &[Unpacked],
        p: &Packed,
        out: *mut f32,
        row_stride: usize,
        tok_stride: usize,
        n_tok: usize,
    ) {
        let nb = p.n_blocks;
        assert!(ws.len() >= R && n_tok <= p.n_bands * BAND);
        for w in &ws[..R] {
            assert!(w.d.len() == nb && w.q.len() == nb * 256 && w.ty == ws[0].ty);
        }
        let q6 = ws[0].ty == GgmlType::Q6_K;
        let zero = _mm512_setzero_si512();
        for band in 0..p.n_bands {
            let t0 = band * BAND;
            if t0 >= n_tok {
                break;
            }
            let mut acc = [_mm512_setzero_ps(); R];
            for b in 0..nb {
                let bb = band * nb + b;
                let aq = p.q.as_ptr().add(bb * 256 * BAND);
                let bs = p.bsum.as_ptr().add(bb * 16 * BAND);
                let codes: [*const u8; R] = std::array::from_fn(|r| ws[r].q.as_ptr().add(b * 256));
                let mut s1 = [zero; R];
                let w4 = |r: usize, g: usize| {
                    _mm512_set1_epi32((codes[r].add(4 * g) as *const i32).read_unaligned())
                };
                if q6 {
                    for s in 0..16 {
                        let mut sum = [zero; R];
                        for g in 4 * s..4 * s + 4 {
                            let a = _mm512_loadu_si512(aq.add(g * 64) as *const _);
                            for r in 0..R {
                                sum[r] = _mm512_dpbusd_epi32(sum[r], w4(r, g), a);
                            }
                        }
                        let bias =
                            _mm512_slli_epi32(_mm512_loadu_si512(bs.add(s * BAND) as *const _), 5);
                        for r in 0..R {
                            let sc = _mm512_set1_epi32(ws[r].sm[b][s]);
                            s1[r] = _mm512_add_epi32(
                                s1[r],
                                _mm512_mullo_epi32(_mm512_sub_epi32(sum[r], bias), sc),
                            );
                        }
                    }
                    let da = _mm512_loadu_ps(p.d.as_ptr().add(bb * BAND));
                    for r in 0..R {
                        let d = _mm512_set1_ps(ws[r].d[b].0);
                        let res = _mm512_mul_ps(_mm512_cvtepi32_ps(s1[r]), d);
                        acc[r] = _mm512_fmadd_ps(res, da, acc[r]);
                    }
                } else {
                    for s in 0..8 {
                        let mut sum = [zero; R];
                        for g in 8 * s..8 * s + 8 {
                            let a = _mm512_loadu_si512(aq.add(g * 64) as *const _);
                            for r in 0..R {
                                sum[r] = _mm512_dpbusd_epi32(sum[r], w4(r, g), a);
                            }
                        }
                        for r in 0..R {
                            let sc = _mm512_set1_epi32(ws[r].sm[b][s]);
                            s1[r] = _mm512_add_epi32(s1[r], _mm512_mullo_epi32(sum[r], sc));
                        }
                    }
                    // Σ min·bsum does not depend on the codes: a separate pass keeps registers
                    // for the one above; two sub-blocks per i16-pair multiply-add.
                    let mut s2 = [zero; R];
                    let b2 = p.b2.as_ptr().add(bb * 4 * BAND);
                    for k in 0..4 {
                        let pair = _mm512_loadu_si512(b2.add(k * BAND) as *const _);
                        for r in 0..R {
                            let m = _mm512_set1_epi32(ws[r].mp[b][k]);
                            s2[r] = _mm512_dpwssd_epi32(s2[r], pair, m);
                        }
                    }
                    let da = _mm512_loadu_ps(p.d.as_ptr().add(bb * BAND));
                    for r in 0..R {
                        let (d, dmin) = ws[r].d[b];
                        let res = _mm512_mul_ps(_mm512_cvtepi32_ps(s1[r]), _mm512_set1_ps(d));
                        let res =
                            _mm512_fnmadd_ps(_mm512_set1_ps(dmin), _mm512_cvtepi32_ps(s2[r]), res);
                        acc[r] = _mm512_fmadd_ps(res, da, acc[r]);
                    }
                }
            }
            let n = BAND.min(n_tok - t0);
            let mut lanes = [[0f32; BAND]; R];
            for r in 0..R {
                _mm512_storeu_ps(lanes[r].as_mut_ptr(), acc[r]);
            }
            for t in 0..n {
                let o = out.add((t0 + t) * tok_stride);
                for r in 0..R {
                    *o.add(r * row_stride) = lanes[r][t];
                }
            }
        }
    }
}

/// The AVX2 form of [`vnni`]: the same packed activations, taken 8 tokens (half a band) at a
/// time; `vpmaddubsw` pairs summed in i16 over as many 4-code groups as cannot overflow, then
/// `vpmaddwd` with the sub-block's scale. Every integer sum is exact, so the float epilogue
/// sees the numbers [`dot`] sees and rounds them in the same order.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod avx2 {
    use super::{Packed, Unpacked, BAND};
    use muser_gguf::GgmlType;
    use std::arch::x86_64::*;

    /// Tokens per vector.
    const HALF: usize = BAND / 2;

    /// `R` weight rows × 8 tokens per pass; rows are `ws[..R]`, row r's token t goes to
    /// `out[r * row_stride + t * tok_stride]` for `t < n_tok`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_rows<const R: usize>(
        ws: &[Unpacked],
        p: &Packed,
        out: *mut f32,
        row_stride: usize,
        tok_stride: usize,
        n_tok: usize,
    ) {
        let nb = p.n_blocks;
        assert!(ws.len() >= R && n_tok <= p.n_bands * BAND);
        for w in &ws[..R] {
            assert!(w.d.len() == nb && w.q.len() == nb * 256 && w.ty == ws[0].ty);
        }
        let ty = ws[0].ty;
        // 4-code groups per scale (sub-block), and per i16 partial sum: a `vpmaddubsw` pair is
        // at most 2·max_code·128, so Q4_K (codes < 16) sums 8 pairs, Q5_K (< 32) 4, Q6_K (< 64) 2.
        let (per_scale, per_i16) = match ty {
            GgmlType::Q4_K => (8, 8),
            GgmlType::Q5_K => (8, 4),
            _ => (4, 2),
        };
        let q6 = ty == GgmlType::Q6_K;
        let zero = _mm256_setzero_si256();
        for half in 0..p.n_bands * 2 {
            let (band, h) = (half / 2, half % 2);
            let t0 = half * HALF;
            if t0 >= n_tok {
                break;
            }
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                let bb = band * nb + b;
                let aq = p.q.as_ptr().add(bb * 256 * BAND + h * 4 * HALF);
                let codes: [*const u8; R] = std::array::from_fn(|r| ws[r].q.as_ptr().add(b * 256));
                let mut s1 = [zero; R];
                for s in 0..64 / per_scale {
                    for part in 0..per_scale / per_i16 {
                        let g0 = s * per_scale + part * per_i16;
                        let mut sum = [zero; R];
                        for g in g0..g0 + per_i16 {
                            let a = _mm256_loadu_si256(aq.add(g * 4 * BAND) as *const __m256i);
                            for r in 0..R {
                                let w = _mm256_set1_epi32(
                                    (codes[r].add(4 * g) as *const i32).read_unaligned(),
                                );
                                sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(w, a));
                            }
                        }
                        for r in 0..R {
                            let sc = _mm256_set1_epi16(ws[r].sm[b][s] as i16);
                            s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(sum[r], sc));
                        }
                    }
                }
                let da = _mm256_loadu_ps(p.d.as_ptr().add(bb * BAND + h * HALF));
                if q6 {
                    // s1 -= 32·Σ scale·bsum, two sub-blocks per i16-pair multiply-add
                    let bs = p.b16.as_ptr().add(bb * 8 * BAND + h * HALF);
                    let mut corr = [zero; R];
                    for k in 0..8 {
                        let pair = _mm256_loadu_si256(bs.add(k * BAND) as *const __m256i);
                        for r in 0..R {
                            let sm = &ws[r].sm[b];
                            let sc = (sm[2 * k] & 0xFFFF) | (sm[2 * k + 1] << 16);
                            corr[r] = _mm256_add_epi32(
                                corr[r],
                                _mm256_madd_epi16(pair, _mm256_set1_epi32(sc)),
                            );
                        }
                    }
                    for r in 0..R {
                        let s = _mm256_sub_epi32(s1[r], _mm256_slli_epi32(corr[r], 5));
                        let d = _mm256_set1_ps(ws[r].d[b].0);
                        let res = _mm256_mul_ps(_mm256_cvtepi32_ps(s), d);
                        acc[r] = _mm256_fmadd_ps(res, da, acc[r]);
                    }
                } else {
                    let b2 = p.b2.as_ptr().add(bb * 4 * BAND + h * HALF);
                    let mut s2 = [zero; R];
                    for k in 0..4 {
                        let pair = _mm256_loadu_si256(b2.add(k * BAND) as *const __m256i);
                        for r in 0..R {
                            let m = _mm256_set1_epi32(ws[r].mp[b][k]);
                            s2[r] = _mm256_add_epi32(s2[r], _mm256_madd_epi16(pair, m));
                        }
                    }
                    for r in 0..R {
                        let (d, dmin) = ws[r].d[b];
                        let res = _mm256_mul_ps(_mm256_cvtepi32_ps(s1[r]), _mm256_set1_ps(d));
                        let res =
                            _mm256_fnmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(s2[r]), res);
                        acc[r] = _mm256_fmadd_ps(res, da, acc[r]);
                    }
                }
            }
            let n = HALF.min(n_tok - t0);
            let mut lanes = [[0f32; HALF]; R];
            for r in 0..R {
                _mm256_storeu_ps(lanes[r].as_mut_ptr(), acc[r]);
            }
            for t in 0..n {
                let o = out.add((t0 + t) * tok_stride);
                for r in 0..R {
                    *o.add(r * row_stride) = lanes[r][t];
                }
            }
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
    fn simd_unpack_equals_scalar_unpack() {
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            let (wq, ..) = rows(ty, 1024, 7);
            let fast = unpack(ty, &wq, 1024);
            let mut plain = Unpacked::new(ty, 4);
            plain.fill_any::<false>(&wq);
            assert_eq!(fast.q, plain.q, "{ty:?} codes");
            assert_eq!(fast.sm, plain.sm, "{ty:?} scales");
            assert_eq!(fast.mp, plain.mp, "{ty:?} mins");
            assert_eq!(fast.d, plain.d, "{ty:?} d");
        }
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
            // 13 rows: the 8-, 4- and 1-row passes, each equal to the scalar model
            let us: Vec<Unpacked> = (0..13u64)
                .map(|r| unpack(ty, &rows(ty, n, 500 + r).0, n))
                .collect();
            let mut got = vec![0f32; 13 * 19];
            dot_packed_rows(&us, &p, &mut got);
            for (r, u) in us.iter().enumerate() {
                for t in 0..19 {
                    let a = &acts[t * (n / 256) * Q8K_BYTES..(t + 1) * (n / 256) * Q8K_BYTES];
                    assert_eq!(got[r * 19 + t], dot(u, a), "{ty:?}: row {r} token {t}");
                }
            }
            // the AVX2 kernel (which an AVX512 host does not dispatch to) against the same model
            #[cfg(target_arch = "x86_64")]
            if muser_quant::hardware_isa() >= muser_quant::Isa::Avx2 {
                let mut avx = vec![0f32; 13 * 19];
                // SAFETY: AVX2 is present; every index r * 19 + t is inside `avx`.
                unsafe {
                    avx2::dot_rows::<4>(&us[..4], &p, avx.as_mut_ptr(), 19, 1, 19);
                    avx2::dot_rows::<4>(&us[4..8], &p, avx.as_mut_ptr().add(4 * 19), 19, 1, 19);
                    for r in 8..13 {
                        avx2::dot_rows::<1>(&us[r..], &p, avx.as_mut_ptr().add(r * 19), 19, 1, 19);
                    }
                }
                assert_eq!(
                    avx, got,
                    "{ty:?}: AVX2 kernel differs from the scalar model"
                );
            }
        }
    }
}
