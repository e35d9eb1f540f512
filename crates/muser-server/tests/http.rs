//! The router in-process (tower `oneshot`) on the real SmolLM2 model: strictness, limits,
//! auth, queueing and the main routes. Each rejection is asserted with its status and message.

use axum::body::{to_bytes, Body};
use axum::http::{header, Request, StatusCode};
use axum::Router;
use muser_server::routes::router;
use muser_server::server::{load, ServeConfig};
use muser_server::state::SharedState;
use serde_json::{json, Value};
use std::sync::OnceLock;
use tower::ServiceExt;

mod common;
use common::smollm2_path as model_path;

/// Two slots of 256 tokens, no key.
fn open_state() -> SharedState {
    static STATE: OnceLock<SharedState> = OnceLock::new();
    STATE
        .get_or_init(|| {
            let mut cfg = ServeConfig::new(model_path());
            cfg.n_slots = 2;
            cfg.n_ctx = 256;
            cfg.threads = 2;
            cfg.slot_save_path = Some(std::env::temp_dir().join("muser-server-test-slots"));
            load(&cfg).expect("load SmolLM2")
        })
        .clone()
}

/// One slot, a queue of one, and an API key.
fn keyed_state() -> SharedState {
    static STATE: OnceLock<SharedState> = OnceLock::new();
    STATE
        .get_or_init(|| {
            let mut cfg = ServeConfig::new(model_path());
            cfg.n_slots = 1;
            cfg.n_ctx = 512;
            cfg.threads = 2;
            cfg.queue_max = 1;
            cfg.api_key = Some("s3cret".into());
            load(&cfg).expect("load SmolLM2")
        })
        .clone()
}

/// One slot of its own, for save/restore (no other test moves its cache).
fn slot_state() -> SharedState {
    static STATE: OnceLock<SharedState> = OnceLock::new();
    STATE
        .get_or_init(|| {
            let mut cfg = ServeConfig::new(model_path());
            cfg.n_slots = 1;
            cfg.n_ctx = 128;
            cfg.threads = 2;
            cfg.slot_save_path = Some(std::env::temp_dir().join("muser-server-test-slots"));
            load(&cfg).expect("load SmolLM2")
        })
        .clone()
}

fn app() -> Router {
    router(open_state())
}

fn post_json(path: &str, body: &Value) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

