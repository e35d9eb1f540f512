//! Session migration over the prefill lane: a session's bundle moves from this node to
//! another over the lane's mutual TLS, still encrypted.
//!
//! - The source answers `POST /v1/sessions/{id}/migrate` `{"to": NODE}` (NODE one of its
//!   `--migrate-to NAME=https://HOST:PORT`): it reads the bundle, checks it opens under its
//!   own key, and sends the bytes unchanged as `POST /v1/lane/sessions` to NODE. The answer
//!   must name the same session and revision; only then does the source delete its copy
//!   (at that revision: a write that raced the move keeps the source's newer copy, 409).
//!   Any failure before the confirmation leaves the source as it was.
//! - The target serves `POST /v1/lane/sessions` on its lane port (`--lane-port`) to the
//!   `--lane-peer` names: the bundle is verified whole (authentic under the operator key both
//!   share, made for this model) and kept only when it is newer than a local copy; the same
//!   bytes again (a retried move whose confirmation was lost) are confirmed, not refused.
//!
//! The bundle never leaves its encryption: the lane adds transport security and proves the
//! peers' names; the operator key alone opens it. A restore on the target gives the
//! conversation and the exact K/V, so it continues with the tokens it would have produced
//! where it was.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use http_body_util::Full;
use muser_cluster::PeerName;
use muser_sessions::{Header, SessionError, SessionStore};
use serde_json::{json, Value};

use crate::error::{ApiError, ApiResult};
use crate::json::{parse, JsonBytes};
use crate::routes::sessions::{blocking, header_json, session_error, sessions};
use crate::state::SharedState;
use crate::wire::sessions::MigrateSession;

/// Longest a move may take, connection to confirmation.
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(120);

fn migration_error(status: StatusCode, msg: String) -> ApiError {
    ApiError::new(status, "migration_error", msg)
}

/// `POST /v1/sessions/{id}/migrate` `{"to": NODE}`.
pub async fn migrate(
    State(state): State<SharedState>,
    Path(id): Path<String>,
    JsonBytes(body): JsonBytes,
) -> ApiResult<Response> {
    let req: MigrateSession = parse(&body)?;
    sessions(&state)?;
    let lane = state.lane.get().cloned().ok_or_else(|| {
        ApiError::bad_request("this node has no lane: start it with --name and --migrate-to")
    })?;
    let (ep, client) = lane.migration_target(&req.to).ok_or_else(|| {
        ApiError::bad_request(format!(
            "`{}` is not a --migrate-to node of this server",
            req.to
        ))
    })?;
    let st = state.clone();
    let (h, bytes) = blocking(move || {
        let store = &sessions(&st)?.store;
        let bytes = store.read_raw(&id).map_err(session_error)?;
        let (h, _) = store.verify(&bytes).map_err(session_error)?;
        Ok((h, bytes))
    })
    .await?;
    let request = hyper::Request::post("/v1/lane/sessions")
        .header("content-type", "application/octet-stream")
        .body(Full::new(Bytes::from(bytes)))
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let refused = |why: String| {
        migration_error(
            StatusCode::BAD_GATEWAY,
            format!(
                "session {} stays here: {} did not take it: {why}",
                h.id, ep.name
            ),
        )
    };
    let mut resp = client
        .send(ep, request, MIGRATE_TIMEOUT)
        .await
        .map_err(|e| refused(e.to_string()))?;
    let status = resp.status();
    let answer = tokio::time::timeout(MIGRATE_TIMEOUT, crate::lane::small_body(resp.body_mut()))
        .await
        .map_err(|_| refused("no answer in time".into()))?
        .map_err(refused)?;
    if status != StatusCode::OK {
        return Err(refused(format!("{status}: {answer}")));
    }
    let confirmed: Value = serde_json::from_str(&answer).map_err(|e| refused(e.to_string()))?;
    if confirmed["id"] != json!(h.id) || confirmed["revision"] != json!(h.revision) {
        return Err(refused(format!(
            "it confirmed {confirmed}, not revision {}",
            h.revision
        )));
    }
    // the target holds this revision: the source's copy goes, unless it changed meanwhile
    let st = state.clone();
    let (id, revision) = (h.id.clone(), h.revision);
    blocking(move || {
        sessions(&st)?
            .store
            .delete(&id, revision)
            .map_err(session_error)
    })
    .await?;
    tracing::info!(session = %h.id, revision = h.revision, to = %ep.name, "session migrated");
    let mut v = header_json(&h);
    v["migrated_to"] = json!(ep.name);
    Ok(Json(v).into_response())
}

/// The lane routes of a node that takes sessions in (`--lane-port`).
pub fn lane_router(state: SharedState) -> Router {
    let limit = state
        .sessions
        .as_ref()
        .map_or(0, |s| s.max_bundle_bytes as usize);
    Router::new()
        .route("/v1/lane/sessions", post(receive))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// `POST /v1/lane/sessions`: a bundle from an enrolled peer.
async fn receive(
    State(state): State<SharedState>,
    Extension(peer): Extension<PeerName>,
    body: Bytes,
) -> ApiResult<Response> {
    sessions(&state)?;
    let st = state.clone();
    let h = blocking(move || take_in(&sessions(&st)?.store, &body).map_err(session_error)).await?;
    tracing::info!(session = %h.id, revision = h.revision, from = %peer.0, "session migrated in");
    Ok(Json(header_json(&h)).into_response())
}

/// Imports `bytes`; the very bundle already held (a retried move) is confirmed as well.
fn take_in(store: &SessionStore, bytes: &[u8]) -> Result<Header, SessionError> {
    match store.import(bytes) {
        Err(SessionError::Stale {
            id,
            current: Some(c),
            expected: Some(r),
        }) if c == r && store.read_raw(&id).is_ok_and(|held| held == bytes) => {
            Ok(store.verify(bytes)?.0)
        }
        other => other,
    }
}

/// Serves [`lane_router`] over mutual TLS to the `peers` on `listener`, as node `node`.
pub async fn serve_lane(
    state: SharedState,
    config_dir: &std::path::Path,
    node: &str,
    peers: &[String],
    listener: tokio::net::TcpListener,
) -> Result<(), String> {
    let creds = muser_cluster::Pki::at(config_dir)
        .node(node)
        .map_err(|e| e.to_string())?;
    let tls = muser_cluster::server_config(&creds).map_err(|e| e.to_string())?;
    let peers: Arc<[String]> = peers.iter().cloned().collect();
    muser_cluster::serve(
        listener,
        tls,
        peers,
        lane_router(state),
        std::future::pending(),
    )
    .await
    .map_err(|e| e.to_string())
}
