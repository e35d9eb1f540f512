//! Output: tokens streamed, embeddings pooled and sent, and a request's end with its timings.

use std::time::{Duration, Instant};

use muser_model::Output;

use super::{Answer, Phase, Row, Scheduler, Task};
use crate::engine::{Event, FinishReason, Pooling, Timings};
use crate::sampling::Sampled;

impl Scheduler<'_> {
    /// Adds the hidden states of an embedding request's rows in this pass to its pool.
    pub(super) fn pool_rows(&mut self, out: &Output, rows: &[Row], n_embd: usize) {
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
    pub(super) fn embed(&mut self, slot: usize, hidden: &[f32]) {
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
    pub(super) fn emit(&mut self, slot: usize, sampled: Sampled) {
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
    pub(super) fn finish(&mut self, slot: usize, reason: FinishReason) {
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
    pub(super) fn fail(&mut self, slot: usize, msg: &str) {
        let task = self.slots[slot].task.take();
        self.kv.clear(slot as u32);
        self.slots[slot].tokens.clear();
        self.slots[slot].foreign = false;
        self.publish();
        if let Some(t) = task {
            let _ = t.tx.send(Event::Error(msg.to_string()));
        }
    }
}

impl Task<'_> {
    /// The token a row's answer gives, sampled as a plain step samples it.
    pub(super) fn pick(&mut self, answer: Answer) -> Sampled {
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

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
