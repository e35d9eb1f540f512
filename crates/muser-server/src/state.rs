//! What every handler shares: the engine, the tokenizer and template, facts about the model,
//! the server's configuration and its metrics.

use crate::error::{ApiError, ApiResult};
use crate::metrics::Metrics;
use crate::wire::{Prompt, PromptPiece, Prompts};
use muser_engine::Engine;
use muser_text::Tokenizer;
use std::path::PathBuf;
use std::sync::Arc;

/// Facts about the served model, read once at start-up.
#[derive(Debug, Clone)]
pub struct ModelMeta {
    /// The id the server reports: the first `--alias` in sorted order (llama-server keeps its
    /// aliases in a sorted set), else the file name without `.gguf`.
    pub id: String,
    /// The `--alias` names, sorted and unique (`id` among them), or `[id]` without any.
    pub aliases: Vec<String>,
    /// The file name without `.gguf`: the model answers to it too.
    pub file_id: String,
    /// Informational `--tags`, sorted and unique.
    pub tags: Vec<String>,
    pub path: PathBuf,
    pub arch: String,
    pub is_muse: bool,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_ctx_train: usize,
    pub n_params: u64,
    pub size_bytes: u64,
    pub file_type: String,
    pub chat_template: Option<String>,
}

/// Operator settings that handlers need.
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    pub api_key: Option<String>,
    /// Names a request's `Host` may carry when no API key is set (lower case, no port), so
    /// a page that rebinds its own domain to this address cannot use the server.
    pub allowed_hosts: Vec<String>,
    pub slot_save_path: Option<PathBuf>,
    pub slot_save_quota_bytes: u64,
    pub n_slots: usize,
    pub n_ctx: usize,
    /// Sampling settings of a request that states none (`--temp`, `--seed`, ...).
    pub sampling: muser_engine::SamplingParams,
    /// Most tokens a request that gives no limit generates (`-n/--n-predict`).
    pub n_predict: Option<u32>,
    /// The GBNF grammar of a request that asks for no structure (`--grammar`).
    pub grammar: Option<String>,
    /// `GET /slots` answers (else 501, llama-server's `--no-slots`).
    pub slots_endpoint: bool,
    /// `GET /metrics` answers (else 501, `--no-metrics`).
    pub metrics_endpoint: bool,
    /// `/rerank` answers (else 501; `--rerank`).
    pub rerank_endpoint: bool,
    /// Which browser origins may call the server (`--cors-*`).
    pub cors: crate::cors::Cors,
}

pub struct AppState {
    pub engine: Arc<Engine>,
    /// The prefill lane of a consumer (`--prefill` with `--producer`s, or enrolled nodes);
    /// set once, at start-up or when the first node joins a consumer that follows its
    /// registry.
    pub lane: std::sync::OnceLock<Arc<crate::lane::Lane>>,
    /// Identity and keys sealing slot files; present with `--slot-save-path`.
    pub kvpack: Option<Arc<muser_engine::KvPackContext>>,
    /// The image projector (`--mmproj`); `None`: images are refused.
    pub vision: Option<Arc<crate::vision::Vision>>,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<muser_text::ChatTemplate>,
    pub model: ModelMeta,
    pub options: ServerOptions,
    pub metrics: Arc<Metrics>,
    /// Session bundles (`/v1/sessions`); present with a session directory.
    pub sessions: Option<crate::routes::sessions::Sessions>,
    /// The node registry's routes (`/v1/nodes`); present on a consumer.
    pub nodes: Option<crate::routes::nodes::NodeAdmin>,
    /// Permits of requests in flight ([`crate::limits::IN_FLIGHT_MAX`]).
    pub in_flight: Arc<tokio::sync::Semaphore>,
    /// Unix seconds at start-up (the `created` of /v1/models).
    pub started_unix_s: u64,
}

pub type SharedState = Arc<AppState>;

/// Bytes of prompt text per token of the context up to which an over-long prompt is still
/// tokenized whole, to report its exact count (`exceed_context_size_error`); a longer text is
/// refused without that work.
const COUNT_BYTES_PER_TOKEN: usize = 16;

/// The least text an over-long prompt is still counted whole up to, however small the
/// context (`-c` is shared among the slots, so a slot's context may be a few hundred tokens):
/// a few milliseconds of tokenizing.
const COUNT_BYTES_MIN: usize = 64 << 10;

impl AppState {
    /// Ollama's routes: accepts an absent model name or one of the served model's names (also
    /// with an Ollama `:tag`). The OpenAI and llama.cpp routes answer to any name, as
    /// llama-server does with one model loaded.
    pub fn check_model(&self, name: Option<&str>) -> ApiResult<()> {
        let known = |n: &str| n == self.model.file_id || self.model.aliases.iter().any(|a| a == n);
        match name {
            None => Ok(()),
            Some(n) if n.is_empty() || known(n) || n.split(':').next().is_some_and(known) => Ok(()),
            Some(n) => Err(ApiError::not_found(
                "model_not_found",
                format!(
                    "model `{n}` is not served here; this server serves `{}`",
                    self.model.id
                ),
            )),
        }
    }

