//! The K-quant row dots (Q2_K..Q6_K against Q8_K activations), each in the float order of
//! ggml's AVX2 kernel of the same type.

use super::*;

/// Q4_K / Q5_K scales: 8 six-bit scales then 8 six-bit mins, as ggml's `utmp` shuffle.
#[inline]
pub(super) fn k4_scales_mins(s: &[u8]) -> [u32; 4] {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let mut u = [w(0), w(1), w(2), 0];
    u[3] = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
    let uaux = u[1] & KMASK1;
    u[1] = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
    u[2] = uaux;
    u[0] &= KMASK1;
    u
}

/// i16 lanes 0..15 all = scale pair selector for `get_scale_shuffle_k4(i)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn shuffle_k4(i: usize) -> __m256i {
    let b = (2 * i) as i8;
    let pair = (b as u8 as i16) | (((b + 1) as u8 as i16) << 8);
    _mm256_set1_epi16(pair)
}

/// How far ahead (bytes) the decode kernels prefetch the weight stream: on this project's
/// AMD EPYC it about doubled one-thread decode bandwidth over the hardware prefetcher alone
/// (`tile_bench`'s "from memory" line); 1-2 KiB less or 4 KiB more measured worse.
pub(super) const PF_AHEAD: usize = 4096;

/// Weight rows stream from memory once in decode: ask for the block `PF_AHEAD` bytes on
/// (the rest of this row or the next one) early. A prefetch never faults, even past the end.
#[inline(always)]
pub(super) unsafe fn prefetch_block<const BYTES: usize>(x: *const u8) {
    let mut o = 0;
    while o < BYTES {
        _mm_prefetch::<_MM_HINT_T0>(x.wrapping_add(PF_AHEAD + o) as *const i8);
        o += 64;
    }
}

/// Q8_K block: (d, qs pointer, bsums pointer).
#[inline]
pub(super) unsafe fn q8k(y: *const u8) -> (f32, *const u8, *const u8) {
    ((y as *const f32).read_unaligned(), y.add(4), y.add(260))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q4_k(w: &[u8], a: &[u8]) -> f32 {
    let nb = w.len() / 144;
    let m4 = _mm256_set1_epi8(0xF);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for i in 0..nb {
        let x = w.as_ptr().add(144 * i);
        prefetch_block::<144>(x);
        let (yd, mut q8, bsums) = q8k(a.as_ptr().add(292 * i));
        let d = yd * h2f(x);
        let dmin = -yd * h2f(x.add(2));
        let u = k4_scales_mins(&w[144 * i + 4..144 * i + 16]);
        let mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(
            u[3] as i32,
            u[2] as i32,
            u[1] as i32,
            u[0] as i32,
        ));
        let q8sums = loadu(bsums);
        let q8s = _mm_hadd_epi16(
            _mm256_extracti128_si256(q8sums, 0),
            _mm256_extracti128_si256(q8sums, 1),
        );
        let prod = _mm_madd_epi16(_mm256_extracti128_si256(mins_and_scales, 1), q8s);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);
        let sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
        let scales = _mm256_set_m128i(sc128, sc128);
        let mut sumi = _mm256_setzero_si256();
        let mut q4 = x.add(16);
        for j in 0..4 {
            let scale_l = _mm256_shuffle_epi8(scales, shuffle_k4(2 * j));
            let scale_h = _mm256_shuffle_epi8(scales, shuffle_k4(2 * j + 1));
            let bits = loadu(q4);
            q4 = q4.add(32);
            let q4l = _mm256_and_si256(bits, m4);
            let q4h = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            let p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, loadu(q8)));
            let p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, loadu(q8.add(32))));
            q8 = q8.add(64);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    hsum_float_8(acc) + _mm_cvtss_f32(acc_m)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q5_k(w: &[u8], a: &[u8]) -> f32 {
    let nb = w.len() / 176;
    let m4 = _mm256_set1_epi8(0xF);
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0.0f32;
    for i in 0..nb {
        let x = w.as_ptr().add(176 * i);
        prefetch_block::<176>(x);
        let (yd, mut q8, bsums) = q8k(a.as_ptr().add(292 * i));
        let d = yd * h2f(x);
        let dmin = -yd * h2f(x.add(2));
        let u = k4_scales_mins(&w[176 * i + 4..176 * i + 16]);
        let mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(
            u[3] as i32,
            u[2] as i32,
            u[1] as i32,
            u[0] as i32,
        ));
        let q8sums = loadu(bsums);
        let q8s = _mm_hadd_epi16(
            _mm256_extracti128_si256(q8sums, 0),
            _mm256_extracti128_si256(q8sums, 1),
        );
        let prod = _mm_madd_epi16(_mm256_extracti128_si256(mins_and_scales, 1), q8s);
        let z = _mm_setzero_si128();
        let hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, z), z);
        summs = dmin.mul_add(_mm_cvtsi128_si32(hsum) as f32, summs);
        let sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
        let scales = _mm256_set_m128i(sc128, sc128);
        let hbits = loadu(x.add(16));
        let mut q5 = x.add(48);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            let bits = loadu(q5);
            q5 = q5.add(32);
            let h0 = _mm256_and_si256(srl16(hbits, (2 * j) as i32), _mm256_set1_epi8(1));
            let h1 = _mm256_and_si256(srl16(hbits, (2 * j + 1) as i32), _mm256_set1_epi8(1));
            let q5_0 = _mm256_or_si256(_mm256_and_si256(bits, m4), _mm256_slli_epi16(h0, 4));
            let q5_1 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4),
                _mm256_slli_epi16(h1, 4),
            );
            let p0 = _mm256_madd_epi16(
                _mm256_shuffle_epi8(scales, shuffle_k4(2 * j)),
                _mm256_maddubs_epi16(q5_0, loadu(q8)),
            );
            let p1 = _mm256_madd_epi16(
                _mm256_shuffle_epi8(scales, shuffle_k4(2 * j + 1)),
                _mm256_maddubs_epi16(q5_1, loadu(q8.add(32))),
            );
            q8 = q8.add(64);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_float_8(acc) + summs
}

