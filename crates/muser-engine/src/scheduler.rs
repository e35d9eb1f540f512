//! The engine thread: slots, admission, and one forward pass per step.
//!
//! Every step gathers the pending decode token of each generating slot plus a chunk of one
//! prompt still being processed (the oldest), up to `prefill_chunk` tokens, into a single
//! `Batch`; runs it; then samples for the rows that asked for logits. A slot keeps the tokens
//! whose K/V it holds after its request ends, so a later prompt sharing a prefix only
//! processes the rest.
//!
//! The parts of a step live beside it: `admission.rs` (queue to slot), `reuse.rs` (what a
//! slot's K/V starts from and offers back), `speculative.rs` (drafts and their verification)
//! and `output.rs` (tokens, embeddings and a request's end); sleeping is `sleep.rs`.

use std::sync::Arc;
use std::time::Instant;

use muser_model::{Batch, KvCache, KvMark, Model, ModelError, Output};
use muser_spec::{DflashDrafter, Drafting, RowCost};
use muser_text::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::detok::Detok;
use crate::engine::{
    contained, EngineConfig, EngineStats, Event, FinishReason, GenerateRequest, Pooling, Progress,
    Shared, SharedState, SlotInfo,
};
use crate::sampling::Sampler;
use crate::sleep::Exit;
use crate::stop::StopMatcher;

mod admission;
mod output;
mod reuse;
mod speculative;

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
