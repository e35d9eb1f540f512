//! The one error type of the HTTP layer and its JSON envelope:
//! `{"error": {"type": ..., "message": ..., "code": <status>}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub retry_after_s: Option<u64>,
    /// Fields beside `type`, `message` and `code` in the error object.
    pub details: Vec<(&'static str, serde_json::Value)>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            retry_after_s: None,
            details: Vec::new(),
        }
    }
    /// 400 `exceed_context_size_error`, with the prompt's tokens and the slot's context as
    /// llama-server reports them.
    pub fn exceed_context(n_prompt_tokens: usize, n_ctx: usize) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "exceed_context_size_error",
            format!(
                "the prompt has {n_prompt_tokens} tokens; the context per slot is {n_ctx} tokens (start the server with a larger -c)"
            ),
        );
        e.details = vec![
            ("n_prompt_tokens", n_prompt_tokens.into()),
            ("n_ctx", n_ctx.into()),
        ];
        e
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    pub fn unsupported_media(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            message,
        )
    }
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or invalid API key: send `Authorization: Bearer <key>`",
        )
    }
    pub fn not_found(kind: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, kind, message)
    }
    pub fn busy(retry_after_s: u64) -> Self {
        Self {
            retry_after_s: Some(retry_after_s.max(1)),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_exceeded",
                "the request queue is full; retry later",
            )
        }
    }
    /// 503 with `Retry-After`: too many requests in flight.
    pub fn overloaded() -> Self {
        Self {
            retry_after_s: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                format!(
                    "the server is handling {} requests; retry later",
                    crate::limits::IN_FLIGHT_MAX
                ),
            )
        }
    }
    pub fn not_implemented(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_IMPLEMENTED, "not_implemented", message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }
    pub fn body(&self) -> serde_json::Value {
        let mut error: serde_json::Map<String, serde_json::Value> = self
            .details
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        error.insert("type".into(), self.kind.into());
        error.insert("message".into(), self.message.clone().into());
        error.insert("code".into(), self.status.as_u16().into());
        serde_json::json!({ "error": error })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
