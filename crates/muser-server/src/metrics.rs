//! What the server measures, kept in atomics: request counters, latency and rate histograms
//! per lane and device, a 10-second token rate, and the Prometheus text exposition of all
//! of it plus engine gauges read at scrape time. `/v1/telemetry` reads the same values.

use muser_engine::{EngineStats, PromptCacheStats};
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the request latency histogram.
const LATENCY_BUCKETS_S: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Time to first token and queue wait (seconds).
const WAIT_BUCKETS_S: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Time between two tokens of one stream (seconds).
const ITL_BUCKETS_S: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
];
/// Prefill and decode rates of one request (tokens per second).
const RATE_BUCKETS: &[f64] = &[
    1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 50000.0,
];
/// Samples kept per histogram for the percentiles of `/v1/telemetry`.
const RECENT_SAMPLES: usize = 512;
/// Window of the token rate.
pub const RATE_WINDOW_S: u64 = 10;

/// A Prometheus histogram (cumulative buckets, count, sum) and its most recent samples.
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    /// Sum of the samples, in millionths of their unit.
    sum_micro: AtomicU64,
    recent: Mutex<VecDeque<f64>>,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micro: AtomicU64::new(0),
            recent: Mutex::new(VecDeque::with_capacity(RECENT_SAMPLES)),
        }
    }

    pub fn observe(&self, v: f64) {
        if !v.is_finite() || v < 0.0 {
            return;
        }
        for (bound, bucket) in self.bounds.iter().zip(self.buckets.iter()) {
            if v <= *bound {
                bucket.fetch_add(1, Relaxed);
            }
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_micro.fetch_add((v * 1e6) as u64, Relaxed);
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if recent.len() == RECENT_SAMPLES {
            recent.pop_front();
        }
        recent.push_back(v);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// The `q` quantile of the recent samples; `None` before the first one.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let mut v: Vec<f64> = self
            .recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let i = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        Some(v[i])
    }

    /// Bucket, sum and count lines; `labels` is empty or `k="v",...` (no braces).
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (bound, bucket) in self.bounds.iter().zip(self.buckets.iter()) {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {}",
                bucket.load(Relaxed)
            );
        }
        let count = self.count();
        let braces = |s: &str| match s {
            "" => String::new(),
            s => format!("{{{s}}}"),
        };
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum{} {}",
            braces(labels),
            self.sum_micro.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count{} {count}", braces(labels));
    }
}

/// Where a request's prompt was computed: here, or by a remote prefill node (the
/// disaggregated lane).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    Local,
    Remote,
}

impl Lane {
    pub const ALL: [Lane; 2] = [Lane::Local, Lane::Remote];
    pub fn label(self) -> &'static str {
        match self {
            Lane::Local => "local",
            Lane::Remote => "remote",
        }
    }
}

/// The histograms of one lane.
pub struct LaneStats {
    pub ttft_s: Histogram,
    pub itl_s: Histogram,
    pub queue_wait_s: Histogram,
    pub prefill_tok_s: Histogram,
    pub decode_tok_s: Histogram,
}

impl LaneStats {
    fn new() -> LaneStats {
        LaneStats {
            ttft_s: Histogram::new(WAIT_BUCKETS_S),
            itl_s: Histogram::new(ITL_BUCKETS_S),
            queue_wait_s: Histogram::new(WAIT_BUCKETS_S),
            prefill_tok_s: Histogram::new(RATE_BUCKETS),
            decode_tok_s: Histogram::new(RATE_BUCKETS),
        }
    }

    /// (metric name, help, histogram) of each family.
    fn families(&self) -> [(&'static str, &'static str, &Histogram); 5] {
        [
            (
                "muser_time_to_first_token_seconds",
                "From the request's arrival to its first token.",
                &self.ttft_s,
            ),
            (
                "muser_inter_token_seconds",
                "Between two consecutive tokens of one generation.",
                &self.itl_s,
            ),
            (
                "muser_queue_wait_seconds",
                "From queueing a request to its slot.",
                &self.queue_wait_s,
            ),
            (
                "muser_prefill_tokens_per_second",
                "Prompt tokens computed per second, per request.",
                &self.prefill_tok_s,
            ),
            (
                "muser_decode_tokens_per_second",
                "Tokens generated per second after the first, per request.",
                &self.decode_tok_s,
            ),
        ]
    }
}

