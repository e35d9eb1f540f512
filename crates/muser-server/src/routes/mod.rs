//! The router: every route, the auth and logging middleware, and helpers shared by the three
//! wire families.

pub mod anthropic;
pub mod dashboard;
pub mod llama;
pub mod nodes;
pub mod ollama;
pub mod openai;
pub mod rerank;
pub mod responses;
pub mod sessions;
pub mod telemetry;

use crate::auth;
use crate::error::{ApiError, ApiResult};
use crate::gen::{per_second, Finished};
use crate::reqlog::RequestLog;
use crate::state::{AppState, SharedState};
use axum::body::Body;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{header, request::Parts, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Every fixed route path (metric labels come from this list; anything else is "other").
const ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/chat/completions/input_tokens",
    "/chat/completions/input_tokens",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/responses",
    "/v1/responses/input_tokens",
    "/responses/input_tokens",
    "/v1/models",
    "/models",
    "/completion",
    "/completions",
    "/infill",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/embedding",
    "/embeddings",
    "/rerank",
    "/v1/rerank",
    "/props",
    "/slots",
    "/health",
    "/v1/health",
    "/metrics",
    "/api/generate",
    "/api/chat",
    "/api/tags",
    "/api/show",
    "/api/version",
    "/v1/sessions",
    "/v1/sessions/import",
    "/v1/telemetry",
    "/v1/telemetry/stream",
    "/",
];

fn route_label(path: &str) -> &'static str {
    match ROUTES.iter().find(|r| **r == path) {
        Some(r) => r,
        None if path.starts_with("/slots/") => "/slots/{id}",
        None if path.starts_with("/v1/sessions/") => "/v1/sessions/{id}",
        None if path.starts_with("/assets/") => "/assets/{name}",
        None => "other",
    }
}

/// All routes with auth and per-request logging.
pub fn router(state: SharedState) -> Router {
    Router::new()
        // OpenAI
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/chat/completions", post(openai::chat_completions))
        .route(
            "/v1/chat/completions/input_tokens",
            post(openai::chat_input_tokens),
        )
        .route(
            "/chat/completions/input_tokens",
            post(openai::chat_input_tokens),
        )
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::models))
        // Anthropic
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        // OpenAI Responses
        .route("/v1/responses", post(responses::responses))
        .route("/responses", post(responses::responses))
        .route("/v1/responses/input_tokens", post(responses::input_tokens))
        .route("/responses/input_tokens", post(responses::input_tokens))
        .route("/models", get(openai::models))
        // llama.cpp
        .route("/completion", post(llama::completion))
        .route("/completions", post(llama::completion))
        .route("/infill", post(llama::infill))
        .route("/tokenize", post(llama::tokenize))
        .route("/detokenize", post(llama::detokenize))
        .route("/apply-template", post(llama::apply_template))
        .route("/embedding", post(llama::embedding))
        .route("/embeddings", post(llama::embedding))
        .route("/rerank", post(rerank::rerank))
        .route("/v1/rerank", post(rerank::rerank))
        .route("/props", get(llama::props))
        .route("/slots", get(llama::slots))
        .route("/slots/{id}", post(llama::slot_action))
        .route("/health", get(llama::health))
        .route("/v1/health", get(llama::health))
        .route("/metrics", get(llama::metrics))
        // Ollama
        .route("/api/generate", post(ollama::generate))
        .route("/api/chat", post(ollama::chat))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/version", get(ollama::version))
        // sessions
        .route("/v1/sessions", get(sessions::list).post(sessions::create))
        .route("/v1/sessions/import", post(sessions::import))
        .route(
            "/v1/sessions/{id}",
            get(sessions::get_one)
                .put(sessions::update)
                .delete(sessions::delete),
        )
        .route("/v1/sessions/{id}/restore", post(sessions::restore))
        .route("/v1/sessions/{id}/bundle", get(sessions::export))
        .route("/v1/sessions/{id}/migrate", post(crate::migrate::migrate))
        // telemetry and the dashboard
        .route("/v1/nodes", get(nodes::list).post(nodes::add))
        .route("/v1/nodes/{name}", delete(nodes::remove))
        .route("/v1/telemetry", get(telemetry::get))
        .route("/v1/telemetry/stream", get(telemetry::stream))
        .route("/", get(dashboard::index))
        .route("/assets/{name}", get(dashboard::asset))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            handler_panicked,
        ))
        .with_state(state)
}

