//! The router in-process (tower `oneshot`) on the real SmolLM2 model: strictness, limits,
//! auth, queueing and the main routes. Each rejection is asserted with its status and message.
//!
//! One test binary whose modules share the servers loaded here: `guards.rs` (what every route
//! refuses or bounds), `routes.rs` (each API's shape), `options.rs` (request options).

use axum::body::{to_bytes, Body};
use axum::http::{header, Request, StatusCode};
use axum::Router;
use muser_server::routes::router;
use muser_server::server::{load, ServeConfig};
use muser_server::state::SharedState;
use serde_json::{json, Value};
use std::sync::OnceLock;
use tower::ServiceExt;

#[path = "../common/mod.rs"]
mod common;
mod guards;
mod options;
mod routes;
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
