//! `y = x · Wᵀ` with ggml's CPU kernel choice (b11434, x86 AVX512 build, no weight repacking;
//! the AVX2 build differs only in the lanes of the F32/F16 rows below, which follow `Order`):
//!
//! | weight | rows of x | kernel |
//! |---|---|---|
//! | Q4_K, Q5_K, Q6_K | ≥ 8 | tiled K-quant matmul on Q8_K activations ([`super::kquant`]) |
//! | F16 | ≥ 2 | llamafile tinyBLAS on F16 activations (16-lane FMA, then reduce) |
//! | F16 | 1 | `ggml_vec_dot_f16` |
//! | anything else | any | `ggml_vec_dot_<type>` on `vec_dot_type` activations (muser-quant) |
//!
//! (tinyBLAS also takes Q8_0/Q4_0/Q5_0 with two or more rows; its per-block FMA into 8 lanes
//! and final reduction are the same operations as the vec_dot kernels, so one path serves.)
//!
//! Rows computed alone (a speculative verification's) take the one-row kernel whatever the
//! batch: `vec_dot` in the one-row order, the weights still read once for all rows.
//!
//! Work is split over output rows in blocks; each block of weight rows is read once and dotted
//! with every activation row while it is hot in cache. F32 and F16 weights against two or
//! more rows (tinyBLAS's case) go through the activations in blocks of [`TOKEN_BLOCK`] rows
//! that stay in the L2 cache, [`TILE_ROWS`] weight rows by [`TILE_TOKENS`] activation rows at
//! a time ([`tinyblas_tile`]); each output is still one tinyBLAS dot in its own lanes, so the
//! result has the bits of the untiled loop.

use super::kquant;
use super::math::{fma_fn, tinyblas_dot, tinyblas_tile, vec_dot, TILE_ROWS, TILE_TOKENS};
use super::numerics::Order;
use crate::backend::Weight;
use crate::error::ModelError;
use half::f16;
use muser_gguf::GgmlType;
use rayon::prelude::*;

/// Output rows per work item.
const ROW_BLOCK: usize = 16;
/// Activation rows an F32/F16 matmul dots with a task's weight rows before the next ones (a
/// block of 32 rows of 1536 values is 192 KiB: the L2 cache holds it).
const TOKEN_BLOCK: usize = 32;
/// Batches of at most this many tokens split a quantized matmul by weight rows, not tokens.
const FEW_TOKENS: usize = 16;

/// Weight rows the K-quant kernel takes per pass.
const KQ_GROUP: usize = 8;

/// Activations converted once for a whole matmul.
enum Acts {
    /// f32 values; for F16 weights rounded to f16 first (ggml's `vec_dot_type`), kept widened
    /// (exactly) so that no product converts them again.
    F32(Vec<f32>),
    /// Quantized rows of `row_bytes` each.
    Quant { data: Vec<u8>, row_bytes: usize },
}

fn quant_err(w: &Weight, e: muser_quant::QuantError) -> ModelError {
    ModelError::Quant(format!("{}: {e}", w.name))
}

/// Whether the CPU backend can multiply weights of this type.
pub fn supported(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16) || muser_quant::has_vec_dot(ty)
}

