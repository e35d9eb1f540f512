//! The AVX512 kernels: the same operations in the same order as the scalar models in `attention.rs`
//! (`tiled`, `one_chunk`), with query rows (tiled) or head dims (one chunk) in the lanes.

use super::{View, TILE_KV, TILE_Q};
use crate::cpu::math::x86::{reduce_add, v_expf};
use crate::cpu::math::LANES;
use crate::kv::KvType;
use std::arch::x86_64::*;

/// 16 cache values at element `elem` as f32; `round16` rounds F32 values through F16 (ggml
/// casts an F32 cache to F16 for the one-chunk kernel).
#[inline(always)]
unsafe fn load16(buf: &[u8], dtype: KvType, elem: usize, round16: bool) -> __m512 {
    match dtype {
        KvType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(
            buf.as_ptr().add(elem * 2) as *const __m256i
        )),
        KvType::F32 => {
            let v = _mm512_loadu_ps(buf.as_ptr().add(elem * 4) as *const f32);
            if round16 {
                round_f16(v)
            } else {
                v
            }
        }
    }
}

/// Round to F16 and back (round to nearest even, as `f16::from_f32` and ggml's F16 stores).
#[inline(always)]
unsafe fn round_f16(v: __m512) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtps_ph::<
        { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
    >(v))
}

/// `src` as F16 (round to nearest even, as `f16::from_f32`) into `dst` (2 bytes each).
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,fma,f16c")]
pub unsafe fn store_f16(dst: &mut [u8], src: &[f32]) {
    assert_eq!(dst.len(), src.len() * 2);
    let n = src.len();
    let body = n - n % LANES;
    let mut i = 0;
    while i < body {
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_loadu_ps(src.as_ptr().add(i)),
        );
        _mm256_storeu_si256(dst.as_mut_ptr().add(i * 2) as *mut __m256i, h);
        i += LANES;
    }
    for i in body..n {
        dst[i * 2..i * 2 + 2].copy_from_slice(&half::f16::from_f32(src[i]).to_bits().to_le_bytes());
    }
}

/// A cell's K or V row for kv head `kvh` as f32 (`hd` values, a multiple of 16).
#[inline(always)]
unsafe fn load_row(view: &View, buf: &[u8], c: usize, kvh: usize, out: &mut [f32]) {
    let base = c * view.row + kvh * view.head_dim;
    for (i, o) in out.chunks_exact_mut(LANES).enumerate() {
        _mm512_storeu_ps(
            o.as_mut_ptr(),
            load16(buf, view.dtype, base + i * LANES, false),
        );
    }
}

/// The tiled kernel (`super::tiled`) for up to 64 query rows: rows in the lanes of four
/// 16-lane groups for the scores and the softmax, then row by row for V.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,fma,f16c")]
pub unsafe fn tiled(
    view: &View,
    n_kv: usize,
    kvh: usize,
    scale: f32,
    q_rows: &[(&[f32], i32)],
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    for (b, rows) in q_rows.chunks(TILE_Q).enumerate() {
        let mut sub = |r: usize, v: &[f32]| emit(b * TILE_Q + r, v);
        match rows.len().div_ceil(LANES) {
            1 => tile::<1>(view, n_kv, kvh, scale, rows, &mut sub),
            2 => tile::<2>(view, n_kv, kvh, scale, rows, &mut sub),
            3 => tile::<3>(view, n_kv, kvh, scale, rows, &mut sub),
            _ => tile::<4>(view, n_kv, kvh, scale, rows, &mut sub),
        }
    }
}

