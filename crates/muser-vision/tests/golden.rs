//! The encoder against llama.cpp's libmtmd: the synthetic `vision-tiny` projector, rebuilt
//! from the preset and seed recorded in `tests/golden/goldens.json` (its SHA-256 checked), on
//! each test image; embeddings within a tolerance of the ones `scripts/vision-goldens.sh`
//! recorded, and the same token grid.

use std::path::{Path, PathBuf};

use muser_gguf::{GgmlType, GgufFile};
use muser_model::synth::{presets, Plan, Vocab, WeightType};
use muser_model::{Batch, CpuBackend, InputEmbd, KvType, LoadOptions, Model, Numerics};
use muser_vision::synth::{preset, write_projector};
use muser_vision::{decode, Limits, Projector};
use sha2::{Digest, Sha256};

/// Largest allowed |muser - llama.cpp| over an image's embeddings, relative to the largest
/// |value|: llama.cpp's own embeddings do not move between 1 and 2 threads and move by about
/// 1e-3 of it with flash attention on (`max_abs_*` in goldens.json); ours equal them bit for
/// bit on the `BIT_EXACT` images and differ by about 1.5e-4 of it on the largest one (140
/// patches: attention rows past ggml's 64-value SIMD loops), so the bound is the
/// flash-attention one.
const REL_TOL: f32 = 1e-3;

/// Images whose embeddings equal llama.cpp's bit for bit today; a change that breaks that is
/// caught here.
const BIT_EXACT: [&str; 3] = ["gray-20x52", "rgb-37x23", "rgba-10x9"];

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests")
}

fn floats(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn goldens() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir().join("golden/goldens.json")).unwrap()).unwrap()
}

fn sha256(path: &Path) -> String {
    hex::encode(Sha256::digest(std::fs::read(path).unwrap()))
}

/// The projector the goldens were recorded with, rebuilt in `dir`.
fn projector(doc: &serde_json::Value, dir: &Path) -> Projector {
    let p = &doc["projector"];
    let path = dir.join("mmproj.gguf");
    let ty = match p["type"].as_str().unwrap() {
        "f16" => GgmlType::F16,
        _ => GgmlType::F32,
    };
    let vp = preset(p["preset"].as_str().unwrap()).unwrap();
    write_projector(&path, &vp, ty, p["seed"].as_u64().unwrap()).unwrap();
    assert_eq!(
        sha256(&path),
        p["sha256"].as_str().unwrap(),
        "synthetic projector bytes changed"
    );
    Projector::open(&path).unwrap()
}

fn image_embeddings(proj: &Projector, cpu: &CpuBackend, file: &str) -> muser_vision::Embeddings {
    let bytes = std::fs::read(dir().join("data").join(file)).unwrap();
    let rgb = decode(&bytes, &Limits::default()).unwrap();
    proj.encode(cpu, &proj.preprocess(&rgb).unwrap()).unwrap()
}

#[test]
fn embeddings_match_llama_cpp() {
    let doc = goldens();
    let tmp = tempfile::tempdir().unwrap();
    let proj = projector(&doc, tmp.path());
    let cpu = CpuBackend::new(2).unwrap();
    for img in doc["images"].as_array().unwrap() {
        let name = img["name"].as_str().unwrap();
        let got = image_embeddings(&proj, &cpu, img["file"].as_str().unwrap());
        let want = floats(
            &dir()
                .join("golden")
                .join(img["embeddings"].as_str().unwrap()),
        );
        let grid = img["run"]["chunks"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|c| c.get("image"))
            .unwrap();
        assert_eq!(
            got.n_tokens() as u64,
            grid["n_tokens"].as_u64().unwrap(),
            "{name}: image tokens"
        );
        assert_eq!(got.data.len(), want.len(), "{name}: embedding size");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got
            .data
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!("{name}: max |diff| {diff:.3e} of max |value| {scale:.3e}");
        assert!(
            diff <= REL_TOL * scale,
            "{name}: max |diff| {diff} > {REL_TOL} × {scale}"
        );
        if BIT_EXACT.contains(&name) {
            assert_eq!(diff, 0.0, "{name}: no longer bit-exact");
        }
    }
}

