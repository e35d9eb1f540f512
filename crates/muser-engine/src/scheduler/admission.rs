//! Admission: slot jobs, expired queue entries, slot choice, and a request started on a slot.

use std::time::{Duration, Instant};

use muser_spec::Drafting;

use super::reuse::common_prefix;
use super::{Phase, Scheduler, Task};
use crate::detok::Detok;
use crate::engine::{contained, Event, GenerateRequest, Job, SharedState, SlotKv};
use crate::prompt_cache::{Lookup, Resume};
use crate::sampling::Sampler;
use crate::sleep::{idle_wait, Exit};
use crate::stop::StopMatcher;

impl Scheduler<'_> {
    /// Runs slot jobs, drops dead queue entries and admits requests to idle slots; blocks while
    /// there is nothing to run. `None`: a step to take; else why the run ends.
    pub(super) fn take_work(&mut self) -> Option<Exit> {
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
}
