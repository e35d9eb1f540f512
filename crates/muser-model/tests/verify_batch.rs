//! The premise of exact speculative decoding on the CPU backend: the rows of a sequence marked
//! in `Batch::lone_seqs` (a verification: the decode token and its drafts) give bit for bit the
//! logits and K/V of the same tokens fed one at a time, whatever the batch holds beside them
//! (another sequence's decode row and a prefill chunk) and wherever the cache stands: here over
//! 1024 cells (from 512 on a lone query row splits the cells across threads), across a
//! multiple of 256 cells, past 1024 positions, with the sliding-window ring wrapped; for the weight kinds
//! whose batch kernels differ from the one-row kernel (K-quants from 8 rows, F16 from 2) and
//! the others. The same batches without the mark differ, so the mark is what makes them equal.

mod common;

use common::synth_model;
use muser_model::{Batch, KvCache, KvType, LoadOptions, Model};

/// Rows of sequence 0 per verification batch (a decode token and 8 drafts).
const ROWS: usize = 9;
/// Prompt tokens of sequence 2 beside each verification.
const CHUNK: usize = 16;

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

/// A cache with `prompt` in sequence 0 and a few tokens in sequence 1.
fn prefilled(m: &Model, prompt: &[u32]) -> KvCache {
    let mut kv = m.new_kv(1100, 3, KvType::F16).unwrap();
    for (i, part) in prompt.chunks(256).enumerate() {
        let b = Batch::single(0, part, (i * 256) as u32, true);
        m.forward(&mut kv, &b).unwrap();
    }
    let other = muser_model::synth::random_tokens(8, m.info().n_vocab, 11);
    m.forward(&mut kv, &Batch::single(1, &other, 0, true))
        .unwrap();
    kv
}

/// Whether `block` after `prompt`, in batches of [`ROWS`] rows of sequence 0 beside a decode
/// row of sequence 1 and a prefill chunk of sequence 2, gives every row the logits of `steps`.
fn batched_equals(
    m: &Model,
    prompt: &[u32],
    block: &[u32],
    alone: bool,
    steps: &[Vec<f32>],
) -> bool {
    let n_vocab = m.info().n_vocab;
    let mut kv = prefilled(m, prompt);
    let beside = muser_model::synth::random_tokens(64, n_vocab, 12);
    let mut same = true;
    for (k, part) in block.chunks(ROWS).enumerate() {
        let at = prompt.len() + k * ROWS;
        let mut b = Batch::single(0, part, at as u32, false);
        b.push(beside[k], 8 + k as u32, 1, true);
        for (j, &t) in beside[..CHUNK].iter().enumerate() {
            b.push(t, (k * CHUNK + j) as u32, 2, false);
        }
        if alone {
            b.lone_seqs = vec![0];
        }
        let out = m.forward(&mut kv, &b).unwrap();
        same &= (0..part.len()).all(|j| out.row(j, n_vocab) == &steps[k * ROWS + j][..]);
    }
    same
}

#[test]
fn rows_computed_alone_give_the_logits_of_one_token_steps() {
    for ty in ["q8_0", "q4_k", "f16"] {
        let m = model(ty);
        assert!(m.computes_rows_alone());
        let n_vocab = m.info().n_vocab;
        // 1024 cells in view (a lone row splits them), then 1280 from position 1024; the
        // ring (768 cells) wrapped
        let start = 1010;
        let prompt = muser_model::synth::random_tokens(start, n_vocab, 9);
        let block = muser_model::synth::random_tokens(4 * ROWS, n_vocab, 10);
        let mut kv = prefilled(&m, &prompt);
        let steps: Vec<Vec<f32>> = block
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let b = Batch::single(0, &[t], (start + i) as u32, true);
                m.forward(&mut kv, &b).unwrap().logits
            })
            .collect();
        assert!(
            batched_equals(&m, &prompt, &block, true, &steps),
            "{ty} from {start}: rows computed alone"
        );
        assert!(
            !batched_equals(&m, &prompt, &block, false, &steps),
            "{ty} from {start}: the batch kernels were expected to differ"
        );
    }
}

#[test]
fn a_lone_seq_outside_the_pool_is_refused_and_changes_nothing() {
    let m = model("q8_0");
    let mut kv = m.new_kv(64, 1, KvType::F16).unwrap();
    let mut b = Batch::single(0, &[1, 2, 3], 0, true);
    b.lone_seqs = vec![1];
    let e = m.forward(&mut kv, &b).unwrap_err().to_string();
    assert!(e.contains("lone seq 1"), "{e}");
    assert_eq!(kv.seq_len(0), 0, "a refused batch changes nothing");
}
