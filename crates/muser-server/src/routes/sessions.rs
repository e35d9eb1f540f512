//! `/v1/sessions`: a slot's conversation and exact K/V kept as an encrypted bundle
//! (muser-sessions), restored into a slot here or on another Muser of the same model and
//! operator key, with revisions and idempotency keys.
//!
//! - `GET /v1/sessions`: the sessions, newest first.
//! - `POST /v1/sessions` `{id?, slot, messages}`: 201, revision 1.
//! - `GET /v1/sessions/{id}`: the session with its messages.
//! - `PUT /v1/sessions/{id}` `{slot, messages, expected_revision}`: the next revision; a
//!   stale `expected_revision` is 409 and changes nothing.
//! - `DELETE /v1/sessions/{id}?expected_revision=N`: 204.
//! - `POST /v1/sessions/{id}/restore` `{slot}`: the slot holds the session's tokens and K/V.
//! - `GET /v1/sessions/{id}/bundle`: the bundle file; `POST /v1/sessions/import` (body
//!   `application/octet-stream`) takes one in (verified whole, kept only when newer).
//! - `POST /v1/sessions/{id}/migrate` `{to}`: moves the bundle to another node over the
//!   prefill lane's mutual TLS (`crate::migrate`).
//!
//! Writes accept an `Idempotency-Key` header: a retry with the same key and body gets the
//! first answer and changes nothing; the same key with another body is 422.

use crate::error::{ApiError, ApiResult};
use crate::json::{parse, JsonBytes};
use crate::routes::{next_id, unix_now};
use crate::slotfile;
use crate::state::SharedState;
use crate::wire::sessions::{CreateSession, DeleteSession, RestoreSession, UpdateSession};
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use muser_engine::KvPackContext;
use muser_sessions::{
    Answer, Header, Idempotency, Seen, SessionError, SessionStore, SessionWrite, MAX_MESSAGES_BYTES,
};
use serde_json::{json, Value};

/// Most messages in one session.
const MAX_MESSAGES: usize = 4096;

/// The session store and its idempotency keys.
pub struct Sessions {
    pub store: SessionStore,
    idempotency: Idempotency,
    /// Largest bundle accepted (a full slot's image plus the conversation).
    pub max_bundle_bytes: u64,
}

impl Sessions {
    pub fn open(
        dir: &std::path::Path,
        operator_key: &[u8; 32],
        ctx: &KvPackContext,
        n_ctx: usize,
    ) -> Result<Sessions, SessionError> {
        let max_bundle_bytes =
            slotfile::max_image_bytes(ctx, n_ctx) + MAX_MESSAGES_BYTES as u64 + (64 << 10);
        let model = ctx.identity.digest(&ctx.keys);
        Ok(Sessions {
            store: SessionStore::open(dir, operator_key, model, max_bundle_bytes)?,
            idempotency: Idempotency::default(),
            max_bundle_bytes,
        })
    }
}

pub(crate) fn sessions(state: &SharedState) -> ApiResult<&Sessions> {
    state.sessions.as_ref().ok_or_else(|| {
        ApiError::not_found(
            "not_found",
            "sessions are off: start the server with --session-dir DIR",
        )
    })
}

/// The HTTP status of each refusal.
pub(crate) fn session_error(e: SessionError) -> ApiError {
    let (status, kind) = match &e {
        SessionError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
        SessionError::Stale { .. } => (StatusCode::CONFLICT, "stale_revision"),
        SessionError::ForeignModel => (StatusCode::CONFLICT, "identity_mismatch"),
        SessionError::Full(_) => (StatusCode::CONFLICT, "store_full"),
        SessionError::IdempotencyKeyReused => {
            (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused")
        }
        SessionError::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
        SessionError::Unauthentic | SessionError::Malformed(_) => {
            (StatusCode::BAD_REQUEST, "invalid_bundle")
        }
        SessionError::BadId(_) | SessionError::BadIdempotencyKey => {
            (StatusCode::BAD_REQUEST, "invalid_request_error")
        }
        SessionError::Seal | SessionError::Io { .. } => {
            (StatusCode::INTERNAL_SERVER_ERROR, "server_error")
        }
    };
    ApiError::new(status, kind, e.to_string())
}

pub(crate) fn header_json(h: &Header) -> Value {
    json!({
        "id": h.id,
        "object": "session",
        "revision": h.revision,
        "n_tokens": h.n_tokens,
        "n_messages": h.n_messages,
        "saved_at": h.saved_unix_s,
    })
}

/// Runs blocking work (files, the engine's slot jobs) off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
}

