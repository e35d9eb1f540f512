//! llama.cpp-server-shaped routes: /completion, /tokenize, /detokenize, /apply-template,
//! /embedding, /props, /slots, /slots/{id}, /health, /metrics.

use super::{sse_response, timings, Log};
use crate::error::{ApiError, ApiResult};
use crate::gen::{self, Finished, SamplingOptions, Step};
use crate::json::{OptionalJson, StrictJson};
use crate::limits::{check_count, TOKENIZE_TOKENS_MAX};
use crate::state::{AppState, SharedState};
use crate::structured;
use crate::vision::{WireImage, MEDIA_MARKER};
use crate::wire::llama::{
    valid_slot_filename, CompletionRequest, DetokenizeRequest, EmbeddingRequest, InfillChunk,
    SlotAction, SlotActionRequest, SlotQuery, TokenizeRequest,
};
use crate::wire::openai::ChatCompletionRequest;
use crate::wire::PromptPiece;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use muser_engine::{
    FinishReason, GenerateRequest, PromptImage, SamplingParams, TokenLogprobs, TokenProb,
};
use serde_json::{json, Value};

fn stop_type(done: &Finished) -> &'static str {
    match done.reason {
        FinishReason::Eog => "eos",
        FinishReason::Stop => "word",
        FinishReason::Length => "limit",
        FinishReason::Cancelled => "none",
    }
}

/// `completion_probabilities` entries (llama.cpp's current shape): `logprob`/`top_logprobs`,
/// or after the sampler chain (`post_sampling_probs`) `prob`/`top_probs`.
fn probs(state: &AppState, lps: &[TokenLogprobs]) -> Value {
    let entry = |t: &TokenProb, post: bool| {
        let bytes = state.tokenizer.token_to_piece(t.id, true).to_vec();
        let mut e = json!({ "id": t.id, "token": String::from_utf8_lossy(&bytes), "bytes": bytes });
        if post {
            e["prob"] = json!(t.prob);
        } else {
            e["logprob"] = json!(t.logprob);
        }
        e
    };
    lps.iter()
        .map(|lp| {
            let post = lp.post_sampling;
            let mut e = entry(&lp.token, post);
            let top: Vec<Value> = lp.top.iter().map(|t| entry(t, post)).collect();
            e[if post { "top_probs" } else { "top_logprobs" }] = json!(top);
            e
        })
        .collect()
}

/// Sampling settings as llama-server reports them (`generation_settings`, and `/props`'s
/// defaults): a banned token's bias is `null`.
pub fn settings(p: &SamplingParams, n_predict: Option<u32>) -> Value {
    let bias: Vec<Value> = p
        .logit_bias
        .iter()
        .map(|&(token, b)| json!({ "token": token, "bias": if b.is_finite() { json!(b) } else { Value::Null } }))
        .collect();
    json!({
        "n_predict": n_predict.map_or(-1, i64::from), "seed": p.seed.map_or(-1, |s| s as i64),
        "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
        "typical_p": p.typical_p, "repeat_penalty": p.repeat_penalty, "repeat_last_n": p.repeat_last_n,
        "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
        "n_probs": p.n_probs, "min_keep": p.min_keep, "post_sampling_probs": p.post_sampling_probs,
        "logit_bias": bias,
    })
}

pub async fn completion(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(mut req): StrictJson<CompletionRequest>,
) -> ApiResult<Response> {
    if req.input_prefix.is_some() || req.input_suffix.is_some() || req.input_extra.is_some() {
        return Err(ApiError::bad_request(
            "input_prefix, input_suffix and input_extra belong to /infill",
        ));
    }
    let prompts = req
        .prompt
        .take()
        .ok_or_else(|| ApiError::bad_request("prompt is required"))?;
    let n_prompts = prompts.0.len();
    complete(state, log, req, n_prompts, move |st| {
        let n_images = prompts.0.iter().map(|p| match p.0.as_slice() {
            [PromptPiece::Multimodal { images, .. }] => images.len(),
            _ => 0,
        });
        st.check_image_count(n_images.sum())?;
        let max = st.prompt_tokens_max();
        prompts
            .0
            .iter()
            .map(|prompt| match prompt.0.as_slice() {
                [PromptPiece::Multimodal { text, images }] => {
                    let images = images
                        .iter()
                        .map(|b| WireImage::from_base64(b))
                        .collect::<ApiResult<_>>()?;
                    st.encode_with_images(text, true, MEDIA_MARKER, images)
                }
                _ => Ok((st.tokenize_prompt(prompt, true, true, max)?, Vec::new())),
            })
            .collect()
    })
    .await
}

