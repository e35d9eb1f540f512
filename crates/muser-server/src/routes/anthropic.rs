//! Anthropic Messages: `POST /v1/messages` (whole or streamed as Anthropic's events) and
//! `POST /v1/messages/count_tokens`. A request is translated into the chat request it means
//! (system prompt, `tool_use` blocks as tool calls, `tool_result` blocks as tool messages,
//! `thinking` blocks as reasoning, base64 `image` blocks as `image_url` parts) and runs the
//! chat route's path; the answer is shaped as content blocks (`thinking`, `text`,
//! `tool_use`).

use super::openai::{start_chat, ChatRun};
use super::{next_id, sse_response, Log};
use crate::chat::Piece;
use crate::error::{ApiError, ApiResult};
use crate::gen::{self, Finished, Step};
use crate::json::StrictJson;
use crate::state::SharedState;
use crate::wire::anthropic::{
    Block, Content, ImageSource, MessagesRequest, Role, System, Thinking, ToolChoice,
    ToolResultContent,
};
use crate::wire::openai::ChatCompletionRequest;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use muser_engine::FinishReason;
use serde_json::{json, Value};

pub async fn messages(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(req): StrictJson<MessagesRequest>,
) -> ApiResult<Response> {
    let stream = req.stream;
    let chat = to_chat(req)?;
    let (_, run) = start_chat(&state, &log, chat).await?;
    let ChatRun {
        rx,
        mut reader,
        n_prompt,
        ..
    } = run;
    let id = next_id("msg_");
    let model = state.model.id.clone();
    if stream {
        let mut blocks = BlockStream::default();
        let mut first = true;
        let body = gen::stream_body(rx, log.0.clone(), move |step| {
            let mut events = Vec::new();
            if std::mem::take(&mut first) {
                events.push(event(json!({
                    "type": "message_start",
                    "message": {
                        "id": id, "type": "message", "role": "assistant", "model": model,
                        "content": [], "stop_reason": null, "stop_sequence": null,
                        "usage": { "input_tokens": n_prompt, "output_tokens": 0 },
                    },
                })));
            }
            match step {
                Ok(Step::Token { text, .. }) => {
                    for p in reader.push(&text) {
                        blocks.piece(p, &mut events);
                    }
                }
                Ok(Step::Embedding(_) | Step::Progress(_)) => {}
                Ok(Step::Done(done)) => {
                    for p in reader.finish() {
                        blocks.piece(p, &mut events);
                    }
                    if blocks.index == 0 && blocks.open.is_none() {
                        // an empty answer is still one (empty) text block
                        blocks.piece(Piece::Content(String::new()), &mut events);
                    }
                    let tool_use = blocks.tool_use;
                    blocks.close(&mut events);
                    events.push(event(json!({
                        "type": "message_delta",
                        "delta": { "stop_reason": stop_reason(&done, tool_use), "stop_sequence": null },
                        "usage": usage(&done),
                    })));
                    events.push(event(json!({ "type": "message_stop" })));
                }
                Err(e) => events.push(event(json!({
                    "type": "error",
                    "error": { "type": error_type(&e), "message": e.message },
                }))),
            }
            events
        });
        return Ok(sse_response(body));
    }
    let out = gen::collect(rx, &log).await?;
    let msg = reader.message(&out.text);
    let mut content = Vec::new();
    if !msg.reasoning.is_empty() {
        content.push(json!({ "type": "thinking", "thinking": msg.reasoning, "signature": "" }));
    }
    if !msg.content.is_empty() || msg.tool_calls.is_empty() {
        content.push(json!({ "type": "text", "text": msg.content }));
    }
    for (name, arguments) in &msg.tool_calls {
        content.push(json!({
            "type": "tool_use", "id": next_id("toolu_"), "name": name, "input": tool_input(arguments),
        }));
    }
    Ok(Json(json!({
        "id": id, "type": "message", "role": "assistant", "model": model,
        "content": content,
        "stop_reason": stop_reason(&out.done, !msg.tool_calls.is_empty()),
        "stop_sequence": null,
        "usage": usage(&out.done),
    }))
    .into_response())
}

pub async fn count_tokens(
    State(state): State<SharedState>,
    StrictJson(req): StrictJson<MessagesRequest>,
) -> ApiResult<Json<Value>> {
    let n = super::openai::count_chat_tokens(&state, to_chat(req)?).await?;
    Ok(Json(json!({ "input_tokens": n })))
}

