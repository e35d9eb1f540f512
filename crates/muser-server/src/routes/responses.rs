//! OpenAI Responses: `POST /v1/responses` and `/responses`, stateless. A request is
//! translated into the chat request it means (`instructions` as the system message, message
//! items, `function_call` items as tool calls, `function_call_output` items as tool
//! messages) and runs the chat route's path; the answer is output items (`reasoning`,
//! `message`, `function_call`). Streamed, the message's text arrives as
//! `response.output_text.delta` events; reasoning and function calls as whole items at the end.
//! `POST /v1/responses/input_tokens` counts the prompt tokens of the same translation.

use super::openai::{count_chat_tokens, start_chat, ChatRun};
use super::{next_id, sse_response, unix_now, Log};
use crate::chat::{Message, Piece};
use crate::error::{ApiError, ApiResult};
use crate::gen::{self, Finished, Step};
use crate::json::StrictJson;
use crate::state::SharedState;
use crate::wire::openai::ChatCompletionRequest;
use crate::wire::responses::{Input, Item, MessageContent, Part, ResponsesRequest};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use muser_engine::FinishReason;
use serde_json::{json, Value};

pub async fn responses(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(req): StrictJson<ResponsesRequest>,
) -> ApiResult<Response> {
    let stream = req.stream;
    let chat = to_chat(req)?;
    let (_, run) = start_chat(&state, &log, chat).await?;
    let ChatRun { rx, mut reader, .. } = run;
    let head = Head {
        id: next_id("resp_"),
        created_at: unix_now(),
        model: state.model.id.clone(),
    };
    if !stream {
        let out = gen::collect(rx, &log).await?;
        let msg = reader.message(&out.text);
        let message_id = next_id("msg_");
        return Ok(Json(head.response(&msg, &message_id, Some(&out.done))).into_response());
    }
    let message_id = next_id("msg_");
    let mut seq = 0u64;
    let mut first = true;
    let mut msg = Message::default();
    let body = gen::stream_body(rx, log.0.clone(), move |step| {
        let mut events = Vec::new();
        let mut emit = |mut v: Value| {
            v["sequence_number"] = json!(seq);
            seq += 1;
            events.push(format!(
                "event: {}\ndata: {v}\n\n",
                v["type"].as_str().unwrap_or("error")
            ));
        };
        let text_item = |status: &str, text: &str| {
            json!({ "type": "message", "id": message_id, "status": status, "role": "assistant",
                    "content": [output_text(text)] })
        };
        let at = json!({ "item_id": message_id, "output_index": 0, "content_index": 0 });
        let with = |mut v: Value| {
            for (k, x) in at.as_object().into_iter().flatten() {
                v[k] = x.clone();
            }
            v
        };
        if std::mem::take(&mut first) {
            let started = head.response(&msg, &message_id, None);
            emit(json!({ "type": "response.created", "response": started }));
            emit(json!({ "type": "response.in_progress", "response": started }));
            emit(
                json!({ "type": "response.output_item.added", "output_index": 0,
                         "item": { "type": "message", "id": message_id, "status": "in_progress",
                                   "role": "assistant", "content": [] } }),
            );
            emit(with(
                json!({ "type": "response.content_part.added", "part": output_text("") }),
            ));
        }
        let take = |pieces: Vec<Piece>, msg: &mut Message, emit: &mut dyn FnMut(Value)| {
            for p in pieces {
                match p {
                    Piece::Content(t) => {
                        emit(with(
                            json!({ "type": "response.output_text.delta", "delta": t, "logprobs": [] }),
                        ));
                        msg.content.push_str(&t);
                    }
                    Piece::Reasoning(t) => msg.reasoning.push_str(&t),
                    Piece::ToolCall { name, arguments } => msg.tool_calls.push((name, arguments)),
                }
            }
        };
        match step {
            Ok(Step::Token { text, .. }) => take(reader.push(&text), &mut msg, &mut emit),
            Ok(Step::Embedding(_) | Step::Progress(_)) => {}
            Ok(Step::Done(done)) => {
                take(reader.finish(), &mut msg, &mut emit);
                emit(with(
                    json!({ "type": "response.output_text.done", "text": msg.content, "logprobs": [] }),
                ));
                emit(with(
                    json!({ "type": "response.content_part.done", "part": output_text(&msg.content) }),
                ));
                emit(
                    json!({ "type": "response.output_item.done", "output_index": 0,
                             "item": text_item("completed", &msg.content) }),
                );
                let whole = head.response(&msg, &message_id, Some(&done));
                let items = whole["output"].as_array().cloned().unwrap_or_default();
                for (i, item) in items
                    .into_iter()
                    .filter(|it| it["id"] != json!(message_id))
                    .enumerate()
                {
                    emit(
                        json!({ "type": "response.output_item.added", "output_index": i + 1, "item": item }),
                    );
                    emit(
                        json!({ "type": "response.output_item.done", "output_index": i + 1, "item": item }),
                    );
                }
                let kind = if whole["status"] == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                emit(json!({ "type": kind, "response": whole }));
            }
            Err(e) => emit(json!({
                "type": "error", "code": e.kind, "message": e.message, "param": null,
            })),
        }
        events
    });
    Ok(sse_response(body))
}