/// llama-server's `/infill`: the code before and after the cursor (`input_prefix`,
/// `input_suffix`) between the model's fill-in-the-middle tokens, after the extra files
/// (`input_extra`), with `prompt` continuing the prefix (see [`infill_prompt`]); answered as
/// `/completion` answers. A model without those tokens is a 501.
pub async fn infill(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(mut req): StrictJson<CompletionRequest>,
) -> ApiResult<Response> {
    let fim = state.tokenizer.fim();
    let (Some(_), Some(_), Some(_)) = (fim.pre, fim.suf, fim.mid) else {
        return Err(ApiError::new(
            axum::http::StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "infill is not supported by this model: it has no fill-in-the-middle prefix, suffix and middle tokens",
        ));
    };
    let (Some(prefix), Some(suffix)) = (req.input_prefix.take(), req.input_suffix.take()) else {
        return Err(ApiError::bad_request(
            "input_prefix and input_suffix are required",
        ));
    };
    let prompt = match req.prompt.take().map(|p| p.0) {
        None => String::new(),
        Some(mut p) => match p.pop().map(|p| p.0).as_deref() {
            Some([PromptPiece::Text(t)]) if p.is_empty() => t.clone(),
            _ => return Err(ApiError::bad_request("prompt must be a string")),
        },
    };
    let extra = req.input_extra.take().unwrap_or_default();
    check_count("input_extra", extra.len(), crate::limits::PROMPTS_MAX)?;
    let n_predict = req.n_predict.unwrap_or(-1);
    complete(state, log, req, 1, move |st| {
        let budget = InfillBudget {
            n_batch: st.engine.config().prefill_chunk,
            n_ctx: st.options.n_ctx,
            n_predict,
        };
        let parts = InfillParts {
            prefix: &prefix,
            suffix: &suffix,
            prompt: &prompt,
            extra: &extra,
        };
        Ok(vec![(
            infill_prompt(&st.tokenizer, &parts, &budget),
            Vec::new(),
        )])
    })
    .await
}

/// What an infill prompt is made of.
pub struct InfillParts<'a> {
    pub prefix: &'a str,
    pub suffix: &'a str,
    pub prompt: &'a str,
    pub extra: &'a [InfillChunk],
}

/// The sizes an infill prompt is cut to.
pub struct InfillBudget {
    pub n_batch: usize,
    pub n_ctx: usize,
    /// -1: no limit.
    pub n_predict: i64,
}

