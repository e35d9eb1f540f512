//! The engine thread: slots, admission, and one forward pass per step.
//!
//! Every step gathers the pending decode token of each generating slot plus a chunk of one
//! prompt still being processed (the oldest), up to `prefill_chunk` tokens, into a single
//! `Batch`; runs it; then samples for the rows that asked for logits. A slot keeps the tokens
//! whose K/V it holds after its request ends, so a later prompt sharing a prefix only
//! processes the rest.
//!
//! Speculative decoding: a generating slot may follow its decode token with draft tokens
//! (muser-spec). Every row is sampled in order as a plain step would sample it; a draft is
//! accepted while it equals the token sampled before it, the first token that differs (or
//! the token after the last draft) is the bonus, and the cache rolls back to the accepted
//! prefix ([`KvCache::rollback`]). Sampling from the target and comparing is speculative
//! rejection sampling for a drafter that proposes one token with certainty: a draft `d` is
//! accepted with probability `p(d)`, and the emitted token is distributed as `p`. A
//! verifying slot's rows are computed alone (`Batch::lone_seqs`: each row with the kernels
//! and the view of the cache of a one-token step at its position), so verification never
//! changes a token; drafts are made only where the model can (`Model::computes_rows_alone`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use muser_model::{Batch, KvCache, KvMark, Model, ModelError, Output};
use muser_spec::{DflashDrafter, Drafting, RowCost, SpecMode};
use muser_text::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::detok::Detok;
use crate::engine::{
    contained, EngineConfig, EngineStats, Event, FinishReason, GenerateRequest, Job, Pooling,
    Progress, Shared, SharedState, SlotInfo, SlotKv, Timings,
};
use crate::kvpack_bridge::{snapshot_to_state, state_to_snapshot};
use crate::prompt_cache::{Lookup, Resume};
use crate::sampling::{Sampled, Sampler};
use crate::sleep::{idle_wait, Exit};
use crate::stop::StopMatcher;

pub(crate) struct Scheduler<'t> {
    model: Arc<Model>,
    tok: Option<&'t Tokenizer>,
    kv: KvCache,
    cfg: EngineConfig,
    shared: Arc<Shared>,
    slots: Vec<Slot<'t>>,
    stats: EngineStats,
    /// Admissions so far; orders prefills and slot reuse.
    tick: u64,
    /// The DFlash drafter's caches (speculative mode dflash): fed after every batch.
    dflash: Option<DflashDrafter>,
    /// Forward times of decode batches: what a draft row costs.
    row_cost: RowCost,
}

struct Slot<'t> {
    /// Tokens whose K/V sequence `id` holds, position order.
    tokens: Vec<u32>,
    /// Some of that K/V came from other numerics (a producer's): never offered to the prompt
    /// cache, which would publish it as this engine's own.
    foreign: bool,
    last_used: u64,
    task: Option<Task<'t>>,
}

enum Phase {
    /// Processing the prompt; `tokens.len()` of it are in the cache.
    Prefill,
    /// This sampled token goes into the cache next.
    Decode(u32),
}

struct Task<'t> {
    req: GenerateRequest,
    tx: UnboundedSender<Event>,
    sampler: Sampler,
    stop: StopMatcher,
    detok: Detok<'t>,
    phase: Phase,
    n_cached: usize,
    /// Prompt length at which the prefill pauses to offer its prefix to the prompt cache.
    publish_at: Option<usize>,
    /// Longest prefix offered to the prompt cache so far.
    published: usize,
    n_gen: usize,
    admitted_tick: u64,
    enqueued: Instant,
    started: Instant,
    first_token: Option<Instant>,
    deadline: Option<Instant>,
    /// The producer whose prefill was installed.
    producer: Option<Arc<str>>,
    /// Speculative decoding for this request.
    drafting: Option<Drafting>,
    /// Draft tokens verified and accepted.
    draft_n: usize,
    draft_n_accepted: usize,
    /// Report the prompt's progress ([`Event::Progress`]).
    progress: bool,
    /// An embedding request pooling every row: their hidden states so far (summed for
    /// [`Pooling::Mean`], one after another for [`Pooling::None`]).
    pooled: Vec<f32>,
}

impl Task<'_> {
    /// Reports the prompt's progress when the request asked for it.
    fn report_progress(&self, processed: usize) {
        if self.progress {
            let _ = self.tx.send(Event::Progress(Progress {
                total: self.req.prompt.len(),
                cache: self.n_cached,
                processed,
            }));
        }
    }
}

/// Which slot a batch row belongs to and whether it samples.
#[derive(Clone, Copy)]
struct Row {
    slot: usize,
    /// The last prompt token or a decode token: its output is sampled (or pooled).
    samples: bool,
    /// A draft token: taken only if the row before it sampled exactly this token.
    draft: bool,
}

/// A slot's decode row followed by draft rows, and how to undo the drafts.
struct Verify {
    /// Batch index of the decode row; the drafts follow it.
    first: usize,
    n_drafts: usize,
    mark: KvMark,
}