/// i16 lanes 0..7 = scale 2i, lanes 8..15 = scale 2i+1 of a 16-scale i16 vector pair
/// (`get_scale_shuffle_q3k`, applied to a duplicated 8-scale half).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn shuffle_q3k(i: usize) -> __m256i {
    let lo = (2 * (2 * i)) as i16;
    let hi = (2 * (2 * i + 1)) as i16;
    let plo = (lo & 0xFF) | ((lo + 1) << 8);
    let phi = (hi & 0xFF) | ((hi + 1) << 8);
    _mm256_set_m128i(_mm_set1_epi16(phi), _mm_set1_epi16(plo))
}

/// Byte shuffles picking scale 2i eight times, then scale 2i+1 eight times (`get_scale_shuffle`).
pub(super) static SCALE_PAIRS: [[u8; 16]; 8] = {
    let mut t = [[0u8; 16]; 8];
    let mut i = 0;
    while i < 8 {
        let mut b = 0;
        while b < 16 {
            t[i][b] = (2 * i + b / 8) as u8;
            b += 1;
        }
        i += 1;
    }
    t
};

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q6_k(w: &[u8], a: &[u8]) -> f32 {
    let nb = w.len() / 210;
    let m3 = _mm256_set1_epi8(3);
    let m15 = _mm256_set1_epi8(15);
    let mut acc = _mm256_setzero_ps();
    for i in 0..nb {
        let x = w.as_ptr().add(210 * i);
        prefetch_block::<210>(x);
        let (yd, mut q8, bsums) = q8k(a.as_ptr().add(292 * i));
        let d = yd * h2f(x.add(208));
        let mut q4 = x;
        let mut qh = x.add(128);
        let scales = _mm_loadu_si128(x.add(192) as *const __m128i);
        let scales16 = _mm256_cvtepi8_epi16(scales);
        let q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(loadu(bsums), scales16), 5);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..2 {
            let b1 = loadu(q4);
            let b2 = loadu(q4.add(32));
            let bh = loadu(qh);
            q4 = q4.add(64);
            qh = qh.add(32);
            let h0 = _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4);
            let h1 = _mm256_slli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(12)), 2);
            let h2 = _mm256_and_si256(bh, _mm256_set1_epi8(48));
            let h3 = _mm256_srli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(-64)), 2);
            let q = [
                _mm256_or_si256(_mm256_and_si256(b1, m15), h0),
                _mm256_or_si256(_mm256_and_si256(b2, m15), h1),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m15), h2),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m15), h3),
            ];
            for (c, qc) in q.iter().enumerate() {
                let p16 = _mm256_maddubs_epi16(*qc, loadu(q8.add(32 * c)));
                // scales 8j+2c (bytes 0..15) and 8j+2c+1 (bytes 16..31)
                let pick = _mm_loadu_si128(SCALE_PAIRS[4 * j + c].as_ptr() as *const __m128i);
                let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sc, p16));
            }
            q8 = q8.add(128);
        }
        sumi = _mm256_sub_epi32(sumi, q8sclsub);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_float_8(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q2_k(w: &[u8], a: &[u8]) -> f32 {
    let nb = w.len() / 84;
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0xF);
    let mut acc = _mm256_setzero_ps();
    for i in 0..nb {
        let x = w.as_ptr().add(84 * i);
        let (yd, mut q8, bsums) = q8k(a.as_ptr().add(292 * i));
        let d = yd * h2f(x.add(80));
        let dmin = -yd * h2f(x.add(82));
        let ms = _mm_loadu_si128(x as *const __m128i);
        let scales8 = _mm_and_si128(ms, m4);
        let mins8 = _mm_and_si128(_mm_srli_epi16(ms, 4), m4);
        let prod = _mm256_madd_epi16(_mm256_cvtepi8_epi16(mins8), loadu(bsums));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), acc);
        let all = _mm256_cvtepi8_epi16(scales8);
        let (l, h) = (
            _mm256_extracti128_si256(all, 0),
            _mm256_extracti128_si256(all, 1),
        );
        let scales = [_mm256_set_m128i(l, l), _mm256_set_m128i(h, h)];
        let mut q2 = x.add(16);
        let mut sumi = _mm256_setzero_si256();
        for sc in scales {
            let bits = loadu(q2);
            q2 = q2.add(32);
            for c in 0..4 {
                let q = _mm256_and_si256(srl16(bits, (2 * c) as i32), m3);
                let p = _mm256_maddubs_epi16(q, loadu(q8.add(32 * c)));
                sumi = _mm256_add_epi32(
                    sumi,
                    _mm256_madd_epi16(_mm256_shuffle_epi8(sc, shuffle_q3k(c)), p),
                );
            }
            q8 = q8.add(128);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_float_8(acc)
}

