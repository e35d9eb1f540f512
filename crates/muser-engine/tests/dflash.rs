//! Speculative decoding with a DFlash drafter gives plain decoding's greedy tokens (SmolLM2
//! with a synthetic `dflash-tiny` drafter, two slots at once), and a drafter goes only with
//! speculative mode dflash. A random drafter is rarely right, so this checks exactness and
//! that drafts were verified, not speed.

use std::sync::Arc;

use muser_engine::{Engine, EngineConfig, Event, GenerateRequest, SamplingParams};
use muser_gguf::{GgmlType, GgufFile};
use muser_model::models::dflash::Dflash;
use muser_model::synth::dflash::{preset, write_drafter};
use muser_model::{LoadOptions, Model};
use muser_spec::{SpecConfig, SpecMode};
use muser_text::Tokenizer;

mod common;

fn tokens(rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> (Vec<u32>, usize) {
    let mut rx = rx;
    let mut ids = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, .. } => ids.push(id),
            Event::Done { timings, .. } => return (ids, timings.draft_n),
            _ => {}
        }
    }
    panic!("stream ended without Done")
}

#[test]
fn greedy_with_a_dflash_drafter_equals_plain_decoding() {
    let path = common::smollm_path();
    let opts = LoadOptions {
        threads: 2,
        ..Default::default()
    };
    let model = Arc::new(Model::load(&path, &opts).unwrap());
    let tok = Arc::new(Tokenizer::from_gguf(model.gguf()).unwrap());
    let dir = std::env::temp_dir().join(format!("muser-engine-dflash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("dflash.gguf");
    let target = GgufFile::open(&path).unwrap();
    write_drafter(
        &file,
        &preset("dflash-tiny").unwrap(),
        &target,
        GgmlType::F32,
        7,
    )
    .unwrap();
    let drafter = Arc::new(Dflash::load(&file, 1).unwrap());
    std::fs::remove_dir_all(&dir).ok();

    let reqs: Vec<GenerateRequest> = ["The capital of France is", "def fibonacci(n):"]
        .iter()
        .map(|p| GenerateRequest {
            prompt: tok.encode(p, true, false),
            params: SamplingParams::greedy(),
            max_tokens: Some(16),
            ..Default::default()
        })
        .collect();
    let cfg = |spec: bool| EngineConfig {
        n_slots: 2,
        n_ctx: 256,
        prefill_chunk: 64,
        // full blocks whatever the random drafter's acceptance
        spec: spec.then(|| SpecConfig {
            adaptive: false,
            ..SpecConfig::new(SpecMode::Dflash)
        }),
        dflash: spec.then(|| drafter.clone()),
        ..Default::default()
    };
    let plain = Engine::start(model.clone(), tok.clone(), cfg(false)).unwrap();
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| tokens(plain.submit(r.clone()).unwrap()).0)
        .collect();
    let spec = Engine::start(model.clone(), tok.clone(), cfg(true)).unwrap();
    let rxs: Vec<_> = reqs
        .iter()
        .map(|r| spec.submit(r.clone()).unwrap())
        .collect();
    let mut drafted = 0;
    for (i, rx) in rxs.into_iter().enumerate() {
        let (got, n) = tokens(rx);
        assert_eq!(got, want[i], "request {i}");
        drafted += n;
    }
    assert!(drafted > 0, "the drafter proposed tokens");

    // a drafter without mode dflash, or mode dflash without a drafter, is refused
    let lone = EngineConfig {
        dflash: Some(drafter.clone()),
        ..cfg(false)
    };
    assert!(Engine::start(model.clone(), tok.clone(), lone).is_err());
    let bare = EngineConfig {
        dflash: None,
        ..cfg(true)
    };
    assert!(Engine::start(model, tok, bare).is_err());
}