/// llama-server's infill prompt (`format_prompt_infill`, repo-level FIM): `[REP]myproject\n`
/// and per extra file `[SEP]filename\n` and its text (without a separator token, a plain-text
/// snippet marker), then `[SEP]filename\n`; BOS where the model adds it; `[PRE]` the last
/// 3/4 of a batch of the prefix, the prompt; `[SUF]` the start of the suffix (what is left of
/// a quarter batch); `[MID]`. The extra files are cut from the front to what the context
/// leaves besides a batch and twice `n_predict`. Needs the tokenizer's prefix, suffix and
/// middle tokens.
pub fn infill_prompt(
    tok: &muser_text::Tokenizer,
    parts: &InfillParts,
    budget: &InfillBudget,
) -> Vec<u32> {
    let fim = tok.fim();
    let text = |s: &str| tok.encode(s, false, false);
    let mut extra = Vec::new();
    if let Some(rep) = fim.rep {
        extra.push(rep);
        extra.extend(text("myproject\n"));
    }
    for chunk in parts.extra {
        let filename = chunk.filename.as_deref().unwrap_or("tmp");
        match fim.sep {
            Some(sep) => {
                extra.push(sep);
                extra.extend(text(&format!("{filename}\n")));
            }
            None => extra.extend(text("\n\n--- snippet ---\n\n")),
        }
        extra.extend(text(&chunk.text));
    }
    if let Some(sep) = fim.sep {
        extra.push(sep);
        extra.extend(text("filename\n"));
    }
    let prefix = text(parts.prefix);
    let suffix = text(parts.suffix);
    let prompt = tok.encode(parts.prompt, false, true);
    let n_batch = budget.n_batch as i64;
    let n_prefix = prefix.len().min((3 * (n_batch / 4)) as usize);
    let n_suffix = suffix
        .len()
        .min((n_batch / 4 - (2 + prompt.len() as i64)).max(0) as usize);
    let n_extra =
        ((budget.n_ctx as i64 - n_batch - 2 * budget.n_predict).max(0) as usize).min(extra.len());
    let mut out = extra[extra.len() - n_extra..].to_vec();
    out.extend(tok.bos().filter(|_| tok.add_bos()));
    out.extend(fim.pre);
    out.extend_from_slice(&prefix[prefix.len() - n_prefix..]);
    out.extend(prompt);
    out.extend(fim.suf);
    out.extend_from_slice(&suffix[..n_suffix]);
    out.extend(fim.mid);
    out
}

/// `/completion` and `/infill` once their prompts are tokenized (`prompts`, on the work
/// pool): sampling, structure, one generation per prompt, llama-server's answer.
async fn complete(
    state: SharedState,
    log: super::LogHandle,
    mut req: CompletionRequest,
    n_prompts: usize,
    prompts: impl FnOnce(&AppState) -> ApiResult<Vec<(Vec<u32>, Vec<PromptImage>)>> + Send + 'static,
) -> ApiResult<Response> {
    let (schema, grammar) = (req.json_schema.take(), req.grammar.take());
    gen::check_choices(None, n_prompts)?;
    if req.stream {
        gen::check_one_stream(n_prompts)?;
    }
    let (prompts, constraint) = state
        .cpu(move |st| {
            let constraint = structured::plan_completion(st, schema.as_ref(), grammar.as_deref())?;
            Ok((prompts(st)?, constraint))
        })
        .await?;
    let max_tokens = match req.n_predict {
        None | Some(-1) => None,
        Some(n) if n >= 0 => Some(u32::try_from(n).unwrap_or(u32::MAX)),
        Some(n) => {
            return Err(ApiError::bad_request(format!(
                "n_predict must be -1 or more, got {n}"
            )))
        }
    };
    let mut logit_bias = gen::llama_logit_bias(&state, req.logit_bias.as_ref())?;
    if req.ignore_eos {
        // end-of-generation tokens are banned whatever the request biased them by
        logit_bias.retain(|&(t, _)| !state.tokenizer.is_eog(t));
        logit_bias.extend(state.tokenizer.eog_ids().map(|t| (t, f32::NEG_INFINITY)));
    }
    let opts = SamplingOptions {
        temperature: req.temperature,
        top_k: req.top_k,
        top_p: req.top_p,
        min_p: req.min_p,
        typical_p: req.typical_p,
        repeat_penalty: req.repeat_penalty,
        repeat_last_n: req.repeat_last_n,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        seed: req.seed,
        n_probs: req.n_probs.unwrap_or(0) as usize,
        logit_bias,
    };
    let n_probs = opts.n_probs;
    let slot = super::slot_from(req.id_slot, &state)?;
    let speculative = gen::speculative(req.speculative())?;
    let base = GenerateRequest {
        prompt: Vec::new(),
        params: SamplingParams {
            constraint,
            post_sampling_probs: req.post_sampling_probs,
            ..opts.to_params(&state.options.sampling)?
        },
        max_tokens,
        stop: req.stop.map(|s| s.0).unwrap_or_default(),
        slot,
        cache_prompt: req.cache_prompt.unwrap_or(true),
        embeddings: false,
        special: false,
        prefilled: None,
        speculative,
        images: Vec::new(),
    };
    let mut reqs: Vec<GenerateRequest> = prompts
        .into_iter()
        .map(|(prompt, images)| GenerateRequest {
            prompt,
            images,
            ..base.clone()
        })
        .collect();
    let model = state.model.id.clone();
    let id_slot = slot.map_or(-1, |s| s as i64);
    let return_tokens = req.return_tokens;
    let generation_settings = settings(&base.params, max_tokens.or(state.options.n_predict));
    let final_fields = move |content: &str, tokens: &[u32], done: &Finished| {
        json!({
            "generation_settings": generation_settings,
            "content": content, "tokens": if return_tokens { json!(tokens) } else { json!([]) },
            "id_slot": id_slot, "stop": true, "model": model,
            "tokens_predicted": done.n_gen, "tokens_evaluated": done.n_prompt,
            "tokens_cached": done.n_cached, "truncated": false,
            "stop_type": stop_type(done), "stopping_word": "",
            "timings": timings(done),
        })
    };
    if req.stream {
        let progress = req.return_progress == Some(true);
        let rx = gen::submit_with(&state, &log, reqs.remove(0), progress).await?;
        let st = state.clone();
        let body = gen::stream_body(rx, log.0.clone(), move |step| match step {
            Ok(Step::Token { id, text, logprobs }) => {
                let mut v = json!({ "content": text, "stop": false, "id_slot": id_slot,
                                    "tokens": if return_tokens { json!([id]) } else { json!([]) } });
                if n_probs > 0 {
                    v["completion_probabilities"] = probs(&st, logprobs.as_slice());
                }
                vec![format!("data: {v}\n\n")]
            }
            Ok(Step::Embedding(_)) => Vec::new(),
            Ok(Step::Progress(p)) => {
                let v = json!({ "content": "", "stop": false, "id_slot": id_slot, "tokens": [],
                                "prompt_progress": super::prompt_progress(&p) });
                vec![format!("data: {v}\n\n")]
            }
            Ok(Step::Done(done)) => vec![format!("data: {}\n\n", final_fields("", &[], &done))],
            Err(e) => vec![format!("data: {}\n\n", e.body())],
        });
        return Ok(sse_response(body));
    }
    let outs = gen::generate_all(&state, &log, reqs).await?;
    let mut results: Vec<Value> = outs
        .iter()
        .enumerate()
        .map(|(index, out)| {
            let mut v = final_fields(&out.text, &out.tokens, &out.done);
            if n_probs > 0 {
                v["completion_probabilities"] = probs(&state, &out.logprobs);
            }
            if n_prompts > 1 {
                v["index"] = json!(index);
            }
            v
        })
        .collect();
    if n_prompts == 1 {
        return Ok(Json(results.remove(0)).into_response());
    }
    Ok(Json(Value::Array(results)).into_response())
}

