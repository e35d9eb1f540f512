//! The bridge between handlers and the engine: sampling options from any wire family, submit
//! with error mapping, collecting a whole generation, and streaming frames to a client.

use crate::error::{ApiError, ApiResult};
use crate::limits::{self, LOGIT_BIAS_ABS_MAX, LOGIT_BIAS_MAX, N_PROBS_MAX};
use crate::reqlog::RequestLog;
use crate::state::AppState;
use crate::wire::SpecFields;
use axum::body::Body;
use muser_engine::{
    Event, FinishReason, GenerateRequest, Progress, SamplingParams, SpecOverride, SubmitError,
    TokenLogprobs, DRAFT_MAX_LIMIT,
};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Sampling options as any wire family states them; `None` keeps llama.cpp's default.
#[derive(Debug, Default, Clone)]
pub struct SamplingOptions {
    pub temperature: Option<f32>,
    pub top_k: Option<i32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub n_probs: usize,
    pub logit_bias: Vec<(u32, f32)>,
}

impl SamplingOptions {
    /// Validates ranges; what the request leaves out comes from `defaults` (the server's:
    /// llama.cpp's, or `muser up --temp/--seed/...`).
    pub fn to_params(&self, defaults: &SamplingParams) -> ApiResult<SamplingParams> {
        let mut p = defaults.clone();
        let finite = |name: &str, v: Option<f32>, lo: f32, hi: f32| -> ApiResult<Option<f32>> {
            match v {
                Some(x) if !x.is_finite() || x < lo || x > hi => Err(ApiError::bad_request(
                    format!("{name} must be between {lo} and {hi}, got {x}"),
                )),
                other => Ok(other),
            }
        };
        if let Some(t) = finite("temperature", self.temperature, 0.0, 100.0)? {
            p.temperature = t;
        }
        if let Some(v) = finite("top_p", self.top_p, 0.0, 1.0)? {
            p.top_p = v;
        }
        if let Some(v) = finite("min_p", self.min_p, 0.0, 1.0)? {
            p.min_p = v;
        }
        if let Some(v) = finite("typical_p", self.typical_p, 0.0, 1.0)? {
            p.typical_p = v;
        }
        if let Some(v) = finite("repeat_penalty", self.repeat_penalty, 0.0, 100.0)? {
            p.repeat_penalty = v;
        }
        if let Some(v) = finite("presence_penalty", self.presence_penalty, -2.0, 2.0)? {
            p.presence_penalty = v;
        }
        if let Some(v) = finite("frequency_penalty", self.frequency_penalty, -2.0, 2.0)? {
            p.frequency_penalty = v;
        }
        if let Some(k) = self.top_k {
            if k < -1 {
                return Err(ApiError::bad_request(format!(
                    "top_k must be -1 or more, got {k}"
                )));
            }
            p.top_k = k;
        }
        if let Some(n) = self.repeat_last_n {
            if n < -1 {
                return Err(ApiError::bad_request(format!(
                    "repeat_last_n must be -1 or more, got {n}"
                )));
            }
            p.repeat_last_n = n;
        }
        if self.seed.is_some() {
            p.seed = crate::wire::seed_from(self.seed).map_err(ApiError::bad_request)?;
        }
        if self.n_probs > N_PROBS_MAX {
            return Err(ApiError::bad_request(format!(
                "at most {N_PROBS_MAX} log-probabilities per token, asked for {}",
                self.n_probs
            )));
        }
        p.n_probs = self.n_probs;
        p.logit_bias = self.logit_bias.clone();
        Ok(p)
    }
}

/// What a `logit_bias` entry names: a token id, or text whose every token is biased
/// (llama.cpp's string keys).
pub enum BiasKey {
    Token(u64),
    Text(String),
}

impl BiasKey {
    /// An object key: a token id when it is a number, else text.
    fn from_key(key: &str) -> BiasKey {
        key.parse()
            .map_or_else(|_| BiasKey::Text(key.to_string()), BiasKey::Token)
    }
}