/// `y = x · Wᵀ` for `n_rows` activation rows; F32 and F16 weights sum in `order`'s lanes. The
/// rows flagged in `alone` (empty: none) get what a one-row product gives them.
pub fn matmul(
    order: Order,
    w: &Weight,
    x: &[f32],
    n_rows: usize,
    alone: &[bool],
) -> Result<Vec<f32>, ModelError> {
    let (n_in, n_out) = (w.n_in, w.n_out);
    if x.len() != n_rows * n_in {
        return Err(ModelError::BadBatch(format!(
            "{}: activation length {} != {n_rows}×{n_in}",
            w.name,
            x.len()
        )));
    }
    if !supported(w.ty) {
        return Err(ModelError::UnsupportedType {
            name: w.name.to_string(),
            ty: w.ty.name(),
        });
    }
    if n_rows == 0 {
        // A batch that asks for no output rows (an intermediate prompt chunk).
        return Ok(Vec::new());
    }
    if !alone.is_empty() && alone.len() != n_rows {
        return Err(ModelError::BadBatch(format!(
            "{}: {} row flags for {n_rows} rows",
            w.name,
            alone.len()
        )));
    }
    let n_alone = alone.iter().filter(|&&a| a).count();
    if n_alone > 0 && n_alone < n_rows && kquant::applies(w.ty, n_rows) {
        // The tiled K-quant kernel takes the batch: the rows computed alone go through the
        // one-row kernel by themselves, the others through the batch's.
        return split_alone(order, w, x, alone);
    }
    let rb = w.row_bytes();
    let acts = match w.ty {
        GgmlType::F32 => Acts::F32(x.to_vec()),
        GgmlType::F16 => Acts::F32(x.iter().map(|&v| f16::from_f32(v).to_f32()).collect()),
        ty => {
            let vt = muser_quant::vec_dot_type(ty);
            let row_bytes = muser_quant::row_size(vt, n_in).map_err(|e| quant_err(w, e))?;
            let mut data = vec![0u8; row_bytes * n_rows];
            // Rows are independent: quantize them on every thread.
            x.par_chunks_exact(n_in)
                .zip(data.par_chunks_exact_mut(row_bytes))
                .with_min_len(8)
                .try_for_each(|(src, dst)| muser_quant::quantize_activations(vt, src, dst))
                .map_err(|e| quant_err(w, e))?;
            Acts::Quant { data, row_bytes }
        }
    };
    let packed = match (&acts, n_alone == 0 && kquant::applies(w.ty, n_rows)) {
        (Acts::Quant { data, .. }, true) => Some(kquant::Packed::new(data, n_rows, n_in / 256)),
        _ => None,
    };
    if let (Acts::Quant { data, .. }, None) = (&acts, &packed) {
        return quant_matmul(w, data, n_rows);
    }
    // A few contiguous row ranges per thread: each range reads its weights once and dots them
    // with every activation row while they are in cache.
    let per = n_out
        .div_ceil(4 * rayon::current_num_threads())
        .div_ceil(ROW_BLOCK)
        * ROW_BLOCK;
    let ranges: Vec<(usize, usize)> = (0..n_out)
        .step_by(per.max(ROW_BLOCK))
        .map(|r0| (r0, (r0 + per).min(n_out)))
        .collect();
    let mut y = vec![0f32; n_rows * n_out];
    let y_ptr = SendPtr(y.as_mut_ptr());
    ranges.into_par_iter().for_each(|(r0, r1)| {
        let y_ptr = &y_ptr;
        if n_rows == 1 {
            // SAFETY: the ranges are disjoint and inside `y` (n_out values).
            let o = unsafe { std::slice::from_raw_parts_mut(y_ptr.0.add(r0), r1 - r0) };
            for (r, o) in (r0..r1).zip(o.chunks_exact_mut(1)) {
                dot_row(
                    order,
                    w.ty,
                    n_in,
                    &w.data[r * rb..(r + 1) * rb],
                    &acts,
                    &[],
                    o,
                );
            }
            return;
        }
        if let Some(p) = &packed {
            // KQ_GROUP weight rows unpacked at a time, each activation vector loaded once for
            // all of them; results go straight into y.
            let mut us: Vec<kquant::Unpacked> = (0..KQ_GROUP.min(r1 - r0))
                .map(|_| kquant::Unpacked::new(w.ty, n_in / 256))
                .collect();
            for g0 in (r0..r1).step_by(KQ_GROUP) {
                let g1 = (g0 + KQ_GROUP).min(r1);
                for (u, r) in us.iter_mut().zip(g0..g1) {
                    u.fill(&w.data[r * rb..(r + 1) * rb]);
                }
                // SAFETY: y is n_rows × n_out; this task alone writes columns g0..g1.
                unsafe {
                    kquant::dot_packed_rows_to(&us[..g1 - g0], p, y_ptr.0.add(g0), 1, n_out, n_rows)
                };
            }
            return;
        }
        let mut out = vec![0f32; (r1 - r0) * n_rows];
        match &acts {
            Acts::F32(x) if alone.is_empty() && n_in.is_multiple_of(order.lanes()) => {
                let wf = widen(w.ty, &w.data[r0 * rb..r1 * rb]);
                dot_tiles(order, n_in, &wf, x, &mut out);
            }
            _ => {
                for r in r0..r1 {
                    let wrow = &w.data[r * rb..(r + 1) * rb];
                    let o = &mut out[(r - r0) * n_rows..(r - r0 + 1) * n_rows];
                    dot_row(order, w.ty, n_in, wrow, &acts, alone, o);
                }
            }
        }
        // Transpose [row][token] into y's [token][row], 16 rows at a time so that every
        // token's write is one contiguous run.
        for i0 in (0..r1 - r0).step_by(ROW_BLOCK) {
            let i1 = (i0 + ROW_BLOCK).min(r1 - r0);
            for t in 0..n_rows {
                // SAFETY: columns r0..r1 of every token row belong to this range alone.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(y_ptr.0.add(t * n_out + r0 + i0), i1 - i0)
                };
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = out[(i0 + i) * n_rows + t];
                }
            }
        }
    });
    Ok(y)
}

