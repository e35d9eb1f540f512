//! Times `RowDot::dot_tile` (prefill shape: 64 tokens) and one-token rows (decode shape) on one
//! thread; prints the fastest of many short runs (robust to a busy machine).
//! `cargo run --release -p muser-quant --example tile_bench -- [q4_1|q8_0|q4_k|q6_k]`

use muser_quant::{quantize_activations, quantize_row, vec_dot_type, GgmlType, RowDot};
use std::time::Instant;

fn main() {
    let ty = match std::env::args().nth(1).as_deref() {
        Some("q8_0") => GgmlType::Q8_0,
        Some("q4_k") => GgmlType::Q4_K,
        Some("q6_k") => GgmlType::Q6_K,
        _ => GgmlType::Q4_1,
    };
    let (n, rows, toks) = (1536usize, 576usize, 64usize);
    let mut s = 0x1234_5678u64;
    let mut rnd = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let wb = ty.row_bytes(n).unwrap();
    let mut w = vec![0u8; wb * rows];
    for r in w.chunks_exact_mut(wb) {
        let x: Vec<f32> = (0..n).map(|_| rnd()).collect();
        quantize_row(ty, &x, r).unwrap();
    }
    let at = vec_dot_type(ty);
    let ab = at.row_bytes(n).unwrap();
    let mut a = vec![0u8; ab * toks];
    for r in a.chunks_exact_mut(ab) {
        let x: Vec<f32> = (0..n).map(|_| rnd()).collect();
        quantize_activations(at, &x, r).unwrap();
    }
    let k = RowDot::new(ty, n).unwrap();
    let mut out = vec![0f32; rows * toks];
    let mut best = f64::MAX;
    for _ in 0..200 {
        let t = Instant::now();
        k.dot_tile(&w, &a, &mut out, rows);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let mut best1 = f64::MAX;
    for _ in 0..2000 {
        let t = Instant::now();
        k.dot_tile(&w, &a[..ab], &mut out[..rows], rows);
        best1 = best1.min(t.elapsed().as_secs_f64());
    }
    // decode from memory: one token against a matrix far larger than the caches
    let big_rows = (64 << 20) / wb;
    let wbig: Vec<u8> = w.iter().copied().cycle().take(big_rows * wb).collect();
    let mut obig = vec![0f32; big_rows];
    let mut best_mem = f64::MAX;
    for _ in 0..15 {
        let t = Instant::now();
        k.dot_tile(&wbig, &a[..ab], &mut obig, big_rows);
        best_mem = best_mem.min(t.elapsed().as_secs_f64());
    }
    let mut best_two = f64::MAX;
    let half = big_rows / 2;
    for _ in 0..15 {
        let t = Instant::now();
        let (o0, o1) = obig.split_at_mut(half);
        let (w0, w1) = wbig.split_at(half * wb);
        std::thread::scope(|s| {
            s.spawn(|| k.dot_tile(w0, &a[..ab], o0, half));
            k.dot_tile(w1, &a[..ab], o1, big_rows - half);
        });
        best_two = best_two.min(t.elapsed().as_secs_f64());
    }
    println!(
        "{ty}: one token from memory {:.2} GB/s of weights (two threads {:.2} GB/s)",
        wbig.len() as f64 / best_mem / 1e9,
        wbig.len() as f64 / best_two / 1e9
    );
    let macs = (n * rows * toks) as f64;
    println!(
        "{ty}: tile {:.2} GMAC/s ({:.3} ms), one token {:.2} GMAC/s ({:.1} us, L2-resident)",
        macs / best / 1e9,
        best * 1e3,
        (n * rows) as f64 / best1 / 1e9,
        best1 * 1e6
    );
    std::hint::black_box(&out);
}
