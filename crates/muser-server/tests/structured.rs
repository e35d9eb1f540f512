//! Structured output on the real SmolLM2 model: the constraint over every token of its
//! vocabulary, and `response_format` / forced `tool_choice` through the router.

use axum::body::{to_bytes, Body};
use axum::http::{header, Request, StatusCode};
use axum::Router;
use muser_engine::constraint::{Grammar, Matcher, Vocab};
use muser_server::routes::router;
use muser_server::server::{load, ServeConfig};
use muser_server::state::SharedState;
use muser_text::Tokenizer;
use serde_json::{json, Value};
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tower::ServiceExt;

mod common;
use common::smollm2_path as model_path;

fn state() -> SharedState {
    static STATE: OnceLock<SharedState> = OnceLock::new();
    STATE
        .get_or_init(|| {
            let mut cfg = ServeConfig::new(model_path());
            cfg.n_slots = 2;
            cfg.n_ctx = 512;
            cfg.threads = 2;
            load(&cfg).expect("load SmolLM2")
        })
        .clone()
}

fn tokenizer() -> Arc<Tokenizer> {
    state().tokenizer.clone()
}

fn app() -> Router {
    router(state())
}

async fn chat(body: Value) -> (StatusCode, Value) {
    post("/v1/chat/completions", body).await
}

