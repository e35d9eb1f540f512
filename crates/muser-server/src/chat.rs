//! Chat specifics: turning OpenAI/Ollama messages into the template's input, rendering, and
//! splitting model output into reasoning, content and tool calls (Muse models, through
//! `muser_text::muse::MuseParser`; other models' output is plain content).

use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use crate::wire::openai::{ChatMessage, Content, ContentPart, Tool};
use serde_json::{json, Value};

/// The model's chat template.
///
/// Bridge until `muser_text::ChatTemplate` lands: renders the GGUF's Jinja template with
/// minijinja and the variables llama.cpp passes (messages, tools, add_generation_prompt,
/// bos_token, eos_token).
pub struct Template {
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
}

impl Template {
    pub fn from_gguf(
        gguf: &muser_gguf::GgufFile,
        tok: &muser_text::Tokenizer,
    ) -> Result<Option<Template>, String> {
        let Some(source) = gguf
            .get_opt_str("tokenizer.chat_template")
            .map_err(|e| e.to_string())?
        else {
            return Ok(None);
        };
        let mut env = minijinja::Environment::new();
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| e.to_string())?;
        let text = |id: Option<u32>| {
            id.map(|t| tok.token_text(t).to_string())
                .unwrap_or_default()
        };
        Ok(Some(Template {
            env,
            bos: text(tok.bos()),
            eos: text(tok.eos()),
        }))
    }

    fn render(
        &self,
        messages: Vec<Value>,
        tools: Option<Value>,
        add_generation_prompt: bool,
        extra: serde_json::Map<String, Value>,
    ) -> Result<String, String> {
        let mut ctx = extra;
        ctx.insert("messages".into(), Value::Array(messages));
        if let Some(t) = tools {
            ctx.insert("tools".into(), t);
        }
        ctx.insert("add_generation_prompt".into(), json!(add_generation_prompt));
        ctx.insert("bos_token".into(), json!(self.bos));
        ctx.insert("eos_token".into(), json!(self.eos));
        let tmpl = self.env.get_template("chat").map_err(|e| e.to_string())?;
        tmpl.render(minijinja::Value::from_serialize(&ctx))
            .map_err(|e| e.to_string())
    }
}

/// A message as the chat template sees it.
pub fn template_message(m: &ChatMessage) -> ApiResult<Value> {
    let content = match &m.content {
        None => Value::Null,
        Some(Content::Text(t)) => Value::String(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut texts = Vec::new();
            for part in parts {
                match part {
                    ContentPart::Text { text } => texts.push(text.as_str()),
                    ContentPart::ImageUrl { .. } => {
                        return Err(ApiError::bad_request(
                            "image_url parts need a vision encoder; the served model has none",
                        ))
                    }
                }
            }
            Value::String(texts.join("\n"))
        }
    };
    let mut msg = json!({ "role": m.role.as_str(), "content": content });
    if let Some(name) = &m.name {
        msg["name"] = json!(name);
    }
    if let Some(id) = &m.tool_call_id {
        msg["tool_call_id"] = json!(id);
    }
    if let Some(r) = &m.reasoning_content {
        msg["reasoning_content"] = json!(r);
    }
    if let Some(calls) = &m.tool_calls {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                // Templates index into the arguments, so hand them the parsed object.
                let args = serde_json::from_str::<Value>(&c.function.arguments)
                    .unwrap_or_else(|_| Value::String(c.function.arguments.clone()));
                json!({
                    "id": c.id, "type": "function",
                    "function": { "name": c.function.name, "arguments": args }
                })
            })
            .collect();
        msg["tool_calls"] = Value::Array(calls);
    }
    Ok(msg)
}

pub fn tools_value(tools: &[Tool]) -> Value {
    serde_json::to_value(tools).unwrap_or(Value::Null)
}

/// Renders the conversation with the model's template.
pub fn render(
    state: &AppState,
    messages: Vec<Value>,
    tools: Option<Value>,
    add_generation_prompt: bool,
    extra: serde_json::Map<String, Value>,
) -> ApiResult<String> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty"));
    }
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::bad_request("the served model has no chat template; use /v1/completions")
    })?;
    template
        .render(messages, tools, add_generation_prompt, extra)
        .map_err(|e| ApiError::bad_request(format!("chat template: {e}")))
}

/// A piece of assistant output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    ToolCall { name: String, arguments: String },
}

/// Incremental output splitter. Until `muser_text::muse::MuseParser` lands, every model's
/// output is plain content.
pub struct OutputParser;

impl OutputParser {
    pub fn new(_is_muse: bool) -> Self {
        OutputParser
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        if text.is_empty() {
            Vec::new()
        } else {
            vec![Piece::Content(text.to_string())]
        }
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        Vec::new()
    }
}

/// The whole output split at once.
#[derive(Debug, Default)]
pub struct Message {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<(String, String)>,
}

pub fn split_output(is_muse: bool, text: &str) -> Message {
    let mut parser = OutputParser::new(is_muse);
    let mut msg = Message::default();
    for p in parser.push(text).into_iter().chain(parser.finish()) {
        match p {
            Piece::Reasoning(s) => msg.reasoning.push_str(&s),
            Piece::Content(s) => msg.content.push_str(&s),
            Piece::ToolCall { name, arguments } => msg.tool_calls.push((name, arguments)),
        }
    }
    msg
}
