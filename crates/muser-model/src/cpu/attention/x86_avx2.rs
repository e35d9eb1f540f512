//! The AVX2 kernels, in either order. In the AVX512 order: the AVX512 kernels' operations in the
//! same order on eight lanes. In the tiled kernel the lanes are query rows (no lane ever meets
//! another), so eight at a time give the same bits; in the one-chunk kernel the lanes are head
//! dims, so each 16-lane AVX512 accumulator is a pair of registers and reduced by the same tree.
//! In the AVX2 order: ggml's AVX2 `expf`, softmax groups of 8 cells, one register per
//! `vec_dot_f16` accumulator and the `hadd` tree.

use super::{View, TILE_KV, TILE_Q};
use crate::cpu::math::x86_avx2::{reduce_add_16, reduce_hadd_8, v_expf, v_expf_avx2_order};
use crate::cpu::math::LANES;
use crate::cpu::numerics::Order;
use crate::kv::KvType;
use std::arch::x86_64::*;

/// Lanes of a register.
const L: usize = 8;

/// 8 cache values at element `elem` as f32; `round16` rounds F32 values through F16.
#[inline(always)]
unsafe fn load8(buf: &[u8], dtype: KvType, elem: usize, round16: bool) -> __m256 {
    match dtype {
        KvType::F16 => {
            _mm256_cvtph_ps(_mm_loadu_si128(buf.as_ptr().add(elem * 2) as *const __m128i))
        }
        KvType::F32 => {
            let v = _mm256_loadu_ps(buf.as_ptr().add(elem * 4) as *const f32);
            if round16 {
                round_f16(v)
            } else {
                v
            }
        }
    }
}

/// Round to F16 and back (round to nearest even).
#[inline(always)]
unsafe fn round_f16(v: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
}

/// `src` as F16 (round to nearest even, as `f16::from_f32`) into `dst` (2 bytes each).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn store_f16(dst: &mut [u8], src: &[f32]) {
    assert_eq!(dst.len(), src.len() * 2);
    let n = src.len();
    let body = n - n % L;
    let mut i = 0;
    while i < body {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
        _mm_storeu_si128(dst.as_mut_ptr().add(i * 2) as *mut __m128i, h);
        i += L;
    }
    for i in body..n {
        dst[i * 2..i * 2 + 2].copy_from_slice(&half::f16::from_f32(src[i]).to_bits().to_le_bytes());
    }
}

/// A cell's K or V row for kv head `kvh` as f32 (`hd` values, a multiple of 8).
#[inline(always)]
unsafe fn load_row(view: &View, buf: &[u8], c: usize, kvh: usize, out: &mut [f32]) {
    let base = c * view.row + kvh * view.head_dim;
    for (i, o) in out.chunks_exact_mut(L).enumerate() {
        _mm256_storeu_ps(o.as_mut_ptr(), load8(buf, view.dtype, base + i * L, false));
    }
}

/// Lane mask (all ones where bit `l` of `m` is set) of an 8-bit mask.
#[inline(always)]
unsafe fn lanes_of(m: u8) -> __m256 {
    let bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let v = _mm256_and_si256(_mm256_set1_epi32(m as i32), bits);
    _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, bits))
}

#[inline(always)]
unsafe fn mask_of(v: __m256) -> u8 {
    _mm256_movemask_ps(v) as u8
}

/// The tiled kernel for up to 64 query rows: rows in the lanes of eight 8-lane groups.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tiled(
    order: Order,
    view: &View,
    n_kv: usize,
    kvh: usize,
    scale: f32,
    q_rows: &[(&[f32], i32)],
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    for (b, rows) in q_rows.chunks(TILE_Q).enumerate() {
        let mut sub = |r: usize, v: &[f32]| emit(b * TILE_Q + r, v);
        tile(order, view, n_kv, kvh, scale, rows, &mut sub);
    }
}