async fn post(path: &str, body: Value) -> (StatusCode, Value) {
    let req = Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Deterministic pseudo-random numbers for the walks.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

#[test]
fn the_mask_agrees_with_every_token_of_the_real_vocabulary() {
    let tok = tokenizer();
    let vocab = Vocab::from_tokenizer(&tok, false);
    let grammar = Arc::new(Grammar::json_object());
    let mut mask = Vec::new();
    // states: start, inside a key, after a colon, inside a string value (with an open
    // multi-byte character), inside a number, after a value, complete
    for prefix in [
        "",
        "{\"ke",
        "{\"key\": ",
        "{\"key\": \"caf\u{e9} ",
        "{\"key\": -12",
        "{\"key\": [true, {\"a\": null}]",
        "{\"key\": 1}",
    ] {
        let mut m = Matcher::new(grammar.clone());
        assert!(m.advance(prefix.as_bytes()), "{prefix}");
        let t = Instant::now();
        let n = m.fill_mask(&vocab, &mut mask);
        let took = t.elapsed();
        let mut agree = 0;
        for id in 0..vocab.len() as u32 {
            let one = m.allows_token(&vocab, id);
            assert_eq!(mask[id as usize], one, "prefix {prefix:?}, token {id}");
            if one && !vocab.is_eog(id) {
                // the text stays a prefix of some JSON object: check with a real parser
                // after closing it the cheapest way is out of reach, so re-run the matcher
                let mut text = prefix.as_bytes().to_vec();
                text.extend_from_slice(vocab.piece(id).unwrap());
                assert!(Matcher::new(grammar.clone()).advance(&text));
            }
            agree += 1;
        }
        assert_eq!(agree, vocab.len());
        eprintln!(
            "prefix {prefix:?}: {n} of {} tokens allowed, mask in {:.2} ms",
            vocab.len(),
            took.as_secs_f64() * 1e3
        );
        assert!(n > 0);
    }
}

#[test]
fn random_walks_over_the_real_vocabulary_end_in_json_objects() {
    let tok = tokenizer();
    let vocab = Vocab::from_tokenizer(&tok, false);
    let grammar = Arc::new(Grammar::json_object());
    let closers: Vec<u32> = ["\"", "}", "]", ":", "0", "u", "e", "l", "s", "a", "r"]
        .iter()
        .filter_map(|s| tok.token_id(s))
        .collect();
    let mut rng = Lcg(7);
    let mut mask = Vec::new();
    let (mut n_mask, mut mask_s) = (0u32, 0.0f64);
    for walk in 0..12 {
        let mut m = Matcher::new(grammar.clone());
        let mut text = Vec::new();
        for step in 0..400 {
            let t = Instant::now();
            let n = m.fill_mask(&vocab, &mut mask);
            mask_s += t.elapsed().as_secs_f64();
            n_mask += 1;
            assert!(
                n > 0,
                "walk {walk} step {step}: no token allowed after {text:?}"
            );
            let allowed: Vec<u32> = (0..vocab.len() as u32)
                .filter(|&i| mask[i as usize])
                .collect();
            let eog = allowed.iter().copied().find(|&i| vocab.is_eog(i));
            let pick = if let (Some(e), true) = (eog, step > 30) {
                e
            } else if step > 30 {
                closers
                    .iter()
                    .copied()
                    .find(|&c| mask[c as usize])
                    .unwrap_or(allowed[rng.next() as usize % allowed.len()])
            } else {
                allowed[rng.next() as usize % allowed.len()]
            };
            if vocab.is_eog(pick) {
                assert!(m.is_complete());
                break;
            }
            text.extend_from_slice(vocab.piece(pick).unwrap());
            assert!(m.accept_token(&vocab, pick));
        }
        assert!(m.is_complete(), "walk {walk} did not finish: {text:?}");
        let s = String::from_utf8(text).expect("valid UTF-8");
        let v: Value = serde_json::from_str(&s).unwrap_or_else(|e| panic!("{e}: {s}"));
        assert!(v.is_object(), "{s}");
    }
    eprintln!(
        "{n_mask} masks, mean {:.3} ms",
        mask_s * 1e3 / f64::from(n_mask)
    );
}

fn tools() -> Value {
    json!([
        { "type": "function", "function": {
            "name": "get_weather", "description": "Current weather in a city",
            "parameters": { "type": "object",
                "properties": { "city": { "type": "string" }, "unit": { "enum": ["C", "F"] } },
                "required": ["city"] } } },
        { "type": "function", "function": {
            "name": "get_time", "description": "The time in a timezone",
            "parameters": { "type": "object", "properties": { "tz": { "type": "string" } } } } }
    ])
}

#[tokio::test]
async fn json_object_output_is_one_json_object_whatever_the_prompt() {
    for prompt in [
        "Give me a JSON object describing a cat with its name and age.",
        "Write a haiku about the sea.",
        "Say hello.",
        "What is 2 + 2?",
    ] {
        let (status, v) = chat(json!({
            "messages": [{ "role": "user", "content": prompt }],
            "response_format": { "type": "json_object" },
            "temperature": 0, "max_tokens": 160,
        }))
        .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let choice = &v["choices"][0];
        let content = choice["message"]["content"].as_str().unwrap();
        eprintln!("{prompt} -> {content:?} ({})", choice["finish_reason"]);
        match choice["finish_reason"].as_str().unwrap() {
            "stop" => {
                let parsed: Value = serde_json::from_str(content)
                    .unwrap_or_else(|e| panic!("{prompt}: {e}: {content}"));
                assert!(parsed.is_object(), "{content}");
            }
            "length" => {
                assert!(
                    Matcher::new(Arc::new(Grammar::json_object())).advance(content.as_bytes()),
                    "cut output is a JSON prefix: {content}"
                );
            }
            other => panic!("finish_reason {other}"),
        }
    }
    // sampled, several seeds: always an object or a cut prefix
    let mut n_stop = 0;
    for seed in 1..=4 {
        let (status, v) = chat(json!({
            "messages": [{ "role": "user", "content": "Describe a dog as JSON." }],
            "response_format": { "type": "json_object" },
            "temperature": 1.0, "seed": seed, "max_tokens": 160,
        }))
        .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let content = v["choices"][0]["message"]["content"].as_str().unwrap();
        if v["choices"][0]["finish_reason"] == "stop" {
            n_stop += 1;
            assert!(serde_json::from_str::<Value>(content).unwrap().is_object());
        } else {
            assert!(Matcher::new(Arc::new(Grammar::json_object())).advance(content.as_bytes()));
        }
    }
    eprintln!("sampled: {n_stop} of 4 closed within the limit");
}

#[tokio::test]
async fn json_schema_output_follows_the_schema() {
    let schema = json!({ "type": "object",
        "properties": { "name": { "type": "string" }, "age": { "type": "integer" },
                        "pet": { "type": "boolean" } },
        "required": ["name", "age", "pet"] });
    let (status, v) = chat(json!({
        "messages": [{ "role": "user", "content": "Tell me about Ann, 31, who has a cat." }],
        "response_format": { "type": "json_schema",
            "json_schema": { "name": "person", "schema": schema, "strict": true } },
        "temperature": 0, "max_tokens": 96,
    }))
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{content}");
    let p: Value = serde_json::from_str(content).unwrap();
    assert!(
        p["name"].is_string() && p["age"].is_i64() && p["pet"].is_boolean(),
        "{p}"
    );
    assert_eq!(p.as_object().unwrap().len(), 3);
    // no schema: any object
    let (status, v) = chat(json!({
        "messages": [{ "role": "user", "content": "Hi" }],
        "response_format": { "type": "json_schema", "json_schema": { "name": "any" } },
        "temperature": 0, "max_tokens": 64,
    }))
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(content).unwrap().is_object());
    }
    // unsupported keywords are named
    let (status, v) = chat(json!({
        "messages": [{ "role": "user", "content": "Hi" }],
        "response_format": { "type": "json_schema", "json_schema": { "name": "x",
            "schema": { "type": "string", "pattern": "^a+$" } } },
    }))
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("pattern"),
        "{v}"
    );
}

