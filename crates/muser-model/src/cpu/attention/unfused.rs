//! Attention with flash attention off (`--flash-attn off`): llama.cpp b11434's unfused graph
//! (`build_attn_mha` without flash attention), op by op, for one query head:
//!
//! 1. `kq = mul_mat(K, Q)`: each cell's K row dotted with each query row. For an F16 cache the
//!    query is first rounded to F16 (`from_float` of the matmul's activations); two or more
//!    query rows take tinyBLAS when `n_kv` is a multiple of 4, one row `ggml_vec_dot_f16`. For
//!    an F32 cache the permuted query is not contiguous (unless there is one head), so
//!    tinyBLAS is skipped: `ggml_vec_dot_f32`.
//! 2. `soft_max_ext(kq, mask, scale)` over the row of all `n_kv` cells: `kq·scale + mask`
//!    (0 or -inf), the row's max, `ggml_vec_soft_max_f32` (vector exp per lane group of the
//!    order, f64 sum), then every value times `(f32)(1/sum)`.
//! 3. `kqv = mul_mat(Vᵀ, kq)`: per dimension of the head, the V values of the cells dotted
//!    with the probabilities, rounded to F16 first for an F16 cache; tinyBLAS over the cells for
//!    two or more query rows when the head dim is a multiple of 4, vec_dot for one row.
//!
//! Nothing depends on the thread count. Widening F16 to f32 is exact, so the dots run on f32
//! copies of the rows ([`vec_dot`], [`tinyblas_dot`] on either type give the same bits).

use super::{OutPtr, View};
use crate::backend::AttnInput;
use crate::cpu::math::{fma_fn, soft_max_tile, tinyblas_dot, vec_dot};
use crate::cpu::numerics::Order;
use crate::kv::KvType;
use half::f16;

/// Query rows per task: each task widens its kv head's K and V once for this many rows.
const TASK_ROWS: usize = 64;

/// Which dot product each of the two matmuls runs, from the facts ggml decides by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Kernels {
    kq_tinyblas: bool,
    kqv_tinyblas: bool,
}

impl Kernels {
    /// `q_rows` query rows of one sequence against `n_kv` cells of a cache of `dtype`.
    fn choose(dtype: KvType, q_rows: usize, n_kv: usize, head_dim: usize, n_head: usize) -> Self {
        // llamafile_sgemm: only for two or more columns, and (x86) rows in multiples of 4.
        let rows = q_rows >= 2;
        Kernels {
            kq_tinyblas: rows && n_kv.is_multiple_of(4) && (dtype == KvType::F16 || n_head == 1),
            kqv_tinyblas: rows && head_dim.is_multiple_of(4),
        }
    }
}

/// The value ggml's matmul sees for an activation of a cache of `dtype`: rounded to F16 for an
/// F16 cache (`ggml_cpu_fp32_to_fp16`, round to nearest even), unchanged for F32.
fn as_cache_type(dtype: KvType, x: f32) -> f32 {
    match dtype {
        KvType::F16 => f16::from_f32(x).to_f32(),
        KvType::F32 => x,
    }
}

