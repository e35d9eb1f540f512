//! DFlash drafter parity: the blocks Muser's drafter proposes equal llama.cpp's draft-dflash
//! path on the same target and drafter (goldens from scripts/dflash-goldens.sh: SmolLM2
//! Q4_1 as the target, a synthetic `dflash-tiny` drafter rebuilt here from preset, type and
//! seed).
//!
//! The test replays llama-server's loop: prefill the prompt, inject its features, then per
//! step draft a block after the last sampled token, verify `[id_last, drafts]` on the target
//! in one batch, keep the agreeing prefix plus one token, inject the features of the batch and
//! forget the rejected positions on both caches.

mod common;

use muser_gguf::{GgmlType, GgufFile, Value as Meta};
use muser_model::models::dflash::Dflash;
use muser_model::synth::dflash::{preset, write_drafter};
use muser_model::{argmax_logits, Batch, KvType, LoadOptions, Model};
use serde_json::Value;

#[test]
fn drafts_equal_llama_cpp_draft_dflash() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/dflash-golden/dflash-tiny.json");
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let meta = &golden["meta"];
    let target_path = common::real_model(meta["target"].as_str().unwrap());
    let target = Model::load(&target_path, &LoadOptions::default()).unwrap();
    let dir = std::env::temp_dir().join(format!("muser-dflash-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let drafter_path = dir.join("dflash.gguf");
    let p = preset(meta["preset"].as_str().unwrap()).unwrap();
    assert_eq!(meta["type"], "f32");
    let seed = meta["seed"].as_u64().unwrap();
    write_drafter(
        &drafter_path,
        &p,
        &GgufFile::open(&target_path).unwrap(),
        GgmlType::F32,
        seed,
    )
    .unwrap();
    let drafter = Dflash::load(&drafter_path, 0).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    drafter.check_target(&target).unwrap();
    let n_draft = golden["n_draft"].as_u64().unwrap() as usize;
    let n_predict = golden["n_predict"].as_u64().unwrap() as usize;
    let layers = drafter.info().target_layers.clone();
    let v = target.info().n_vocab;
    let mut steps = 0;
    for case in golden["cases"].as_array().unwrap() {
        let prompt = common::ids(&case["prompt_ids"]);
        let want_out = common::ids(&case["output_ids"]);
        let want_drafts: Vec<Vec<u32>> = case["drafts"]
            .as_array()
            .unwrap()
            .iter()
            .map(common::ids)
            .collect();
        let mut kv = target.new_kv(1024, 1, KvType::F16).unwrap();
        let mut ctx = drafter.new_context();
        let mut batch = Batch::single(0, &prompt, 0, true);
        batch.capture_layers = layers.clone();
        let out = target.forward(&mut kv, &batch).unwrap();
        drafter
            .inject(&mut ctx, &batch.pos, &out.layer_inp)
            .unwrap();
        let mut got_out = vec![argmax_logits(out.row(0, v))];
        let mut got_drafts = Vec::new();
        while got_out.len() < n_predict {
            let id_last = *got_out.last().unwrap();
            let pos0 = (prompt.len() + got_out.len() - 1) as u32;
            // llama-server drafts a whole block and keeps what fits before n_predict.
            let keep = n_draft.min(n_predict - got_out.len() - 1);
            let mut tokens = vec![id_last];
            if keep > 0 {
                let drafts = drafter
                    .draft(&target, &ctx, id_last, pos0, n_draft)
                    .unwrap();
                tokens.extend(&drafts[..keep]);
                got_drafts.push(drafts);
            }
            let mut verify = Batch::single(0, &tokens, pos0, false);
            verify.capture_layers = layers.clone();
            let out = target.forward(&mut kv, &verify).unwrap();
            drafter
                .inject(&mut ctx, &verify.pos, &out.layer_inp)
                .unwrap();
            let mut accepted = 0;
            for r in 0..tokens.len() {
                let t = argmax_logits(out.row(r, v));
                got_out.push(t);
                if tokens.get(r + 1) != Some(&t) {
                    break;
                }
                accepted += 1;
            }
            let pos_next = pos0 + accepted as u32 + 1;
            kv.truncate(0, pos_next);
            ctx.truncate(pos_next);
        }
        got_out.truncate(want_out.len());
        assert_eq!(got_drafts, want_drafts, "drafts after {:?}", case["prompt"]);
        assert_eq!(got_out, want_out, "output after {:?}", case["prompt"]);
        steps += got_drafts.len();
    }
    assert!(steps >= 6, "the goldens hold {steps} drafting steps");
}

/// A drafter file with the good drafter's metadata, `key` replaced by `value` (or dropped),
/// and no tensors.
fn meta_only(
    dir: &std::path::Path,
    good: &GgufFile,
    key: &str,
    value: Option<Meta>,
) -> std::path::PathBuf {
    let path = dir.join(format!("bad-{key}.gguf"));
    let f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    let mut w = muser_gguf::GgufWriter::new(f, 3).unwrap();
    for (k, v) in good.metadata() {
        if k != key {
            w.add(k, v.clone()).unwrap();
        }
    }
    if let Some(v) = value {
        w.add(key, v).unwrap();
    }
    w.write_header().unwrap();
    use std::io::Write;
    w.finish().unwrap().flush().unwrap();
    path
}

#[test]
fn a_bad_drafter_or_the_wrong_target_is_refused_with_a_message() {
    let smol = common::real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let dir = std::env::temp_dir().join(format!("muser-dflash-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("dflash.gguf");
    let target = GgufFile::open(&smol).unwrap();
    write_drafter(
        &file,
        &preset("dflash-tiny").unwrap(),
        &target,
        GgmlType::F32,
        7,
    )
    .unwrap();
    let good = GgufFile::open(&file).unwrap();
    let err = |p: &std::path::Path| Dflash::load(p, 1).unwrap_err().to_string();
    // not a drafter
    assert!(err(&smol).contains("architecture"), "{}", err(&smol));
    let cases: [(&str, Option<Meta>, &str); 4] = [
        ("dflash.target_layers", None, "target_layers"),
        ("dflash.block_size", Some(Meta::U32(100_000)), "block_size"),
        (
            "tokenizer.ggml.mask_token_id",
            Some(Meta::U32(1 << 30)),
            "mask token",
        ),
        (
            "dflash.embedding_length",
            Some(Meta::U32(u32::MAX)),
            "geometry",
        ),
    ];
    for (key, value, want) in cases {
        let p = meta_only(&dir, &good, key, value);
        let e = err(&p);
        assert!(e.contains(want), "{key}: {e}");
    }
    // a drafter for another width
    let tiny = Model::load(
        &common::synth_model(&serde_json::json!({"preset": "tiny", "type": "q8_0", "seed": 7})),
        &LoadOptions::default(),
    )
    .unwrap();
    let d = Dflash::load(&file, 1).unwrap();
    let e = d.check_target(&tiny).unwrap_err().to_string();
    assert!(e.contains("wide"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
