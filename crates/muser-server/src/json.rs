//! Strict JSON request bodies: `Content-Type: application/json` (optionally `charset=utf-8`),
//! a bounded body, and typed parsing whose errors name the offending field and its path.

use crate::error::ApiError;
use crate::limits::{self, BODY_BYTES_MAX, BODY_READ_TIMEOUT};
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use serde::de::DeserializeOwned;

/// A request body parsed strictly as `T` (whose types use `deny_unknown_fields`).
pub struct StrictJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send + 'static> FromRequest<S> for StrictJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, ApiError> {
        let bytes = read_body(req).await?;
        limits::cpu(move || parse(&bytes)).await?.map(StrictJson)
    }
}

/// A JSON request body's bytes (Content-Type checked by the guard, size by [`read_body`]), for
/// handlers that also need the body itself (idempotency keys); parse them with [`parse`].
pub struct JsonBytes(pub axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for JsonBytes {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, ApiError> {
        read_body(req).await.map(JsonBytes)
    }
}

/// Like [`StrictJson`], but an empty body is `None`.
pub struct OptionalJson<T>(pub Option<T>);

impl<S: Send + Sync, T: DeserializeOwned + Send + 'static> FromRequest<S> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, ApiError> {
        let bytes = read_body(req).await?;
        if bytes.is_empty() {
            return Ok(OptionalJson(None));
        }
        limits::cpu(move || parse(&bytes))
            .await?
            .map(|v| OptionalJson(Some(v)))
    }
}

/// The whole body: 413 past [`BODY_BYTES_MAX`] (a declared length over it is refused before
/// reading), 408 when it does not arrive within [`BODY_READ_TIMEOUT`].
async fn read_body(req: Request) -> Result<Bytes, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > BODY_BYTES_MAX as u64) {
        return Err(limits::too_large());
    }
    match tokio::time::timeout(
        BODY_READ_TIMEOUT,
        axum::body::to_bytes(req.into_body(), BODY_BYTES_MAX),
    )
    .await
    {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(_)) => Err(limits::too_large()),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body did not arrive within {} s",
                BODY_READ_TIMEOUT.as_secs()
            ),
        )),
    }
}

/// Every POST carries `Content-Type: application/json` (`charset=utf-8` allowed), whatever
/// its body: a browser cannot send that cross-site without a CORS preflight, which this
/// server never grants.
pub fn check_content_type(value: Option<&header::HeaderValue>) -> Result<(), ApiError> {
    let Some(value) = value else {
        return Err(ApiError::unsupported_media(
            "missing Content-Type: send `Content-Type: application/json`",
        ));
    };
    let text = value.to_str().unwrap_or("").to_ascii_lowercase();
    let mut parts = text.split(';').map(str::trim);
    let media = parts.next().unwrap_or("");
    let params_ok = parts.all(|p| p.is_empty() || p.replace(' ', "") == "charset=utf-8");
    if media == "application/json" && params_ok {
        Ok(())
    } else {
        Err(ApiError::unsupported_media(format!(
            "Content-Type `{text}` is not supported: send `application/json`"
        )))
    }
}

/// Parses a JSON body. Malformed JSON and JSON of the wrong shape (unknown field, wrong type,
/// missing field, the latter with the field's path) are 400, as llama-server answers them; a
/// body that is not declared JSON is 415 (`check_content_type`).
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de);
    let value = value.map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        match inner.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                ApiError::bad_request(format!("request body is not valid JSON: {inner}"))
            }
            _ if path.is_empty() || path == "." => {
                ApiError::bad_request(format!("invalid request: {}", strip_position(&inner)))
            }
            _ => ApiError::bad_request(format!(
                "invalid request at `{path}`: {}",
                strip_position(&inner)
            )),
        }
    })?;
    de.end()
        .map_err(|e| ApiError::bad_request(format!("request body is not valid JSON: {e}")))?;
    Ok(value)
}

/// serde_json appends " at line L column C"; the field path says more.
fn strip_position(err: &serde_json::Error) -> String {
    let text = err.to_string();
    match text.rfind(" at line ") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use serde::Deserialize;

    #[derive(Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        a: u32,
        #[serde(default)]
        inner: Option<Inner>,
    }
    #[derive(Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        b: bool,
    }

    #[test]
    fn unknown_nested_field_is_named_with_its_path() {
        let err = parse::<Outer>(br#"{"a":1,"inner":{"b":true,"typo":1}}"#).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(
            err.message.contains("`typo`") && err.message.contains("inner"),
            "{}",
            err.message
        );
    }

    #[test]
    fn malformed_json_and_wrong_type_are_400() {
        assert_eq!(
            parse::<Outer>(b"{\"a\":").unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            parse::<Outer>(b"hello").unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        let err = parse::<Outer>(br#"{"a":"x"}"#).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.message.contains("`a`"), "{}", err.message);
        assert!(parse::<Outer>(br#"{"a":1} trailing"#).is_err());
    }

    #[test]
    fn content_type_must_be_json() {
        let ok = |s: &str| check_content_type(Some(&header::HeaderValue::from_str(s).unwrap()));
        assert!(ok("application/json").is_ok());
        assert!(ok("application/json; charset=utf-8").is_ok());
        assert!(ok("text/plain").is_err());
        assert!(ok("application/json; charset=latin1").is_err());
        assert!(check_content_type(None).is_err());
    }
}
