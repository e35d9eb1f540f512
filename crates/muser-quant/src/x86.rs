//! AVX2 kernels (x86_64), chosen at run time. Each one follows the float arithmetic of the
//! matching ggml x86 kernel (see `scalar`), so it returns the same bits as the scalar reference.
//! The integer parts use `vpmaddubsw`/`vpmaddwd`; the result per 32-bit lane is exact, so the
//! VNNI form (`vpdpbusd`) that ggml's AVX512-VNNI build uses gives the same lanes.

use std::arch::x86_64::*;

use crate::{GgmlType, Isa};

mod kquant;
use kquant::*;

pub(crate) fn detect() -> Isa {
    if !(is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c"))
    {
        return Isa::Scalar;
    }
    if is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
    {
        return Isa::Avx512;
    }
    Isa::Avx2
}

/// The SIMD dot for `ty` (rows already checked and cut to length), or `None` when only the
/// scalar kernel exists. `isa` is at least `Avx2` and present on this CPU.
pub(crate) fn vec_dot(isa: Isa, ty: GgmlType, w: &[u8], a: &[u8]) -> Option<f32> {
    macro_rules! bytes {
        ($f:ident) => {
            if isa == Isa::Avx512 {
                vnni::$f(w, a)
            } else {
                avx2::$f(w, a)
            }
        };
    }
    // SAFETY: the caller checked that this CPU has AVX2, FMA and F16C (and AVX512-VNNI/VL for
    // `Isa::Avx512`), and the row lengths.
    unsafe {
        Some(match ty {
            GgmlType::Q4_0 => bytes!(dot_q4_0),
            GgmlType::Q5_0 => bytes!(dot_q5_0),
            GgmlType::Q8_0 => bytes!(dot_q8_0),
            GgmlType::Q4_1 => bytes!(dot_q4_1),
            GgmlType::Q5_1 => bytes!(dot_q5_1),
            GgmlType::NVFP4 => bytes!(dot_nvfp4),
            GgmlType::MXFP4 => bytes!(dot_mxfp4),
            GgmlType::Q4_K => dot_q4_k(w, a),
            GgmlType::Q5_K => dot_q5_k(w, a),
            GgmlType::Q6_K => dot_q6_k(w, a),
            GgmlType::Q2_K => dot_q2_k(w, a),
            GgmlType::Q3_K => dot_q3_k(w, a),
            GgmlType::F32 => dot_f32(w, a),
            GgmlType::F16 => dot_f16(w, a),
            GgmlType::BF16 => dot_bf16(w, a),
            _ => return None,
        })
    }
}

/// The f16 at `p` as f32, from a table like ggml's: one load, and no vector insert (LLVM's
/// `vpinsrw` into a live register made the conversion depend on the accumulator, which
/// serialized whole kernels).
#[inline(always)]
unsafe fn h2f(p: *const u8) -> f32 {
    *crate::fp::F16_TABLE.get_unchecked((p as *const u16).read_unaligned() as usize)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum_float_8(x: __m256) -> f32 {
    let mut r = _mm256_extractf128_ps(x, 1);
    r = _mm_add_ps(r, _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn loadu(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// 32 nibbles → 32 bytes: low nibbles of the 16 bytes first, then the high nibbles.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bytes_from_nibbles_32(p: *const u8) -> __m256i {
    let tmp = _mm_loadu_si128(p as *const __m128i);
    let bytes = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
    _mm256_and_si256(bytes, _mm256_set1_epi8(0xF))
}

/// 32 bits → 32 bytes of 0x00 / 0xFF.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    let x32 = (p as *const u32).read_unaligned();
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32 as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Variable logical right shift of 16-bit lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn srl16(x: __m256i, count: i32) -> __m256i {
    _mm256_srl_epi16(x, _mm_cvtsi32_si128(count))
}

const K_Q4_0: u8 = 0;
const K_Q5_0: u8 = 1;
const K_Q8_0: u8 = 2;
const K_Q4_1: u8 = 3;
const K_Q5_1: u8 = 4;

/// The 32 quant bytes of a Q4_0/Q5_0/Q8_0 (signed) or Q4_1/Q5_1 (unsigned) block at `x`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_values<const K: u8>(x: *const u8) -> __m256i {
    match K {
        K_Q4_0 => _mm256_sub_epi8(bytes_from_nibbles_32(x.add(2)), _mm256_set1_epi8(8)),
        K_Q5_0 => {
            let hi =
                _mm256_andnot_si256(bytes_from_bits_32(x.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
            _mm256_or_si256(bytes_from_nibbles_32(x.add(6)), hi)
        }
        K_Q8_0 => loadu(x.add(2)),
        K_Q4_1 => bytes_from_nibbles_32(x.add(4)),
        _ => {
            let hi = _mm256_and_si256(bytes_from_bits_32(x.add(4)), _mm256_set1_epi8(0x10));
            _mm256_or_si256(bytes_from_nibbles_32(x.add(8)), hi)
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn fp4_table() -> __m128i {
    _mm_loadu_si128(crate::fp::KVALUES_FP4.as_ptr() as *const __m128i)
}

/// `e8m0_half` of every byte (`ggml_table_f32_e8m0_half`).
static E8M0_HALF: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut e = 0;
    while e < 256 {
        t[e] = crate::fp::e8m0_half(e as u8);
        e += 1;
    }
    t
};

/// `ue4m3_half` of every byte (ggml's CPU build looks it up in `ggml_table_f32_ue4m3` too).
static UE4M3_HALF: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut x = 0;
    while x < 256 {
        t[x] = crate::fp::ue4m3_half(x as u8);
        x += 1;
    }
    t
};

/// The kernels whose integer core is "u8 × i8, summed in fours": stamped out once for AVX2
/// (`vpmaddubsw` + `vpmaddwd`) and once for AVX512-VNNI (`vpdpbusd` on 256-bit registers, as
/// ggml's AVX512-VNNI build does). Both give the same lanes, so the same bits.
macro_rules! byte_dot_kernels {
    ($module:ident, $features:literal, $mul_sum_us8:item) => {
        mod $module {
            use super::*;

            /// Unsigned × signed bytes, summed in fours into eight i32 lanes, as f32.
            #[target_feature(enable = $features)]
            #[inline]
            $mul_sum_us8

            /// Signed × signed bytes, summed in fours into eight i32 lanes, as f32.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256 {
                mul_sum_us8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
            }

        /// Weight blocks of 32 signed values (`ts` bytes each) against Q8_0.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn dot_32_q8_0<const K: u8>(w: &[u8], a: &[u8], ts: usize) -> f32 {
            let nb = a.len() / 34;
            let (wp, ap) = (w.as_ptr(), a.as_ptr());
            let mut acc = _mm256_setzero_ps();
            for i in 0..nb {
                let (x, y) = (wp.add(i * ts), ap.add(i * 34));
                _mm_prefetch::<_MM_HINT_T0>(x.wrapping_add(PF_AHEAD) as *const i8);
                let d = _mm256_set1_ps(h2f(x) * h2f(y));
                let q = mul_sum_i8(block_values::<K>(x), loadu(y.add(2)));
                acc = _mm256_fmadd_ps(d, q, acc);
            }
            hsum_float_8(acc)
        }

        #[target_feature(enable = $features)]
        pub(super) unsafe fn dot_q4_0(w: &[u8], a: &[u8]) -> f32 {
            dot_32_q8_0::<K_Q4_0>(w, a, 18)
        }

        #[target_feature(enable = $features)]
        pub(super) unsafe fn dot_q8_0(w: &[u8], a: &[u8]) -> f32 {
            dot_32_q8_0::<K_Q8_0>(w, a, 34)
        }

        #[target_feature(enable = $features)]
        pub(super) unsafe fn dot_q5_0(w: &[u8], a: &[u8]) -> f32 {
            dot_32_q8_0::<K_Q5_0>(w, a, 22)
        }

        /// Weight blocks of 32 unsigned values with a min against Q8_1.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn dot_32_q8_1<const K: u8>(w: &[u8], a: &[u8], ts: usize) -> f32 {
            let nb = a.len() / 36;
            let (wp, ap) = (w.as_ptr(), a.as_ptr());
            let mut acc = _mm256_setzero_ps();
            let mut summs = 0.0f32;
            for i in 0..nb {
                let (x, y) = (wp.add(i * ts), ap.add(i * 36));
                _mm_prefetch::<_MM_HINT_T0>(x.wrapping_add(PF_AHEAD) as *const i8);
                let d = _mm256_set1_ps(h2f(x) * h2f(y));
                summs = h2f(x.add(2)).mul_add(h2f(y.add(2)), summs);
                let q = mul_sum_us8(block_values::<K>(x), loadu(y.add(4)));
                acc = _mm256_fmadd_ps(d, q, acc);
            }
            hsum_float_8(acc) + summs
        }

        #[target_feature(enable = $features)]
        pub(super) unsafe fn dot_q4_1(w: &[u8], a: &[u8]) -> f32 {
            dot_32_q8_1::<K_Q4_1>(w, a, 20)
        }

        #[target_feature(enable = $features)]
        pub(super) unsafe fn dot_q5_1(w: &[u8], a: &[u8]) -> f32 {
            dot_32_q8_1::<K_Q5_1>(w, a, 24)
        }

        #[target_feature(enable = $features)]
        pub(super) unsafe fn dot_nvfp4(w: &[u8], a: &[u8]) -> f32 {
            let nb = w.len() / 36;
            let (wp, ap) = (w.as_ptr(), a.as_ptr());
            let table = fp4_table();
            let m4 = _mm_set1_epi8(0xF);
            let mut acc = _mm256_setzero_ps();
            for i in 0..nb {
                let x = wp.add(36 * i);
                for half in 0..2 {
                    let y = ap.add(68 * i + 34 * half);
                    let bits = _mm_loadu_si128(x.add(4 + 16 * half) as *const __m128i);
                    let lo = _mm_shuffle_epi8(table, _mm_and_si128(bits, m4));
                    let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bits, 4), m4));
                    let q4 = _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
                    let p = mul_sum_i8(q4, loadu(y.add(2)));
                    let dy = h2f(y);
                    let s0 = UE4M3_HALF[*x.add(2 * half) as usize] * dy;
                    let s1 = UE4M3_HALF[*x.add(2 * half + 1) as usize] * dy;
                    let scales = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
                    acc = _mm256_fmadd_ps(scales, p, acc);
                }
            }
            hsum_float_8(acc)
        }

        #[target_feature(enable = $features)]
        pub(super) unsafe fn dot_mxfp4(w: &[u8], a: &[u8]) -> f32 {
            let nb = w.len() / 17;
            let (wp, ap) = (w.as_ptr(), a.as_ptr());
            let table = fp4_table();
            let m4 = _mm_set1_epi8(0xF);
            let block = |i: usize| unsafe {
                let (x, y) = (wp.add(17 * i), ap.add(34 * i));
                let bits = _mm_loadu_si128(x.add(1) as *const __m128i);
                let q4 = _mm256_set_m128i(
                    _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bits, 4), m4)),
                    _mm_shuffle_epi8(table, _mm_and_si128(bits, m4)),
                );
                (_mm256_set1_ps(h2f(y) * E8M0_HALF[*x as usize]), mul_sum_i8(q4, loadu(y.add(2))))
            };
            // ggml: blocks alternate between two accumulators, summed before the reduction
            let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 1 < nb {
                let (d0, p0) = block(i);
                let (d1, p1) = block(i + 1);
                acc0 = _mm256_fmadd_ps(d0, p0, acc0);
                acc1 = _mm256_fmadd_ps(d1, p1, acc1);
                i += 2;
            }
            let mut sumf = hsum_float_8(_mm256_add_ps(acc0, acc1));
            if i < nb {
                // the odd last block in ggml's scalar tail: sumf += d·Σ, fused
                let (x, y) = (&w[17 * i..17 * i + 17], &a[34 * i..34 * i + 34]);
                let d = h2f(y.as_ptr()) * E8M0_HALF[x[0] as usize];
                sumf = d.mul_add(crate::scalar::fp4_block_sum(&x[1..], &y[2..]) as f32, sumf);
            }
            sumf
        }

        }
    };
}

