//! One log line per request, written when the last holder lets go of the record: for a
//! streamed response that is when the stream ends, so the line carries the real timings.

use crate::metrics::{GenerationTimes, Lane, Metrics};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(Default, Clone, Copy)]
struct Counts {
    status: u16,
    prompt_tokens: u64,
    generated_tokens: u64,
    prompt_ms: f64,
    gen_ms: f64,
}

pub struct RequestLog {
    method: String,
    path: String,
    route: String,
    start: Instant,
    /// Whether a producer prefilled the prompt (the metrics' lane label).
    remote: AtomicBool,
    counts: Mutex<Counts>,
    /// When the last token of this request's generation streamed.
    last_token: Mutex<Option<Instant>>,
    metrics: Arc<Metrics>,
}

impl RequestLog {
    /// `route` is the matched route pattern (bounded label set), or "other".
    pub fn new(method: &str, path: &str, route: &str, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            method: method.to_string(),
            path: path.chars().take(256).collect(),
            route: route.to_string(),
            start: Instant::now(),
            remote: AtomicBool::new(false),
            counts: Mutex::new(Counts::default()),
            last_token: Mutex::new(None),
            metrics,
        })
    }

    fn with<R>(&self, f: impl FnOnce(&mut Counts) -> R) -> R {
        f(&mut self.counts.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn set_status(&self, status: u16) {
        self.with(|c| c.status = status);
    }

    /// Marks the request as prefilled by a producer: its timings go to the remote lane.
    pub fn set_remote(&self) {
        self.remote.store(true, Ordering::Relaxed);
    }

    fn lane(&self) -> Lane {
        if self.remote.load(Ordering::Relaxed) {
            Lane::Remote
        } else {
            Lane::Local
        }
    }

    /// Records one streamed token: the time to the first token (from the request's arrival)
    /// or since the previous one.
    pub fn add_token(&self) {
        let now = Instant::now();
        let lane = self.metrics.lane(self.lane());
        let mut last = self.last_token.lock().unwrap_or_else(|e| e.into_inner());
        match last.replace(now) {
            None => lane.ttft_s.observe((now - self.start).as_secs_f64()),
            Some(prev) => lane.itl_s.observe((now - prev).as_secs_f64()),
        }
        self.metrics.record_token();
    }

    /// Records one finished generation (prompt and generated tokens with their timings).
    pub fn add_generation(&self, g: &GenerationTimes) {
        self.with(|c| {
            c.prompt_tokens += g.prompt_tokens;
            c.generated_tokens += g.generated_tokens;
            c.prompt_ms += g.prompt_ms;
            c.gen_ms += g.gen_ms;
        });
        *self.last_token.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.metrics.record_generation(self.lane(), g);
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let c = self.with(|c| *c);
        let total = self.start.elapsed();
        self.metrics
            .record_request(&self.route, c.status, total.as_secs_f64());
        tracing::info!(
            target: "muser::http",
            "{} {} {} lane={} prompt_tokens={} gen_tokens={} prompt_ms={:.1} gen_ms={:.1} total_ms={:.1}",
            self.method,
            self.path,
            c.status,
            self.lane().label(),
            c.prompt_tokens,
            c.generated_tokens,
            c.prompt_ms,
            c.gen_ms,
            total.as_secs_f64() * 1e3,
        );
    }
}