/// One tile of `nq <= 16·G` query rows.
#[inline(always)]
unsafe fn tile<const G: usize>(
    view: &View,
    n_kv: usize,
    kvh: usize,
    scale: f32,
    q_rows: &[(&[f32], i32)],
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    const W: usize = TILE_Q; // row stride of the lane-major buffers
    let hd = view.head_dim;
    let nq = q_rows.len();
    debug_assert!(nq <= G * LANES);
    // Q transposed: qt[d·W + r], gathered 16 rows at a time from a contiguous copy.
    let mut qc = vec![0f32; G * LANES * hd];
    let mut qpos = [i32::MIN; TILE_Q];
    for (r, (q, p)) in q_rows.iter().enumerate() {
        qc[r * hd..(r + 1) * hd].copy_from_slice(&q[..hd]);
        qpos[r] = *p;
    }
    let mut qt = vec![0f32; hd * W];
    let gidx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(hd as i32),
    );
    for g in 0..G {
        let src = qc.as_ptr().add(g * LANES * hd);
        for d in 0..hd {
            let v = _mm512_i32gather_ps::<4>(gidx, src.add(d));
            _mm512_storeu_ps(qt.as_mut_ptr().add(d * W + g * LANES), v);
        }
    }
    let qp: [__m512i; G] =
        std::array::from_fn(|g| _mm512_loadu_si512(qpos.as_ptr().add(g * LANES) as *const _));
    let real: [__mmask16; G] = std::array::from_fn(|g| {
        let n = nq.saturating_sub(g * LANES).min(LANES);
        ((1u32 << n) - 1) as __mmask16
    });
    let mut m = [_mm512_set1_ps(f32::NEG_INFINITY); G];
    let mut s = [_mm512_setzero_ps(); G];
    // TILE_Q rows, so that the 4-row V blocks never run past the end.
    let mut acc = vec![0f32; TILE_Q * hd];
    let mut kf = vec![0f32; TILE_KV * hd];
    let mut vf = vec![0f32; TILE_KV * hd];
    // Scores, lane-major: sc[t·W + r].
    let mut sc = vec![0f32; TILE_KV * W];
    let mut vis = [[0 as __mmask16; G]; TILE_KV];
    let n_swa = view.n_swa as i32;
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let zero = _mm512_setzero_ps();
    let vscale = _mm512_set1_ps(scale);
    let mut c0 = 0;
    while c0 < n_kv {
        let nc = TILE_KV.min(n_kv - c0);
        let mut any = false;
        for t in 0..TILE_KV {
            for g in 0..G {
                vis[t][g] = 0;
            }
            if t >= nc {
                continue;
            }
            let p = view.cell_pos[c0 + t];
            if p < 0 {
                continue;
            }
            let vp = _mm512_set1_epi32(p);
            for g in 0..G {
                // p <= q_pos && (n_swa == 0 || q_pos - p < n_swa)
                let mut k = _mm512_mask_cmple_epi32_mask(real[g], vp, qp[g]);
                if n_swa != 0 {
                    let dist = _mm512_sub_epi32(qp[g], vp);
                    k &= _mm512_cmplt_epi32_mask(dist, _mm512_set1_epi32(n_swa));
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
        // kq[t] = Σ_d q[d]·k[t][d] (FMA in d order), ·scale, + mask.
        let mut t = 0;
        while t < nc {
            let mut a = [[zero; G]; 4];
            let kp = kf.as_ptr().add(t * hd);
            for d in 0..hd {
                let qv: [__m512; G] =
                    std::array::from_fn(|g| _mm512_loadu_ps(qt.as_ptr().add(d * W + g * LANES)));
                for (c, ac) in a.iter_mut().enumerate() {
                    let kb = _mm512_set1_ps(*kp.add(c * hd + d));
                    for g in 0..G {
                        ac[g] = _mm512_fmadd_ps(qv[g], kb, ac[g]);
                    }
                }
            }
            for (c, ac) in a.iter().enumerate() {
                let tc = t + c;
                if tc >= nc {
                    break;
                }
                for g in 0..G {
                    let mask = _mm512_mask_blend_ps(vis[tc][g], neg_inf, zero);
                    let v = _mm512_add_ps(_mm512_mul_ps(ac[g], vscale), mask);
                    _mm512_storeu_ps(sc.as_mut_ptr().add(tc * W + g * LANES), v);
                }
            }
            t += 4;
        }
        for t in nc..TILE_KV {
            for g in 0..G {
                _mm512_storeu_ps(sc.as_mut_ptr().add(t * W + g * LANES), neg_inf);
            }
        }
        // Per row: tile max, rescale on a new maximum, softmax of the tile, sum.
        let mut valid = [0 as __mmask16; G];
        let mut grow = [0 as __mmask16; G];
        let mut ms = [[1f32; LANES]; G];
        let mut m_new = [zero; G];
        for g in 0..G {
            let mut tmax = neg_inf;
            for t in 0..TILE_KV {
                tmax = _mm512_max_ps(tmax, _mm512_loadu_ps(sc.as_ptr().add(t * W + g * LANES)));
            }
            valid[g] = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(tmax, neg_inf) & real[g];
            let mn = _mm512_max_ps(m[g], tmax);
            grow[g] = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(mn, m[g]) & valid[g];
            if grow[g] != 0 {
                let mut mo = [0f32; LANES];
                let mut mnv = [0f32; LANES];
                _mm512_storeu_ps(mo.as_mut_ptr(), m[g]);
                _mm512_storeu_ps(mnv.as_mut_ptr(), mn);
                for l in 0..LANES {
                    if grow[g] >> l & 1 == 1 {
                        ms[g][l] = (mo[l] - mnv[l]).exp();
                    }
                }
                let vms = _mm512_loadu_ps(ms[g].as_ptr());
                s[g] = _mm512_mask_mul_ps(s[g], grow[g], s[g], vms);
            }
            m[g] = _mm512_mask_mov_ps(m[g], valid[g], mn);
            m_new[g] = mn;
            // soft_max_tile: exp(x - max) per 16 cells, each group reduced by the
            // `_mm512_reduce_add_ps` tree, the groups summed in f64.
            let mut sum_lo = _mm512_setzero_pd();
            let mut sum_hi = _mm512_setzero_pd();
            for k in 0..TILE_KV / LANES {
                let mut v = [zero; LANES];
                for (i, vi) in v.iter_mut().enumerate() {
                    let at = sc.as_mut_ptr().add((k * LANES + i) * W + g * LANES);
                    *vi = v_expf(_mm512_sub_ps(_mm512_loadu_ps(at), mn));
                    _mm512_storeu_ps(at, *vi);
                }
                let t8: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(v[i + 8], v[i]));
                let t4: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(t8[i + 4], t8[i]));
                let r = _mm512_add_ps(_mm512_add_ps(t4[0], t4[2]), _mm512_add_ps(t4[1], t4[3]));
                sum_lo = _mm512_add_pd(sum_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(r)));
                sum_hi = _mm512_add_pd(sum_hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(r)));
            }
            let s_lo = _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(s[g])), sum_lo);
            let s_hi = _mm512_add_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(s[g])), sum_hi);
            let s_new = _mm512_insertf32x8::<1>(
                _mm512_castps256_ps512(_mm512_cvtpd_ps(s_lo)),
                _mm512_cvtpd_ps(s_hi),
            );
            s[g] = _mm512_mask_mov_ps(s[g], valid[g], s_new);
        }
        // V: acc[r] = acc[r]·ms + Σ_t w[t]·v[t] (FMA in t order; the padding cells of a
        // partial tile add w = 0 times v = 0, i.e. +0). Four rows at a time share each V
        // load; rows without a visible cell here are computed but not stored.
        for r0 in (0..nq).step_by(4) {
            let mut store = 0u8;
            let mut scale_by = [1f32; 4];
            for j in 0..4 {
                let r = r0 + j;
                let (g, l) = (r / LANES, r % LANES);
                if r < nq && valid[g] >> l & 1 == 1 {
                    store |= 1 << j;
                    if grow[g] >> l & 1 == 1 {
                        // ×1 leaves a value unchanged, so rows without a new max use it.
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
                let step = match (hd - d) / LANES {
                    n if n >= 4 => 4,
                    n if n >= 2 => 2,
                    _ => 1,
                };
                match step {
                    4 => v_block::<4>(a, d, hd, &vf, w, nc, scale_by, store),
                    2 => v_block::<2>(a, d, hd, &vf, w, nc, scale_by, store),
                    _ => v_block::<1>(a, d, hd, &vf, w, nc, scale_by, store),
                }
                d += step * LANES;
            }
        }
        c0 += TILE_KV;
    }
    let mut sv = [[0f32; LANES]; G];
    for g in 0..G {
        _mm512_storeu_ps(sv[g].as_mut_ptr(), s[g]);
    }
    let mut o = vec![0f32; hd];
    for r in 0..nq {
        let sr = sv[r / LANES][r % LANES];
        let inv = _mm512_set1_ps(if sr == 0.0 { 0.0 } else { 1.0 / sr });
        for d in (0..hd).step_by(LANES) {
            let a = _mm512_loadu_ps(acc.as_ptr().add(r * hd + d));
            _mm512_storeu_ps(o.as_mut_ptr().add(d), _mm512_mul_ps(a, inv));
        }
        emit(r, &o);
    }
}