/// One tile of `nq <= 64` query rows.
#[inline(always)]
unsafe fn tile(
    order: Order,
    view: &View,
    n_kv: usize,
    kvh: usize,
    scale: f32,
    q_rows: &[(&[f32], i32)],
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    const W: usize = TILE_Q; // row stride of the lane-major buffers
    const GMAX: usize = TILE_Q / L;
    let hd = view.head_dim;
    let nq = q_rows.len();
    let ng = nq.div_ceil(L);
    debug_assert!(nq <= TILE_Q);
    // Q transposed: qt[d·W + r].
    let mut qt = vec![0f32; hd * W];
    let mut qpos = [i32::MIN; TILE_Q];
    for (r, (q, p)) in q_rows.iter().enumerate() {
        for d in 0..hd {
            qt[d * W + r] = q[d];
        }
        qpos[r] = *p;
    }
    let qp: [__m256i; GMAX] =
        std::array::from_fn(|g| _mm256_loadu_si256(qpos.as_ptr().add(g * L) as *const _));
    let real: [u8; GMAX] = std::array::from_fn(|g| {
        let n = nq.saturating_sub(g * L).min(L);
        ((1u32 << n) - 1) as u8
    });
    let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); GMAX];
    let mut s = [_mm256_setzero_ps(); GMAX];
    let mut acc = vec![0f32; TILE_Q * hd];
    let mut kf = vec![0f32; TILE_KV * hd];
    let mut vf = vec![0f32; TILE_KV * hd];
    // Scores, lane-major: sc[t·W + r].
    let mut sc = vec![0f32; TILE_KV * W];
    let mut vis = [[0u8; GMAX]; TILE_KV];
    let n_swa = view.n_swa as i32;
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    let zero = _mm256_setzero_ps();
    let vscale = _mm256_set1_ps(scale);
    let mut c0 = 0;
    while c0 < n_kv {
        let nc = TILE_KV.min(n_kv - c0);
        let mut any = false;
        for t in 0..TILE_KV {
            vis[t] = [0; GMAX];
            if t >= nc {
                continue;
            }
            let p = view.cell_pos[c0 + t];
            if p < 0 {
                continue;
            }
            let vp = _mm256_set1_epi32(p);
            for g in 0..ng {
                // p <= q_pos && (n_swa == 0 || q_pos - p < n_swa)
                let le = _mm256_xor_si256(_mm256_cmpgt_epi32(vp, qp[g]), _mm256_set1_epi32(-1));
                let mut k = mask_of(_mm256_castsi256_ps(le)) & real[g];
                if n_swa != 0 {
                    let dist = _mm256_sub_epi32(qp[g], vp);
                    let lt = _mm256_cmpgt_epi32(_mm256_set1_epi32(n_swa), dist);
                    k &= mask_of(_mm256_castsi256_ps(lt));
                }
                vis[t][g] = k;
                any |= k != 0;
            }
        }
        if !any {
            c0 += TILE_KV;
            continue;
        }
        for t in 0..nc {
            load_row(view, view.k, c0 + t, kvh, &mut kf[t * hd..(t + 1) * hd]);
            load_row(view, view.v, c0 + t, kvh, &mut vf[t * hd..(t + 1) * hd]);
        }
        // kq[t] = Σ_d q[d]·k[t][d] (FMA in d order), ·scale, + mask; 8 cells at a time.
        for g in 0..ng {
            let mut t = 0;
            while t < nc {
                let mut a = [zero; 8];
                let kp = kf.as_ptr().add(t * hd);
                let cells = (nc - t).min(8);
                for d in 0..hd {
                    let qv = _mm256_loadu_ps(qt.as_ptr().add(d * W + g * L));
                    for (c, ac) in a.iter_mut().enumerate().take(cells) {
                        *ac = _mm256_fmadd_ps(qv, _mm256_set1_ps(*kp.add(c * hd + d)), *ac);
                    }
                }
                for (c, ac) in a.iter().enumerate().take(cells) {
                    let tc = t + c;
                    let mask = _mm256_blendv_ps(neg_inf, zero, lanes_of(vis[tc][g]));
                    let v = _mm256_add_ps(_mm256_mul_ps(*ac, vscale), mask);
                    _mm256_storeu_ps(sc.as_mut_ptr().add(tc * W + g * L), v);
                }
                t += 8;
            }
        }
        for t in nc..TILE_KV {
            for g in 0..ng {
                _mm256_storeu_ps(sc.as_mut_ptr().add(t * W + g * L), neg_inf);
            }
        }
        // Per row: tile max, rescale on a new maximum, softmax of the tile, sum.
        let mut valid = [0u8; GMAX];
        let mut grow = [0u8; GMAX];
        let mut ms = [[1f32; L]; GMAX];
        for g in 0..ng {
            let mut tmax = neg_inf;
            for t in 0..TILE_KV {
                tmax = _mm256_max_ps(tmax, _mm256_loadu_ps(sc.as_ptr().add(t * W + g * L)));
            }
            valid[g] = mask_of(_mm256_cmp_ps::<_CMP_NEQ_OQ>(tmax, neg_inf)) & real[g];
            let mn = _mm256_max_ps(m[g], tmax);
            grow[g] = mask_of(_mm256_cmp_ps::<_CMP_GT_OQ>(mn, m[g])) & valid[g];
            if grow[g] != 0 {
                let mut mo = [0f32; L];
                let mut mnv = [0f32; L];
                _mm256_storeu_ps(mo.as_mut_ptr(), m[g]);
                _mm256_storeu_ps(mnv.as_mut_ptr(), mn);
                for l in 0..L {
                    if grow[g] >> l & 1 == 1 {
                        ms[g][l] = (mo[l] - mnv[l]).exp();
                    }
                }
                let vms = _mm256_loadu_ps(ms[g].as_ptr());
                s[g] = _mm256_blendv_ps(s[g], _mm256_mul_ps(s[g], vms), lanes_of(grow[g]));
            }
            m[g] = _mm256_blendv_ps(m[g], mn, lanes_of(valid[g]));
            // soft_max_tile: exp(x - max) per 16 cells, each group reduced by the
            // `_mm512_reduce_add_ps` tree (across cells here), the groups summed in f64.
            // (groups of `order.lanes()` cells: 16 in the AVX512 order, 8 in the AVX2 one)
            let mut sum_lo = _mm256_setzero_pd();
            let mut sum_hi = _mm256_setzero_pd();
            let gw = order.lanes();
            for k in 0..TILE_KV / gw {
                let mut v = [zero; LANES];
                for (i, vi) in v[..gw].iter_mut().enumerate() {
                    let at = sc.as_mut_ptr().add((k * gw + i) * W + g * L);
                    let x = _mm256_sub_ps(_mm256_loadu_ps(at), mn);
                    *vi = match order {
                        Order::GgmlAvx512 => v_expf(x),
                        Order::GgmlAvx2 => v_expf_avx2_order(x),
                    };
                    _mm256_storeu_ps(at, *vi);
                }
                let mut w = gw;
                while w > 4 {
                    w /= 2;
                    for i in 0..w {
                        v[i] = _mm256_add_ps(v[i + w], v[i]);
                    }
                }
                let r = _mm256_add_ps(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3]));
                sum_lo = _mm256_add_pd(sum_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(r)));
                sum_hi = _mm256_add_pd(sum_hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(r)));
            }
            let s_lo = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(s[g])), sum_lo);
            let s_hi = _mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(s[g])), sum_hi);
            let s_new = _mm256_set_m128(_mm256_cvtpd_ps(s_hi), _mm256_cvtpd_ps(s_lo));
            s[g] = _mm256_blendv_ps(s[g], s_new, lanes_of(valid[g]));
        }
        // V: acc[r] = acc[r]·ms + Σ_t w[t]·v[t] (FMA in t order; the padding cells of a
        // partial tile add w = 0 times v = 0, i.e. +0). Four rows at a time share each V
        // load; rows without a visible cell here are computed but not stored.
        for r0 in (0..nq).step_by(4) {
            let mut store = 0u8;
            let mut scale_by = [1f32; 4];
            for j in 0..4 {
                let r = r0 + j;
                let (g, l) = (r / L, r % L);
                if r < nq && valid[g] >> l & 1 == 1 {
                    store |= 1 << j;
                    if grow[g] >> l & 1 == 1 {
                        scale_by[j] = ms[g][l];
                    }
                }
            }
            if store == 0 {
                continue;
            }
            let a = acc.as_mut_ptr().add(r0 * hd);
            let w = sc.as_ptr().add(r0);
            let mut d = 0;
            while d < hd {
                if hd - d >= 2 * L {
                    v_block::<2>(a, d, hd, &vf, w, nc, scale_by, store);
                    d += 2 * L;
                } else {
                    v_block::<1>(a, d, hd, &vf, w, nc, scale_by, store);
                    d += L;
                }
            }
        }
        c0 += TILE_KV;
    }
    let mut sv = [[0f32; L]; GMAX];
    for g in 0..ng {
        _mm256_storeu_ps(sv[g].as_mut_ptr(), s[g]);
    }
    let mut o = vec![0f32; hd];
    for r in 0..nq {
        let sr = sv[r / L][r % L];
        let inv = _mm256_set1_ps(if sr == 0.0 { 0.0 } else { 1.0 / sr });
        for d in (0..hd).step_by(L) {
            let a = _mm256_loadu_ps(acc.as_ptr().add(r * hd + d));
            _mm256_storeu_ps(o.as_mut_ptr().add(d), _mm256_mul_ps(a, inv));
        }
        emit(r, &o);
    }
}

