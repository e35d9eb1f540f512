//! Ollama-shaped routes: /api/generate and /api/chat (NDJSON streaming by default),
//! /api/tags, /api/show, /api/version.

use super::{ndjson_response, Log};
use crate::chat::{self, OutputParser, Piece};
use crate::error::{ApiError, ApiResult};
use crate::gen::{self, Finished, SamplingOptions, Step};
use crate::json::StrictJson;
use crate::limits;
use crate::state::{AppState, SharedState};
use crate::structured;
use crate::vision::WireImage;
use crate::wire::ollama::{ChatRequest, GenerateRequest as OllamaGenerate, Options, ShowRequest};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use muser_engine::{GenerateRequest, SamplingParams};
use serde_json::{json, Value};
use std::time::Instant;

fn created_at() -> String {
    // RFC 3339 in UTC, from the Unix clock (no date crate needed).
    let secs = super::unix_now();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn sampling(options: Option<&Options>) -> ApiResult<(SamplingOptions, Option<u32>, Vec<String>)> {
    let Some(o) = options else {
        return Ok((SamplingOptions::default(), None, Vec::new()));
    };
    let max_tokens = match o.num_predict {
        None | Some(-1) | Some(-2) => None,
        Some(n) if n >= 0 => Some(u32::try_from(n).unwrap_or(u32::MAX)),
        Some(n) => {
            return Err(ApiError::bad_request(format!(
                "num_predict must be -1 or more, got {n}"
            )))
        }
    };
    let opts = SamplingOptions {
        temperature: o.temperature,
        top_k: o.top_k,
        top_p: o.top_p,
        min_p: o.min_p,
        typical_p: o.typical_p,
        repeat_penalty: o.repeat_penalty,
        repeat_last_n: o.repeat_last_n,
        presence_penalty: o.presence_penalty,
        frequency_penalty: o.frequency_penalty,
        seed: o.seed,
        ..Default::default()
    };
    Ok((
        opts,
        max_tokens,
        o.stop.clone().map(|s| s.0).unwrap_or_default(),
    ))
}

fn check_common(state: &AppState, options: Option<&Options>) -> ApiResult<()> {
    if let Some(n) = options.and_then(|o| o.num_ctx) {
        if n as usize > state.options.n_ctx {
            return Err(ApiError::bad_request(format!(
                "options.num_ctx {n} exceeds the server's context per slot ({})",
                state.options.n_ctx
            )));
        }
    }
    Ok(())
}

fn final_counts(v: &mut Value, done: &Finished, total_ns: u128) {
    v["done"] = json!(true);
    v["done_reason"] = json!(done.openai_reason());
    v["total_duration"] = json!(total_ns as u64);
    v["load_duration"] = json!(0);
    v["prompt_eval_count"] = json!(done.n_prompt);
    v["prompt_eval_duration"] = json!((done.prompt_ms * 1e6) as u64);
    v["eval_count"] = json!(done.n_gen);
    v["eval_duration"] = json!((done.gen_ms * 1e6) as u64);
}

/// The images of a request's messages (base64, in order) and the marker they are rendered
/// as; their count is checked before any is decoded.
fn ollama_images<'a>(
    state: &AppState,
    lists: impl IntoIterator<Item = Option<&'a [String]>>,
) -> ApiResult<(String, Vec<WireImage>)> {
    let all: Vec<&String> = lists.into_iter().flatten().flatten().collect();
    state.check_image_count(all.len())?;
    let marker = state
        .vision
        .as_ref()
        .map_or(String::new(), |v| v.chat_marker().to_string());
    let images = all
        .into_iter()
        .map(|b| WireImage::from_base64(b))
        .collect::<ApiResult<_>>()?;
    Ok((marker, images))
}

fn stream_error(e: &ApiError) -> String {
    format!("{}\n", json!({ "error": e.message }))
}