pub async fn tokenize(
    State(state): State<SharedState>,
    StrictJson(req): StrictJson<TokenizeRequest>,
) -> ApiResult<Json<Value>> {
    let (add, parse, with_pieces) = (req.add_special, req.parse_special, req.with_pieces);
    let ids = state
        .cpu(move |st| st.tokenize_prompt(&req.content, add, parse, TOKENIZE_TOKENS_MAX))
        .await?;
    if !with_pieces {
        return Ok(Json(json!({ "tokens": ids })));
    }
    let tokens: Vec<Value> = ids
        .iter()
        .map(|&id| {
            let bytes = state.tokenizer.token_to_piece(id, true);
            let piece = match std::str::from_utf8(bytes) {
                Ok(s) => json!(s),
                Err(_) => json!(bytes),
            };
            json!({ "id": id, "piece": piece })
        })
        .collect();
    Ok(Json(json!({ "tokens": tokens })))
}

pub async fn detokenize(
    State(state): State<SharedState>,
    StrictJson(req): StrictJson<DetokenizeRequest>,
) -> ApiResult<Json<Value>> {
    check_count("tokens", req.tokens.len(), TOKENIZE_TOKENS_MAX)?;
    let ids = req
        .tokens
        .iter()
        .map(|&t| state.check_token(t))
        .collect::<ApiResult<Vec<_>>>()?;
    Ok(Json(
        json!({ "content": state.tokenizer.decode(&ids, true) }),
    ))
}

