//! `/v1/nodes`: a consumer's enrolled producers, behind the guard layer (API key) like every
//! route. `GET` lists the registry with each node's health as this server's lane sees it;
//! `POST {name, url, code}` runs the enrollment steps of [`crate::onboard`] on this server's
//! engine (one at a time; 201 with the steps, or 422 naming the failed step); `DELETE
//! /v1/nodes/{name}` revokes the node's certificates, forgets it, and stops this server's
//! lane from routing to it at once.
//!
//! A consumer whose producers are its registry's ([`NodeAdmin::follow`]) keeps its lane in
//! line with `nodes.toml` while it runs ([`follow_registry`]): a node enrolled here or by
//! `muser node add` joins the lane (which opens with the first one), a node removed by
//! either is retired at once.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use muser_cluster::enroll::EnrollCode;
use muser_cluster::registry::{FailureLog, Registry};
use muser_cluster::Pki;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::lane::{ConsumerConfig, Lane};
use crate::onboard::{Onboarding, Step};
use crate::state::SharedState;

/// What a consumer's node routes work with (`muser up` sets it).
pub struct NodeAdmin {
    /// Holds `tls/`, `nodes.toml` and the lane ledger.
    pub config_dir: PathBuf,
    /// This consumer's certificate name, when given (`--name`); else the registry's.
    pub consumer: Option<String>,
    /// The operator key file (`--kv-key-file`; default the model store's).
    pub kv_key_file: Option<PathBuf>,
    pub accept_abis: Vec<String>,
    /// The lane settings the registry's nodes join with while this consumer runs, when its
    /// producers are the registry's (no `--producer`, `--node` or `--local`); `None`: the
    /// lane's producers are fixed at start-up.
    pub follow: Option<ConsumerConfig>,
    /// One enrollment at a time.
    pub enrolling: tokio::sync::Mutex<()>,
    /// The registry file as [`follow_registry`] last read it (modified time and length).
    seen: Mutex<Option<(SystemTime, u64)>>,
}

impl NodeAdmin {
    pub fn new(
        config_dir: PathBuf,
        consumer: Option<String>,
        kv_key_file: Option<PathBuf>,
        accept_abis: Vec<String>,
        follow: Option<ConsumerConfig>,
    ) -> NodeAdmin {
        NodeAdmin {
            config_dir,
            consumer,
            kv_key_file,
            accept_abis,
            follow,
            enrolling: tokio::sync::Mutex::new(()),
            seen: Mutex::new(None),
        }
    }
}

/// Brings a following consumer's lane in line with its registry: a node enrolled since
/// joins (the lane opens with the first one), a node no longer enrolled is retired. Reads
/// the registry only when its file changed (or `force`); a no-op on a consumer that does not
/// follow.
pub fn follow_registry(state: &SharedState, force: bool) -> Result<(), String> {
    let Some(admin) = state.nodes.as_ref() else {
        return Ok(());
    };
    let Some(follow) = &admin.follow else {
        return Ok(());
    };
    let path = Registry::path(&admin.config_dir);
    let now = std::fs::metadata(&path)
        .ok()
        .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()));
    {
        let mut seen = admin.seen.lock().unwrap_or_else(|e| e.into_inner());
        if !force && *seen == now {
            return Ok(());
        }
        *seen = now;
    }
    let reg = Registry::load(&admin.config_dir).map_err(|e| e.to_string())?;
    let lane = match (state.lane.get(), reg.nodes.is_empty()) {
        (Some(lane), _) => lane.clone(),
        (None, true) => return Ok(()),
        (None, false) => open_lane(state, admin, follow, &reg)?,
    };
    for n in &reg.nodes {
        let ep = n.endpoint().map_err(|e| e.to_string())?;
        if lane.join(&ep)? {
            tracing::info!(producer = %n.name, url = %n.url, "prefill lane: enrolled node joined");
        }
    }
    for (name, _, _) in lane.health() {
        if reg.get(&name).is_none() {
            lane.retire(&name);
        }
    }
    Ok(())
}