byte_dot_kernels!(
    avx2,
    "avx2,fma,f16c",
    unsafe fn mul_sum_us8(ax: __m256i, sy: __m256i) -> __m256 {
        let dot = _mm256_maddubs_epi16(ax, sy);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), dot))
    }
);

byte_dot_kernels!(
    vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    unsafe fn mul_sum_us8(ax: __m256i, sy: __m256i) -> __m256 {
        // `vpdpbusd` through asm: the intrinsic needs Rust 1.89 (MSRV is 1.85). `{evex}` pins the
        // AVX512-VNNI encoding: the VEX one (AVX-VNNI) is what kills ggml's build on hosts
        // without AVX-VNNI.
        let mut acc = _mm256_setzero_si256();
        std::arch::asm!(
            "{{evex}} vpdpbusd {acc}, {a}, {b}",
            acc = inout(ymm_reg) acc,
            a = in(ymm_reg) ax,
            b = in(ymm_reg) sy,
            options(pure, nomem, nostack)
        );
        _mm256_cvtepi32_ps(acc)
    }
);

/// Eight f32 lanes from `p` (f32 elements, or f16 when `HALF`), element offset `e`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<const HALF: bool>(p: *const u8, e: usize) -> __m256 {
    if HALF {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * e) as *const __m128i))
    } else {
        _mm256_loadu_ps(p.add(4 * e) as *const f32)
    }
}

