//! Prompt cache across requests and restarts: prompts' K/V kept as kvpack packs, so a prompt
//! that shares a block-aligned prefix with one computed before (in this process or an earlier
//! one) resumes that prefix instead of recomputing it.
//!
//! Two tiers behind the slots' own caches, both addressed by the keyed prefix chain
//! ([`muser_kvpack::PrefixHasher`], 256-token blocks):
//! - **memory**: a [`ResidentCache`] (radix of reference-counted blocks) under a byte budget;
//! - **disk**: a durable [`PackStore`] in the operator's directory, a byte budget with
//!   least-recently-used eviction, the replay ledger, recovery at start-up.
//!
//! The scheduler asks [`PromptCache::lookup`] when it admits a request. A memory hit is a copy
//! on the engine thread; a longer prefix on disk is read and verified (identity, seal with the
//! operator key, Merkle root, every segment's SHA-256) on a loader thread while the request
//! waits in the queue and the other slots keep decoding; the engine is woken when it is ready.
//! A pack that fails any check is logged, removed from the store and the request recomputes.
//! [`PromptCache::resume`] is the same answer computed synchronously. After a prompt's prefill reaches its
//! publish cut the scheduler exports that prefix and [`PromptCache::offer`]s it; a writer
//! thread seals the pack, writes and fsyncs it without holding the store, then commits it
//! (ledger, rename) and adds its blocks to the memory tier. Offers never wait: when the writer
//! is behind, the offer is dropped.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use muser_kvpack::{
    BlockId, KvState, KvpackError, PackPlan, PackSpec, PackStore, RecoveryReport, ResidentCache,
    RestoreControl, SegmentPlan, Stager, StoreConfig, BLOCK_TOKENS,
};

use crate::kvpack_bridge::{KvPackContext, PackError};

/// Where and how much the prompt cache keeps.
#[derive(Clone, Debug)]
pub struct PromptCacheConfig {
    /// The pack store's directory (created if missing).
    pub dir: PathBuf,
    /// Most bytes of packs on disk; least recently used packs are evicted beyond it.
    pub disk_budget_bytes: u64,
    /// Most bytes of K/V blocks kept in memory (0: no memory tier).
    pub memory_budget_bytes: u64,
    /// Prompts whose publishable prefix is shorter than this are not published (at least
    /// one 256-token block).
    pub min_tokens: u32,
    /// Check every segment of every pack at start-up (otherwise header, manifest and seal;
    /// segments are always checked before a pack is used).
    pub verify_on_open: bool,
}

impl PromptCacheConfig {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        PromptCacheConfig {
            dir: dir.into(),
            disk_budget_bytes: 4 << 30,
            memory_budget_bytes: 1 << 30,
            min_tokens: BLOCK_TOKENS,
            verify_on_open: false,
        }
    }
}

/// Counters of the prompt cache.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PromptCacheStats {
    /// Requests that resumed a prefix from memory / from disk.
    pub hits_memory: u64,
    pub hits_disk: u64,
    /// Prompt tokens resumed from either tier.
    pub tokens_resumed: u64,
    /// Packs refused at use (failed verification) and removed.
    pub rejected: u64,
    /// Packs moved aside at start-up (damaged, foreign key, wrong name).
    pub quarantined_at_open: u64,
    /// Packs published to disk; offers dropped because the writer was behind; failures.
    pub published: u64,
    pub offers_dropped: u64,
    pub publish_failed: u64,
    /// Milliseconds the last resume took (lookup, read, verify, copy; not the import).
    pub last_resume_ms: f64,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
    pub disk_packs: usize,
}

/// Where a resumed prefix came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Memory,
    Disk,
}

/// A prefix ready to import into a slot: positions `0..state.positions.end`.
pub struct Resume {
    pub state: KvState,
    pub tier: Tier,
    /// Time spent getting it (for a disk load on the loader thread: from the first lookup
    /// that started it), which the request's prompt time includes.
    pub took: std::time::Duration,
}

/// What [`PromptCache::lookup`] answers the scheduler.
pub enum Lookup {
    /// A longer prefix is being read and verified from disk on a loader thread; ask again
    /// (the engine is woken when it is ready).
    Wait,
    /// The best prefix available now, if any is longer than what the slot holds.
    Ready(Option<Resume>),
}