/// The 16 Q3_K scales minus 32, as bytes (ggml's `aux` shuffle).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn q3_k_scales128(p: *const u8) -> __m128i {
    const KMASK1: u32 = 0x03030303;
    const KMASK2: u32 = 0x0f0f0f0f;
    let aux = |i: usize| unsafe { (p.add(4 * i) as *const u32).read_unaligned() };
    let (a0, a1, a2) = (aux(0), aux(1), aux(2));
    let s = _mm_set_epi32(
        (((a1 >> 4) & KMASK2) | (((a2 >> 6) & KMASK1) << 4)) as i32,
        (((a0 >> 4) & KMASK2) | (((a2 >> 4) & KMASK1) << 4)) as i32,
        ((a1 & KMASK2) | (((a2 >> 2) & KMASK1) << 4)) as i32,
        ((a0 & KMASK2) | ((a2 & KMASK1) << 4)) as i32,
    );
    _mm_sub_epi8(s, _mm_set1_epi8(32))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q3_k(w: &[u8], a: &[u8]) -> f32 {
    let nb = w.len() / 110;
    let m3 = _mm256_set1_epi8(3);
    let mut acc = _mm256_setzero_ps();
    for i in 0..nb {
        let x = w.as_ptr().add(110 * i);
        let (yd, mut q8, _) = q8k(a.as_ptr().add(292 * i));
        let d = yd * h2f(x.add(108));
        let all = _mm256_cvtepi8_epi16(q3_k_scales128(x.add(96)));
        let (l, h) = (
            _mm256_extracti128_si256(all, 0),
            _mm256_extracti128_si256(all, 1),
        );
        let scales = [_mm256_set_m128i(l, l), _mm256_set_m128i(h, h)];
        let hbits = loadu(x);
        let mut q3 = x.add(32);
        let mut sumi = _mm256_setzero_si256();
        for (j, sc) in scales.iter().enumerate() {
            let bits = loadu(q3);
            q3 = q3.add(32);
            for c in 0..4 {
                let bit = (4 * j + c) as i32;
                let ql = _mm256_and_si256(srl16(bits, (2 * c) as i32), m3);
                // 4 where the high bit is clear, 0 where set
                let hb = _mm256_and_si256(srl16(hbits, bit), _mm256_set1_epi8(1));
                let qh = _mm256_slli_epi16(_mm256_xor_si256(hb, _mm256_set1_epi8(1)), 2);
                let y = loadu(q8.add(32 * c));
                let p = _mm256_sub_epi16(_mm256_maddubs_epi16(ql, y), _mm256_maddubs_epi16(qh, y));
                sumi = _mm256_add_epi32(
                    sumi,
                    _mm256_madd_epi16(_mm256_shuffle_epi8(*sc, shuffle_q3k(c)), p),
                );
            }
            q8 = q8.add(128);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_float_8(acc)
}