/// [`matmul`] of a batch with rows computed alone and others, each part in its own call (the
/// alone rows all flagged), the results put back in batch order.
fn split_alone(
    order: Order,
    w: &Weight,
    x: &[f32],
    alone: &[bool],
) -> Result<Vec<f32>, ModelError> {
    let (n_in, n_out) = (w.n_in, w.n_out);
    let mut y = vec![0f32; alone.len() * n_out];
    for part in [true, false] {
        let rows: Vec<usize> = (0..alone.len()).filter(|&t| alone[t] == part).collect();
        let xs: Vec<f32> = rows
            .iter()
            .flat_map(|&t| &x[t * n_in..(t + 1) * n_in])
            .copied()
            .collect();
        let flags = vec![part; rows.len()];
        let ys = matmul(order, w, &xs, rows.len(), if part { &flags } else { &[] })?;
        for (k, &t) in rows.iter().enumerate() {
            y[t * n_out..(t + 1) * n_out].copy_from_slice(&ys[k * n_out..(k + 1) * n_out]);
        }
    }
    Ok(y)
}

/// `vec_dot` matmul on quantized activations `acts` (`n_rows` rows), the kernel chosen once.
/// One token: contiguous weight-row ranges per task, each written in place. Up to
/// [`FEW_TOKENS`]: weight-row ranges per task as well (memory-bound, so each weight byte is
/// read by one task only). More tokens: the tokens are split between tasks (each owns its rows
/// of y) and every task runs the multi-row × multi-token kernel over the whole weight matrix.
/// Every value has the bits of `vec_dot` whichever split computes it.
fn quant_matmul(w: &Weight, acts: &[u8], n_rows: usize) -> Result<Vec<f32>, ModelError> {
    let (n_in, n_out) = (w.n_in, w.n_out);
    let kern = muser_quant::RowDot::new(w.ty, n_in).map_err(|e| quant_err(w, e))?;
    let (rb, ab) = (kern.weight_row_bytes(), kern.act_row_bytes());
    let weights = &w.data[..n_out * rb];
    let mut y = vec![0f32; n_rows * n_out];
    let threads = rayon::current_num_threads();
    if n_rows == 1 {
        let per = n_out.div_ceil(4 * threads).div_ceil(ROW_BLOCK) * ROW_BLOCK;
        y.par_chunks_mut(per.max(ROW_BLOCK))
            .enumerate()
            .for_each(|(i, out)| {
                let r0 = i * per.max(ROW_BLOCK);
                let n = out.len();
                kern.dot_tile(&weights[r0 * rb..(r0 + n) * rb], acts, out, n);
            });
    } else if n_rows <= FEW_TOKENS {
        // A few tokens (decode of several slots, a verification): split the weight rows, so
        // that each task streams only its share of the matrix, and gather the tasks' columns
        // into y. Two shares per thread, whole 4-row tiles (not blocks of 16: 576 rows on 8
        // threads made 12 shares, two rounds for one and a half's work).
        let per = n_out.div_ceil(2 * threads).next_multiple_of(4);
        let parts: Vec<(usize, Vec<f32>)> = (0..n_out)
            .step_by(per)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|r0| {
                let n = per.min(n_out - r0);
                let mut out = vec![0f32; n_rows * n];
                // ROW_BLOCK rows at a time against every token: each weight row comes from
                // memory once and serves every token from the L1 cache.
                for b0 in (0..n).step_by(ROW_BLOCK) {
                    let b1 = (b0 + ROW_BLOCK).min(n);
                    let rows = &weights[(r0 + b0) * rb..(r0 + b1) * rb];
                    kern.dot_tile(rows, acts, &mut out[b0..], n);
                }
                (r0, out)
            })
            .collect();
        for (r0, out) in parts {
            let n = out.len() / n_rows;
            for (t, row) in out.chunks_exact(n).enumerate() {
                y[t * n_out + r0..t * n_out + r0 + n].copy_from_slice(row);
            }
        }
    } else {
        let per = n_rows.div_ceil(2 * threads).next_multiple_of(4);
        y.par_chunks_mut(per * n_out)
            .zip(acts.par_chunks(per * ab))
            .for_each(|(out, a)| kern.dot_tile(weights, a, out, n_out));
    }
    Ok(y)
}

