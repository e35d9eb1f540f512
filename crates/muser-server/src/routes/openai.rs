//! OpenAI-shaped routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models.

use super::{next_id, sse_response, unix_now, Log};
use crate::chat::{self, Piece};
use crate::error::{ApiError, ApiResult};
use crate::gen::{self, Finished, SamplingOptions, Step};
use crate::json::StrictJson;
use crate::limits;
use crate::reqlog::RequestLog;
use crate::state::{AppState, SharedState};
use crate::structured;
use crate::wire::openai::{
    ChatCompletionRequest, CompletionRequest, EmbeddingRequest, EncodingFormat, Role, ToolChoice,
};
use crate::wire::Prompts;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use muser_engine::{Event, GenerateRequest, Pooling, SamplingParams, TokenLogprobs};
use serde_json::{json, Value};
use tokio::sync::mpsc;

fn check_max_tokens(name: &str, v: Option<u32>) -> ApiResult<Option<u32>> {
    match v {
        Some(0) => Err(ApiError::bad_request(format!("{name} must be at least 1"))),
        other => Ok(other),
    }
}

/// Token counts of a request's generations (each prompt counted once per generation, as
/// OpenAI counts `n` choices).
fn usage<'a>(dones: impl IntoIterator<Item = &'a Finished>) -> Value {
    let (mut prompt, mut gen, mut cached) = (0u32, 0u32, 0u32);
    for d in dones {
        prompt += d.n_prompt;
        gen += d.n_gen;
        cached += d.n_cached;
    }
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": gen,
        "total_tokens": prompt + gen,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

fn piece_text(state: &AppState, id: u32) -> (String, Vec<u8>) {
    let bytes = state.tokenizer.token_to_piece(id, true).to_vec();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat `logprobs.content[i]`.
fn chat_logprob(state: &AppState, lp: &TokenLogprobs) -> Value {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = piece_text(state, id);
        json!({ "token": token, "logprob": logprob, "bytes": bytes })
    };
    let mut v = entry(lp.token.id, lp.token.logprob);
    v["top_logprobs"] = lp.top.iter().map(|t| entry(t.id, t.logprob)).collect();
    v
}

/// A chat request submitted to the engine, and the reader of its output (shared by the
/// OpenAI, Anthropic and Responses routes).
pub struct ChatRun {
    pub rx: mpsc::UnboundedReceiver<Event>,
    pub reader: chat::ChatReader,
    /// Tokens of the rendered prompt.
    pub n_prompt: usize,
    /// The rendered prompt.
    pub prompt: String,
}

/// A checked, rendered and tokenized chat request, ready to submit once or `n` times.
pub struct ChatPlan {
    pub greq: GenerateRequest,
    /// The rendered prompt.
    pub prompt: String,
    offered_tools: Option<Value>,
    generic_tool_call: bool,
}

impl ChatPlan {
    /// A reader of one generation's output.
    pub fn reader(&self, state: &AppState) -> chat::ChatReader {
        chat::ChatReader::new(
            state.model.is_muse,
            self.offered_tools.as_ref(),
            self.generic_tool_call,
        )
    }
}

/// Checks, renders and tokenizes a chat request; gives the request back (its response
/// options) with the plan.
pub async fn plan_chat(
    state: &SharedState,
    req: ChatCompletionRequest,
) -> ApiResult<(ChatCompletionRequest, ChatPlan)> {
    let max_tokens = match (
        check_max_tokens("max_tokens", req.max_tokens)?,
        check_max_tokens("max_completion_tokens", req.max_completion_tokens)?,
    ) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "give max_tokens or max_completion_tokens, not both",
            ))
        }
        (a, b) => a.or(b),
    };
    let n_probs = match (req.logprobs, req.top_logprobs) {
        (Some(true), top) => top.unwrap_or(0) as usize,
        (_, Some(_)) => return Err(ApiError::bad_request("top_logprobs needs logprobs: true")),
        _ => 0,
    };
    // response_format and forced tool choices become a grammar the sampler enforces; it,
    // the template and the tokenizer run on the work pool
    let (mut req, plan, ids, images, prompt) = state
        .cpu(move |state| {
            let plan = structured::plan_chat(state, &req)?;
            let images = chat::chat_images(state, &req.messages)?;
            let marker = state.vision.as_ref().map_or("", |v| v.chat_marker());
            let text = render_chat(state, &req)?;
            let (ids, images) = state.encode_with_images(&text, true, marker, images)?;
            Ok((req, plan, ids, images, text))
        })
        .await?;
    let sampling = req.sampling();
    let opts = SamplingOptions {
        temperature: sampling.temperature,
        top_k: sampling.top_k,
        top_p: sampling.top_p,
        min_p: sampling.min_p,
        repeat_penalty: sampling.repeat_penalty,
        presence_penalty: sampling.presence_penalty,
        frequency_penalty: sampling.frequency_penalty,
        seed: sampling.seed,
        n_probs: n_probs.max(usize::from(req.logprobs == Some(true))),
        logit_bias: gen::openai_logit_bias(state, sampling.logit_bias.as_ref())?,
        ..Default::default()
    };
    let mut params = opts.to_params(&state.options.sampling)?;
    params.constraint = plan.constraint;
    let greq = GenerateRequest {
        prompt: ids,
        params,
        max_tokens,
        stop: req.stop.take().map(|s| s.0).unwrap_or_default(),
        slot: super::slot_from(req.id_slot, state)?,
        cache_prompt: req.cache_prompt.unwrap_or(true),
        embeddings: false,
        // The Muse parser reads the control tokens that delimit its messages.
        special: state.model.is_muse,
        prefilled: None,
        speculative: gen::speculative(req.speculative())?,
        images,
    };
    let offered_tools = req.tools.as_deref().map(chat::tools_value);
    Ok((
        req,
        ChatPlan {
            greq,
            prompt,
            offered_tools,
            generic_tool_call: plan.generic_tool_call,
        },
    ))
}