/// What the engine and the prompt cache report at scrape time.
pub struct Gauges {
    pub engine: EngineStats,
    pub n_slots: usize,
    pub kv_capacity_tokens: usize,
    pub prompt_cache: Option<PromptCacheStats>,
    /// A consumer's producers: name, health, health changes so far.
    pub producers: Vec<(String, muser_cluster::supervise::NodeHealth, u64)>,
}

pub struct Metrics {
    /// The device label of every lane histogram (`cpu`, `cuda`, ...).
    pub device: String,
    started: Instant,
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    latency: Histogram,
    lanes: [LaneStats; 2],
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    prompt_us: AtomicU64,
    gen_us: AtomicU64,
    rejected_busy: AtomicU64,
    /// The most tokens one generation's context held.
    context_tokens_max: AtomicU64,
    /// Tokens streamed per second since start: (second, tokens), the last few seconds.
    token_seconds: Mutex<VecDeque<(u64, u64)>>,
    /// The generations finished since the last scrape (llama-server's throughput gauges).
    window: Mutex<Window>,
    /// The last scrape's text and the token count it saw: what a sleeping server answers.
    last_scrape: Mutex<Option<(u64, String)>>,
}

/// Prompt and generated tokens, and the time spent on them, of the generations finished in
/// a window between two scrapes: llama-server's `prompt_tokens_seconds` and
/// `predicted_tokens_seconds` are averaged over that window, not since start.
#[derive(Debug, Clone, Copy, Default)]
pub struct Window {
    prompt_tokens: u64,
    prompt_us: u64,
    gen_tokens: u64,
    gen_us: u64,
}

impl Window {
    /// Prompt and generation tokens per second (0 for an empty window).
    fn rates(&self) -> (f64, f64) {
        let per_s = |n: u64, us: u64| match us {
            0 => 0.0,
            us => n as f64 * 1e6 / us as f64,
        };
        (
            per_s(self.prompt_tokens, self.prompt_us),
            per_s(self.gen_tokens, self.gen_us),
        )
    }
}

impl Metrics {
    pub fn new(device: &str) -> Metrics {
        Metrics {
            device: device.to_string(),
            started: Instant::now(),
            requests: Mutex::default(),
            latency: Histogram::new(LATENCY_BUCKETS_S),
            lanes: [LaneStats::new(), LaneStats::new()],
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            prompt_us: AtomicU64::new(0),
            gen_us: AtomicU64::new(0),
            rejected_busy: AtomicU64::new(0),
            context_tokens_max: AtomicU64::new(0),
            token_seconds: Mutex::default(),
            window: Mutex::default(),
            last_scrape: Mutex::default(),
        }
    }

    pub fn lane(&self, lane: Lane) -> &LaneStats {
        &self.lanes[lane as usize]
    }

    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn record_request(&self, route: &str, status: u16, seconds: f64) {
        *self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((route.to_string(), status))
            .or_default() += 1;
        self.latency.observe(seconds);
    }

    /// One finished generation: its counts, and its queue wait and rates on `lane`.
    pub fn record_generation(&self, lane: Lane, g: &GenerationTimes) {
        self.prompt_tokens.fetch_add(g.prompt_tokens, Relaxed);
        self.generated_tokens.fetch_add(g.generated_tokens, Relaxed);
        self.context_tokens_max.fetch_max(g.context_tokens, Relaxed);
        self.prompt_us
            .fetch_add((g.prompt_ms * 1e3) as u64, Relaxed);
        self.gen_us.fetch_add((g.gen_ms * 1e3) as u64, Relaxed);
        {
            let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
            w.prompt_tokens += g.prompt_tokens;
            w.prompt_us += (g.prompt_ms * 1e3) as u64;
            w.gen_tokens += g.generated_tokens;
            w.gen_us += (g.gen_ms * 1e3) as u64;
        }
        let l = self.lane(lane);
        l.queue_wait_s.observe(g.queue_ms / 1e3);
        if g.prompt_tokens > 0 && g.prompt_ms > 0.0 {
            l.prefill_tok_s
                .observe(g.prompt_tokens as f64 * 1e3 / g.prompt_ms);
        }
        // the first token closes the prefill; the rate is of the tokens after it
        if g.generated_tokens > 1 && g.gen_ms > 0.0 {
            l.decode_tok_s
                .observe((g.generated_tokens - 1) as f64 * 1e3 / g.gen_ms);
        }
    }