/// Disk loads in flight or finished but not yet taken, by cut id.
enum Load {
    /// Started at.
    Pending(Instant),
    /// The state, when the load started and when it finished.
    Done(KvState, Instant, Instant),
}

/// A finished load nobody took (its request was cancelled) is dropped after this long.
const LOAD_TTL: std::time::Duration = std::time::Duration::from_secs(60);

struct Tiers {
    ctx: Arc<KvPackContext>,
    /// The replay stream of every pack this cache publishes: one ledger entry per model
    /// identity, however many prefixes come and go.
    stream: muser_kvpack::Digest32,
    memory: Option<Mutex<ResidentCache>>,
    store: Mutex<PackStore>,
    stats: Mutex<PromptCacheStats>,
    loads: Mutex<HashMap<BlockId, Load>>,
    /// Called when a load finishes (the engine wakes its scheduler); `None`: loads run
    /// synchronously in [`PromptCache::lookup`].
    waker: Mutex<Option<Waker>>,
}

type Waker = Arc<dyn Fn() + Send + Sync>;

enum Job {
    Publish { tokens: Vec<u32>, state: KvState },
    Flush(std::sync::mpsc::Sender<()>),
}

/// The prompt cache of one engine (one model identity and operator key).
pub struct PromptCache {
    tiers: Arc<Tiers>,
    tx: Mutex<Option<SyncSender<Job>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    min_tokens: u32,
}

impl std::fmt::Debug for PromptCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptCache")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Offers queued for the writer before new ones are dropped.
const WRITER_QUEUE: usize = 2;

impl PromptCache {
    /// Opens (creating) the store in `cfg.dir` and recovers it (partial files removed,
    /// damaged or foreign packs quarantined, each logged), and starts the writer thread.
    pub fn open(
        ctx: Arc<KvPackContext>,
        cfg: &PromptCacheConfig,
    ) -> Result<(PromptCache, RecoveryReport), PackError> {
        let mut store_cfg = StoreConfig::new(&cfg.dir, cfg.disk_budget_bytes);
        store_cfg.limits = ctx.limits.clone();
        store_cfg.verify_segments_on_open = cfg.verify_on_open;
        let (store, report) = PackStore::open(store_cfg, ctx.keys.clone())?;
        for (name, why) in &report.quarantined {
            tracing::warn!(pack = %name, reason = %why, "prompt cache: pack refused at start-up and quarantined");
        }
        if report.kept + report.removed_partial + report.evicted > 0 {
            tracing::info!(
                kept = report.kept,
                removed_partial = report.removed_partial,
                evicted = report.evicted,
                "prompt cache: store opened"
            );
        }
        let memory = match cfg.memory_budget_bytes {
            0 => None,
            b => Some(Mutex::new(ResidentCache::new(
                ctx.identity.layout.clone(),
                b,
            )?)),
        };
        let stats = PromptCacheStats {
            quarantined_at_open: report.quarantined.len() as u64,
            ..Default::default()
        };
        let stager = store.stager();
        let stream = muser_kvpack::field_digest(
            "muser prompt-cache stream",
            &ctx.identity.digest(&ctx.keys),
        );
        let tiers = Arc::new(Tiers {
            ctx,
            stream,
            memory,
            store: Mutex::new(store),
            stats: Mutex::new(stats),
            loads: Mutex::new(HashMap::new()),
            waker: Mutex::new(None),
        });
        let (tx, rx) = sync_channel(WRITER_QUEUE);
        let t = tiers.clone();
        let writer = std::thread::Builder::new()
            .name("muser-prompt-cache".into())
            .spawn(move || writer_loop(&t, &stager, rx))
            .map_err(|e| PackError::Kv(format!("cannot start the prompt-cache writer: {e}")))?;
        Ok((
            PromptCache {
                tiers,
                tx: Mutex::new(Some(tx)),
                writer: Mutex::new(Some(writer)),
                min_tokens: cfg.min_tokens.max(BLOCK_TOKENS),
            },
            report,
        ))
    }

    pub fn context(&self) -> &Arc<KvPackContext> {
        &self.tiers.ctx
    }

    pub fn stats(&self) -> PromptCacheStats {
        let mut s = lock(&self.tiers.stats).clone();
        if let Some(m) = &self.tiers.memory {
            s.memory_bytes = lock(m).used_bytes();
        }
        let store = lock(&self.tiers.store);
        s.disk_bytes = store.total_bytes();
        s.disk_packs = store.len();
        s
    }