/// ggml's AVX512 float loop (four 16-lane accumulators, 64 values a step) on eight 8-lane
/// registers: accumulator j lanes 0..7 in `acc[2j]`, lanes 8..15 in `acc[2j+1]`.
/// Returns the reduced sum and how many values it covered.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_floats<const HALF: bool>(w: &[u8], a: &[u8], n: usize) -> (f32, usize) {
    let np = n & !63;
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut i = 0;
    while i < np {
        for (r, accr) in acc.iter_mut().enumerate() {
            let e = i + 8 * r;
            *accr = _mm256_fmadd_ps(load8::<HALF>(wp, e), load8::<HALF>(ap, e), *accr);
        }
        i += 64;
    }
    // x0 += x2, x1 += x3, x0 += x1 (16-lane registers = pairs of 8-lane ones)
    for h in 0..2 {
        acc[h] = _mm256_add_ps(acc[h], acc[4 + h]);
        acc[2 + h] = _mm256_add_ps(acc[2 + h], acc[6 + h]);
        acc[h] = _mm256_add_ps(acc[h], acc[2 + h]);
    }
    (reduce16(acc[0], acc[1]), np)
}

/// GCC's `_mm512_reduce_add_ps` of the 16 lanes `lo` (0..7) and `hi` (8..15):
/// t = hi + lo, then 4 + 4, then (t0+t2) + (t1+t3).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn reduce16(lo: __m256, hi: __m256) -> f32 {
    let t3 = _mm256_add_ps(hi, lo);
    let t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    let t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
    _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)))
}

