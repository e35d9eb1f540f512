//! Prompt-prefix reuse on a sliding-window model (the synthetic `tiny` Muse Glimmer, window 32,
//! no tokenizer): a cut of the cache is reused only while the window before the cut is still
//! stored, and a reused prefix gives the same tokens as a cold run.

use std::sync::Arc;

use muser_engine::{Engine, EngineConfig, Event, GenerateRequest, SamplingParams};
use muser_model::synth::{presets, Plan, WeightType};
use muser_model::{LoadOptions, Model};

fn tiny_model() -> Arc<Model> {
    let dir = std::env::temp_dir().join(format!("muser-engine-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny-q8_0-7.gguf");
    let plan = Plan::new(
        presets::preset("tiny").unwrap(),
        WeightType::from_name("q8_0").unwrap(),
        7,
        None,
    );
    plan.write_file(&path, &mut |_| {}).unwrap();
    let model = Model::load(
        &path,
        &LoadOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let _ = std::fs::remove_file(&path);
    Arc::new(model)
}

fn tokens(n: usize, seed: u64, n_vocab: usize) -> Vec<u32> {
    muser_model::synth::random_tokens(n, n_vocab, seed)
}

fn run(e: &Engine, prompt: &[u32], cache_prompt: bool) -> (Vec<u32>, usize) {
    let mut rx = e
        .submit(GenerateRequest {
            prompt: prompt.to_vec(),
            params: SamplingParams::greedy(),
            max_tokens: Some(6),
            cache_prompt,
            ..Default::default()
        })
        .unwrap();
    let mut ids = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, text, .. } => {
                assert!(text.is_empty(), "no tokenizer, no text");
                ids.push(id);
            }
            Event::Done { n_cached, .. } => return (ids, n_cached),
            other => panic!("{other:?}"),
        }
    }
    panic!("stream ended without Done")
}

#[test]
fn sliding_window_prefix_reuse_only_when_the_window_is_still_cached() {
    let model = tiny_model();
    let info = model.info().clone();
    assert_eq!(info.n_swa, 32);
    let cfg = EngineConfig {
        n_slots: 1,
        n_ctx: 512,
        prefill_chunk: 32,
        ..Default::default()
    };
    let cold = Engine::start_without_tokenizer(model.clone(), cfg.clone()).unwrap();
    let e = Engine::start_without_tokenizer(model, cfg).unwrap();

    let long = tokens(400, 1, info.n_vocab);
    let (_, n) = run(&e, &long, true);
    assert_eq!(n, 0);

    // shares 390 tokens: the window before position 390 is still in the ring
    let mut near = long[..390].to_vec();
    near.extend(tokens(5, 2, info.n_vocab));
    let (ids, n) = run(&e, &near, true);
    assert_eq!(n, 390);
    assert_eq!(ids, run(&cold, &near, false).0);

    // shares 100 tokens: positions 68..100 have left the ring (it holds 256 cells), so the
    // prompt is processed from the start
    let mut far = long[..100].to_vec();
    far.extend(tokens(5, 3, info.n_vocab));
    let (ids, n) = run(&e, &far, true);
    assert_eq!(n, 0);
    assert_eq!(ids, run(&cold, &far, false).0);

    // after a fresh start the whole prompt is inside the ring again: a cut is reused
    let mut longer = far.clone();
    longer.extend(tokens(20, 4, info.n_vocab));
    let (_, n) = run(&e, &longer, true);
    assert!(n >= far.len());
}
