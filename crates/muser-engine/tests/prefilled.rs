//! A prefill computed by another engine (`GenerateRequest::prefilled`, what the prefill lane
//! installs), on the synthetic `tiny` Muse Glimmer (window 32, ring wrapping): installed, it
//! gives the tokens of computing the prompt here and names its producer in the timings; K/V
//! of another engine ABI is never published to the prompt cache, this engine's own is; a
//! delta whose base the slot does not hold is ignored and the prompt computed here.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use muser_engine::{
    Engine, EngineConfig, Event, GenerateRequest, KvPackContext, Prefilled, PromptCache,
    PromptCacheConfig, SamplingParams,
};
use muser_kvpack::Keys;
use muser_model::synth::{presets, Plan, WeightType};
use muser_model::{KvType, LoadOptions, Model};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("muser-prefilled-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tiny_model(dir: &Path) -> Arc<Model> {
    let path = dir.join("tiny.gguf");
    let plan = Plan::new(
        presets::preset("tiny").unwrap(),
        WeightType::from_name("q8_0").unwrap(),
        11,
        None,
    );
    plan.write_file(&path, &mut |_| {}).unwrap();
    Arc::new(
        Model::load(
            &path,
            &LoadOptions {
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

fn ctx(model: &Model) -> Arc<KvPackContext> {
    Arc::new(KvPackContext::new(model, None, KvType::F16, Keys::derive(&[3; 32])).unwrap())
}

fn engine(model: &Arc<Model>, pc: Option<Arc<PromptCache>>) -> Engine {
    let cfg = EngineConfig {
        n_slots: 1,
        n_ctx: 1024,
        prefill_chunk: 64,
        prompt_cache: pc,
        ..Default::default()
    };
    Engine::start_without_tokenizer(model.clone(), cfg).unwrap()
}

/// Greedy tokens, `n_cached` and the producer named in the timings.
fn run(
    e: &Engine,
    prompt: &[u32],
    prefilled: Option<Prefilled>,
) -> (Vec<u32>, usize, Option<String>) {
    let mut rx = e
        .submit(GenerateRequest {
            prompt: prompt.to_vec(),
            params: SamplingParams::greedy(),
            max_tokens: Some(6),
            prefilled: prefilled.map(Arc::new),
            ..Default::default()
        })
        .unwrap();
    let mut ids = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, .. } => ids.push(id),
            Event::Done {
                n_cached, timings, ..
            } => return (ids, n_cached, timings.producer.map(|p| p.to_string())),
            other => panic!("{other:?}"),
        }
    }
    panic!("stream ended without Done")
}

#[test]
fn an_installed_prefill_decodes_like_local_and_foreign_numerics_are_never_published() {
    let dir = scratch("install");
    let model = tiny_model(&dir);
    let prompt = muser_model::synth::random_tokens(700, model.info().n_vocab, 5);
    let (want, _, _) = run(&engine(&model, None), &prompt, None);

    // a "producer": the first 320 tokens prefilled on another engine, exported
    let producer = engine(&model, None);
    let c = ctx(&model);
    let mut rx = producer
        .submit(GenerateRequest {
            prompt: prompt[..320].to_vec(),
            max_tokens: Some(0),
            slot: Some(0),
            ..Default::default()
        })
        .unwrap();
    while !matches!(rx.blocking_recv(), Some(Event::Done { .. }) | None) {}
    let state = producer.export_slot_state(0, &c, Vec::new()).unwrap().state;
    assert_eq!(state.positions, 0..320);

    for (foreign, published) in [(true, false), (false, true)] {
        let pc_dir = dir.join(format!("cache-{foreign}"));
        let mut pcc = PromptCacheConfig::new(&pc_dir);
        pcc.min_tokens = 256;
        let (pc, _) = PromptCache::open(ctx(&model), &pcc).unwrap();
        let pc = Arc::new(pc);
        let e = engine(&model, Some(pc.clone()));
        let p = Prefilled {
            state: state.clone(),
            producer: Arc::from("prod"),
            took: std::time::Duration::ZERO,
            foreign_abi: foreign,
        };
        let (got, n_cached, producer) = run(&e, &prompt, Some(p));
        assert_eq!(got, want, "foreign {foreign}");
        assert_eq!(n_cached, 320);
        assert_eq!(producer.as_deref(), Some("prod"));
        pc.flush();
        assert_eq!(pc.stats().published > 0, published, "foreign {foreign}");
    }

    // a delta on a base this (empty) slot does not hold: ignored, computed here
    let delta = producer
        .export_slot_state(
            0,
            &c,
            c.hasher.chain(&prompt[..320]).block_ids()[..1].to_vec(),
        )
        .unwrap();
    assert_eq!(delta.base, 256);
    let p = Prefilled {
        state: delta.state,
        producer: Arc::from("prod"),
        took: std::time::Duration::ZERO,
        foreign_abi: false,
    };
    let (got, n_cached, producer) = run(&engine(&model, None), &prompt, Some(p));
    assert_eq!((got, n_cached, producer), (want, 0, None));
}
