//! One log line per request, written when the last holder lets go of the record: for a
//! streamed response that is when the stream ends, so the line carries the real timings.

use crate::metrics::Metrics;
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
    counts: Mutex<Counts>,
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
            counts: Mutex::new(Counts::default()),
            metrics,
        })
    }

    fn with<R>(&self, f: impl FnOnce(&mut Counts) -> R) -> R {
        f(&mut self.counts.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn set_status(&self, status: u16) {
        self.with(|c| c.status = status);
    }

    /// Records one finished generation (prompt and generated tokens with their timings).
    pub fn add_generation(
        &self,
        prompt_tokens: u64,
        generated_tokens: u64,
        prompt_ms: f64,
        gen_ms: f64,
    ) {
        self.with(|c| {
            c.prompt_tokens += prompt_tokens;
            c.generated_tokens += generated_tokens;
            c.prompt_ms += prompt_ms;
            c.gen_ms += gen_ms;
        });
        self.metrics
            .record_generation(prompt_tokens, generated_tokens, prompt_ms, gen_ms);
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
            "{} {} {} prompt_tokens={} gen_tokens={} prompt_ms={:.1} gen_ms={:.1} total_ms={:.1}",
            self.method,
            self.path,
            c.status,
            c.prompt_tokens,
            c.generated_tokens,
            c.prompt_ms,
            c.gen_ms,
            total.as_secs_f64() * 1e3,
        );
    }
}