/// `vdpbf16ps` on eight lanes (16 bf16 values of `w` and `a` at `p`, `q`): each lane adds the
/// odd product, then the even one (both exact in f32).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dpbf16(acc: __m256, p: *const u8, q: *const u8) -> __m256 {
    let (x, y) = (loadu(p), loadu(q));
    let hi = _mm256_set1_epi32(0xFFFF0000u32 as i32);
    let odd = _mm256_mul_ps(
        _mm256_castsi256_ps(_mm256_and_si256(x, hi)),
        _mm256_castsi256_ps(_mm256_and_si256(y, hi)),
    );
    let even = _mm256_mul_ps(
        _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)),
        _mm256_castsi256_ps(_mm256_slli_epi32(y, 16)),
    );
    _mm256_add_ps(_mm256_add_ps(acc, odd), even)
}

/// ggml's AVX512-BF16 loop: two 16-lane `vdpbf16ps` accumulators over 64 values a step, each
/// reduced on its own into an f64 sum, then the rest in f64.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_bf16(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len() / 2;
    let np = n / 64 * 64;
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mut c = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < np {
        for (r, cr) in c.iter_mut().enumerate() {
            *cr = dpbf16(*cr, wp.add(2 * (i + 16 * r)), ap.add(2 * (i + 16 * r)));
        }
        i += 64;
    }
    let mut sum = reduce16(c[0], c[1]) as f64;
    sum += reduce16(c[2], c[3]) as f64;
    for e in np..n {
        let x = crate::fp::bf16_to_f32(u16::from_le_bytes([w[2 * e], w[2 * e + 1]]));
        let y = crate::fp::bf16_to_f32(u16::from_le_bytes([a[2 * e], a[2 * e + 1]]));
        sum += (x * y) as f64;
    }
    sum as f32
}

/// llama.cpp's prompt-matmul order (`scalar::vec_dot_gemm`) for F32, F16 and BF16.
pub(crate) fn vec_dot_gemm(ty: GgmlType, w: &[u8], a: &[u8]) -> Option<f32> {
    // SAFETY: the caller checked AVX2/FMA/F16C and the row lengths.
    unsafe {
        Some(match ty {
            GgmlType::F32 => gemm_floats::<false>(w, a, w.len() / 4),
            GgmlType::F16 => gemm_floats::<true>(w, a, w.len() / 2),
            GgmlType::BF16 => gemm_bf16(w, a),
            _ => return None,
        })
    }
}

/// One 16-lane accumulator, 16 values a step, the tail zero-padded.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm_floats<const HALF: bool>(w: &[u8], a: &[u8], n: usize) -> f32 {
    let width = if HALF { 2 } else { 4 };
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let n16 = n / 16 * 16;
    let mut l = 0;
    while l < n16 {
        lo = _mm256_fmadd_ps(load8::<HALF>(wp, l), load8::<HALF>(ap, l), lo);
        hi = _mm256_fmadd_ps(load8::<HALF>(wp, l + 8), load8::<HALF>(ap, l + 8), hi);
        l += 16;
    }
    if n16 < n {
        let (mut tw, mut ta) = ([0u8; 64], [0u8; 64]);
        let rest = (n - n16) * width;
        tw[..rest].copy_from_slice(&w[n16 * width..]);
        ta[..rest].copy_from_slice(&a[n16 * width..]);
        lo = _mm256_fmadd_ps(
            load8::<HALF>(tw.as_ptr(), 0),
            load8::<HALF>(ta.as_ptr(), 0),
            lo,
        );
        hi = _mm256_fmadd_ps(
            load8::<HALF>(tw.as_ptr(), 8),
            load8::<HALF>(ta.as_ptr(), 8),
            hi,
        );
    }
    reduce16(lo, hi)
}

/// One 16-lane `vdpbf16ps` accumulator, 32 values a step, the tail zero-padded.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm_bf16(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len() / 2;
    let n32 = n / 32 * 32;
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut l = 0;
    while l < n32 {
        lo = dpbf16(lo, wp.add(2 * l), ap.add(2 * l));
        hi = dpbf16(hi, wp.add(2 * l + 32), ap.add(2 * l + 32));
        l += 32;
    }
    if n32 < n {
        let (mut tw, mut ta) = ([0u8; 64], [0u8; 64]);
        let rest = (n - n32) * 2;
        tw[..rest].copy_from_slice(&w[2 * n32..]);
        ta[..rest].copy_from_slice(&a[2 * n32..]);
        lo = dpbf16(lo, tw.as_ptr(), ta.as_ptr());
        hi = dpbf16(hi, tw.as_ptr().add(32), ta.as_ptr().add(32));
    }
    reduce16(lo, hi)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len() / 4;
    let (mut sum, np) = dot_floats::<false>(w, a, n);
    let (wp, ap) = (w.as_ptr() as *const f32, a.as_ptr() as *const f32);
    for e in np..n {
        // GCC vectorizes the products of ggml's leftover loop: no fused multiply-add there
        sum += wp.add(e).read_unaligned() * ap.add(e).read_unaligned();
    }
    sum
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len() / 2;
    let (sum, np) = dot_floats::<true>(w, a, n);
    let mut sum = sum as f64;
    for e in np..n {
        sum += (h2f(w.as_ptr().add(2 * e)) * h2f(a.as_ptr().add(2 * e))) as f64;
    }
    sum as f32
}