async fn send(app: Router, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, String) {
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    (
        status,
        headers,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

async fn send_json(app: Router, req: Request<Body>) -> (StatusCode, Value) {
    let (status, _, body) = send(app, req).await;
    (
        status,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    )
}

fn error_message(v: &Value) -> &str {
    v["error"]["message"].as_str().unwrap_or_default()
}

async fn expect_400(path: &str, body: Value, needle: &str) {
    let (status, v) = send_json(app(), post_json(path, &body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {v}");
    assert!(
        error_message(&v).contains(needle),
        "{path}: `{}` lacks `{needle}`",
        error_message(&v)
    );
}

fn chat_body() -> Value {
    json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 4, "temperature": 0 })
}

#[tokio::test]
async fn unknown_fields_are_rejected_by_name_at_every_depth() {
    let mut b = chat_body();
    b["frobnicate"] = json!(1);
    expect_400("/v1/chat/completions", b, "frobnicate").await;
    let mut b = chat_body();
    b["stream_options"] = json!({ "include_usage": true, "extra_opt": 1 });
    expect_400("/v1/chat/completions", b, "extra_opt").await;
    let mut b = chat_body();
    b["messages"][0]["mood"] = json!("happy");
    expect_400("/v1/chat/completions", b, "mood").await;
    let mut b = chat_body();
    b["messages"][0]["content"] = json!([{ "type": "text", "text": "x", "colour": "red" }]);
    expect_400("/v1/chat/completions", b, "colour").await;
    let mut b = chat_body();
    b["tools"] = json!([{ "type": "function", "function": { "name": "f", "sideeffects": true } }]);
    expect_400("/v1/chat/completions", b, "sideeffects").await;
    expect_400(
        "/completion",
        json!({ "prompt": "x", "n_predictt": 3 }),
        "n_predictt",
    )
    .await;
    expect_400(
        "/v1/completions",
        json!({ "prompt": "x", "temprature": 0 }),
        "temprature",
    )
    .await;
    expect_400(
        "/v1/embeddings",
        json!({ "input": "x", "dimension": 3 }),
        "dimension",
    )
    .await;
    expect_400(
        "/tokenize",
        json!({ "content": "x", "add_bos": true }),
        "add_bos",
    )
    .await;
    expect_400(
        "/api/generate",
        json!({ "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "x", "options": { "typo": 1 } }),
        "typo",
    )
    .await;
}

#[tokio::test]
async fn content_type_and_malformed_bodies_are_415() {
    let req = Request::post("/v1/completions")
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::from(r#"{"prompt":"x"}"#))
        .unwrap();
    let (status, v) = send_json(app(), req).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{v}");
    let req = Request::post("/v1/completions")
        .body(Body::from(r#"{"prompt":"x"}"#))
        .unwrap();
    assert_eq!(
        send_json(app(), req).await.0,
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    );
    let req = Request::post("/v1/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{\"prompt\": "))
        .unwrap();
    let (status, v) = send_json(app(), req).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert!(error_message(&v).contains("not valid JSON"), "{v}");
}

#[tokio::test]
async fn limits_are_400_with_the_limit_named() {
    let huge = "a".repeat(9 << 20);
    let (status, v) = send_json(
        app(),
        post_json("/v1/completions", &json!({ "prompt": huge })),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_message(&v).contains(&(8u64 << 20).to_string()), "{v}");
    let long = "word ".repeat(400);
    expect_400("/v1/completions", json!({ "prompt": long }), "256").await;
    expect_400("/completion", json!({ "prompt": "" }), "empty").await;
    expect_400(
        "/v1/chat/completions",
        {
            let mut b = chat_body();
            b["n"] = json!(2);
            b
        },
        "n must be 1",
    )
    .await;
    expect_400(
        "/v1/completions",
        json!({ "prompt": "x", "temperature": -1.0 }),
        "temperature",
    )
    .await;
    expect_400(
        "/v1/completions",
        json!({ "prompt": "x", "seed": -5 }),
        "seed",
    )
    .await;
    expect_400(
        "/completion",
        json!({ "prompt": [1, 99999999] }),
        "vocabulary",
    )
    .await;
    expect_400(
        "/completion",
        json!({ "prompt": "x", "id_slot": 7 }),
        "id_slot",
    )
    .await;
    let mut b = chat_body();
    b["messages"][0]["content"] =
        json!([{ "type": "image_url", "image_url": { "url": "data:," } }]);
    expect_400("/v1/chat/completions", b, "vision").await;
    let (status, v) = send_json(
        app(),
        post_json(
            "/v1/completions",
            &json!({ "model": "gpt-9", "prompt": "x" }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
}

#[tokio::test]
async fn slot_files_are_confined() {
    for bad in ["../x", "a/b", "..", ""] {
        expect_400("/slots/0?action=save", json!({ "filename": bad }), "slot").await;
    }
    let (status, v) = send_json(app(), post_json("/slots/0?action=explode", &json!({}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let (status, v) = send_json(app(), post_json("/slots/9?action=erase", &json!({}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
}

#[tokio::test]
async fn chat_completion_and_stream_agree() {
    let (status, v) = send_json(app(), post_json("/v1/chat/completions", &chat_body())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!content.is_empty());
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 4);
    let mut b = chat_body();
    b["stream"] = json!(true);
    b["stream_options"] = json!({ "include_usage": true });
    let (status, headers, body) = send(app(), post_json("/v1/chat/completions", &b)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[header::CONTENT_TYPE], "text/event-stream");
    let events: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], v["usage"]["completion_tokens"]);
}

#[tokio::test]
async fn llama_routes_answer_in_llama_shape() {
    let (status, v) = send_json(
        app(),
        post_json("/tokenize", &json!({ "content": "Hello world" })),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let ids = v["tokens"].clone();
    let (_, v) = send_json(app(), post_json("/detokenize", &json!({ "tokens": ids }))).await;
    assert_eq!(v["content"], "Hello world");
    let (status, v) = send_json(
        app(),
        post_json(
            "/completion",
            &json!({ "prompt": "Hello", "n_predict": 3, "temperature": 0 }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["tokens_predicted"], 3);
    assert_eq!(v["stop_type"], "limit");
    assert!(v["timings"]["predicted_per_second"].as_f64().unwrap() > 0.0);
    let (_, v) = send_json(
        app(),
        post_json("/embedding", &json!({ "content": "Hello" })),
    )
    .await;
    let emb = v[0]["embedding"][0].as_array().unwrap();
    let norm: f64 = emb.iter().map(|x| x.as_f64().unwrap().powi(2)).sum();
    assert!((norm - 1.0).abs() < 1e-4, "norm {norm}");
    let (_, _, text) = send(app(), Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert!(text.contains("muser_generated_tokens_total"), "{text}");
    let (_, v) = send_json(app(), Request::get("/slots").body(Body::empty()).unwrap()).await;
    assert_eq!(v.as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn api_key_guards_every_route_but_health() {
    let app = || router(keyed_state());
    let get = |path: &str, key: Option<&str>| {
        let mut r = Request::get(path);
        if let Some(k) = key {
            r = r.header(header::AUTHORIZATION, format!("Bearer {k}"));
        }
        r.body(Body::empty()).unwrap()
    };
    assert_eq!(send(app(), get("/health", None)).await.0, StatusCode::OK);
    // the dashboard's files hold no data: the page loads, then asks for the key
    assert_eq!(send(app(), get("/", None)).await.0, StatusCode::OK);
    assert_eq!(
        send(app(), get("/assets/app.js", None)).await.0,
        StatusCode::OK
    );
    for path in [
        "/v1/models",
        "/props",
        "/metrics",
        "/slots",
        "/api/tags",
        "/v1/telemetry",
    ] {
        assert_eq!(
            send(app(), get(path, None)).await.0,
            StatusCode::UNAUTHORIZED,
            "{path}"
        );
        assert_eq!(
            send(app(), get(path, Some("wrong"))).await.0,
            StatusCode::UNAUTHORIZED,
            "{path}"
        );
        assert_eq!(
            send(app(), get(path, Some("s3cret"))).await.0,
            StatusCode::OK,
            "{path}"
        );
    }
}

#[tokio::test]
async fn full_queue_is_429_with_retry_after() {
    let app = || router(keyed_state());
    let body = json!({ "prompt": "Count to one thousand:", "n_predict": 200, "stream": true, "ignore_eos": true });
    let mut held = Vec::new();
    let mut saw_429 = false;
    for _ in 0..6 {
        let mut req = post_json("/completion", &body);
        req.headers_mut()
            .insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        let resp = app().oneshot(req).await.unwrap();
        if resp.status() == StatusCode::TOO_MANY_REQUESTS {
            assert!(resp.headers().contains_key(header::RETRY_AFTER));
            saw_429 = true;
            break;
        }
        assert_eq!(resp.status(), StatusCode::OK);
        held.push(resp); // keeps the generation alive
    }
    assert!(saw_429, "one slot and a queue of one never answered 429");
    drop(held); // disconnect: the generations are cancelled
                // The slot frees up once the cancelled generation is dropped.
    let mut free = false;
    for _ in 0..100 {
        let mut req = Request::get("/slots").body(Body::empty()).unwrap();
        req.headers_mut()
            .insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        let (_, v) = send_json(app(), req).await;
        if v[0]["is_processing"] == json!(false) {
            free = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(free, "a disconnected stream kept its slot busy");
}

#[tokio::test]
async fn ollama_and_openai_listing_routes() {
    let (status, v) = send_json(
        app(),
        Request::get("/api/tags").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["models"][0]["name"], "SmolLM2-135M-Instruct.Q4_1");
    let (_, v) = send_json(
        app(),
        Request::get("/v1/models").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(v["data"][0]["meta"]["n_embd"], 576);
    let (status, v) = send_json(
        app(),
        post_json(
            "/api/generate",
            &json!({ "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Hi", "stream": false,
                                            "options": { "num_predict": 2, "temperature": 0 } }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["done"], true);
    assert_eq!(v["eval_count"], 2);
    let (status, _) = send_json(
        app(),
        post_json(
            "/api/generate",
            &json!({ "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Hi", "template": "{{x}}" }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn slot_save_erase_restore_roundtrip() {
    let app = || router(slot_state());
    let body = json!({ "prompt": "The history of the printing press", "n_predict": 4, "temperature": 0, "id_slot": 0 });
    let (status, first) = send_json(app(), post_json("/completion", &body)).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let (status, v) = send_json(
        app(),
        post_json(
            "/slots/0?action=save",
            &json!({ "filename": "roundtrip.slot" }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let n_saved = v["n_saved"].as_u64().unwrap();
    assert!(n_saved > 4, "{v}");
    let (status, v) = send_json(app(), post_json("/slots/0?action=erase", &json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, v) = send_json(
        app(),
        post_json(
            "/slots/0?action=restore",
            &json!({ "filename": "roundtrip.slot" }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["n_restored"].as_u64(), Some(n_saved));
    // The restored cache serves the prompt prefix and gives the same greedy continuation.
    let (_, again) = send_json(app(), post_json("/completion", &body)).await;
    assert_eq!(again["content"], first["content"]);
    assert!(again["tokens_cached"].as_u64().unwrap() > 0, "{again}");
    // A corrupted file is refused before the cache is touched.
    let dir = std::env::temp_dir().join("muser-server-test-slots");
    let mut bytes = std::fs::read(dir.join("roundtrip.slot")).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(dir.join("corrupt.slot"), bytes).unwrap();
    let (status, v) = send_json(
        app(),
        post_json(
            "/slots/0?action=restore",
            &json!({ "filename": "corrupt.slot" }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(error_message(&v).contains("checksum"), "{v}");
    let (status, _) = send_json(
        app(),
        post_json(
            "/slots/0?action=restore",
            &json!({ "filename": "absent.slot" }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}
