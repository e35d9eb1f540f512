//! Prefill schedules over a prompt three sliding windows long.
//!
//! llama.cpp's own numbers depend on the schedule: a batch of 64+ rows of one sequence takes the
//! tiled flash-attention kernel (f32 accumulation), smaller batches the one-chunk kernel (F16 V
//! accumulation), so one-batch and chunked prefill of the same prompt differ in the last bits
//! and, on random synthetic weights, eventually in a greedy pick. Muser reproduces each schedule
//! (`tests/parity.rs` checks one batch, chunks of 20 and token by token against llama.cpp for
//! every synthetic golden). Here: schedules that take the same kernels agree exactly, across
//! window boundaries, and a KV snapshot continues exactly like the cache it came from.

mod common;

use common::{greedy, synth_model};
use muser_model::{Batch, KvType, LoadOptions, Model};

fn tiny_model() -> Model {
    let spec = serde_json::json!({"source": "synth", "preset": "tiny", "type": "q8_0", "seed": 11});
    Model::load(
        &synth_model(&spec),
        &LoadOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap()
}

fn prompt(n: usize, n_vocab: usize) -> Vec<u32> {
    muser_model::synth::random_tokens(n, n_vocab, 12345)
}

#[test]
fn chunked_and_token_by_token_prefill_decode_the_same() {
    let model = tiny_model();
    let i = model.info().clone();
    assert!(i.n_swa > 0 && i.is_swa.iter().any(|&s| s) && i.is_swa.iter().any(|&s| !s));
    let p = prompt(3 * i.n_swa as usize, i.n_vocab);
    let n_gen = 32;
    let mut runs = Vec::new();
    // Chunk sizes that do and do not divide the window; all below the tiled-kernel threshold.
    for (name, chunk) in [
        ("token by token", 1usize),
        ("chunks of 7", 7),
        ("chunks of 20", 20),
        ("chunks of 32", 32),
    ] {
        let mut kv = model.new_kv(256, 1, KvType::F16).unwrap();
        let run = greedy(&model, &mut kv, &p, n_gen, |_| chunk);
        assert_eq!(kv.seq_len(0) as usize, p.len() + n_gen - 1, "{name}");
        runs.push((name, run));
    }
    for (name, run) in &runs[1..] {
        assert_eq!(
            run.tokens, runs[0].1.tokens,
            "{name} differs from token by token"
        );
        assert_eq!(
            run.first_logits, runs[0].1.first_logits,
            "{name}: first-step logits differ"
        );
        assert_eq!(
            run.top_logits, runs[0].1.top_logits,
            "{name}: top logits differ"
        );
    }
}

#[test]
fn exported_prefix_continues_identically_in_another_sequence() {
    let model = tiny_model();
    let i = model.info().clone();
    let p = prompt(3 * i.n_swa as usize, i.n_vocab);
    let mut kv = model.new_kv(256, 2, KvType::F16).unwrap();
    model
        .forward(&mut kv, &Batch::single(0, &p, 0, false))
        .unwrap();
    let snap = kv.export(0, 0..p.len() as u32).unwrap();
    kv.import(1, &snap).unwrap();
    // Both sequences decode the same next tokens, batched together in one forward pass.
    let (mut t0, mut t1) = (p[p.len() - 1], p[p.len() - 1]);
    let n = p.len() as u32;
    for step in 0..8u32 {
        let mut b = Batch::default();
        b.push(t0, n + step, 0, true);
        b.push(t1, n + step, 1, true);
        let out = model.forward(&mut kv, &b).unwrap();
        let a = out.row(0, i.n_vocab);
        let c = out.row(1, i.n_vocab);
        assert_eq!(a, c, "step {step}: sequences diverge");
        let best = a
            .iter()
            .enumerate()
            .fold(0, |m, (j, &x)| if x > a[m] { j } else { m }) as u32;
        t0 = best;
        t1 = best;
    }
}

#[test]
fn rollback_then_redecode_reproduces_the_logits() {
    let model = tiny_model();
    let i = model.info().clone();
    let p = prompt(2 * i.n_swa as usize + 5, i.n_vocab);
    let mut kv = model.new_kv(256, 1, KvType::F16).unwrap();
    model
        .forward(&mut kv, &Batch::single(0, &p, 0, false))
        .unwrap();
    let a = model
        .forward(&mut kv, &Batch::single(0, &[3], p.len() as u32, true))
        .unwrap()
        .logits;
    kv.truncate(0, p.len() as u32);
    assert_eq!(kv.seq_len(0), p.len() as u32);
    let b = model
        .forward(&mut kv, &Batch::single(0, &[3], p.len() as u32, true))
        .unwrap()
        .logits;
    assert_eq!(a, b);
}

#[test]
fn a_prompt_chunk_without_output_rows_fills_the_cache_like_one_with_them() {
    let model = tiny_model();
    let i = model.info().clone();
    let p = prompt(40, i.n_vocab);
    let mut with_rows = model.new_kv(128, 1, KvType::F16).unwrap();
    let mut without_rows = model.new_kv(128, 1, KvType::F16).unwrap();
    let mut quiet = Batch::single(0, &p[..20], 0, true);
    quiet.logits.iter_mut().for_each(|l| *l = false);
    let out = model.forward(&mut without_rows, &quiet).unwrap();
    assert!(out.logits.is_empty());
    model
        .forward(&mut with_rows, &Batch::single(0, &p[..20], 0, true))
        .unwrap();
    let rest = Batch::single(0, &p[20..], 20, true);
    let a = model.forward(&mut with_rows, &rest).unwrap();
    let b = model.forward(&mut without_rows, &rest).unwrap();
    assert_eq!(a.logits, b.logits);
}
