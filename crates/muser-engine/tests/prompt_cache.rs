//! The prompt cache across requests and restarts, on the synthetic `tiny` Muse Glimmer
//! (sliding window 32; prompts of 700 tokens, far longer than the window): an engine started
//! on the directory an earlier engine filled resumes the block-aligned prefix from disk (and
//! later from memory) and produces the same greedy tokens as computing everything; a tampered
//! pack is refused at use and a foreign one at start-up, and the prompt is then recomputed
//! with the same output.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use muser_engine::{
    Engine, EngineConfig, Event, GenerateRequest, KvPackContext, PromptCache, PromptCacheConfig,
    SamplingParams,
};
use muser_kvpack::Keys;
use muser_model::synth::{presets, Plan, WeightType};
use muser_model::{KvType, LoadOptions, Model};

const N_PROMPT: usize = 700;
const STEPS: u32 = 6;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("muser-prompt-cache-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny model written to `dir` (same seed, same bytes) and loaded.
fn tiny_model(dir: &Path) -> Arc<Model> {
    let path = dir.join("tiny-q8_0-11.gguf");
    if !path.exists() {
        let plan = Plan::new(
            presets::preset("tiny").unwrap(),
            WeightType::from_name("q8_0").unwrap(),
            11,
            None,
        );
        plan.write_file(&path, &mut |_| {}).unwrap();
    }
    let model = Model::load(
        &path,
        &LoadOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(model.info().n_swa, 32);
    Arc::new(model)
}

fn tokens(n: usize, seed: u64, n_vocab: usize) -> Vec<u32> {
    muser_model::synth::random_tokens(n, n_vocab, seed)
}

fn cache(model: &Model, dir: &Path, key: u8) -> Arc<PromptCache> {
    let ctx =
        Arc::new(KvPackContext::new(model, None, KvType::F16, Keys::derive(&[key; 32])).unwrap());
    let (pc, _) = PromptCache::open(ctx, &PromptCacheConfig::new(dir)).unwrap();
    Arc::new(pc)
}

fn engine(model: &Arc<Model>, pc: Option<Arc<PromptCache>>) -> Engine {
    let cfg = EngineConfig {
        n_slots: 2,
        n_ctx: 1024,
        prefill_chunk: 64,
        kv_type: KvType::F16,
        prompt_cache: pc,
        ..Default::default()
    };
    Engine::start_without_tokenizer(model.clone(), cfg).unwrap()
}

/// Greedy tokens and `n_cached` of one request.
fn run(e: &Engine, prompt: &[u32], slot: Option<usize>) -> (Vec<u32>, usize) {
    let mut rx = e
        .submit(GenerateRequest {
            prompt: prompt.to_vec(),
            params: SamplingParams::greedy(),
            max_tokens: Some(STEPS),
            slot,
            ..Default::default()
        })
        .unwrap();
    let mut ids = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, .. } => ids.push(id),
            Event::Done { n_cached, .. } => return (ids, n_cached),
            other => panic!("{other:?}"),
        }
    }
    panic!("stream ended without Done")
}

