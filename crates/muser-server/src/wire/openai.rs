//! OpenAI request types: chat completions, completions, embeddings.

use super::{Prompts, StopList};
use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;

/// Sampling fields shared by chat and completions (OpenAI names plus llama.cpp extensions,
/// the speculative ones included). `serde(flatten)` cannot be combined with
/// `deny_unknown_fields`, so a macro adds the fields.
#[derive(Debug, Default, Clone)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub logit_bias: Option<BTreeMap<String, f64>>,
}

macro_rules! with_sampling {
    ($(#[$m:meta])* pub struct $name:ident { $($body:tt)* }) => {
        $(#[$m])*
        pub struct $name {
            $($body)*
            #[serde(default)]
            pub temperature: Option<f32>,
            #[serde(default)]
            pub top_p: Option<f32>,
            #[serde(default)]
            pub top_k: Option<i32>,
            #[serde(default)]
            pub min_p: Option<f32>,
            #[serde(default)]
            pub presence_penalty: Option<f32>,
            #[serde(default)]
            pub frequency_penalty: Option<f32>,
            #[serde(default)]
            pub repeat_penalty: Option<f32>,
            #[serde(default)]
            pub seed: Option<i64>,
            #[serde(default)]
            pub logit_bias: Option<BTreeMap<String, f64>>,
            #[serde(default, rename = "speculative.type")]
            pub speculative_type: Option<String>,
            #[serde(default, rename = "speculative.n_max")]
            pub speculative_n_max: Option<i64>,
            #[serde(default, rename = "speculative.n_min")]
            pub speculative_n_min: Option<i64>,
            #[serde(default, rename = "speculative.p_min")]
            pub speculative_p_min: Option<f32>,
        }
        impl $name {
            pub fn speculative(&self) -> super::SpecFields<'_> {
                super::SpecFields {
                    kind: self.speculative_type.as_deref(),
                    n_max: self.speculative_n_max,
                    n_min: self.speculative_n_min,
                    p_min: self.speculative_p_min,
                }
            }
            pub fn sampling(&self) -> Sampling {
                Sampling {
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    min_p: self.min_p,
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    repeat_penalty: self.repeat_penalty,
                    seed: self.seed,
                    logit_bias: self.logit_bias.clone(),
                }
            }
        }
    };
}

with_sampling! {
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub stop: Option<StopList>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub cache_prompt: Option<bool>,
    #[serde(default)]
    pub id_slot: Option<i64>,
    /// llama.cpp: timings on the stream's chunks (the final one carries them here).
    #[serde(default)]
    pub timings_per_token: bool,
    /// llama.cpp: streamed, `prompt_progress` chunks while the prompt is prefilled.
    #[serde(default)]
    pub return_progress: Option<bool>,
    /// llama.cpp: a whole answer carries `__verbose` (the rendered prompt, the generated
    /// text and the token counts).
    #[serde(default)]
    pub verbose: bool,
    /// llama.cpp: a GBNF grammar the reply's content follows (`structured::plan_chat`).
    #[serde(default)]
    pub grammar: Option<String>,
    /// llama.cpp: a JSON schema the reply's content follows, as `response_format` states it.
    #[serde(default)]
    pub json_schema: Option<serde_json::Value>,
}
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: Role,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCall>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub reasoning_content: Option<String>,
}

/// Message content: a string, or a list of typed parts.
#[derive(Debug)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(s) => Ok(Content::Text(s)),
            v @ serde_json::Value::Array(_) => serde_json::from_value(v)
                .map(Content::Parts)
                .map_err(|e| D::Error::custom(format!("content part: {e}"))),
            _ => Err(D::Error::custom("content is a string or a list of parts")),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ContentPart {
    Text { text: String },
    ImageUrl { image_url: ImageUrl },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageUrl {
    pub url: String,
    #[serde(default)]
    pub detail: Option<String>,
}

#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    pub function: FunctionCall,
}

#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: ToolKind,
    pub function: FunctionDef,
}

#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolKind {
    Function,
}

#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionDef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice`: "none" | "auto" | "required" | {"type":"function","function":{"name":...}}.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Named {
            #[serde(rename = "type")]
            _kind: ToolKind,
            function: NamedFn,
        }
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct NamedFn {
            name: String,
        }
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(s) => match s.as_str() {
                "none" => Ok(ToolChoice::None),
                "auto" => Ok(ToolChoice::Auto),
                "required" => Ok(ToolChoice::Required),
                other => Err(D::Error::custom(format!(
                    "unknown tool_choice `{other}`: expected none, auto, required or a named function"
                ))),
            },
            v => serde_json::from_value::<Named>(v)
                .map(|n| ToolChoice::Named(n.function.name))
                .map_err(|e| D::Error::custom(format!("tool_choice: {e}"))),
        }
    }
}

/// `response_format`: plain text, any JSON object, or JSON following a schema (all enforced
/// by constrained sampling; see `crate::structured`).
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    Text,
    /// llama.cpp also reads a `schema` here.
    JsonObject {
        #[serde(default)]
        schema: Option<serde_json::Value>,
    },
    JsonSchema {
        json_schema: JsonSchemaFormat,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    /// `None`: any JSON object.
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
    #[serde(default)]
    pub strict: Option<bool>,
}

with_sampling! {
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Prompts,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub stop: Option<StopList>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub best_of: Option<u32>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub suffix: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub cache_prompt: Option<bool>,
    #[serde(default)]
    pub id_slot: Option<i64>,
    /// llama.cpp: a GBNF grammar the completion follows (`structured::plan_completion`).
    #[serde(default)]
    pub grammar: Option<String>,
}
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub input: Prompts,
    #[serde(default)]
    pub encoding_format: Option<EncodingFormat>,
    #[serde(default)]
    pub dimensions: Option<u32>,
    #[serde(default)]
    pub user: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EncodingFormat {
    Float,
    Base64,
}