/// Plans and submits a chat request of one choice.
pub async fn start_chat(
    state: &SharedState,
    log: &RequestLog,
    req: ChatCompletionRequest,
) -> ApiResult<(ChatCompletionRequest, ChatRun)> {
    gen::check_choices(req.n, 1)?;
    gen::check_one_stream(req.n.unwrap_or(1) as usize)?;
    let (req, plan) = plan_chat(state, req).await?;
    let reader = plan.reader(state);
    let n_prompt = plan.greq.prompt.len();
    let progress = req.stream && req.return_progress == Some(true);
    let rx = gen::submit_with(state, log, plan.greq, progress).await?;
    Ok((
        req,
        ChatRun {
            rx,
            reader,
            n_prompt,
            prompt: plan.prompt,
        },
    ))
}

/// A whole chat message from a generation's text: content, reasoning, tool calls, and the
/// finish reason.
fn chat_choice(
    state: &AppState,
    reader: chat::ChatReader,
    out: &gen::Output,
    index: usize,
    logprobs_on: bool,
) -> Value {
    let msg = reader.message(&out.text);
    let content = if msg.content.is_empty() && !msg.tool_calls.is_empty() {
        Value::Null
    } else {
        json!(msg.content)
    };
    let mut message = json!({ "role": "assistant", "content": content });
    if !msg.reasoning.is_empty() {
        message["reasoning_content"] = json!(msg.reasoning);
    }
    let finish = if msg.tool_calls.is_empty() {
        out.done.openai_reason()
    } else {
        message["tool_calls"] = msg
            .tool_calls
            .iter()
            .map(|(name, args)| {
                json!({ "id": next_id("call-"), "type": "function",
                        "function": { "name": name, "arguments": args } })
            })
            .collect();
        "tool_calls"
    };
    let logprobs = logprobs_on.then(|| json!({ "content": out.logprobs.iter().map(|lp| chat_logprob(state, lp)).collect::<Vec<_>>() }));
    json!({ "index": index, "message": message, "logprobs": logprobs, "finish_reason": finish })
}