/// The integer core of the tile kernels on AVX512-VNNI: `vpdpbusd` on unsigned weight
/// values, the signed formats' offset taken back out of the lanes' start value.
mod tile_core_vnni {
    use super::*;

    /// Unsigned block values (32 bytes, 0..=31) of a Q4_0/Q5_0/Q8_0/Q4_1/Q5_1 block at `x`:
    /// the signed formats are offset (Q4_0 by 8, Q5_0 by 16, Q8_0 by 128) and the offset is
    /// taken back out of the integer sums (see [`bias`]).
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    #[inline]
    pub(super) unsafe fn weights<const K: u8>(x: *const u8) -> __m256i {
        match K {
            K_Q4_0 => bytes_from_nibbles_32(x.add(2)),
            K_Q5_0 => {
                let hi = _mm256_and_si256(bytes_from_bits_32(x.add(2)), _mm256_set1_epi8(0x10));
                _mm256_or_si256(bytes_from_nibbles_32(x.add(6)), hi)
            }
            K_Q8_0 => _mm256_xor_si256(loadu(x.add(2)), _mm256_set1_epi8(-128)),
            _ => block_values::<K>(x),
        }
    }

    /// The offset of [`weights`] for the signed formats.
    const fn offset(k: u8) -> i32 {
        match k {
            K_Q4_0 => 8,
            K_Q5_0 => 16,
            K_Q8_0 => 128,
            _ => 0,
        }
    }

    /// `-offset · Σ y` over each group of four bytes: the start value of the integer lanes, so
    /// that `vpdpbusd(bias, u, y) = Σ (u - offset)·y`, exactly the signed product sums.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    #[inline]
    pub(super) unsafe fn bias<const K: u8>(y: __m256i) -> __m256i {
        if offset(K) == 0 {
            return _mm256_setzero_si256();
        }
        let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), y);
        _mm256_mullo_epi32(s, _mm256_set1_epi32(-offset(K)))
    }

    /// The eight i32 lanes of block values `xv` (from [`weights`]) times activations `y`.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    #[inline]
    pub(super) unsafe fn lanes(bias: __m256i, xv: __m256i, y: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(bias, xv, y)
    }
}

/// The integer core of the tile kernels on AVX2: signed values with the sign trick
/// (`vpsignb`, `vpmaddubsw`, `vpmaddwd`), the same lanes as [`tile_core_vnni`].
mod tile_core_avx2 {
    use super::*;

    /// The block values at `x` (signed for Q4_0/Q5_0/Q8_0, unsigned for Q4_1/Q5_1).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn weights<const K: u8>(x: *const u8) -> __m256i {
        block_values::<K>(x)
    }

    /// No offset to take out.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn bias<const K: u8>(_y: __m256i) -> __m256i {
        _mm256_setzero_si256()
    }

    /// The eight i32 lanes of block values `xv` (from [`weights`]) times activations `y`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn lanes<const SIGNED: bool>(
        _bias: __m256i,
        xv: __m256i,
        y: __m256i,
    ) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        if SIGNED {
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(y, xv));
            _mm256_madd_epi16(ones, p)
        } else {
            _mm256_madd_epi16(ones, _mm256_maddubs_epi16(xv, y))
        }
    }
}

