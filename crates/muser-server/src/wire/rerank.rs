//! Rerank requests (`/rerank`, `/v1/rerank`): llama-server's shape (`documents`, answered
//! as `results`) and Hugging Face TEI's (`texts`, answered as a bare list).

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RerankRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub query: String,
    #[serde(default)]
    pub documents: Option<Vec<String>>,
    /// TEI's name for the documents; the answer then takes TEI's shape.
    #[serde(default)]
    pub texts: Option<Vec<String>>,
    #[serde(default)]
    pub top_n: Option<usize>,
    #[serde(default)]
    pub return_text: bool,
    /// TEI's name for `return_text`.
    #[serde(default)]
    pub raw_scores: Option<bool>,
}
