//! Every bound on one request's work, in one place, each decided before the work it bounds
//! (`docs/security.md` lists them), and the bounded pool that runs a request's CPU-heavy work
//! (JSON parsing, template rendering, tokenizing, grammar compilation) off the async reactor.

use crate::error::{ApiError, ApiResult};
use axum::http::StatusCode;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Largest request body; more is 413 before it is read further.
pub const BODY_BYTES_MAX: usize = 4 << 20;
/// Longest wait for a request body once its headers arrived (a slow body is 408).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Pieces (strings and token ids) of one prompt list.
pub const PROMPT_PIECES_MAX: usize = 1 << 17;
/// Prompts of one request (`prompt`/`input` as a list of prompts), each generated or
/// embedded on its own.
pub const PROMPTS_MAX: usize = 64;
/// Choices (`n`) per prompt of one request.
pub const CHOICES_MAX: usize = 16;
/// Messages of one chat request.
pub const MESSAGES_MAX: usize = 4096;
/// Tools offered in one request.
pub const TOOLS_MAX: usize = 256;
/// Stop strings of one request, and the bytes of each.
pub const STOP_COUNT_MAX: usize = 16;
pub const STOP_BYTES_MAX: usize = 256;
/// Entries of `logit_bias`, and the largest bias magnitude (`false` bans a token).
pub const LOGIT_BIAS_MAX: usize = 1024;
pub const LOGIT_BIAS_ABS_MAX: f64 = 100.0;
/// Log-probabilities reported per token.
pub const N_PROBS_MAX: usize = 20;
/// Tokens `/tokenize` returns and `/detokenize` takes.
pub const TOKENIZE_TOKENS_MAX: usize = 1 << 17;
/// Documents of one rerank request.
pub const RERANK_DOCUMENTS_MAX: usize = 256;
/// Bytes of a JSON schema, an Ollama `format`, or one tool's `parameters`, serialized.
pub const SCHEMA_BYTES_MAX: usize = 64 << 10;

/// Requests handled at once (streams included, until their last frame); more is 503 with
/// `Retry-After`.
pub const IN_FLIGHT_MAX: usize = 256;
/// Open connections; more are closed as soon as they are accepted.
pub const CONNECTIONS_MAX: usize = 4096;
/// A connection must deliver a whole request head within this, from the moment it opens or
/// goes idle after a response (slowloris and idle keep-alive connections end here).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of a request head (request line and headers); more is 431.
pub const HEADER_BYTES_MAX: usize = 64 << 10;
/// A TLS handshake must finish within this.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection whose writes the client leaves blocked this long is dropped (a streaming
/// client's generation is cancelled and its slot freed).
pub const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// 413 for a body over [`BODY_BYTES_MAX`].
pub fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("request body exceeds the limit of {BODY_BYTES_MAX} bytes"),
    )
}

/// A count checked against its limit, named in the 400.
pub fn check_count(what: &str, n: usize, max: usize) -> ApiResult<()> {
    if n > max {
        return Err(ApiError::bad_request(format!(
            "{what}: {n} given, at most {max} allowed"
        )));
    }
    Ok(())
}

/// Stop strings: at most [`STOP_COUNT_MAX`] of at most [`STOP_BYTES_MAX`] bytes each.
pub fn check_stop(stop: &[String]) -> ApiResult<()> {
    check_count("stop strings", stop.len(), STOP_COUNT_MAX)?;
    match stop.iter().find(|s| s.len() > STOP_BYTES_MAX) {
        Some(s) => Err(ApiError::bad_request(format!(
            "a stop string has {} bytes, at most {STOP_BYTES_MAX} allowed",
            s.len()
        ))),
        None => Ok(()),
    }
}

/// A JSON value given as a schema, at most [`SCHEMA_BYTES_MAX`] bytes serialized.
pub fn check_schema(what: &str, schema: &serde_json::Value) -> ApiResult<()> {
    let n = serde_json::to_vec(schema).map_or(usize::MAX, |v| v.len());
    if n > SCHEMA_BYTES_MAX {
        return Err(ApiError::bad_request(format!(
            "{what} has {n} bytes, at most {SCHEMA_BYTES_MAX} allowed"
        )));
    }
    Ok(())
}

/// Runs CPU-heavy request work on the blocking pool, at most one job per core at a time
/// (the rest wait their turn), so the reactor keeps serving while a large body is parsed or a
/// long prompt tokenized.
pub async fn cpu<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> ApiResult<T> {
    static POOL: OnceLock<Semaphore> = OnceLock::new();
    let pool = POOL.get_or_init(|| {
        Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get()))
    });
    let _permit = pool
        .acquire()
        .await
        .map_err(|_| ApiError::internal("the work pool is closed"))?;
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("request work failed: {e}")))
}