pub async fn apply_template(
    State(state): State<SharedState>,
    StrictJson(req): StrictJson<ChatCompletionRequest>,
) -> ApiResult<Json<Value>> {
    let prompt = state
        .cpu(move |st| super::openai::render_chat(st, &req))
        .await?;
    Ok(Json(json!({ "prompt": prompt })))
}

/// llama.cpp's `/embedding(s)`: one entry per prompt, each `[vector]` (the pooled vector).
pub async fn embedding(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(req): StrictJson<EmbeddingRequest>,
) -> ApiResult<Json<Value>> {
    let prompts = req.prompts().map_err(ApiError::bad_request)?;
    let ids = state.cpu(move |st| st.tokenize_prompts(&prompts)).await?;
    let vectors = super::openai::embed(&state, &log, ids).await?;
    // a pooled vector is one row; `--pooling none` gives every token's
    let n_embd = state.model.n_embd.max(1);
    Ok(Json(
        vectors
            .into_iter()
            .enumerate()
            .map(|(index, (v, _))| {
                let rows: Vec<&[f32]> = v.chunks(n_embd).collect();
                json!({ "index": index, "embedding": rows })
            })
            .collect(),
    ))
}

/// The settings of a request that gives none (`muser up`'s sampling flags).
fn default_settings(state: &AppState) -> Value {
    json!({
        "n_ctx": state.options.n_ctx,
        "params": settings(&state.options.sampling, state.options.n_predict),
    })
}

pub async fn props(State(state): State<SharedState>) -> Json<Value> {
    let piece = |id: Option<u32>| {
        id.map(|t| state.tokenizer.token_text(t).to_string())
            .unwrap_or_default()
    };
    Json(json!({
        "default_generation_settings": default_settings(&state),
        "total_slots": state.options.n_slots,
        "is_sleeping": state.engine.is_sleeping(),
        "model_path": state.model.path.display().to_string(),
        "model_alias": state.model.id,
        "chat_template": state.model.chat_template.clone().unwrap_or_default(),
        "bos_token": piece(state.tokenizer.bos()),
        "eos_token": piece(state.tokenizer.eos()),
        "modalities": { "vision": false, "audio": false },
        "build_info": concat!("muser ", env!("CARGO_PKG_VERSION")),
        "prompt_cache": prompt_cache_props(&state),
        "speculative": speculative_props(&state),
        "prefill_lane": state.lane.get().map_or_else(
            || json!({ "mode": "local", "engine_abi": engine_abi(&state) }),
            |l| l.props()
        ),
    }))
}

/// The server's speculative decoding (`--spec`, `--draft-max`; null without), its counters
/// since start, the acceptance (null before any draft) and what a verification row costs
/// now (a fraction of a decode step; it sizes the drafts).
fn speculative_props(state: &AppState) -> Value {
    let st = state.engine.stats();
    let cfg = state
        .engine
        .config()
        .spec
        .map(|c| json!({ "type": c.mode.name(), "n_max": c.draft_max, "n_min": c.draft_min }));
    json!({
        "default": cfg,
        "verifications_total": st.draft_verifications_total,
        "draft_n_total": st.draft_tokens_total,
        "draft_n_accepted_total": st.draft_accepted_total,
        "acceptance": st.draft_acceptance(),
        "row_cost": st.draft_row_cost,
    })
}

/// The engine ABI this server's caches carry (when it seals packs).
fn engine_abi(state: &AppState) -> Option<String> {
    state.kvpack.as_ref().map(|k| k.identity.engine_abi.clone())
}

/// The prompt cache's counters (`--prompt-cache`), or null without one.
fn prompt_cache_props(state: &AppState) -> Value {
    let Some(pc) = &state.engine.config().prompt_cache else {
        return Value::Null;
    };
    let s = pc.stats();
    json!({
        "hits_memory": s.hits_memory, "hits_disk": s.hits_disk,
        "tokens_resumed": s.tokens_resumed, "rejected": s.rejected,
        "quarantined_at_open": s.quarantined_at_open, "published": s.published,
        "offers_dropped": s.offers_dropped, "publish_failed": s.publish_failed,
        "memory_bytes": s.memory_bytes, "disk_bytes": s.disk_bytes, "disk_packs": s.disk_packs,
    })
}