/// Multi-row, multi-token kernels for the 32-value byte formats (the per-pair kernels above,
/// reorganized), stamped out for AVX512-VNNI and for AVX2: `R` weight rows × `T` activation
/// rows at a time, so each weight block is unpacked once for `T` tokens and each activation
/// block loaded once for `R` rows. Every output keeps the per-pair kernel's operations in the
/// same order: per block an exact integer lane sum, its f32 conversion, one FMA into eight f32
/// lanes (and for Q8_1 activations one scalar FMA of the mins), then the same final
/// reduction. The integer lanes are the same numbers as ggml's, whatever way they are formed.
macro_rules! tile_kernels {
    ($module:ident, $features:literal, $core:ident, [$($signed:tt)*], [$($unsigned:tt)*]) => {
pub(crate) mod $module {
    use super::*;
    use super::$core as core;
    /// Weight rows `w + r·w_stride` (r < R) against activation rows `a + t·a_stride`
    /// (t < T), `nb` blocks each; writes `out[t·o_stride + r]`. `stream`: the weights come
    /// from memory (prefetch ahead).
    ///
    /// # Safety
    /// AVX2/FMA/F16C/AVX512-VNNI/VL present; every row holds `nb` blocks; the outputs are
    /// writable.
    #[target_feature(enable = $features)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn q8_0<const K: u8, const R: usize, const T: usize>(
        w: *const u8,
        w_stride: usize,
        ts: usize,
        a: *const u8,
        a_stride: usize,
        nb: usize,
        out: *mut f32,
        o_stride: usize,
        stream: bool,
    ) {
        const { assert!(T <= 4) };
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for i in 0..nb {
            let mut dy = [0f32; T];
            let mut yq = [_mm256_setzero_si256(); T];
            let mut yb = [_mm256_setzero_si256(); T];
            for t in 0..T {
                let y = a.add(t * a_stride + 34 * i);
                dy[t] = h2f(y);
                yq[t] = loadu(y.add(2));
                yb[t] = core::bias::<K>(yq[t]);
            }
            // dx·dy for every (row, token): four products per multiply, each broadcast by a
            // load (the same f32 products the per-pair kernel broadcasts)
            let mut dd = [[0f32; 4]; R];
            if T > 1 {
                let mut d4 = [0f32; 4];
                d4[..T].copy_from_slice(&dy);
                let dyv = _mm_loadu_ps(d4.as_ptr());
                for r in 0..R {
                    let x = w.add(r * w_stride + ts * i);
                    _mm_storeu_ps(dd[r].as_mut_ptr(), _mm_mul_ps(_mm_set1_ps(h2f(x)), dyv));
                }
            }
            for r in 0..R {
                let x = w.add(r * w_stride + ts * i);
                prefetch_if(stream, x);
                let xv = core::weights::<K>(x);
                for t in 0..T {
                    let q = _mm256_cvtepi32_ps(core::lanes $($signed)* (yb[t], xv, yq[t]));
                    let d = if T == 1 {
                        _mm256_set1_ps(h2f(x) * dy[0])
                    } else {
                        _mm256_broadcast_ss(&*std::ptr::addr_of!(dd[r][t]))
                    };
                    acc[r][t] = _mm256_fmadd_ps(d, q, acc[r][t]);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                *out.add(t * o_stride + r) = hsum_float_8(acc[r][t]);
            }
        }
    }

    /// As [`q8_0`] for Q4_1/Q5_1 weights against Q8_1 activations (mins summed in f32).
    ///
    /// # Safety
    /// As [`q8_0`].
    #[target_feature(enable = $features)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn q8_1<const K: u8, const R: usize, const T: usize>(
        w: *const u8,
        w_stride: usize,
        ts: usize,
        a: *const u8,
        a_stride: usize,
        nb: usize,
        out: *mut f32,
        o_stride: usize,
        stream: bool,
    ) {
        const { assert!(T <= 4) };
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        // the mins' sums of row r, token t in lane t (one FMA per lane, as the scalar sum)
        let mut summs = [_mm_setzero_ps(); R];
        for i in 0..nb {
            let mut dy = [0f32; 4];
            let mut sy = [0f32; 4];
            let mut yq = [_mm256_setzero_si256(); T];
            for t in 0..T {
                let y = a.add(t * a_stride + 36 * i);
                dy[t] = h2f(y);
                sy[t] = h2f(y.add(2));
                yq[t] = loadu(y.add(4));
            }
            let dyv = _mm_loadu_ps(dy.as_ptr());
            let syv = _mm_loadu_ps(sy.as_ptr());
            // dx·dy for every (row, token): four products per multiply, each broadcast by a
            // load (the same f32 products the per-pair kernel broadcasts)
            let mut dd = [[0f32; 4]; R];
            if T > 1 {
                for r in 0..R {
                    let x = w.add(r * w_stride + ts * i);
                    _mm_storeu_ps(dd[r].as_mut_ptr(), _mm_mul_ps(_mm_set1_ps(h2f(x)), dyv));
                }
            }
            for r in 0..R {
                let x = w.add(r * w_stride + ts * i);
                prefetch_if(stream, x);
                let mx = _mm_set1_ps(h2f(x.add(2)));
                let xv = core::weights::<K>(x);
                summs[r] = _mm_fmadd_ps(mx, syv, summs[r]);
                for t in 0..T {
                    let q = core::lanes $($unsigned)* (_mm256_setzero_si256(), xv, yq[t]);
                    let q = _mm256_cvtepi32_ps(q);
                    let d = if T == 1 {
                        // one token (decode): no table of products
                        _mm256_set1_ps(h2f(x) * dy[0])
                    } else {
                        _mm256_broadcast_ss(&*std::ptr::addr_of!(dd[r][t]))
                    };
                    acc[r][t] = _mm256_fmadd_ps(d, q, acc[r][t]);
                }
            }
        }
        for r in 0..R {
            let mut m = [0f32; 4];
            _mm_storeu_ps(m.as_mut_ptr(), summs[r]);
            for t in 0..T {
                *out.add(t * o_stride + r) = hsum_float_8(acc[r][t]) + m[t];
            }
        }
    }

}
    };
}

tile_kernels!(
    tile_vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    tile_core_vnni,
    [],
    []
);
tile_kernels!(tile_avx2, "avx2,fma,f16c", tile_core_avx2, [::<true>], [::<false>]);

/// The tile kernels on AVX512-VNNI with two weight rows per 512-bit register (one in each
/// 256-bit half, against the token's activations in both): each half is the 256-bit kernel's
/// eight lanes for its row (the same integer sums, the same `dx·dy` product, the same FMA into
/// its own accumulator), so every output keeps [`tile_vnni`]'s bits with half the
/// instructions.
mod tile_zmm {
    use super::*;