/// `n` > 1 chat choices, generated whole.
async fn chat_choices(
    state: SharedState,
    log: &RequestLog,
    req: ChatCompletionRequest,
    n: usize,
) -> ApiResult<Response> {
    let (req, plan) = plan_chat(&state, req).await?;
    let outs = gen::generate_all(&state, log, vec![plan.greq.clone(); n]).await?;
    let logprobs_on = req.logprobs == Some(true);
    let choices: Vec<Value> = outs
        .iter()
        .enumerate()
        .map(|(i, out)| chat_choice(&state, plan.reader(&state), out, i, logprobs_on))
        .collect();
    Ok(Json(json!({
        "id": next_id("chatcmpl-"), "object": "chat.completion", "created": unix_now(),
        "model": state.model.id, "system_fingerprint": "muser",
        "choices": choices, "usage": usage(outs.iter().map(|o| &o.done)),
    }))
    .into_response())
}

pub async fn chat_completions(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(req): StrictJson<ChatCompletionRequest>,
) -> ApiResult<Response> {
    let n = gen::check_choices(req.n, 1)?;
    if n > 1 && !req.stream {
        return chat_choices(state, &log, req, n).await;
    }
    let (req, run) = start_chat(&state, &log, req).await?;
    let ChatRun {
        rx,
        mut reader,
        prompt,
        ..
    } = run;
    let logprobs_on = req.logprobs == Some(true);
    let id = next_id("chatcmpl-");
    let created = unix_now();
    let model = state.model.id.clone();

    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let mut tool_index = 0usize;
        let st = state.clone();
        let chunk = move |delta: Value, finish: Option<&str>, logprobs: Option<Value>| {
            let mut c = json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": "muser",
                "choices": [{ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish }],
            });
            if include_usage {
                c["usage"] = Value::Null;
            }
            c
        };
        let mut first = true;
        let body = gen::stream_body(rx, log.0.clone(), move |step| {
            let mut frames = Vec::new();
            let mut push = |v: Value| frames.push(format!("data: {v}\n\n"));
            if first {
                first = false;
                push(chunk(
                    json!({ "role": "assistant", "content": null }),
                    None,
                    None,
                ));
            }
            let deltas = |pieces: Vec<Piece>, tool_index: &mut usize| -> Vec<Value> {
                pieces
                    .into_iter()
                    .map(|p| match p {
                        Piece::Content(s) => json!({ "content": s }),
                        Piece::Reasoning(s) => json!({ "reasoning_content": s }),
                        Piece::ToolCall { name, arguments } => {
                            *tool_index += 1;
                            json!({ "tool_calls": [{
                                "index": *tool_index - 1, "id": next_id("call-"), "type": "function",
                                "function": { "name": name, "arguments": arguments },
                            }]})
                        }
                    })
                    .collect()
            };
            match step {
                Ok(Step::Token { text, logprobs, .. }) => {
                    let lp = logprobs
                        .filter(|_| logprobs_on)
                        .map(|lp| json!({ "content": [chat_logprob(&st, &lp)] }));
                    let ds = deltas(reader.push(&text), &mut tool_index);
                    if ds.is_empty() && lp.is_some() {
                        push(chunk(json!({ "content": "" }), None, lp));
                    } else {
                        let mut lp = lp;
                        for d in ds {
                            push(chunk(d, None, lp.take()));
                        }
                    }
                }
                Ok(Step::Embedding(_)) => {}
                Ok(Step::Progress(p)) => {
                    let mut c = chunk(json!({}), None, None);
                    c["choices"] = json!([]);
                    c["prompt_progress"] = super::prompt_progress(&p);
                    push(c);
                }
                Ok(Step::Done(done)) => {
                    for d in deltas(reader.finish(), &mut tool_index) {
                        push(chunk(d, None, None));
                    }
                    let reason = if tool_index > 0 {
                        "tool_calls"
                    } else {
                        done.openai_reason()
                    };
                    // the last chunk carries the timings, as llama-server's does
                    let mut last = chunk(json!({}), Some(reason), None);
                    if include_usage {
                        push(last);
                        last = chunk(json!({}), None, None);
                        last["choices"] = json!([]);
                        last["usage"] = usage([&done]);
                    }
                    last["timings"] = super::timings(&done);
                    push(last);
                    frames.push("data: [DONE]\n\n".to_string());
                }
                Err(e) => {
                    push(e.body());
                    frames.push("data: [DONE]\n\n".to_string());
                }
            }
            frames
        });
        return Ok(sse_response(body));
    }

    let out = gen::collect(rx, &log).await?;
    let choice = chat_choice(&state, reader, &out, 0, logprobs_on);
    let mut body = json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": "muser",
        "choices": [choice],
        "usage": usage([&out.done]),
        "timings": super::timings(&out.done),
    });
    if req.verbose {
        body["__verbose"] = json!({
            "prompt": prompt, "content": out.text,
            "tokens_evaluated": out.done.n_prompt, "tokens_predicted": out.done.n_gen,
        });
    }
    Ok(Json(body).into_response())
}

