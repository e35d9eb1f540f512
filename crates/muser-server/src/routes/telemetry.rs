//! `GET /v1/telemetry` (one JSON snapshot) and `GET /v1/telemetry/stream` (the snapshot
//! every second as server-sent events, `event: snapshot`).
//!
//! Every number is an object `{"value", "unit", "tag"}`. The tag says where it comes from:
//! `measured` (observed by this process; an idle zero is still measured), `target` (a
//! configured or published goal) or `mock` (demonstration data). This server reports only
//! what it measures: a number it cannot measure (a percentile before the first sample, the
//! prompt cache when it is off, a lane that has served nothing) is absent, never invented,
//! and `mock` never appears next to `measured`.

use crate::metrics::{Gauges, Histogram, Lane, RATE_WINDOW_S};
use crate::routes::sse_response;
use crate::state::SharedState;
use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::time::Duration;

pub const SCHEMA: &str = "muser.telemetry.v1";
/// Seconds between two frames of the stream.
const STREAM_PERIOD: Duration = Duration::from_secs(1);

/// A measured value.
fn measured(value: impl Into<Value>, unit: &str) -> Value {
    json!({ "value": value.into(), "unit": unit, "tag": "measured" })
}

/// What the engine and the prompt cache report now.
pub fn gauges(state: &SharedState) -> Gauges {
    Gauges {
        engine: state.engine.stats(),
        n_slots: state.options.n_slots,
        kv_capacity_tokens: state.options.n_slots * state.options.n_ctx,
        prompt_cache: state
            .engine
            .config()
            .prompt_cache
            .as_ref()
            .map(|pc| pc.stats()),
        producers: state.lane.get().map_or_else(Vec::new, |l| l.health()),
    }
}

/// p50 / p95 / count of a histogram in `unit` (`scale` converts from its own unit); the
/// percentiles are absent before the first sample.
fn distribution(h: &Histogram, unit: &str, scale: f64) -> Value {
    let mut m = Map::new();
    m.insert("count".into(), measured(h.count(), "requests"));
    for (name, q) in [("p50", 0.5), ("p95", 0.95)] {
        if let Some(v) = h.quantile(q) {
            m.insert(name.into(), measured(v * scale, unit));
        }
    }
    Value::Object(m)
}

pub fn snapshot(state: &SharedState) -> Value {
    let m = &state.metrics;
    let g = gauges(state);
    let e = &g.engine;
    let mut lanes = Map::new();
    for lane in Lane::ALL {
        let l = m.lane(lane);
        if lane != Lane::Local && l.ttft_s.count() == 0 {
            continue;
        }
        lanes.insert(
            lane.label().into(),
            json!({
                "device": m.device,
                "ttft_ms": distribution(&l.ttft_s, "ms", 1e3),
                "itl_ms": distribution(&l.itl_s, "ms", 1e3),
                "queue_wait_ms": distribution(&l.queue_wait_s, "ms", 1e3),
                "prefill_tok_s": distribution(&l.prefill_tok_s, "tok/s", 1.0),
                "decode_tok_s": distribution(&l.decode_tok_s, "tok/s", 1.0),
            }),
        );
    }
    let slots: Vec<Value> = state
        .engine
        .slots()
        .iter()
        .map(|s| {
            json!({
                "id": s.id,
                "busy": s.busy,
                "n_ctx": s.n_ctx,
                "n_cached": measured(s.n_cached, "tokens"),
                "n_prompt": measured(s.n_prompt, "tokens"),
                "n_gen": measured(s.n_gen, "tokens"),
            })
        })
        .collect();
    let prompt_seen = e.prompt_tokens_total + e.cached_tokens_total;
    let mut cache = Map::new();
    cache.insert(
        "cached_tokens_total".into(),
        measured(e.cached_tokens_total, "tokens"),
    );
    if prompt_seen > 0 {
        cache.insert(
            "token_hit_rate".into(),
            measured(e.cached_tokens_total as f64 / prompt_seen as f64, "ratio"),
        );
    }
    if let Some(pc) = &g.prompt_cache {
        let requests = e.requests_total.max(1);
        cache.insert(
            "store".into(),
            json!({
                "hits_memory": measured(pc.hits_memory, "requests"),
                "hits_disk": measured(pc.hits_disk, "requests"),
                "hit_rate": measured((pc.hits_memory + pc.hits_disk) as f64 / requests as f64, "ratio"),
                "tokens_resumed": measured(pc.tokens_resumed, "tokens"),
                "memory_bytes": measured(pc.memory_bytes, "bytes"),
                "disk_bytes": measured(pc.disk_bytes, "bytes"),
                "disk_packs": measured(pc.disk_packs, "packs"),
            }),
        );
    }
    let mut out = json!({
        "schema": SCHEMA,
        "generated_at": crate::routes::unix_now(),
        "uptime_s": measured(m.uptime().as_secs_f64(), "s"),
        "model": { "id": state.model.id, "arch": state.model.arch, "device": m.device },
        // what this server offers; the dashboard asks only for what is here
        "features": { "sessions": state.sessions.is_some(), "node_registry": state.nodes.is_some() },
        "throughput": {
            "tokens_per_second": measured(m.tokens_per_second(), "tok/s"),
            "window_s": RATE_WINDOW_S,
            "generated_tokens_total": measured(m.generated_tokens(), "tokens"),
            "prompt_tokens_total": measured(m.prompt_tokens(), "tokens"),
            "requests_total": measured(e.requests_total, "requests"),
        },
        "lanes": lanes,
        "slots": {
            "total": measured(g.n_slots, "slots"),
            "busy": measured(e.busy_slots, "slots"),
            "list": slots,
        },
        "queue": {
            "depth": measured(e.queue_depth, "requests"),
            "rejected_total": measured(m.rejected_busy(), "requests"),
        },
        "kv": {
            "tokens": measured(e.kv_tokens, "tokens"),
            "capacity_tokens": measured(g.kv_capacity_tokens, "tokens"),
            "occupancy": measured(e.kv_tokens as f64 / g.kv_capacity_tokens.max(1) as f64, "ratio"),
        },
        "prompt_cache": cache,
    });
    // speculative decoding's acceptance, once something was drafted
    if let Some(acceptance) = e.draft_acceptance() {
        out["speculative"] = json!({
            "drafted_total": measured(e.draft_tokens_total, "tokens"),
            "accepted_total": measured(e.draft_accepted_total, "tokens"),
            "acceptance": measured(acceptance, "ratio"),
        });
    }
    if let Some(n) = crate::routes::sessions::count(state) {
        out["sessions"] = json!({ "count": measured(n, "sessions") });
    }
    out
}

pub async fn get(State(state): State<SharedState>) -> axum::Json<Value> {
    axum::Json(snapshot(&state))
}

/// One `snapshot` event per second until the client goes away.
pub async fn stream(State(state): State<SharedState>) -> Response {
    let frames = futures::stream::unfold((state, 0u64), |(state, seq)| async move {
        if seq > 0 {
            tokio::time::sleep(STREAM_PERIOD).await;
        }
        let st = state.clone();
        let data = tokio::task::spawn_blocking(move || snapshot(&st))
            .await
            .unwrap_or(Value::Null);
        let frame = format!("event: snapshot\nid: {seq}\ndata: {data}\n\n");
        Some((Ok::<_, Infallible>(frame), (state, seq + 1)))
    });
    sse_response(Body::from_stream(frames))
}
