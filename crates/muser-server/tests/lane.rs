//! The consumer's side of the prefill lane against a real producer (SmolLM2, in process, over
//! mutual TLS on loopback) whose answers a hostile layer can alter: a tampered byte, a body cut
//! short (a producer dying mid-stream), a replayed pack, a stalled body (deadline) and a
//! producer sealing with another operator key are each refused with a clear error, and the
//! consumer keeps serving the same greedy tokens afterwards; a delta after a shared prefix
//! carries only the new blocks.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use muser_cluster::{Endpoint, Pki};
use muser_server::lane::{ConsumerConfig, LaneRole, LaneSetup, PrefillMode};
use muser_server::metrics::Lane;
use muser_server::producer::Producer;
use muser_server::routes::router;
use muser_server::server::{load, ServeConfig};
use muser_server::state::SharedState;
use serde_json::{json, Value};
use tower::ServiceExt;

mod common;
use common::smollm2_path as model_path;

#[derive(Clone)]
enum Mode {
    Pass,
    /// Flip one bit at this offset of the pack.
    Tamper(usize),
    /// Send only this many bytes, then end the body.
    Cut(usize),
    /// Send the first pack this producer ever sent.
    Replay,
    /// Send a little, then nothing, forever.
    Stall,
}

#[derive(Default)]
struct Hostile {
    mode: Mutex<Option<Mode>>,
    first: Mutex<Option<Vec<u8>>>,
}

async fn hostile(State(h): State<Arc<Hostile>>, req: Request, next: Next) -> Response {
    let prefill = req.uri().path() == "/v1/prefill";
    let resp = next.run(req).await;
    if !prefill || !resp.status().is_success() {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let mut bytes = to_bytes(body, 1 << 30).await.unwrap().to_vec();
    h.first.lock().unwrap().get_or_insert_with(|| bytes.clone());
    let mode = h.mode.lock().unwrap().clone().unwrap_or(Mode::Pass);
    let body = match mode {
        Mode::Pass => Body::from(bytes),
        Mode::Tamper(at) => {
            bytes[at] ^= 0x10;
            Body::from(bytes)
        }
        Mode::Cut(n) => Body::from(bytes[..n].to_vec()),
        Mode::Replay => Body::from(h.first.lock().unwrap().clone().unwrap()),
        Mode::Stall => {
            let head = bytes[..1000].to_vec();
            Body::from_stream(futures::stream::unfold(Some(head), |s| async move {
                match s {
                    Some(b) => Some((Ok::<_, std::io::Error>(b), None)),
                    None => futures::future::pending().await,
                }
            }))
        }
    };
    Response::from_parts(parts, body)
}

fn setup(dir: &Path, node: &str, role: LaneRole) -> LaneSetup {
    LaneSetup {
        config_dir: dir.join("cfg"),
        node: node.into(),
        role,
        listen: None,
    }
}

fn config(dir: &Path, key: &str, lane: LaneSetup) -> ServeConfig {
    let mut cfg = ServeConfig::new(model_path());
    cfg.n_slots = 1;
    cfg.n_ctx = 1024;
    cfg.threads = 2;
    cfg.kv_key_file = Some(dir.join(key));
    cfg.lane = Some(lane);
    cfg
}

/// A producer named `name` sealing with key file `key`, behind the hostile layer; its port
/// and its engine's state.
async fn producer(dir: &Path, name: &str, key: &str, h: Arc<Hostile>) -> (u16, SharedState) {
    let role = LaneRole::Producer {
        consumers: vec!["cons".into()],
        max_queue: 4,
        fault: None,
    };
    let s = setup(dir, name, role);
    let state = load(&config(dir, key, s.clone())).unwrap();
    let p = Producer::new(state.clone(), name, 4, None).unwrap();
    let app = p
        .router()
        .layer(axum::middleware::from_fn_with_state(h, hostile));
    let creds = Pki::at(&s.config_dir).node(name).unwrap();
    let tls = muser_cluster::server_config(&creds).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(muser_cluster::serve(
        listener,
        tls,
        Arc::from(vec!["cons".to_string()]),
        app,
        std::future::pending(),
    ));
    (port, state)
}

/// The K/V bytes of positions `0..n` of slot 0.
async fn slot_kv(state: &SharedState, n: u32) -> Vec<(Vec<u8>, Vec<u8>)> {
    let engine = state.engine.clone();
    tokio::task::spawn_blocking(move || {
        engine
            .with_slot(0, move |s| s.kv.export(s.seq, 0..n).unwrap())
            .unwrap()
    })
    .await
    .unwrap()
    .layers
    .into_iter()
    .map(|l| (l.k, l.v))
    .collect()
}

/// Runs `prompt` on a consumer whose slot was emptied first (so the lane is asked).
async fn complete(app: &axum::Router, prompt: &str) -> (u16, Value) {
    let erase = axum::http::Request::post("/slots/0?action=erase")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::empty())
        .unwrap();
    assert!(app
        .clone()
        .oneshot(erase)
        .await
        .unwrap()
        .status()
        .is_success());
    complete_on(app, prompt).await
}

/// Runs `prompt` on a consumer as it is.
async fn complete_on(app: &axum::Router, prompt: &str) -> (u16, Value) {
    let req = axum::http::Request::post("/completion")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(
            json!({"prompt": prompt, "n_predict": 6, "temperature": 0, "return_tokens": true})
                .to_string(),
        ))
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status().as_u16();
    let v = serde_json::from_slice(&to_bytes(res.into_body(), 1 << 20).await.unwrap()).unwrap();
    (status, v)
}

