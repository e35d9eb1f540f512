//! Several sequences decoding together, one batch of one row per sequence at each step (what
//! `muser bench --batched` times and the engine's continuous batching runs), after their
//! prompts went in as one stream of batches cut across sequences (as llama-batched-bench
//! feeds them): on a Q8_0 model (whose matmul dots every row alone at any batch size) each
//! sequence's logits, hence its greedy tokens, equal bit for bit those of its run alone.

mod common;

use common::synth_model;
use muser_model::{Batch, KvType, LoadOptions, Model};

const PROMPT: usize = 40;
const N_GEN: usize = 12;

fn model() -> Model {
    let spec = serde_json::json!({"source": "synth", "preset": "tiny", "type": "q8_0", "seed": 5});
    Model::load(
        &synth_model(&spec),
        &LoadOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap()
}

/// The highest logit, the lowest id on a tie.
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of `prompt` alone: the logits of each step (the prompt's last row first).
fn alone(m: &Model, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = m.new_kv(PROMPT + N_GEN, 1, KvType::F16).unwrap();
    let mut logits = m
        .forward(&mut kv, &Batch::single(0, prompt, 0, true))
        .unwrap()
        .logits;
    let mut out = Vec::new();
    for i in 0..N_GEN {
        let t = argmax(&logits);
        out.push(std::mem::take(&mut logits));
        let b = Batch::single(0, &[t], (PROMPT + i) as u32, true);
        logits = m.forward(&mut kv, &b).unwrap().logits;
    }
    out
}

/// Greedy decoding of all `prompts` together: prompt rows in batches of `ubatch` rows, then
/// one row per sequence per step; the logits of each sequence's steps.
fn together(m: &Model, prompts: &[Vec<u32>], ubatch: usize) -> Vec<Vec<Vec<f32>>> {
    let n_vocab = m.info().n_vocab;
    let pl = prompts.len();
    let mut kv = m
        .new_kv_ubatch(PROMPT + N_GEN, pl, KvType::F16, ubatch as u32)
        .unwrap();
    let mut rows = Vec::new();
    for (seq, p) in prompts.iter().enumerate() {
        for (pos, &t) in p.iter().enumerate() {
            rows.push((t, pos as u32, seq as u32, pos + 1 == PROMPT));
        }
    }
    let mut last = vec![Vec::new(); pl];
    for chunk in rows.chunks(ubatch) {
        let mut b = Batch::default();
        for &(t, pos, seq, out) in chunk {
            b.push(t, pos, seq, out);
        }
        let o = m.forward(&mut kv, &b).unwrap();
        let seqs = chunk.iter().filter(|r| r.3).map(|r| r.2 as usize);
        for (k, seq) in seqs.enumerate() {
            last[seq] = o.row(k, n_vocab).to_vec();
        }
    }
    let mut out = vec![Vec::new(); pl];
    for i in 0..N_GEN {
        let mut b = Batch::default();
        for (seq, l) in last.iter().enumerate() {
            b.push(argmax(l), (PROMPT + i) as u32, seq as u32, true);
        }
        out.iter_mut()
            .zip(&mut last)
            .for_each(|(o, l)| o.push(std::mem::take(l)));
        let o = m.forward(&mut kv, &b).unwrap();
        for (seq, l) in last.iter_mut().enumerate() {
            *l = o.row(seq, n_vocab).to_vec();
        }
    }
    out
}

#[test]
fn each_sequence_of_a_batched_decode_equals_its_run_alone() {
    let m = model();
    let n_vocab = m.info().n_vocab;
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|s| muser_model::synth::random_tokens(PROMPT, n_vocab, 100 + s))
        .collect();
    let solo: Vec<_> = prompts.iter().map(|p| alone(&m, p)).collect();
    // 13 does not divide the prompt: batches hold the end of one prompt and the start of the
    // next
    for pl in [1, 3, 8] {
        let got = together(&m, &prompts[..pl], 13);
        for (seq, steps) in got.iter().enumerate() {
            let want = &solo[seq];
            let tokens = |s: &[Vec<f32>]| s.iter().map(|l| argmax(l)).collect::<Vec<_>>();
            assert_eq!(
                tokens(steps),
                tokens(want),
                "{pl} sequences, sequence {seq}"
            );
            assert!(
                steps == want,
                "{pl} sequences, sequence {seq}: logits differ"
            );
        }
    }
}