/// Tokens of a chat request's rendered prompt (what its generation would start from).
pub async fn count_chat_tokens(
    state: &SharedState,
    req: ChatCompletionRequest,
) -> ApiResult<usize> {
    state
        .cpu(move |st| {
            // images count their rows, from their sizes (not encoded)
            let images = chat::chat_images(st, &req.messages)?;
            let marker = st.vision.as_ref().map_or("", |v| v.chat_marker());
            st.count_with_images(&render_chat(st, &req)?, true, marker, images)
        })
        .await
}

/// llama-server's `/chat/completions/input_tokens`.
pub async fn chat_input_tokens(
    State(state): State<SharedState>,
    StrictJson(req): StrictJson<ChatCompletionRequest>,
) -> ApiResult<Json<Value>> {
    let n = count_chat_tokens(&state, req).await?;
    Ok(Json(
        json!({ "object": "response.input_tokens", "input_tokens": n }),
    ))
}

/// Renders a chat request's conversation (shared with /apply-template).
pub fn render_chat(state: &AppState, req: &ChatCompletionRequest) -> ApiResult<String> {
    limits::check_count("messages", req.messages.len(), limits::MESSAGES_MAX)?;
    if let [.., a, b] = req.messages.as_slice() {
        if a.role == Role::Assistant && b.role == Role::Assistant {
            return Err(ApiError::bad_request(
                "the conversation ends with two assistant messages: at most one continues",
            ));
        }
    }
    limits::check_count(
        "tools",
        req.tools.as_ref().map_or(0, Vec::len),
        limits::TOOLS_MAX,
    )?;
    let mut messages = req
        .messages
        .iter()
        .map(|m| chat::template_message(m, state.vision.as_ref().map(|v| v.chat_marker())))
        .collect::<ApiResult<Vec<_>>>()?;
    structured::add_tool_instructions(state, req, &mut messages)?;
    let tools = match (&req.tools, &req.tool_choice) {
        (Some(_), Some(ToolChoice::None)) | (None, _) => None,
        (Some(tools), _) => Some(chat::tools_value(tools)),
    };
    if let (Some(ToolChoice::Named(name)), Some(tools)) = (&req.tool_choice, &req.tools) {
        if !tools.iter().any(|t| &t.function.name == name) {
            return Err(ApiError::bad_request(format!(
                "tool_choice names `{name}`, which is not in tools"
            )));
        }
    }
    let mut extra = serde_json::Map::new();
    if let Some(effort) = &req.reasoning_effort {
        if !["low", "medium", "high"].contains(&effort.as_str()) {
            return Err(ApiError::bad_request(
                "reasoning_effort must be low, medium or high",
            ));
        }
        extra.insert("reasoning_effort".into(), json!(effort));
    }
    chat::render(state, messages, tools, true, extra)
}