/// The chat request an Anthropic request means.
fn to_chat(req: MessagesRequest) -> ApiResult<ChatCompletionRequest> {
    let mut messages = Vec::new();
    match req.system {
        Some(System::Text(t)) => messages.push(json!({ "role": "system", "content": t })),
        Some(System::Blocks(blocks)) => {
            let text: Vec<String> = blocks.into_iter().map(|b| b.text).collect();
            messages.push(json!({ "role": "system", "content": text.join("\n") }));
        }
        None => {}
    }
    for m in req.messages {
        let blocks = match m.content {
            Content::Text(t) => vec![Block::Text {
                text: t,
                cache_control: None,
            }],
            Content::Blocks(b) => b,
        };
        match m.role {
            Role::User => user_messages(blocks, &mut messages)?,
            Role::Assistant => messages.push(assistant_message(blocks)),
        }
    }
    // no turn at all is one empty user turn (llama-server answers it too)
    if messages.iter().all(|m| m["role"] == "system") {
        messages.push(json!({ "role": "user", "content": "" }));
    }
    let mut chat = json!({
        "messages": messages,
        "stream": false,
    });
    let fields = [
        ("model", json!(req.model)),
        ("max_tokens", json!(req.max_tokens)),
        ("stop", json!(req.stop_sequences.map(|s| s.0))),
        ("temperature", json!(req.temperature)),
        ("top_p", json!(req.top_p)),
        ("top_k", json!(req.top_k)),
    ];
    for (k, v) in fields {
        if !v.is_null() {
            chat[k] = v;
        }
    }
    if let Some(tools) = req.tools {
        chat["tools"] = tools
            .into_iter()
            .map(|t| {
                json!({ "type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": t.input_schema,
                }})
            })
            .collect();
    }
    if let Some(choice) = req.tool_choice {
        chat["tool_choice"] = match choice {
            ToolChoice::Auto { .. } => json!("auto"),
            ToolChoice::Any { .. } => json!("required"),
            ToolChoice::None => json!("none"),
            ToolChoice::Tool { name, .. } => {
                json!({ "type": "function", "function": { "name": name } })
            }
        };
    }
    if let Some(Thinking::Enabled { budget_tokens }) = req.thinking {
        if req.max_tokens.is_some_and(|m| budget_tokens >= m) {
            return Err(ApiError::bad_request(
                "thinking.budget_tokens must be less than max_tokens",
            ));
        }
    }
    serde_json::from_value(chat).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// A user turn: its text (and images) as one user message, each `tool_result` as a tool
/// message, in their order.
fn user_messages(blocks: Vec<Block>, out: &mut Vec<Value>) -> ApiResult<()> {
    let mut parts = Vec::new();
    let flush = |parts: &mut Vec<Value>, out: &mut Vec<Value>| {
        if !parts.is_empty() {
            out.push(json!({ "role": "user", "content": std::mem::take(parts) }));
        }
    };
    for b in blocks {
        match b {
            Block::ToolResult {
                tool_use_id,
                content,
                is_error,
                ..
            } => {
                flush(&mut parts, out);
                let mut blocks = match content {
                    None => Vec::new(),
                    Some(ToolResultContent::Text(t)) => vec![json!({ "type": "text", "text": t })],
                    Some(ToolResultContent::Blocks(blocks)) => blocks
                        .into_iter()
                        .filter_map(|b| part(b).transpose())
                        .collect::<ApiResult<_>>()?,
                };
                if is_error == Some(true) {
                    match blocks.first_mut() {
                        Some(b) if b["type"] == "text" => {
                            b["text"] =
                                json!(format!("Error: {}", b["text"].as_str().unwrap_or("")))
                        }
                        _ => blocks.insert(0, json!({ "type": "text", "text": "Error: " })),
                    }
                }
                // text alone is the tool message's text; with images its parts (the chat
                // route's images)
                let content = if blocks.iter().all(|b| b["type"] == "text") {
                    let texts: Vec<&str> =
                        blocks.iter().filter_map(|b| b["text"].as_str()).collect();
                    json!(texts.join("\n"))
                } else {
                    json!(blocks)
                };
                out.push(
                    json!({ "role": "tool", "tool_call_id": tool_use_id, "content": content }),
                );
            }
            b => parts.extend(part(b)?),
        }
    }
    flush(&mut parts, out);
    Ok(())
}

/// A user block as an OpenAI content part (`None`: nothing to say).
fn part(b: Block) -> ApiResult<Option<Value>> {
    Ok(match b {
        Block::Text { text, .. } => Some(json!({ "type": "text", "text": text })),
        Block::Image { source, .. } => Some(image_part(source)?),
        Block::Thinking { .. } | Block::RedactedThinking { .. } => None,
        Block::ToolUse { .. } | Block::ToolResult { .. } => {
            return Err(ApiError::bad_request(
                "tool_use blocks belong to assistant messages",
            ))
        }
    })
}