pub async fn slots(State(state): State<SharedState>) -> ApiResult<Json<Value>> {
    if !state.options.slots_endpoint {
        return Err(ApiError::not_implemented(
            "This server does not support slots endpoint (started with --no-slots).",
        ));
    }
    let settings = default_settings(&state);
    let slots: Vec<Value> = state
        .engine
        .slots()
        .iter()
        .map(|s| {
            let mut slot = json!({
                "id": s.id, "n_ctx": state.options.n_ctx, "is_processing": s.busy,
                "n_cached": s.n_cached, "n_prompt": s.n_prompt, "n_decoded": s.n_gen,
            });
            // as llama-server: the settings of a slot that has served a request
            if s.busy || s.n_cached > 0 {
                slot["params"] = settings["params"].clone();
            }
            slot
        })
        .collect();
    Ok(Json(Value::Array(slots)))
}

pub async fn slot_action(
    State(state): State<SharedState>,
    Path(id): Path<String>,
    Query(query): Query<SlotQuery>,
    OptionalJson(req): OptionalJson<SlotActionRequest>,
) -> ApiResult<Json<Value>> {
    let id: usize = id
        .parse()
        .ok()
        .filter(|&i: &usize| i < state.options.n_slots)
        .ok_or_else(|| {
            ApiError::bad_request(format!("slot id must be in 0..{}", state.options.n_slots))
        })?;
    if query.action == SlotAction::Erase {
        let st = state.clone();
        tokio::task::spawn_blocking(move || st.engine.erase_slot(id))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| {
                ApiError::new(axum::http::StatusCode::CONFLICT, "conflict", e.to_string())
            })?;
        return Ok(Json(json!({ "id_slot": id, "erased": true })));
    }
    if state.options.slot_save_path.is_none() {
        return Err(ApiError::bad_request(
            "slot save/restore is off: start the server with --slot-save-path DIR",
        ));
    }
    let filename = req
        .and_then(|r| r.filename)
        .ok_or_else(|| ApiError::bad_request("missing `filename`"))?;
    if !valid_slot_filename(&filename) {
        return Err(ApiError::bad_request(
            "slot filename must be 1-255 characters of [A-Za-z0-9._-], not `.` or `..`",
        ));
    }
    let path = state
        .options
        .slot_save_path
        .as_ref()
        .map(|d| d.join(&filename))
        .unwrap_or_default();
    let action = query.action;
    let st = state.clone();
    let start = std::time::Instant::now();
    let n = tokio::task::spawn_blocking(move || match action {
        SlotAction::Save => crate::slotfile::save(
            &st.engine,
            st.kvpack.as_ref(),
            id,
            &path,
            st.options.slot_save_quota_bytes,
        ),
        _ => crate::slotfile::restore(&st.engine, st.kvpack.as_ref(), id, &path),
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let key = if action == SlotAction::Save {
        "n_saved"
    } else {
        "n_restored"
    };
    Ok(Json(json!({
        "id_slot": id, "filename": filename, key: n,
        "timings": { "ms": start.elapsed().as_secs_f64() * 1e3 },
    })))
}

/// 200 while the engine runs; 503 once it has stopped (the server then exits).
pub async fn health(State(state): State<SharedState>) -> Response {
    if state.engine.is_running() {
        return Json(json!({ "status": "ok" })).into_response();
    }
    ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "engine_unavailable",
        "the engine has stopped",
    )
    .into_response()
}

pub async fn metrics(State(state): State<SharedState>) -> ApiResult<Response> {
    if !state.options.metrics_endpoint {
        return Err(ApiError::not_implemented(
            "This server does not support metrics endpoint (started with --no-metrics).",
        ));
    }
    let gauges = crate::routes::telemetry::gauges(&state);
    let text = state.metrics.scrape(&gauges, state.engine.is_sleeping());
    let mut r = text.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    // llama-server's header: when this process started (Unix seconds)
    r.headers_mut().insert(
        "Process-Start-Time-Unix",
        HeaderValue::from(state.started_unix_s),
    );
    Ok(r)
}