pub async fn completions(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(mut req): StrictJson<CompletionRequest>,
) -> ApiResult<Response> {
    let prompts = std::mem::replace(&mut req.prompt, Prompts(Vec::new()));
    let n = gen::check_choices(req.n, prompts.0.len())?;
    if req.stream {
        gen::check_one_stream(n * prompts.0.len())?;
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::bad_request("best_of must be 1"));
    }
    if req.echo == Some(true) {
        return Err(ApiError::bad_request("echo is not supported"));
    }
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_request(
            "suffix (fill-in-the-middle) is not supported",
        ));
    }
    let max_tokens = check_max_tokens("max_tokens", req.max_tokens)?.or(Some(16));
    let grammar = req.grammar.take();
    let (prompts, constraint) = state
        .cpu(move |st| {
            let constraint = structured::plan_completion(st, None, grammar.as_deref())?;
            Ok((st.tokenize_prompts(&prompts)?, constraint))
        })
        .await?;
    let sampling = req.sampling();
    let n_probs = req.logprobs.unwrap_or(0) as usize;
    let opts = SamplingOptions {
        temperature: sampling.temperature,
        top_k: sampling.top_k,
        top_p: sampling.top_p,
        min_p: sampling.min_p,
        repeat_penalty: sampling.repeat_penalty,
        presence_penalty: sampling.presence_penalty,
        frequency_penalty: sampling.frequency_penalty,
        seed: sampling.seed,
        n_probs,
        logit_bias: gen::openai_logit_bias(&state, sampling.logit_bias.as_ref())?,
        ..Default::default()
    };
    let speculative = gen::speculative(req.speculative())?;
    let base = GenerateRequest {
        prompt: Vec::new(),
        params: SamplingParams {
            constraint,
            ..opts.to_params(&state.options.sampling)?
        },
        max_tokens,
        stop: req.stop.map(|s| s.0).unwrap_or_default(),
        slot: super::slot_from(req.id_slot, &state)?,
        cache_prompt: req.cache_prompt.unwrap_or(true),
        embeddings: false,
        special: false,
        prefilled: None,
        speculative,
        images: Vec::new(),
    };
    // choices in OpenAI's order: prompt 0's n choices, then prompt 1's...
    let mut reqs: Vec<GenerateRequest> = prompts
        .into_iter()
        .flat_map(|prompt| std::iter::repeat_n(prompt, n))
        .map(|prompt| GenerateRequest {
            prompt,
            ..base.clone()
        })
        .collect();
    let id = next_id("cmpl-");
    let created = unix_now();
    let model = state.model.id.clone();
    let logprobs_on = req.logprobs.is_some();
    let st = state.clone();
    let completion_logprobs = move |lps: &[TokenLogprobs]| -> Value {
        let tokens: Vec<String> = lps
            .iter()
            .map(|lp| piece_text(&st, lp.token.id).0)
            .collect();
        json!({
            "tokens": tokens,
            "token_logprobs": lps.iter().map(|lp| lp.token.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|lp| {
                lp.top.iter().map(|t| (piece_text(&st, t.id).0, json!(t.logprob))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
        })
    };
    if req.stream {
        let rx = gen::submit(&state, &log, reqs.remove(0)).await?;
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let body = gen::stream_body(rx, log.0.clone(), move |step| {
            let chunk = |text: &str, finish: Option<&str>, lp: Option<Value>| {
                let mut c = json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{ "index": 0, "text": text, "logprobs": lp, "finish_reason": finish }],
                });
                if include_usage {
                    c["usage"] = Value::Null;
                }
                format!("data: {c}\n\n")
            };
            match step {
                Ok(Step::Token { text, logprobs, .. }) => {
                    let lp = logprobs
                        .filter(|_| logprobs_on)
                        .map(|lp| completion_logprobs(&[lp]));
                    vec![chunk(&text, None, lp)]
                }
                Ok(Step::Embedding(_) | Step::Progress(_)) => Vec::new(),
                Ok(Step::Done(done)) => {
                    let mut frames = vec![chunk("", Some(done.openai_reason()), None)];
                    if include_usage {
                        let u = json!({
                            "id": id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": usage([&done]),
                        });
                        frames.push(format!("data: {u}\n\n"));
                    }
                    frames.push("data: [DONE]\n\n".to_string());
                    frames
                }
                Err(e) => vec![format!("data: {}\n\ndata: [DONE]\n\n", e.body())],
            }
        });
        return Ok(sse_response(body));
    }
    let outs = gen::generate_all(&state, &log, reqs).await?;
    let choices: Vec<Value> = outs
        .iter()
        .enumerate()
        .map(|(index, out)| {
            let lp = logprobs_on.then(|| completion_logprobs(&out.logprobs));
            json!({ "index": index, "text": out.text, "logprobs": lp, "finish_reason": out.done.openai_reason() })
        })
        .collect();
    let mut body = json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": choices, "usage": usage(outs.iter().map(|o| &o.done)),
    });
    if let [out] = outs.as_slice() {
        body["timings"] = super::timings(&out.done);
    }
    Ok(Json(body).into_response())
}