/// Runs a write once per `Idempotency-Key`: a retry with the same key and request gets the
/// first successful answer again without running; the key with another request is 422.
async fn idempotent<F>(
    state: &SharedState,
    headers: &HeaderMap,
    request: Vec<u8>,
    run: F,
) -> ApiResult<Response>
where
    F: std::future::Future<Output = ApiResult<(StatusCode, Value)>>,
{
    let s = sessions(state)?;
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| session_error(SessionError::BadIdempotencyKey))?
                .to_string(),
        ),
    };
    if let Some(key) = &key {
        if let Seen::Replay(a) = s.idempotency.check(key, &request).map_err(session_error)? {
            let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::OK);
            let mut r = (status, a.body).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r.headers_mut()
                .insert("idempotent-replay", HeaderValue::from_static("true"));
            return Ok(r);
        }
    }
    let (status, body) = run.await?;
    if let Some(key) = &key {
        let answer = Answer {
            status: status.as_u16(),
            body: body.to_string().into_bytes(),
        };
        s.idempotency.remember(key, &request, answer);
    }
    Ok((status, axum::Json(body)).into_response())
}

/// What an idempotency key is checked against: the route and the body.
fn request_digest_input(route: &str, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(route.len() + 1 + body.len());
    v.extend_from_slice(route.as_bytes());
    v.push(0);
    v.extend_from_slice(body);
    v
}

fn check_slot(state: &SharedState, slot: usize) -> ApiResult<()> {
    match slot < state.options.n_slots {
        true => Ok(()),
        false => Err(ApiError::bad_request(format!(
            "slot must be in 0..{}, got {slot}",
            state.options.n_slots
        ))),
    }
}

fn messages_bytes(messages: &[Value]) -> ApiResult<Vec<u8>> {
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad_request(format!(
            "a session holds at most {MAX_MESSAGES} messages"
        )));
    }
    if let Some(i) = messages
        .iter()
        .position(|m| !m.get("role").is_some_and(Value::is_string))
    {
        return Err(ApiError::bad_request(format!(
            "messages[{i}] must be an object with a string `role`"
        )));
    }
    let bytes = serde_json::to_vec(messages).map_err(|e| ApiError::internal(e.to_string()))?;
    if bytes.len() > MAX_MESSAGES_BYTES {
        return Err(session_error(SessionError::TooLarge(format!(
            "the conversation ({} bytes; at most {MAX_MESSAGES_BYTES})",
            bytes.len()
        ))));
    }
    Ok(bytes)
}

/// Writes slot `slot`'s image and `messages` as session `id` at the revision after
/// `expected` (`None`: a new session).
async fn write_session(
    state: &SharedState,
    id: String,
    expected: Option<u64>,
    slot: usize,
    messages: &[Value],
) -> ApiResult<Value> {
    check_slot(state, slot)?;
    sessions(state)?;
    let n_messages = messages.len() as u32;
    let messages = messages_bytes(messages)?;
    let st = state.clone();
    blocking(move || {
        let s = sessions(&st)?;
        let (image, n_tokens) = slotfile::image(&st.engine, st.kvpack.as_ref(), slot)?;
        let write = SessionWrite {
            messages,
            n_messages,
            slot: image,
            n_tokens: n_tokens as u32,
        };
        let h = s
            .store
            .put(&id, expected, write, unix_now())
            .map_err(session_error)?;
        Ok(header_json(&h))
    })
    .await
}

pub async fn list(State(state): State<SharedState>) -> ApiResult<Response> {
    sessions(&state)?;
    let st = state.clone();
    let headers = blocking(move || sessions(&st)?.store.list().map_err(session_error)).await?;
    let data: Vec<Value> = headers.iter().map(header_json).collect();
    Ok(axum::Json(json!({ "object": "list", "data": data })).into_response())
}