/// The output buffer, written by several tasks at disjoint places.
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint elements only (see the uses).
unsafe impl Sync for SendPtr {}
unsafe impl Send for SendPtr {}

fma_fn! {
/// One weight row against every activation row, in `order`; the rows flagged in `alone`
/// (empty: none) take the one-row kernel.
fn dot_row(order: Order, ty: GgmlType, n_in: usize, wrow: &[u8], acts: &Acts, alone: &[bool], out: &mut [f32]) {
    let n_rows = out.len();
    let batched = |t: usize| n_rows >= 2 && n_in.is_multiple_of(order.lanes()) && !alone.get(t).copied().unwrap_or(false);
    match acts {
        Acts::F32(x) => {
            let wf = widen(ty, wrow);
            for (t, o) in out.iter_mut().enumerate() {
                let a = &x[t * n_in..(t + 1) * n_in];
                *o = if batched(t) {
                    tinyblas_dot(order, &wf, a)
                } else {
                    vec_dot(order, &wf, a)
                };
            }
        }
        Acts::Quant { data, row_bytes } => {
            for (t, o) in out.iter_mut().enumerate() {
                *o =
                    muser_quant::vec_dot(ty, n_in, wrow, &data[t * row_bytes..(t + 1) * row_bytes]);
            }
        }
    }
}
}

/// F32 or F16 weight rows as f32 values (exactly), widened once, not in every product.
fn widen(ty: GgmlType, rows: &[u8]) -> Vec<f32> {
    if ty == GgmlType::F16 {
        rows.chunks_exact(2)
            .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect()
    } else {
        rows.chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }
}

