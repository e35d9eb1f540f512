//! The consumer's side of the disaggregated prefill lane.
//!
//! With `--prefill remote|auto` and one or more `--producer NAME=https://HOST:PORT`, a prompt
//! long enough to pay is prefilled on a producer: the consumer sends the tokens of every
//! prefill chunk but the last (which it computes itself, as a local prefill would, so the
//! greedy tokens equal a local prefill's) over mutual TLS, the producer answers with a sealed
//! kvpack pack as the response body, and the consumer verifies it segment by segment as it
//! arrives ([`StreamRestore`]) into a staging state that the engine installs on a slot only
//! after the last check. Decode always runs here.
//!
//! Checks on every pack, besides the pack's own (seal under the operator key, Merkle root,
//! every segment's SHA-256): the identity equals this engine's in every field but
//! `engine_abi`, which must be this engine's or one of `--accept-abi`; the prefix id equals
//! the one of the tokens sent; the replay stream is this consumer–producer pair's and the
//! generation the one asked for, above the ledger's high-water mark (kept on disk across
//! restarts); the body is no larger than the K/V of the tokens sent, and arrives before the
//! deadline. `auto` falls back to a local prefill on any failure and logs why; `remote`
//! fails the request when every producer failed.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use bytes::Bytes;
use http_body_util::Full;
use muser_cluster::registry::FailureLog;
use muser_cluster::supervise::{NodeHealth, Supervision};
use muser_cluster::transport::next_chunk;
use muser_cluster::{Endpoint, LaneClient, NodeCreds};
use muser_engine::{Engine, KvPackContext, Prefilled};
use muser_kvpack::{
    field_digest, Assembly, BlockId, Digest32, Expect, KvState, Ledger, Manifest, PackKind,
    PrefixHasher, ReadLimits, StreamRestore, BLOCK_TOKENS,
};
use tokio::sync::mpsc;

mod plan;

pub use plan::{measure_prefill, pieces, synthetic_prompt, threshold};
use plan::{DEFAULT_MIN_TOKENS, DEFAULT_PAYLOAD_B_S};

use crate::error::ApiError;
use crate::wire::lane::{LaneStatus, PrefillRequest};

/// Where a prompt's prefill runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillMode {
    Local,
    Remote,
    Auto,
}

impl PrefillMode {
    pub fn name(self) -> &'static str {
        match self {
            PrefillMode::Local => "local",
            PrefillMode::Remote => "remote",
            PrefillMode::Auto => "auto",
        }
    }
}

/// A consumer's lane settings (`muser up --prefill ...`).
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    pub mode: PrefillMode,
    pub producers: Vec<Endpoint>,
    /// `auto` sends prompts of at least this many tokens to a producer (`None`: measured,
    /// see [`Lane::min_tokens`]).
    pub min_tokens: Option<usize>,
    /// Longest a remote prefill may take, from the request to the last byte of the pack.
    pub deadline: Duration,
    /// Engine ABIs accepted besides this engine's own (producers with other numerics).
    pub accept_abis: Vec<String>,
    /// Nodes this one may move sessions to (`--migrate-to NAME=https://HOST:PORT`).
    pub migrate_to: Vec<Endpoint>,
}

/// A node's place on the lane (`muser up --role ...`).
#[derive(Clone, Debug)]
pub struct LaneSetup {
    /// Holds `tls/` (the CA and node certificates) and `lane/` (the consumer's ledger).
    pub config_dir: PathBuf,
    /// This node's certificate name.
    pub node: String,
    pub role: LaneRole,
    /// A consumer's own lane listener (`--lane-port`): sessions migrated in from the
    /// `peers`, over mutual TLS.
    pub listen: Option<LaneListen>,
}

/// A consumer's lane endpoint: the port, and the node names allowed to connect.
#[derive(Clone, Debug)]
pub struct LaneListen {
    pub port: u16,
    pub peers: Vec<String>,
}

#[derive(Clone, Debug)]
pub enum LaneRole {
    /// Serves prefills to the enrolled `consumers`; at most `max_queue` wait beyond the
    /// slots; `fault` is for tests only (`producer::KvFault`).
    Producer {
        consumers: Vec<String>,
        max_queue: usize,
        fault: Option<crate::producer::KvFault>,
    },
    Consumer(ConsumerConfig),
}

/// Longest status or error body read from a producer.
const MAX_SMALL_BODY: usize = 64 << 10;

/// What the consumer knows of one producer.
pub struct Producer {
    pub ep: Endpoint,
    /// The replay stream of this consumer–producer pair.
    stream: Digest32,
    /// Last generation handed out (starts at the ledger's high-water mark).
    generation: AtomicU64,
    /// Last reported queue depth plus this consumer's requests in flight.
    queue_depth: AtomicU64,
    in_flight: AtomicU64,
    health: Mutex<Health>,
}

#[derive(Clone)]
struct Health {
    /// Healthy, degraded or down, from probes and prefills (`muser_cluster::supervise`).
    sup: Supervision,
    last_error: Option<String>,
    engine_abi: Option<String>,
    prefill_tok_s: f64,
    /// The producer's prefill chunk (0: not reported yet).
    prefill_chunk: usize,
    last_handoff: Option<Handoff>,
}

