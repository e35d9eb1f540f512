//! `--prompt-cache DIR` on the real SmolLM2 model: a server restarted on the same directory
//! resumes the block-aligned prefix of a prompt it computed before (llama.cpp
//! `tokens_cached`, OpenAI `usage.prompt_tokens_details.cached_tokens`) and answers with the
//! same greedy text as the first server.

use axum::body::{to_bytes, Body};
use axum::http::{header, Request, StatusCode};
use muser_engine::PromptCacheConfig;
use muser_server::routes::router;
use muser_server::server::{load, ServeConfig};
use serde_json::{json, Value};
use std::path::Path;
use tower::ServiceExt;

mod common;
use common::smollm2_path as model_path;

fn config(dir: &Path) -> ServeConfig {
    let mut cfg = ServeConfig::new(model_path());
    cfg.n_slots = 1;
    cfg.n_ctx = 1024;
    cfg.threads = 2;
    cfg.kv_key_file = Some(dir.join("kv.key"));
    cfg.prompt_cache = Some(PromptCacheConfig::new(dir.join("cache")));
    cfg
}

async fn post(app: axum::Router, path: &str, body: Value) -> Value {
    let req = Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let res = app.oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = to_bytes(res.into_body(), 1 << 20).await.unwrap();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(status, StatusCode::OK, "{v}");
    v
}

async fn get(app: axum::Router, path: &str) -> Value {
    let res = app
        .oneshot(Request::get(path).body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    serde_json::from_slice(&to_bytes(res.into_body(), 1 << 20).await.unwrap()).unwrap()
}

fn prompt() -> String {
    let mut s = String::new();
    for i in 0..40 {
        s.push_str(&format!(
            "Line {i}: the lighthouse keeper counted {} ships passing the northern reef. ",
            i * 7 + 3
        ));
    }
    s.push_str("Summary:");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_resumes_the_prompt_from_the_cache_directory() {
    let dir =
        std::env::temp_dir().join(format!("muser-server-prompt-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kv.key"), [7u8; 32]).unwrap();
    let body = json!({ "prompt": prompt(), "n_predict": 12, "temperature": 0.0, "top_k": 1 });

    let first = {
        let state = load(&config(&dir)).expect("load SmolLM2");
        let v = post(router(state.clone()), "/completion", body.clone()).await;
        assert_eq!(v["tokens_cached"], 0, "{v}");
        assert!(v["tokens_evaluated"].as_u64().unwrap() > 512, "{v}");
        // the state (and with it the engine and the prompt cache's writer) goes away here
        drop(state);
        v
    };
    // give the engine thread's drop a moment when the runtime still holds a clone
    for _ in 0..50 {
        if std::fs::read_dir(dir.join("cache/packs")).is_ok_and(|mut d| d.next().is_some()) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    let state = load(&config(&dir)).expect("load SmolLM2 again");
    let app = router(state.clone());
    let second = post(app.clone(), "/completion", body.clone()).await;
    let n_cached = second["tokens_cached"].as_u64().unwrap();
    assert!(
        n_cached >= 512 && n_cached % 256 == 0,
        "block-aligned prefix from disk: {second}"
    );
    assert_eq!(second["content"], first["content"]);
    assert_eq!(second["timings"]["cache_n"], n_cached);
    let props = get(app.clone(), "/props").await;
    assert_eq!(props["prompt_cache"]["hits_disk"], 1, "{props}");
    assert_eq!(props["prompt_cache"]["rejected"], 0, "{props}");

    // OpenAI shape reports the cached prompt tokens too (here the slot's own cache serves
    // every prompt token but the last)
    let v = post(
        app,
        "/v1/completions",
        json!({ "prompt": prompt(), "max_tokens": 12, "temperature": 0.0 }),
    )
    .await;
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= n_cached, "{v}");
    assert_eq!(v["choices"][0]["text"], first["content"]);
    drop(state);
    let _ = std::fs::remove_dir_all(&dir);
}
