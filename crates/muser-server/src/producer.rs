//! The producer's side of the prefill lane (`muser up --role producer`): an HTTP/2 router
//! served over mutual TLS to enrolled consumers only (`muser_cluster::serve`).
//!
//! `POST /v1/prefill` takes token ids (never text), prefills them on a slot of this engine
//! (the slot whose cached tokens share the longest prefix, so a repeated long prefix costs
//! only the rest; `--prompt-cache` adds the pack store behind it), and answers with the
//! sealed pack as the response body: full, or a delta past the blocks the consumer says it
//! holds. The pack carries the consumer's replay generation on the stream of this
//! consumer–producer pair; `x-muser-prefill-ms` (waiting for a slot and the prefill) and
//! `x-muser-export-ms` (K/V out of the cache) say where the producer's time went before the
//! head, so a consumer can tell the handoff's own cost; sealing (hashing the segments, the
//! manifest's seal) follows the head and precedes the body's first byte. `GET /v1/lane/status` reports the queue depth and the recent
//! prefill rate consumers route by. Concurrent prefills are bounded by the slots, waiting ones
//! by `max_queue` (429 beyond).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use muser_cluster::PeerName;
use muser_engine::{Event, GenerateRequest, KvPackContext, SlotExport};
use muser_kvpack::{BlockId, KvState, PackPlan, BLOCK_TOKENS};
use tokio::sync::{mpsc, Semaphore};

use crate::error::ApiError;
use crate::lane::stream_id;
use crate::state::SharedState;
use crate::wire::lane::{LaneStatus, PrefillRequest};

/// Bytes of pack per body chunk.
const CHUNK_BYTES: usize = 1 << 20;
/// Chunks copied ahead of the connection (bounded: the sender waits for the consumer).
const SEND_AHEAD_CHUNKS: usize = 8;

/// A fault-injection seam for tests: changes the K/V a producer exported before it is
/// sealed, as a faulty node would (wrong numerics, flipped bits), so the pack verifies and
/// only its tokens tell. Set only by library callers (tests); no flag, file or request
/// reaches it.
#[derive(Clone)]
pub struct KvFault(pub Arc<dyn Fn(&mut KvState) + Send + Sync>);

impl std::fmt::Debug for KvFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvFault")
    }
}

/// A producer: the engine it prefills on and what it tracks of its slots.
pub struct Producer {
    app: SharedState,
    ctx: Arc<KvPackContext>,
    name: String,
    fault: Option<KvFault>,
    slots: Mutex<Vec<SlotUse>>,
    permits: Semaphore,
    queue_depth: AtomicU64,
    max_queue: u64,
    /// Prompt tokens per second of recent prefills (moving average; bits of an f64).
    rate_bits: AtomicU64,
}

#[derive(Default)]
struct SlotUse {
    busy: bool,
    tokens: Vec<u32>,
}

impl Producer {
    /// A producer named `name` over a loaded server state (which must hold the kvpack
    /// context: the operator key sealing packs); `fault` is for tests only ([`KvFault`]).
    pub fn new(
        app: SharedState,
        name: &str,
        max_queue: usize,
        fault: Option<KvFault>,
    ) -> Result<Arc<Producer>, String> {
        let ctx = app
            .kvpack
            .clone()
            .ok_or("a producer needs the kvpack operator key (--kv-key-file)")?;
        let n = app.options.n_slots;
        Ok(Arc::new(Producer {
            ctx,
            name: name.to_string(),
            fault,
            slots: Mutex::new((0..n).map(|_| SlotUse::default()).collect()),
            permits: Semaphore::new(n),
            queue_depth: AtomicU64::new(0),
            max_queue: max_queue as u64,
            rate_bits: AtomicU64::new(0f64.to_bits()),
            app,
        }))
    }

    pub fn router(self: &Arc<Self>) -> Router {
        // a request is a token list: bounded by the context
        let limit = self.app.options.n_ctx * 12 + (64 << 10);
        Router::new()
            .route("/v1/prefill", post(prefill))
            .route("/v1/lane/status", get(status))
            .layer(DefaultBodyLimit::max(limit))
            .with_state(self.clone())
    }

