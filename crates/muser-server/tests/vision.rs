//! Images on the routes (`--mmproj`), in-process, on the synthetic text model and projector of
//! muser-vision's goldens: `/completion` with `multimodal_data` gives llama.cpp's libmtmd tokens
//! after the image; OpenAI and Ollama chats count the image's rows in the prompt; bad images
//! are 400s while a text request on the same server still gets its answer.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use axum::body::{to_bytes, Body};
use axum::http::{header, Request, StatusCode};
use base64::Engine as _;
use muser_gguf::{GgmlType, GgufFile};
use muser_model::synth::{presets, Plan, Vocab, WeightType};
use muser_server::routes::router;
use muser_server::server::{load, ServeConfig};
use muser_server::state::SharedState;
use serde_json::{json, Value};
use tower::ServiceExt;

mod common;

fn vision_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../muser-vision/tests")
}

fn goldens() -> Value {
    serde_json::from_slice(&std::fs::read(vision_dir().join("golden/goldens.json")).unwrap())
        .unwrap()
}

/// The goldens' text model (SmolLM2's tokenizer with Muse's special tokens) and projector,
/// served with one slot of 512 tokens and at most 4 images a request.
fn state() -> SharedState {
    static STATE: OnceLock<SharedState> = OnceLock::new();
    STATE
        .get_or_init(|| {
            let doc = goldens();
            let dir = std::env::temp_dir().join(format!("muser-vision-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let t = &doc["text"];
            let donor = GgufFile::open(&common::smollm2_path()).unwrap();
            let mut specials = muser_text::muse::SPECIAL_TOKENS.to_vec();
            specials.push("<|endoftext|>");
            let vocab =
                Vocab::from_donor(&donor, &specials, muser_text::muse::CHAT_TEMPLATE).unwrap();
            let text = dir.join("text.gguf");
            Plan::new(
                presets::preset(t["preset"].as_str().unwrap()).unwrap(),
                WeightType::from_name(t["type"].as_str().unwrap()).unwrap(),
                t["seed"].as_u64().unwrap(),
                Some(vocab),
            )
            .write_file(&text, &mut |_| {})
            .unwrap();
            let p = &doc["projector"];
            let mmproj = dir.join("mmproj.gguf");
            let preset = muser_vision::synth::preset(p["preset"].as_str().unwrap()).unwrap();
            muser_vision::synth::write_projector(
                &mmproj,
                &preset,
                GgmlType::F16,
                p["seed"].as_u64().unwrap(),
            )
            .unwrap();
            let mut cfg = ServeConfig::new(&text);
            cfg.n_slots = 2;
            cfg.n_ctx = 512;
            cfg.threads = 2;
            cfg.mmproj = Some(mmproj);
            cfg.max_images = 4;
            load(&cfg).expect("load the synthetic vision model")
        })
        .clone()
}

fn image_b64(name: &str) -> String {
    let bytes = std::fs::read(vision_dir().join("data").join(name)).unwrap();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

async fn post(path: &str, body: &Value) -> (StatusCode, Value) {
    let req = Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = router(state()).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn chat(content: Value) -> Value {
    json!({ "messages": [{ "role": "user", "content": content }], "max_tokens": 4, "temperature": 0 })
}

fn image_part(url: &str) -> Value {
    json!({ "type": "image_url", "image_url": { "url": url } })
}

/// `/completion` with llama.cpp's multimodal prompt gives the tokens libmtmd gave after the
/// image (`scripts/vision-goldens.sh`: "Look: <__media__>\nIt is", greedy, 16 tokens), for the
/// images whose embeddings are bit-exact.
#[tokio::test]
async fn completion_after_an_image_equals_llama_cpp() {
    let doc = goldens();
    for name in ["rgb-37x23", "gray-20x52"] {
        let img = doc["images"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["name"] == name)
            .unwrap();
        let want = &img["run"]["tokens"];
        let body = json!({
            "prompt": { "prompt_string": "Look: <__media__>\nIt is",
                        "multimodal_data": [image_b64(img["file"].as_str().unwrap())] },
            "n_predict": want.as_array().unwrap().len(), "temperature": 0,
            "return_tokens": true, "cache_prompt": false,
        });
        let (status, v) = post("/completion", &body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(&v["tokens"], want, "{name}");
        assert_eq!(
            v["tokens_evaluated"].as_u64().unwrap(),
            img["run"]["n_past"].as_u64().unwrap(),
            "{name}: prompt tokens, image rows included"
        );
    }
}

/// An image part adds its rows and its begin and end tokens to the prompt; the Ollama routes
/// count the same.
#[tokio::test]
async fn chat_images_count_in_the_prompt_on_openai_and_ollama() {
    let png = image_b64("rgb-37x23.png");
    let (status, text_only) = post("/v1/chat/completions", &chat(json!("What is this?"))).await;
    assert_eq!(status, StatusCode::OK, "{text_only}");
    let n_text = text_only["usage"]["prompt_tokens"].as_u64().unwrap();
    let parts = json!([image_part(&format!("data:image/png;base64,{png}")), { "type": "text", "text": "What is this?" }]);
    let (status, v) = post("/v1/chat/completions", &chat(parts)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // 6 image rows (mtmd's grid for 37x23 on a 16-pixel cell), <|image_start|>, <|image_end|>
    let n_image = 6 + 2;
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        n_text + n_image
    );
    let ollama = json!({
        "model": "text", "stream": false, "options": { "num_predict": 4, "temperature": 0 },
        "messages": [{ "role": "user", "content": "What is this?", "images": [png] }],
    });
    let (status, o) = post("/api/chat", &ollama).await;
    assert_eq!(status, StatusCode::OK, "{o}");
    assert_eq!(o["prompt_eval_count"].as_u64().unwrap(), n_text + n_image);
    assert_eq!(
        o["message"]["content"],
        v["choices"][0]["message"]["content"]
    );
    let generate = json!({
        "model": "text", "stream": false, "prompt": "What is this?", "images": [png],
        "options": { "num_predict": 4, "temperature": 0 },
    });
    let (status, g) = post("/api/generate", &generate).await;
    assert_eq!(status, StatusCode::OK, "{g}");
    assert_eq!(g["prompt_eval_count"].as_u64().unwrap(), n_text + n_image);
    assert!(g["context"].is_null(), "image rows have no ids to return");
}

/// A PNG whose header claims `w × h` pixels, with no pixel data (as in muser-vision's
/// `tests/hostile.rs`).
fn png_header(w: u32, h: u32) -> Vec<u8> {
    let crc32 = |data: &[u8]| {
        let mut c = !0u32;
        for &b in data {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
        }
        !c
    };
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    out.extend_from_slice(&13u32.to_be_bytes());
    out.extend_from_slice(&ihdr);
    out.extend_from_slice(&crc32(&ihdr).to_be_bytes());
    // an empty IDAT (the decoder reads the header up to the first one) and the end
    for chunk in [&b"IDAT"[..], &b"IEND"[..]] {
        out.extend_from_slice(&0u32.to_be_bytes());
        out.extend_from_slice(chunk);
        out.extend_from_slice(&crc32(chunk).to_be_bytes());
    }
    out
}

/// Each bad image is a 400 naming the problem, and a text request sent at the same time
/// still gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_images_are_400_and_text_still_answers() {
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let png = std::fs::read(vision_dir().join("data/rgb-37x23.png")).unwrap();
    let data = |bytes: &[u8]| format!("data:image/png;base64,{}", b64(bytes));
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "truncated",
            chat(json!([image_part(&data(&png[..png.len() / 2]))])),
            "image 0",
        ),
        (
            "huge",
            chat(json!([image_part(&data(&png_header(100_000, 100_000)))])),
            "too large",
        ),
        (
            "wrong MIME",
            chat(json!([image_part(&format!(
                "data:image/gif;base64,{}",
                b64(&png)
            ))])),
            "image/gif",
        ),
        (
            "bad base64",
            chat(json!([image_part("data:image/png;base64,***")])),
            "base64",
        ),
        (
            "remote",
            chat(json!([image_part("https://example.com/cat.png")])),
            "not fetched",
        ),
        (
            "not an image",
            chat(json!([image_part(&data(b"hello"))])),
            "image 0",
        ),
        (
            "50 images",
            chat(json!(vec![image_part(&data(&png)); 50])),
            "at most 4",
        ),
    ];
    let text = tokio::spawn(async { post("/v1/chat/completions", &chat(json!("Hi"))).await });
    for (what, body, needle) in cases {
        let (status, v) = post("/v1/chat/completions", &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{what}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{what}: `{msg}` lacks `{needle}`");
    }
    let markers = json!({ "prompt": { "prompt_string": "<__media__> and <__media__>",
                                      "multimodal_data": [b64(&png)] }, "n_predict": 1 });
    let (status, v) = post("/completion", &markers).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("marks 2 images"),
        "{v}"
    );
    let ollama = json!({ "model": "text", "stream": false, "prompt": "x", "images": ["%%"] });
    let (status, v) = post("/api/generate", &ollama).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let (status, v) = text.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

/// A projector made for another width is refused at start-up, naming both widths.
#[test]
fn a_projector_of_another_width_is_refused() {
    let dir = std::env::temp_dir().join(format!("muser-vision-width-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mmproj = dir.join("mmproj.gguf");
    let preset = muser_vision::synth::preset("vision-tiny").unwrap();
    muser_vision::synth::write_projector(&mmproj, &preset, GgmlType::F16, 7).unwrap();
    let mut cfg = ServeConfig::new(common::smollm2_path());
    cfg.n_ctx = 64;
    cfg.threads = 1;
    cfg.mmproj = Some(mmproj);
    let err = load(&cfg).err().expect("SmolLM2 is 576 wide").to_string();
    assert!(
        err.contains("256 wide but the text model's are 576"),
        "{err}"
    );
}

fn message(content: Value) -> Value {
    json!({ "max_tokens": 4, "temperature": 0,
            "messages": [{ "role": "user", "content": content }] })
}

fn image_block(media_type: &str, data: &str) -> Value {
    json!({ "type": "image", "source": { "type": "base64", "media_type": media_type, "data": data } })
}

/// An Anthropic image block is the chat route's image: the same rows in the prompt (and in
/// count_tokens) and the same greedy answer; bad sources are 400s naming the problem.
#[tokio::test]
async fn anthropic_image_blocks_are_chat_images() {
    let png = image_b64("rgb-37x23.png");
    let text = json!({ "type": "text", "text": "What is this?" });
    let (status, text_only) = post("/v1/messages", &message(json!([text]))).await;
    assert_eq!(status, StatusCode::OK, "{text_only}");
    let (status, m) = post(
        "/v1/messages",
        &message(json!([image_block("image/png", &png), text])),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{m}");
    assert_eq!(
        m["usage"]["input_tokens"].as_u64().unwrap(),
        text_only["usage"]["input_tokens"].as_u64().unwrap() + 6 + 2
    );
    // count_tokens counts the image's rows from its size
    let count = json!({ "messages": [{ "role": "user", "content": [image_block("image/png", &png), text] }] });
    let (status, n) = post("/v1/messages/count_tokens", &count).await;
    assert_eq!(status, StatusCode::OK, "{n}");
    assert_eq!(n["input_tokens"], m["usage"]["input_tokens"]);
    let parts = json!([image_part(&format!("data:image/png;base64,{png}")), text]);
    let (status, c) = post("/v1/chat/completions", &chat(parts)).await;
    assert_eq!(status, StatusCode::OK, "{c}");
    assert_eq!(
        m["content"][0]["text"],
        c["choices"][0]["message"]["content"]
    );

    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "wrong media_type",
            json!([image_block("image/gif", &png)]),
            "image/gif",
        ),
        (
            "bad base64",
            json!([image_block("image/png", "not base64!")]),
            "base64",
        ),
        (
            "url source",
            json!([{ "type": "image", "source": { "type": "url", "url": "https://example.com/a.png" } }]),
            "not fetched",
        ),
        (
            "unknown source",
            json!([{ "type": "image", "source": { "type": "file", "file_id": "f" } }]),
            "image source",
        ),
        (
            "too many images",
            json!(vec![image_block("image/png", &png); 5]),
            "at most 4",
        ),
        (
            "undecodable",
            json!([image_block("image/png", &png[..png.len() / 8 * 4])]),
            "image 0",
        ),
    ];
    for (what, content, needle) in cases {
        let (status, v) = post("/v1/messages", &message(content)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{what}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{what}: `{msg}` lacks `{needle}`");
    }
}
