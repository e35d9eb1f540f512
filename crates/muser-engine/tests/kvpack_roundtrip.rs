//! Slots exported and imported as kvpack packs: restoring a pack (full, or a delta on the
//! receiver's own first block) and decoding gives the same greedy tokens and bit-identical
//! logits as computing the prompt locally, on SmolLM2-135M (`MUSER_MODELS`) and on the
//! synthetic `tiny` Muse Glimmer (sliding window 32, prompts longer than the window). Packs
//! for another model, identity, key or token sequence are rejected with kvpack's typed error
//! and leave the slot as it was.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use muser_engine::kvpack_bridge::{KvPackContext, PackError};
use muser_engine::{Engine, EngineConfig, Event, GenerateRequest, SamplingParams};
use muser_kvpack::{IdentityField, Keys, KvpackError, PrefixHasher, ReadLimits};
use muser_model::synth::{presets, Plan, WeightType};
use muser_model::{Batch, KvType, LoadOptions, Model, Numerics, Order};

mod common;

const CHUNK: usize = 64;
const STEPS: usize = 6;

fn tiny_model(seed: u64) -> Arc<Model> {
    tiny_model_in(seed, Numerics::PORTABLE)
}

/// [`tiny_model`] computing in `numerics`.
fn tiny_model_in(seed: u64, numerics: Numerics) -> Arc<Model> {
    let dir = std::env::temp_dir().join(format!("muser-kvpack-bridge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // tests run in parallel: one file per call
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!("tiny-q8_0-{seed}-{n}.gguf"));
    let plan = Plan::new(
        presets::preset("tiny").unwrap(),
        WeightType::from_name("q8_0").unwrap(),
        seed,
        None,
    );
    plan.write_file(&path, &mut |_| {}).unwrap();
    let model = Model::load(
        &path,
        &LoadOptions {
            threads: 2,
            numerics,
        },
    )
    .unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(model.info().n_swa, 32);
    Arc::new(model)
}

fn tokens(n: usize, seed: u64, n_vocab: usize) -> Vec<u32> {
    muser_model::synth::random_tokens(n, n_vocab, seed)
}

fn engine(model: &Arc<Model>, n_slots: usize) -> Engine {
    let cfg = EngineConfig {
        n_slots,
        n_ctx: 512,
        prefill_chunk: CHUNK,
        kv_type: KvType::F16,
        ..Default::default()
    };
    Engine::start_without_tokenizer(model.clone(), cfg).unwrap()
}

fn context(model: &Model, key: u8) -> Arc<KvPackContext> {
    Arc::new(KvPackContext::new(model, None, KvType::F16, Keys::derive(&[key; 32])).unwrap())
}

/// Computes `prompt` into the slot locally, in prefill-sized chunks.
fn prefill(e: &Engine, slot: usize, prompt: &[u32]) {
    let prompt = prompt.to_vec();
    e.with_slot(slot, move |s| {
        s.kv.clear(s.seq);
        s.tokens.clear();
        for chunk in prompt.chunks(CHUNK) {
            let b = Batch::single(s.seq, chunk, s.tokens.len() as u32, true);
            s.model.forward(s.kv, &b).unwrap();
            s.tokens.extend_from_slice(chunk);
        }
    })
    .unwrap();
}

/// Feeds `first` and then `STEPS - 1` greedy tokens one at a time on top of the slot's cache;
/// returns the chosen tokens and the bits of every logits row.
fn probe(e: &Engine, slot: usize, first: u32) -> (Vec<u32>, Vec<Vec<u32>>) {
    e.with_slot(slot, move |s| {
        let n_vocab = s.model.info().n_vocab;
        let (mut ids, mut rows) = (Vec::new(), Vec::new());
        let mut next = first;
        for _ in 0..STEPS {
            let b = Batch::single(s.seq, &[next], s.tokens.len() as u32, true);
            let out = s.model.forward(s.kv, &b).unwrap();
            s.tokens.push(next);
            let row = out.row(0, n_vocab);
            rows.push(row.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
            next = (0..n_vocab)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
                .unwrap() as u32;
            ids.push(next);
        }
        (ids, rows)
    })
    .unwrap()
}

fn generate(e: &Engine, slot: usize, prompt: &[u32]) -> (Vec<u32>, usize) {
    let mut rx = e
        .submit(GenerateRequest {
            prompt: prompt.to_vec(),
            params: SamplingParams::greedy(),
            max_tokens: Some(STEPS as u32),
            slot: Some(slot),
            cache_prompt: true,
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

fn slot_len(e: &Engine, slot: usize) -> (Vec<u32>, u32) {
    e.with_slot(slot, |s| (s.tokens.clone(), s.kv.seq_len(s.seq)))
        .unwrap()
}

/// Full and delta packs against local compute on `model`, with a prompt of `n_prompt`
/// tokens (the last is fed by the probe, so `n_prompt - 1` are packed).
fn roundtrip(model: Arc<Model>, n_prompt: usize) {
    let n_vocab = model.info().n_vocab;
    let ctx = context(&model, 7);
    let prompt = tokens(n_prompt, 11, n_vocab);
    let cached = &prompt[..n_prompt - 1];
    let last = prompt[n_prompt - 1];

    // sender: computes locally, exports a full pack and a delta for a receiver holding the
    // first block
    let a = engine(&model, 1);
    prefill(&a, 0, cached);
    let full = Arc::new(a.export_slot_pack(0, &ctx, 1).unwrap());

    // receiver: slot 0 for the probe, slot 1 for a generation through the scheduler, slot 2
    // holds the first block and takes the delta
    let b = engine(&model, 3);
    assert_eq!(
        b.import_slot_pack(0, full.clone(), cached.to_vec(), &ctx)
            .unwrap(),
        cached.len()
    );
    assert_eq!(
        b.import_slot_pack(1, full.clone(), cached.to_vec(), &ctx)
            .unwrap(),
        cached.len()
    );
    prefill(&b, 2, &cached[..256]);
    let held = b.slot_block_ids(2, &ctx).unwrap();
    assert_eq!(held.len(), 1);
    let delta = Arc::new(a.export_slot_delta_pack(0, &ctx, 2, held).unwrap());
    assert!(
        delta.len() < full.len(),
        "delta {} bytes, full {}",
        delta.len(),
        full.len()
    );
    assert_eq!(
        b.import_slot_pack(2, delta, cached.to_vec(), &ctx).unwrap(),
        cached.len()
    );

    let (want_ids, want_logits) = probe(&a, 0, last);
    for slot in [0, 2] {
        let (ids, logits) = probe(&b, slot, last);
        assert_eq!(ids, want_ids, "slot {slot}: greedy tokens");
        assert!(
            logits == want_logits,
            "slot {slot}: logits are not bit-identical"
        );
    }
    let (ids, n_cached) = generate(&b, 1, &prompt);
    assert_eq!(n_cached, cached.len(), "the restored prefix is reused");
    assert_eq!(ids, want_ids, "generation on the restored slot");
}

#[test]
fn smollm_full_and_delta_packs_restore_bit_identical() {
    let model = Model::load(
        &common::smollm_path(),
        &LoadOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    roundtrip(Arc::new(model), 300);
}

#[test]
fn sliding_window_full_and_delta_packs_restore_bit_identical() {
    roundtrip(tiny_model(7), 300);
}

#[test]
fn sliding_window_full_pack_of_a_prompt_longer_than_the_window() {
    let model = tiny_model(7);
    let ctx = context(&model, 7);
    let prompt = tokens(100, 3, model.info().n_vocab);
    let a = engine(&model, 1);
    prefill(&a, 0, &prompt[..99]);
    let full = Arc::new(a.export_slot_pack(0, &ctx, 1).unwrap());
    let b = engine(&model, 1);
    b.import_slot_pack(0, full, prompt[..99].to_vec(), &ctx)
        .unwrap();
    let want = probe(&a, 0, prompt[99]);
    assert!(probe(&b, 0, prompt[99]) == want, "tokens and logits bits");
}

#[test]
fn packs_of_another_model_identity_key_or_prompt_are_rejected_and_the_slot_is_unchanged() {
    let model = tiny_model(7);
    let other = tiny_model(8);
    let n_vocab = model.info().n_vocab;
    let ctx = context(&model, 7);
    let prompt = tokens(100, 5, n_vocab);
    let cached = prompt[..99].to_vec();

    // the receiver's slot holds its own prompt
    let b = engine(&model, 1);
    let own = tokens(60, 9, n_vocab);
    prefill(&b, 0, &own);
    let before = slot_len(&b, 0);
    let check = |bytes: Vec<u8>, toks: &[u32], ctx: &Arc<KvPackContext>| {
        let err = b
            .import_slot_pack(0, Arc::new(bytes), toks.to_vec(), ctx)
            .unwrap_err();
        assert_eq!(slot_len(&b, 0), before, "slot changed after {err}");
        err
    };

    // another model (same geometry, other weights)
    let e_other = engine(&other, 1);
    prefill(&e_other, 0, &cached);
    let ctx_other = context(&other, 7);
    let pack = e_other.export_slot_pack(0, &ctx_other, 1).unwrap();
    match check(pack, &cached, &ctx) {
        PackError::Pack(KvpackError::IdentityMismatch(IdentityField::ModelWeights)) => {}
        e => panic!("expected a weights mismatch, got {e:?}"),
    }

    // the same weights computed in another numerics order (the x86-avx2 one)
    let avx2 = tiny_model_in(
        7,
        Numerics {
            order: Order::GgmlAvx2,
            flash_attn: true,
        },
    );
    let e_avx2 = engine(&avx2, 1);
    prefill(&e_avx2, 0, &cached);
    let pack = e_avx2.export_slot_pack(0, &context(&avx2, 7), 1).unwrap();
    match check(pack, &cached, &ctx) {
        PackError::Pack(KvpackError::IdentityMismatch(IdentityField::EngineAbi)) => {}
        e => panic!("expected an engine ABI mismatch across numerics orders, got {e:?}"),
    }

    // same model, another engine ABI
    let a = engine(&model, 1);
    prefill(&a, 0, &cached);
    let keys = Keys::derive(&[7; 32]);
    let mut identity = ctx.identity.clone();
    identity.engine_abi = "muser-other-v9".into();
    let hasher = PrefixHasher::new(&keys, &identity.digest(&keys));
    let ctx_abi = Arc::new(KvPackContext {
        keys,
        identity,
        hasher,
        limits: ReadLimits::default(),
    });
    let pack = a.export_slot_pack(0, &ctx_abi, 1).unwrap();
    match check(pack, &cached, &ctx) {
        PackError::Pack(KvpackError::IdentityMismatch(IdentityField::EngineAbi)) => {}
        e => panic!("expected an engine ABI mismatch, got {e:?}"),
    }

    // another operator key
    let pack = a.export_slot_pack(0, &context(&model, 8), 1).unwrap();
    match check(pack, &cached, &ctx) {
        PackError::Pack(KvpackError::SealMismatch) => {}
        e => panic!("expected a seal mismatch, got {e:?}"),
    }

    // the right pack for other tokens
    let pack = a.export_slot_pack(0, &ctx, 1).unwrap();
    let mut wrong = cached.clone();
    wrong[40] = (wrong[40] + 1) % n_vocab as u32;
    match check(pack.clone(), &wrong, &ctx) {
        PackError::Pack(KvpackError::PrefixMismatch) => {}
        e => panic!("expected a prefix mismatch, got {e:?}"),
    }

    // a damaged pack
    let mut bad = pack.clone();
    let at = bad.len() - 10;
    bad[at] ^= 1;
    match check(bad, &cached, &ctx) {
        PackError::Pack(KvpackError::SegmentDigest { .. }) => {}
        e => panic!("expected a segment digest mismatch, got {e:?}"),
    }

    // and the right pack still restores
    b.import_slot_pack(0, Arc::new(pack), cached.clone(), &ctx)
        .unwrap();
    assert_eq!(slot_len(&b, 0), (cached, 99));
}