    /// One streamed token (for the 10-second token rate).
    pub fn record_token(&self) {
        let now_s = self.started.elapsed().as_secs();
        let mut ring = self.token_seconds.lock().unwrap_or_else(|e| e.into_inner());
        match ring.back_mut() {
            Some((s, n)) if *s == now_s => *n += 1,
            _ => ring.push_back((now_s, 1)),
        }
        while ring
            .front()
            .is_some_and(|(s, _)| *s + RATE_WINDOW_S < now_s)
        {
            ring.pop_front();
        }
    }

    /// Tokens per second over the last [`RATE_WINDOW_S`] whole seconds.
    pub fn tokens_per_second(&self) -> f64 {
        let now_s = self.started.elapsed().as_secs();
        let ring = self.token_seconds.lock().unwrap_or_else(|e| e.into_inner());
        let n: u64 = ring
            .iter()
            .filter(|(s, _)| *s < now_s && *s + RATE_WINDOW_S >= now_s)
            .map(|(_, n)| n)
            .sum();
        n as f64 / RATE_WINDOW_S as f64
    }

    pub fn record_busy(&self) {
        self.rejected_busy.fetch_add(1, Relaxed);
    }

    pub fn generated_tokens(&self) -> u64 {
        self.generated_tokens.load(Relaxed)
    }

    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens.load(Relaxed)
    }

    pub fn rejected_busy(&self) -> u64 {
        self.rejected_busy.load(Relaxed)
    }

    /// llama-server's metrics under its own names (`llamacpp:`), from the same counters, so
    /// that its dashboards and alerts work unchanged.
    fn render_llamacpp(&self, out: &mut String, g: &Gauges, window: &Window) {
        let mut metric = |kind: &str, name: &str, help: &str, value: f64| {
            let _ = writeln!(
                out,
                "# HELP llamacpp:{name} {help}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}"
            );
        };
        let (prompt, generated) = (self.prompt_tokens(), self.generated_tokens());
        let (prompt_s, gen_s) = (
            self.prompt_us.load(Relaxed) as f64 / 1e6,
            self.gen_us.load(Relaxed) as f64 / 1e6,
        );
        let (prompt_rate, predicted_rate) = window.rates();
        let e = &g.engine;
        for (name, help, value) in [
            (
                "prompt_tokens_total",
                "Number of prompt tokens processed.",
                prompt as f64,
            ),
            (
                "prompt_tokens_cached_total",
                "Number of prompt tokens reused from a cache.",
                e.cached_tokens_total as f64,
            ),
            ("prompt_seconds_total", "Prompt process time.", prompt_s),
            (
                "tokens_predicted_total",
                "Number of generation tokens processed.",
                generated as f64,
            ),
            (
                "tokens_predicted_seconds_total",
                "Predict process time.",
                gen_s,
            ),
            (
                "n_decode_total",
                "Total number of forward passes.",
                e.forward_total as f64,
            ),
            (
                "n_tokens_max",
                "Largest observed n_tokens.",
                self.context_tokens_max.load(Relaxed) as f64,
            ),
            (
                "spec_decode_num_draft_tokens_total",
                "Draft tokens verified.",
                e.draft_tokens_total as f64,
            ),
            (
                "spec_decode_num_accepted_tokens_total",
                "Draft tokens accepted.",
                e.draft_accepted_total as f64,
            ),
            (
                "spec_decode_num_drafts_total",
                "Drafts verified.",
                e.draft_verifications_total as f64,
            ),
        ] {
            metric("counter", name, help, value);
        }
        let per_pass = if e.forward_total > 0 {
            e.slot_forwards_total as f64 / e.forward_total as f64
        } else {
            0.0
        };
        for (name, help, value) in [
            (
                "prompt_tokens_seconds",
                "Average prompt throughput in tokens/s since the last scrape.",
                prompt_rate,
            ),
            (
                "predicted_tokens_seconds",
                "Average generation throughput in tokens/s since the last scrape.",
                predicted_rate,
            ),
            (
                "requests_processing",
                "Number of requests processing.",
                e.busy_slots as f64,
            ),
            (
                "requests_deferred",
                "Number of requests deferred.",
                e.queue_depth as f64,
            ),
            (
                "n_busy_slots_per_decode",
                "Average number of busy slots per forward pass.",
                per_pass,
            ),
        ] {
            metric("gauge", name, help, value);
        }
    }

    /// A scrape of `/metrics`: the text, with llama-server's throughput gauges over the
    /// generations since the previous scrape (which this one closes). While the engine is
    /// `asleep` and nothing ran since the previous scrape, its text is answered again with
    /// only those gauges new: as llama-server serves a sleeping server's metrics from the
    /// snapshot taken when it fell asleep, so that polling a sleeping server (its /props and
    /// /metrics requests are counted too) reads the same numbers.
    pub fn scrape(&self, g: &Gauges, asleep: bool) -> String {
        let window = std::mem::take(&mut *self.window.lock().unwrap_or_else(|e| e.into_inner()));
        let tokens = self.prompt_tokens() + self.generated_tokens();
        let mut last = self.last_scrape.lock().unwrap_or_else(|e| e.into_inner());
        let text = match last.as_ref() {
            Some((seen, text)) if asleep && *seen == tokens => with_rates(text, window.rates()),
            _ => self.render(g, &window),
        };
        *last = Some((tokens, text.clone()));
        text
    }

    fn render(&self, g: &Gauges, window: &Window) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, value: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        };
        let prompt = self.prompt_tokens();
        let generated = self.generated_tokens();
        counter(
            &mut out,
            "muser_prompt_tokens_total",
            "Prompt tokens processed.",
            prompt,
        );
        counter(
            &mut out,
            "muser_generated_tokens_total",
            "Tokens generated.",
            generated,
        );
        counter(
            &mut out,
            "muser_requests_rejected_busy_total",
            "Requests refused with 429.",
            self.rejected_busy(),
        );
        let per_s = |n: u64, us: u64| match us {
            0 => 0.0,
            us => n as f64 * 1e6 / us as f64,
        };
        gauge(
            &mut out,
            "muser_prompt_tokens_per_second",
            "Prompt throughput over all requests so far.",
            per_s(prompt, self.prompt_us.load(Relaxed)),
        );
        gauge(
            &mut out,
            "muser_generated_tokens_per_second",
            "Per-request generation throughput over all requests so far.",
            per_s(generated, self.gen_us.load(Relaxed)),
        );
        gauge(
            &mut out,
            "muser_stream_tokens_per_second_10s",
            "Tokens streamed per second over the last 10 s, all requests together.",
            self.tokens_per_second(),
        );
        gauge(
            &mut out,
            "muser_slots_busy",
            "Slots generating now.",
            g.engine.busy_slots as f64,
        );
        gauge(
            &mut out,
            "muser_slots_total",
            "Slots configured.",
            g.n_slots as f64,
        );
        gauge(
            &mut out,
            "muser_queue_depth",
            "Requests waiting for a slot.",
            g.engine.queue_depth as f64,
        );
        gauge(
            &mut out,
            "muser_kv_tokens",
            "Tokens whose K/V the slots hold.",
            g.engine.kv_tokens as f64,
        );
        gauge(
            &mut out,
            "muser_kv_capacity_tokens",
            "Tokens the slots' K/V can hold.",
            g.kv_capacity_tokens as f64,
        );
        counter(
            &mut out,
            "muser_prompt_cached_tokens_total",
            "Prompt tokens not computed: reused from the slot or resumed from the prompt cache.",
            g.engine.cached_tokens_total,
        );
        counter(
            &mut out,
            "muser_draft_verifications_total",
            "Speculative verification steps (a decode token with its drafts).",
            g.engine.draft_verifications_total,
        );
        counter(
            &mut out,
            "muser_draft_tokens_total",
            "Speculative draft tokens verified.",
            g.engine.draft_tokens_total,
        );
        counter(
            &mut out,
            "muser_draft_accepted_tokens_total",
            "Speculative draft tokens accepted.",
            g.engine.draft_accepted_total,
        );
        gauge(
            &mut out,
            "muser_draft_acceptance_ratio",
            "Speculative draft tokens accepted per draft token verified (0 before any).",
            g.engine.draft_acceptance().unwrap_or(0.0),
        );
        gauge(
            &mut out,
            "muser_draft_row_cost",
            "What one more verification row adds to a decode step, as a fraction of a one-row step (measured; sizes the drafts).",
            f64::from(g.engine.draft_row_cost),
        );
        if let Some(pc) = &g.prompt_cache {
            let name = "muser_prompt_cache_hits_total";
            let _ = writeln!(out, "# HELP {name} Requests that resumed a prefix from the prompt cache, by tier.\n# TYPE {name} counter");
            let _ = writeln!(out, "{name}{{tier=\"memory\"}} {}", pc.hits_memory);
            let _ = writeln!(out, "{name}{{tier=\"disk\"}} {}", pc.hits_disk);
            let name = "muser_prompt_cache_bytes";
            let _ = writeln!(
                out,
                "# HELP {name} Bytes the prompt cache holds, by tier.\n# TYPE {name} gauge"
            );
            let _ = writeln!(out, "{name}{{tier=\"memory\"}} {}", pc.memory_bytes);
            let _ = writeln!(out, "{name}{{tier=\"disk\"}} {}", pc.disk_bytes);
            counter(
                &mut out,
                "muser_prompt_cache_tokens_resumed_total",
                "Prompt tokens resumed from the prompt cache.",
                pc.tokens_resumed,
            );
        }

        self.render_llamacpp(&mut out, g, window);

        let _ = writeln!(out, "# HELP muser_requests_total HTTP requests by route and status.\n# TYPE muser_requests_total counter");
        for ((route, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "muser_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let name = "muser_request_duration_seconds";
        let _ = writeln!(out, "# HELP {name} HTTP request latency, to the end of the response body.\n# TYPE {name} histogram");
        self.latency.render(&mut out, name, "");
        // the local lane always; another lane once it has served a request
        if !g.producers.is_empty() {
            let _ = writeln!(
                out,
                "# HELP muser_lane_producer_health A producer's health: 2 healthy, 1 degraded, 0 down.\n# TYPE muser_lane_producer_health gauge"
            );
            for (name, h, _) in &g.producers {
                let _ = writeln!(
                    out,
                    "muser_lane_producer_health{{producer=\"{name}\"}} {}",
                    h.gauge()
                );
            }
            let _ = writeln!(
                out,
                "# HELP muser_lane_producer_health_changes_total A producer's changes of health.\n# TYPE muser_lane_producer_health_changes_total counter"
            );
            for (name, _, n) in &g.producers {
                let _ = writeln!(
                    out,
                    "muser_lane_producer_health_changes_total{{producer=\"{name}\"}} {n}"
                );
            }
        }
        let lanes: Vec<Lane> = Lane::ALL
            .into_iter()
            .filter(|&l| l == Lane::Local || self.lane(l).ttft_s.count() > 0)
            .collect();
        for i in 0..5 {
            let (name, help, _) = self.lanes[0].families()[i];
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            for &lane in &lanes {
                let labels = format!("lane=\"{}\",device=\"{}\"", lane.label(), self.device);
                self.lane(lane).families()[i]
                    .2
                    .render(&mut out, name, &labels);
            }
        }
        out
    }
}

