//! Golden tests against llama.cpp b11434 (data from `scripts/text-goldens.sh`): tokenization of a
//! 241-string corpus for SmolLM2, Gemma 3 and three synthetic Muse tokenizers, detokenization,
//! special-token ids and the end-of-generation set, and chat-template renders.
//!
//! The models come from `MUSER_MODELS` (default `$HOME/.cache/muser/models`); a missing model is
//! a failure. The synthetic Muse tokenizers are rebuilt in memory from SmolLM2's metadata with
//! the recipe of `scripts/text/goldens.py` (`muse_metadata` below).

use std::path::PathBuf;
use std::sync::OnceLock;

use muser_gguf::{Array, GgufFile, Value};
use muser_text::{muse, unix_from_date, ChatRequest, ChatTemplate, Tokenizer};
use serde_json::Value as Json;

fn models_dir() -> PathBuf {
    match std::env::var_os("MUSER_MODELS") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
            .join(".cache/muser/models"),
    }
}

fn open_model(file: &str) -> GgufFile {
    let path = models_dir().join(file);
    GgufFile::open(&path).unwrap_or_else(|e| {
        panic!(
            "test model {} is needed (run scripts/fetch-models.sh or set MUSER_MODELS): {e}",
            path.display()
        )
    })
}

fn smollm2() -> &'static GgufFile {
    static F: OnceLock<GgufFile> = OnceLock::new();
    F.get_or_init(|| open_model("SmolLM2-135M-Instruct.Q4_1.gguf"))
}

fn gemma3() -> &'static GgufFile {
    static F: OnceLock<GgufFile> = OnceLock::new();
    F.get_or_init(|| open_model("gemma-3-270m-q4_k_m.gguf"))
}

