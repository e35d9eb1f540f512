//! The engine handle: requests in, event streams out, one scheduler thread behind it.
//!
//! [`Engine::start`] spawns the scheduler (see `scheduler.rs`), which owns the KV pool and
//! runs every forward pass. [`Engine::submit`] queues a request (bounded) and returns the
//! receiving end of its event stream; dropping that receiver cancels the request and frees
//! its slot at the next step.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use muser_model::{KvCache, KvType, Model, ModelError};
use muser_spec::SpecOverride;
use muser_text::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::image::{image_ids, PromptImage};
use crate::sampling::{SamplingParams, TokenLogprobs};
use crate::sleep::{serve, SleepConfig};

/// Sizes of the engine, fixed at start.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Concurrent generations (KV sequences).
    pub n_slots: usize,
    /// Context positions per slot.
    pub n_ctx: usize,
    /// Requests waiting for a slot before `submit` answers `QueueFull`.
    pub queue_max: usize,
    pub kv_type: KvType,
    /// Most tokens one forward pass carries: the decode tokens of all busy slots plus a chunk
    /// of one pending prompt.
    pub prefill_chunk: usize,
    /// A request still queued after this long fails; one still generating finishes with
    /// `FinishReason::Length`. `None`: no limit.
    pub request_timeout: Option<Duration>,
    /// Prompt cache across requests and restarts (memory and disk tiers of kvpack packs);
    /// `None`: only each slot's own cache is reused.
    pub prompt_cache: Option<Arc<crate::prompt_cache::PromptCache>>,
    /// Speculative decoding for every generating slot; `None`: plain decoding.
    pub spec: Option<muser_spec::SpecConfig>,
    /// The DFlash drafter `SpecMode::Dflash` drafts with (`--dflash FILE`).
    pub dflash: Option<Arc<muser_model::models::dflash::Dflash>>,
    /// How an embedding request's rows become its [`Event::Embedding`].
    pub pooling: Pooling,
    /// Unload the model (weights and K/V) after this long without work, and load it again
    /// for the next (llama-server's `--sleep-idle-seconds`); `None`: stay loaded.
    pub sleep: Option<SleepConfig>,
}

/// How an embedding request's final-norm hidden states become its embedding (llama-server's
/// `--pooling`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pooling {
    /// The last prompt row's, L2-normalized.
    #[default]
    Last,
    /// The mean of every prompt row's, L2-normalized. Needs every row computed: the prompt
    /// reuses no cached prefix.
    Mean,
    /// Every prompt row's, row after row (`n_prompt × n_embd`), as computed.
    None,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            n_slots: 4,
            n_ctx: 4096,
            queue_max: 64,
            kv_type: KvType::F16,
            prefill_chunk: 512,
            request_timeout: Some(Duration::from_secs(600)),
            prompt_cache: None,
            spec: None,
            dflash: None,
            pooling: Pooling::Last,
            sleep: None,
        }
    }
}

/// One generation (or embedding) request.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Prompt token ids (already templated and tokenized).
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// `None`: until end of generation or the slot's context is full.
    pub max_tokens: Option<u32>,
    /// Generation ends before any of these strings; they are not emitted.
    pub stop: Vec<String>,
    /// Run on this slot (waits for it); `None` picks the idle slot sharing the longest prompt
    /// prefix, else the least recently used one.
    pub slot: Option<usize>,
    /// Reuse the slot's cached K/V for the common prompt prefix.
    pub cache_prompt: bool,
    /// Return the L2-normalized final hidden state of the last prompt token instead of
    /// generating.
    pub embeddings: bool,
    /// Render control tokens (e.g. `<|im_end|>`) in the text.
    pub special: bool,
    /// K/V of a prompt prefix computed elsewhere (a producer of the prefill lane), already
    /// verified, installed instead of computing that prefix.
    pub prefilled: Option<Arc<Prefilled>>,
    /// This request's speculative settings over the engine's ([`EngineConfig::spec`]).
    pub speculative: SpecOverride,
    /// Images among the prompt's rows (ascending, not overlapping), placed by
    /// [`crate::place_images`]; their rows' prompt ids are set by [`Engine::submit`].
    pub images: Vec<PromptImage>,
}

/// A verified K/V state for positions `state.positions` of a request's prompt, computed by
/// another engine. A state starting above 0 (from a delta pack) is installed only on a slot
/// that still holds the prompt's tokens before it; otherwise the request computes the prefix
/// itself, so the result never depends on which slot it landed on.
pub struct Prefilled {
    pub state: muser_kvpack::KvState,
    /// Who computed it (shown in the request's timings).
    pub producer: Arc<str>,
    /// Time spent getting it, which the request's prompt time includes.
    pub took: Duration,
    /// Computed by numerics other than this engine's: the prompt cache never publishes it
    /// as this engine's own.
    pub foreign_abi: bool,
}

