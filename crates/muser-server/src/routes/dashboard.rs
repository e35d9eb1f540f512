//! The web dashboard (muser-dashboard's embedded files): `/` and `/assets/{name}`, open
//! without the API key (they hold no data; the page asks for the key and keeps it in memory),
//! never cached, under a same-origin Content-Security-Policy.

use crate::error::ApiError;
use axum::extract::Path;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use muser_dashboard::Asset;

fn serve(a: Asset) -> Response {
    let mut r = a.body.into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(a.content_type),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(muser_dashboard::CONTENT_SECURITY_POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    r
}

pub async fn index() -> Response {
    serve(muser_dashboard::INDEX)
}

pub async fn asset(Path(name): Path<String>) -> Result<Response, ApiError> {
    muser_dashboard::asset(&name)
        .map(serve)
        .ok_or_else(|| ApiError::not_found("not_found", format!("no asset {name}")))
}
