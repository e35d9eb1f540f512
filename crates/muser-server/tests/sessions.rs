//! Sessions end to end on SmolLM2, in-process: a conversation saved on server A, exported,
//! imported and restored on server B (its own engine, the same operator key), continues with
//! the same tokens as A's uninterrupted run, from the restored K/V. Tampered bundles, another
//! operator key, stale revisions and a reused idempotency key are refused with their status
//! and change nothing. Telemetry and /metrics report what the generations did.

use axum::body::{to_bytes, Body};
use axum::http::{header, Request, StatusCode};
use muser_server::routes::router;
use muser_server::server::{load, ServeConfig};
use muser_server::state::SharedState;
use serde_json::{json, Value};
use std::path::Path;
use tower::ServiceExt;

mod common;

/// One slot of 512 tokens, sessions in `dir`, the operator key in `key_file`.
fn server(dir: &Path, key_file: &Path) -> SharedState {
    let mut cfg = ServeConfig::new(common::smollm2_path());
    cfg.n_slots = 1;
    cfg.n_ctx = 512;
    cfg.threads = 2;
    cfg.kv_key_file = Some(key_file.to_path_buf());
    cfg.session_dir = Some(dir.to_path_buf());
    load(&cfg).expect("load SmolLM2")
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    bytes: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.bytes).unwrap_or(Value::Null)
    }
}

async fn call(
    state: &SharedState,
    method: &str,
    path: &str,
    body: Option<Value>,
    idem: Option<&str>,
) -> Reply {
    let mut r = Request::builder().method(method).uri(path);
    if body.is_some() {
        r = r.header(header::CONTENT_TYPE, "application/json");
    }
    if let Some(k) = idem {
        r = r.header("idempotency-key", k);
    }
    let body = body.map_or_else(Body::empty, |b| Body::from(b.to_string()));
    send(state, r.body(body).unwrap()).await
}