/// A handler that panics answers 500 (the connection and the server go on).
fn handler_panicked(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    ApiError::internal("the request failed inside the server").into_response()
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(
        "not_found",
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
}

/// The one layer every route (present and future) passes: CORS (preflights answered here,
/// before anything else), the `Host` allow-list (without
/// a key), JSON-only POSTs, the API key (`Authorization: Bearer KEY`, or Anthropic's
/// `x-api-key: KEY`; every route but /health and the dashboard's files, which hold no data),
/// waking a sleeping engine for any request but a read (GET, HEAD), the limit on requests in
/// flight, and the per-request log record.
async fn guard(State(state): State<SharedState>, mut req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let route = route_label(path);
    let log = RequestLog::new(req.method().as_str(), path, route, state.metrics.clone());
    let origin = req.headers().get(header::ORIGIN).cloned();
    if req.method() == axum::http::Method::OPTIONS {
        // a CORS preflight: browsers send it without credentials, and it carries no data
        let mut response = StatusCode::OK.into_response();
        state
            .options
            .cors
            .apply(origin.as_ref(), true, response.headers_mut());
        log.set_status(200);
        return response;
    }
    let open = matches!(path, "/health" | "/v1/health" | "/") || path.starts_with("/assets/");
    let refused = admit(&state, &req, open).err();
    if refused.is_none() && !matches!(*req.method(), Method::GET | Method::HEAD) {
        // a request that may need the model wakes a sleeping engine (--sleep-idle-seconds);
        // reading /health, /props, /models or /metrics does not
        state.engine.touch();
    }
    let response = match refused {
        Some(e) => e.into_response(),
        None if open || route == "/metrics" => {
            req.extensions_mut().insert(LogHandle(log.clone()));
            next.run(req).await
        }
        None => match state.in_flight.clone().try_acquire_owned() {
            Err(_) => ApiError::overloaded().into_response(),
            Ok(permit) => {
                req.extensions_mut().insert(LogHandle(log.clone()));
                hold_while_streaming(next.run(req).await, permit)
            }
        },
    };
    let mut response = response;
    state
        .options
        .cors
        .apply(origin.as_ref(), false, response.headers_mut());
    log.set_status(response.status().as_u16());
    response
}

/// The checks that refuse a request before any work: Host, Content-Type, API key.
fn admit(state: &AppState, req: &Request, open: bool) -> ApiResult<()> {
    let headers = req.headers();
    match &state.options.api_key {
        Some(key) if !open => {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|h| h.to_str().ok());
            match headers.get("x-api-key").map(|h| h.to_str().unwrap_or("")) {
                Some(k) if given.is_none() => auth::check_key(key, k.trim())?,
                _ => auth::check_bearer(key, given)?,
            }
        }
        Some(_) => {}
        None => {
            let host = headers.get(header::HOST).map(|h| h.to_str().unwrap_or(""));
            if let Some(host) =
                host.filter(|h| !auth::host_allowed(h, &state.options.allowed_hosts))
            {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "forbidden_host",
                    format!("Host `{host}` is not served here: without an API key this server answers only to its own names (start it with --allow-host NAME, or with a key)"),
                ));
            }
        }
    }
    // A session bundle is binary (`application/octet-stream`, which a browser cannot send
    // cross-site without a preflight either); every other POST is JSON.
    if req.method() == axum::http::Method::POST && req.uri().path() != "/v1/sessions/import" {
        crate::json::check_content_type(headers.get(header::CONTENT_TYPE))?;
    }
    Ok(())
}