    /// Waits until every offer made so far is published (or failed).
    pub fn flush(&self) {
        let (tx, rx) = std::sync::mpsc::channel();
        let sent = lock(&self.tx)
            .as_ref()
            .is_some_and(|w| w.send(Job::Flush(tx)).is_ok());
        if sent {
            let _ = rx.recv();
        }
    }

    /// The length of prefix to publish for a prompt of `n_prompt` tokens: the last block
    /// boundary a later identical prompt can resume (one token always stays to compute), or
    /// `None` when that is below the minimum.
    pub fn publish_cut(&self, n_prompt: usize) -> Option<u32> {
        let cut = (n_prompt.saturating_sub(1) as u32 / BLOCK_TOKENS) * BLOCK_TOKENS;
        (cut >= self.min_tokens).then_some(cut)
    }

    /// The cut to publish for a slot that holds `n_held` tokens' K/V after generating (the
    /// last block boundary), or `None` below the minimum.
    pub fn held_cut(&self, n_held: usize) -> Option<u32> {
        let cut = (n_held as u32 / BLOCK_TOKENS) * BLOCK_TOKENS;
        (cut >= self.min_tokens).then_some(cut)
    }

    /// Lets [`PromptCache::lookup`] read disk packs on a loader thread, calling `waker` when
    /// one is ready (the engine sets this to wake its scheduler).
    pub fn set_waker(&self, waker: Waker) {
        *lock(&self.tiers.waker) = Some(waker);
    }

    /// What the scheduler asks when it admits a request: like [`PromptCache::resume`], but a
    /// disk pack is read and verified on a loader thread (so the decode loop of the other
    /// slots never waits on it) while this answers [`Lookup::Wait`]; once loaded, the next
    /// call returns it. Without a waker the disk is read here.
    pub fn lookup(&self, prompt: &[u32], limit: usize, have: usize) -> Lookup {
        let Some(waker) = lock(&self.tiers.waker).clone() else {
            return Lookup::Ready(self.resume(prompt, limit, have));
        };
        let limit = limit.min(prompt.len()) as u32;
        if limit < BLOCK_TOKENS || (limit as usize) <= have {
            return Lookup::Ready(None);
        }
        let t0 = Instant::now();
        let ctx = &self.tiers.ctx;
        let chain = ctx.hasher.chain(&prompt[..limit as usize]);
        let n_mem = self.tiers.memory.as_ref().map_or(0, |m| {
            lock(m)
                .lookup(chain.block_ids(), limit)
                .map_or(0, |h| h.n_tokens())
        });
        let floor = n_mem.max(have as u32);
        let disk = lock(&self.tiers.store)
            .lookup(&chain, limit)
            .filter(|h| h.token_count > floor);
        let Some(hit) = disk else {
            return Lookup::Ready(self.resume_memory(&chain, limit, have, t0));
        };
        let mut loads = lock(&self.tiers.loads);
        loads.retain(|_, l| !matches!(l, Load::Done(_, _, t) if t.elapsed() > LOAD_TTL));
        match loads.remove(&hit.cut) {
            Some(Load::Done(state, began, _)) => {
                drop(loads);
                if let Some(m) = &self.tiers.memory {
                    if let Err(e) = lock(m).insert(&state, chain.block_ids()) {
                        tracing::debug!(error = %e, "prompt cache: memory tier insert");
                    }
                }
                let mut r = Resume {
                    state,
                    tier: Tier::Disk,
                    took: began.elapsed(),
                };
                self.count(&mut r, t0);
                Lookup::Ready(Some(r))
            }
            Some(Load::Pending(began)) => {
                loads.insert(hit.cut, Load::Pending(began));
                Lookup::Wait
            }
            None => {
                let ticket = match lock(&self.tiers.store).ticket(&hit.cut) {
                    Ok(t) => t,
                    Err(e) => {
                        drop(loads);
                        self.reject(&hit.cut, hit.token_count, &e.to_string());
                        return Lookup::Ready(self.resume_memory(&chain, limit, have, t0));
                    }
                };
                loads.insert(hit.cut, Load::Pending(t0));
                drop(loads);
                let tiers = self.tiers.clone();
                let n = hit.token_count;
                let spawned = std::thread::Builder::new()
                    .name("muser-prompt-load".into())
                    .spawn(move || {
                        let control = RestoreControl {
                            max_bytes: state_bytes_bound(&tiers.ctx, n),
                            ..Default::default()
                        };
                        let r = ticket
                            .restore(&tiers.ctx.identity, &control)
                            .and_then(|r| {
                                lock(&tiers.store).confirm(&ticket, &r)?;
                                Ok(r)
                            })
                            .and_then(|r| {
                                if r.state.positions == (0..n) {
                                    Ok(r.state)
                                } else {
                                    Err(KvpackError::InvalidState(
                                        "the pack does not cover the prefix it is named for".into(),
                                    ))
                                }
                            });
                        match r {
                            Ok(state) => {
                                lock(&tiers.loads)
                                    .insert(ticket.cut, Load::Done(state, t0, Instant::now()));
                            }
                            Err(e) => {
                                lock(&tiers.loads).remove(&ticket.cut);
                                reject(&tiers, &ticket.cut, n, &e.to_string());
                            }
                        }
                        waker();
                    });
                if spawned.is_err() {
                    lock(&self.tiers.loads).remove(&hit.cut);
                    return Lookup::Ready(self.resume(prompt, limit as usize, have));
                }
                Lookup::Wait
            }
        }
    }

