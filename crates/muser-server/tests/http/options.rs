//! Request options: prompts and `n`, text `logit_bias`, progress, llama.cpp fields, infill, pooling.

use axum::http::StatusCode;
use muser_server::routes::router;
use muser_server::server::{load, ServeConfig};
use muser_server::state::SharedState;
use serde_json::{json, Value};

use super::{
    app, chat_body, error_message, expect_400, model_path, open_state, post_json, send, send_json,
};

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
