//! An enrolling producer (`muser up --role producer --enroll`): it serves the enrollment
//! exchange over TLS pinned by its one-time code (`muser_cluster::enroll`) until a consumer
//! proved the code's secret and granted it a certificate for its own key, the CA, the
//! revocation list and the kvpack operator key; then the caller serves the lane with them on
//! the same listener.
//!
//! `POST /v1/enroll/hello` answers the facts a consumer's preflight and model verification
//! check (protocol and muser versions, device, free memory and disk, clock, the model
//! identity field by field), the node's public key and a nonce, with the node's proof over
//! them. `POST /v1/enroll/finish` takes the grant with the consumer's proof over both
//! names and nonces, the node's key and the grant; a wrong proof is 403 and counts towards
//! burning the code, a used or expired code is 403 on both routes.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use muser_cluster::enroll::{self, EnrolledNode, Enrollment, Grant, PROTOCOL};
use muser_kvpack::KvIdentity;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::error::ApiError;
use crate::lane::{LaneRole, LaneSetup};
use crate::state::{AppState, SharedState};
use crate::wire::nodes::{
    EnrollFinish, EnrollHello, GrantWire, HelloAnswer, ModelFacts, NodeFacts,
};

/// Largest enrollment message (certificates and names).
const MAX_BODY: usize = 64 << 10;

/// A model identity as the enrollment exchange carries it.
pub fn model_facts(id: &KvIdentity) -> ModelFacts {
    ModelFacts {
        model_weights: hex::encode(id.model_weights),
        tokenizer: hex::encode(id.tokenizer),
        chat_template: hex::encode(id.chat_template),
        weight_precision: id.weight_precision.clone(),
        kv_layout: format!("{:?}", id.layout),
        context_policy: hex::encode(id.context_policy),
        engine_abi: id.engine_abi.clone(),
    }
}

/// What a node's proof covers in a hello answer.
pub fn hello_parts<'a>(consumer: &'a str, nonce: &'a str, facts_json: &'a [u8]) -> [&'a [u8]; 3] {
    [consumer.as_bytes(), nonce.as_bytes(), facts_json]
}

/// What a consumer's proof covers in a finish.
pub fn finish_parts<'a>(
    node: &'a str,
    consumer: &'a str,
    nonces: (&'a str, &'a str),
    public_key: &'a str,
    grant_json: &'a [u8],
) -> [&'a [u8]; 6] {
    [
        node.as_bytes(),
        consumer.as_bytes(),
        nonces.0.as_bytes(),
        nonces.1.as_bytes(),
        public_key.as_bytes(),
        grant_json,
    ]
}

struct Node {
    app: SharedState,
    enrollment: Enrollment,
    config_dir: PathBuf,
    /// The last hello: the consumer's name and nonce, and the nonce this node answered.
    pending: Mutex<Option<(String, String, String)>>,
    done: Notify,
}

fn refused(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, "enrollment_refused", e.to_string())
}

/// Serves enrollment on `listener` as node `name` until a consumer enrolled it; returns
/// what the node now runs with. `show_code` gets the one-time code (valid for `ttl`).
pub async fn enroll(
    app: &SharedState,
    name: &str,
    config_dir: &Path,
    listener: &TcpListener,
    ttl: Duration,
    show_code: impl FnOnce(&str),
) -> Result<EnrolledNode, String> {
    let node = Arc::new(Node {
        app: app.clone(),
        enrollment: Enrollment::new(name, ttl).map_err(|e| e.to_string())?,
        config_dir: config_dir.to_path_buf(),
        pending: Mutex::new(None),
        done: Notify::new(),
    });
    let tls = node.enrollment.server_config().map_err(|e| e.to_string())?;
    show_code(&node.enrollment.code_text());
    let router = Router::new()
        .route("/v1/enroll/hello", post(hello))
        .route("/v1/enroll/finish", post(finish))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(node.clone());
    enroll::serve_open(listener, tls, router, node.done.notified())
        .await
        .map_err(|e| format!("enrollment listener: {e}"))?;
    enroll::load_enrolled(config_dir, name)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "the enrollment did not complete".to_string())
}

