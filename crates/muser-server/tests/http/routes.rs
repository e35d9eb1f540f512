//! The main routes answer in their API's shape: OpenAI, llama.cpp, Ollama, Anthropic, slots.

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use muser_server::routes::router;
use serde_json::{json, Value};

use super::{app, chat_body, error_message, post_json, send, send_json, slot_state};

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