    fn status(&self) -> LaneStatus {
        LaneStatus {
            name: self.name.clone(),
            engine_abi: self.ctx.identity.engine_abi.clone(),
            queue_depth: self.queue_depth.load(Ordering::Relaxed),
            prefill_tok_s: f64::from_bits(self.rate_bits.load(Ordering::Relaxed)),
            n_ctx: self.app.options.n_ctx as u64,
            prefill_chunk: self.app.engine.config().prefill_chunk as u64,
        }
    }

    fn lock_slots(&self) -> std::sync::MutexGuard<'_, Vec<SlotUse>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the free slot sharing the longest prefix with `tokens` (a permit guarantees one).
    fn take_slot(&self, tokens: &[u32]) -> Option<usize> {
        let mut slots = self.lock_slots();
        let best = slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.busy)
            .max_by_key(|(_, s)| {
                s.tokens
                    .iter()
                    .zip(tokens)
                    .take_while(|(a, b)| a == b)
                    .count()
            })
            .map(|(i, _)| i)?;
        slots[best].busy = true;
        Some(best)
    }

    fn release_slot(&self, slot: usize, tokens: Option<Vec<u32>>) {
        let mut slots = self.lock_slots();
        slots[slot].busy = false;
        slots[slot].tokens = tokens.unwrap_or_default();
    }

    /// Prefills two chunks on a slot once, at start-up, so the rate consumers route by (and
    /// size `auto`'s threshold with) is measured before the first request, and the weights
    /// are paged in.
    pub async fn warm_up(self: Arc<Self>) {
        let n = (2 * self.app.engine.config().prefill_chunk).min(self.app.options.n_ctx - 1);
        let Ok(_permit) = self.permits.acquire().await else {
            return;
        };
        let Some(slot) = self.take_slot(&[]) else {
            return;
        };
        let tokens = crate::lane::synthetic_prompt(n, self.app.tokenizer.n_vocab());
        let t = Instant::now();
        match prefill_on(&self, slot, &tokens).await {
            Ok(()) => {
                self.record_rate(n, t.elapsed().as_secs_f64());
                tracing::info!(
                    tokens = n,
                    tok_s = self.status().prefill_tok_s,
                    "producer: prefill rate measured"
                );
            }
            Err(e) => tracing::warn!(error = %e.message, "producer: the warm-up prefill failed"),
        }
        // the slot starts empty, as it would have without the warm-up
        let engine = self.app.engine.clone();
        let cleared = tokio::task::spawn_blocking(move || {
            engine.with_slot(slot, |s| {
                s.kv.clear(s.seq);
                s.tokens.clear();
            })
        })
        .await;
        if !matches!(cleared, Ok(Ok(()))) {
            tracing::warn!("producer: clearing the warm-up's slot failed");
        }
        self.release_slot(slot, None);
    }

    fn record_rate(&self, tokens: usize, secs: f64) {
        if secs <= 0.0 {
            return;
        }
        let now = tokens as f64 / secs;
        let old = f64::from_bits(self.rate_bits.load(Ordering::Relaxed));
        let new = if old == 0.0 {
            now
        } else {
            0.7 * old + 0.3 * now
        };
        self.rate_bits.store(new.to_bits(), Ordering::Relaxed);
    }

    /// Checks a request against this engine: tokens in the vocabulary and the context, held
    /// ids well formed and no more than the tokens' blocks.
    fn check(&self, req: &PrefillRequest) -> Result<Vec<BlockId>, ApiError> {
        let n = req.tokens.len();
        if n == 0 || n >= self.app.options.n_ctx {
            return Err(ApiError::bad_request(format!(
                "a prefill needs 1 to {} tokens, got {n}",
                self.app.options.n_ctx - 1
            )));
        }
        for &t in &req.tokens {
            self.app.check_token(u64::from(t))?;
        }
        if req.generation == 0 {
            return Err(ApiError::bad_request("generation must be at least 1"));
        }
        if req.held.len() > n / BLOCK_TOKENS as usize {
            return Err(ApiError::bad_request(
                "more held blocks than the tokens have",
            ));
        }
        req.held
            .iter()
            .map(|h| {
                let mut id = [0u8; 32];
                hex::decode_to_slice(h, &mut id)
                    .map_err(|_| ApiError::bad_request("a held block id is not 64 hex digits"))?;
                Ok(BlockId(id))
            })
            .collect()
    }
}

