//! What grammar-constrained sampling costs per token on SmolLM2's 49,152-token vocabulary.
//!
//! `cargo run --release -p muser-server --example structured_bench [MODEL.gguf]`
//!
//! 1. The sampler alone, replaying the tokens of a JSON object: unconstrained greedy; greedy
//!    with the `json_object` constraint when the best token is allowed (the usual case: one
//!    check); when the best is refused and the next is allowed (a probe of the top
//!    candidates); and the whole-vocabulary mask (the fallback) with a cold cache.
//! 2. End to end through the router: greedy chat completions with and without
//!    `response_format: json_object`, generation time per token.
//!
//! Prints a table and writes `docs/receipts/structured-output.json`.
//!
//! `--micro free|fast|probe|mask [MODEL]` runs one sampler case once over the object's tokens
//! with only the tokenizer loaded, for instruction counts that load on the machine does not
//! disturb: `valgrind --tool=callgrind --toggle-collect='*Sampler*sample*'` (or
//! `'*fill_mask*'` for `mask`), divided by the call count it prints.

use axum::body::{to_bytes, Body};
use axum::http::{header, Request};
use muser_engine::constraint::{gbnf, Constraint, Grammar, Matcher, Vocab};
use muser_engine::{Sampler, SamplingParams};
use muser_server::routes::router;
use muser_server::server::{load, ServeConfig};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tower::ServiceExt;

const OBJECT: &str = r#"{"name": "Felix", "species": "cat", "age": 10, "colors": ["black", "white"], "indoor": true, "notes": "Likes to sleep in the sun and chase small toys around the house."}"#;

/// JSON as a GBNF grammar (the `gbnf` fuzz target's seed): what a user-written grammar's
/// mask costs beside the built-in JSON matcher's.
const JSON_GBNF: &str = include_str!("../../../fuzz/seeds/gbnf/json.gbnf");