/// A request's `logit_bias` from any wire family, as `(token id, bias)` entries where `None`
/// bans the token (llama.cpp's `false`): at most [`LOGIT_BIAS_MAX`] entries and as many
/// tokens, each token id in the vocabulary and named once (a token reached again through
/// text keeps its first bias), each bias a finite number within ±[`LOGIT_BIAS_ABS_MAX`].
pub fn logit_bias(
    state: &AppState,
    entries: impl ExactSizeIterator<Item = (BiasKey, Option<f64>)>,
) -> ApiResult<Vec<(u32, f32)>> {
    limits::check_count("logit_bias entries", entries.len(), LOGIT_BIAS_MAX)?;
    let mut out: Vec<(u32, f32)> = Vec::with_capacity(entries.len());
    for (key, bias) in entries {
        let bias = match bias {
            None => f32::NEG_INFINITY,
            Some(b) if b.is_finite() && b.abs() <= LOGIT_BIAS_ABS_MAX => b as f32,
            Some(b) => {
                let what = match &key {
                    BiasKey::Token(id) => format!("token {id}"),
                    BiasKey::Text(t) => format!("{t:?}"),
                };
                return Err(ApiError::bad_request(format!(
                    "logit_bias for {what} must be within [-{LOGIT_BIAS_ABS_MAX}, {LOGIT_BIAS_ABS_MAX}] (or false to ban it), got {b}"
                )));
            }
        };
        match key {
            BiasKey::Token(id) => {
                let id = state.check_token(id)?;
                if out.iter().any(|&(t, _)| t == id) {
                    return Err(ApiError::bad_request(format!(
                        "logit_bias names token {id} more than once"
                    )));
                }
                out.push((id, bias));
            }
            BiasKey::Text(text) => {
                let left = LOGIT_BIAS_MAX.saturating_sub(out.len());
                let ids = state
                    .tokenizer
                    .encode_at_most(&text, false, false, left)
                    .ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "logit_bias: more than {LOGIT_BIAS_MAX} tokens in all"
                        ))
                    })?;
                for id in ids {
                    if !out.iter().any(|&(t, _)| t == id) {
                        out.push((id, bias));
                    }
                }
            }
        }
    }
    Ok(out)
}

/// OpenAI `logit_bias`: token id (as a string; llama.cpp also takes text) → bias.
pub fn openai_logit_bias(
    state: &AppState,
    map: Option<&std::collections::BTreeMap<String, f64>>,
) -> ApiResult<Vec<(u32, f32)>> {
    let Some(map) = map else {
        return Ok(Vec::new());
    };
    logit_bias(
        state,
        map.iter().map(|(k, &v)| (BiasKey::from_key(k), Some(v))),
    )
}

/// llama.cpp `logit_bias`: `[[token id or text, bias or false], ...]`, or an object of token
/// id or text → bias or false.
pub fn llama_logit_bias(
    state: &AppState,
    value: Option<&serde_json::Value>,
) -> ApiResult<Vec<(u32, f32)>> {
    use serde_json::Value;
    let bias = |v: &Value| match v {
        Value::Bool(false) => Ok(None),
        Value::Number(n) => Ok(n.as_f64()),
        _ => Err(ApiError::bad_request(
            "logit_bias values must be numbers or false",
        )),
    };
    let entries = match value {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| Ok((BiasKey::from_key(k), bias(v)?)))
            .collect::<ApiResult<_>>()?,
        Some(Value::Array(pairs)) => pairs
            .iter()
            .map(|pair| match pair.as_array().map(Vec::as_slice) {
                Some([Value::Number(id), v]) => {
                    let id = id.as_u64().ok_or_else(|| {
                        ApiError::bad_request("logit_bias token ids are non-negative integers")
                    })?;
                    Ok((BiasKey::Token(id), bias(v)?))
                }
                Some([Value::String(text), v]) => Ok((BiasKey::Text(text.clone()), bias(v)?)),
                _ => Err(ApiError::bad_request(
                    "logit_bias entries are [token id or text, bias or false]",
                )),
            })
            .collect::<ApiResult<_>>()?,
        Some(_) => {
            return Err(ApiError::bad_request(
                "logit_bias is a list of [token, bias] pairs or an object",
            ))
        }
    };
    logit_bias(state, entries.into_iter())
}

/// How a generation ended, with its counts and timings.
#[derive(Debug, Clone)]
pub struct Finished {
    pub reason: FinishReason,
    pub n_prompt: u32,
    pub n_cached: u32,
    pub n_gen: u32,
    pub prompt_ms: f64,
    pub gen_ms: f64,
    /// The producer that prefilled the prompt (`None`: prefilled here).
    pub producer: Option<Arc<str>>,
    /// Speculative draft tokens verified and accepted.
    pub draft_n: usize,
    pub draft_n_accepted: usize,
}

impl Finished {
    /// OpenAI's finish_reason.
    pub fn openai_reason(&self) -> &'static str {
        match self.reason {
            FinishReason::Length => "length",
            _ => "stop",
        }
    }
}