/// What every snapshot of one response shares.
struct Head {
    id: String,
    created_at: u64,
    model: String,
}

impl Head {
    /// The response object: in progress (`done` is `None`) or finished with its output items.
    fn response(&self, msg: &Message, message_id: &str, done: Option<&Finished>) -> Value {
        let mut output = Vec::new();
        if done.is_some() {
            if !msg.reasoning.is_empty() {
                output.push(json!({
                    "type": "reasoning", "id": next_id("rs_"), "summary": [],
                    "content": [{ "type": "reasoning_text", "text": msg.reasoning }],
                }));
            }
            output.push(json!({
                "type": "message", "id": message_id, "status": "completed", "role": "assistant",
                "content": [output_text(&msg.content)],
            }));
            for (name, arguments) in &msg.tool_calls {
                output.push(json!({
                    "type": "function_call", "id": next_id("fc_"), "call_id": next_id("call_"),
                    "name": name, "arguments": arguments, "status": "completed",
                }));
            }
        }
        let (status, incomplete) = match done.map(|d| d.reason) {
            None => ("in_progress", Value::Null),
            Some(FinishReason::Length) => ("incomplete", json!({ "reason": "max_output_tokens" })),
            Some(_) => ("completed", Value::Null),
        };
        json!({
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "incomplete_details": incomplete, "error": null,
            "model": self.model, "output": output,
            "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
            "usage": done.map(|d| json!({
                "input_tokens": d.n_prompt,
                "input_tokens_details": { "cached_tokens": d.n_cached },
                "output_tokens": d.n_gen,
                "output_tokens_details": { "reasoning_tokens": 0 },
                "total_tokens": d.n_prompt + d.n_gen,
            })),
        })
    }
}

/// `POST /v1/responses/input_tokens` (and `/responses/input_tokens`): how many prompt
/// tokens the request would take, generating nothing (llama-server's shape).
pub async fn input_tokens(
    State(state): State<SharedState>,
    StrictJson(req): StrictJson<ResponsesRequest>,
) -> ApiResult<Json<Value>> {
    let n = count_chat_tokens(&state, to_chat(req)?).await?;
    Ok(Json(
        json!({ "object": "response.input_tokens", "input_tokens": n }),
    ))
}

fn output_text(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
}

/// The chat request a Responses request means.
fn to_chat(req: ResponsesRequest) -> ApiResult<ChatCompletionRequest> {
    let mut messages = Vec::new();
    if let Some(i) = req.instructions {
        messages.push(json!({ "role": "system", "content": i }));
    }
    match req.input {
        Input::Text(t) => messages.push(json!({ "role": "user", "content": t })),
        Input::Items(items) => {
            for item in items {
                messages.push(match item {
                    Item::Message(m) => {
                        let content = match m.content {
                            MessageContent::Text(t) => json!(t),
                            MessageContent::Parts(parts) => parts
                                .into_iter()
                                .map(|p| match p {
                                    Part::InputText { text } | Part::OutputText { text, .. } => {
                                        json!({ "type": "text", "text": text })
                                    }
                                    Part::InputImage { image_url, .. } => json!({
                                        "type": "image_url",
                                        "image_url": { "url": image_url.unwrap_or_default() },
                                    }),
                                })
                                .collect(),
                        };
                        json!({ "role": m.role, "content": content })
                    }
                    Item::FunctionCall(c) => json!({
                        "role": "assistant", "content": "",
                        "tool_calls": [{ "id": c.call_id, "type": "function",
                                         "function": { "name": c.name, "arguments": c.arguments } }],
                    }),
                    Item::FunctionCallOutput(o) => {
                        json!({ "role": "tool", "tool_call_id": o.call_id, "content": o.output })
                    }
                });
            }
        }
    }
    let mut chat = json!({ "messages": messages });
    let fields = [
        ("model", json!(req.model)),
        ("max_tokens", json!(req.max_output_tokens)),
        ("temperature", json!(req.temperature)),
        ("top_p", json!(req.top_p)),
        ("seed", json!(req.seed)),
        ("parallel_tool_calls", json!(req.parallel_tool_calls)),
        ("user", json!(req.user)),
        (
            "reasoning_effort",
            json!(req.reasoning.and_then(|r| r.effort)),
        ),
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
                    "name": t.name, "description": t.description,
                    "parameters": t.parameters.unwrap_or_else(|| json!({ "type": "object" })),
                }})
            })
            .collect();
    }
    if let Some(choice) = req.tool_choice {
        chat["tool_choice"] = match &choice {
            Value::Object(o) if o.get("type") == Some(&json!("function")) => {
                json!({ "type": "function", "function": { "name": o.get("name").cloned().unwrap_or_default() } })
            }
            _ => choice,
        };
    }
    serde_json::from_value(chat).map_err(|e| ApiError::bad_request(e.to_string()))
}
