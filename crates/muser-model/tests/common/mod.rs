//! Shared helpers of the integration tests: golden files, model lookup, greedy decoding.
#![allow(dead_code)]

use muser_model::{Batch, KvCache, LoadOptions, Model, Numerics};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

pub struct Case {
    /// Prefill schedule: 0 = one batch, N = batches of N tokens.
    pub chunk: usize,
    pub prompt: Vec<u32>,
    pub tokens: Vec<u32>,
    pub top_logits: Vec<f32>,
    pub first_logits: Option<Vec<f32>>,
}

pub struct Golden {
    pub model: Value,
    pub sha256: String,
    pub n_ctx: usize,
    pub n_threads: usize,
    pub cases: Vec<Case>,
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// Every golden file of the default numerics profile, sorted by name.
pub fn golden_files() -> Vec<(String, Golden)> {
    golden_files_in(&golden_dir())
}

/// Every golden file in `dir`, sorted by name.
pub fn golden_files_in(dir: &std::path::Path) -> Vec<(String, Golden)> {
    let mut out = Vec::new();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    paths.sort();
    for p in paths {
        if p.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        let s = &v["settings"];
        let g = Golden {
            model: v["model"].clone(),
            sha256: v["sha256"].as_str().unwrap().to_string(),
            n_ctx: s["n_ctx"].as_u64().unwrap() as usize,
            n_threads: s["n_threads"].as_u64().unwrap() as usize,
            cases: v["cases"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| Case {
                    chunk: c["chunk"].as_u64().unwrap_or(0) as usize,
                    prompt: ids(&c["prompt"]),
                    tokens: ids(&c["tokens"]),
                    top_logits: floats(&c["top_logits"]),
                    first_logits: c.get("first_logits").map(floats),
                })
                .collect(),
        };
        out.push((p.file_stem().unwrap().to_string_lossy().into_owned(), g));
    }
    out
}

/// Directory of the real test models.
pub fn models_dir() -> PathBuf {
    std::env::var_os("MUSER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/muser/models")
        })
}

/// A real test model by file name; panics with instructions when it is absent.
pub fn real_model(file: &str) -> PathBuf {
    let p = models_dir().join(file);
    assert!(
        p.is_file(),
        "test model {} is missing: run scripts/fetch-models.sh (or set MUSER_MODELS)",
        p.display()
    );
    p
}

pub fn sha256_file(p: &std::path::Path) -> String {
    let mut h = Sha256::new();
    let mut f = std::fs::File::open(p).unwrap();
    std::io::copy(&mut f, &mut h).unwrap();
    hex::encode(h.finalize())
}

/// The model a golden was recorded on, loaded with the golden's thread count, computing in
/// `numerics`.
pub fn load_golden_model(g: &Golden, name: &str, numerics: Numerics) -> Model {
    let opts = LoadOptions {
        threads: g.n_threads,
        numerics,
    };
    let path = match g.model["source"].as_str() {
        Some("file") => real_model(g.model["file"].as_str().unwrap()),
        Some("synth") => synth_model(&g.model),
        other => panic!("{name}: unknown model source {other:?}"),
    };
    assert_eq!(
        sha256_file(&path),
        g.sha256,
        "{name}: {} is not the file the golden was recorded on",
        path.display()
    );
    Model::load(&path, &opts).unwrap()
}

/// Regenerate a synthetic model from a golden's recorded preset, type and seed.
pub fn synth_model(spec: &Value) -> PathBuf {
    let preset = spec["preset"].as_str().unwrap();
    let ty = spec["type"].as_str().unwrap();
    let seed = spec["seed"].as_u64().unwrap();
    let dir = std::env::temp_dir().join(format!("muser-model-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{preset}-{ty}-{seed}.gguf"));
    // Tests of one binary run in parallel; one writer at a time.
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if !path.exists() {
        synth::write(preset, ty, seed, &path);
    }
    path
}

mod synth {
    use muser_model::synth::{presets, Plan, WeightType};

    /// Write the synthetic model `preset`/`ty`/`seed` (no tokenizer) to `path`.
    pub fn write(preset: &str, ty: &str, seed: u64, path: &std::path::Path) {
        let p = presets::preset(preset).unwrap();
        let wt = WeightType::from_name(ty).unwrap();
        let tmp = path.with_extension("part");
        Plan::new(p, wt, seed, None)
            .write_file(&tmp, &mut |_| {})
            .unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }
}

pub struct Run {
    pub tokens: Vec<u32>,
    pub top_logits: Vec<f32>,
    pub first_logits: Vec<f32>,
}

fn argmax(l: &[f32]) -> (u32, f32) {
    let mut best = 0;
    for (i, &x) in l.iter().enumerate() {
        if x > l[best] {
            best = i;
        }
    }
    (best as u32, l[best])
}

/// Prefill `prompt` in chunks of `chunk(pos)` tokens (0 = all at once), then greedily generate
/// `n` tokens one at a time, as the goldens do.
pub fn greedy(
    model: &Model,
    kv: &mut KvCache,
    prompt: &[u32],
    n: usize,
    chunk: impl Fn(usize) -> usize,
) -> Run {
    let n_vocab = model.info().n_vocab;
    let mut p = 0;
    let mut last = Vec::new();
    while p < prompt.len() {
        let c = match chunk(p) {
            0 => prompt.len() - p,
            c => c.min(prompt.len() - p),
        };
        let out = model
            .forward(kv, &Batch::single(0, &prompt[p..p + c], p as u32, true))
            .unwrap();
        last = out.logits;
        p += c;
    }
    let mut run = Run {
        tokens: Vec::new(),
        top_logits: Vec::new(),
        first_logits: last.clone(),
    };
    let mut pos = prompt.len() as u32;
    for s in 0..n {
        let (id, top) = argmax(&last[..n_vocab]);
        run.tokens.push(id);
        run.top_logits.push(top);
        if s + 1 < n {
            last = model
                .forward(kv, &Batch::single(0, &[id], pos, true))
                .unwrap()
                .logits;
            pos += 1;
        }
    }
    run
}