/// The synthetic text model of the goldens (SmolLM2's tokenizer with Muse's special tokens).
fn text_model(doc: &serde_json::Value, dir: &Path) -> Model {
    let t = &doc["text"];
    let models = std::env::var("MUSER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/muser/models")
        });
    let donor = GgufFile::open(&models.join(t["vocab_from"].as_str().unwrap())).unwrap();
    let mut specials = muser_text::muse::SPECIAL_TOKENS.to_vec();
    specials.push("<|endoftext|>");
    let vocab = Vocab::from_donor(&donor, &specials, muser_text::muse::CHAT_TEMPLATE).unwrap();
    let plan = Plan::new(
        presets::preset(t["preset"].as_str().unwrap()).unwrap(),
        WeightType::from_name(t["type"].as_str().unwrap()).unwrap(),
        t["seed"].as_u64().unwrap(),
        Some(vocab),
    );
    let path = dir.join("text.gguf");
    plan.write_file(&path, &mut |_| {}).unwrap();
    assert_eq!(
        sha256(&path),
        t["sha256"].as_str().unwrap(),
        "synthetic text model changed"
    );
    let opts = LoadOptions {
        threads: 2,
        numerics: Numerics::PORTABLE,
    };
    Model::load(&path, &opts).unwrap()
}

/// Text, image rows, text in llama.cpp's chunks (one decode each), then greedy steps: the
/// tokens equal llama-mtmd's, with llama.cpp's image rows on every image (the text model's
/// side of images: `Batch::input_embd`, normalized like token rows) and with this encoder's
/// rows end to end on the `BIT_EXACT` images.
#[test]
fn greedy_after_an_image_matches_llama_cpp() {
    let doc = goldens();
    let tmp = tempfile::tempdir().unwrap();
    let proj = projector(&doc, tmp.path());
    let model = text_model(&doc, tmp.path());
    let cpu = CpuBackend::new(2).unwrap();
    let n_vocab = model.info().n_vocab;
    let images = doc["images"].as_array().unwrap();
    let runs = images.iter().map(|i| (i, false)).chain(
        images
            .iter()
            .filter(|i| BIT_EXACT.contains(&i["name"].as_str().unwrap()))
            .map(|i| (i, true)),
    );
    for (img, ours) in runs {
        let name = img["name"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(img["run"]["tokens"].clone()).unwrap();
        let mut emb = image_embeddings(&proj, &cpu, img["file"].as_str().unwrap());
        if !ours {
            emb.data = floats(
                &dir()
                    .join("golden")
                    .join(img["embeddings"].as_str().unwrap()),
            );
        }
        let mut kv = model.new_kv(1024, 1, KvType::F16).unwrap();
        let mut pos = 0u32;
        let mut last = Vec::new();
        for chunk in img["run"]["chunks"].as_array().unwrap() {
            let batch = match chunk.get("text") {
                Some(ids) => {
                    let ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
                    Batch::single(0, &ids, pos, true)
                }
                None => {
                    let n = emb.n_tokens();
                    Batch {
                        input_embd: InputEmbd {
                            rows: (0..n).collect(),
                            values: emb.data.clone(),
                        },
                        ..Batch::single(0, &vec![0; n], pos, true)
                    }
                }
            };
            pos += batch.len() as u32;
            last = model.forward(&mut kv, &batch).unwrap().logits;
        }
        let mut got = Vec::new();
        for _ in 0..want.len() {
            let row = &last[..n_vocab];
            let id = (0..n_vocab).fold(0, |b, i| if row[i] > row[b] { i } else { b }) as u32;
            got.push(id);
            last = model
                .forward(&mut kv, &Batch::single(0, &[id], pos, true))
                .unwrap()
                .logits;
            pos += 1;
        }
        let rows = if ours { "muser's" } else { "llama.cpp's" };
        assert_eq!(got, want, "{name} with {rows} image rows: greedy tokens");
    }
}
