//! Images in a prompt (`GenerateRequest::images`) on the synthetic `tiny` Muse Glimmer: the
//! tokens after an image equal a forward pass fed the same rows by hand in mtmd's chunks; an
//! image's rows are identified by its digest, so a slot's cached prefix and the prompt cache
//! (its packs) resume a prompt only for the same image; bad image spans are refused.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use muser_engine::{
    Engine, EngineConfig, Event, GenerateRequest, KvPackContext, PromptCache, PromptCacheConfig,
    PromptImage, SamplingParams, SubmitError,
};
use muser_kvpack::Keys;
use muser_model::synth::{presets, random_tokens, Plan, WeightType};
use muser_model::{Batch, InputEmbd, KvType, LoadOptions, Model};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("muser-images-{}-{name}", std::process::id()));
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
    let opts = LoadOptions {
        threads: 2,
        ..Default::default()
    };
    Arc::new(Model::load(&path, &opts).unwrap())
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

/// An image of `n` rows at prompt index `at`: values from `seed`, identified by `digest`.
fn image(model: &Model, at: usize, n: usize, seed: u32, digest: u8) -> PromptImage {
    let mut x = seed.wrapping_mul(2_654_435_761).max(1);
    let values = (0..n * model.info().n_embd)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect();
    PromptImage {
        at,
        n_tokens: n,
        values: Arc::new(values),
        digest: [digest; 32],
    }
}

/// A prompt of `len` tokens with `img`'s rows (placeholders) in it.
fn prompt_with(model: &Model, len: usize, img: &PromptImage) -> Vec<u32> {
    let mut p = random_tokens(len, model.info().n_vocab, 5);
    p[img.span()].fill(0);
    p
}

/// Greedy tokens and how many prompt tokens came from a cache.
fn run(e: &Engine, prompt: &[u32], img: &PromptImage, n: u32) -> (Vec<u32>, usize) {
    let mut rx = e
        .submit(GenerateRequest {
            prompt: prompt.to_vec(),
            params: SamplingParams::greedy(),
            max_tokens: Some(n),
            images: vec![img.clone()],
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

#[test]
fn tokens_after_an_image_equal_the_rows_fed_by_hand() {
    let dir = scratch("hand");
    let model = tiny_model(&dir);
    let img = image(&model, 6, 5, 1, 1);
    let prompt = prompt_with(&model, 15, &img);
    let (got, _) = run(&engine(&model, None), &prompt, &img, 6);

    // text, the image's rows alone, text: then one token a step
    let mut kv = model.new_kv(1024, 1, KvType::F16).unwrap();
    let mut logits = Vec::new();
    for (i, chunk) in [0..6, 6..11, 11..15].into_iter().enumerate() {
        let mut b = Batch::single(0, &prompt[chunk.clone()], chunk.start as u32, true);
        if i == 1 {
            b.input_embd = InputEmbd {
                rows: (0..5).collect(),
                values: img.values.to_vec(),
            };
        }
        logits = model.forward(&mut kv, &b).unwrap().logits;
    }
    let mut want = Vec::new();
    for pos in 15..21 {
        let id = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .unwrap() as u32;
        want.push(id);
        logits = model
            .forward(&mut kv, &Batch::single(0, &[id], pos, true))
            .unwrap()
            .logits;
    }
    assert_eq!(got, want);
}

#[test]
fn another_image_never_resumes_a_cached_prefix() {
    let dir = scratch("identity");
    let model = tiny_model(&dir);
    let c =
        Arc::new(KvPackContext::new(&model, None, KvType::F16, Keys::derive(&[3; 32])).unwrap());
    let mut pcc = PromptCacheConfig::new(dir.join("cache"));
    pcc.min_tokens = 256;
    let (pc, _) = PromptCache::open(c, &pcc).unwrap();
    let pc = Arc::new(pc);
    let e = engine(&model, Some(pc.clone()));
    let a = image(&model, 10, 8, 1, 0xa);
    let b = image(&model, 10, 8, 2, 0xb);
    // the same pixels' rows under another digest: a different image to the caches
    let a2 = PromptImage {
        digest: [0xc; 32],
        ..a.clone()
    };
    let prompt = prompt_with(&model, 300, &a);

    let (with_a, cached) = run(&e, &prompt, &a, 4);
    assert_eq!(cached, 0);
    pc.flush();
    assert!(
        pc.stats().published > 0,
        "the prefix with image a is published"
    );
    assert_eq!(
        run(&e, &prompt, &a, 4),
        (with_a.clone(), 299),
        "same image: the slot's cache"
    );

    // image b: at most the text before the image is reused (a sliding-window cache cut back
    // inside its window is not), and b's tokens are its own
    let (with_b, cached) = run(&e, &prompt, &b, 4);
    assert!(cached <= 10, "{cached}");
    assert_eq!(with_b, run(&engine(&model, None), &prompt, &b, 4).0);
    pc.flush();
    // the slot now holds b: image a resumes from the prompt cache's 256-token pack of a
    assert_eq!(run(&e, &prompt, &a, 4), (with_a, 256));
    // a2 resumes neither the slot (a) nor a pack
    let cached = run(&e, &prompt, &a2, 4).1;
    assert!(cached <= 10, "{cached}");
}

#[test]
fn bad_image_spans_are_refused() {
    let dir = scratch("bad");
    let model = tiny_model(&dir);
    let e = engine(&model, None);
    let n_embd = model.info().n_embd;
    let submit = |images: Vec<PromptImage>| {
        e.submit(GenerateRequest {
            prompt: vec![1; 20],
            images,
            ..Default::default()
        })
        .map(|_| ())
    };
    let img = |at, n| image(&model, at, n, 3, 3);
    let short = PromptImage {
        values: Arc::new(vec![0.0; n_embd]),
        ..img(2, 2)
    };
    for (what, images) in [
        ("past the last row", vec![img(15, 5)]),
        ("overlapping", vec![img(2, 4), img(5, 2)]),
        ("descending", vec![img(10, 2), img(2, 2)]),
        ("empty", vec![img(2, 0)]),
        ("values for one row of two", vec![short]),
    ] {
        assert!(
            matches!(submit(images), Err(SubmitError::BadImage(_))),
            "{what}"
        );
    }
    assert!(submit(vec![img(2, 4), img(6, 2)]).is_ok());
}