fma_fn! {
/// Attention of query rows `q_rows` (one query head's slice, position) over cells `0..n_kv` of
/// kv head `kvh`; row `r`'s result goes to `emit(r, values)`.
#[allow(clippy::too_many_arguments)]
fn attend_kv_head(order: Order, view: &View, n_kv: usize, kvh: usize, scale: f32, kernels: Kernels, q_rows: &[(&[f32], i32)], emit: &mut dyn FnMut(usize, &[f32])) {
    let hd = view.head_dim;
    // K rows and V transposed ([d][cell]), widened once.
    let mut k = vec![0f32; n_kv * hd];
    let mut vt = vec![0f32; hd * n_kv];
    let mut row = vec![0f32; hd];
    for c in 0..n_kv {
        view.k_f32(c, kvh, &mut k[c * hd..(c + 1) * hd]);
        view.v_f32(c, kvh, &mut row);
        for (d, &x) in row.iter().enumerate() {
            vt[d * n_kv + c] = x;
        }
    }
    let mut p = vec![0f32; n_kv];
    let mut qv = vec![0f32; hd];
    let mut out = vec![0f32; hd];
    for (r, (q, q_pos)) in q_rows.iter().enumerate() {
        for (a, &x) in qv.iter_mut().zip(q.iter()) {
            *a = as_cache_type(view.dtype, x);
        }
        for (c, s) in p.iter_mut().enumerate() {
            *s = if view.visible(c, *q_pos) {
                let kc = &k[c * hd..(c + 1) * hd];
                let kq = if kernels.kq_tinyblas {
                    tinyblas_dot(order, kc, &qv)
                } else {
                    vec_dot(order, kc, &qv)
                };
                // `ggml_vec_scale_f32`, then the mask's 0 added
                kq * scale + 0.0
            } else {
                f32::NEG_INFINITY
            };
        }
        let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum = soft_max_tile(order, &mut p, max);
        let inv = (1.0 / sum) as f32;
        for s in p.iter_mut() {
            *s = as_cache_type(view.dtype, *s * inv);
        }
        for (d, o) in out.iter_mut().enumerate() {
            let vd = &vt[d * n_kv..(d + 1) * n_kv];
            *o = if kernels.kqv_tinyblas {
                tinyblas_dot(order, vd, &p)
            } else {
                vec_dot(order, vd, &p)
            };
        }
        emit(r, &out);
    }
}
}