pub async fn create(
    State(state): State<SharedState>,
    headers: HeaderMap,
    JsonBytes(body): JsonBytes,
) -> ApiResult<Response> {
    let request = request_digest_input("POST /v1/sessions", &body);
    idempotent(&state, &headers, request, async {
        let req: CreateSession = parse(&body)?;
        let id = req.id.unwrap_or_else(|| next_id("s-"));
        let v = write_session(&state, id, None, req.slot, &req.messages).await?;
        Ok((StatusCode::CREATED, v))
    })
    .await
}

pub async fn update(
    State(state): State<SharedState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    JsonBytes(body): JsonBytes,
) -> ApiResult<Response> {
    let request = request_digest_input(&format!("PUT /v1/sessions/{id}"), &body);
    idempotent(&state, &headers, request, async {
        let req: UpdateSession = parse(&body)?;
        let v = write_session(
            &state,
            id.clone(),
            Some(req.expected_revision),
            req.slot,
            &req.messages,
        )
        .await?;
        Ok((StatusCode::OK, v))
    })
    .await
}

pub async fn get_one(
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    sessions(&state)?;
    let st = state.clone();
    let (h, contents) =
        blocking(move || sessions(&st)?.store.get(&id).map_err(session_error)).await?;
    let messages: Value = serde_json::from_slice(&contents.messages)
        .map_err(|e| ApiError::internal(format!("session {}: messages: {e}", h.id)))?;
    let mut v = header_json(&h);
    v["messages"] = messages;
    Ok(axum::Json(v).into_response())
}

pub async fn delete(
    State(state): State<SharedState>,
    Path(id): Path<String>,
    q: Result<Query<DeleteSession>, QueryRejection>,
) -> ApiResult<Response> {
    let Query(q) = q.map_err(|e| ApiError::bad_request(e.body_text()))?;
    sessions(&state)?;
    let st = state.clone();
    blocking(move || {
        sessions(&st)?
            .store
            .delete(&id, q.expected_revision)
            .map_err(session_error)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub async fn restore(
    State(state): State<SharedState>,
    Path(id): Path<String>,
    JsonBytes(body): JsonBytes,
) -> ApiResult<Response> {
    let req: RestoreSession = parse(&body)?;
    check_slot(&state, req.slot)?;
    sessions(&state)?;
    let st = state.clone();
    let (h, contents, n) = blocking(move || {
        let (h, contents) = sessions(&st)?.store.get(&id).map_err(session_error)?;
        let what = format!("session {id}");
        let n = slotfile::restore_image(
            &st.engine,
            st.kvpack.as_ref(),
            req.slot,
            &contents.slot,
            &what,
        )?;
        Ok((h, contents, n))
    })
    .await?;
    let messages: Value = serde_json::from_slice(&contents.messages)
        .map_err(|e| ApiError::internal(format!("session {}: messages: {e}", h.id)))?;
    let mut v = header_json(&h);
    v["slot"] = json!(req.slot);
    v["n_restored"] = json!(n);
    v["messages"] = messages;
    Ok(axum::Json(v).into_response())
}

pub async fn export(
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    sessions(&state)?;
    let st = state.clone();
    let name = format!("{id}.bundle");
    let bytes = blocking(move || sessions(&st)?.store.read_raw(&id).map_err(session_error)).await?;
    let mut r = bytes.into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    Ok(r)
}

/// `POST /v1/sessions/import`: a bundle file as the body (`application/octet-stream`, at
/// most a full slot's bundle).
pub async fn import(State(state): State<SharedState>, req: Request) -> ApiResult<Response> {
    let s = sessions(&state)?;
    let headers = req.headers().clone();
    let media = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if media != "application/octet-stream" {
        return Err(ApiError::unsupported_media(
            "a session bundle is sent as `Content-Type: application/octet-stream`",
        ));
    }
    let limit = s.max_bundle_bytes as usize;
    let body: Bytes = axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|_| {
            session_error(SessionError::TooLarge(format!(
                "the bundle (at most {limit} bytes)"
            )))
        })?;
    let request = request_digest_input("POST /v1/sessions/import", &body);
    let st = state.clone();
    idempotent(&state, &headers, request, async move {
        let h = blocking(move || sessions(&st)?.store.import(&body).map_err(session_error)).await?;
        Ok((StatusCode::CREATED, header_json(&h)))
    })
    .await
}

/// The session count for telemetry; `None` when sessions are off.
pub fn count(state: &SharedState) -> Option<usize> {
    let s = state.sessions.as_ref()?;
    s.store.list().ok().map(|l| l.len())
}
