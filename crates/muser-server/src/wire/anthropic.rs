//! Anthropic Messages request types (`POST /v1/messages`, `/v1/messages/count_tokens`).
//! Unknown fields are refused like everywhere else; `cache_control` marks are accepted and
//! have no effect (the prompt cache is automatic).

use super::StopList;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessagesRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// Required by Anthropic's API; optional here as in llama-server (count_tokens has none).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub system: Option<System>,
    #[serde(default)]
    pub stop_sequences: Option<StopList>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i32>,
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
    /// Extended thinking: reasoning is reported as `thinking` blocks for models that reason
    /// (Muse models); the budget is not enforced separately from `max_tokens`.
    #[serde(default)]
    pub thinking: Option<Thinking>,
    #[serde(default)]
    pub metadata: Option<Metadata>,
    #[serde(default)]
    pub service_tier: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum System {
    Text(String),
    Blocks(Vec<TextBlock>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextBlock {
    #[serde(rename = "type")]
    pub kind: TextType,
    pub text: String,
    #[serde(default)]
    pub cache_control: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextType {
    Text,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: Role,
    pub content: Content,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Block {
    Text {
        text: String,
        #[serde(default)]
        cache_control: Option<Value>,
    },
    Image {
        /// An [`ImageSource`], read by the route so that a bad one gets its own message.
        source: Value,
        #[serde(default)]
        cache_control: Option<Value>,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
        #[serde(default)]
        cache_control: Option<Value>,
    },
    ToolResult {
        tool_use_id: String,
        #[serde(default)]
        content: Option<ToolResultContent>,
        #[serde(default)]
        is_error: Option<bool>,
        #[serde(default)]
        cache_control: Option<Value>,
    },
    Thinking {
        thinking: String,
        #[serde(default)]
        signature: Option<String>,
    },
    RedactedThinking {
        data: String,
    },
}

/// Where an image block's bytes are: inline base64 of a `media_type`, or a URL (refused: the
/// server fetches nothing).
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ImageSource {
    Base64 { media_type: String, data: String },
    Url { url: String },
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolResultContent {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    pub input_schema: Value,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub cache_control: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum ToolChoice {
    Auto {
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    Any {
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    Tool {
        name: String,
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    None,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum Thinking {
    Enabled { budget_tokens: u32 },
    Disabled,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    #[serde(default)]
    pub user_id: Option<String>,
}