/// `text` with the values of llama-server's two throughput gauges replaced by `rates`.
fn with_rates(text: &str, (prompt, predicted): (f64, f64)) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        match line.split_once(' ') {
            Some((name @ "llamacpp:prompt_tokens_seconds", _)) => {
                let _ = writeln!(out, "{name} {prompt}");
            }
            Some((name @ "llamacpp:predicted_tokens_seconds", _)) => {
                let _ = writeln!(out, "{name} {predicted}");
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// One generation's counts and timings, as the engine reports them.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerationTimes {
    /// Prompt tokens computed (not reused from a cache).
    pub prompt_tokens: u64,
    /// Tokens in the slot's context at the end: the whole prompt and what was generated.
    pub context_tokens: u64,
    pub generated_tokens: u64,
    pub queue_ms: f64,
    pub prompt_ms: f64,
    pub gen_ms: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_gauges_cover_the_window_since_the_last_scrape() {
        let m = Metrics::new("cpu");
        let g = Gauges {
            engine: EngineStats::default(),
            n_slots: 1,
            kv_capacity_tokens: 256,
            prompt_cache: None,
            producers: Vec::new(),
        };
        let generation = GenerationTimes {
            prompt_tokens: 10,
            generated_tokens: 5,
            prompt_ms: 20.0,
            gen_ms: 50.0,
            ..Default::default()
        };
        m.record_generation(Lane::Local, &generation);
        let first = m.scrape(&g, false);
        assert!(first.contains("\nllamacpp:prompt_tokens_seconds 500\n"));
        assert!(first.contains("\nllamacpp:predicted_tokens_seconds 100\n"));
        let second = m.scrape(&g, false);
        assert!(second.contains("\nllamacpp:predicted_tokens_seconds 0\n"));
        assert!(second.contains("\nllamacpp:tokens_predicted_total 5\n"));
        // asleep with nothing run since: the last scrape again, though requests were counted
        m.record_request("/props", 200, 0.001);
        assert_eq!(m.scrape(&g, true), second);
        assert_ne!(m.scrape(&g, false), second);
        // a generation since the last scrape: rendered afresh, its window reported once
        m.record_generation(Lane::Local, &generation);
        let asleep = m.scrape(&g, true);
        assert!(asleep.contains("\nllamacpp:predicted_tokens_seconds 100\n"));
        assert_eq!(
            m.scrape(&g, true),
            asleep
                .replace("seconds 500\n", "seconds 0\n")
                .replace("seconds 100\n", "seconds 0\n")
        );
    }

    #[test]
    fn renders_counters_and_cumulative_histograms() {
        let m = Metrics::new("cpu");
        m.record_request("/v1/completions", 200, 0.03);
        m.record_request("/v1/completions", 200, 3.0);
        m.record_generation(
            Lane::Local,
            &GenerationTimes {
                prompt_tokens: 10,
                context_tokens: 30,
                generated_tokens: 5,
                queue_ms: 2.0,
                prompt_ms: 20.0,
                gen_ms: 50.0,
            },
        );
        m.lane(Lane::Local).ttft_s.observe(0.02);
        let text = m.scrape(
            &Gauges {
                engine: EngineStats {
                    busy_slots: 1,
                    queue_depth: 2,
                    kv_tokens: 100,
                    draft_verifications_total: 7,
                    draft_tokens_total: 40,
                    draft_accepted_total: 25,
                    draft_row_cost: 0.5,
                    ..Default::default()
                },
                n_slots: 4,
                kv_capacity_tokens: 4096,
                prompt_cache: None,
                producers: vec![(
                    "prod".into(),
                    muser_cluster::supervise::NodeHealth::Degraded,
                    1,
                )],
            },
            false,
        );
        assert!(text.contains("muser_lane_producer_health{producer=\"prod\"} 1"));
        assert!(text.contains("muser_lane_producer_health_changes_total{producer=\"prod\"} 1"));
        assert!(text.contains("muser_draft_verifications_total 7"));
        assert!(text.contains("muser_draft_tokens_total 40"));
        assert!(text.contains("muser_draft_accepted_tokens_total 25"));
        assert!(text.contains("muser_draft_acceptance_ratio 0.625"));
        assert!(text.contains("muser_draft_row_cost 0.5"));
        assert!(text.contains("muser_prompt_tokens_total 10"));
        assert!(text.contains(
            "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 10\n"
        ));
        assert!(text.contains("llamacpp:requests_deferred 2\n"));
        assert!(text.contains("llamacpp:n_tokens_max 30\n"));
        assert!(text.contains("muser_generated_tokens_total 5"));
        assert!(text.contains("muser_generated_tokens_per_second 100"));
        assert!(text.contains("muser_requests_total{route=\"/v1/completions\",status=\"200\"} 2"));
        assert!(text.contains("muser_request_duration_seconds_bucket{le=\"0.05\"} 1"));
        assert!(text.contains("muser_request_duration_seconds_bucket{le=\"5\"} 2"));
        assert!(text.contains("muser_request_duration_seconds_count 2"));
        assert!(text.contains("muser_queue_depth 2"));
        assert!(text.contains("muser_kv_tokens 100"));
        let l = "lane=\"local\",device=\"cpu\"";
        assert!(text.contains(&format!(
            "muser_queue_wait_seconds_bucket{{{l},le=\"0.001\"}} 0"
        )));
        assert!(text.contains(&format!(
            "muser_queue_wait_seconds_bucket{{{l},le=\"0.005\"}} 1"
        )));
        assert!(text.contains(&format!(
            "muser_prefill_tokens_per_second_bucket{{{l},le=\"500\"}} 1"
        )));
        // 4 tokens after the first in 50 ms: 80 tok/s
        assert!(text.contains(&format!(
            "muser_decode_tokens_per_second_bucket{{{l},le=\"50\"}} 0"
        )));
        assert!(text.contains(&format!(
            "muser_decode_tokens_per_second_bucket{{{l},le=\"100\"}} 1"
        )));
        assert!(text.contains(&format!("muser_time_to_first_token_seconds_count{{{l}}} 1")));
        assert!(
            !text.contains("lane=\"remote\""),
            "an unused lane is absent"
        );
    }

    #[test]
    fn quantiles_come_from_samples_or_are_absent() {
        let h = Histogram::new(ITL_BUCKETS_S);
        assert_eq!(h.quantile(0.5), None);
        for v in 1..=100 {
            h.observe(f64::from(v));
        }
        assert_eq!(h.quantile(0.5), Some(51.0));
        assert_eq!(h.quantile(0.95), Some(95.0));
        h.observe(f64::NAN);
        assert_eq!(h.count(), 100);
    }
}
