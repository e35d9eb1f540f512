//! The premise of exact speculative decoding on the CPU backend: within
//! `Model::exact_batch_rows`, as far as the cells the attention visits stay those of a
//! one-token step (`KvCache::uniform_extent`: the count is padded to 256), and while fewer than
//! 512 cells are in view (`Model::rows_attend_as_one`: from 512 on a lone row takes ggml's
//! split-KV kernel and a batch the one-chunk kernel), every row of a multi-token batch of one sequence (a
//! verification: the decode token and its drafts, here beside another sequence's decode row)
//! gives bit for bit the logits and K/V of the same tokens fed one at a time, across the
//! sliding window; and the row bound is tight (one row more takes another kernel). The attention
//! keeps rows exact below 64 rows of one sequence (`chunking.rs`), which is why a verification
//! carries at most 32 drafts.

mod common;

use common::synth_model;
use muser_model::{Batch, KvCache, KvType, LoadOptions, Model};

/// The block crosses position 256.
const PROMPT: usize = 240;

fn model(ty: &str) -> Model {
    let spec = serde_json::json!({"source": "synth", "preset": "tiny", "type": ty, "seed": 3});
    Model::load(
        &synth_model(&spec),
        &LoadOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Sequence 0 takes `block` from position `PROMPT` in batches of `rows` rows (`rows - 1` of
/// its tokens beside one decode token of sequence 1 while that one has tokens), each cut where
/// the cells the attention visits would grow (`KvCache::uniform_extent`, crossed at 256);
/// true when every row's logits equal `steps`.
fn batched_equals(
    m: &Model,
    prompt: &[u32],
    block: &[u32],
    rows: usize,
    steps: &[Vec<f32>],
) -> bool {
    let n_vocab = m.info().n_vocab;
    let mut kv = prefilled(m, prompt);
    let other = muser_model::synth::random_tokens(3, n_vocab, 11);
    let (mut at, mut k) = (0, 0);
    let mut same = true;
    while at < block.len() {
        let beside = k < other.len() && rows >= 2;
        let mut want = (rows - usize::from(beside)).min(block.len() - at) as u32;
        let (cells, ring) = kv.cells_in_view(0, 1).unwrap();
        if !m.rows_attend_as_one(cells.max(ring)) {
            // from 512 cells on, a lone row takes the split-KV kernel
            want = 1;
        }
        let end = at + kv.uniform_extent(0, want) as usize;
        let mut b = Batch::default();
        for (i, &t) in block[at..end].iter().enumerate() {
            b.push(t, (PROMPT + at + i) as u32, 0, true);
        }
        if beside {
            b.push(other[k], (PROMPT + k) as u32, 1, true);
            k += 1;
        }
        let out = m.forward(&mut kv, &b).unwrap();
        same &= (0..end - at).all(|j| out.row(j, n_vocab) == &steps[at + j][..]);
        at = end;
    }
    same
}

fn prefilled(m: &Model, prompt: &[u32]) -> KvCache {
    let mut kv = m.new_kv(1024, 2, KvType::F16).unwrap();
    for seq in 0..2u32 {
        m.forward(&mut kv, &Batch::single(seq, prompt, 0, true))
            .unwrap();
    }
    kv
}

#[test]
fn a_batch_within_the_exact_rows_gives_the_logits_of_one_token_steps() {
    for (ty, exact) in [("q8_0", usize::MAX), ("q4_k", 7), ("f16", 1)] {
        let m = model(ty);
        assert_eq!(m.exact_batch_rows(), exact, "{ty}");
        let n_vocab = m.info().n_vocab;
        let prompt = muser_model::synth::random_tokens(PROMPT, n_vocab, 9);
        let block = muser_model::synth::random_tokens(33, n_vocab, 10);
        let mut kv = prefilled(&m, &prompt);
        let steps: Vec<Vec<f32>> = block
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let b = Batch::single(0, &[t], (PROMPT + i) as u32, true);
                m.forward(&mut kv, &b).unwrap().logits
            })
            .collect();
        for n in [2usize, 7, 34].into_iter().filter(|&n| n <= exact) {
            assert!(
                batched_equals(&m, &prompt, &block, n, &steps),
                "{ty}: batches of {n}"
            );
        }
        if exact < 33 {
            let n = exact + 1;
            assert!(
                !batched_equals(&m, &prompt, &block, n, &steps),
                "{ty}: batches of {n} rows were expected to take another kernel"
            );
        }
    }
}
