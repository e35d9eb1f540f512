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
//!
//! `tests/golden/*.json` are the default profile's (`ggml-b11434/x86-avx512/fa-on`);
//! `tests/golden/<order>-<fa>/` hold other profiles' goldens (`GOLDEN_PROFILE=...
//! scripts/goldens.sh`, see `docs/exactness.md`), checked with the backend computing that
//! profile (every profile runs on every host: each kernel family computes every order).

mod common;

use common::{golden_dir, golden_files, golden_files_in, greedy, load_golden_model, Golden};
use muser_model::KvType;
use muser_model::{Numerics, Order};

/// Largest |Δlogit| accepted. The CPU kernels reproduce ggml's operation order (including
/// where GCC fuses a multiply and an add), so the goldens match to the printed digit.
const TOL: f32 = 2e-3;

fn check(g: &Golden, name: &str, numerics: Numerics) {
    let model = load_golden_model(g, name, numerics);
    assert_eq!(model.numerics_tag(), Some(numerics.tag()));
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
        check(&g, &name, Numerics::PORTABLE);
    }
}

#[test]
fn every_profile_the_backend_computes_matches_its_goldens() {
    let mut dirs: Vec<_> = std::fs::read_dir(golden_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        // `x86-avx2-fa-off` is the profile `ggml-b11434/x86-avx2/fa-off`
        let (order, fa) = name.rsplit_once("-fa-").unwrap_or_else(|| {
            panic!("golden profile directory {name}: expected <order>-fa-<on|off>")
        });
        let numerics = Numerics {
            order: Order::from_name(order)
                .unwrap_or_else(|| panic!("golden profile directory {name}: unknown order")),
            flash_attn: fa == "on",
        };
        for (file, g) in golden_files_in(&dir) {
            check(&g, &format!("{name}/{file}"), numerics);
        }
    }
}
