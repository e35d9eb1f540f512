//! llama.cpp server request types (its field names).

use super::{Prompt, Prompts, StopList};
use serde::Deserialize;

/// One extra file of an /infill request.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InfillChunk {
    pub text: String,
    /// `tmp` when absent.
    #[serde(default)]
    pub filename: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    /// Required on /completion; on /infill an optional text continuing the prefix.
    #[serde(default)]
    pub prompt: Option<Prompts>,
    /// /infill: the code before the cursor.
    #[serde(default)]
    pub input_prefix: Option<String>,
    /// /infill: the code after the cursor.
    #[serde(default)]
    pub input_suffix: Option<String>,
    /// /infill: other files of the project, before the prefix.
    #[serde(default)]
    pub input_extra: Option<Vec<InfillChunk>>,
    /// -1: until the end of the context.
    #[serde(default)]
    pub n_predict: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub typical_p: Option<f32>,
    #[serde(default)]
    pub repeat_penalty: Option<f32>,
    #[serde(default)]
    pub repeat_last_n: Option<i32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<StopList>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub cache_prompt: Option<bool>,
    #[serde(default)]
    pub id_slot: Option<i64>,
    #[serde(default)]
    pub n_probs: Option<u32>,
    #[serde(default)]
    pub return_tokens: bool,
    #[serde(default)]
    pub ignore_eos: bool,
    /// Pairs `[token id or text, bias]`, or an object of token id or text → bias; a bias of
    /// `false` bans the token (see `gen::llama_logit_bias`).
    #[serde(default)]
    pub logit_bias: Option<serde_json::Value>,
    /// Timings on the stream's chunks (the final one carries them here).
    #[serde(default)]
    pub timings_per_token: bool,
    /// Streamed: `prompt_progress` chunks while the prompt is prefilled.
    #[serde(default)]
    pub return_progress: Option<bool>,
    /// `n_probs` reports probabilities after the sampler chain (`prob`, `top_probs`) instead
    /// of the model's log-probabilities.
    #[serde(default)]
    pub post_sampling_probs: bool,
    /// llama-server's sampling on the accelerator: accepted, changes nothing (Muser samples on
    /// the CPU, with the same probabilities).
    #[serde(default)]
    pub backend_sampling: bool,
    /// A GBNF grammar the completion follows (`structured::plan_completion`).
    #[serde(default)]
    pub grammar: Option<String>,
    /// The completion is one JSON value of this schema (the subset `response_format`
    /// supports; `{}`: any value).
    #[serde(default)]
    pub json_schema: Option<serde_json::Value>,
    #[serde(default, rename = "speculative.type")]
    pub speculative_type: Option<String>,
    #[serde(default, rename = "speculative.n_max")]
    pub speculative_n_max: Option<i64>,
    #[serde(default, rename = "speculative.n_min")]
    pub speculative_n_min: Option<i64>,
    #[serde(default, rename = "speculative.p_min")]
    pub speculative_p_min: Option<f32>,
}

impl CompletionRequest {
    pub fn speculative(&self) -> super::SpecFields<'_> {
        super::SpecFields {
            kind: self.speculative_type.as_deref(),
            n_max: self.speculative_n_max,
            n_min: self.speculative_n_min,
            p_min: self.speculative_p_min,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub content: Prompt,
    #[serde(default)]
    pub add_special: bool,
    #[serde(default = "yes")]
    pub parse_special: bool,
    #[serde(default)]
    pub with_pieces: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingRequest {
    /// llama.cpp's name; `input` (OpenAI's) is taken too.
    #[serde(default)]
    pub content: Option<Prompts>,
    #[serde(default)]
    pub input: Option<Prompts>,
}

impl EmbeddingRequest {
    pub fn prompts(self) -> Result<Prompts, &'static str> {
        match (self.content, self.input) {
            (Some(p), None) | (None, Some(p)) => Ok(p),
            _ => Err("give `content` or `input`, one of them"),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotActionRequest {
    pub filename: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotQuery {
    pub action: SlotAction,
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SlotAction {
    Save,
    Restore,
    Erase,
}

/// A slot file name: 1..=255 of `[A-Za-z0-9._-]`, not `.` or `..`, so it can never leave the
/// slot directory.
pub fn valid_slot_filename(name: &str) -> bool {
    (1..=255).contains(&name.len())
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_filenames() {
        assert!(valid_slot_filename("slot0.bin"));
        assert!(valid_slot_filename("a-b_c.d"));
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            "a\\b",
            "x\0",
            "é",
            &"a".repeat(256),
        ] {
            assert!(!valid_slot_filename(bad), "{bad:?}");
        }
    }
}