/// One step of a generation as handlers see it.
pub enum Step {
    Token {
        id: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    Embedding(Vec<f32>),
    Done(Finished),
    /// The prompt's prefill progress (requests submitted with `progress`).
    Progress(Progress),
}

/// Submits a request, mapping engine refusals to HTTP errors (429 with Retry-After, 400).
/// A consumer of the prefill lane first gets the prompt's K/V from a producer when its lane
/// says so (see `lane`).
pub async fn submit(
    state: &AppState,
    log: &RequestLog,
    req: GenerateRequest,
) -> ApiResult<mpsc::UnboundedReceiver<Event>> {
    submit_with(state, log, req, false).await
}

/// [`submit`]; with `progress`, the stream also reports the prompt's prefill
/// ([`Step::Progress`], llama-server's `return_progress`).
pub async fn submit_with(
    state: &AppState,
    log: &RequestLog,
    mut req: GenerateRequest,
    progress: bool,
) -> ApiResult<mpsc::UnboundedReceiver<Event>> {
    state.check_prompt_len(req.prompt.len())?;
    limits::check_stop(&req.stop)?;
    if req.max_tokens.is_none() && !req.embeddings {
        req.max_tokens = state.options.n_predict;
    }
    if let Some(lane) = state
        .lane
        .get()
        .filter(|_| req.cache_prompt && !req.embeddings && req.images.is_empty())
    {
        req.prefilled = lane
            .prefill(&state.engine, &req.prompt)
            .await?
            .map(Arc::new);
        if req.prefilled.is_some() {
            log.set_remote();
        }
    }
    let submitted = match progress {
        true => state.engine.submit_reporting_progress(req),
        false => state.engine.submit(req),
    };
    submitted.map_err(|e| match e {
        SubmitError::QueueFull { retry_after_s } => {
            state.metrics.record_busy();
            ApiError::busy(retry_after_s)
        }
        SubmitError::PromptTooLong { n_prompt, n_ctx } => ApiError::exceed_context(n_prompt, n_ctx),
        SubmitError::Stopped => ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "engine_unavailable",
            "the engine has stopped",
        ),
        other => ApiError::bad_request(other.to_string()),
    })
}

/// A request's `speculative.*` fields as the engine's override: `speculative.type` `none`
/// turns speculation off, a drafter's name (`ngram-simple`, `ngram`, `lookup`) turns it on;
/// `n_max` (0 = off) and `n_min` size the drafts; `p_min` is checked (0..=1).
pub fn speculative(f: SpecFields) -> ApiResult<SpecOverride> {
    let count = |name: &str, v: Option<i64>| -> ApiResult<Option<usize>> {
        v.map(|n| {
            usize::try_from(n)
                .ok()
                .filter(|&n| n <= DRAFT_MAX_LIMIT)
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "speculative.{name} must be between 0 and {DRAFT_MAX_LIMIT}, got {n}"
                    ))
                })
        })
        .transpose()
    };
    if let Some(p) = f.p_min.filter(|p| !(0.0..=1.0).contains(p)) {
        return Err(ApiError::bad_request(format!(
            "speculative.p_min must be between 0 and 1, got {p}"
        )));
    }
    let mode = match f.kind {
        None => None,
        Some("none") => Some(None),
        Some(name) => Some(Some(name.parse().map_err(
            |e: muser_engine::SpecError| ApiError::bad_request(format!("speculative.type: {e}")),
        )?)),
    };
    Ok(SpecOverride {
        mode,
        draft_max: count("n_max", f.n_max)?,
        draft_min: count("n_min", f.n_min)?,
    })
}

/// Next step of a generation; records the finished generation in the request log.
pub async fn next_step(
    rx: &mut mpsc::UnboundedReceiver<Event>,
    log: &RequestLog,
) -> ApiResult<Step> {
    match rx.recv().await {
        Some(Event::Token { id, text, logprobs }) => {
            log.add_token();
            Ok(Step::Token { id, text, logprobs })
        }
        Some(Event::Embedding(v)) => Ok(Step::Embedding(v)),
        Some(Event::Progress(p)) => Ok(Step::Progress(p)),
        Some(Event::Done {
            reason,
            n_prompt,
            n_cached,
            n_gen,
            timings,
        }) => {
            let done = Finished {
                reason,
                n_prompt: n_prompt as u32,
                n_cached: n_cached as u32,
                n_gen: n_gen as u32,
                prompt_ms: timings.prompt_ms,
                gen_ms: timings.gen_ms,
                producer: timings.producer,
                draft_n: timings.draft_n,
                draft_n_accepted: timings.draft_n_accepted,
            };
            log.add_generation(&crate::metrics::GenerationTimes {
                prompt_tokens: u64::from(done.n_prompt - done.n_cached),
                context_tokens: u64::from(done.n_prompt + done.n_gen),
                generated_tokens: u64::from(done.n_gen),
                queue_ms: timings.queue_ms,
                prompt_ms: done.prompt_ms,
                gen_ms: done.gen_ms,
            });
            Ok(Step::Done(done))
        }
        Some(Event::Error(message)) => {
            Err(ApiError::internal(format!("generation failed: {message}")))
        }
        None => Err(ApiError::internal(
            "the engine stopped before finishing the request",
        )),
    }
}