async fn status(State(p): State<Arc<Producer>>) -> Json<LaneStatus> {
    Json(p.status())
}

/// Decrements the queue depth when a prefill leaves (done, failed or its client gone).
struct Queued<'a>(&'a AtomicU64);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn prefill(
    State(p): State<Arc<Producer>>,
    Extension(peer): Extension<PeerName>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: PrefillRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("prefill request: {e}")))?;
    let held = p.check(&req)?;
    if p.queue_depth.fetch_add(1, Ordering::Relaxed) >= p.max_queue + p.app.options.n_slots as u64 {
        p.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::busy(1));
    }
    let queued = Queued(&p.queue_depth);
    let (mut export, took) = run_prefill(&p, &req.tokens, held).await?;
    drop(queued);
    if let Some(KvFault(fault)) = &p.fault {
        fault(&mut export.state);
    }
    let stream = stream_id(&peer.0, &p.name);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(SEND_AHEAD_CHUNKS);
    let ctx = p.ctx.clone();
    let generation = req.generation;
    // the answer's head leaves now, so a consumer asking in pieces sends its next request
    // while this pack is sealed and sent; hashing every segment (in parallel) comes first in
    // the body, since the manifest and its seal lead the pack, then the segments are copied
    // out while the consumer reads, SEND_AHEAD_CHUNKS ahead
    tokio::task::spawn_blocking(move || {
        let mut spec = export.spec(&ctx, generation, Some(stream));
        spec.threads = seal_threads();
        let mut w = ChunkWriter {
            tx,
            buf: Vec::with_capacity(CHUNK_BYTES),
        };
        let sent = PackPlan::new(&export.state, &ctx.keys, &spec)
            .map_err(std::io::Error::other)
            .and_then(|plan| plan.write_to(&mut w))
            .and_then(|()| w.flush());
        if let Err(e) = sent {
            tracing::warn!(error = %e, "prefill lane: sending a pack failed");
            let _ = w.tx.blocking_send(Err(e));
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let ms =
        |name: &'static str, v: f64| (header::HeaderName::from_static(name), format!("{v:.3}"));
    Ok((
        StatusCode::OK,
        [
            (
                header::CONTENT_TYPE,
                "application/x-muser-kvpack".to_string(),
            ),
            (
                header::HeaderName::from_static("x-muser-queue-depth"),
                p.queue_depth.load(Ordering::Relaxed).to_string(),
            ),
            ms("x-muser-prefill-ms", took.prefill_ms),
            ms("x-muser-export-ms", took.export_ms),
        ],
        body,
    )
        .into_response())
}

/// Threads hashing a pack's segments: the cores of this machine (up to 16), since the
/// consumer waits for the seal before the first K/V byte can leave.
fn seal_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(16))
}

/// Where a producer's time before the first byte went.
struct Took {
    /// Waiting for a slot and the prefill itself.
    prefill_ms: f64,
    /// Copying the slot's K/V out of the cache.
    export_ms: f64,
}

/// Prefills `tokens` on a slot of its own and exports its K/V past the blocks `held`.
async fn run_prefill(
    p: &Arc<Producer>,
    tokens: &[u32],
    held: Vec<BlockId>,
) -> Result<(SlotExport, Took), ApiError> {
    let t0 = Instant::now();
    let _permit = p
        .permits
        .acquire()
        .await
        .map_err(|_| ApiError::internal("the producer is shutting down"))?;
    let slot = p
        .take_slot(tokens)
        .ok_or_else(|| ApiError::internal("no free slot under a permit"))?;
    let t1 = Instant::now();
    let result = prefill_on(p, slot, tokens).await;
    if result.is_ok() {
        p.record_rate(tokens.len(), t1.elapsed().as_secs_f64());
    }
    let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t2 = Instant::now();
    let result = match result {
        Ok(()) => export(p, slot, held).await,
        Err(e) => Err(e),
    };
    p.release_slot(slot, result.is_ok().then(|| tokens.to_vec()));
    let took = Took {
        prefill_ms,
        export_ms: t2.elapsed().as_secs_f64() * 1e3,
    };
    if let Ok(e) = &result {
        let bytes: usize = e.state.layers.iter().map(|l| l.k.len() + l.v.len()).sum();
        tracing::info!(
            tokens = tokens.len(),
            from = e.base,
            bytes,
            prefill_ms = took.prefill_ms,
            export_ms = took.export_ms,
            waited_ms = e.waited.as_secs_f64() * 1e3,
            copied_ms = e.copied.as_secs_f64() * 1e3,
            "producer: prefilled and exported"
        );
    }
    result.map(|e| (e, took))
}