/// A streamed response keeps its in-flight permit until its last frame is sent (or the
/// client goes away); any other response returns it now.
fn hold_while_streaming(response: Response, permit: tokio::sync::OwnedSemaphorePermit) -> Response {
    let streaming = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| {
            t.starts_with("text/event-stream") || t.starts_with("application/x-ndjson")
        });
    if !streaming {
        return response;
    }
    response.map(|body| {
        Body::from_stream(futures::StreamExt::map(
            body.into_data_stream(),
            move |frame| {
                let _held = &permit;
                frame
            },
        ))
    })
}

/// The request's log record, handed to handlers by the middleware.
#[derive(Clone)]
pub struct LogHandle(pub Arc<RequestLog>);

impl std::ops::Deref for LogHandle {
    type Target = RequestLog;
    fn deref(&self) -> &RequestLog {
        &self.0
    }
}

/// Extractor for the log record.
pub struct Log(pub LogHandle);

impl<S: Send + Sync> FromRequestParts<S> for Log {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts
            .extensions
            .get::<LogHandle>()
            .cloned()
            .map(Log)
            .ok_or_else(|| ApiError::internal("request log missing"))
    }
}

pub fn sse_response(body: Body) -> Response {
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

pub fn ndjson_response(body: Body) -> Response {
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    r
}

/// A unique id with a prefix (`chatcmpl-…`), from the clock and a counter.
pub fn next_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{prefix}{:x}{n:06x}", t & 0xffff_ffff_ffff)
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `id_slot`: -1 or absent means any slot.
pub fn slot_from(id_slot: Option<i64>, state: &AppState) -> ApiResult<Option<usize>> {
    match id_slot {
        None | Some(-1) => Ok(None),
        Some(s) if s >= 0 && (s as usize) < state.options.n_slots => Ok(Some(s as usize)),
        Some(s) => Err(ApiError::bad_request(format!(
            "id_slot must be -1 or in 0..{}, got {s}",
            state.options.n_slots
        ))),
    }
}

/// llama-server's `prompt_progress` of a stream chunk (`return_progress`).
pub fn prompt_progress(p: &muser_engine::Progress) -> Value {
    json!({ "total": p.total, "cache": p.cache, "processed": p.processed })
}

/// llama.cpp's `timings` object.
pub fn timings(done: &Finished) -> Value {
    let per_token = |ms: f64, n: u32| if n > 0 { ms / f64::from(n) } else { 0.0 };
    let n_prompt_eval = done.n_prompt.saturating_sub(done.n_cached);
    let n_after_first = done.n_gen.saturating_sub(1);
    json!({
        "cache_n": done.n_cached,
        "prompt_n": n_prompt_eval,
        "prompt_ms": done.prompt_ms,
        "prompt_per_token_ms": per_token(done.prompt_ms, n_prompt_eval),
        "prompt_per_second": per_second(n_prompt_eval, done.prompt_ms),
        "predicted_n": done.n_gen,
        "predicted_ms": done.gen_ms,
        // the first token comes with the prompt's last pass: the rate is of the tokens after it
        "predicted_per_token_ms": per_token(done.gen_ms, n_after_first),
        "predicted_per_second": per_second(n_after_first, done.gen_ms),
        "prefill_lane": if done.producer.is_some() { "remote" } else { "local" },
        "producer": done.producer.as_deref(),
        "draft_n": done.draft_n,
        "draft_n_accepted": done.draft_n_accepted,
    })
}

pub fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Marks a response status for handlers that build their own.
pub fn status_json(status: StatusCode, v: Value) -> Response {
    (status, axum::Json(v)).into_response()
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64() {
        assert_eq!(super::base64_encode(b""), "");
        assert_eq!(super::base64_encode(b"f"), "Zg==");
        assert_eq!(super::base64_encode(b"fo"), "Zm8=");
        assert_eq!(super::base64_encode(b"foobar"), "Zm9vYmFy");
    }
}