/// SmolLM2's tokens, types and merges plus the Muse special tokens as CONTROL tokens,
/// bos = eos = `<|endoftext|>` (0), eot = `<|eot|>`, add_bos, the Muse template.
fn muse_metadata(pre: &str) -> Vec<(String, Value)> {
    let smol = smollm2();
    let mut tokens: Vec<String> = smol
        .get_str_array("tokenizer.ggml.tokens")
        .unwrap()
        .iter()
        .map(|s| s.to_string())
        .collect();
    let Some(Value::Array(Array::I32(types))) = smol.get("tokenizer.ggml.token_type") else {
        panic!("SmolLM2 has i32 token types")
    };
    let mut types = types.clone();
    let merges: Vec<String> = smol
        .get_str_array("tokenizer.ggml.merges")
        .unwrap()
        .iter()
        .map(|s| s.to_string())
        .collect();
    let eot = (tokens.len()
        + muse::SPECIAL_TOKENS
            .iter()
            .position(|t| *t == "<|eot|>")
            .unwrap()) as u32;
    tokens.extend(muse::SPECIAL_TOKENS.iter().map(|s| s.to_string()));
    types.extend(std::iter::repeat_n(3, muse::SPECIAL_TOKENS.len()));
    let kv = |k: &str, v: Value| (k.to_string(), v);
    vec![
        kv("general.architecture", Value::String("muse-glimmer".into())),
        kv("tokenizer.ggml.model", Value::String("gpt2".into())),
        kv("tokenizer.ggml.pre", Value::String(pre.into())),
        kv("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))),
        kv("tokenizer.ggml.token_type", Value::Array(Array::I32(types))),
        kv("tokenizer.ggml.merges", Value::Array(Array::String(merges))),
        kv("tokenizer.ggml.bos_token_id", Value::U32(0)),
        kv("tokenizer.ggml.eos_token_id", Value::U32(0)),
        kv("tokenizer.ggml.eot_token_id", Value::U32(eot)),
        kv("tokenizer.ggml.add_bos_token", Value::Bool(true)),
        kv(
            "tokenizer.chat_template",
            Value::String(muse::CHAT_TEMPLATE.into()),
        ),
    ]
}

fn tokenizer(model: &str) -> Tokenizer {
    match model {
        "smollm2" => Tokenizer::from_gguf(smollm2()).unwrap(),
        "gemma3" => Tokenizer::from_gguf(gemma3()).unwrap(),
        m => Tokenizer::from_metadata(&muse_metadata(
            m.strip_prefix("muse-").expect("a muse model"),
        ))
        .unwrap(),
    }
}

fn golden(name: &str) -> Json {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn ids(v: &Json) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check_model(model: &str) {
    let g = golden("tokenize.json");
    let corpus: Vec<&str> = g["corpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert!(corpus.len() >= 200);
    let e = &g["models"][model];
    let tok = tokenizer(model);

    let vocab = &e["vocab"];
    assert_eq!(
        tok.bos(),
        vocab["bos"].as_u64().map(|x| x as u32),
        "{model} bos"
    );
    assert_eq!(
        tok.eos(),
        vocab["eos"].as_u64().map(|x| x as u32),
        "{model} eos"
    );
    assert_eq!(
        tok.eot(),
        vocab["eot"].as_u64().map(|x| x as u32),
        "{model} eot"
    );
    assert_eq!(
        tok.eog_ids().collect::<Vec<_>>(),
        ids(&vocab["eog"]),
        "{model} end-of-generation set"
    );

    let mut failures = Vec::new();
    let mut round_trips = 0;
    for (i, text) in corpus.iter().enumerate() {
        let want = ids(&e["encode"][i]);
        let got = tok.encode(text, true, true);
        if got != want {
            failures.push(format!(
                "#{i} {text:?} parse_special:\n  want {want:?}\n  got  {got:?}"
            ));
        }
        let want_raw = ids(&e["encode_no_special"][i]);
        let got_raw = tok.encode(text, true, false);
        if got_raw != want_raw {
            failures.push(format!(
                "#{i} {text:?} no parse_special:\n  want {want_raw:?}\n  got  {got_raw:?}"
            ));
        }
        // /detokenize: the pieces (special rendering on) concatenated.
        let pieces: Vec<u8> = want
            .iter()
            .flat_map(|&id| tok.token_to_piece(id, true).to_vec())
            .collect();
        if let Some(d) = e["detokenize"][i].as_str() {
            if pieces != d.as_bytes() {
                failures.push(format!(
                    "#{i} {text:?} detokenize: want {d:?} got {:?}",
                    String::from_utf8_lossy(&pieces)
                ));
            }
            // Round trip where llama.cpp has it: the text back from its own tokens (minus BOS).
            let bos_piece = match (tok.add_bos(), tok.bos()) {
                (true, Some(b)) => {
                    String::from_utf8_lossy(tok.token_to_piece(b, true)).into_owned()
                }
                _ => String::new(),
            };
            if d.strip_prefix(bos_piece.as_str()) == Some(text) {
                let ids = tok.encode(text, false, true);
                let back: Vec<u8> = ids
                    .iter()
                    .flat_map(|&id| tok.token_to_piece(id, true).to_vec())
                    .collect();
                assert_eq!(back, text.as_bytes(), "{model}: round trip of #{i}");
                round_trips += 1;
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{model}: {} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        round_trips > corpus.len() / 2,
        "{model}: only {round_trips} round trips checked"
    );
}

#[test]
fn smollm2_tokenizes_like_llama_cpp() {
    check_model("smollm2");
}

#[test]
fn gemma3_tokenizes_like_llama_cpp() {
    check_model("gemma3");
}

#[test]
fn muse_llama_bpe_tokenizes_like_llama_cpp() {
    check_model("muse-llama-bpe");
}

#[test]
fn muse_gpt2_tokenizes_like_llama_cpp() {
    check_model("muse-gpt-2");
}

#[test]
fn muse_qwen2_tokenizes_like_llama_cpp() {
    check_model("muse-qwen2");
}

#[test]
fn forced_user_defined_tokens_are_always_parsed() {
    let tok = tokenizer("muse-llama-bpe");
    let start = tok.token_id("<|start|>").unwrap();
    let eot = tok.token_id("<|eot|>").unwrap();
    let ids = tok.encode("<|start|>x<|eot|>", false, false);
    assert_eq!(
        ids[0], start,
        "<|start|> is user-defined: matched without parse_special"
    );
    assert!(
        !ids.contains(&eot),
        "<|eot|> is control: not matched without parse_special"
    );
    assert_eq!(tok.token_to_piece(start, false), b"<|start|>");
    assert_eq!(tok.token_to_piece(eot, false), b"");
    assert_eq!(tok.token_to_piece(eot, true), b"<|eot|>");
    assert!(tok.is_eog(eot));
    assert!(
        !tok.is_eog(tok.token_id("<|eom|>").unwrap()),
        "<|eom|> does not end generation"
    );
}

#[test]
fn unknown_pre_tokenizer_is_named() {
    let mut meta = muse_metadata("llama-bpe");
    meta[2].1 = Value::String("gpt2".into());
    let err = Tokenizer::from_metadata(&meta)
        .err()
        .expect("gpt2 is a model name, not a pre-tokenizer");
    assert!(err.to_string().contains("`gpt2`"), "{err}");
}

#[test]
fn templates_render_like_llama_server() {
    let g = golden("templates.json");
    let smol_tok = tokenizer("smollm2");
    let gemma_tok = tokenizer("gemma3");
    let muse_tok = tokenizer("muse-llama-bpe");
    let smol = ChatTemplate::from_gguf(smollm2(), &smol_tok)
        .unwrap()
        .expect("SmolLM2 has a template");
    assert!(ChatTemplate::from_gguf(gemma3(), &gemma_tok)
        .unwrap()
        .is_none());
    let gemma = ChatTemplate::from_gguf_or_chatml(gemma3(), &gemma_tok).unwrap();
    let muse_t = ChatTemplate::new(muse::CHAT_TEMPLATE, &muse_tok).unwrap();
    assert!(muse_t.is_muse() && !smol.is_muse());
    let mut failures = Vec::new();
    let cases = g["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for c in cases {
        let t = match c["model"].as_str().unwrap() {
            "smollm2" => &smol,
            "gemma3" => &gemma,
            _ => &muse_t,
        };
        let r = &c["request"];
        let mut extra = r["chat_template_kwargs"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        if let Some(effort) = r.get("reasoning_effort") {
            extra.insert("reasoning_effort".into(), effort.clone());
        }
        let req = ChatRequest {
            messages: r["messages"].as_array().unwrap().clone(),
            tools: r.get("tools").cloned(),
            add_generation_prompt: r
                .get("add_generation_prompt")
                .and_then(Json::as_bool)
                .unwrap_or(true),
            extra,
            now_unix_s: c
                .get("date")
                .and_then(Json::as_str)
                .and_then(unix_from_date),
        };
        let got = t.render(&req).unwrap_or_else(|e| format!("ERROR {e}"));
        let want = c["prompt"].as_str().unwrap();
        if got != want {
            failures.push(format!(
                "{} / {}:\n--- want\n{want}\n--- got\n{got}",
                c["model"], c["label"]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} template mismatches:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn stream_decoder_emits_split_characters_once_whole() {
    for model in ["smollm2", "gemma3"] {
        let tok = tokenizer(model);
        let text = "emoji 👨‍👩‍👧‍👦 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 龘靐齉";
        let ids = tok.encode(text, false, true);
        let mut dec = muser_text::StreamDecoder::new(&tok, false);
        let mut chunks = Vec::new();
        for &id in &ids {
            chunks.push(dec.push(id));
        }
        chunks.push(dec.finish());
        assert!(
            chunks.iter().any(String::is_empty),
            "{model}: some character spans several tokens"
        );
        assert!(
            chunks.iter().all(|c| !c.contains('\u{FFFD}')),
            "{model}: no partial character is emitted"
        );
        assert_eq!(chunks.concat(), text, "{model}");
    }
}

/// `encode_at_most` gives `encode`'s ids within the limit and refuses past it, on both
/// tokenizer kinds; a text too long for any tokenization is refused before the work.
#[test]
fn bounded_encoding_matches_and_refuses_past_the_limit() {
    for model in ["smollm2", "gemma3"] {
        let tok = tokenizer(model);
        let text = "Hello world, this is <|im_start|> a test of bounded tokenization. ".repeat(8);
        let full = tok.encode(&text, true, true);
        let n = full.len();
        assert_eq!(
            tok.encode_at_most(&text, true, true, n),
            Some(full.clone()),
            "{model}"
        );
        assert_eq!(
            tok.encode_at_most(&text, true, true, n - 1),
            None,
            "{model}"
        );
        assert_eq!(tok.encode_at_most(&text, true, true, 3), None, "{model}");
        let huge = "x".repeat(8 << 20);
        let t0 = std::time::Instant::now();
        assert_eq!(
            tok.encode_at_most(&huge, false, false, 4096),
            None,
            "{model}"
        );
        assert!(
            t0.elapsed().as_millis() < 50,
            "{model}: the refusal did the work"
        );
    }
}