/// The last pack installed from a producer.
#[derive(Clone, Copy)]
struct Handoff {
    /// Tokens covered, and the first one the pack carried (above 0 for a delta).
    tokens: usize,
    from: u32,
    /// K/V bytes received, and the time from request to verified state.
    bytes: u64,
    ms: f64,
    phases: Phases,
}

/// The consumer's lane: producers, client, ledger.
pub struct Lane {
    pub mode: PrefillMode,
    /// `--remote-min-tokens`, when given.
    min_tokens: Option<usize>,
    /// This engine's own prefill rate (prompt tokens per second, f64 bits; 0: not measured).
    local_tok_s: AtomicU64,
    /// Whether the measurement of `local_tok_s` has been started.
    measure_claimed: AtomicBool,
    /// This engine's prefill chunk.
    chunk: usize,
    deadline: Duration,
    accept_abis: Vec<String>,
    client: LaneClient,
    /// Grows while the lane runs: a node enrolled since joins it ([`Lane::join`]).
    producers: RwLock<Vec<Arc<Producer>>>,
    migrate_to: Vec<Endpoint>,
    ctx: Arc<KvPackContext>,
    ledger: Arc<Mutex<Ledger>>,
    ledger_path: PathBuf,
    /// This consumer's certificate name (one end of every replay stream).
    consumer: String,
    /// Where producers' failures are kept (`muser_cluster::registry::FailureLog`).
    config_dir: PathBuf,
    n_ctx: usize,
}

/// The replay stream of packs sent by `producer` to `consumer`.
pub fn stream_id(consumer: &str, producer: &str) -> Digest32 {
    field_digest("lane stream", format!("{consumer}\0{producer}").as_bytes())
}

/// The consumer's ledger file in the configuration directory.
pub fn ledger_path(config_dir: &Path, node: &str) -> PathBuf {
    config_dir.join("lane").join(format!("{node}.ledger"))
}

fn lane_err(status: StatusCode, msg: String) -> ApiError {
    ApiError::new(status, "prefill_lane_error", msg)
}

impl Lane {
    /// The lane of consumer `creds.name`, its ledger under `config_dir`.
    pub fn open(
        cfg: &ConsumerConfig,
        creds: &NodeCreds,
        config_dir: &Path,
        ctx: Arc<KvPackContext>,
        n_ctx: usize,
        chunk: usize,
    ) -> Result<Lane, String> {
        if cfg.mode != PrefillMode::Local && cfg.producers.is_empty() {
            return Err(format!(
                "--prefill {} needs at least one --producer NAME=https://HOST:PORT",
                cfg.mode.name()
            ));
        }
        let tls = muser_cluster::client_config(creds).map_err(|e| e.to_string())?;
        let path = ledger_path(config_dir, &creds.name);
        if let Some(dir) = path.parent() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let ledger = Ledger::open(&path, &ctx.keys)
            .map_err(|e| format!("lane ledger {}: {e}", path.display()))?;
        let lane = Lane {
            mode: cfg.mode,
            min_tokens: cfg.min_tokens,
            local_tok_s: AtomicU64::new(0f64.to_bits()),
            measure_claimed: AtomicBool::new(false),
            chunk,
            deadline: cfg.deadline,
            accept_abis: cfg.accept_abis.clone(),
            client: LaneClient::new(tls),
            producers: RwLock::new(Vec::new()),
            migrate_to: cfg.migrate_to.clone(),
            ctx,
            ledger: Arc::new(Mutex::new(ledger)),
            ledger_path: path,
            consumer: creds.name.clone(),
            config_dir: config_dir.to_path_buf(),
            n_ctx,
        };
        for ep in &cfg.producers {
            lane.join(ep)?;
        }
        Ok(lane)
    }

    /// Adds producer `ep` to the running lane (a node enrolled since it opened), or renews
    /// one that was removed or moved; whether the lane changed. Its replay generations start
    /// above the ledger's mark as this process holds it and as it is on disk now (an
    /// enrollment in another process may have recorded the pair's stream since).
    pub fn join(&self, ep: &Endpoint) -> Result<bool, String> {
        let current = self.producers().into_iter().find(|p| p.ep.name == ep.name);
        if current.is_some_and(|p| p.ep == *ep && !health(&p).sup.is_retired()) {
            return Ok(false);
        }
        let stream = stream_id(&self.consumer, &ep.name);
        let on_disk = Ledger::open(&self.ledger_path, &self.ctx.keys)
            .map_err(|e| format!("lane ledger {}: {e}", self.ledger_path.display()))?
            .high_water(&stream);
        let mut ledger = lock(&self.ledger);
        if let Some(g) = on_disk.filter(|&g| ledger.admit(&stream, g).is_ok()) {
            ledger
                .record(stream, g)
                .map_err(|e| format!("lane ledger: {e}"))?;
        }
        let producer = Arc::new(Producer {
            generation: AtomicU64::new(ledger.high_water(&stream).unwrap_or(0)),
            stream,
            ep: ep.clone(),
            queue_depth: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            health: Mutex::new(Health {
                sup: Supervision::new(Instant::now()),
                last_error: None,
                engine_abi: None,
                prefill_tok_s: 0.0,
                prefill_chunk: 0,
                last_handoff: None,
            }),
        });
        drop(ledger);
        let mut producers = self.producers.write().unwrap_or_else(|e| e.into_inner());
        producers.retain(|p| p.ep.name != ep.name);
        producers.push(producer);
        Ok(true)
    }

