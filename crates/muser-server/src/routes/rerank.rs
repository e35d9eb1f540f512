//! `POST /rerank` and `/v1/rerank` (llama-server's `--rerank`): each document scored against
//! the query. Muser has no ranking head, so the score is the cosine similarity of the
//! query's and the document's embeddings (the embedding routes' last-token pooling); the order
//! is by that score, highest first.

use super::Log;
use crate::error::{ApiError, ApiResult};
use crate::json::StrictJson;
use crate::limits::{self, RERANK_DOCUMENTS_MAX};
use crate::state::SharedState;
use crate::wire::rerank::RerankRequest;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

pub async fn rerank(
    State(state): State<SharedState>,
    Log(log): Log,
    StrictJson(req): StrictJson<RerankRequest>,
) -> ApiResult<Json<Value>> {
    if !state.options.rerank_endpoint {
        return Err(ApiError::not_implemented(
            "This server does not support reranking. Start it with --rerank",
        ));
    }
    let tei = req.texts.is_some();
    let documents = match (req.documents, req.texts) {
        (Some(d), None) | (None, Some(d)) => d,
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request("give documents or texts, not both"))
        }
        (None, None) => return Err(ApiError::bad_request("documents is required")),
    };
    if documents.is_empty() {
        return Err(ApiError::bad_request("documents must not be empty"));
    }
    limits::check_count("documents", documents.len(), RERANK_DOCUMENTS_MAX)?;
    let texts: Vec<String> = std::iter::once(req.query).chain(documents).collect();
    let tokenized = texts.clone();
    let ids = state
        .cpu(move |st| {
            tokenized
                .iter()
                .map(|t| st.encode_prompt(t, true))
                .collect::<ApiResult<Vec<_>>>()
        })
        .await?;
    super::openai::one_vector_per_input(&state)?;
    let embedded = super::openai::embed(&state, &log, ids).await?;
    let n_tokens: u32 = embedded.iter().map(|(_, d)| d.n_prompt).sum();
    let vectors: Vec<Vec<f32>> = embedded.into_iter().map(|(v, _)| v).collect();
    let (query, docs) = vectors
        .split_first()
        .expect("the query and at least one document");
    let mut scored: Vec<(usize, f32)> = docs
        .iter()
        .map(|d| d.iter().zip(query).map(|(a, b)| a * b).sum())
        .enumerate()
        .collect();
    scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    scored.truncate(req.top_n.unwrap_or(scored.len()));
    let with_text = req.return_text || req.raw_scores == Some(true);
    let text = |i: usize| texts[i + 1].clone();
    if tei {
        return Ok(Json(
            scored
                .iter()
                .map(|&(i, s)| {
                    let mut v = json!({ "index": i, "score": s });
                    if with_text {
                        v["text"] = json!(text(i));
                    }
                    v
                })
                .collect(),
        ));
    }
    let results: Vec<Value> = scored
        .iter()
        .map(|&(i, s)| {
            let mut v = json!({ "index": i, "relevance_score": s });
            if with_text {
                v["document"] = json!({ "text": text(i) });
            }
            v
        })
        .collect();
    Ok(Json(json!({
        "model": state.model.id,
        "object": "list",
        "usage": { "prompt_tokens": n_tokens, "total_tokens": n_tokens },
        "results": results,
    })))
}