    /// As [`tile_vnni::q8_0`]; four weight rows go through the 512-bit pairs, other counts
    /// through the 256-bit kernel.
    ///
    /// # Safety
    /// As [`tile_vnni::q8_0`], with AVX512F/DQ/BW.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vnni,avx512vl")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn q8_0<const K: u8, const R: usize, const T: usize>(
        w: *const u8,
        w_stride: usize,
        ts: usize,
        a: *const u8,
        a_stride: usize,
        nb: usize,
        out: *mut f32,
        o_stride: usize,
        stream: bool,
    ) {
        if R != 4 {
            return tile_vnni::q8_0::<K, R, T>(
                w, w_stride, ts, a, a_stride, nb, out, o_stride, stream,
            );
        }
        const { assert!(T <= 4) };
        let mut acc = [[_mm512_setzero_ps(); T]; 2];
        for i in 0..nb {
            let mut dy = [0f32; T];
            let mut yq = [_mm512_setzero_si512(); T];
            let mut yb = [_mm512_setzero_si512(); T];
            for t in 0..T {
                let y = a.add(t * a_stride + 34 * i);
                dy[t] = h2f(y);
                let y8 = loadu(y.add(2));
                yq[t] = _mm512_broadcast_i64x4(y8);
                yb[t] = _mm512_broadcast_i64x4(tile_core_vnni::bias::<K>(y8));
            }
            for (p, acc) in acc.iter_mut().enumerate() {
                let x0 = w.add(2 * p * w_stride + ts * i);
                let x1 = x0.add(w_stride);
                prefetch_if(stream, x0);
                prefetch_if(stream, x1);
                let xv = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(tile_core_vnni::weights::<K>(x0)),
                    tile_core_vnni::weights::<K>(x1),
                );
                // row 2p's scale in the low half, row 2p + 1's in the high half
                let dx = _mm512_insertf32x8::<1>(_mm512_set1_ps(h2f(x0)), _mm256_set1_ps(h2f(x1)));
                for t in 0..T {
                    let q = _mm512_dpbusd_epi32(yb[t], xv, yq[t]);
                    let d = _mm512_mul_ps(dx, _mm512_set1_ps(dy[t]));
                    acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), acc[t]);
                }
            }
        }
        for (p, acc) in acc.iter().enumerate() {
            for t in 0..T {
                *out.add(t * o_stride + 2 * p) = hsum_float_8(_mm512_castps512_ps256(acc[t]));
                *out.add(t * o_stride + 2 * p + 1) =
                    hsum_float_8(_mm512_extractf32x8_ps::<1>(acc[t]));
            }
        }
    }

    /// As [`tile_vnni::q8_1`]; four weight rows go through the 512-bit pairs, other counts
    /// through the 256-bit kernel.
    ///
    /// # Safety
    /// As [`tile_vnni::q8_1`], with AVX512F/DQ/BW.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vnni,avx512vl")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn q8_1<const K: u8, const R: usize, const T: usize>(
        w: *const u8,
        w_stride: usize,
        ts: usize,
        a: *const u8,
        a_stride: usize,
        nb: usize,
        out: *mut f32,
        o_stride: usize,
        stream: bool,
    ) {
        if R != 4 {
            return tile_vnni::q8_1::<K, R, T>(
                w, w_stride, ts, a, a_stride, nb, out, o_stride, stream,
            );
        }
        const { assert!(T <= 4) };
        let mut acc = [[_mm512_setzero_ps(); T]; 2];
        // the mins' sums of row r, token t in lane t (one FMA per lane, as the scalar sum)
        let mut summs = [_mm_setzero_ps(); 4];
        for i in 0..nb {
            let mut dy = [0f32; 4];
            let mut sy = [0f32; 4];
            let mut yq = [_mm512_setzero_si512(); T];
            for t in 0..T {
                let y = a.add(t * a_stride + 36 * i);
                dy[t] = h2f(y);
                sy[t] = h2f(y.add(2));
                yq[t] = _mm512_broadcast_i64x4(loadu(y.add(4)));
            }
            let syv = _mm_loadu_ps(sy.as_ptr());
            for (p, acc) in acc.iter_mut().enumerate() {
                let x0 = w.add(2 * p * w_stride + ts * i);
                let x1 = x0.add(w_stride);
                prefetch_if(stream, x0);
                prefetch_if(stream, x1);
                summs[2 * p] = _mm_fmadd_ps(_mm_set1_ps(h2f(x0.add(2))), syv, summs[2 * p]);
                summs[2 * p + 1] = _mm_fmadd_ps(_mm_set1_ps(h2f(x1.add(2))), syv, summs[2 * p + 1]);
                let xv = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(block_values::<K>(x0)),
                    block_values::<K>(x1),
                );
                // row 2p's scale in the low half, row 2p + 1's in the high half
                let dx = _mm512_insertf32x8::<1>(_mm512_set1_ps(h2f(x0)), _mm256_set1_ps(h2f(x1)));
                for t in 0..T {
                    let q = _mm512_dpbusd_epi32(_mm512_setzero_si512(), xv, yq[t]);
                    let d = _mm512_mul_ps(dx, _mm512_set1_ps(dy[t]));
                    acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), acc[t]);
                }
            }
        }
        let mut m = [[0f32; 4]; 4];
        for (r, s) in summs.iter().enumerate() {
            _mm_storeu_ps(m[r].as_mut_ptr(), *s);
        }
        for (p, acc) in acc.iter().enumerate() {
            for t in 0..T {
                let lo = hsum_float_8(_mm512_castps512_ps256(acc[t]));
                let hi = hsum_float_8(_mm512_extractf32x8_ps::<1>(acc[t]));
                *out.add(t * o_stride + 2 * p) = lo + m[2 * p][t];
                *out.add(t * o_stride + 2 * p + 1) = hi + m[2 * p + 1][t];
            }
        }
    }
}