    /// The producers now (a snapshot: one may join while a request runs).
    fn producers(&self) -> Vec<Arc<Producer>> {
        self.producers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The node `name` of `--migrate-to`, and the client that reaches it.
    pub fn migration_target(&self, name: &str) -> Option<(&Endpoint, &LaneClient)> {
        let ep = self.migrate_to.iter().find(|e| e.name == name)?;
        Some((ep, &self.client))
    }

    /// The engine ABIs this consumer accepts: its own, then the configured others.
    pub fn accepted_abis(&self) -> Vec<String> {
        std::iter::once(self.ctx.identity.engine_abi.clone())
            .chain(self.accept_abis.iter().cloned())
            .collect()
    }

    /// `/props`' view of the lane.
    pub fn props(&self) -> serde_json::Value {
        let producers: Vec<_> = self
            .producers()
            .iter()
            .map(|p| {
                let h = health(p);
                serde_json::json!({
                    "name": p.ep.name,
                    "url": p.ep.to_string().split_once('=').map(|(_, u)| u.to_string()),
                    "healthy": h.sup.state() == NodeHealth::Healthy,
                    "health": h.sup.state().name(),
                    "engine_abi": h.engine_abi,
                    "queue_depth": p.queue_depth.load(Ordering::Relaxed),
                    "prefill_tok_s": h.prefill_tok_s,
                    "prefill_chunk": h.prefill_chunk,
                    "last_error": h.last_error,
                    "last_handoff": h.last_handoff.map(|l| serde_json::json!({
                        "tokens": l.tokens,
                        "from_token": l.from,
                        "kv_bytes": l.bytes,
                        "ms": l.ms,
                        "producer_prefill_ms": l.phases.producer_prefill_ms,
                        "producer_export_ms": l.phases.producer_export_ms,
                        "producer_seal_ms": l.phases.producer_seal_ms,
                        "head_ms": l.phases.head_ms,
                        "body_ms": l.phases.body_ms,
                        "verify_ms": l.phases.verify_ms,
                        "last_seal_ms": l.phases.last_seal_ms,
                        "join_ms": l.phases.join_ms,
                        "pieces": l.phases.pieces,
                        "gb_per_s": if l.ms > 0.0 { l.bytes as f64 / l.ms / 1e6 } else { 0.0 },
                    })),
                })
            })
            .collect();
        serde_json::json!({
            "mode": self.mode.name(),
            "remote_min_tokens": self.min_tokens().0,
            "remote_min_tokens_from": self.min_tokens().1,
            "local_prefill_tok_s": self.local_tok_s(),
            "deadline_ms": self.deadline.as_millis() as u64,
            "engine_abi": self.ctx.identity.engine_abi,
            "accepted_abis": self.accepted_abis(),
            "producers": producers,
        })
    }

    fn local_tok_s(&self) -> f64 {
        f64::from_bits(self.local_tok_s.load(Ordering::Relaxed))
    }

    /// Whether `auto` measures its threshold (no `--remote-min-tokens`).
    pub fn measures(&self) -> bool {
        self.mode == PrefillMode::Auto && self.min_tokens.is_none()
    }

    /// True once: for the caller that starts measuring this engine's prefill rate.
    pub fn claim_measurement(&self) -> bool {
        !self.measure_claimed.swap(true, Ordering::Relaxed)
    }

    /// Records this engine's prefill rate, measured at start-up ([`measure_prefill`]).
    pub fn set_local_rate(&self, tok_s: f64) {
        self.local_tok_s.store(tok_s.to_bits(), Ordering::Relaxed);
    }

    /// The shortest prompt `auto` sends to a producer, and where the number comes from:
    /// `configured` (`--remote-min-tokens`), `measured`, or `default` (a rate not known
    /// yet). Measured: a prompt of n tokens pays remotely when n / local rate exceeds
    /// n / producer rate + n × K/V bytes per token / payload rate + a fixed cost per
    /// handoff ([`threshold`]'s fixed cost); the producer is the first one a prefill would try,
    /// its payload rate the one of its last handoff ([`DEFAULT_PAYLOAD_B_S`] before one).
    /// When the producer is not faster than this engine by more than the transfer costs,
    /// `auto` never sends (usize::MAX).
    pub fn min_tokens(&self) -> (usize, &'static str) {
        if let Some(n) = self.min_tokens {
            return (n, "configured");
        }
        let local = self.local_tok_s();
        let Some(p) = self.order().into_iter().next() else {
            return (DEFAULT_MIN_TOKENS, "default");
        };
        let h = health(&p);
        if local <= 0.0 || h.prefill_tok_s <= 0.0 {
            return (DEFAULT_MIN_TOKENS, "default");
        }
        let layout = &self.ctx.identity.layout;
        let kv_per_token = layout.row_bytes() as f64 * 2.0 * f64::from(layout.n_layer);
        let payload = h
            .last_handoff
            .filter(|l| l.ms > 0.0 && l.bytes > 0)
            .map_or(DEFAULT_PAYLOAD_B_S, |l| l.bytes as f64 / (l.ms / 1e3));
        (
            threshold(local, h.prefill_tok_s, kv_per_token / payload, self.chunk),
            "measured",
        )
    }

    /// Asks every producer whose probe is due for its status (queue depth, prefill rate,
    /// engine ABI); an answer heals it, a failure degrades it and backs its probes off.
    pub async fn refresh(&self) {
        for p in &self.producers() {
            if !health(p).sup.due(Instant::now()) {
                continue;
            }
            match self.status(p).await {
                Ok(s) => {
                    p.queue_depth.store(s.queue_depth, Ordering::Relaxed);
                    let mut h = lock(&p.health);
                    h.engine_abi = Some(s.engine_abi);
                    h.prefill_tok_s = s.prefill_tok_s;
                    h.prefill_chunk = s.prefill_chunk as usize;
                    drop(h);
                    self.record(p, Ok(()));
                }
                Err(e) => self.record(p, Err(("probe", e.as_str()))),
            }
        }
    }

    /// Stops routing to producer `name` at once (it was removed from the registry); whether
    /// this lane had it.
    pub fn retire(&self, name: &str) -> bool {
        let Some(p) = self.producers().into_iter().find(|p| p.ep.name == name) else {
            return false;
        };
        let change = lock(&p.health).sup.retire();
        if let Some((from, to)) = change {
            tracing::warn!(
                producer = name,
                from = from.name(),
                to = to.name(),
                "prefill lane: producer removed"
            );
        }
        true
    }

    /// Each producer's name, health and count of health changes (for `/metrics`).
    pub fn health(&self) -> Vec<(String, NodeHealth, u64)> {
        self.producers()
            .iter()
            .map(|p| {
                let h = health(p);
                (p.ep.name.clone(), h.sup.state(), h.sup.changes)
            })
            .collect()
    }

    async fn status(&self, p: &Producer) -> Result<LaneStatus, String> {
        probe(&self.client, &p.ep, Duration::from_secs(5)).await
    }

    /// Producers in the order to try: healthy ones, then degraded ones, each group by
    /// shortest queue; producers that are down are not tried (their probes bring them back).
    fn order(&self) -> Vec<Arc<Producer>> {
        let mut ps: Vec<(Arc<Producer>, NodeHealth)> = self
            .producers()
            .into_iter()
            .map(|p| {
                let h = health(&p).sup.state();
                (p, h)
            })
            .filter(|(_, h)| *h != NodeHealth::Down)
            .collect();
        ps.sort_by_key(|(p, h)| {
            let q = p.queue_depth.load(Ordering::Relaxed) + p.in_flight.load(Ordering::Relaxed);
            (*h != NodeHealth::Healthy, q)
        });
        ps.into_iter().map(|(p, _)| p).collect()
    }

    /// The prefill of `prompt` from a producer, when this lane sends it to one: `Ok(None)`
    /// means compute it here (local mode, a short prompt, or an `auto` fallback).
    pub async fn prefill(
        &self,
        engine: &Arc<Engine>,
        prompt: &[u32],
    ) -> Result<Option<Prefilled>, ApiError> {
        // A producer of this engine's ABI computes the prompt's chunks before the last one,
        // this engine the last chunk, exactly as its own prefill would: the numerics depend
        // on the batch shape, so this split gives the tokens a local prefill gives. A producer
        // of another accepted ABI computes all but the last token: its K/V already differs
        // from this engine's by its numerics, and the consumer (a slower host, typically)
        // then computes one token instead of up to a chunk.
        let chunk = self.chunk;
        let own_split = (prompt.len().saturating_sub(1) / chunk) * chunk;
        let foreign_split = prompt.len().saturating_sub(1);
        let wanted = match self.mode {
            PrefillMode::Local => false,
            PrefillMode::Remote => foreign_split > 0,
            PrefillMode::Auto => foreign_split > 0 && prompt.len() >= self.min_tokens().0,
        };
        if !wanted {
            return Ok(None);
        }
        let held_all = held_prefix(engine, &prompt[..foreign_split]).await;
        let mut failures = Vec::new();
        for p in &self.order() {
            let own = self.abi_is_own(p) != Some(false);
            let theirs = health(p).prefill_chunk;
            if own && theirs != 0 && theirs != chunk {
                failures.push(format!(
                    "{}: its prefill chunk is {theirs} tokens, this engine's {chunk}: its K/V \
                     would not equal a local prefill's (give both the same --prefill-chunk)",
                    p.ep.name
                ));
                continue;
            }
            let n = if own { own_split } else { foreign_split };
            let held = held_all.min(n);
            if held >= n {
                return Ok(None); // a slot here already holds it (or it is under one chunk)
            }
            let tokens = &prompt[..n];
            p.in_flight.fetch_add(1, Ordering::Relaxed);
            let r = self.fetch(p, tokens, held, chunk).await;
            p.in_flight.fetch_sub(1, Ordering::Relaxed);
            match r {
                Ok((pf, phases)) => {
                    self.record(p, Ok(()));
                    let mut h = lock(&p.health);
                    h.last_handoff = Some(Handoff {
                        tokens: n,
                        from: pf.state.positions.start,
                        bytes: pf
                            .state
                            .layers
                            .iter()
                            .map(|l| (l.k.len() + l.v.len()) as u64)
                            .sum(),
                        ms: pf.took.as_secs_f64() * 1e3,
                        phases,
                    });
                    tracing::info!(
                        producer = %p.ep.name,
                        tokens = n,
                        from = pf.state.positions.start,
                        ms = pf.took.as_secs_f64() * 1e3,
                        ?phases,
                        "prefill lane: remote prefill installed"
                    );
                    return Ok(Some(pf));
                }
                Err(e) => {
                    tracing::warn!(producer = %p.ep.name, error = %e, "prefill lane: producer failed");
                    self.record(p, Err(("prefill", e.as_str())));
                    failures.push(format!("{}: {e}", p.ep.name));
                }
            }
        }
        let why = match failures.is_empty() {
            true => "no producer is healthy".to_string(),
            false => failures.join("; "),
        };
        match self.mode {
            PrefillMode::Remote => Err(lane_err(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("remote prefill failed on every producer: {why}"),
            )),
            _ => {
                tracing::warn!(reason = %why, "prefill lane: falling back to local prefill");
                Ok(None)
            }
        }
    }

    /// A probe's or prefill's outcome for `p`'s health; a change of state is logged, and a
    /// failure (what failed: `probe` or `prefill`, and why) is kept in the node's failure
    /// log for `muser node status`.
    fn record(&self, p: &Producer, outcome: Result<(), (&str, &str)>) {
        let mut h = lock(&p.health);
        let now = Instant::now();
        let change = match outcome {
            Ok(()) => h.sup.success(now),
            Err((_, why)) => {
                h.last_error = Some(why.to_string());
                h.sup.failure(now)
            }
        };
        drop(h);
        if let Some((from, to)) = change {
            tracing::warn!(
                producer = %p.ep.name,
                from = from.name(),
                to = to.name(),
                "prefill lane: producer health changed"
            );
        }
        if let Err((what, why)) = outcome {
            let log = FailureLog::at(&self.config_dir, &p.ep.name);
            if let Err(e) = log.push(what, why) {
                tracing::warn!(producer = %p.ep.name, error = %e, "prefill lane: failure log");
            }
        }
    }

    /// Whether `p`'s engine ABI, as its status last reported it, is this engine's (`None`:
    /// not reported yet). Another one is one of `--accept-abi`; any other is refused on
    /// arrival.
    fn abi_is_own(&self, p: &Producer) -> Option<bool> {
        health(p)
            .engine_abi
            .as_deref()
            .map(|abi| abi == self.ctx.identity.engine_abi)
    }

    /// One remote prefill of `tokens` from `p`, verified, with where its time went; `held`
    /// leading tokens are on an idle slot here.
    ///
    /// A long prompt is asked for in pieces (see [`pieces`]): each piece is the delta past
    /// the previous one, sealed and verified on its own, and the request for the next piece
    /// goes out as soon as the previous answer's head has arrived, so its body streams and
    /// is verified while the producer prefills the next piece. Only the last, smallest
    /// piece's transfer stays on the time to first token. The pieces end on multiples of
    /// this engine's prefill chunk, so the producer computes exactly the chunks one request
    /// would have. Every piece is written, as it is verified, into one state for the whole
    /// prompt ([`Assembly`]) whose pages are mapped while the producer prefills the first
    /// piece, so each received row is copied once, into memory that is ready; nothing is
    /// installed unless every piece passed.
    async fn fetch(
        &self,
        p: &Producer,
        tokens: &[u32],
        held: usize,
        chunk: usize,
    ) -> Result<(Prefilled, Phases), String> {
        let started = Instant::now();
        let deadline = started + self.deadline;
        let own_abi = &self.ctx.identity.engine_abi;
        let same_abi = self.abi_is_own(p) == Some(true);
        // block ids name the producer's identity: ours, or ours under its reported ABI
        let chain = match (same_abi, health(p).engine_abi) {
            (true, _) => Some((own_abi.clone(), self.ctx.hasher.chain(tokens))),
            (false, Some(abi)) => {
                let mut id = self.ctx.identity.clone();
                id.engine_abi = abi.clone();
                let hasher = PrefixHasher::new(&self.ctx.keys, &id.digest(&self.ctx.keys));
                Some((abi, hasher.chain(tokens)))
            }
            (false, None) => None,
        };
        // a slot's K/V is this engine's own: only a producer of this ABI builds on it
        let base = if same_abi { held } else { 0 };
        let ends = match chain {
            Some(_) => pieces(base, tokens.len(), chunk),
            None => vec![tokens.len()],
        };
        let mut phases = Phases {
            pieces: ends.len(),
            ..Phases::default()
        };
        // the state the pieces are written into, made (every page mapped) on blocking threads
        // while the producer prefills the first piece; each piece's verifier takes it from
        // the one before
        let layout = self.ctx.identity.layout.clone();
        let positions = base as u32..tokens.len() as u32;
        let mut joined: Joining = AbortOnDrop(tokio::spawn(async move {
            tokio::task::spawn_blocking(move || Joined {
                asm: Assembly::new(KvState::prefaulted(layout, positions, prefault_threads())),
                engine_abi: None,
                received: Vec::new(),
                join_wait: Duration::ZERO,
            })
            .await
            .map_err(|e| format!("preparing the state: {e}"))
        }));
        let mut from = base;
        let mut base_abi = own_abi.clone();
        for end in ends {
            let held_ids: Vec<String> = match &chain {
                Some((_, c)) => c.block_ids()[..from / BLOCK_TOKENS as usize]
                    .iter()
                    .map(BlockId::to_hex)
                    .collect(),
                None => Vec::new(),
            };
            let piece = self
                .request(
                    p,
                    &tokens[..end],
                    from,
                    held_ids,
                    base_abi,
                    deadline,
                    joined,
                )
                .await?;
            // the next piece builds on this one, computed under the producer's ABI
            base_abi = chain
                .as_ref()
                .map_or_else(String::new, |(abi, _)| abi.clone());
            phases.add_producer(&piece.phases);
            phases.head_ms = started.elapsed().as_secs_f64() * 1e3;
            // this piece is verified into the state once the pieces before it are, while the
            // producer prefills the next one
            joined = piece.task;
            from = end;
        }
        let t_body = Instant::now();
        let done = (&mut joined.0)
            .await
            .map_err(|e| format!("receiving the pieces: {e}"))??;
        for r in &done.received {
            phases.add_received(r);
        }
        phases.join_ms = done.join_wait.as_secs_f64() * 1e3;
        let engine_abi = done.engine_abi.ok_or("no piece was asked for")?;
        let state = done
            .asm
            .into_state()
            .map_err(|e| format!("pack refused: {e}"))?;
        phases.body_ms = t_body.elapsed().as_secs_f64() * 1e3;
        let pf = Prefilled {
            foreign_abi: engine_abi != self.ctx.identity.engine_abi,
            state,
            producer: Arc::from(p.ep.name.as_str()),
            took: started.elapsed(),
        };
        Ok((pf, phases))
    }

    /// Asks `p` for the pack of `tokens` past the `base` tokens whose blocks `held_ids` name,
    /// and returns once its head has arrived, with its body being received and verified, into
    /// the state the pieces `before` leave, on a task of its own.
    #[allow(clippy::too_many_arguments)]
    async fn request(
        &self,
        p: &Producer,
        tokens: &[u32],
        base: usize,
        held_ids: Vec<String>,
        base_abi: String,
        deadline: Instant,
        before: Joining,
    ) -> Result<Piece, String> {
        let ctx = &self.ctx;
        let generation = p.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let body = serde_json::to_vec(&PrefillRequest {
            tokens: tokens.to_vec(),
            held: held_ids,
            generation,
        })
        .map_err(|e| e.to_string())?;
        let req = hyper::Request::post("/v1/prefill")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let started = Instant::now();
        let left = deadline.saturating_duration_since(started);
        let mut resp = self
            .client
            .send(&p.ep, req, left)
            .await
            .map_err(|e| e.to_string())?;
        if resp.status() != StatusCode::OK {
            let msg = small_body(resp.body_mut()).await.unwrap_or_default();
            return Err(format!("answered {}: {msg}", resp.status()));
        }
        let header_f64 = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        let phases = Phases {
            producer_prefill_ms: header_f64("x-muser-prefill-ms"),
            producer_export_ms: header_f64("x-muser-export-ms"),
            ..Phases::default()
        };
        if let Some(q) = resp
            .headers()
            .get("x-muser-queue-depth")
            .and_then(|v| v.to_str().ok()?.parse().ok())
        {
            p.queue_depth.store(q, Ordering::Relaxed);
        }
        // bounded by the K/V of the tokens sent, whatever the producer declares
        let layout = &ctx.identity.layout;
        let max_kv =
            layout.row_bytes() as u64 * 2 * u64::from(layout.n_layer) * tokens.len() as u64;
        let limits = ReadLimits {
            max_file_bytes: max_kv + (ctx.limits.max_manifest_bytes + 4096),
            max_tokens: self.n_ctx as u32,
            ..ctx.limits.clone()
        };
        let ask = Ask {
            ctx: ctx.clone(),
            ledger: self.ledger.clone(),
            accept_abis: self.accept_abis.clone(),
            stream: p.stream,
            generation,
            tokens: tokens.to_vec(),
            base,
            base_abi,
        };
        let late = format!(
            "the pack did not arrive within the {} ms deadline",
            self.deadline.as_millis()
        );
        // the transport receives while a blocking thread verifies what arrived (copying into
        // the state, the segments' SHA-256 on workers): TLS, HTTP/2 and hashing run side by
        // side, VERIFY_AHEAD_CHUNKS apart at most. The verifier starts once the pieces before
        // this one are verified and recorded (their state is this piece's destination).
        let task = tokio::spawn(async move {
            let (tx, rx) = mpsc::channel::<Bytes>(VERIFY_AHEAD_CHUNKS);
            let mut before = before;
            let worker = AbortOnDrop(tokio::spawn(async move {
                let before = (&mut before.0)
                    .await
                    .map_err(|e| format!("receiving the pieces: {e}"))??;
                tokio::task::spawn_blocking(move || ask.verify(&limits, max_kv, rx, before))
                    .await
                    .map_err(|e| format!("verifying the pack: {e}"))?
            }));
            let head = Instant::now();
            let mut first_byte = None;
            loop {
                let next = tokio::time::timeout_at(deadline.into(), next_chunk(resp.body_mut()))
                    .await
                    .map_err(|_| late.clone())?;
                first_byte.get_or_insert_with(|| head.elapsed());
                match next {
                    None => break,
                    Some(chunk) => {
                        if tx.send(chunk.map_err(|e| e.to_string())?).await.is_err() {
                            break; // the verifier stopped: its error says why
                        }
                    }
                }
            }
            drop(tx);
            let last_byte = Instant::now();
            let mut worker = worker;
            let (mut joined, busy) = tokio::time::timeout_at(deadline.into(), &mut worker.0)
                .await
                .map_err(|_| late)?
                .map_err(|e| format!("verifying the pack: {e}"))??;
            joined.received.push(PieceTimes {
                busy,
                first_byte: first_byte.unwrap_or_default(),
            });
            joined.join_wait = last_byte.elapsed();
            Ok(joined)
        });
        Ok(Piece {
            phases,
            task: AbortOnDrop(task),
        })
    }
}

/// The pieces verified so far, being received on tasks of their own (stopped, with the
/// pieces each waits for, when the handoff fails).
type Joining = AbortOnDrop<Result<Joined, String>>;

/// The state the pieces received so far are written into, the engine ABI they name (none
/// before the first), each piece's receipt in order, and how long the last piece's
/// verification ran on after its last byte arrived.
struct Joined {
    asm: Assembly,
    engine_abi: Option<String>,
    received: Vec<PieceTimes>,
    join_wait: Duration,
}

/// A piece whose head has arrived; its body is received and verified by `task`.
struct Piece {
    phases: Phases,
    task: Joining,
}

/// A piece's verifier busy time and the wait from its answer's head to its first byte.
#[derive(Clone, Copy)]
struct PieceTimes {
    busy: Duration,
    first_byte: Duration,
}

/// A task stopped when its handle is dropped (a handoff that failed stops receiving).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Chunks of a pack received ahead of its verification.
const VERIFY_AHEAD_CHUNKS: usize = 16;

/// Threads hashing a pack's segments as they arrive: the cores, up to 8 (the receiving
/// thread only copies into the staging state).
fn verify_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// Threads mapping the pages of a handoff's state while the producer prefills: the cores, up
/// to 4 (this engine may be decoding meanwhile).
fn prefault_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// Where a handoff's time went: the producer's prefill and export (as it reported them) and
/// its sealing (an answer's head to its first byte), summed over the pieces, the time to the
/// last piece's head (everything the producer
/// did included), the rest (last head to the last byte verified: the transfer left on the
/// time to first token), the verifiers' own busy time, and the pieces asked for.
#[derive(Clone, Copy, Default, Debug)]
pub struct Phases {
    pub producer_prefill_ms: f64,
    pub producer_export_ms: f64,
    pub producer_seal_ms: f64,
    pub head_ms: f64,
    pub body_ms: f64,
    pub verify_ms: f64,
    /// The last piece's wait from head to first byte (its seal), and how long its verifier ran
    /// on after its last byte arrived (the hash workers' last digests and the ledger record).
    pub last_seal_ms: f64,
    pub join_ms: f64,
    pub pieces: usize,
}

impl Phases {
    fn add_producer(&mut self, piece: &Phases) {
        self.producer_prefill_ms += piece.producer_prefill_ms;
        self.producer_export_ms += piece.producer_export_ms;
    }