    /// The memory tier's longest prefix above `have`, counted as a hit.
    fn resume_memory(
        &self,
        chain: &muser_kvpack::PrefixChain,
        limit: u32,
        have: usize,
        t0: Instant,
    ) -> Option<Resume> {
        let m = self.tiers.memory.as_ref()?;
        let hit = lock(m)
            .lookup(chain.block_ids(), limit)
            .filter(|h| h.n_tokens() as usize > have)?;
        let mut r = Resume {
            state: hit.to_state(&self.tiers.ctx.identity.layout),
            tier: Tier::Memory,
            took: std::time::Duration::ZERO,
        };
        self.count(&mut r, t0);
        Some(r)
    }

    /// Counts a hit; `r.took` covers at least this lookup.
    fn count(&self, r: &mut Resume, t0: Instant) {
        r.took = r.took.max(t0.elapsed());
        let mut s = lock(&self.tiers.stats);
        match r.tier {
            Tier::Memory => s.hits_memory += 1,
            Tier::Disk => s.hits_disk += 1,
        }
        s.tokens_resumed += u64::from(r.state.positions.end);
        s.last_resume_ms = r.took.as_secs_f64() * 1e3;
    }

    /// The longest cached prefix of `prompt` of at most `limit` tokens and more than `have`
    /// (what the slot holds already), from memory or else from disk. A disk pack is verified
    /// completely first; one that fails is logged and removed, and the next best answer (or
    /// none) is returned.
    pub fn resume(&self, prompt: &[u32], limit: usize, have: usize) -> Option<Resume> {
        let t0 = Instant::now();
        let limit = limit.min(prompt.len()) as u32;
        if limit < BLOCK_TOKENS || (limit as usize) <= have {
            return None;
        }
        let ctx = &self.tiers.ctx;
        let chain = ctx.hasher.chain(&prompt[..limit as usize]);
        let mem = self.tiers.memory.as_ref().and_then(|m| {
            let mut m = lock(m);
            m.lookup(chain.block_ids(), limit)
                .filter(|h| h.n_tokens() as usize > have)
        });
        let n_mem = mem.as_ref().map_or(0, |h| h.n_tokens());
        let floor = n_mem.max(have as u32);
        let disk = {
            let store = lock(&self.tiers.store);
            store
                .lookup(&chain, limit)
                .filter(|h| h.token_count > floor)
        };
        let out = if let Some(hit) = disk {
            let control = RestoreControl {
                max_bytes: state_bytes_bound(ctx, hit.token_count),
                ..Default::default()
            };
            let restored = lock(&self.tiers.store).restore(&hit.cut, &ctx.identity, &control);
            match restored {
                Ok(r) if r.state.positions == (0..hit.token_count) => {
                    if let Some(m) = &self.tiers.memory {
                        if let Err(e) = lock(m).insert(&r.state, chain.block_ids()) {
                            tracing::debug!(error = %e, "prompt cache: memory tier insert");
                        }
                    }
                    Some(Resume {
                        state: r.state,
                        tier: Tier::Disk,
                        took: std::time::Duration::ZERO,
                    })
                }
                other => {
                    let reason = match other {
                        Ok(_) => "the pack does not cover the prefix it is named for".to_string(),
                        Err(e) => e.to_string(),
                    };
                    self.reject(&hit.cut, hit.token_count, &reason);
                    None
                }
            }
        } else {
            None
        };
        let mut out = out.or_else(|| {
            mem.map(|h| Resume {
                state: h.to_state(&ctx.identity.layout),
                tier: Tier::Memory,
                took: std::time::Duration::ZERO,
            })
        });
        if let Some(r) = &mut out {
            self.count(r, t0);
        }
        out
    }