/// `--pooling none` gives a vector per token, which the OpenAI and rerank shapes cannot carry
/// (llama-server answers the same 400).
pub fn one_vector_per_input(state: &AppState) -> ApiResult<()> {
    match state.engine.config().pooling {
        Pooling::None => Err(ApiError::bad_request(
            "the server pools nothing (--pooling none): one vector per token is served by /embedding",
        )),
        _ => Ok(()),
    }
}

/// Embeds prompts as the server's pooling says (`--pooling`, [`Pooling`]); the vectors
/// (with `Pooling::None`, every row's, one after another) and the finished generations in
/// the prompts' order.
pub async fn embed(
    state: &AppState,
    log: &crate::reqlog::RequestLog,
    prompts: Vec<Vec<u32>>,
) -> ApiResult<Vec<(Vec<f32>, Finished)>> {
    let reqs = prompts
        .into_iter()
        .map(|prompt| GenerateRequest {
            prompt,
            params: Default::default(),
            max_tokens: Some(0),
            stop: Vec::new(),
            slot: None,
            cache_prompt: false,
            embeddings: true,
            special: false,
            prefilled: None,
            speculative: Default::default(),
            images: Vec::new(),
        })
        .collect();
    gen::generate_all(state, log, reqs)
        .await?
        .into_iter()
        .map(|out| {
            let v = out
                .embedding
                .ok_or_else(|| ApiError::internal("the engine returned no embedding"))?;
            Ok((v, out.done))
        })
        .collect()
}

pub async fn embeddings(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(req): StrictJson<EmbeddingRequest>,
) -> ApiResult<Response> {
    one_vector_per_input(&state)?;
    if let Some(d) = req.dimensions {
        if d as usize != state.model.n_embd {
            return Err(ApiError::bad_request(format!(
                "dimensions must be {} (truncation is not supported)",
                state.model.n_embd
            )));
        }
    }
    let format = req.encoding_format.unwrap_or(EncodingFormat::Float);
    let ids = state.cpu(move |st| st.tokenize_prompts(&req.input)).await?;
    let vectors = embed(&state, &log, ids).await?;
    let n_prompt: u32 = vectors.iter().map(|(_, d)| d.n_prompt).sum();
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, (v, _))| {
            let embedding = match format {
                EncodingFormat::Float => json!(v),
                EncodingFormat::Base64 => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(super::base64_encode(&bytes))
                }
            };
            json!({ "object": "embedding", "index": index, "embedding": embedding })
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": state.model.id,
        "usage": { "prompt_tokens": n_prompt, "total_tokens": n_prompt },
    }))
    .into_response())
}

pub async fn models(State(state): State<SharedState>) -> Json<Value> {
    let m = &state.model;
    Json(json!({
        "object": "list",
        "data": [{
            "id": m.id, "aliases": m.aliases, "tags": m.tags, "object": "model",
            "created": state.started_unix_s, "owned_by": "muser",
            "meta": {
                "arch": m.arch, "n_vocab": m.n_vocab, "n_ctx": state.options.n_ctx,
                "n_ctx_train": m.n_ctx_train, "n_embd": m.n_embd, "n_params": m.n_params,
                "size": m.size_bytes, "ftype": m.file_type,
            },
        }],
    }))
}