/// An image block as the chat route's `image_url` part (a `data:` URI), which the chat path
/// decodes and encodes like any other image; `url` sources are refused.
fn image_part(source: Value) -> ApiResult<Value> {
    let source: ImageSource = serde_json::from_value(source)
        .map_err(|e| ApiError::bad_request(format!("image source: {e}")))?;
    match source {
        ImageSource::Base64 { media_type, data } => {
            crate::vision::check_media_type(&media_type)?;
            let url = format!("data:{media_type};base64,{data}");
            Ok(json!({ "type": "image_url", "image_url": { "url": url } }))
        }
        ImageSource::Url { .. } => Err(ApiError::bad_request(
            "image url sources are not fetched; send the image as a base64 source",
        )),
    }
}

/// An assistant turn: text as content, `thinking` as reasoning, `tool_use` as tool calls.
fn assistant_message(blocks: Vec<Block>) -> Value {
    let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for b in blocks {
        match b {
            Block::Text { text: t, .. } => text.push_str(&t),
            Block::Thinking { thinking, .. } => reasoning.push_str(&thinking),
            Block::ToolUse {
                id, name, input, ..
            } => calls.push(json!({
                "id": id, "type": "function",
                "function": { "name": name, "arguments": input.to_string() },
            })),
            Block::RedactedThinking { .. } | Block::Image { .. } | Block::ToolResult { .. } => {}
        }
    }
    let mut m = json!({ "role": "assistant", "content": text });
    if !reasoning.is_empty() {
        m["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        m["tool_calls"] = json!(calls);
    }
    m
}

/// A tool call's arguments as the `input` object (text that is not JSON stays a string).
fn tool_input(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| json!(arguments))
}

fn stop_reason(done: &Finished, tool_use: bool) -> &'static str {
    match done.reason {
        _ if tool_use => "tool_use",
        FinishReason::Length => "max_tokens",
        FinishReason::Stop => "stop_sequence",
        FinishReason::Eog | FinishReason::Cancelled => "end_turn",
    }
}

fn usage(done: &Finished) -> Value {
    json!({
        "input_tokens": done.n_prompt,
        "output_tokens": done.n_gen,
        "cache_read_input_tokens": done.n_cached,
        "cache_creation_input_tokens": 0,
    })
}

fn error_type(e: &ApiError) -> &'static str {
    match e.status.as_u16() {
        400 => "invalid_request_error",
        429 => "rate_limit_error",
        _ => "api_error",
    }
}

fn event(v: Value) -> String {
    format!(
        "event: {}\ndata: {v}\n\n",
        v["type"].as_str().unwrap_or("error")
    )
}

/// The content blocks of a streamed answer: a block opens when a piece of another kind
/// arrives, and closes before the next one (a tool call is a block of its own).
#[derive(Default)]
struct BlockStream {
    /// The kind of the open block.
    open: Option<&'static str>,
    /// The index the next block gets.
    index: usize,
    tool_use: bool,
}

impl BlockStream {
    fn piece(&mut self, p: Piece, events: &mut Vec<String>) {
        let (kind, start, delta) = match p {
            Piece::Content(t) => (
                "text",
                json!({ "type": "text", "text": "" }),
                json!({ "type": "text_delta", "text": t }),
            ),
            Piece::Reasoning(t) => (
                "thinking",
                json!({ "type": "thinking", "thinking": "" }),
                json!({ "type": "thinking_delta", "thinking": t }),
            ),
            Piece::ToolCall { name, arguments } => {
                self.tool_use = true;
                self.close(events);
                (
                    "tool_use",
                    json!({ "type": "tool_use", "id": next_id("toolu_"), "name": name, "input": {} }),
                    json!({ "type": "input_json_delta", "partial_json": arguments }),
                )
            }
        };
        if self.open != Some(kind) {
            self.close(events);
            events.push(event(json!({
                "type": "content_block_start", "index": self.index, "content_block": start,
            })));
            self.open = Some(kind);
        }
        events.push(event(json!({
            "type": "content_block_delta", "index": self.index, "delta": delta,
        })));
    }

    fn close(&mut self, events: &mut Vec<String>) {
        let Some(kind) = self.open.take() else {
            return;
        };
        if kind == "thinking" {
            events.push(event(json!({
                "type": "content_block_delta", "index": self.index,
                "delta": { "type": "signature_delta", "signature": "" },
            })));
        }
        events.push(event(
            json!({ "type": "content_block_stop", "index": self.index }),
        ));
        self.index += 1;
    }
}