/// The lane of a consumer that started with no node enrolled, opened when the first one is.
fn open_lane(
    state: &SharedState,
    admin: &NodeAdmin,
    follow: &ConsumerConfig,
    reg: &Registry,
) -> Result<Arc<Lane>, String> {
    let consumer = admin
        .consumer
        .clone()
        .or_else(|| reg.consumer.clone())
        .ok_or("the registry names no consumer")?;
    let creds = muser_cluster::enroll::node_creds(&admin.config_dir, &consumer)
        .map_err(|e| e.to_string())?;
    let ctx = state
        .kvpack
        .clone()
        .ok_or("this server has no model identity")?;
    let cfg = ConsumerConfig {
        producers: reg
            .nodes
            .iter()
            .map(|n| n.endpoint().map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?,
        ..follow.clone()
    };
    let lane = Lane::open(
        &cfg,
        &creds,
        &admin.config_dir,
        ctx,
        state.options.n_ctx,
        state.engine.config().prefill_chunk,
    )?;
    // a concurrent caller may have opened it first: theirs is the lane
    let _ = state.lane.set(Arc::new(lane));
    Ok(state.lane.get().expect("just set").clone())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddNode {
    pub name: String,
    /// `https://HOST:PORT`.
    pub url: String,
    pub code: String,
}

fn admin(state: &SharedState) -> Result<&NodeAdmin, ApiError> {
    state
        .nodes
        .as_ref()
        .ok_or_else(|| ApiError::not_found("not_found", "this server keeps no node registry"))
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(e.to_string())
}

pub async fn list(State(state): State<SharedState>) -> Result<Json<Value>, ApiError> {
    let admin = admin(&state)?;
    let reg = Registry::load(&admin.config_dir).map_err(internal)?;
    let health = state.lane.get().map(|l| l.health()).unwrap_or_default();
    let nodes: Vec<Value> = reg
        .nodes
        .iter()
        .map(|n| {
            let state = health
                .iter()
                .find(|(name, _, _)| *name == n.name)
                .map_or("not in use", |(_, h, _)| h.name());
            json!({
                "name": n.name,
                "url": n.url,
                "device": n.device,
                "engine_abi": n.engine_abi,
                "model_weights": n.model_weights,
                "enrolled_unix": n.enrolled_unix,
                "state": state,
                "last_handoff": n.handoff.map(|h| json!({
                    "tokens": h.tokens,
                    "kv_bytes": h.kv_bytes,
                    "ms": h.ms,
                    "gb_per_s": h.gb_per_s(),
                })),
            })
        })
        .collect();
    Ok(Json(json!({ "consumer": reg.consumer, "nodes": nodes })))
}

pub async fn add(State(state): State<SharedState>, body: Bytes) -> Result<Response, ApiError> {
    let admin = admin(&state)?;
    let req: AddNode = crate::json::parse(&body)?;
    let code = EnrollCode::parse(&req.code).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let _one = admin.enrolling.try_lock().map_err(|_| {
        ApiError::new(
            StatusCode::CONFLICT,
            "enrollment_busy",
            "another enrollment is running",
        )
    })?;
    let consumer = crate::onboard::consumer_identity(&admin.config_dir, admin.consumer.clone())
        .map_err(internal)?;
    let mut key = crate::kvkey::load_or_create(admin.kv_key_file.as_deref()).map_err(internal)?;
    let onboarding = Onboarding {
        app: state.clone(),
        config_dir: admin.config_dir.clone(),
        consumer,
        operator_key_hex: hex::encode(key),
        accept_abis: admin.accept_abis.clone(),
    };
    key.fill(0);
    let mut steps = Vec::new();
    let mut progress = |step: Step, what: &str| {
        steps.push(json!({ "step": step.name(), "result": what }));
    };
    let result = onboarding
        .add(&req.name, &req.url, &code, &mut progress)
        .await;
    if let Err(e) = follow_registry(&state, true) {
        tracing::warn!(error = %e, "prefill lane: following the node registry");
    }
    Ok(match result {
        Ok(entry) => (
            StatusCode::CREATED,
            Json(json!({ "node": entry.name, "state": "healthy", "steps": steps })),
        )
            .into_response(),
        Err(e) => {
            tracing::warn!(node = %req.name, error = %e, "enrollment failed");
            let mut body = ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "enrollment_failed",
                e.to_string(),
            )
            .body();
            body["error"]["step"] = json!(e.step.name());
            body["steps"] = json!(steps);
            (StatusCode::UNPROCESSABLE_ENTITY, Json(body)).into_response()
        }
    })
}

pub async fn remove(
    State(state): State<SharedState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let admin = admin(&state)?;
    muser_cluster::check_name(&name).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let mut reg = Registry::load(&admin.config_dir).map_err(internal)?;
    if !reg.remove(&name) {
        return Err(ApiError::not_found(
            "not_found",
            format!("node `{name}` is not enrolled"),
        ));
    }
    let revoked = Pki::at(&admin.config_dir).revoke(&name).map_err(internal)?;
    reg.save(&admin.config_dir).map_err(internal)?;
    if let Some(lane) = state.lane.get() {
        lane.retire(&name);
    }
    if let Err(e) = FailureLog::at(&admin.config_dir, &name).clear() {
        tracing::warn!(node = %name, error = %e, "node failure log");
    }
    Ok(Json(
        json!({ "removed": name, "certificates_revoked": revoked }),
    ))
}