fma_fn! {
/// tinyBLAS dots of the weight rows `wf` (`n_in` values each) with every activation row of
/// `x` into `out` (`[weight row][activation row]`): blocks of [`TOKEN_BLOCK`] activation rows,
/// each gone through by tiles of [`TILE_ROWS`] × [`TILE_TOKENS`] dots; the rows left over at
/// the edges take the one-dot kernel. `n_in` is a multiple of `order.lanes()`.
fn dot_tiles(order: Order, n_in: usize, wf: &[f32], x: &[f32], out: &mut [f32]) {
    let (n_w, n_x) = (wf.len() / n_in, x.len() / n_in);
    let wrow = |r: usize| &wf[r * n_in..(r + 1) * n_in];
    let xrow = |t: usize| &x[t * n_in..(t + 1) * n_in];
    let (w_tiled, mut tile) = (n_w - n_w % TILE_ROWS, [[0f32; TILE_TOKENS]; TILE_ROWS]);
    for t0 in (0..n_x).step_by(TOKEN_BLOCK) {
        let t1 = (t0 + TOKEN_BLOCK).min(n_x);
        let x_tiled = t1 - (t1 - t0) % TILE_TOKENS;
        for r in (0..w_tiled).step_by(TILE_ROWS) {
            for t in (t0..x_tiled).step_by(TILE_TOKENS) {
                tinyblas_tile(
                    order,
                    std::array::from_fn(|i| wrow(r + i)),
                    std::array::from_fn(|j| xrow(t + j)),
                    &mut tile,
                );
                for (i, row) in tile.iter().enumerate() {
                    out[(r + i) * n_x + t..(r + i) * n_x + t + TILE_TOKENS].copy_from_slice(row);
                }
            }
            for t in x_tiled..t1 {
                for i in 0..TILE_ROWS {
                    out[(r + i) * n_x + t] = tinyblas_dot(order, wrow(r + i), xrow(t));
                }
            }
        }
        for r in w_tiled..n_w {
            for t in t0..t1 {
                out[r * n_x + t] = tinyblas_dot(order, wrow(r), xrow(t));
            }
        }
    }
}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values uniform in [-1, 1) from a fixed seed.
    fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    fn two_threads() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap()
    }

    /// F32 and F16 weights against two or more rows, tiled and blocked over the activations,
    /// give each output the bits of one tinyBLAS dot of its weight row and activation row (the
    /// untiled loop), in both orders, with rows left over at every edge.
    #[test]
    fn tiled_f32_f16_equal_one_tinyblas_dot_per_output() {
        let (mut rnd, pool) = (uniform(11), two_threads());
        let (n_in, n_out) = (96, 37);
        for ty in [GgmlType::F32, GgmlType::F16] {
            let vals: Vec<f32> = (0..n_in * n_out).map(|_| rnd()).collect();
            let data: Vec<u8> = match ty {
                GgmlType::F16 => vals
                    .iter()
                    .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
                    .collect(),
                _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            let w = Weight {
                name: "w",
                ty,
                n_in,
                n_out,
                data: &data,
            };
            let wf = widen(ty, &data);
            for order in [Order::GgmlAvx512, Order::GgmlAvx2] {
                for n_rows in [2, 3, TOKEN_BLOCK + 1, 2 * TOKEN_BLOCK + 3] {
                    let x: Vec<f32> = (0..n_rows * n_in).map(|_| rnd()).collect();
                    let y = pool.install(|| matmul(order, &w, &x, n_rows, &[])).unwrap();
                    for t in 0..n_rows {
                        let a: Vec<f32> = x[t * n_in..(t + 1) * n_in]
                            .iter()
                            .map(|&v| match ty {
                                GgmlType::F16 => f16::from_f32(v).to_f32(),
                                _ => v,
                            })
                            .collect();
                        for r in 0..n_out {
                            let want = tinyblas_dot(order, &wf[r * n_in..(r + 1) * n_in], &a);
                            assert_eq!(
                                y[t * n_out + r].to_bits(),
                                want.to_bits(),
                                "{ty:?} {order:?} rows {n_rows} t {t} r {r}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every batch size, whichever way it is split over the pool, gives each output the bits
    /// of one `vec_dot` of its weight row and activation row.
    #[test]
    fn every_split_equals_vec_dot_per_output() {
        let (n_in, n_out) = (256, 72);
        let (mut rnd, pool) = (uniform(7), two_threads());
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0] {
            let rb = muser_quant::row_size(ty, n_in).unwrap();
            let mut data = vec![0u8; rb * n_out];
            for row in data.chunks_exact_mut(rb) {
                let src: Vec<f32> = (0..n_in).map(|_| rnd()).collect();
                muser_quant::quantize_row(ty, &src, row).unwrap();
            }
            let w = Weight {
                name: "w",
                ty,
                n_in,
                n_out,
                data: &data,
            };
            let vt = muser_quant::vec_dot_type(ty);
            let ab = muser_quant::row_size(vt, n_in).unwrap();
            for n_rows in [1, 2, 3, 5, FEW_TOKENS, FEW_TOKENS + 1, 40] {
                let x: Vec<f32> = (0..n_rows * n_in).map(|_| rnd()).collect();
                let y = pool
                    .install(|| matmul(Order::GgmlAvx512, &w, &x, n_rows, &[]))
                    .unwrap();
                for t in 0..n_rows {
                    let mut a = vec![0u8; ab];
                    muser_quant::quantize_activations(vt, &x[t * n_in..(t + 1) * n_in], &mut a)
                        .unwrap();
                    for r in 0..n_out {
                        let want = muser_quant::vec_dot(ty, n_in, &data[r * rb..(r + 1) * rb], &a);
                        let got = y[t * n_out + r];
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{ty:?} rows {n_rows} t {t} r {r}"
                        );
                    }
                }
            }
        }
    }
}