fn us(s: f64) -> f64 {
    s * 1e6
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let micro = match args.iter().position(|a| a == "--micro") {
        Some(i) if i + 1 < args.len() => {
            let case = args.remove(i + 1);
            args.remove(i);
            Some(case)
        }
        Some(_) => return Err("--micro needs a case: free, fast, probe or mask".into()),
        None => None,
    };
    let model = args.first().map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var("HOME").unwrap_or_default())
            .join(".cache/muser/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    let mut cfg = ServeConfig::new(model.clone());
    cfg.n_slots = 1;
    cfg.n_ctx = 1024;
    cfg.threads = 2;
    let (state, tok) = if micro.is_some() {
        let gguf = muser_gguf::GgufFile::open(&model)?;
        (None, Arc::new(muser_text::Tokenizer::from_gguf(&gguf)?))
    } else {
        let state = load(&cfg)?;
        let tok = state.tokenizer.clone();
        (Some(state), tok)
    };
    let n_vocab = tok.n_vocab();
    let t = Instant::now();
    let vocab = Arc::new(Vocab::from_tokenizer(&tok, false));
    let vocab_ms = t.elapsed().as_secs_f64() * 1e3;
    let grammar = Arc::new(Grammar::json_object());
    let ids = tok.encode(OBJECT, false, false);
    let eog = vocab.eog_ids()[0];
    let mut seq = ids.clone();
    seq.push(eog);
    let refused = (0..n_vocab as u32)
        .find(|&i| vocab.piece(i).is_some_and(|p| p.is_empty()) && !vocab.is_eog(i))
        .expect("a control token");

    // logits where `best` wins and `second` comes next
    let logits_for = |best: u32, second: Option<u32>| {
        let mut l: Vec<f32> = (0..n_vocab)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        l[best as usize] = 10.0;
        if let Some(s) = second {
            l[s as usize] = 9.0;
        }
        l
    };
    let replay = |constrained: bool, refuse_first: bool, reps: usize| -> (f64, u64) {
        let params = SamplingParams {
            constraint: constrained.then(|| Constraint {
                grammar: grammar.clone(),
                vocab: vocab.clone(),
            }),
            ..SamplingParams::greedy()
        };
        let rows: Vec<Vec<f32>> = seq
            .iter()
            .map(|&id| {
                if refuse_first {
                    logits_for(refused, Some(id))
                } else {
                    logits_for(id, None)
                }
            })
            .collect();
        let mut total = 0.0;
        let mut masked = 0;
        for _ in 0..reps {
            let mut s = Sampler::new(&params, 1024).unwrap();
            let t = Instant::now();
            for (row, &want) in rows.iter().zip(&seq) {
                let got = s.sample(row).id;
                assert_eq!(got, want);
                s.accept(got);
            }
            total += t.elapsed().as_secs_f64();
            masked = s.masked_steps();
        }
        (total / (reps * seq.len()) as f64, masked)
    };
    if let Some(case) = micro {
        let n = match case.as_str() {
            "free" => replay(false, false, 1).1,
            "fast" => replay(true, false, 1).1,
            "probe" => replay(true, true, 1).1,
            "mask" => {
                let mut mask = Vec::new();
                let mut text = Vec::new();
                for &id in &ids {
                    let mut m = Matcher::new(grammar.clone());
                    assert!(m.advance(&text));
                    m.fill_mask(&vocab, &mut mask);
                    text.extend_from_slice(vocab.piece(id).unwrap());
                }
                0
            }
            other => return Err(format!("unknown case `{other}`").into()),
        };
        let calls = if case == "mask" { ids.len() } else { seq.len() };
        println!("{case}: {calls} calls, {n} masked steps");
        return Ok(());
    }
    let state = state.ok_or("no state")?;
    let (free, _) = replay(false, false, 20);
    let (fast, fast_masked) = replay(true, false, 20);
    let (probe, probe_masked) = replay(true, true, 20);

    // the fallback: a whole-vocabulary mask with a cold cache, at every prefix of the object
    // (mean, max seconds), for the built-in JSON grammar and the same language in GBNF
    let mut mask = Vec::new();
    let mut cold_masks = |grammar: &Arc<Grammar>| {
        let mut text = Vec::new();
        let (mut total, mut max) = (0.0f64, 0.0f64);
        for &id in &ids {
            let mut m = Matcher::new(grammar.clone());
            assert!(m.advance(&text));
            let t = Instant::now();
            m.fill_mask(&vocab, &mut mask);
            let dt = t.elapsed().as_secs_f64();
            total += dt;
            max = max.max(dt);
            text.extend_from_slice(vocab.piece(id).unwrap());
        }
        (total / ids.len() as f64, max)
    };
    let (mask_mean, mask_max) = cold_masks(&grammar);
    let json_gbnf = Arc::new(gbnf::compile(JSON_GBNF)?);
    let (gbnf_mean, gbnf_max) = cold_masks(&json_gbnf);
    // the same state again (inside a string): the cache
    let mut m = Matcher::new(grammar.clone());
    m.advance(b"{\"notes\": \"Likes");
    m.fill_mask(&vocab, &mut mask);
    let t = Instant::now();
    for _ in 0..100 {
        m.fill_mask(&vocab, &mut mask);
    }
    let cached = t.elapsed().as_secs_f64() / 100.0;

    // end to end
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let prompts = [
        "Describe a cat as JSON with its name, age and colors.",
        "Give me a JSON object about the city of Paris.",
        "Write a short story.",
    ];
    let mut e2e = Vec::new();
    for p in prompts {
        for json_mode in [false, true] {
            let mut body = json!({
                "messages": [{ "role": "user", "content": p }],
                "temperature": 0, "max_tokens": 64, "cache_prompt": false,
            });
            if json_mode {
                body["response_format"] = json!({ "type": "json_object" });
            }
            let app = router(state.clone());
            let v: Value = rt.block_on(async move {
                let req = Request::post("/v1/chat/completions")
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Body::from(body.to_string()))
                    .unwrap();
                let resp = app.oneshot(req).await.unwrap();
                let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
                serde_json::from_slice(&bytes).unwrap()
            });
            let t = &v["timings"];
            e2e.push(json!({
                "prompt": p, "json_object": json_mode,
                "tokens": t["predicted_n"], "ms_per_token": t["predicted_per_token_ms"],
                "finish_reason": v["choices"][0]["finish_reason"],
            }));
        }
    }

    println!(
        "constrained sampling on {} ({} tokens)",
        model.display(),
        n_vocab
    );
    println!("vocabulary table built in {vocab_ms:.1} ms (once per model)");
    println!(
        "| sampler step (greedy, replaying {} tokens) | µs/token | masked steps |",
        seq.len()
    );
    println!("|---|---:|---:|");
    println!("| unconstrained | {:.1} | - |", us(free));
    println!(
        "| json_object, best token allowed | {:.1} | {fast_masked} |",
        us(fast)
    );
    println!(
        "| json_object, best refused, next allowed | {:.1} | {probe_masked} |",
        us(probe)
    );
    println!(
        "| whole-vocabulary mask, cold (mean / max over prefixes) | {:.0} / {:.0} | - |",
        us(mask_mean),
        us(mask_max)
    );
    println!(
        "| whole-vocabulary mask, cold, JSON as GBNF rules (mean / max) | {:.0} / {:.0} | - |",
        us(gbnf_mean),
        us(gbnf_max)
    );
    println!(
        "| whole-vocabulary mask, cached state | {:.1} | - |",
        us(cached)
    );
    println!();
    println!("| prompt | json_object | tokens | ms/token | finish |");
    println!("|---|---|---:|---:|---|");
    for r in &e2e {
        println!(
            "| {} | {} | {} | {:.2} | {} |",
            r["prompt"].as_str().unwrap_or_default(),
            r["json_object"],
            r["tokens"],
            r["ms_per_token"].as_f64().unwrap_or(0.0),
            r["finish_reason"].as_str().unwrap_or_default()
        );
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let receipt = json!({
        "command": "scripts/structured-bench.sh",
        "commit": commit,
        "machine": {
            "arch": std::env::consts::ARCH,
            "threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
        },
        "what": "grammar-constrained sampling cost per token (json_object), SmolLM2-135M-Instruct Q4_1",
        "model": model.file_name().map(|f| f.to_string_lossy().into_owned()),
        "n_vocab": n_vocab,
        "threads": cfg.threads,
        "vocab_table_ms": vocab_ms,
        "sampler_us_per_token": {
            "unconstrained": us(free),
            "json_object_best_allowed": us(fast),
            "json_object_best_refused": us(probe),
            "mask_cold_mean": us(mask_mean),
            "mask_cold_max": us(mask_max),
            "mask_cold_gbnf_json_mean": us(gbnf_mean),
            "mask_cold_gbnf_json_max": us(gbnf_max),
            "mask_cached": us(cached),
        },
        "end_to_end": e2e,
    });
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/receipts");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("structured-output.json"),
        serde_json::to_string_pretty(&receipt)? + "\n",
    )?;
    println!("\nreceipt: docs/receipts/structured-output.json");
    Ok(())
}