/// `N` vectors from dim `d` of the V accumulators of four rows: rescale, FMA over the
/// cells in order, then store the rows whose bit is set in `store`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn v_block<const N: usize>(
    acc: *mut f32,
    d: usize,
    hd: usize,
    vf: &[f32],
    w: *const f32,
    nc: usize,
    scale_by: [f32; 4],
    store: u8,
) {
    let mut a: [[__m256; N]; 4] = std::array::from_fn(|j| {
        let m = _mm256_set1_ps(scale_by[j]);
        std::array::from_fn(|i| _mm256_mul_ps(_mm256_loadu_ps(acc.add(j * hd + d + i * L)), m))
    });
    let vp = vf.as_ptr().add(d);
    for t in 0..nc {
        let v: [__m256; N] = std::array::from_fn(|i| _mm256_loadu_ps(vp.add(t * hd + i * L)));
        for (j, aj) in a.iter_mut().enumerate() {
            let wt = _mm256_set1_ps(*w.add(t * TILE_Q + j));
            for i in 0..N {
                aj[i] = _mm256_fmadd_ps(wt, v[i], aj[i]);
            }
        }
    }
    if nc < TILE_KV {
        for aj in a.iter_mut() {
            for x in aj.iter_mut() {
                *x = _mm256_add_ps(*x, _mm256_setzero_ps());
            }
        }
    }
    for (j, aj) in a.iter().enumerate() {
        if store >> j & 1 == 1 {
            for (i, x) in aj.iter().enumerate() {
                _mm256_storeu_ps(acc.add(j * hd + d + i * L), *x);
            }
        }
    }
}