/// Serves enrollment as the producer `setup` describes until a consumer enrolled it (the
/// code goes to `show_code` only); returns the state and setup to serve the lane with
/// (`server::serve_producer`): packs sealed with the provisioned operator key, the enrolling
/// consumer among those served. `muser up --role producer --enroll` runs this.
pub async fn enroll_producer(
    state: &SharedState,
    setup: &LaneSetup,
    listener: &TcpListener,
    ttl: Duration,
    show_code: impl FnOnce(&str),
) -> Result<(SharedState, LaneSetup), String> {
    let enrolled = enroll(
        state,
        &setup.node,
        &setup.config_dir,
        listener,
        ttl,
        show_code,
    )
    .await?;
    tracing::info!(
        consumers = %enrolled.consumers.join(", "),
        "enrolled: serving the lane with the issued certificate"
    );
    let state = with_operator_key(state, &enrolled.kv_key_file)?;
    let mut setup = setup.clone();
    if let LaneRole::Producer { consumers, .. } = &mut setup.role {
        consumers.extend(enrolled.consumers);
    }
    Ok((state, setup))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn hex_nonce(nonce: &str) -> Result<(), ApiError> {
    let mut raw = [0u8; 32];
    hex::decode_to_slice(nonce, &mut raw)
        .map_err(|_| ApiError::bad_request("a nonce is 64 hex digits"))
}

async fn hello(State(n): State<Arc<Node>>, body: Bytes) -> Result<Json<HelloAnswer>, ApiError> {
    n.enrollment.usable().map_err(refused)?;
    let req: EnrollHello = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("enrollment hello: {e}")))?;
    muser_cluster::check_name(&req.consumer).map_err(|e| ApiError::bad_request(e.to_string()))?;
    hex_nonce(&req.nonce)?;
    let ctx = n
        .app
        .kvpack
        .as_ref()
        .ok_or_else(|| ApiError::internal("no model identity"))?;
    let nonce = hex::encode(enroll::random::<32>().map_err(|e| ApiError::internal(e.to_string()))?);
    let facts = NodeFacts {
        node: n.enrollment.name().to_string(),
        protocol: PROTOCOL,
        muser_version: env!("CARGO_PKG_VERSION").to_string(),
        device: n.app.metrics.device.clone(),
        free_memory_bytes: free_memory_bytes(),
        free_disk_bytes: free_disk_bytes(&n.config_dir),
        time_unix_ms: unix_ms(),
        model: model_facts(&ctx.identity),
        public_key: hex::encode(n.enrollment.public_key()),
        nonce: nonce.clone(),
    };
    let json = serde_json::to_vec(&facts).map_err(|e| ApiError::internal(e.to_string()))?;
    let proof = n
        .enrollment
        .prove(&hello_parts(&req.consumer, &req.nonce, &json));
    *lock(&n.pending) = Some((req.consumer, req.nonce, nonce));
    Ok(Json(HelloAnswer {
        facts,
        proof: hex::encode(proof),
    }))
}

async fn finish(
    State(n): State<Arc<Node>>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    n.enrollment.usable().map_err(refused)?;
    let req: EnrollFinish = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("enrollment finish: {e}")))?;
    let (consumer, nonce_c, nonce_n) = lock(&n.pending)
        .clone()
        .filter(|(_, _, nn)| *nn == req.nonce)
        .ok_or_else(|| refused("no hello of this consumer is pending (say hello first)"))?;
    let mut proof = [0u8; 32];
    hex::decode_to_slice(&req.proof, &mut proof)
        .map_err(|_| ApiError::bad_request("a proof is 64 hex digits"))?;
    let grant_json =
        serde_json::to_vec(&req.grant).map_err(|e| ApiError::internal(e.to_string()))?;
    let public_key = hex::encode(n.enrollment.public_key());
    let parts = finish_parts(
        n.enrollment.name(),
        &consumer,
        (&nonce_c, &nonce_n),
        &public_key,
        &grant_json,
    );
    n.enrollment.accept(&parts, &proof).map_err(refused)?;
    let grant = check_grant(req.grant, &consumer)?;
    n.enrollment
        .save(&n.config_dir, &grant)
        .map_err(|e| ApiError::internal(format!("keeping the enrollment: {e}")))?;
    tracing::info!(node = n.enrollment.name(), consumer = %consumer, "enrolled");
    n.done.notify_one();
    Ok(Json(serde_json::json!({ "enrolled": n.enrollment.name() })))
}

/// A grant this node can run with: its certificate and key make a configuration, the
/// operator key parses, the consumer that proved itself is among the names served.
fn check_grant(g: GrantWire, consumer: &str) -> Result<Grant, ApiError> {
    let bad = |e: String| ApiError::bad_request(format!("enrollment grant: {e}"));
    muser_kvpack::parse_operator_key(g.kv_key.as_bytes()).map_err(|e| bad(e.to_string()))?;
    if !g.consumers.iter().any(|c| c == consumer) {
        return Err(bad(format!("it does not name the consumer `{consumer}`")));
    }
    Ok(Grant {
        cert_pem: g.cert,
        ca_pem: g.ca,
        crl_pem: g.crl,
        kv_key_hex: g.kv_key,
        consumers: g.consumers,
    })
}

/// The state an enrolled producer serves with: the same engine, its packs sealed with the
/// operator key the enrollment provisioned. A producer's routes take token ids, so it keeps
/// no chat template, sessions or lane of its own.
pub fn with_operator_key(app: &AppState, kv_key_file: &Path) -> Result<SharedState, String> {
    let old = app.kvpack.as_ref().ok_or("no kvpack context")?;
    let mut key = crate::kvkey::load_or_create(Some(kv_key_file))?;
    let keys = muser_kvpack::Keys::derive(&key);
    key.fill(0);
    let ctx = muser_engine::KvPackContext {
        hasher: muser_kvpack::PrefixHasher::new(&keys, &old.identity.digest(&keys)),
        identity: old.identity.clone(),
        limits: old.limits.clone(),
        keys,
    };
    Ok(Arc::new(AppState {
        engine: app.engine.clone(),
        lane: std::sync::OnceLock::new(),
        kvpack: Some(Arc::new(ctx)),
        vision: None,
        tokenizer: app.tokenizer.clone(),
        template: None,
        model: app.model.clone(),
        options: app.options.clone(),
        metrics: app.metrics.clone(),
        sessions: None,
        nodes: None,
        in_flight: app.in_flight.clone(),
        started_unix_s: app.started_unix_s,
    }))
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `MemAvailable` of /proc/meminfo (0 when unknown).
fn free_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Bytes free to this user on the file system of `dir` (or its nearest existing parent).
fn free_disk_bytes(dir: &Path) -> u64 {
    let Some(dir) = dir.ancestors().find(|d| d.exists()) else {
        return 0;
    };
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return 0;
    };
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and a struct the call fills
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return 0;
    }
    st.f_bavail as u64 * st.f_frsize as u64
}