async fn prefill_on(p: &Arc<Producer>, slot: usize, tokens: &[u32]) -> Result<(), ApiError> {
    align_slot(p, slot, tokens).await?;
    let mut rx = p
        .app
        .engine
        .submit(GenerateRequest {
            prompt: tokens.to_vec(),
            max_tokens: Some(0),
            slot: Some(slot),
            cache_prompt: true,
            ..Default::default()
        })
        .map_err(|e| ApiError::internal(format!("prefill: {e}")))?;
    loop {
        match rx.recv().await {
            Some(Event::Done { .. }) => break,
            Some(Event::Error(e)) => return Err(ApiError::internal(format!("prefill: {e}"))),
            Some(_) => {}
            None => return Err(ApiError::internal("prefill: the engine stopped")),
        }
    }
    Ok(())
}

/// The slot's K/V past the blocks `held`.
async fn export(
    p: &Arc<Producer>,
    slot: usize,
    held: Vec<BlockId>,
) -> Result<SlotExport, ApiError> {
    let (engine, ctx) = (p.app.engine.clone(), p.ctx.clone());
    tokio::task::spawn_blocking(move || engine.export_slot_state(slot, &ctx, held))
        .await
        .map_err(|e| ApiError::internal(format!("export: {e}")))?
        .map_err(|e| ApiError::internal(format!("export: {e}")))
}

/// Cuts the slot's cache back to the longest shared prefix that is a whole number of blocks
/// and leaves at least one block to compute. The kernels a CPU forward takes depend on the
/// batch's rows; computing whole blocks (as a consumer's own chunked prefill does) keeps
/// every row's K/V equal to what the consumer would have computed. A sliding-window ring
/// that no longer holds the window before the cut (the slot went on past it) cannot resume
/// there: the slot is cleared and the prompt computed from its start.
async fn align_slot(p: &Arc<Producer>, slot: usize, tokens: &[u32]) -> Result<(), ApiError> {
    let block = BLOCK_TOKENS as usize;
    let tokens = tokens.to_vec();
    let engine = p.app.engine.clone();
    tokio::task::spawn_blocking(move || {
        engine.with_slot(slot, move |s| {
            let shared = s
                .tokens
                .iter()
                .zip(&tokens)
                .take_while(|(a, b)| a == b)
                .count();
            let mut keep = shared.min(tokens.len().saturating_sub(block)) / block * block;
            if keep < s.tokens.len() && !s.kv.holds_window(s.seq, keep as u32) {
                keep = 0;
            }
            if keep < s.tokens.len() {
                if keep == 0 {
                    s.kv.clear(s.seq);
                } else {
                    s.kv.truncate(s.seq, keep as u32);
                }
                s.tokens.truncate(keep);
            }
        })
    })
    .await
    .map_err(|e| ApiError::internal(format!("prefill: {e}")))?
    .map_err(|e| ApiError::internal(format!("prefill: {e}")))
}

/// A `Write` that sends what it is given as body chunks of [`CHUNK_BYTES`]; fails once the
/// receiver is gone (the consumer hung up).
struct ChunkWriter {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    buf: Vec<u8>,
}

impl Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = (CHUNK_BYTES - self.buf.len()).min(data.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == CHUNK_BYTES {
            self.flush()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(
            &mut self.buf,
            Vec::with_capacity(CHUNK_BYTES),
        ));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "consumer gone"))
    }
}