/// Attention for all groups of a batch on one layer with flash attention off. Returns
/// `[tokens × n_head·hd]`. The caller checked the groups' token indices and views.
pub fn run(
    order: Order,
    at: &AttnInput,
    views: &[View],
    n_kvs: &[usize],
    q: &[f32],
    n_tokens: usize,
) -> Vec<f32> {
    use rayon::prelude::*;
    let hd = at.head_dim;
    let qw = at.n_head * hd;
    let group = at.n_head / at.n_head_kv;
    let mut out = vec![0f32; n_tokens * qw];
    // One task per (sequence, query head, block of query rows).
    let mut tasks: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (g, (_, idx)) in at.groups.iter().enumerate() {
        for h in 0..at.n_head {
            for r0 in (0..idx.len()).step_by(TASK_ROWS) {
                tasks.push((g, h, r0, (r0 + TASK_ROWS).min(idx.len())));
            }
        }
    }
    let dst = OutPtr(out.as_mut_ptr());
    let work = |&(g, h, r0, r1): &(usize, usize, usize, usize)| {
        let all = &at.groups[g].1;
        let idx = &all[r0..r1];
        let view = &views[g];
        let kernels = Kernels::choose(view.dtype, all.len(), n_kvs[g], hd, at.n_head);
        let rows: Vec<(&[f32], i32)> = idx
            .iter()
            .map(|&t| (&q[t * qw + h * hd..t * qw + (h + 1) * hd], at.pos[t] as i32))
            .collect();
        let mut emit = |r: usize, vals: &[f32]| {
            let t = idx[r];
            // SAFETY: `t < n_tokens` (checked by the caller) and head `h`'s columns of row `t`
            // belong to this task alone.
            unsafe {
                std::ptr::copy_nonoverlapping(vals.as_ptr(), dst.at(t * qw + h * hd), hd);
            }
        };
        attend_kv_head(
            order,
            view,
            n_kvs[g],
            h / group,
            at.scale,
            kernels,
            &rows,
            &mut emit,
        );
    };
    if tasks.len() == 1 {
        tasks.iter().for_each(work);
    } else {
        tasks.par_iter().for_each(work);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::store;
    use super::*;

    /// Both cache types, both kernels of each matmul, a window and empty cells: the result is
    /// softmax(q·k·scale) · v over the visible cells, computed here plainly in f64 (the cache
    /// rounding of q and the probabilities bounds the difference).
    #[test]
    fn unfused_attention_is_the_softmax_of_the_visible_cells() {
        let (hd, n_head_kv, n_kv) = (32usize, 2usize, 96usize);
        let row = n_head_kv * hd;
        let mut seed = 0x2545_f491u32;
        let mut rnd = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        };
        let kv_vals: Vec<f32> = (0..2 * n_kv * row).map(|_| rnd()).collect();
        let cell_pos: Vec<i32> = (0..n_kv as i32)
            .map(|c| if c % 13 == 4 { -1 } else { c })
            .collect();
        let q: Vec<f32> = (0..5 * hd).map(|_| 2.0 * rnd()).collect();
        for dtype in [KvType::F16, KvType::F32] {
            let mut k = vec![0u8; n_kv * row * dtype.size()];
            let mut v = vec![0u8; n_kv * row * dtype.size()];
            store(&mut k, dtype, 0, &kv_vals[..n_kv * row]);
            store(&mut v, dtype, 0, &kv_vals[n_kv * row..]);
            for n_swa in [0u32, 20] {
                let view = View {
                    k: &k,
                    v: &v,
                    cell_pos: &cell_pos,
                    dtype,
                    row,
                    head_dim: hd,
                    n_swa,
                };
                for n_rows in [1usize, 5] {
                    let rows: Vec<(&[f32], i32)> = (0..n_rows)
                        .map(|r| (&q[r * hd..(r + 1) * hd], 60 + r as i32))
                        .collect();
                    let kernels = Kernels::choose(dtype, n_rows, n_kv, hd, 1);
                    let mut got = vec![vec![0f32; hd]; n_rows];
                    attend_kv_head(
                        Order::GgmlAvx2,
                        &view,
                        n_kv,
                        1,
                        0.25,
                        kernels,
                        &rows,
                        &mut |r, o| got[r].copy_from_slice(o),
                    );
                    for (r, (qr, p)) in rows.iter().enumerate() {
                        let mut kc = vec![0f32; hd];
                        let mut vc = vec![0f32; hd];
                        let mut w = Vec::new();
                        for c in (0..n_kv).filter(|&c| view.visible(c, *p)) {
                            view.k_f32(c, 1, &mut kc);
                            let s: f64 = kc.iter().zip(*qr).map(|(a, b)| f64::from(a * b)).sum();
                            w.push((c, s * 0.25));
                        }
                        let max = w.iter().map(|x| x.1).fold(f64::MIN, f64::max);
                        let sum: f64 = w.iter().map(|x| (x.1 - max).exp()).sum();
                        let mut want = vec![0f64; hd];
                        for &(c, s) in &w {
                            view.v_f32(c, 1, &mut vc);
                            for d in 0..hd {
                                want[d] += (s - max).exp() / sum * f64::from(vc[d]);
                            }
                        }
                        for d in 0..hd {
                            let err = (f64::from(got[r][d]) - want[d]).abs();
                            assert!(
                                err < 4e-3,
                                "{dtype:?} swa {n_swa} rows {n_rows} r {r} d {d}: {err}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn kernels_follow_ggml_s_choice() {
        let k = |dtype, rows, n_kv, hd, heads| Kernels::choose(dtype, rows, n_kv, hd, heads);
        // Prefill on an F16 cache: tinyBLAS for both; decode: vec_dot for both.
        assert_eq!(
            k(KvType::F16, 9, 256, 64, 9),
            Kernels {
                kq_tinyblas: true,
                kqv_tinyblas: true
            }
        );
        assert_eq!(
            k(KvType::F16, 1, 256, 64, 9),
            Kernels {
                kq_tinyblas: false,
                kqv_tinyblas: false
            }
        );
        // An F32 cache: the permuted query is contiguous only with one head.
        assert!(!k(KvType::F32, 9, 256, 64, 9).kq_tinyblas);
        assert!(k(KvType::F32, 9, 256, 64, 1).kq_tinyblas);
        // Rows of the first matrix not a multiple of 4: no tinyBLAS.
        assert!(!k(KvType::F16, 9, 254, 64, 9).kq_tinyblas);
        assert!(!k(KvType::F16, 9, 256, 66, 9).kqv_tinyblas);
    }
}