#[tokio::test]
async fn forced_tool_choice_yields_a_parsed_tool_call() {
    for (choice, expect) in [
        (json!("required"), None),
        (
            json!({ "type": "function", "function": { "name": "get_time" } }),
            Some("get_time"),
        ),
    ] {
        let (status, v) = chat(json!({
            "messages": [{ "role": "user", "content": "What's the weather like in Paris?" }],
            "tools": tools(), "tool_choice": choice,
            "temperature": 0, "max_tokens": 96,
        }))
        .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        assert!(c["message"]["content"].is_null(), "{v}");
        let call = &c["message"]["tool_calls"][0];
        let name = call["function"]["name"].as_str().unwrap();
        assert!(["get_weather", "get_time"].contains(&name), "{name}");
        if let Some(e) = expect {
            assert_eq!(name, e);
        }
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(args.is_object());
        if name == "get_weather" {
            assert!(args["city"].is_string(), "{args}");
        }
        eprintln!("{choice} -> {name}({args})");
    }
    // streamed: one tool-call delta, finish_reason tool_calls
    let req = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(
            json!({
                "messages": [{ "role": "user", "content": "Weather in Oslo?" }],
                "tools": tools(), "tool_choice": "required", "stream": true,
                "temperature": 0, "max_tokens": 96,
            })
            .to_string(),
        ))
        .unwrap();
    let resp = app().oneshot(req).await.unwrap();
    let body = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    let text = String::from_utf8_lossy(&body);
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
}

#[tokio::test]
async fn forced_tool_choices_and_formats_are_checked() {
    let (status, v) = chat(json!({
        "messages": [{ "role": "user", "content": "Hi" }], "tool_choice": "required",
    }))
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(v["error"]["message"].as_str().unwrap().contains("tools"));
    let (status, v) = chat(json!({
        "messages": [{ "role": "user", "content": "Hi" }], "tools": tools(),
        "tool_choice": "required", "response_format": { "type": "json_object" },
    }))
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(v["error"]["message"].as_str().unwrap().contains("combined"));
    let (status, v) = chat(json!({
        "messages": [{ "role": "user", "content": "Hi" }], "tools": tools(),
        "tool_choice": { "type": "function", "function": { "name": "nope" } },
    }))
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(v["error"]["message"].as_str().unwrap().contains("nope"));
}

#[tokio::test]
async fn ollama_format_json_and_schema_are_enforced() {
    // A prompt that would not answer in JSON on its own.
    let (status, v) = post(
        "/api/chat",
        json!({ "model": "SmolLM2-135M-Instruct.Q4_1", "stream": false, "format": "json",
            "messages": [{ "role": "user", "content": "Write a haiku about rain." }],
            "options": { "temperature": 0, "num_predict": 80 } }),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let content = v["message"]["content"].as_str().unwrap();
    if v["done_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Value>(content).unwrap().is_object(),
            "{content}"
        );
    } else {
        assert!(content.trim_start().starts_with('{'), "{content}");
    }
    let schema = json!({ "type": "object",
        "properties": { "city": { "type": "string" }, "sunny": { "type": "boolean" } },
        "required": ["city", "sunny"] });
    let (status, v) = post(
        "/api/generate",
        json!({ "model": "SmolLM2-135M-Instruct.Q4_1", "stream": false, "format": schema,
            "prompt": "What is the weather in Paris?",
            "options": { "temperature": 0, "num_predict": 64 } }),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["done_reason"], "stop", "{v}");
    let p: Value = serde_json::from_str(v["response"].as_str().unwrap()).unwrap();
    assert!(p["city"].is_string() && p["sunny"].is_boolean(), "{p}");
    // unsupported schema keywords and other format values are refused
    let (status, v) = post(
        "/api/generate",
        json!({ "model": "SmolLM2-135M-Instruct.Q4_1", "stream": false, "prompt": "x",
            "format": { "type": "string", "pattern": "a" } }),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let (status, _) = post(
        "/api/generate",
        json!({ "model": "SmolLM2-135M-Instruct.Q4_1", "stream": false, "prompt": "x", "format": "yaml" }),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn completion_json_schema_is_enforced() {
    let schema = json!({ "type": "object",
        "properties": { "answer": { "type": "integer" } }, "required": ["answer"] });
    let (status, v) = post(
        "/completion",
        json!({ "prompt": "Once upon a time", "n_predict": 48, "temperature": 0,
                "json_schema": schema }),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["stop_type"], "eos", "{v}");
    let p: Value = serde_json::from_str(v["content"].as_str().unwrap()).unwrap();
    assert!(p["answer"].is_i64(), "{p}");
    let (status, _) = post(
        "/completion",
        json!({ "prompt": "x", "json_schema": { "type": "string", "format": "email" } }),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}