fn pack_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir.join("packs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

/// The greedy tokens of `prompt` computed from scratch.
fn cold(model: &Arc<Model>, prompt: &[u32]) -> Vec<u32> {
    let (ids, n_cached) = run(&engine(model, None), prompt, None);
    assert_eq!(n_cached, 0);
    ids
}

#[test]
fn a_restarted_engine_resumes_the_prefix_from_disk_then_memory_with_identical_output() {
    let dir = scratch("restart");
    let store = dir.join("cache");
    let model = tiny_model(&dir);
    let n_vocab = model.info().n_vocab;
    let prompt = tokens(N_PROMPT, 1, n_vocab);
    // shares the first 600 tokens with `prompt`
    let mut other = prompt[..600].to_vec();
    other.extend(tokens(90, 2, n_vocab));
    let want = cold(&model, &prompt);
    let want_other = cold(&model, &other);

    // first process: computes and publishes the 512-token prefix (the last block boundary
    // below the prompt's end)
    {
        let pc = cache(&model, &store, 1);
        let e = engine(&model, Some(pc.clone()));
        assert_eq!(run(&e, &prompt, None), (want.clone(), 0));
        pc.flush();
        let s = pc.stats();
        assert!(s.published >= 1, "{s:?}");
        assert_eq!(s.hits_disk + s.hits_memory, 0);
    }
    assert!(!pack_files(&store).is_empty());

    // second process: a fresh model load and engine on the same directory
    let model2 = tiny_model(&dir);
    let pc = cache(&model2, &store, 1);
    let e = engine(&model2, Some(pc.clone()));
    let (ids, n_cached) = run(&e, &prompt, Some(0));
    assert_eq!(n_cached, 512, "the block-aligned prefix comes from disk");
    assert_eq!(ids, want, "resumed output equals the cold output");
    assert_eq!(pc.stats().hits_disk, 1);

    // the disk hit filled the memory tier: another slot resumes from memory
    let (ids, n_cached) = run(&e, &prompt, Some(1));
    assert_eq!((ids, n_cached), (want.clone(), 512));
    assert_eq!(pc.stats().hits_memory, 1, "{:?}", pc.stats());

    // a different prompt sharing 600 tokens resumes at least the shared 512-token block
    // prefix (both slots' own caches hold `prompt`, but past the window of the cut)
    let (ids, n_cached) = run(&e, &other, None);
    assert_eq!(ids, want_other);
    assert!(n_cached >= 512, "{n_cached}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Flips one byte at `offset` (from the end when negative) of `path`.
fn flip(path: &Path, offset: i64) {
    let mut b = std::fs::read(path).unwrap();
    let i = if offset < 0 {
        (b.len() as i64 + offset) as usize
    } else {
        offset as usize
    };
    b[i] ^= 0x40;
    std::fs::write(path, b).unwrap();
}

#[test]
fn tampered_and_foreign_packs_are_refused_and_the_prompt_recomputed() {
    let dir = scratch("tamper");
    let store = dir.join("cache");
    let model = tiny_model(&dir);
    let prompt = tokens(N_PROMPT, 3, model.info().n_vocab);
    let want = cold(&model, &prompt);
    let publish = |store: &Path, key: u8| {
        let pc = cache(&model, store, key);
        let e = engine(&model, Some(pc.clone()));
        assert_eq!(run(&e, &prompt, None).0, want);
        pc.flush();
        assert_eq!(pc.stats().disk_packs, 1);
    };
    publish(&store, 1);

    // a flipped byte inside the K/V segments: the store opens (header and seal are intact),
    // the restore's SHA-256 check refuses the pack, which is removed; the request recomputes
    // and publishes a good pack again
    let packs = pack_files(&store);
    assert_eq!(packs.len(), 1);
    flip(&packs[0], -100);
    {
        let pc = cache(&model, &store, 1);
        let e = engine(&model, Some(pc.clone()));
        let (ids, n_cached) = run(&e, &prompt, None);
        assert_eq!((ids, n_cached), (want.clone(), 0));
        pc.flush();
        let s = pc.stats();
        assert_eq!((s.rejected, s.hits_disk), (1, 0), "{s:?}");
        assert_eq!(s.disk_packs, 1, "republished after the recompute");
    }
    // ... and the republished pack serves the next process
    {
        let pc = cache(&model, &store, 1);
        let e = engine(&model, Some(pc.clone()));
        assert_eq!(run(&e, &prompt, None), (want.clone(), 512));
    }

    // a flipped byte in the manifest: refused at start-up (quarantined)
    let packs = pack_files(&store);
    assert_eq!(packs.len(), 1);
    flip(&packs[0], 40);
    {
        let pc = cache(&model, &store, 1);
        assert_eq!(pc.stats().quarantined_at_open, 1);
        let e = engine(&model, Some(pc.clone()));
        assert_eq!(run(&e, &prompt, None), (want.clone(), 0));
    }

    // a pack sealed with another operator key, copied into this store: refused at start-up
    let foreign = dir.join("foreign");
    publish(&foreign, 2);
    let fresh = dir.join("fresh");
    {
        // a store of key 1 that has never seen the prompt
        drop(cache(&model, &fresh, 1));
    }
    let src = &pack_files(&foreign)[0];
    std::fs::copy(src, fresh.join("packs").join(src.file_name().unwrap())).unwrap();
    {
        let pc = cache(&model, &fresh, 1);
        assert_eq!(pc.stats().quarantined_at_open, 1);
        let e = engine(&model, Some(pc.clone()));
        assert_eq!(run(&e, &prompt, None), (want.clone(), 0));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn short_prompts_are_not_published_cache_prompt_false_bypasses_and_the_ledger_stays_one_entry() {
    let dir = scratch("short");
    let store = dir.join("cache");
    let model = tiny_model(&dir);
    let n_vocab = model.info().n_vocab;
    let pc = cache(&model, &store, 1);
    let e = engine(&model, Some(pc.clone()));
    // 200 tokens and 6 generated: not one whole block
    run(&e, &tokens(200, 5, n_vocab), None);
    pc.flush();
    assert_eq!(pc.stats().disk_packs, 0);

    let prompt = tokens(N_PROMPT, 6, n_vocab);
    let mut rx = e
        .submit(GenerateRequest {
            prompt: prompt.clone(),
            params: SamplingParams::greedy(),
            max_tokens: Some(1),
            cache_prompt: false,
            ..Default::default()
        })
        .unwrap();
    while rx.blocking_recv().is_some() {}
    pc.flush();
    assert_eq!(
        pc.stats().disk_packs,
        0,
        "cache_prompt: false publishes nothing"
    );

    // two prompts, two packs, one replay stream: the ledger keeps a single entry
    // (8-byte magic, count, one 40-byte entry, 32-byte seal)
    run(&e, &tokens(N_PROMPT, 7, n_vocab), None);
    run(&e, &tokens(N_PROMPT, 8, n_vocab), None);
    pc.flush();
    assert_eq!(pc.stats().disk_packs, 2);
    let ledger = std::fs::metadata(store.join("ledger.bin")).unwrap().len();
    assert_eq!(ledger, 8 + 4 + 40 + 32);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_disk_load_while_another_slot_decodes_leaves_both_outputs_exact() {
    let dir = scratch("concurrent");
    let store = dir.join("cache");
    let model = tiny_model(&dir);
    let n_vocab = model.info().n_vocab;
    let prompt = tokens(N_PROMPT, 21, n_vocab);
    let busy = tokens(100, 22, n_vocab);
    let want = cold(&model, &prompt);
    let want_busy = {
        let e = engine(&model, None);
        let mut rx = e
            .submit(GenerateRequest {
                prompt: busy.clone(),
                params: SamplingParams::greedy(),
                max_tokens: Some(48),
                ..Default::default()
            })
            .unwrap();
        let mut ids = Vec::new();
        while let Some(ev) = rx.blocking_recv() {
            if let Event::Token { id, .. } = ev {
                ids.push(id);
            }
        }
        ids
    };
    {
        let pc = cache(&model, &store, 1);
        let e = engine(&model, Some(pc.clone()));
        run(&e, &prompt, None);
    }
    let pc = cache(&model, &store, 1);
    let e = engine(&model, Some(pc.clone()));
    // slot 0 decodes a long answer while slot 1's prefix is read and verified from disk
    let mut rx_busy = e
        .submit(GenerateRequest {
            prompt: busy.clone(),
            params: SamplingParams::greedy(),
            max_tokens: Some(48),
            slot: Some(0),
            ..Default::default()
        })
        .unwrap();
    let (ids, n_cached) = run(&e, &prompt, Some(1));
    assert_eq!((ids, n_cached), (want, 512));
    let mut got_busy = Vec::new();
    while let Some(ev) = rx_busy.blocking_recv() {
        if let Event::Token { id, .. } = ev {
            got_busy.push(id);
        }
    }
    assert_eq!(got_busy, want_busy);
    assert_eq!(pc.stats().hits_disk, 1);
    let _ = std::fs::remove_dir_all(&dir);
}