    fn add_received(&mut self, r: &PieceTimes) {
        self.producer_seal_ms += r.first_byte.as_secs_f64() * 1e3;
        self.last_seal_ms = r.first_byte.as_secs_f64() * 1e3;
        self.verify_ms += r.busy.as_secs_f64() * 1e3;
    }
}

/// What the pack of one request must be; owned, so it verifies on a blocking thread.
struct Ask {
    ctx: Arc<KvPackContext>,
    ledger: Arc<Mutex<Ledger>>,
    accept_abis: Vec<String>,
    stream: Digest32,
    generation: u64,
    tokens: Vec<u32>,
    /// Leading tokens whose K/V this consumer holds under the pack's ABI (on a slot, or
    /// from the earlier pieces of this handoff): a delta may build on them.
    base: usize,
    /// The engine ABI that computed those tokens' K/V.
    base_abi: String,
}

impl Ask {
    /// Verifies the pack whose chunks arrive on `rx` into the state of the pieces `before`,
    /// and records its generation; that state and the time spent verifying. The manifest is
    /// checked as soon as it is complete, before any K/V byte is accepted.
    fn verify(
        &self,
        limits: &ReadLimits,
        max_kv: u64,
        mut rx: mpsc::Receiver<Bytes>,
        before: Joined,
    ) -> Result<(Joined, Duration), String> {
        let expect = Expect {
            identity: &self.ctx.identity,
            cut: None,
            other_abis: &self.accept_abis,
        };
        let Joined {
            asm,
            engine_abi,
            received,
            ..
        } = before;
        let mut sr = StreamRestore::new(&self.ctx.keys, expect, limits, max_kv)
            .hash_threads(verify_threads())
            .into_assembly(asm);
        let mut checked = false;
        let mut busy = Duration::ZERO;
        while let Some(chunk) = rx.blocking_recv() {
            let t = Instant::now();
            sr.push_bytes(chunk)
                .map_err(|e| format!("pack refused: {e}"))?;
            if !checked {
                if let Some(m) = sr.manifest() {
                    self.check_manifest(m)?;
                    checked = true;
                }
            }
            busy += t.elapsed();
        }
        let (manifest, asm) = sr
            .finish_assembly()
            .map_err(|e| format!("pack refused: {e}"))?;
        if !checked {
            self.check_manifest(&manifest)?;
        }
        let abi = manifest.identity.engine_abi;
        if engine_abi.as_ref().is_some_and(|a| *a != abi) {
            return Err(
                "pack refused: the pieces of one prefill name different engine ABIs".into(),
            );
        }
        // generations are recorded in the order they were asked for: this piece's verifier
        // started after the one before it finished
        lock(&self.ledger)
            .record(self.stream, self.generation)
            .map_err(|e| format!("pack refused: {e}"))?;
        let joined = Joined {
            asm,
            engine_abi: Some(abi),
            received,
            join_wait: Duration::ZERO,
        };
        Ok((joined, busy))
    }