impl std::fmt::Debug for Prefilled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefilled")
            .field("positions", &self.state.positions)
            .field("producer", &self.producer)
            .field("took", &self.took)
            .field("foreign_abi", &self.foreign_abi)
            .finish()
    }
}

impl Default for GenerateRequest {
    fn default() -> Self {
        GenerateRequest {
            prompt: Vec::new(),
            params: SamplingParams::default(),
            max_tokens: None,
            stop: Vec::new(),
            slot: None,
            cache_prompt: true,
            embeddings: false,
            special: false,
            prefilled: None,
            speculative: SpecOverride::default(),
            images: Vec::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop string matched.
    Stop,
    /// `max_tokens`, the slot's context or the request timeout was reached.
    Length,
    /// The model produced an end-of-generation token.
    Eog,
    /// The engine shut down.
    Cancelled,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    /// From queueing the request to taking a slot (a prompt-cache load from disk while
    /// queued counts as prompt time, not as waiting).
    pub queue_ms: f64,
    /// From taking a slot to the first sampled token (prompt processing).
    pub prompt_ms: f64,
    /// From the first sampled token to the last.
    pub gen_ms: f64,
    /// The producer whose prefill the request installed (`None`: the prompt was computed
    /// here).
    pub producer: Option<Arc<str>>,
    /// Draft tokens verified and accepted (speculative decoding; 0 without it).
    pub draft_n: usize,
    pub draft_n_accepted: usize,
}

/// What a request's stream carries, in order: `Token`s (or one `Embedding`), then `Done`; or
/// an `Error` as the last event.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A sampled token and the text it completes. `text` may be empty (an incomplete UTF-8
    /// character, or text held back because it may start a stop string) and may carry text
    /// held back by earlier tokens.
    Token {
        id: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    Embedding(Vec<f32>),
    Done {
        reason: FinishReason,
        /// Prompt tokens, of which `n_cached` were not computed: they came from the slot's
        /// cache or were resumed from the prompt cache.
        n_prompt: usize,
        n_cached: usize,
        /// Generated tokens, the end-of-generation token included.
        n_gen: usize,
        timings: Timings,
    },
    Error(String),
    /// The prompt's progress, for a request submitted with
    /// [`Engine::submit_reporting_progress`]: once when its prefill starts, then after each
    /// prefill chunk, always before its first token.
    Progress(Progress),
}

/// How far a prompt's prefill is: `processed` of its `total` tokens are in the slot's cache,
/// `cache` of them reused (the slot's cache, the prompt cache or a producer) rather than
/// computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    pub total: usize,
    pub cache: usize,
    pub processed: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SubmitError {
    #[error("the request queue is full; retry in {retry_after_s} s")]
    QueueFull { retry_after_s: u64 },
    #[error("the prompt has {n_prompt} tokens but a slot holds {n_ctx}")]
    PromptTooLong { n_prompt: usize, n_ctx: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token {id} is outside the vocabulary of {n_vocab}")]
    BadToken { id: u32, n_vocab: usize },
    #[error("there is no slot {slot} (the engine has {n_slots})")]
    NoSuchSlot { slot: usize, n_slots: usize },
    #[error("bad image rows: {0}")]
    BadImage(String),
    #[error(transparent)]
    InvalidParams(#[from] crate::sampling::SamplingError),
    #[error("speculative: {0}")]
    Speculative(#[from] muser_spec::SpecError),
    #[error("the engine has stopped")]
    Stopped,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("bad engine configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("cannot start the engine thread: {0}")]
    Spawn(#[from] std::io::Error),
    #[error("there is no slot {slot} (the engine has {n_slots})")]
    NoSuchSlot { slot: usize, n_slots: usize },
    #[error("slot {0} is busy")]
    SlotBusy(usize),
    #[error("the slot job failed (the slot was reset): {0}")]
    SlotJob(String),
    #[error("the engine has stopped")]
    Stopped,
}

/// Counters for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub n_slots: usize,
    pub busy_slots: usize,
    pub queue_depth: usize,
    pub requests_total: u64,
    pub prompt_tokens_total: u64,
    /// Prompt tokens served from slot caches instead of being processed.
    pub cached_tokens_total: u64,
    pub gen_tokens_total: u64,
    pub prompt_seconds_total: f64,
    pub gen_seconds_total: f64,
    /// Forward passes run.
    pub forward_total: u64,
    /// Slots in each forward pass, summed over the passes (÷ `forward_total`: slots per pass).
    pub slot_forwards_total: u64,
    /// Speculative decoding: verification steps (a decode token with drafts), draft tokens
    /// verified, and accepted.
    pub draft_verifications_total: u64,
    pub draft_tokens_total: u64,
    pub draft_accepted_total: u64,
    /// What one more row adds to a decode step, as a fraction of a one-row step: measured on
    /// the decode batches, it sets how many drafts pay (`muser_spec::best_len`).
    pub draft_row_cost: f32,
    /// Tokens whose K/V the slots hold now.
    pub kv_tokens: usize,
}

impl EngineStats {
    /// Draft tokens accepted per draft token verified since start; `None` before any draft.
    pub fn draft_acceptance(&self) -> Option<f64> {
        (self.draft_tokens_total > 0)
            .then(|| self.draft_accepted_total as f64 / self.draft_tokens_total as f64)
    }
}

/// One slot as `/slots` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotInfo {
    pub id: usize,
    pub busy: bool,
    pub n_ctx: usize,
    /// Tokens whose K/V the slot holds.
    pub n_cached: usize,
    /// Prompt length and tokens generated so far of the running request.
    pub n_prompt: usize,
    pub n_gen: usize,
}

/// A slot's cache, lent to a closure on the engine thread ([`Engine::with_slot`]).
pub struct SlotKv<'a> {
    pub model: &'a Model,
    pub kv: &'a mut KvCache,
    /// The slot's KV sequence id.
    pub seq: u32,
    /// The tokens whose K/V the sequence holds, position order. A closure that changes the
    /// cache must keep this in step.
    pub tokens: &'a mut Vec<u32>,
}

/// A closure run on an idle slot; true when it panicked (the scheduler then resets the slot).
pub(crate) type SlotJob = Box<dyn FnOnce(SlotKv<'_>) -> bool + Send>;

/// Runs `f`, turning a panic into its message: the unit of fault containment. A panic in
/// request-dependent code fails that request (or slot job) alone; the engine serves on.
pub(crate) fn contained<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".to_string())
    })
}

/// A queued request.
pub(crate) struct Job {
    pub req: GenerateRequest,
    pub tx: UnboundedSender<Event>,
    pub enqueued: Instant,
    /// Send [`Event::Progress`] while the prompt is prefilled.
    pub progress: bool,
}

/// What the handle and the scheduler share.
pub(crate) struct Shared {
    pub state: Mutex<SharedState>,
    pub wake: Condvar,
}

#[derive(Default)]
pub(crate) struct SharedState {
    pub queue: VecDeque<Job>,
    pub slot_jobs: Vec<(usize, SlotJob)>,
    pub stats: EngineStats,
    pub slots: Vec<SlotInfo>,
    /// Mean wall time of a finished request, for `retry_after_s`.
    pub mean_request_s: f64,
    pub shutdown: bool,
    pub stopped: bool,
    /// The model is unloaded and nothing has asked for it since.
    pub sleeping: bool,
    /// The last request, slot job, [`Engine::touch`] or generation step: the idle clock of
    /// [`EngineConfig::sleep`].
    pub last_active: Option<Instant>,
}

impl SharedState {
    /// Marks activity; ends a sleep (the engine thread reloads the model).
    pub fn touch(&mut self) {
        self.last_active = Some(Instant::now());
        self.sleeping = false;
    }

    /// Whether work is waiting for the engine thread.
    pub fn has_work(&self) -> bool {
        !self.queue.is_empty() || !self.slot_jobs.is_empty()
    }
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, SharedState> {
        // a panicking scheduler marks `stopped`; the data stays usable
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The running engine. Dropping it stops the scheduler (running requests end `Cancelled`).
pub struct Engine {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    cfg: EngineConfig,
    n_vocab: usize,
    n_embd: usize,
    /// Keys the prompt ids of image rows (drawn at start; see `image.rs`).
    image_key: [u8; 32],
}

impl Engine {
    pub fn start(
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        cfg: EngineConfig,
    ) -> Result<Engine, EngineError> {
        Engine::spawn(model, Some(tokenizer), cfg)
    }

    /// An engine for a model without a tokenizer (synthetic models): token events carry ids
    /// and empty text, and no token ends generation by itself.
    pub fn start_without_tokenizer(
        model: Arc<Model>,
        cfg: EngineConfig,
    ) -> Result<Engine, EngineError> {
        Engine::spawn(model, None, cfg)
    }

    fn spawn(
        model: Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
        cfg: EngineConfig,
    ) -> Result<Engine, EngineError> {
        if cfg.n_slots == 0 || cfg.n_ctx < 2 || cfg.prefill_chunk == 0 {
            return Err(EngineError::Config(
                "n_slots and prefill_chunk must be positive and n_ctx at least 2".into(),
            ));
        }
        if let Some(spec) = &cfg.spec {
            spec.validate()
                .map_err(|e| EngineError::Config(e.to_string()))?;
        }
        let dflash_mode = cfg
            .spec
            .is_some_and(|s| s.mode == muser_spec::SpecMode::Dflash);
        match (&cfg.dflash, dflash_mode) {
            (Some(d), true) => d
                .check_target(&model)
                .map_err(|e| EngineError::Config(format!("the DFlash drafter: {e}")))?,
            (None, false) => {}
            _ => {
                return Err(EngineError::Config(
                    "a DFlash drafter goes with speculative mode dflash, and only with it".into(),
                ))
            }
        }
        let n_ubatch = cfg.prefill_chunk.max(cfg.n_slots);
        let kv = model.new_kv_ubatch(cfg.n_ctx, cfg.n_slots, cfg.kv_type, n_ubatch as u32)?;
        let n_vocab = model.info().n_vocab;
        let n_embd = model.info().n_embd;
        let mut image_key = [0u8; 32];
        getrandom::getrandom(&mut image_key)
            .map_err(|e| EngineError::Config(format!("no randomness for the image key: {e}")))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(SharedState::default()),
            wake: Condvar::new(),
        });
        if let Some(pc) = &cfg.prompt_cache {
            // disk packs load on their own thread; the scheduler looks again when one is ready
            let weak = Arc::downgrade(&shared);
            pc.set_waker(Arc::new(move || {
                if let Some(sh) = weak.upgrade() {
                    sh.wake.notify_all();
                }
            }));
        }
        shared.lock().touch();
        let thread_shared = shared.clone();
        let thread_cfg = cfg.clone();
        let thread = std::thread::Builder::new()
            .name("muser-engine".into())
            .spawn(move || {
                let tok = tokenizer.as_deref();
                let run = std::panic::AssertUnwindSafe(|| {
                    serve(model, kv, tok, &thread_cfg, &thread_shared)
                });
                let failed = std::panic::catch_unwind(run).is_err();
                let mut st = thread_shared.lock();
                st.stopped = true;
                let msg = if failed {
                    "the engine thread failed"
                } else {
                    "the engine has stopped"
                };
                for job in st.queue.drain(..) {
                    let _ = job.tx.send(Event::Error(msg.to_string()));
                }
            })?;
        Ok(Engine {
            shared,
            thread: Some(thread),
            cfg,
            n_vocab,
            n_embd,
            image_key,
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Counts as activity for [`EngineConfig::sleep`]: restarts the idle clock, and wakes a
    /// sleeping engine (which loads its model again) without waiting for it. A server calls
    /// it for every request that is not read-only.
    pub fn touch(&self) {
        self.shared.lock().touch();
        self.shared.wake.notify_all();
    }

    /// True while the model is unloaded and no request has woken the engine.
    pub fn is_sleeping(&self) -> bool {
        self.shared.lock().sleeping
    }

    /// Queues a request; its events arrive on the returned receiver.
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Event>, SubmitError> {
        self.enqueue(req, false)
    }

    /// [`Engine::submit`], with [`Event::Progress`] reports while the prompt is prefilled
    /// (llama-server's `return_progress`).
    pub fn submit_reporting_progress(
        &self,
        req: GenerateRequest,
    ) -> Result<UnboundedReceiver<Event>, SubmitError> {
        self.enqueue(req, true)
    }

    fn enqueue(
        &self,
        mut req: GenerateRequest,
        progress: bool,
    ) -> Result<UnboundedReceiver<Event>, SubmitError> {
        self.check(&req)?;
        for img in &req.images {
            let ids = image_ids(&self.image_key, &img.digest, img.n_tokens);
            req.prompt[img.span()].copy_from_slice(&ids);
        }
        // pooling over every row computes every row
        if req.embeddings && self.cfg.pooling != Pooling::Last {
            req.cache_prompt = false;
        }
        let mut st = self.shared.lock();
        if st.stopped || st.shutdown {
            return Err(SubmitError::Stopped);
        }
        if st.queue.len() >= self.cfg.queue_max {
            let waves = (st.queue.len() / self.cfg.n_slots + 1) as f64;
            let retry_after_s = (st.mean_request_s * waves).ceil().clamp(1.0, 60.0) as u64;
            return Err(SubmitError::QueueFull { retry_after_s });
        }
        st.touch();
        let (tx, rx) = unbounded_channel();
        st.queue.push_back(Job {
            req,
            tx,
            enqueued: Instant::now(),
            progress,
        });
        st.stats.queue_depth = st.queue.len();
        drop(st);
        self.shared.wake.notify_all();
        Ok(rx)
    }

    fn check(&self, req: &GenerateRequest) -> Result<(), SubmitError> {
        let n_prompt = req.prompt.len();
        if n_prompt == 0 {
            return Err(SubmitError::EmptyPrompt);
        }
        if n_prompt >= self.cfg.n_ctx {
            return Err(SubmitError::PromptTooLong {
                n_prompt,
                n_ctx: self.cfg.n_ctx,
            });
        }
        if let Some(&id) = req.prompt.iter().find(|&&t| t as usize >= self.n_vocab) {
            return Err(SubmitError::BadToken {
                id,
                n_vocab: self.n_vocab,
            });
        }
        self.check_images(req)?;
        if let Some(slot) = req.slot.filter(|&s| s >= self.cfg.n_slots) {
            return Err(SubmitError::NoSuchSlot {
                slot,
                n_slots: self.cfg.n_slots,
            });
        }
        req.params.validate()?;
        req.speculative.apply(self.cfg.spec)?;
        Ok(())
    }

    /// Image spans ascend inside the prompt without overlapping, before its last row, each
    /// with its values, and none on a request for embeddings.
    fn check_images(&self, req: &GenerateRequest) -> Result<(), SubmitError> {
        let bad = |m: String| Err(SubmitError::BadImage(m));
        if req.embeddings && !req.images.is_empty() {
            return bad("an embeddings request takes text only".into());
        }
        let mut free = 0;
        for img in &req.images {
            let span = img.span();
            if img.n_tokens == 0 || span.start < free || span.end >= req.prompt.len() {
                return bad(format!(
                    "image rows {span:?} do not fit a {}-token prompt after row {free}",
                    req.prompt.len()
                ));
            }
            if img.values.len() != img.n_tokens * self.n_embd {
                return bad(format!(
                    "{} values for {} rows of width {}",
                    img.values.len(),
                    img.n_tokens,
                    self.n_embd
                ));
            }
            free = span.end;
        }
        Ok(())
    }

    pub fn stats(&self) -> EngineStats {
        self.shared.lock().stats.clone()
    }

    pub fn slots(&self) -> Vec<SlotInfo> {
        self.shared.lock().slots.clone()
    }

    /// Runs `f` on the engine thread with an idle slot's cache (for saving, restoring or
    /// moving K/V), between two forward passes. Fails if the slot is busy.
    pub fn with_slot<R, F>(&self, slot: usize, f: F) -> Result<R, EngineError>
    where
        R: Send + 'static,
        F: FnOnce(SlotKv<'_>) -> R + Send + 'static,
    {
        if slot >= self.cfg.n_slots {
            return Err(EngineError::NoSuchSlot {
                slot,
                n_slots: self.cfg.n_slots,
            });
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let job: SlotJob = Box::new(move |kv: SlotKv<'_>| {
            let result = contained(|| f(kv));
            let panicked = result.is_err();
            let _ = tx.send(result);
            panicked
        });
        {
            let mut st = self.shared.lock();
            if st.stopped || st.shutdown {
                return Err(EngineError::Stopped);
            }
            st.slot_jobs.push((slot, job));
            st.touch();
        }
        self.shared.wake.notify_all();
        // the scheduler drops the job unrun when the slot is busy
        match rx.recv() {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(msg)) => Err(EngineError::SlotJob(msg)),
            Err(_) if self.shared.lock().stopped => Err(EngineError::Stopped),
            Err(_) => Err(EngineError::SlotBusy(slot)),
        }
    }

    /// False once the engine thread has ended (shut down, or failed outside any request):
    /// `/health` reports it and the server exits.
    pub fn is_running(&self) -> bool {
        let st = self.shared.lock();
        !st.stopped && !st.shutdown
    }

    /// Forgets a slot's cached prompt.
    pub fn erase_slot(&self, slot: usize) -> Result<(), EngineError> {
        self.with_slot(slot, |s| {
            s.kv.clear(s.seq);
            s.tokens.clear();
        })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
