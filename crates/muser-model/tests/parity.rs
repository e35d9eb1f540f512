//! Greedy decoding equals llama.cpp b11434 on the same GGUF.
//!
//! Goldens (`tests/golden/*.json`) come from `scripts/goldens.sh`, which runs the comparator's
//! libllama with its default context settings (flash attention auto → on, F16 K/V, n_ubatch
//! 512) at the n_ctx and thread count recorded in each file. Each case decodes the prompt in
//! one batch, then generates one token at a time; the test asserts the same token ids, the
//! top-1 logit of every step within `TOL`, and every logit of the first step within `TOL`.
//!
//! SmolLM2 comes from `MUSER_MODELS` (or `~/.cache/muser/models`); synthetic muse models are
//! regenerated with `muser_model::synth` and must hash to the recorded SHA-256.

mod common;

use common::{golden_files, greedy, load_golden_model, Golden};
use muser_model::KvType;

/// Largest |Δlogit| accepted. The CPU kernels reproduce ggml's operation order (including
/// where GCC fuses a multiply and an add), so the goldens match to the printed digit.
const TOL: f32 = 2e-3;

fn check(g: &Golden, name: &str) {
    let model = load_golden_model(g, name);
    let n_vocab = model.info().n_vocab;
    let mut worst = 0f32;
    for (ci, case) in g.cases.iter().enumerate() {
        let mut kv = model.new_kv(g.n_ctx, 1, KvType::F16).unwrap();
        let run = greedy(&model, &mut kv, &case.prompt, case.tokens.len(), |_| {
            case.chunk
        });
        assert_eq!(
            run.tokens, case.tokens,
            "{name} case {ci} (chunk {}): generated ids differ",
            case.chunk
        );
        for (s, (a, b)) in run.top_logits.iter().zip(&case.top_logits).enumerate() {
            let d = (a - b).abs();
            worst = worst.max(d);
            assert!(
                d <= TOL,
                "{name} case {ci} step {s}: top logit {a} vs llama.cpp {b}"
            );
        }
        if let Some(first) = &case.first_logits {
            assert_eq!(first.len(), n_vocab);
            for (v, (a, b)) in run.first_logits.iter().zip(first).enumerate() {
                let d = (a - b).abs();
                worst = worst.max(d);
                assert!(
                    d <= TOL,
                    "{name} case {ci}: first-step logit {v}: {a} vs llama.cpp {b}"
                );
            }
        }
    }
    eprintln!("{name}: {} cases, max |Δlogit| = {worst:e}", g.cases.len());
}

#[test]
fn greedy_matches_llama_cpp_on_every_golden() {
    let files = golden_files();
    assert!(
        !files.is_empty(),
        "no goldens under tests/golden (run scripts/goldens.sh)"
    );
    for (name, g) in files {
        check(&g, &name);
    }
}