/// The one-chunk kernel: Q rounded to F16, `ggml_vec_dot_f16` scores (16-lane accumulators
/// as register pairs), online softmax with libm `expf`, and an accumulator rounded to F16
/// after every update. `hd` is a multiple of 16.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn one_chunk(
    order: Order,
    view: &View,
    kvh: usize,
    q: &[f32],
    q_pos: i32,
    scale: f32,
    range: std::ops::Range<usize>,
) -> (f32, f32, Vec<f32>) {
    let hd = view.head_dim;
    let nv = hd / L;
    // Accumulator width `w`: 16 lanes (a register pair) in the AVX512 order, 8 in the AVX2 one.
    let w = order.lanes();
    let body = hd - hd % (4 * w);
    let qf: Vec<__m256> = (0..nv)
        .map(|i| round_f16(_mm256_loadu_ps(q.as_ptr().add(i * L))))
        .collect();
    let mut acc = vec![_mm256_setzero_ps(); nv];
    let mut s_sum = 0f32;
    let mut m = f32::NEG_INFINITY;
    let mut kt = vec![0f32; hd];
    for c in range {
        if !view.visible(c, q_pos) {
            continue;
        }
        let base = c * view.row + kvh * hd;
        // ggml_vec_dot_f16: four `w`-lane accumulators over `4w`-value steps, the tail in f64.
        let mut a4 = [[_mm256_setzero_ps(); 2]; 4];
        let mut i = 0;
        while i < body {
            for (j, a) in a4.iter_mut().enumerate() {
                for (h, ah) in a[..w / L].iter_mut().enumerate() {
                    let o = i + j * w + h * L;
                    let k = load8(view.k, view.dtype, base + o, true);
                    *ah = _mm256_fmadd_ps(k, qf[o / L], *ah);
                }
            }
            i += 4 * w;
        }
        let s16: [__m256; 2] = std::array::from_fn(|h| {
            _mm256_add_ps(
                _mm256_add_ps(a4[0][h], a4[2][h]),
                _mm256_add_ps(a4[1][h], a4[3][h]),
            )
        });
        let mut sum = f64::from(match order {
            Order::GgmlAvx512 => reduce_add_16(s16[0], s16[1]),
            Order::GgmlAvx2 => reduce_hadd_8(s16[0]),
        });
        if body < hd {
            for o in (body..hd).step_by(L) {
                let k = load8(view.k, view.dtype, base + o, true);
                _mm256_storeu_ps(kt.as_mut_ptr().add(o), _mm256_mul_ps(k, qf[o / L]));
            }
            for &p in &kt[body..hd] {
                sum += f64::from(p);
            }
        }
        let s = sum as f32 * scale;
        let m_old = m;
        let mut ms = 1f32;
        let mut vs = 1f32;
        if s > m {
            m = s;
            ms = (m_old - m).exp();
            let v = _mm256_set1_ps(ms);
            for a in acc.iter_mut() {
                *a = round_f16(_mm256_mul_ps(*a, v));
            }
        } else {
            vs = (s - m).exp();
        }
        let vv = _mm256_set1_ps(vs);
        for (i, a) in acc.iter_mut().enumerate() {
            let x = load8(view.v, view.dtype, base + i * L, true);
            *a = round_f16(_mm256_fmadd_ps(x, vv, *a));
        }
        s_sum = s_sum.mul_add(ms, vs);
    }
    let mut out = vec![0f32; hd];
    for (i, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(i * L), *a);
    }
    (m, s_sum, out)
}
