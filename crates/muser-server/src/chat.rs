//! Chat specifics: turning OpenAI/Ollama messages into the template's input, rendering, and
//! splitting model output into reasoning, content and tool calls (Muse models, through
//! `muser_text::muse::MuseParser`; other models' output is plain content).

use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use crate::vision::WireImage;
use crate::wire::openai::{ChatMessage, Content, ContentPart, Tool};
use muser_text::muse::{MuseParser, ParseEvent};
use muser_text::ChatRequest;
use serde_json::{json, Value};

/// A message as the chat template sees it. Parts are joined as llama.cpp joins them: text
/// parts with a newline between them, an image part as `image_marker` with no newline before
/// or after it; without a marker (no projector) an image part is refused.
pub fn template_message(m: &ChatMessage, image_marker: Option<&str>) -> ApiResult<Value> {
    let content = match &m.content {
        None => Value::Null,
        Some(Content::Text(t)) => Value::String(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            let mut after_image = false;
            for part in parts {
                match part {
                    ContentPart::Text { text: t } => {
                        if !after_image && !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(t);
                        after_image = false;
                    }
                    ContentPart::ImageUrl { .. } => {
                        let marker = image_marker.ok_or_else(|| {
                            ApiError::bad_request(
                                "image_url parts need a projector; start the server with --mmproj FILE",
                            )
                        })?;
                        text.push_str(marker);
                        after_image = true;
                    }
                }
            }
            Value::String(text)
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

/// The images of a chat request's messages, in order, as given on the wire; their count is
/// checked against `--max-images` before any is decoded.
pub fn chat_images(state: &AppState, messages: &[ChatMessage]) -> ApiResult<Vec<WireImage>> {
    let urls: Vec<&str> = messages
        .iter()
        .filter_map(|m| match &m.content {
            Some(Content::Parts(parts)) => Some(parts),
            _ => None,
        })
        .flatten()
        .filter_map(|p| match p {
            ContentPart::ImageUrl { image_url } => Some(image_url.url.as_str()),
            ContentPart::Text { .. } => None,
        })
        .collect();
    if state.vision.is_none() {
        // an image the request cannot carry is its own fault (400) before the server's
        // missing projector (500); with a projector the count is checked before any decoding
        for url in &urls {
            WireImage::from_url(url)?;
        }
    }
    state.check_image_count(urls.len())?;
    urls.into_iter().map(WireImage::from_url).collect()
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
    let request = ChatRequest {
        messages,
        tools,
        add_generation_prompt,
        extra,
        now_unix_s: None,
    };
    template
        .render(&request)
        .map_err(|e| ApiError::bad_request(format!("chat template: {e}")))
}

/// A piece of assistant output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    ToolCall { name: String, arguments: String },
}

/// Incremental output splitter: the Muse parser for Muse models (reasoning, content, tool
/// calls checked against the offered tools' schemas); other models' output is plain content.
pub enum OutputParser {
    Plain,
    Muse(Box<MuseParser>),
}

impl OutputParser {
    pub fn new(is_muse: bool, tools: Option<&Value>) -> Self {
        if is_muse {
            OutputParser::Muse(Box::new(MuseParser::new(tools)))
        } else {
            OutputParser::Plain
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        match self {
            OutputParser::Plain if text.is_empty() => Vec::new(),
            OutputParser::Plain => vec![Piece::Content(text.to_string())],
            OutputParser::Muse(p) => p.push(text).into_iter().map(piece).collect(),
        }
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        match self {
            OutputParser::Plain => Vec::new(),
            OutputParser::Muse(p) => p.finish().into_iter().map(piece).collect(),
        }
    }
}

fn piece(e: ParseEvent) -> Piece {
    match e {
        ParseEvent::Reasoning(s) => Piece::Reasoning(s),
        ParseEvent::Content(s) => Piece::Content(s),
        ParseEvent::ToolCall {
            name,
            arguments_json,
        } => Piece::ToolCall {
            name,
            arguments: arguments_json,
        },
    }
}

/// The whole output split at once.
#[derive(Debug, Default)]
pub struct Message {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<(String, String)>,
}

pub fn split_output(is_muse: bool, tools: Option<&Value>, text: &str) -> Message {
    ChatReader::new(is_muse, tools, false).message(text)
}

/// Reads a chat generation's text as reasoning, content and tool calls, as it streams
/// (`push`, then `finish`) or whole (`message`). A forced generic tool call (`{"name",
/// "arguments"}` JSON under a grammar) is held and read whole at the end.
pub struct ChatReader {
    parser: OutputParser,
    generic_tool_call: bool,
    held: String,
}

impl ChatReader {
    pub fn new(is_muse: bool, tools: Option<&Value>, generic_tool_call: bool) -> Self {
        ChatReader {
            parser: OutputParser::new(is_muse, tools),
            generic_tool_call,
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        if self.generic_tool_call {
            self.held.push_str(text);
            return Vec::new();
        }
        self.parser.push(text)
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        if !self.generic_tool_call {
            return self.parser.finish();
        }
        // the call if the text is one (it is unless the generation was cut short)
        let text = std::mem::take(&mut self.held);
        match crate::structured::parse_generic_tool_call(&text) {
            Some((name, arguments)) => vec![Piece::ToolCall { name, arguments }],
            None => vec![Piece::Content(text)],
        }
    }

    pub fn message(mut self, text: &str) -> Message {
        let mut msg = Message::default();
        for p in self.push(text).into_iter().chain(self.finish()) {
            match p {
                Piece::Reasoning(s) => msg.reasoning.push_str(&s),
                Piece::Content(s) => msg.content.push_str(&s),
                Piece::ToolCall { name, arguments } => msg.tool_calls.push((name, arguments)),
            }
        }
        msg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn muse_output_is_split_and_plain_output_is_content() {
        let turn = " to=self<|message|>Thinking it over.<|eom|><|start|>assistant to=user<|message|>Hello!<|eot|>";
        let m = split_output(true, None, turn);
        assert_eq!(m.reasoning, "Thinking it over.");
        assert_eq!(m.content, "Hello!");
        let m = split_output(false, None, turn);
        assert_eq!(m.content, turn);
        assert!(m.reasoning.is_empty());
        // Streaming in pieces gives the same split.
        let mut p = OutputParser::new(true, None);
        let mut pieces: Vec<Piece> = turn
            .as_bytes()
            .chunks(7)
            .flat_map(|c| p.push(&String::from_utf8_lossy(c)))
            .collect();
        pieces.extend(p.finish());
        let reasoning: String = pieces
            .iter()
            .filter_map(|x| {
                if let Piece::Reasoning(s) = x {
                    Some(s.as_str())
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(reasoning, "Thinking it over.");
    }
}