/// `N` vectors from dim `d` of the V accumulators of four rows (`acc` at the first, rows
/// `hd` apart; weights `w[t·TILE_Q + j]`): rescale, FMA over the cells in order, then store
/// the rows whose bit is set in `store`.
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
    let mut a: [[__m512; N]; 4] = std::array::from_fn(|j| {
        let m = _mm512_set1_ps(scale_by[j]);
        std::array::from_fn(|i| _mm512_mul_ps(_mm512_loadu_ps(acc.add(j * hd + d + i * LANES)), m))
    });
    let vp = vf.as_ptr().add(d);
    for t in 0..nc {
        let v: [__m512; N] = std::array::from_fn(|i| _mm512_loadu_ps(vp.add(t * hd + i * LANES)));
        for (j, aj) in a.iter_mut().enumerate() {
            let wt = _mm512_set1_ps(*w.add(t * TILE_Q + j));
            for i in 0..N {
                aj[i] = _mm512_fmadd_ps(wt, v[i], aj[i]);
            }
        }
    }
    if nc < TILE_KV {
        for aj in a.iter_mut() {
            for x in aj.iter_mut() {
                *x = _mm512_add_ps(*x, _mm512_setzero_ps());
            }
        }
    }
    for (j, aj) in a.iter().enumerate() {
        if store >> j & 1 == 1 {
            for (i, x) in aj.iter().enumerate() {
                _mm512_storeu_ps(acc.add(j * hd + d + i * LANES), *x);
            }
        }
    }
}