async fn send(state: &SharedState, req: Request<Body>) -> Reply {
    let resp = router(state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap()
        .to_vec();
    Reply {
        status,
        headers,
        bytes,
    }
}

async fn import(state: &SharedState, bundle: &[u8]) -> Reply {
    let req = Request::post("/v1/sessions/import")
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .body(Body::from(bundle.to_vec()))
        .unwrap();
    send(state, req).await
}

/// A greedy chat turn on slot 0: the answer and how many prompt tokens came from the cache.
async fn chat(state: &SharedState, messages: &[Value]) -> (String, u64) {
    let r = call(
        state,
        "POST",
        "/v1/chat/completions",
        Some(json!({
            "messages": messages, "max_tokens": 24, "temperature": 0, "id_slot": 0,
        })),
        None,
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.bytes)
    );
    let v = r.json();
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

async fn revision(state: &SharedState, id: &str) -> u64 {
    let r = call(state, "GET", &format!("/v1/sessions/{id}"), None, None).await;
    assert_eq!(r.status, StatusCode::OK);
    r.json()["revision"].as_u64().unwrap()
}

async fn session_ids(state: &SharedState) -> Vec<String> {
    let r = call(state, "GET", "/v1/sessions", None, None).await;
    assert_eq!(r.status, StatusCode::OK);
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_moves_between_servers_and_continues_with_the_same_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let key = tmp.path().join("kv.key");
    std::fs::write(&key, "11".repeat(32)).unwrap();
    let other_key = tmp.path().join("other.key");
    std::fs::write(&other_key, "22".repeat(32)).unwrap();
    let a = server(&tmp.path().join("a"), &key);

    // server A: one turn, saved as a session
    let q1 = json!({"role": "user", "content": "Name three colors of the rainbow."});
    let (a1, _) = chat(&a, std::slice::from_ref(&q1)).await;
    let turn1 = vec![q1.clone(), json!({"role": "assistant", "content": a1})];
    let create = json!({"id": "rainbow", "slot": 0, "messages": turn1});
    let first = call(
        &a,
        "POST",
        "/v1/sessions",
        Some(create.clone()),
        Some("k-1"),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.json());
    let created = first.json();
    assert_eq!(created["revision"], 1);
    let n_tokens = created["n_tokens"].as_u64().unwrap();
    assert!(n_tokens > 10, "{created}");
    let bundle = call(&a, "GET", "/v1/sessions/rainbow/bundle", None, None).await;
    assert_eq!(bundle.status, StatusCode::OK);
    let bundle = bundle.bytes;

    // a retry with the same key and body is answered again and writes nothing
    let retry = call(
        &a,
        "POST",
        "/v1/sessions",
        Some(create.clone()),
        Some("k-1"),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.json(), created);
    assert_eq!(retry.headers["idempotent-replay"], "true");
    // the same key with another body is refused, and nothing changes
    let mut other = create.clone();
    other["id"] = json!("rainbow-2");
    let reused = call(&a, "POST", "/v1/sessions", Some(other), Some("k-1")).await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.json()["error"]["type"], "idempotency_key_reused");
    assert_eq!(session_ids(&a).await, ["rainbow"]);
    // creating it again without a key: it exists, so the write is stale
    let again = call(&a, "POST", "/v1/sessions", Some(create), None).await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    // a write naming an old revision is refused; the bundle is unchanged
    let stale = json!({"slot": 0, "messages": turn1, "expected_revision": 7});
    let r = call(&a, "PUT", "/v1/sessions/rainbow", Some(stale), None).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.json()["error"]["type"], "stale_revision");
    let unchanged = call(&a, "GET", "/v1/sessions/rainbow/bundle", None, None).await;
    assert_eq!(unchanged.bytes, bundle);

    // A goes on uninterrupted
    let q2 = json!({"role": "user", "content": "And two more?"});
    let mut turn2 = turn1.clone();
    turn2.push(q2);
    let (a2, _) = chat(&a, &turn2).await;

    // server B: its own engine and store, the same operator key
    let b = server(&tmp.path().join("b"), &key);
    let imported = import(&b, &bundle).await;
    assert_eq!(
        imported.status,
        StatusCode::CREATED,
        "{:?}",
        imported.json()
    );
    assert_eq!(imported.json()["revision"], 1);
    let restored = call(
        &b,
        "POST",
        "/v1/sessions/rainbow/restore",
        Some(json!({"slot": 0})),
        None,
    )
    .await;
    assert_eq!(restored.status, StatusCode::OK, "{:?}", restored.json());
    assert_eq!(restored.json()["n_restored"].as_u64(), Some(n_tokens));
    assert_eq!(restored.json()["messages"], json!(turn1));
    let (b2, cached) = chat(&b, &turn2).await;
    assert_eq!(b2, a2, "the restored conversation continues differently");
    assert!(
        cached + 8 >= n_tokens,
        "B recomputed the prompt: {cached} of {n_tokens} tokens from the restored cache"
    );

    // B refuses a tampered bundle, and the same revision again
    let mut tampered = bundle.clone();
    let at = tampered.len() / 2;
    tampered[at] ^= 0x01;
    let r = import(&b, &tampered).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["type"], "invalid_bundle");
    let r = import(&b, &bundle).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(revision(&b, "rainbow").await, 1);

    // a server with another operator key cannot read it, and keeps nothing
    let c = server(&tmp.path().join("c"), &other_key);
    let r = import(&c, &bundle).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("another operator key"));
    assert!(session_ids(&c).await.is_empty());
    let r = call(
        &c,
        "POST",
        "/v1/sessions/rainbow/restore",
        Some(json!({"slot": 0})),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);

    // the next revision, then a delete that names it
    let next = json!({"slot": 0, "messages": turn2, "expected_revision": 1});
    let r = call(&b, "PUT", "/v1/sessions/rainbow", Some(next), None).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.json());
    assert_eq!(r.json()["revision"], 2);
    let r = call(
        &b,
        "DELETE",
        "/v1/sessions/rainbow?expected_revision=1",
        None,
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    let r = call(
        &b,
        "DELETE",
        "/v1/sessions/rainbow?expected_revision=2",
        None,
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(session_ids(&b).await.is_empty());

    // telemetry saw A's generations: tagged, measured values, and histograms on /metrics
    let t = call(&a, "GET", "/v1/telemetry", None, None).await.json();
    assert_eq!(t["schema"], "muser.telemetry.v1");
    let ttft = &t["lanes"]["local"]["ttft_ms"];
    assert_eq!(ttft["count"]["value"], 2, "{t}");
    assert_eq!(ttft["p50"]["tag"], "measured");
    assert!(ttft["p50"]["value"].as_f64().unwrap() > 0.0);
    assert!(
        t["lanes"].get("remote").is_none(),
        "an unused lane is absent"
    );
    assert_eq!(t["sessions"]["count"]["value"], 1);
    assert!(!t.to_string().contains("\"mock\""));
    let metrics = String::from_utf8(call(&a, "GET", "/metrics", None, None).await.bytes).unwrap();
    assert!(metrics
        .contains("muser_time_to_first_token_seconds_count{lane=\"local\",device=\"cpu\"} 2"));
    assert!(metrics.contains("muser_inter_token_seconds_bucket{lane=\"local\",device=\"cpu\""));
}

#[tokio::test]
async fn the_dashboard_is_served_from_the_binary() {
    let mut cfg = ServeConfig::new(common::smollm2_path());
    cfg.n_slots = 1;
    cfg.n_ctx = 64;
    cfg.threads = 1;
    let state = load(&cfg).expect("load SmolLM2");
    let r = call(&state, "GET", "/", None, None).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.headers[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    assert!(r.headers[header::CONTENT_SECURITY_POLICY]
        .to_str()
        .unwrap()
        .contains("default-src 'none'"));
    assert!(String::from_utf8_lossy(&r.bytes).contains("/assets/app.js"));
    let js = call(&state, "GET", "/assets/app.js", None, None).await;
    assert_eq!(js.status, StatusCode::OK);
    assert_eq!(
        call(&state, "GET", "/assets/nope.js", None, None)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    // without a session directory, the routes say how to turn sessions on
    let r = call(&state, "GET", "/v1/sessions", None, None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--session-dir"));
}