    fn reject(&self, cut: &BlockId, n_tokens: u32, reason: &str) {
        reject(&self.tiers, cut, n_tokens, reason);
    }

    /// Hands the K/V of `tokens` (positions `0..tokens.len()`, from position 0) to the writer.
    /// Never waits: dropped when the writer is behind.
    pub fn offer(&self, tokens: Vec<u32>, state: KvState) {
        let guard = lock(&self.tx);
        let Some(tx) = guard.as_ref() else { return };
        match tx.try_send(Job::Publish { tokens, state }) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => lock(&self.tiers.stats).offers_dropped += 1,
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

/// Logs a refused pack and removes it from the store.
fn reject(tiers: &Tiers, cut: &BlockId, n_tokens: u32, reason: &str) {
    tracing::warn!(
        pack = %cut.to_hex(),
        tokens = n_tokens,
        %reason,
        "prompt cache: pack refused; the prompt is recomputed"
    );
    lock(&tiers.stats).rejected += 1;
    if let Err(e) = lock(&tiers.store).remove(cut) {
        tracing::warn!(error = %e, "prompt cache: removing a refused pack");
    }
}

/// Bytes of K/V a state of `n` tokens can take at most (every layer holding every position).
fn state_bytes_bound(ctx: &KvPackContext, n: u32) -> u64 {
    let l = &ctx.identity.layout;
    2 * u64::from(l.n_layer) * u64::from(n) * l.row_bytes() as u64
}

impl Drop for PromptCache {
    /// Lets the writer finish what it was offered, so that packs are durable when the engine
    /// is gone.
    fn drop(&mut self) {
        drop(lock(&self.tx).take());
        if let Some(w) = lock(&self.writer).take() {
            let _ = w.join();
        }
    }
}

fn writer_loop(tiers: &Tiers, stager: &Stager, rx: Receiver<Job>) {
    while let Ok(job) = rx.recv() {
        match job {
            Job::Flush(done) => {
                let _ = done.send(());
            }
            Job::Publish { tokens, state } => {
                if let Err(e) = publish(tiers, stager, &tokens, &state) {
                    tracing::warn!(error = %e, tokens = tokens.len(), "prompt cache: publishing failed");
                    lock(&tiers.stats).publish_failed += 1;
                }
            }
        }
    }
}

/// A generation above the stream's high-water mark and the clock (microseconds).
fn next_generation(store: &PackStore, stream: &muser_kvpack::Digest32) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64);
    now.max(store.high_water(stream).map_or(1, |h| h.saturating_add(1)))
}

fn publish(
    tiers: &Tiers,
    stager: &Stager,
    tokens: &[u32],
    state: &KvState,
) -> Result<(), KvpackError> {
    let ctx = &tiers.ctx;
    let n = tokens.len() as u32;
    if state.positions != (0..n) {
        return Err(KvpackError::InvalidState(
            "an offered state must cover its tokens from position 0".into(),
        ));
    }
    let chain = ctx.hasher.chain(tokens);
    if let Some(m) = &tiers.memory {
        lock(m).insert(state, chain.block_ids())?;
    }
    let cut = chain
        .cut_id(n)
        .ok_or_else(|| KvpackError::InvalidState("empty prefix".into()))?;
    let generation = {
        let store = lock(&tiers.store);
        if store.contains(&cut) {
            return Ok(());
        }
        next_generation(&store, &tiers.stream)
    };
    let spec = PackSpec {
        identity: &ctx.identity,
        chain: &chain,
        generation,
        stream: Some(tiers.stream),
        base_tokens: 0,
        plan: SegmentPlan::default(),
        threads: muser_kvpack::default_threads(),
    };
    let plan = PackPlan::new(state, &ctx.keys, &spec)?;
    let staged = stager.stage(&plan)?;
    lock(&tiers.store).commit(staged)?;
    lock(&tiers.stats).published += 1;
    Ok(())
}