/// The one-chunk kernel (`super::one_chunk`): Q rounded to F16, `ggml_vec_dot_f16` scores,
/// online softmax with libm `expf`, and an accumulator rounded to F16 after every update.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,fma,f16c")]
pub unsafe fn one_chunk(
    view: &View,
    kvh: usize,
    q: &[f32],
    q_pos: i32,
    scale: f32,
    range: std::ops::Range<usize>,
) -> (f32, f32, Vec<f32>) {
    let hd = view.head_dim;
    let nv = hd / LANES;
    let body = hd - hd % (4 * LANES);
    let qf: Vec<__m512> = (0..nv)
        .map(|i| round_f16(_mm512_loadu_ps(q.as_ptr().add(i * LANES))))
        .collect();
    let mut qs = vec![0f32; hd];
    for (i, v) in qf.iter().enumerate() {
        _mm512_storeu_ps(qs.as_mut_ptr().add(i * LANES), *v);
    }
    let mut acc = vec![_mm512_setzero_ps(); nv];
    let mut s_sum = 0f32;
    let mut m = f32::NEG_INFINITY;
    let mut kt = vec![0f32; hd];
    for c in range {
        if !view.visible(c, q_pos) {
            continue;
        }
        let base = c * view.row + kvh * hd;
        // ggml_vec_dot_f16: four accumulators over 64-value steps, the tail in f64.
        let mut a4 = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i < body {
            for (j, a) in a4.iter_mut().enumerate() {
                let o = i + j * LANES;
                let k = load16(view.k, view.dtype, base + o, true);
                *a = _mm512_fmadd_ps(k, qf[o / LANES], *a);
            }
            i += 4 * LANES;
        }
        let s16 = _mm512_add_ps(_mm512_add_ps(a4[0], a4[2]), _mm512_add_ps(a4[1], a4[3]));
        let mut sum = f64::from(reduce_add(s16));
        if body < hd {
            for o in (body..hd).step_by(LANES) {
                let k = load16(view.k, view.dtype, base + o, true);
                _mm512_storeu_ps(kt.as_mut_ptr().add(o), _mm512_mul_ps(k, qf[o / LANES]));
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
            let v = _mm512_set1_ps(ms);
            for a in acc.iter_mut() {
                *a = round_f16(_mm512_mul_ps(*a, v));
            }
        } else {
            vs = (s - m).exp();
        }
        let vv = _mm512_set1_ps(vs);
        for (i, a) in acc.iter_mut().enumerate() {
            let x = load16(view.v, view.dtype, base + i * LANES, true);
            *a = round_f16(_mm512_fmadd_ps(x, vv, *a));
        }
        s_sum = s_sum.mul_add(ms, vs);
    }
    let mut out = vec![0f32; hd];
    for (i, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.as_mut_ptr().add(i * LANES), *a);
    }
    (m, s_sum, out)
}
