//! Prometheus text exposition, hand-written: counters and a latency histogram kept in
//! atomics, plus engine gauges read at scrape time.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Upper bounds (seconds) of the request latency histogram.
const LATENCY_BUCKETS_S: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    latency_buckets: [AtomicU64; LATENCY_BUCKETS_S.len()],
    latency_count: AtomicU64,
    latency_sum_us: AtomicU64,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    prompt_us: AtomicU64,
    gen_us: AtomicU64,
    rejected_busy: AtomicU64,
}

/// Values read from the engine when /metrics is scraped.
pub struct EngineGauges {
    pub busy_slots: usize,
    pub total_slots: usize,
    pub queue_depth: usize,
}

impl Metrics {
    pub fn record_request(&self, route: &str, status: u16, seconds: f64) {
        *self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((route.to_string(), status))
            .or_default() += 1;
        for (bound, bucket) in LATENCY_BUCKETS_S.iter().zip(&self.latency_buckets) {
            if seconds <= *bound {
                bucket.fetch_add(1, Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Relaxed);
        self.latency_sum_us
            .fetch_add((seconds * 1e6) as u64, Relaxed);
    }

    pub fn record_generation(
        &self,
        prompt_tokens: u64,
        generated_tokens: u64,
        prompt_ms: f64,
        gen_ms: f64,
    ) {
        self.prompt_tokens.fetch_add(prompt_tokens, Relaxed);
        self.generated_tokens.fetch_add(generated_tokens, Relaxed);
        self.prompt_us.fetch_add((prompt_ms * 1e3) as u64, Relaxed);
        self.gen_us.fetch_add((gen_ms * 1e3) as u64, Relaxed);
    }

    pub fn record_busy(&self) {
        self.rejected_busy.fetch_add(1, Relaxed);
    }

    pub fn render(&self, engine: &EngineGauges) -> String {
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
        let prompt = self.prompt_tokens.load(Relaxed);
        let generated = self.generated_tokens.load(Relaxed);
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
            self.rejected_busy.load(Relaxed),
        );
        let per_s = |n: u64, us: u64| {
            if us == 0 {
                0.0
            } else {
                n as f64 * 1e6 / us as f64
            }
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
            "muser_slots_busy",
            "Slots generating now.",
            engine.busy_slots as f64,
        );
        gauge(
            &mut out,
            "muser_slots_total",
            "Slots configured.",
            engine.total_slots as f64,
        );
        gauge(
            &mut out,
            "muser_queue_depth",
            "Requests waiting for a slot.",
            engine.queue_depth as f64,
        );

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
        for (bound, bucket) in LATENCY_BUCKETS_S.iter().zip(&self.latency_buckets) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{bound}\"}} {}",
                bucket.load(Relaxed)
            );
        }
        let count = self.latency_count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.latency_sum_us.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {count}");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_cumulative_histogram() {
        let m = Metrics::default();
        m.record_request("/v1/completions", 200, 0.03);
        m.record_request("/v1/completions", 200, 3.0);
        m.record_generation(10, 5, 20.0, 50.0);
        let text = m.render(&EngineGauges {
            busy_slots: 1,
            total_slots: 4,
            queue_depth: 2,
        });
        assert!(text.contains("muser_prompt_tokens_total 10"));
        assert!(text.contains("muser_generated_tokens_total 5"));
        assert!(text.contains("muser_generated_tokens_per_second 100"));
        assert!(text.contains("muser_requests_total{route=\"/v1/completions\",status=\"200\"} 2"));
        assert!(text.contains("muser_request_duration_seconds_bucket{le=\"0.05\"} 1"));
        assert!(text.contains("muser_request_duration_seconds_bucket{le=\"5\"} 2"));
        assert!(text.contains("muser_request_duration_seconds_count 2"));
        assert!(text.contains("muser_queue_depth 2"));
    }
}
