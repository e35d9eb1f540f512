//! `/v1/nodes`: a consumer's enrolled producers, behind the guard layer (API key) like every
//! route. `GET` lists the registry with each node's health as this server's lane sees it;
//! `POST {name, url, code}` runs the enrollment steps of [`crate::onboard`] on this server's
//! engine (one at a time; 201 with the steps, or 422 naming the failed step); `DELETE
//! /v1/nodes/{name}` revokes the node's certificates, forgets it, and stops this server's
//! lane from routing to it at once. A node enrolled here joins the lane at the server's next
//! start.

use std::path::PathBuf;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use muser_cluster::enroll::EnrollCode;
use muser_cluster::registry::Registry;
use muser_cluster::Pki;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
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
    /// One enrollment at a time.
    pub enrolling: tokio::sync::Mutex<()>,
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
    let health = state.lane.as_ref().map(|l| l.health()).unwrap_or_default();
    let nodes: Vec<Value> = reg
        .nodes
        .iter()
        .map(|n| {
            let state = health
                .iter()
                .find(|(name, _, _)| *name == n.name)
                .map_or("not in use (restart to use)", |(_, h, _)| h.name());
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
    if let Some(lane) = &state.lane {
        lane.retire(&name);
    }
    Ok(Json(
        json!({ "removed": name, "certificates_revoked": revoked }),
    ))
}