    /// What the manifest must say for this request: our stream and generation, above the
    /// ledger; the prefix of exactly the tokens sent; a delta only on blocks we hold.
    fn check_manifest(&self, m: &Manifest) -> Result<(), String> {
        let generation = self.generation;
        if m.stream != self.stream {
            return Err("pack refused: it belongs to another consumer-producer stream".into());
        }
        if m.generation != generation {
            return Err(format!(
                "pack refused: replayed or stale (generation {}, this request's is {generation})",
                m.generation
            ));
        }
        lock(&self.ledger)
            .admit(&self.stream, generation)
            .map_err(|e| format!("pack refused: {e}"))?;
        let tokens = &self.tokens;
        if m.token_count as usize != tokens.len() {
            return Err(format!(
                "pack refused: it covers {} tokens, {} were sent",
                m.token_count,
                tokens.len()
            ));
        }
        let ctx = &self.ctx;
        let chain = if m.identity.engine_abi == ctx.identity.engine_abi {
            ctx.hasher.chain(tokens)
        } else {
            PrefixHasher::new(&ctx.keys, &m.identity.digest(&ctx.keys)).chain(tokens)
        };
        if chain.cut_id(m.token_count) != Some(m.cut_id) {
            return Err("pack refused: it is not the prefix of the tokens sent".into());
        }
        if let PackKind::Delta {
            base_tokens,
            base_cut,
        } = m.kind
        {
            if base_tokens as usize > self.base
                || m.identity.engine_abi != self.base_abi
                || chain.cut_id(base_tokens) != Some(base_cut)
            {
                return Err("pack refused: a delta on blocks this consumer does not hold".into());
            }
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn health(p: &Producer) -> Health {
    lock(&p.health).clone()
}

/// Producer `ep`'s `GET /v1/lane/status`, answered within `timeout`.
pub async fn probe(
    client: &LaneClient,
    ep: &Endpoint,
    timeout: Duration,
) -> Result<LaneStatus, String> {
    let req = hyper::Request::get("/v1/lane/status")
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let mut resp = client
        .send(ep, req, timeout)
        .await
        .map_err(|e| e.to_string())?;
    let body = tokio::time::timeout(timeout, small_body(resp.body_mut()))
        .await
        .map_err(|_| format!("producer `{}` did not finish its status in time", ep.name))??;
    if resp.status() != StatusCode::OK {
        return Err(format!("status {}: {body}", resp.status()));
    }
    serde_json::from_str(&body).map_err(|e| format!("status answer: {e}"))
}

/// A short body as text (bounded).
pub(crate) async fn small_body(body: &mut hyper::body::Incoming) -> Result<String, String> {
    let mut out = Vec::new();
    while let Some(c) = next_chunk(body).await {
        let c = c.map_err(|e| e.to_string())?;
        if out.len() + c.len() > MAX_SMALL_BODY {
            return Err("answer too large".into());
        }
        out.extend_from_slice(&c);
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// The longest prefix of `tokens` an idle slot holds (busy slots are skipped).
async fn held_prefix(engine: &Arc<Engine>, tokens: &[u32]) -> usize {
    let engine = engine.clone();
    let tokens = tokens.to_vec();
    tokio::task::spawn_blocking(move || {
        (0..engine.config().n_slots)
            .filter_map(|s| engine.slot_tokens(s).ok())
            .map(|held| held.iter().zip(&tokens).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0)
    })
    .await
    .unwrap_or(0)
}