fn prompt(lines: std::ops::Range<usize>) -> String {
    lines
        .map(|i| {
            format!(
                "Entry {i}: the courier left {} parcels at the mill. ",
                i * 3 + 1
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_answer_is_refused_and_the_consumer_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("kv.key"), [7u8; 32]).unwrap();
    std::fs::write(d.join("other.key"), [9u8; 32]).unwrap();
    let pki = Pki::at(&d.join("cfg"));
    pki.init().unwrap();
    let now = time::OffsetDateTime::now_utc() - time::Duration::minutes(1);
    for n in ["prod", "rogue", "cons"] {
        pki.issue(n, now, 1).unwrap();
    }
    let h = Arc::new(Hostile::default());
    let (port, prod) = producer(d, "prod", "kv.key", h.clone()).await;
    let (rogue, _) = producer(d, "rogue", "other.key", Arc::new(Hostile::default())).await;
    let consumer = |mode| {
        let c = ConsumerConfig {
            mode,
            producers: vec![Endpoint::parse(&format!("prod=https://127.0.0.1:{port}")).unwrap()],
            min_tokens: Some(1),
            deadline: Duration::from_secs(15),
            accept_abis: vec![],
            migrate_to: vec![],
        };
        config(d, "kv.key", setup(d, "cons", LaneRole::Consumer(c)))
    };
    let state = load(&consumer(PrefillMode::Remote)).unwrap();
    let lane = state.lane.get().cloned().unwrap();
    lane.refresh().await;
    let app = router(state.clone());

    // about 650 tokens: the producer computes the first 512-token chunk, the consumer the rest
    let base = prompt(0..40);
    let (s, first) = complete(&app, &base).await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(first["timings"]["prefill_lane"], "remote");
    assert_eq!(first["timings"]["producer"], "prod");
    // its timings land in the remote lane's histograms, not the local one's
    let lane_ttft = |l: Lane| state.metrics.lane(l).ttft_s.count();
    assert_eq!(
        (lane_ttft(Lane::Local), lane_ttft(Lane::Remote) > 0),
        (0, true)
    );
    let tokens = first["tokens"].clone();
    // the handoff is lossless: the consumer holds the producer's K/V byte for byte
    assert_eq!(slot_kv(&state, 512).await, slot_kv(&prod, 512).await);

    // a prompt sharing its first block with the last: only the blocks past it move
    let other = format!("{}{}", prompt(0..18), prompt(100..124));
    let (s, v) = complete_on(&app, &other).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["timings"]["prefill_lane"], "remote");
    let props = lane.props();
    let last = &props["producers"][0]["last_handoff"];
    assert_eq!(last["from_token"], 256, "{props}");
    assert_eq!(last["tokens"], 512, "{props}");

    let check = |what: &'static str, mode: Mode, want: &'static str| {
        let (h, app, tokens) = (h.clone(), app.clone(), tokens.clone());
        let base = base.clone();
        async move {
            *h.mode.lock().unwrap() = Some(mode);
            let (s, v) = complete(&app, &base).await;
            assert_eq!(s, 503, "{what}: {v}");
            let msg = v["error"]["message"].as_str().unwrap().to_string();
            assert!(msg.contains(want), "{what}: {msg}");
            *h.mode.lock().unwrap() = Some(Mode::Pass);
            // the consumer still serves, from the producer, the same tokens
            tokio::time::sleep(Duration::from_millis(10)).await;
            let (s, v) = complete(&app, &base).await;
            assert_eq!((s, &v["tokens"]), (200, &tokens), "{what}: after: {v}");
        }
    };
    check("tampered byte", Mode::Tamper(300_000), "pack refused").await;
    check("tampered manifest", Mode::Tamper(200), "pack refused").await;
    check("cut mid-stream", Mode::Cut(100_000), "truncated").await;
    check("replayed pack", Mode::Replay, "replayed or stale").await;
    check("stalled body", Mode::Stall, "deadline").await;

    // a producer sealing with another operator key
    let c = ConsumerConfig {
        mode: PrefillMode::Auto,
        producers: vec![Endpoint::parse(&format!("rogue=https://127.0.0.1:{rogue}")).unwrap()],
        min_tokens: Some(1),
        deadline: Duration::from_secs(30),
        accept_abis: vec![],
        migrate_to: vec![],
    };
    drop(app);
    let state = load(&config(
        d,
        "kv.key",
        setup(d, "cons", LaneRole::Consumer(c)),
    ))
    .unwrap();
    state.lane.get().unwrap().refresh().await;
    let auto = router(state.clone());
    let (s, v) = complete(&auto, &base).await;
    // auto falls back to a local prefill: same tokens, computed here
    assert_eq!((s, &v["tokens"]), (200, &tokens), "{v}");
    assert_eq!(v["timings"]["prefill_lane"], "local");
    let props = state.lane.get().unwrap().props();
    let err = props["producers"][0]["last_error"].as_str().unwrap();
    assert!(err.contains("seal"), "{err}");

    // a restarted consumer continues its stream above the ledger's high-water mark: the
    // producer's next pack is accepted, the first one it ever sent is not
    let app = router(load(&consumer(PrefillMode::Remote)).unwrap());
    let (s, v) = complete(&app, &base).await;
    assert_eq!((s, &v["tokens"]), (200, &tokens), "{v}");
    *h.mode.lock().unwrap() = Some(Mode::Replay);
    let (s, v) = complete(&app, &base).await;
    assert_eq!(s, 503, "{v}");
}