/// What the forward pass answered for one output row.
#[derive(Clone, Copy)]
enum Answer<'o> {
    Logits(&'o [f32]),
    Token(u32),
}

impl<'t> Scheduler<'t> {
    pub fn new(
        model: Arc<Model>,
        tok: Option<&'t Tokenizer>,
        kv: KvCache,
        cfg: EngineConfig,
        shared: Arc<Shared>,
    ) -> Self {
        let slots = (0..cfg.n_slots)
            .map(|_| Slot {
                tokens: Vec::new(),
                foreign: false,
                last_used: 0,
                task: None,
            })
            .collect();
        let stats = EngineStats {
            n_slots: cfg.n_slots,
            ..Default::default()
        };
        let dflash = cfg
            .dflash
            .clone()
            .map(|d| DflashDrafter::new(d, cfg.n_slots));
        Scheduler {
            model,
            tok,
            kv,
            cfg,
            shared,
            slots,
            stats,
            tick: 0,
            dflash,
            row_cost: RowCost::default(),
        }
    }

    /// Runs requests until the engine shuts down or, with [`EngineConfig::sleep`], has been
    /// idle long enough to unload its model.
    pub fn run(mut self) -> Exit {
        let exit = loop {
            match self.take_work() {
                Some(exit) => break exit,
                None => self.step(),
            }
        };
        for s in 0..self.slots.len() {
            self.finish(s, FinishReason::Cancelled);
        }
        self.publish();
        exit
    }

    // ---- admission -------------------------------------------------------------------------

