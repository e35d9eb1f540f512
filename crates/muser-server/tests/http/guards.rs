//! What every route refuses or bounds: fields, bodies, limits, key, Host, queue, slot files.

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use muser_server::routes::router;
use muser_server::server::{load, ServeConfig};
use serde_json::{json, Value};
use tower::ServiceExt;

use super::{
    app, chat_body, error_message, expect_400, keyed_state, model_path, post_json, send, send_json,
};

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