    /// Runs request work that needs the state on the bounded CPU pool ([`crate::limits::cpu`]).
    pub async fn cpu<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&AppState) -> ApiResult<T> + Send + 'static,
    ) -> ApiResult<T> {
        let st = self.clone();
        crate::limits::cpu(move || f(&st)).await?
    }

    /// The most tokens a prompt may have: one less than the context per slot.
    pub fn prompt_tokens_max(&self) -> usize {
        self.options.n_ctx.saturating_sub(1)
    }

    /// Tokenizes a prompt, refusing it as soon as it is known to exceed `max_tokens`. Text is
    /// tokenized with special-token parsing; the first text piece gets the model's BOS when
    /// `add_special`. Token ids are checked against the vocabulary.
    pub fn tokenize_prompt(
        &self,
        prompt: &Prompt,
        add_special: bool,
        parse_special: bool,
        max_tokens: usize,
    ) -> ApiResult<Vec<u32>> {
        let mut ids = Vec::new();
        for (i, piece) in prompt.0.iter().enumerate() {
            let left = max_tokens.saturating_sub(ids.len());
            match piece {
                PromptPiece::Text(text) => {
                    let more = self
                        .tokenizer
                        .encode_at_most(text, add_special && i == 0, parse_special, left)
                        .ok_or_else(|| self.too_many_tokens(max_tokens))?;
                    ids.extend(more);
                }
                PromptPiece::Multimodal { .. } => {
                    return Err(ApiError::bad_request(
                        "a prompt with multimodal_data is taken by /completion only",
                    ))
                }
                PromptPiece::Token(_) if left == 0 => return Err(self.too_many_tokens(max_tokens)),
                PromptPiece::Token(id) => ids.push(self.check_token(*id)?),
            }
        }
        Ok(ids)
    }

    /// Tokenizes each of several prompts like [`Self::tokenize_prompt`], BOS added and special
    /// tokens parsed, each within the context.
    pub fn tokenize_prompts(&self, prompts: &Prompts) -> ApiResult<Vec<Vec<u32>>> {
        let max = self.prompt_tokens_max();
        prompts
            .0
            .iter()
            .map(|p| self.tokenize_prompt(p, true, true, max))
            .collect()
    }

    /// Tokenizes a rendered prompt (BOS added, special tokens parsed) within the context.
    /// A prompt over it is counted whole for the error only up to [`COUNT_BYTES_PER_TOKEN`]
    /// bytes per token of the context (at least [`COUNT_BYTES_MIN`]).
    pub fn encode_prompt(&self, text: &str, add_special: bool) -> ApiResult<Vec<u32>> {
        let max = self.prompt_tokens_max();
        self.tokenizer
            .encode_at_most(text, add_special, true, max)
            .ok_or_else(|| {
                // the whole count for the error when counting is bounded work (a text of a
                // few bytes per token of the context); past that, refused without tokenizing
                // it all, with the bound it passed
                if text.len() <= (COUNT_BYTES_PER_TOKEN * self.options.n_ctx).max(COUNT_BYTES_MIN) {
                    let n = self.tokenizer.encode(text, add_special, true).len();
                    ApiError::exceed_context(n, self.options.n_ctx)
                } else {
                    self.too_many_tokens(max)
                }
            })
    }

    fn too_many_tokens(&self, max_tokens: usize) -> ApiError {
        if max_tokens == self.prompt_tokens_max() {
            ApiError::bad_request(format!(
                "the prompt is too large: more than {max_tokens} tokens; the context per slot is {} tokens (start the server with a larger -c)",
                self.options.n_ctx
            ))
        } else {
            ApiError::bad_request(format!("the text has more than {max_tokens} tokens"))
        }
    }

    pub fn check_token(&self, id: u64) -> ApiResult<u32> {
        let n_vocab = self.tokenizer.n_vocab();
        u32::try_from(id)
            .ok()
            .filter(|&t| (t as usize) < n_vocab)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "token id {id} is outside the vocabulary (size {n_vocab})"
                ))
            })
    }

    /// A prompt must be non-empty and leave room for at least one generated token.
    pub fn check_prompt_len(&self, n_prompt: usize) -> ApiResult<()> {
        if n_prompt == 0 {
            return Err(ApiError::bad_request("the prompt is empty"));
        }
        if n_prompt >= self.options.n_ctx {
            return Err(ApiError::exceed_context(n_prompt, self.options.n_ctx));
        }
        Ok(())
    }
}