    /// Runs slot jobs, drops dead queue entries and admits requests to idle slots; blocks while
    /// there is nothing to run. `None`: a step to take; else why the run ends.
    fn take_work(&mut self) -> Option<Exit> {
        let shared = self.shared.clone();
        let mut st = shared.lock();
        loop {
            if st.shutdown {
                return Some(Exit::Shutdown);
            }
            let jobs = std::mem::take(&mut st.slot_jobs);
            if !jobs.is_empty() {
                drop(st);
                for (slot, job) in jobs {
                    self.run_slot_job(slot, job);
                }
                self.publish();
                st = shared.lock();
                continue;
            }
            self.expire_queued(&mut st);
            self.admit(&mut st);
            self.publish_into(&mut st);
            if self.slots.iter().any(|s| s.task.is_some()) {
                st.last_active = Some(Instant::now());
                return None;
            }
            let Some(wait) = idle_wait(self.cfg.sleep.as_ref(), &st) else {
                return Some(Exit::Sleep);
            };
            st = shared
                .wake
                .wait_timeout(st, wait.max(Duration::from_millis(1)))
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    fn run_slot_job(&mut self, slot: usize, job: crate::engine::SlotJob) {
        // a busy slot drops the job, which the caller sees as `SlotBusy`
        let Some(s) = self.slots.get_mut(slot) else {
            return;
        };
        if s.task.is_some() {
            return;
        }
        let before = s.tokens.clone();
        let panicked = job(SlotKv {
            model: &self.model,
            kv: &mut self.kv,
            seq: slot as u32,
            tokens: &mut s.tokens,
        });
        if panicked {
            // the job stopped half way: what the slot holds is unknown
            self.kv.clear(slot as u32);
            self.slots[slot].tokens.clear();
            self.slots[slot].foreign = false;
        } else if self.slots[slot].tokens != before {
            // a job that replaced the K/V (a restore, an erase) put this engine's own in its place
            self.slots[slot].foreign = false;
        }
    }

    fn expire_queued(&mut self, st: &mut SharedState) {
        let timeout = self.cfg.request_timeout;
        let now = Instant::now();
        st.queue.retain(|job| {
            if job.tx.is_closed() {
                return false;
            }
            match timeout {
                Some(t) if now.duration_since(job.enqueued) >= t => {
                    let _ = job.tx.send(Event::Error(format!(
                        "timed out after {} s waiting for a free slot",
                        t.as_secs_f64()
                    )));
                    false
                }
                _ => true,
            }
        });
    }

    fn admit(&mut self, st: &mut SharedState) {
        let mut i = 0;
        while i < st.queue.len() {
            match self.pick_slot(&st.queue[i].req) {
                Some(slot) => {
                    // a prefix being loaded from disk: the request waits in the queue
                    let resume = match self.lookup(slot, &st.queue[i].req) {
                        Lookup::Wait => {
                            i += 1;
                            continue;
                        }
                        Lookup::Ready(r) => r,
                    };
                    if let Some(job) = st.queue.remove(i) {
                        self.start_contained(slot, job, resume);
                    }
                }
                None => i += 1,
            }
            if self.slots.iter().all(|s| s.task.is_some()) {
                break;
            }
        }
    }

    /// The requested slot if idle; else the idle slot sharing the longest prefix with the
    /// prompt, then the least recently used.
    fn pick_slot(&self, req: &GenerateRequest) -> Option<usize> {
        if let Some(s) = req.slot {
            return self.slots.get(s).filter(|s| s.task.is_none()).map(|_| s);
        }
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.task.is_none())
            .max_by_key(|(_, s)| {
                let shared = if req.cache_prompt {
                    common_prefix(&s.tokens, &req.prompt)
                } else {
                    0
                };
                (shared, std::cmp::Reverse(s.last_used))
            })
            .map(|(i, _)| i)
    }

    /// What the prompt cache offers for `req` on `slot` beyond the slot's own cache.
    fn lookup(&self, slot: usize, req: &GenerateRequest) -> Lookup {
        match &self.cfg.prompt_cache {
            Some(pc) if req.cache_prompt => {
                let have = self.reusable_prefix(slot, req);
                pc.lookup(&req.prompt, req.prompt.len() - 1, have)
            }
            _ => Lookup::Ready(None),
        }
    }

    /// [`Self::start`], where a panic fails this request alone and resets the slot.
    fn start_contained(&mut self, slot: usize, job: Job, resume: Option<Resume>) {
        let tx = job.tx.clone();
        if let Err(msg) = contained(|| self.start(slot, job, resume)) {
            self.slots[slot].task = None;
            self.kv.clear(slot as u32);
            self.slots[slot].tokens.clear();
            self.slots[slot].foreign = false;
            let _ = tx.send(Event::Error(format!("starting the request failed: {msg}")));
        }
    }

    fn start(&mut self, slot: usize, job: Job, resume: Option<Resume>) {
        let Job {
            mut req,
            tx,
            enqueued,
            progress,
        } = job;
        let mut sampler = match Sampler::new(&req.params, self.cfg.n_ctx) {
            Ok(s) => s,
            Err(e) => {
                let _ = tx.send(Event::Error(e.to_string()));
                return;
            }
        };
        sampler.accept_prompt(&req.prompt);
        let mut keep = self.reusable_prefix(slot, &req);
        let seq = slot as u32;
        if keep == 0 {
            self.kv.clear(seq);
            self.slots[slot].foreign = false;
        } else {
            self.kv.truncate(seq, keep as u32);
        }
        self.slots[slot].tokens.truncate(keep);
        // the prompt time includes getting a resumed prefix (a disk load ran while queued)
        // or a producer's prefill
        let mut started = Instant::now();
        let mut producer = None;
        if let Some(p) = req.prefilled.take() {
            started = started.checked_sub(p.took).unwrap_or(started);
            if let Some(n) = self.install(slot, p, &req.prompt, keep, &mut producer) {
                keep = n;
            }
        }
        let mut publish_at = None;
        if let Some(pc) = self.cfg.prompt_cache.clone().filter(|_| req.cache_prompt) {
            if let Some(r) = resume {
                started = started.checked_sub(r.took).unwrap_or(started);
                if let Some(n) = self.resume(slot, r, &req.prompt, keep) {
                    keep = n;
                }
            }
            publish_at = pc
                .publish_cut(req.prompt.len())
                .map(|c| c as usize)
                .filter(|&c| c > keep && !self.slots[slot].foreign);
        }
        self.tick += 1;
        // `Engine::submit` refused an override that does not apply
        let drafting = match req.embeddings {
            true => None,
            false => req.speculative.apply(self.cfg.spec).ok().flatten(),
        }
        .map(Drafting::new);
        let s = &mut self.slots[slot];
        s.last_used = self.tick;
        s.task = Some(Task {
            stop: StopMatcher::new(&req.stop),
            detok: Detok::new(self.tok, req.special),
            deadline: self.cfg.request_timeout.map(|t| enqueued + t),
            req,
            tx,
            sampler,
            phase: Phase::Prefill,
            n_cached: keep,
            publish_at,
            published: 0,
            n_gen: 0,
            admitted_tick: self.tick,
            enqueued,
            started,
            first_token: None,
            producer,
            drafting,
            draft_n: 0,
            draft_n_accepted: 0,
            progress,
            pooled: Vec::new(),
        });
        if let Some(t) = &s.task {
            t.report_progress(keep);
        }
        self.stats.requests_total += 1;
    }

    /// Installs a producer's K/V of `prompt[state.positions]` on the slot, which holds the
    /// prompt's first `have` tokens. Returns the tokens the slot now holds, or `None` when it
    /// is unchanged (the state is not longer than what the slot has, or a delta's base is
    /// not on this slot).
    fn install(
        &mut self,
        slot: usize,
        p: Arc<crate::engine::Prefilled>,
        prompt: &[u32],
        have: usize,
        producer: &mut Option<Arc<str>>,
    ) -> Option<usize> {
        let p = Arc::try_unwrap(p).unwrap_or_else(|p| crate::engine::Prefilled {
            state: p.state.clone(),
            producer: p.producer.clone(),
            took: p.took,
            foreign_abi: p.foreign_abi,
        });
        let r = p.state.positions.clone();
        let (base, n) = (r.start as usize, r.end as usize);
        let seq = slot as u32;
        if n <= have || n >= prompt.len() || base > have || !self.holds_window(seq, base) {
            tracing::info!(
                producer = %p.producer,
                "prefill lane: the slot does not hold the delta's base; computing the prompt here"
            );
            return None;
        }
        let snap = match state_to_snapshot(p.state, self.kv.layout()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "prefill lane: the state does not fit the cache");
                return None;
            }
        };
        if base == 0 {
            self.kv.clear(seq);
        } else {
            self.kv.truncate(seq, base as u32);
        }
        let s = &mut self.slots[slot];
        s.tokens.truncate(base);
        match self.kv.import(seq, &snap) {
            Ok(()) => {
                s.tokens.extend_from_slice(&prompt[base..n]);
                s.foreign |= p.foreign_abi;
                *producer = Some(p.producer);
                Some(n)
            }
            Err(e) => {
                tracing::warn!(error = %e, "prefill lane: importing the state failed");
                self.kv.clear(seq);
                s.tokens.clear();
                s.foreign = false;
                Some(0)
            }
        }
    }

    /// Whether a token at position `at` finds every row it attends to in the slot.
    fn holds_window(&self, seq: u32, at: usize) -> bool {
        self.kv.holds_window(seq, at as u32)
    }

    /// Imports a prefix of `prompt` resumed from the prompt cache into the slot when it is
    /// longer than the slot's own `have` tokens. Returns the tokens the slot now holds, or
    /// `None` when it is unchanged.
    fn resume(&mut self, slot: usize, r: Resume, prompt: &[u32], have: usize) -> Option<usize> {
        let n = r.state.positions.end as usize;
        if n <= have || n >= prompt.len() {
            return None;
        }
        let snap = match state_to_snapshot(r.state, self.kv.layout()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "prompt cache: resumed state does not fit the cache");
                return None;
            }
        };
        let seq = slot as u32;
        self.kv.clear(seq);
        self.slots[slot].foreign = false;
        let tokens = &mut self.slots[slot].tokens;
        tokens.clear();
        match self.kv.import(seq, &snap) {
            Ok(()) => {
                tokens.extend_from_slice(&prompt[..n]);
                Some(n)
            }
            Err(e) => {
                tracing::warn!(error = %e, "prompt cache: importing a resumed prefix failed");
                self.kv.clear(seq);
                Some(0)
            }
        }
    }

    /// Offers the slot's first `n` tokens' K/V to the prompt cache (when the cache holds every
    /// row an export needs). True when offered.
    fn offer(&mut self, slot: usize, n: usize) -> bool {
        let Some(pc) = self.cfg.prompt_cache.clone() else {
            return false;
        };
        let seq = slot as u32;
        if n == 0 || self.slots[slot].foreign || !self.kv.holds(seq, 0..n as u32) {
            return false;
        }
        let exported = contained(|| {
            let snap = self
                .kv
                .export(seq, 0..n as u32)
                .map_err(|e| e.to_string())?;
            let tokens = self.slots[slot].tokens[..n].to_vec();
            pc.offer(tokens, snapshot_to_state(snap));
            Ok::<_, String>(())
        });
        match exported {
            Ok(Ok(())) => true,
            Ok(Err(e)) | Err(e) => {
                tracing::debug!(error = %e, "prompt cache: export");
                false
            }
        }
    }

    /// Offers the prefixes of prefills that just reached their publish cut.
    fn offer_prefixes(&mut self, rows: &[Row]) {
        if self.cfg.prompt_cache.is_none() {
            return;
        }
        let mut touched: Vec<usize> = rows.iter().map(|r| r.slot).collect();
        touched.dedup();
        for slot in touched {
            let s = &self.slots[slot];
            let Some(t) = &s.task else { continue };
            let Some(cut) = t.publish_at.filter(|&c| c == s.tokens.len()) else {
                continue;
            };
            let offered = self.offer(slot, cut);
            if let Some(t) = &mut self.slots[slot].task {
                t.publish_at = None;
                if offered {
                    t.published = cut;
                }
            }
        }
    }

    /// How many leading prompt tokens the slot's cache can serve. At least one prompt token is
    /// always processed (its logits start the generation). For sliding-window models a cache
    /// cut back below its end is used only if the window before the cut is still stored.
    fn reusable_prefix(&self, slot: usize, req: &GenerateRequest) -> usize {
        if !req.cache_prompt {
            return 0;
        }
        let cached = &self.slots[slot].tokens;
        let keep = common_prefix(cached, &req.prompt).min(req.prompt.len() - 1);
        if keep == 0 || keep == cached.len() || self.holds_window(slot as u32, keep) {
            keep
        } else {
            0
        }
    }

    // ---- one step --------------------------------------------------------------------------

    fn step(&mut self) {
        self.reap();
        let (mut batch, rows, verifies) = self.gather();
        if batch.is_empty() {
            return;
        }
        if let Some(d) = &self.dflash {
            batch.capture_layers = d.target_layers().to_vec();
        }
        // a panic in the model fails this batch's requests, not the engine
        let started = Instant::now();
        let result = contained(|| self.model.forward(&mut self.kv, &batch)).unwrap_or_else(|msg| {
            Err(ModelError::BadBatch(format!(
                "the forward pass panicked: {msg}"
            )))
        });
        // decode rows only (each samples): the batches whose time says what a row costs
        if rows.iter().all(|r| r.samples) {
            self.row_cost
                .observe(batch.len(), started.elapsed().as_secs_f64());
            self.stats.draft_row_cost = self.row_cost.row_ratio();
        }
        self.stats.forward_total += 1;
        // a batch's rows are grouped by slot
        self.stats.slot_forwards_total +=
            1 + rows.windows(2).filter(|w| w[0].slot != w[1].slot).count() as u64;
        match result {
            Ok(out) => {
                if let Some(d) = &mut self.dflash {
                    d.observe(&batch, &out);
                }
                self.apply(&batch, &rows, verifies, &out)
            }
            Err(e) => {
                let mut failed: Vec<usize> = rows.iter().map(|r| r.slot).collect();
                failed.dedup();
                for s in failed {
                    self.fail(s, &format!("forward pass failed: {e}"));
                }
            }
        }
        self.publish();
    }

    /// Ends requests whose receiver is gone or whose time is up.
    fn reap(&mut self) {
        let now = Instant::now();
        for s in 0..self.slots.len() {
            let Some(t) = &self.slots[s].task else {
                continue;
            };
            if t.tx.is_closed() {
                self.finish(s, FinishReason::Cancelled);
            } else if t.deadline.is_some_and(|d| now >= d) {
                self.finish(s, FinishReason::Length);
            }
        }
    }

    /// The decode token of every generating slot (with its drafts when it speculates), then a
    /// chunk of the oldest prefill.
    fn gather(&mut self) -> (Batch, Vec<Row>, Vec<Verify>) {
        let mut batch = Batch::default();
        let mut rows = Vec::new();
        let mut verifies = Vec::new();
        let decoding = self
            .slots
            .iter()
            .filter(|s| {
                matches!(
                    s.task,
                    Some(Task {
                        phase: Phase::Decode(_),
                        ..
                    })
                )
            })
            .count();
        // drafts take what the batch has left after every slot's decode token, where rows
        // can be computed as one-token steps (so a verification changes no token)
        let mut room = match self.model.computes_rows_alone() {
            true => self.cfg.prefill_chunk.saturating_sub(decoding),
            false => 0,
        };
        for i in 0..self.slots.len() {
            let Some(Task {
                phase: Phase::Decode(id),
                ..
            }) = self.slots[i].task
            else {
                continue;
            };
            let drafts = self.drafts(i, id, room);
            let seq = i as u32;
            let pos = self.slots[i].tokens.len() as u32;
            let mark = match drafts.is_empty() {
                true => None,
                false => self.kv.mark(seq, 1 + drafts.len() as u32).ok(),
            };
            let drafts = if mark.is_some() { drafts } else { Vec::new() };
            room -= drafts.len();
            if let Some(mark) = mark {
                batch.lone_seqs.push(seq);
                verifies.push(Verify {
                    first: batch.len(),
                    n_drafts: drafts.len(),
                    mark,
                });
            }
            // A plain greedy step needs only the row's argmax, which a fused device forward
            // hands over without moving the logits.
            let argmax = self.slots[i]
                .task
                .as_ref()
                .is_some_and(|t| t.sampler.plain_greedy());
            for (k, tok) in std::iter::once(id).chain(drafts).enumerate() {
                let p = pos + k as u32;
                if argmax {
                    batch.push_argmax(tok, p, seq);
                } else {
                    batch.push(tok, p, seq, true);
                }
                rows.push(Row {
                    slot: i,
                    samples: true,
                    draft: k > 0,
                });
            }
        }
        let budget = self.cfg.prefill_chunk.saturating_sub(batch.len());
        let prefill = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match &s.task {
                Some(
                    t @ Task {
                        phase: Phase::Prefill,
                        ..
                    },
                ) => Some((t.admitted_tick, i)),
                _ => None,
            })
            .min();
        if let (Some((_, i)), true) = (prefill, budget > 0) {
            let s = &self.slots[i];
            let Some(t) = &s.task else {
                return (batch, rows, verifies);
            };
            let done = s.tokens.len();
            let mut end = t.req.prompt.len().min(done + budget);
            // stop at the publish cut, so that the prefix can be exported exactly there
            if let Some(cut) = t.publish_at.filter(|&c| done < c && c < end) {
                end = cut;
            }
            // an image's rows never share a chunk with the text around them (mtmd's schedule)
            for span in t.req.images.iter().map(|img| img.span()) {
                if done < span.start {
                    end = end.min(span.start);
                } else if done < span.end {
                    end = end.min(span.end);
                }
            }
            let n_embd = self.model.info().n_embd;
            for img in &t.req.images {
                let span = img.span();
                let (from, to) = (span.start.max(done), span.end.min(end));
                for p in from..to {
                    batch.input_embd.rows.push(batch.len() + p - done);
                }
                if from < to {
                    let rows = (from - span.start) * n_embd..(to - span.start) * n_embd;
                    batch.input_embd.values.extend_from_slice(&img.values[rows]);
                }
            }
            // pooling over every row needs every row's hidden state
            let every_row = t.req.embeddings && self.cfg.pooling != Pooling::Last;
            for (k, &id) in t.req.prompt[done..end].iter().enumerate() {
                let last = done + k + 1 == t.req.prompt.len();
                batch.push(id, (done + k) as u32, i as u32, last || every_row);
                rows.push(Row {
                    slot: i,
                    samples: last,
                    draft: false,
                });
                batch.embeddings |= (last || every_row) && t.req.embeddings;
            }
        }
        (batch, rows, verifies)
    }

    /// Draft tokens to follow slot `i`'s decode token `id`: at most `room`, none past the
    /// context or the request's token budget, and none from an end-of-generation token on.
    fn drafts(&mut self, i: usize, id: u32, room: usize) -> Vec<u32> {
        let (n_ctx, tok) = (self.cfg.n_ctx, self.tok);
        let row_cost = self.row_cost.row_ratio();
        let Slot { tokens, task, .. } = &mut self.slots[i];
        let (model, dflash) = (&self.model, &mut self.dflash);
        let Some(t) = task else {
            return Vec::new();
        };
        let Some(d) = &mut t.drafting else {
            return Vec::new();
        };
        // a verification emits up to one token more than it drafts
        let left = t
            .req
            .max_tokens
            .map_or(usize::MAX, |m| (m as usize).saturating_sub(t.n_gen + 1));
        let room = room.min(left).min(n_ctx.saturating_sub(tokens.len() + 1));
        if room == 0 {
            return Vec::new();
        }
        let mut drafts = match (d.mode(), dflash) {
            (SpecMode::Dflash, Some(df)) => {
                let pos = tokens.len() as u32;
                d.propose_with(room, row_cost, |max| {
                    // a failed draft is no draft: the slot decodes plainly this step
                    df.propose(model, i as u32, id, pos, max)
                        .unwrap_or_default()
                })
            }
            _ => {
                tokens.push(id);
                let drafts = d.propose(tokens, room, row_cost);
                tokens.pop();
                drafts
            }
        };
        // a draft never names an image row (it lies outside the vocabulary)
        if let Some(i) = drafts.iter().position(|&t| t >= crate::IMAGE_ID_BASE) {
            drafts.truncate(i);
        }
        // no draft is an end of generation: the row before it samples that token itself, and
        // the rows from it on would be verified for nothing (the n-gram drafter copies the
        // chat template's turn ends, and the next turn's header, from the prompt)
        if let Some(i) = drafts
            .iter()
            .position(|&t| tok.is_some_and(|tk| tk.is_eog(t)))
        {
            drafts.truncate(i);
        }
        drafts
    }

    /// Records what went into the cache and handles every output row.
    fn apply(&mut self, batch: &Batch, rows: &[Row], verifies: Vec<Verify>, out: &Output) {
        // drafts go into a slot's tokens as they are accepted
        for (b, row) in rows.iter().enumerate().filter(|(_, r)| !r.draft) {
            self.slots[row.slot].tokens.push(batch.tokens[b]);
        }
        // the prefill's chunk is in: its progress goes out before its first token
        if let Some(&Row { slot, .. }) = rows.last() {
            let s = &self.slots[slot];
            if let Some(t) = s
                .task
                .as_ref()
                .filter(|t| matches!(t.phase, Phase::Prefill))
            {
                t.report_progress(s.tokens.len());
            }
        }
        self.offer_prefixes(rows);
        let n_vocab = self.model.info().n_vocab;
        let n_embd = self.model.info().n_embd;
        let mut answers: Vec<Option<Answer>> = vec![None; rows.len()];
        for (r, &b) in out.rows.iter().enumerate() {
            answers[b] = Some(Answer::Logits(out.row(r, n_vocab)));
        }
        // rows answered with their argmax (plain greedy decode steps on a fused device)
        for &(b, id) in &out.argmax {
            answers[b] = Some(Answer::Token(id));
        }
        if self.cfg.pooling != Pooling::Last && !out.embeddings.is_empty() {
            self.pool_rows(out, rows, n_embd);
        }
        let mut verifies = verifies.into_iter().peekable();
        for (b, &row) in rows.iter().enumerate() {
            if !row.samples || row.draft {
                continue;
            }
            if let Some(v) = verifies.next_if(|v| v.first == b) {
                self.verify(v, batch, row.slot, &answers);
                continue;
            }
            let Some(task) = &self.slots[row.slot].task else {
                continue;
            };
            let (embeddings, zero) = (task.req.embeddings, task.req.max_tokens == Some(0));
            let Some(answer) = answers[b] else { continue };
            // sampling, grammar, detokenization and stop strings run on request data: a
            // panic in them fails this request and resets its slot
            let handled = contained(|| {
                if embeddings {
                    let r = out.rows.iter().position(|&x| x == b).unwrap_or(0);
                    let e = out.embeddings.get(r * n_embd..(r + 1) * n_embd);
                    self.embed(row.slot, e.unwrap_or_default());
                } else if zero {
                    self.finish(row.slot, FinishReason::Length);
                } else if let Some(t) = &mut self.slots[row.slot].task {
                    let sampled = t.pick(answer);
                    self.emit(row.slot, sampled);
                }
            });
            if let Err(msg) = handled {
                self.fail(row.slot, &format!("sampling failed: {msg}"));
            }
        }
    }

    /// Samples a speculating slot's rows in order: each draft is taken while it equals the
    /// token sampled before it; the first token that differs, or the one after the last
    /// draft, ends the step, and the cache rolls back to what was taken.
    fn verify(&mut self, v: Verify, batch: &Batch, slot: usize, answers: &[Option<Answer>]) {
        let Verify {
            first,
            n_drafts,
            mark,
        } = v;
        let mut mark = Some(mark);
        self.stats.draft_verifications_total += 1;
        self.stats.draft_tokens_total += n_drafts as u64;
        if let Some(t) = &mut self.slots[slot].task {
            t.draft_n += n_drafts;
        }
        let handled = contained(|| {
            for j in 0..=n_drafts {
                let Some(answer) = answers[first + j] else {
                    break;
                };
                let Some(t) = &mut self.slots[slot].task else {
                    break;
                };
                let sampled = t.pick(answer);
                let next = (j < n_drafts).then(|| batch.tokens[first + j + 1]);
                let takes = next == Some(sampled.id);
                if !takes {
                    self.settle(slot, &mut mark, n_drafts, j);
                }
                self.emit(slot, sampled);
                if !takes {
                    break;
                }
                if self.slots[slot].task.is_none() {
                    // the request ended on this token: the draft equal to it stays out
                    self.settle(slot, &mut mark, n_drafts, j);
                    break;
                }
                if let Some(id) = next {
                    self.slots[slot].tokens.push(id);
                    self.stats.draft_accepted_total += 1;
                    if let Some(t) = &mut self.slots[slot].task {
                        t.draft_n_accepted += 1;
                    }
                }
            }
        });
        match handled {
            Err(msg) => self.fail(slot, &format!("sampling failed: {msg}")),
            Ok(()) if mark.is_some() => self.fail(slot, "speculative verification ended early"),
            Ok(()) => {}
        }
    }

    /// Ends a verification with `accepted` of `n_drafts` drafts taken: tells the slot's gate
    /// and rolls the slot's cache back to its decode token and those drafts.
    fn settle(&mut self, slot: usize, mark: &mut Option<KvMark>, n_drafts: usize, accepted: usize) {
        let Some(mark) = mark.take() else {
            return;
        };
        let row_cost = self.row_cost.row_ratio();
        if let Some(d) = self.slots[slot]
            .task
            .as_mut()
            .and_then(|t| t.drafting.as_mut())
        {
            d.record(n_drafts, accepted, row_cost);
        }
        if let Err(e) = self.kv.rollback(mark, 1 + accepted as u32) {
            self.fail(slot, &format!("speculative rollback failed: {e}"));
        }
    }

    /// Adds the hidden states of an embedding request's rows in this pass to its pool.
    fn pool_rows(&mut self, out: &Output, rows: &[Row], n_embd: usize) {
        for (r, &b) in out.rows.iter().enumerate() {
            let (Some(row), Some(h)) = (
                rows.get(b),
                out.embeddings.get(r * n_embd..(r + 1) * n_embd),
            ) else {
                continue;
            };
            let Some(t) = self.slots[row.slot]
                .task
                .as_mut()
                .filter(|t| t.req.embeddings)
            else {
                continue;
            };
            match self.cfg.pooling {
                Pooling::Mean if t.pooled.is_empty() => t.pooled.extend_from_slice(h),
                Pooling::Mean => t.pooled.iter_mut().zip(h).for_each(|(p, x)| *p += x),
                Pooling::None => t.pooled.extend_from_slice(h),
                Pooling::Last => {}
            }
        }
    }

    /// Sends an embedding request's embedding (see [`Pooling`]) from its last row's hidden
    /// state and its pool, and ends it.
    fn embed(&mut self, slot: usize, hidden: &[f32]) {
        let Some(t) = self.slots[slot].task.as_mut() else {
            return;
        };
        let v = match self.cfg.pooling {
            Pooling::Last => normalized(hidden),
            Pooling::Mean => normalized(&t.pooled),
            Pooling::None => std::mem::take(&mut t.pooled),
        };
        let _ = t.tx.send(Event::Embedding(v));
        self.finish(slot, FinishReason::Stop);
    }

    /// Takes the sampled token, streams it, and decides whether the request goes on.
    fn emit(&mut self, slot: usize, sampled: Sampled) {
        let n_ctx = self.cfg.n_ctx;
        let tok = self.tok;
        let s = &mut self.slots[slot];
        let Some(t) = &mut s.task else {
            return;
        };
        let id = sampled.id;
        t.sampler.accept(id);
        t.n_gen += 1;
        t.first_token.get_or_insert_with(Instant::now);

        let eog = tok.is_some_and(|tk| tk.is_eog(id));
        let full =
            t.req.max_tokens.is_some_and(|m| t.n_gen >= m as usize) || s.tokens.len() >= n_ctx;
        let (text, stopped) = t.text_for(id, eog || full);
        let sent = t.tx.send(Event::Token {
            id,
            text,
            logprobs: sampled.logprobs,
        });
        self.stats.gen_tokens_total += 1;
        let reason = if sent.is_err() {
            Some(FinishReason::Cancelled)
        } else if stopped {
            Some(FinishReason::Stop)
        } else if eog {
            Some(FinishReason::Eog)
        } else if full {
            Some(FinishReason::Length)
        } else {
            None
        };
        match reason {
            Some(r) => self.finish(slot, r),
            None => t.phase = Phase::Decode(id),
        }
    }

    /// Frees the slot (its cache stays for reuse), publishes the counters, then sends `Done`
    /// (if anyone listens), so a client that sees `Done` also sees the slot free.
    fn finish(&mut self, slot: usize, reason: FinishReason) {
        let Some(t) = self.slots[slot].task.take() else {
            return;
        };
        let now = Instant::now();
        let first = t.first_token.unwrap_or(now);
        let timings = Timings {
            queue_ms: ms(t.started.saturating_duration_since(t.enqueued)),
            prompt_ms: ms(first - t.started),
            gen_ms: ms(now - first),
            producer: t.producer.clone(),
            draft_n: t.draft_n,
            draft_n_accepted: t.draft_n_accepted,
        };
        let n_prompt = t.req.prompt.len();
        let st = &mut self.stats;
        st.prompt_tokens_total += (n_prompt - t.n_cached) as u64;
        st.cached_tokens_total += t.n_cached as u64;
        st.prompt_seconds_total += timings.prompt_ms / 1e3;
        st.gen_seconds_total += timings.gen_ms / 1e3;
        {
            let shared = self.shared.clone();
            let mut sh = shared.lock();
            let took = (now - t.enqueued).as_secs_f64();
            sh.mean_request_s = if sh.mean_request_s == 0.0 {
                took
            } else {
                0.8 * sh.mean_request_s + 0.2 * took
            };
            self.publish_into(&mut sh);
        }
        let _ = t.tx.send(Event::Done {
            reason,
            n_prompt,
            n_cached: t.n_cached,
            n_gen: t.n_gen,
            timings,
        });
        // what the slot holds now (prompt and answer) serves the next turn of a conversation
        if let Some(pc) = self.cfg.prompt_cache.clone().filter(|_| t.req.cache_prompt) {
            let done = t.published.max(t.n_cached) as u32;
            if let Some(cut) = pc
                .held_cut(self.slots[slot].tokens.len())
                .filter(|&c| c >= done + muser_kvpack::BLOCK_TOKENS)
            {
                self.offer(slot, cut as usize);
            }
        }
    }

    /// Ends a request with an error and drops the slot's cache, whose state is unknown.
    fn fail(&mut self, slot: usize, msg: &str) {
        let task = self.slots[slot].task.take();
        self.kv.clear(slot as u32);
        self.slots[slot].tokens.clear();
        self.slots[slot].foreign = false;
        self.publish();
        if let Some(t) = task {
            let _ = t.tx.send(Event::Error(msg.to_string()));
        }
    }

    // ---- reporting -------------------------------------------------------------------------

    pub fn publish(&mut self) {
        let shared = self.shared.clone();
        let mut st = shared.lock();
        self.publish_into(&mut st);
    }

    fn publish_into(&mut self, st: &mut SharedState) {
        self.stats.busy_slots = self.slots.iter().filter(|s| s.task.is_some()).count();
        self.stats.queue_depth = st.queue.len();
        self.stats.kv_tokens = self.slots.iter().map(|s| s.tokens.len()).sum();
        st.stats = self.stats.clone();
        st.slots = self
            .slots
            .iter()
            .enumerate()
            .map(|(id, s)| SlotInfo {
                id,
                busy: s.task.is_some(),
                n_ctx: self.cfg.n_ctx,
                n_cached: s.tokens.len(),
                n_prompt: s.task.as_ref().map_or(0, |t| t.req.prompt.len()),
                n_gen: s.task.as_ref().map_or(0, |t| t.n_gen),
            })
            .collect();
    }
}

impl Task<'_> {
    /// The token a row's answer gives, sampled as a plain step samples it.
    fn pick(&mut self, answer: Answer) -> Sampled {
        match answer {
            Answer::Logits(logits) => self.sampler.sample(logits),
            Answer::Token(id) => Sampled { id, logprobs: None },
        }
    }

    /// The text to send with token `id`: its characters, minus anything that may begin a stop
    /// string; everything held back when this is the last token. True when a stop string
    /// matched.
    fn text_for(&mut self, id: u32, last: bool) -> (String, bool) {
        let mut piece = self.detok.push(id);
        if last {
            piece.push_str(&self.detok.finish());
        }
        let released = self.stop.push(&piece);
        let mut text = released.text;
        if last && !released.stopped {
            text.push_str(&self.stop.finish());
        }
        (text, released.stopped)
    }
}

/// `v` scaled to unit length (all zeros stays zeros).
fn normalized(v: &[f32]) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
    v.iter().map(|x| x * scale).collect()
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