pub async fn generate(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(req): StrictJson<OllamaGenerate>,
) -> ApiResult<Response> {
    let start = Instant::now();
    state.check_model(Some(&req.model))?;
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_request(
            "suffix (fill-in-the-middle) is not supported",
        ));
    }
    if req.template.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_request(
            "template is not supported: the model's own chat template is used",
        ));
    }
    check_common(&state, req.options.as_ref())?;
    let model = state.model.id.clone();
    if req.prompt.is_empty() && req.context.is_none() {
        // Ollama answers an empty prompt by loading the model; it is always loaded here.
        return Ok(Json(
            json!({ "model": model, "created_at": created_at(), "response": "",
                               "done": true, "done_reason": "load" }),
        )
        .into_response());
    }
    // the grammar, the template and the tokenizer run on the work pool
    let (req, constraint, ids, images) = state
        .cpu(move |state| {
            let constraint =
                structured::plan_format(state, req.format.as_ref(), req.raw != Some(true))?;
            let (marker, images) = ollama_images(state, [req.images.as_deref()])?;
            let prompt = format!("{}{}", marker.repeat(images.len()), req.prompt);
            let text = if req.raw == Some(true) {
                prompt
            } else {
                let mut messages = Vec::new();
                if let Some(system) = req.system.as_ref().filter(|s| !s.is_empty()) {
                    messages.push(json!({ "role": "system", "content": system }));
                }
                messages.push(json!({ "role": "user", "content": prompt }));
                chat::render(state, messages, None, true, Default::default())?
            };
            let context = req.context.as_deref().unwrap_or_default();
            limits::check_count("context tokens", context.len(), state.prompt_tokens_max())?;
            let mut ids = context
                .iter()
                .map(|&t| state.check_token(t))
                .collect::<ApiResult<Vec<_>>>()?;
            let (more, mut images) =
                state.encode_with_images(&text, ids.is_empty(), &marker, images)?;
            for img in &mut images {
                img.at += ids.len();
            }
            ids.extend(more);
            Ok((req, constraint, ids, images))
        })
        .await?;
    let (opts, max_tokens, stop) = sampling(req.options.as_ref())?;
    let greq_has_images = !images.is_empty();
    let greq = GenerateRequest {
        prompt: ids.clone(),
        params: SamplingParams {
            constraint,
            ..opts.to_params(&state.options.sampling)?
        },
        max_tokens,
        stop,
        slot: None,
        cache_prompt: true,
        embeddings: false,
        special: state.model.is_muse,
        prefilled: None,
        speculative: Default::default(),
        images,
    };
    let rx = gen::submit(&state, &log, greq).await?;
    // image rows have no token ids to give back: a prompt with images returns no context
    let mut context = match greq_has_images {
        true => None,
        false => Some(ids),
    };
    if req.stream.unwrap_or(true) {
        let body = gen::stream_body(rx, log.0.clone(), move |step| match step {
            Ok(Step::Token { id, text, .. }) => {
                if let Some(c) = &mut context {
                    c.push(id);
                }
                vec![format!(
                    "{}\n",
                    json!({ "model": model, "created_at": created_at(), "response": text, "done": false })
                )]
            }
            Ok(Step::Embedding(_) | Step::Progress(_)) => Vec::new(),
            Ok(Step::Done(done)) => {
                let mut v = json!({ "model": model, "created_at": created_at(), "response": "", "context": context });
                final_counts(&mut v, &done, start.elapsed().as_nanos());
                vec![format!("{v}\n")]
            }
            Err(e) => vec![stream_error(&e)],
        });
        return Ok(ndjson_response(body));
    }
    let out = gen::collect(rx, &log).await?;
    if let Some(c) = &mut context {
        c.extend(&out.tokens);
    }
    let msg = chat::split_output(state.model.is_muse, None, &out.text);
    let mut v = json!({ "model": model, "created_at": created_at(), "response": msg.content, "context": context });
    if !msg.reasoning.is_empty() {
        v["thinking"] = json!(msg.reasoning);
    }
    final_counts(&mut v, &out.done, start.elapsed().as_nanos());
    Ok(Json(v).into_response())
}

