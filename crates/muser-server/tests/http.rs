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
async fn a_body_not_declared_json_is_415_and_malformed_json_is_400() {
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
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_message(&v).contains("not valid JSON"), "{v}");
}

#[tokio::test]
async fn limits_are_400_with_the_limit_named() {
    let huge = "a".repeat(5 << 20);
    let (status, v) = send_json(
        app(),
        post_json("/v1/completions", &json!({ "prompt": huge })),
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(error_message(&v).contains(&(4u64 << 20).to_string()), "{v}");
    let long = "word ".repeat(400);
    expect_400("/v1/completions", json!({ "prompt": long }), "256").await;
    expect_400("/completion", json!({ "prompt": "" }), "empty").await;
    expect_400(
        "/v1/chat/completions",
        {
            let mut b = chat_body();
            b["n"] = json!(17);
            b
        },
        "n must be between 1 and 16",
    )
    .await;
    expect_400(
        "/v1/completions",
        json!({ "prompt": ["a", "b"], "stream": true }),
        "stream: true takes one prompt",
    )
    .await;
    expect_400(
        "/completion",
        json!({ "prompt": "x", "grammar": "root ::= root \"a\" | \"b\"" }),
        "rule `root` is left-recursive",
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
    // a malformed image is the request's fault; a good one without a projector is the
    // server's setup: 500, as llama-server answers
    expect_400("/v1/chat/completions", b.clone(), "base64").await;
    b["messages"][0]["content"][0]["image_url"]["url"] = json!("data:image/png;base64,AAAA");
    let (status, v) = send_json(app(), post_json("/v1/chat/completions", &b)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    assert!(error_message(&v).contains("--mmproj"), "{v}");
    // one model served: OpenAI routes answer to any name (llama-server's rule), Ollama's
    // only to the model's own names
    let (status, v) = send_json(
        app(),
        post_json(
            "/v1/completions",
            &json!({ "model": "gpt-3.5-turbo", "prompt": "x", "max_tokens": 1 }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["model"], "SmolLM2-135M-Instruct.Q4_1");
    let (status, v) = send_json(
        app(),
        post_json(
            "/api/generate",
            &json!({ "model": "gpt-9", "prompt": "x", "stream": false }),
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

/// Hostile values of every bounded class are 400s naming the limit, decided before the work
/// (a 3 MiB prompt is refused without being tokenized), and the server answers normally
/// afterwards.
#[tokio::test]
async fn hostile_values_are_refused_before_the_work() {
    let ok = || json!({ "prompt": "Hi", "n_predict": 2, "temperature": 0 });
    let with = |k: &str, v: Value| {
        let mut b = ok();
        b[k] = v;
        b
    };
    // the engine-killing request of the past: one token biased twice, +inf and false
    expect_400(
        "/completion",
        with("logit_bias", json!([[17, 1e39], [17, false]])),
        "17",
    )
    .await;
    expect_400(
        "/completion",
        with("logit_bias", json!([[17, 1.0], [17, false]])),
        "more than once",
    )
    .await;
    expect_400(
        "/completion",
        with("logit_bias", json!([[99999999, 1.0]])),
        "vocabulary",
    )
    .await;
    expect_400(
        "/completion",
        with("logit_bias", json!([[5, "x"]])),
        "logit_bias",
    )
    .await;
    let many: Vec<Value> = (0..1025).map(|t| json!([t, 1.0])).collect();
    expect_400("/completion", with("logit_bias", json!(many)), "1024").await;
    expect_400(
        "/v1/completions",
        json!({ "prompt": "x", "logit_bias": { "5": 1.0, "05": -1.0 } }),
        "more than once",
    )
    .await;
    expect_400(
        "/v1/completions",
        json!({ "prompt": "x", "logit_bias": { "5": 1e39 } }),
        "logit_bias",
    )
    .await;
    expect_400(
        "/completion",
        with("temperature", json!(1e39)),
        "temperature",
    )
    .await;
    expect_400("/completion", with("top_p", json!(-1e39)), "top_p").await;
    expect_400("/completion", with("n_probs", json!(21)), "20").await;
    expect_400("/completion", with("stop", json!(vec!["s"; 17])), "stop").await;
    expect_400("/completion", with("stop", json!(["x".repeat(300)])), "256").await;
    // prompts: nesting, element counts, early context rejection, /tokenize's output
    expect_400(
        "/completion",
        with("prompt", json!([[[1]]])),
        "strings and token ids only",
    )
    .await;
    let nested = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    let (status, _) = send_json(app(), post_raw("/completion", &nested)).await;
    assert!(status.is_client_error(), "{status}");
    let pieces = vec![1u32; (1 << 17) + 1];
    expect_400("/completion", with("prompt", json!(pieces)), "at most").await;
    let t0 = std::time::Instant::now();
    expect_400(
        "/completion",
        with("prompt", json!("ab ".repeat(1 << 20))),
        "context",
    )
    .await;
    expect_400(
        "/tokenize",
        json!({ "content": "ab ".repeat(1 << 20) }),
        "131072",
    )
    .await;
    assert!(t0.elapsed().as_secs_f64() < 2.0, "{:?}", t0.elapsed());
    expect_400(
        "/detokenize",
        json!({ "tokens": vec![1; (1 << 17) + 1] }),
        "131072",
    )
    .await;
    // schemas and chats
    let wide: serde_json::Map<String, Value> = (0..4000)
        .map(|i| (format!("p{i}"), json!({ "type": "string" })))
        .collect();
    expect_400(
        "/completion",
        with(
            "json_schema",
            json!({ "type": "object", "properties": wide }),
        ),
        "65536",
    )
    .await;
    let mut b = chat_body();
    b["messages"] = json!(vec![json!({ "role": "user", "content": "x" }); 4097]);
    expect_400("/v1/chat/completions", b, "4096").await;
    // and the server still answers
    let (status, v) = send_json(app(), post_json("/completion", &ok())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, _) = send_json(app(), Request::get("/health").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
}

fn post_raw(path: &str, body: &str) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

/// Without a key, a `Host` that is not one of the server's names is 403 (a DNS-rebinding page
/// cannot reach it), and every POST must be JSON, whatever its body (no cross-site form
/// posts); with a key, the key decides.
#[tokio::test]
async fn host_allow_list_and_json_only_posts() {
    let with_host = |host: &str| {
        Request::get("/v1/models")
            .header(header::HOST, host)
            .body(Body::empty())
            .unwrap()
    };
    for host in ["localhost:4949", "127.0.0.1", "[::1]:80"] {
        assert_eq!(
            send(app(), with_host(host)).await.0,
            StatusCode::OK,
            "{host}"
        );
    }
    for host in ["evil.example:4949", "127.0.0.1.nip.io", "localhost.evil"] {
        let (status, _, body) = send(app(), with_host(host)).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{host}");
        assert!(body.contains("--allow-host"), "{body}");
    }
    let form = Request::post("/slots/0?action=erase")
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        send(app(), form).await.0,
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    );
    let keyed = Request::get("/v1/models")
        .header(header::HOST, "evil.example")
        .header(header::AUTHORIZATION, "Bearer s3cret")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(router(keyed_state()), keyed).await.0, StatusCode::OK);
}

/// The slot directory is private to its owner, slot files are 0600, and a save that would
/// take the directory past its quota is 507 with nothing written.
#[tokio::test]
async fn slot_files_are_private_and_within_their_quota() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let slots = dir.path().join("slots");
    let mut cfg = ServeConfig::new(model_path());
    cfg.n_slots = 1;
    cfg.n_ctx = 64;
    cfg.threads = 2;
    cfg.slot_save_path = Some(slots.clone());
    cfg.kv_key_file = Some(dir.path().join("kv.key"));
    std::fs::write(dir.path().join("kv.key"), "11".repeat(32)).unwrap();
    cfg.slot_save_quota_bytes = 1 << 20;
    let app = router(load(&cfg).expect("load SmolLM2"));
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&slots), 0o700);
    let gen = json!({ "prompt": "Hello there", "n_predict": 2, "id_slot": 0 });
    assert_eq!(
        send(app.clone(), post_json("/completion", &gen)).await.0,
        StatusCode::OK
    );
    let save = |name: &str| post_json("/slots/0?action=save", &json!({ "filename": name }));
    let (status, v) = send_json(app.clone(), save("a")).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(mode(&slots.join("a")), 0o600);
    // a second file would not fit beside the first
    let used = std::fs::metadata(slots.join("a")).unwrap().len();
    std::fs::write(slots.join("filler"), vec![0u8; (1 << 20) - used as usize]).unwrap();
    let (status, v) = send_json(app.clone(), save("b")).await;
    assert_eq!(status, StatusCode::INSUFFICIENT_STORAGE, "{v}");
    assert!(!slots.join("b").exists());
    // replacing a file counts only the new bytes
    std::fs::remove_file(slots.join("filler")).unwrap();
    assert_eq!(send_json(app, save("a")).await.0, StatusCode::OK);
}

/// Past `IN_FLIGHT_MAX` requests in flight (streams count until their last frame) the server
/// answers 503 with `Retry-After` at once, `/health` still answers, and closing the streams
/// frees their permits and their generations.
#[tokio::test]
async fn requests_in_flight_are_bounded_and_streams_hold_their_permit() {
    let mut cfg = ServeConfig::new(model_path());
    cfg.n_slots = 1;
    cfg.n_ctx = 64;
    cfg.threads = 2;
    cfg.queue_max = 300;
    let state = load(&cfg).expect("load SmolLM2");
    let app = router(state.clone());
    let max = muser_server::limits::IN_FLIGHT_MAX;
    let stream = json!({ "prompt": "Hi", "n_predict": 40, "stream": true, "ignore_eos": true });
    let mut held = Vec::new();
    for _ in 0..max {
        let resp = app
            .clone()
            .oneshot(post_json("/completion", &stream))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        held.push(resp); // the body is not read: the stream stays in flight
    }
    let (status, headers, body) = send(app.clone(), post_json("/completion", &stream)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(headers.get(header::RETRY_AFTER).unwrap(), "1");
    let health = Request::get("/health").body(Body::empty()).unwrap();
    assert_eq!(send(app.clone(), health).await.0, StatusCode::OK);
    drop(held);
    let t0 = std::time::Instant::now();
    while state.in_flight.available_permits() < max || state.engine.stats().queue_depth > 0 {
        assert!(
            t0.elapsed().as_secs() < 30,
            "permits or queued requests were not released"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let ok = json!({ "prompt": "Hi", "n_predict": 2 });
    assert_eq!(
        send(app, post_json("/completion", &ok)).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn anthropic_messages_responses_and_rerank() {
    let msg = json!({ "model": "claude-x", "max_tokens": 2, "system": "Be brief.",
                      "messages": [{ "role": "user", "content": [{ "type": "text", "text": "Hi" }] }] });
    let (status, v) = send_json(app(), post_json("/v1/messages", &msg)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["usage"]["output_tokens"], 2);
    let (status, v) = send_json(app(), post_json("/v1/messages/count_tokens", &msg)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(v["input_tokens"].as_u64().unwrap() > 3, "{v}");
    // a tool_use block in a user turn is a request error, not a crash
    let bad = json!({ "max_tokens": 2, "messages": [{ "role": "user", "content": [
        { "type": "tool_use", "id": "t", "name": "f", "input": {} }] }] });
    let (status, v) = send_json(app(), post_json("/v1/messages", &bad)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");

    let req = json!({ "model": "gpt-4.1", "input": "Hi", "max_output_tokens": 2 });
    let (status, v) = send_json(app(), post_json("/v1/responses", &req)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(v["usage"]["output_tokens"], 2);
    let (status, v) = send_json(
        app(),
        post_json(
            "/responses",
            &json!({ "input": "Hi", "previous_response_id": "r" }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");

    // /rerank answers only when the server was started with --rerank
    let (status, v) = send_json(
        app(),
        post_json("/rerank", &json!({ "query": "q", "documents": ["a"] })),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED, "{v}");
}

#[tokio::test]
async fn anthropic_clients_authenticate_with_x_api_key() {
    let count = |key: &str| {
        Request::post("/v1/messages/count_tokens")
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-api-key", key)
            .body(Body::from(
                json!({ "messages": [{ "role": "user", "content": "Hi" }] }).to_string(),
            ))
            .unwrap()
    };
    let (status, v) = send_json(router(keyed_state()), count("s3cret")).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, v) = send_json(router(keyed_state()), count("wrong")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{v}");
}

/// Several prompts per request, `n` choices, and llama.cpp's text keys in `logit_bias`.
#[tokio::test]
async fn several_prompts_choices_and_text_logit_bias() {
    let greedy = |prompt: Value| json!({ "prompt": prompt, "max_tokens": 3, "temperature": 0 });
    let (status, v) = send_json(
        app(),
        post_json("/v1/completions", &{
            let mut b = greedy(json!(["The sky is", [504, 3276, 314]]));
            b["n"] = json!(2);
            b
        }),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
    }
    // greedy: a prompt's two choices agree, and each generation counts its prompt
    assert_eq!(choices[0]["text"], choices[1]["text"]);
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");

    let (status, v) = send_json(
        app(),
        post_json(
            "/completion",
            &json!({ "prompt": ["a", "b", "c"], "n_predict": 2 }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let results = v.as_array().expect("one result per prompt");
    assert_eq!(results.len(), 3);
    assert_eq!(results[2]["index"], 2);

    let (status, v) = send_json(
        app(),
        post_json(
            "/v1/embeddings",
            &json!({ "input": ["hello world", { "content": [
                { "type": "text", "text": "hello " }, { "type": "text", "text": "world" }] }] }),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["data"][1]["index"], 1);
    assert_eq!(v["data"][0]["embedding"], v["data"][1]["embedding"]);
    let (_, one) = send_json(
        app(),
        post_json("/v1/embeddings", &json!({ "input": "hello world" })),
    )
    .await;
    assert_eq!(
        v["usage"]["prompt_tokens"],
        one["usage"]["prompt_tokens"].as_u64().unwrap() * 2
    );

    let mut b = chat_body();
    b["n"] = json!(2);
    b["max_tokens"] = json!(2);
    let (status, v) = send_json(app(), post_json("/v1/chat/completions", &b)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["choices"][1]["message"]["role"], "assistant");

    // the greedy continuation's first word, banned by its text, is not generated again
    let (_, free) = send_json(
        app(),
        post_json(
            "/completion",
            &json!({ "prompt": "The sky is", "n_predict": 1, "temperature": 0 }),
        ),
    )
    .await;
    let word = free["content"].as_str().unwrap().to_string();
    assert!(!word.trim().is_empty(), "{free}");
    for bias in [
        json!([[word.clone(), false]]),
        json!({ word.clone(): -100 }),
    ] {
        let (status, v) = send_json(
            app(),
            post_json(
                "/completion",
                &json!({ "prompt": "The sky is", "n_predict": 1, "temperature": 0, "logit_bias": bias }),
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_ne!(v["content"], word.as_str(), "{v}");
    }
}

/// The JSON `data:` events of a server-sent event stream (the `[DONE]` marker left out).
fn data_events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

#[tokio::test]
async fn return_progress_streams_the_prefill_before_the_first_token() {
    let mut b = chat_body();
    b["messages"] = json!([{ "role": "user", "content": "This is a test. ".repeat(12) }]);
    b["stream"] = json!(true);
    b["return_progress"] = json!(true);
    let (status, _, body) = send(app(), post_json("/v1/chat/completions", &b)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let events = data_events(&body);
    let first_text = events
        .iter()
        .position(|c| c["choices"][0]["delta"]["content"].is_string())
        .unwrap();
    let progress: Vec<(usize, &Value)> = events
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.get("prompt_progress").map(|p| (i, p)))
        .collect();
    assert!(progress.len() >= 2, "{body}");
    let (first, last) = (progress[0].1, progress.last().unwrap().1);
    assert_eq!(first["cache"], first["processed"]);
    assert_eq!(last["processed"], last["total"]);
    for w in progress.windows(2) {
        assert!(w[1].1["processed"].as_u64() > w[0].1["processed"].as_u64());
        assert_eq!(w[1].1["total"], first["total"]);
    }
    assert!(progress.iter().all(|&(i, _)| i < first_text));
    // without it, none
    b["return_progress"] = json!(false);
    let (_, _, body) = send(app(), post_json("/v1/chat/completions", &b)).await;
    assert!(data_events(&body)
        .iter()
        .all(|c| c.get("prompt_progress").is_none()));
}

#[tokio::test]
async fn llama_server_fields_probabilities_settings_errors_and_verbose() {
    // probabilities after the sampler chain: each in (0, 1], the top ones most likely first
    let req = json!({ "prompt": "Today I would finally become a", "n_probs": 5, "n_predict": 3,
                      "temperature": 1.0, "post_sampling_probs": true, "seed": 7 });
    let (status, v) = send_json(app(), post_json("/completion", &req)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    for tok in v["completion_probabilities"].as_array().unwrap() {
        let p = tok["prob"].as_f64().unwrap();
        assert!(p > 0.0 && p <= 1.0, "{tok}");
        let top: Vec<f64> = tok["top_probs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["prob"].as_f64().unwrap())
            .collect();
        assert!(
            !top.is_empty() && top.windows(2).all(|w| w[0] >= w[1]),
            "{tok}"
        );
        assert!(tok.get("logprob").is_none());
    }
    // ignore_eos bans the end-of-generation tokens, shown as null biases
    let req = json!({ "prompt": "Once", "n_predict": 1, "ignore_eos": true });
    let (_, v) = send_json(app(), post_json("/completion", &req)).await;
    let bias = v["generation_settings"]["logit_bias"].as_array().unwrap();
    assert!(
        !bias.is_empty() && bias.iter().all(|b| b["bias"].is_null()),
        "{v}"
    );
    let req = json!({ "prompt": "Once", "n_predict": 1 });
    let (_, v) = send_json(app(), post_json("/completion", &req)).await;
    assert_eq!(v["generation_settings"]["logit_bias"], json!([]), "{v}");
    // a prompt beyond the slot's context: llama-server's error type with both counts
    let mut b = chat_body();
    b["messages"] = json!([{ "role": "user", "content": "What is the best book? ".repeat(60) }]);
    let (status, v) = send_json(app(), post_json("/v1/chat/completions", &b)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["type"], "exceed_context_size_error");
    assert_eq!(v["error"]["n_ctx"], 256);
    assert!(v["error"]["n_prompt_tokens"].as_u64().unwrap() > 256, "{v}");
    // two assistant turns at the end
    let mut b = chat_body();
    b["messages"] = json!([{ "role": "user", "content": "a" }, { "role": "assistant", "content": "b" },
                           { "role": "assistant", "content": "c" }]);
    expect_400("/v1/chat/completions", b, "two assistant messages").await;
    // __verbose carries the rendered prompt
    let mut b = chat_body();
    b["messages"] =
        json!([{ "role": "system", "content": "Book" }, { "role": "user", "content": "Hi" }]);
    b["verbose"] = json!(true);
    let (_, v) = send_json(app(), post_json("/v1/chat/completions", &b)).await;
    assert!(
        v["__verbose"]["prompt"].as_str().unwrap().contains("Book"),
        "{v}"
    );
    b["verbose"] = json!(false);
    let (_, v) = send_json(app(), post_json("/v1/chat/completions", &b)).await;
    assert!(v.get("__verbose").is_none(), "{v}");
    // Anthropic: no turn at all is answered; an image without a projector is the server's 500
    let msg = json!({ "max_tokens": 1, "messages": [] });
    let (status, v) = send_json(app(), post_json("/v1/messages", &msg)).await;
    assert_eq!(
        (status, &v["type"]),
        (StatusCode::OK, &json!("message")),
        "{v}"
    );
    let png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==";
    let image = json!({ "type": "image", "source": { "type": "base64", "media_type": "image/png", "data": png } });
    let msg = json!({ "max_tokens": 1, "messages": [
        { "role": "assistant", "content": [{ "type": "tool_use", "id": "t", "name": "read", "input": {} }] },
        { "role": "user", "content": [{ "type": "tool_result", "tool_use_id": "t", "content": [image] }] }] });
    let (status, v) = send_json(app(), post_json("/v1/messages", &msg)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    assert!(
        error_message(&v).contains("image input is not supported"),
        "{v}"
    );
}

/// A synthetic model with SmolLM2's tokenizer (its repo token `<reponame>`) and the
/// fill-in-the-middle tokens it lacks: prefix, suffix, middle and file separator.
fn fim_state() -> SharedState {
    use muser_model::synth::{presets, Plan, Vocab, WeightType};
    let dir = std::env::temp_dir().join(format!("muser-fim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let donor = muser_gguf::GgufFile::open(&model_path()).unwrap();
    let specials = [
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        "<|file_sep|>",
    ];
    let vocab = Vocab::from_donor(&donor, &specials, muser_text::CHATML_TEMPLATE).unwrap();
    let path = dir.join("fim.gguf");
    Plan::new(
        presets::preset("tiny").unwrap(),
        WeightType::F32,
        7,
        Some(vocab),
    )
    .write_file(&path, &mut |_| {})
    .unwrap();
    let mut cfg = ServeConfig::new(&path);
    cfg.n_slots = 1;
    cfg.n_ctx = 256;
    cfg.threads = 2;
    load(&cfg).expect("load the synthetic FIM model")
}

#[tokio::test]
async fn infill_places_the_parts_between_the_fim_tokens() {
    use muser_server::routes::llama::{infill_prompt, InfillBudget, InfillParts};
    // SmolLM2 has no FIM tokens: 501, as llama-server answers
    let req = json!({ "input_prefix": "def f():\n", "input_suffix": "\n" });
    let (status, v) = send_json(app(), post_json("/infill", &req)).await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED, "{v}");
    assert_eq!(v["error"]["type"], "not_supported_error");

    let state = fim_state();
    let tok = &state.tokenizer;
    let fim = tok.fim();
    let id = |t: &str| tok.token_id(t).unwrap();
    assert_eq!(
        (fim.pre, fim.suf, fim.mid, fim.rep, fim.sep),
        (
            Some(id("<fim_prefix>")),
            Some(id("<fim_suffix>")),
            Some(id("<fim_middle>")),
            Some(id("<reponame>")),
            Some(id("<|file_sep|>"))
        )
    );
    let chunk: muser_server::wire::llama::InfillChunk =
        serde_json::from_value(json!({ "filename": "a.h", "text": "int f();\n" })).unwrap();
    let parts = InfillParts {
        prefix: "int main() {\n",
        suffix: "}\n",
        prompt: "  return f",
        extra: std::slice::from_ref(&chunk),
    };
    let text = |s: &str| tok.encode(s, false, false);
    let (prefix, prompt) = (
        text("int main() {\n"),
        tok.encode("  return f", false, true),
    );
    let mut want = vec![id("<reponame>")];
    want.extend(text("myproject\n"));
    want.push(id("<|file_sep|>"));
    want.extend(text("a.h\n"));
    want.extend(text("int f();\n"));
    want.push(id("<|file_sep|>"));
    want.extend(text("filename\n"));
    want.extend(tok.bos().filter(|_| tok.add_bos()));
    want.push(id("<fim_prefix>"));
    want.extend(&prefix);
    want.extend(&prompt);
    want.push(id("<fim_suffix>"));
    want.extend(text("}\n"));
    want.push(id("<fim_middle>"));
    let roomy = InfillBudget {
        n_batch: 512,
        n_ctx: 4096,
        n_predict: 8,
    };
    assert_eq!(infill_prompt(tok, &parts, &roomy), want);
    // a context too small for the extra files drops them; a small batch keeps the prefix's
    // end and no suffix
    let small = InfillBudget {
        n_batch: 8,
        n_ctx: 16,
        n_predict: 8,
    };
    let got = infill_prompt(tok, &parts, &small);
    let at = got.iter().position(|&t| t == id("<fim_prefix>")).unwrap();
    assert!(at <= 1, "{got:?}");
    let kept = prefix.len().min(6);
    assert_eq!(got[at + 1..at + 1 + kept], prefix[prefix.len() - kept..]);
    assert_eq!(got[at + 1 + kept..got.len() - 2], prompt[..]);
    assert_eq!(
        got[got.len() - 2..],
        [id("<fim_suffix>"), id("<fim_middle>")]
    );

    let fim_app = router(state.clone());
    let req = json!({ "input_prefix": "def add(a, b):\n", "input_suffix": "\n", "prompt": "    return",
                      "input_extra": [{ "text": "x = 1\n" }], "n_predict": 2, "temperature": 0 });
    let (status, v) = send_json(fim_app.clone(), post_json("/infill", &req)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(v["tokens_evaluated"].as_u64().unwrap() > 10, "{v}");
    for (bad, needle) in [
        (json!({ "input_suffix": "" }), "input_prefix"),
        (
            json!({ "input_prefix": "", "input_suffix": "", "input_extra": [{ "filename": "a" }] }),
            "text",
        ),
        (
            json!({ "input_prefix": "", "input_suffix": "", "input_extra": [{ "text": "a", "filename": 1 }] }),
            "filename",
        ),
        (
            json!({ "input_prefix": "", "input_suffix": "", "prompt": [1, 2] }),
            "prompt",
        ),
    ] {
        let (status, v) = send_json(fim_app.clone(), post_json("/infill", &bad)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert!(error_message(&v).contains(needle), "{bad}: {v}");
    }
    expect_400(
        "/completion",
        json!({ "prompt": "a", "input_prefix": "b" }),
        "/infill",
    )
    .await;
}

/// A server pooling `pool` (one slot of 256 tokens).
fn pooling_state(pool: muser_engine::Pooling) -> SharedState {
    let mut cfg = ServeConfig::new(model_path());
    cfg.n_slots = 1;
    cfg.n_ctx = 256;
    cfg.threads = 2;
    cfg.pooling = pool;
    load(&cfg).expect("load SmolLM2")
}

#[tokio::test]
async fn mean_pooling_averages_every_row_that_none_returns() {
    use muser_engine::Pooling;
    let text = "I believe the meaning of life is";
    let input = json!({ "input": text });
    let (status, last) = send_json(app(), post_json("/v1/embeddings", &input)).await;
    assert_eq!(status, StatusCode::OK, "{last}");
    let mean_app = router(pooling_state(Pooling::Mean));
    let (status, mean) = send_json(mean_app.clone(), post_json("/v1/embeddings", &input)).await;
    assert_eq!(status, StatusCode::OK, "{mean}");
    let vec = |v: &Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let mean = vec(&mean["data"][0]["embedding"]);
    let norm: f64 = mean.iter().map(|x| x * x).sum();
    assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    assert_ne!(mean, vec(&last["data"][0]["embedding"]));
    // the same again (no cached prefix skips a row)
    let (_, again) = send_json(mean_app, post_json("/v1/embeddings", &input)).await;
    assert_eq!(vec(&again["data"][0]["embedding"]), mean);

    let none_app = router(pooling_state(Pooling::None));
    let (status, v) = send_json(none_app.clone(), post_json("/v1/embeddings", &input)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let (status, v) = send_json(
        none_app,
        post_json("/embedding", &json!({ "content": text })),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let rows = v[0]["embedding"].as_array().unwrap();
    let n_tokens = open_state().tokenizer.encode(text, true, true).len();
    assert_eq!(rows.len(), n_tokens);
    // their mean, normalized, is the mean-pooled vector
    let mut sum = vec![0.0; mean.len()];
    for r in rows {
        for (s, x) in sum.iter_mut().zip(vec(r)) {
            *s += x;
        }
    }
    let n = sum.iter().map(|x| x * x).sum::<f64>().sqrt();
    for (a, b) in sum.iter().map(|x| x / n).zip(&mean) {
        assert!((a - b).abs() < 1e-4, "{a} {b}");
    }
}