/// A whole generation, gathered.
pub struct Output {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    pub embedding: Option<Vec<f32>>,
    pub done: Finished,
}

pub async fn collect(
    mut rx: mpsc::UnboundedReceiver<Event>,
    log: &RequestLog,
) -> ApiResult<Output> {
    let (mut text, mut tokens, mut logprobs, mut embedding) =
        (String::new(), Vec::new(), Vec::new(), None);
    loop {
        match next_step(&mut rx, log).await? {
            Step::Token {
                id,
                text: piece,
                logprobs: lp,
            } => {
                text.push_str(&piece);
                tokens.push(id);
                logprobs.extend(lp);
            }
            Step::Embedding(v) => embedding = Some(v),
            Step::Progress(_) => {}
            Step::Done(done) => {
                return Ok(Output {
                    text,
                    tokens,
                    logprobs,
                    embedding,
                    done,
                })
            }
        }
    }
}

/// Several generations of one request (several prompts, or `n` choices), each submitted and
/// gathered like a lone one, at most one per slot at a time so a long list never overflows the
/// engine's queue; the outputs come back in the requests' order.
pub async fn generate_all(
    state: &AppState,
    log: &RequestLog,
    reqs: Vec<GenerateRequest>,
) -> ApiResult<Vec<Output>> {
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(reqs)
        .map(|req| async move { collect(submit(state, log, req).await?, log).await })
        .buffered(state.options.n_slots.max(1))
        .try_collect()
        .await
}

/// `n` (choices per prompt): 1 to [`limits::CHOICES_MAX`]; with `prompts` prompts, at most
/// [`limits::PROMPTS_MAX`] generations in all.
pub fn check_choices(n: Option<u32>, prompts: usize) -> ApiResult<usize> {
    let n = n.unwrap_or(1) as usize;
    if !(1..=limits::CHOICES_MAX).contains(&n) {
        return Err(ApiError::bad_request(format!(
            "n must be between 1 and {}, got {n}",
            limits::CHOICES_MAX
        )));
    }
    limits::check_count(
        "generations (prompts times n)",
        n * prompts,
        limits::PROMPTS_MAX,
    )?;
    Ok(n)
}

/// Streaming sends one generation's frames: several prompts or choices are refused.
pub fn check_one_stream(generations: usize) -> ApiResult<()> {
    if generations > 1 {
        return Err(ApiError::bad_request(
            "stream: true takes one prompt and n = 1 (several prompts or choices are returned whole, without stream)",
        ));
    }
    Ok(())
}

/// Frames of a streamed response. The formatter turns each step (or an error) into zero or
/// more frames; the stream ends after `Done` or an error. A client that goes away closes the
/// channel (as does one that stops reading, which the listener drops after
/// [`limits::WRITE_STALL_TIMEOUT`]): the task ends and drops the engine receiver, which
/// cancels the generation.
pub fn stream_body<F>(
    mut rx: mpsc::UnboundedReceiver<Event>,
    log: Arc<RequestLog>,
    mut format: F,
) -> Body
where
    F: FnMut(Result<Step, ApiError>) -> Vec<String> + Send + 'static,
{
    let (tx, out) = mpsc::channel::<String>(64);
    tokio::spawn(async move {
        loop {
            let step = tokio::select! {
                step = next_step(&mut rx, &log) => step,
                () = tx.closed() => return,
            };
            let last = matches!(step, Ok(Step::Done(_)) | Err(_));
            for frame in format(step) {
                if tx.send(frame).await.is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    Body::from_stream(futures::stream::unfold(out, |mut out| async move {
        out.recv()
            .await
            .map(|frame| (Ok::<_, Infallible>(frame), out))
    }))
}

/// Tokens per second, 0 when no time was spent.
pub fn per_second(n: u32, ms: f64) -> f64 {
    if ms > 0.0 {
        f64::from(n) * 1e3 / ms
    } else {
        0.0
    }
}