pub async fn chat(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(req): StrictJson<ChatRequest>,
) -> ApiResult<Response> {
    let start = Instant::now();
    state.check_model(Some(&req.model))?;
    check_common(&state, req.options.as_ref())?;
    limits::check_count("messages", req.messages.len(), limits::MESSAGES_MAX)?;
    limits::check_count(
        "tools",
        req.tools.as_ref().map_or(0, Vec::len),
        limits::TOOLS_MAX,
    )?;
    let (marker, images) = ollama_images(&state, req.messages.iter().map(|m| m.images.as_deref()))?;
    let mut messages = Vec::new();
    for m in &req.messages {
        // Ollama puts a message's images before its text
        let n_images = m.images.as_ref().map_or(0, Vec::len);
        let content = format!("{}{}", marker.repeat(n_images), m.content);
        let mut msg = json!({ "role": m.role.as_str(), "content": content });
        if let Some(t) = &m.thinking {
            msg["reasoning_content"] = json!(t);
        }
        if let Some(calls) = &m.tool_calls {
            msg["tool_calls"] = json!(calls);
        }
        if let Some(name) = &m.tool_name {
            msg["name"] = json!(name);
        }
        messages.push(msg);
    }
    let tools = req
        .tools
        .as_ref()
        .filter(|t| !t.is_empty())
        .map(|t| json!(t));
    // the grammar, the template and the tokenizer run on the work pool
    let (req, tools, constraint, ids, images) = state
        .cpu(move |state| {
            let constraint = structured::plan_format(state, req.format.as_ref(), true)?;
            let text = chat::render(state, messages, tools.clone(), true, Default::default())?;
            let (ids, images) = state.encode_with_images(&text, true, &marker, images)?;
            Ok((req, tools, constraint, ids, images))
        })
        .await?;
    let (opts, max_tokens, stop) = sampling(req.options.as_ref())?;
    let greq = GenerateRequest {
        prompt: ids,
        params: SamplingParams {
            constraint,
            ..opts.to_params(&state.options.sampling)?
        },
        max_tokens,
        stop,
        slot: None,
        cache_prompt: true,
        embeddings: false,
        special: state.model.is_muse,
        prefilled: None,
        speculative: Default::default(),
        images,
    };
    let rx = gen::submit(&state, &log, greq).await?;
    let model = state.model.id.clone();
    let tool_call = |name: &str, args: &str| {
        let arguments = serde_json::from_str::<Value>(args).unwrap_or_else(|_| json!(args));
        json!({ "function": { "name": name, "arguments": arguments } })
    };
    if req.stream.unwrap_or(true) {
        let mut parser = OutputParser::new(state.model.is_muse, tools.as_ref());
        let body = gen::stream_body(rx, log.0.clone(), move |step| {
            let line = |message: Value| {
                format!(
                    "{}\n",
                    json!({ "model": model, "created_at": created_at(), "message": message, "done": false })
                )
            };
            let render = |pieces: Vec<Piece>| -> Vec<String> {
                pieces
                    .into_iter()
                    .map(|p| match p {
                        Piece::Content(s) => line(json!({ "role": "assistant", "content": s })),
                        Piece::Reasoning(s) => line(json!({ "role": "assistant", "content": "", "thinking": s })),
                        Piece::ToolCall { name, arguments } => line(json!({
                            "role": "assistant", "content": "", "tool_calls": [tool_call(&name, &arguments)]
                        })),
                    })
                    .collect()
            };
            match step {
                Ok(Step::Token { text, .. }) => render(parser.push(&text)),
                Ok(Step::Embedding(_) | Step::Progress(_)) => Vec::new(),
                Ok(Step::Done(done)) => {
                    let mut frames = render(parser.finish());
                    let mut v = json!({ "model": model, "created_at": created_at(),
                                        "message": { "role": "assistant", "content": "" } });
                    final_counts(&mut v, &done, start.elapsed().as_nanos());
                    frames.push(format!("{v}\n"));
                    frames
                }
                Err(e) => vec![stream_error(&e)],
            }
        });
        return Ok(ndjson_response(body));
    }
    let out = gen::collect(rx, &log).await?;
    let msg = chat::split_output(state.model.is_muse, tools.as_ref(), &out.text);
    let mut message = json!({ "role": "assistant", "content": msg.content });
    if !msg.reasoning.is_empty() {
        message["thinking"] = json!(msg.reasoning);
    }
    if !msg.tool_calls.is_empty() {
        message["tool_calls"] = msg
            .tool_calls
            .iter()
            .map(|(n, a)| tool_call(n, a))
            .collect();
    }
    let mut v = json!({ "model": model, "created_at": created_at(), "message": message });
    final_counts(&mut v, &out.done, start.elapsed().as_nanos());
    Ok(Json(v).into_response())
}

fn details(state: &AppState) -> Value {
    let m = &state.model;
    json!({
        "format": "gguf", "family": m.arch, "families": [m.arch],
        "parameter_size": format!("{:.0}M", m.n_params as f64 / 1e6),
        "quantization_level": m.file_type,
    })
}

pub async fn tags(State(state): State<SharedState>) -> Json<Value> {
    let m = &state.model;
    Json(json!({ "models": [{
        "name": m.id, "model": m.id, "modified_at": created_at(), "size": m.size_bytes,
        "digest": "", "details": details(&state),
    }]}))
}

pub async fn show(
    State(state): State<SharedState>,
    StrictJson(req): StrictJson<ShowRequest>,
) -> ApiResult<Json<Value>> {
    let name = req.model.as_deref().or(req.name.as_deref());
    if name.is_none() {
        return Err(ApiError::bad_request("missing `model`"));
    }
    state.check_model(name)?;
    let m = &state.model;
    Ok(Json(json!({
        "modelfile": "", "parameters": "", "template": m.chat_template.clone().unwrap_or_default(),
        "details": details(&state),
        "model_info": {
            "general.architecture": m.arch, "general.parameter_count": m.n_params,
            format!("{}.context_length", m.arch): m.n_ctx_train,
            format!("{}.embedding_length", m.arch): m.n_embd,
        },
        "capabilities": ["completion"],
    })))
}

pub async fn version() -> Json<Value> {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn civil_dates() {
        assert_eq!(super::civil_from_days(0), (1970, 1, 1));
        assert_eq!(super::civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(super::civil_from_days(11_016), (2000, 2, 29));
    }
}