/// A pass that streams its weights from memory (a chunk's first token group) asks for the
/// bytes [`PF_AHEAD`] on early: without it the few-token passes of a speculative
/// verification ran at memory latency, 2-3x slower than the one-token kernel. A prefetch
/// never faults, even past the end.
#[inline(always)]
unsafe fn prefetch_if(stream: bool, x: *const u8) {
    if stream {
        _mm_prefetch::<_MM_HINT_T0>(x.wrapping_add(PF_AHEAD) as *const i8);
    }
}

/// The tile kernel family of `ty`: (Q8_1 activations?, block kind, weight block bytes).
fn tile_kind(ty: GgmlType) -> Option<(bool, u8, usize)> {
    Some(match ty {
        GgmlType::Q4_0 => (false, K_Q4_0, 18),
        GgmlType::Q5_0 => (false, K_Q5_0, 22),
        GgmlType::Q8_0 => (false, K_Q8_0, 34),
        GgmlType::Q4_1 => (true, K_Q4_1, 20),
        GgmlType::Q5_1 => (true, K_Q5_1, 24),
        _ => return None,
    })
}

/// Runs the tile kernels of `isa` over `n_w` weight rows × `n_a` activation rows (4 weight rows
/// × up to 4 tokens at a time, then the rows at the edge), weight rows in chunks that stay in L1/L2 while every token group
/// passes over them. Returns false when `ty` has no tile kernel (nothing written).
///
/// # Safety
/// `isa` (at least AVX2) present; `w` holds `n_w` rows of `nb` blocks at `w_stride`, `a` holds
/// `n_a` rows at `a_stride`, and `out[t·o_stride + r]` is writable for every r < n_w, t < n_a.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_run(
    isa: Isa,
    ty: GgmlType,
    w: *const u8,
    w_stride: usize,
    n_w: usize,
    a: *const u8,
    a_stride: usize,
    n_a: usize,
    nb: usize,
    out: *mut f32,
    o_stride: usize,
) -> bool {
    let Some((q81, k, ts)) = tile_kind(ty) else {
        return false;
    };
    if n_a == 1 {
        // One token (decode): the weights stream from memory once, one row after the other
        // (a single sequential stream for the prefetchers; interleaved rows measured 2-4x
        // slower), through the per-pair kernel, which prefetches ahead.
        let a1 = std::slice::from_raw_parts(a, a_stride);
        for r in 0..n_w {
            let wr = std::slice::from_raw_parts(w.add(r * w_stride), w_stride);
            *out.add(r) = vec_dot(isa, ty, wr, a1).expect("the byte formats have SIMD dots");
        }
        return true;
    }
    macro_rules! run {
        ($m:ident, $f:ident, $k:expr) => {{
            let chunk = (16384 / w_stride.max(1)).clamp(4, 64) & !3;
            for c0 in (0..n_w).step_by(chunk) {
                let c1 = (c0 + chunk).min(n_w);
                let mut t = 0;
                while t < n_a {
                    let at = a.add(t * a_stride);
                    let ot = out.add(t * o_stride);
                    // up to 4 tokens a pass: a verification's 2 or 3 rows share each
                    // unpacked weight block too
                    let n_t = (n_a - t).min(4);
                    let mut r = c0;
                    while r < c1 {
                        let (wr, or) = (w.add(r * w_stride), ot.add(r));
                        let full_r = c1 - r >= 4;
                        // one weight tile of $r rows against $n tokens
                        macro_rules! tile_n {
                            ($r:literal, $n:literal) => {
                                $m::$f::<{ $k }, $r, $n>(
                                    wr,
                                    w_stride,
                                    ts,
                                    at,
                                    a_stride,
                                    nb,
                                    or,
                                    o_stride,
                                    t == 0,
                                )
                            };
                        }
                        macro_rules! tile {
                            ($r:literal) => {
                                match n_t {
                                    4 => tile_n!($r, 4),
                                    3 => tile_n!($r, 3),
                                    2 => tile_n!($r, 2),
                                    _ => tile_n!($r, 1),
                                }
                            };
                        }
                        match full_r {
                            true => tile!(4),
                            false => tile!(1),
                        }
                        r += if full_r { 4 } else { 1 };
                    }
                    t += n_t;
                }
            }
        }};
    }
    macro_rules! run_isa {
        ($m:ident) => {
            match (q81, k) {
                (false, K_Q4_0) => run!($m, q8_0, K_Q4_0),
                (false, K_Q5_0) => run!($m, q8_0, K_Q5_0),
                (false, _) => run!($m, q8_0, K_Q8_0),
                (true, K_Q4_1) => run!($m, q8_1, K_Q4_1),
                (true, _) => run!($m, q8_1, K_Q5_1),
            }
        };
    }
    if isa == Isa::Avx512 {
        run_isa!(tile_zmm)
    } else {
        run_isa!(tile_avx2)
    }
    true
}
