//! What a greedy step costs the host sampler on one logits row, by vocabulary size: the direct
//! argmax over the raw row (the path `Sampler::sample` takes when nothing changes the row: no
//! grammar, logit bias, active penalties or logprobs) against the candidate-list path (the
//! same row with a zero logit bias on token 0, which changes no value but takes the list).
//!
//! `cargo bench -p muser-engine --bench sampling` prints a table (median of 7 runs of 200
//! samples each) and writes docs/receipts/sampling-greedy.json. Both paths must pick the same
//! token on every row, or the program exits 1.

use std::time::Instant;

use muser_engine::{Sampler, SamplingParams};

const RUNS: usize = 7;
const SAMPLES: usize = 200;

/// A deterministic row with a few repeated maxima.
fn row(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).max(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 20000) as f32 / 1000.0 - 10.0
        })
        .collect()
}

/// Median microseconds per sample over [`RUNS`] runs, and the last token.
fn time(s: &mut Sampler, rows: &[Vec<f32>]) -> (f64, Vec<u32>) {
    let mut us = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..RUNS {
        ids.clear();
        let t = Instant::now();
        for i in 0..SAMPLES {
            ids.push(s.sample(&rows[i % rows.len()]).id);
        }
        us.push(t.elapsed().as_secs_f64() * 1e6 / SAMPLES as f64);
    }
    us.sort_by(f64::total_cmp);
    (us[RUNS / 2], ids)
}

/// The checkout's commit, when git can tell.
fn commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn main() {
    let direct_params = SamplingParams::greedy();
    let list_params = SamplingParams {
        logit_bias: vec![(0, 0.0)],
        ..SamplingParams::greedy()
    };
    let mut results = Vec::new();
    let mut ok = true;
    println!("| vocabulary | direct argmax (µs) | candidate list (µs) | speed-up |");
    println!("|---:|---:|---:|---:|");
    for n in [49_152usize, 202_048] {
        let rows: Vec<Vec<f32>> = (1..=8).map(|s| row(n, s)).collect();
        let mut direct = Sampler::new(&direct_params, 64).expect("params");
        let mut list = Sampler::new(&list_params, 64).expect("params");
        let (d, di) = time(&mut direct, &rows);
        let (l, li) = time(&mut list, &rows);
        ok &= di == li;
        println!("| {n} | {d:.1} | {l:.1} | {:.1}x |", l / d);
        results.push(serde_json::json!({
            "n_vocab": n, "direct_us": d, "list_us": l, "same_tokens": di == li,
        }));
    }
    let receipt = serde_json::json!({
        "what": "host greedy sampling of one logits row: direct argmax against the candidate list",
        "command": "cargo bench -p muser-engine --bench sampling",
        "commit": commit(),
        "host_threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "stat": format!("median of {RUNS} runs of {SAMPLES} samples"),
        "results": results,
    });
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/receipts/sampling-greedy.json"
    );
    if let Err(e) = std::fs::write(
        path,
        serde_json::to_string_pretty(&receipt).unwrap_or_default(),
    ) {
        eprintln!("could not write {path}: {e}");
    }
    if !ok {
        eprintln!("the two paths picked different tokens");
        std::process::exit(1);
    }
}
