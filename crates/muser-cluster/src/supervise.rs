//! A consumer's view of one producer's health, from probes and from real prefills:
//! **healthy** (the last attempt worked), **degraded** (one or two failures in a row: still
//! used, after the healthy ones), **down** (three or more: not routed to; probed with a
//! backoff that doubles from [`PROBE_EVERY`] to [`BACKOFF_MAX`] until it answers). Pure
//! state: the caller probes, routes, logs the changes it is told of and exports them.

use std::time::{Duration, Instant};

/// Probe interval of a producer that answers.
pub const PROBE_EVERY: Duration = Duration::from_secs(2);
/// Longest wait between probes of a producer that is down.
pub const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// Failures in a row that make a producer down.
pub const DOWN_AFTER: u32 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeHealth {
    Healthy,
    Degraded,
    Down,
}

impl NodeHealth {
    pub fn name(self) -> &'static str {
        match self {
            NodeHealth::Healthy => "healthy",
            NodeHealth::Degraded => "degraded",
            NodeHealth::Down => "down",
        }
    }

    /// The Prometheus gauge value: 2 healthy, 1 degraded, 0 down.
    pub fn gauge(self) -> u8 {
        match self {
            NodeHealth::Healthy => 2,
            NodeHealth::Degraded => 1,
            NodeHealth::Down => 0,
        }
    }
}

/// A state change: from, to.
pub type Change = (NodeHealth, NodeHealth);

#[derive(Clone, Debug)]
pub struct Supervision {
    failures: u32,
    next_probe: Instant,
    /// State changes so far (exported as a counter).
    pub changes: u64,
    /// Removed from the registry: down for good, never probed again.
    retired: bool,
}

impl Supervision {
    pub fn new(now: Instant) -> Supervision {
        Supervision {
            failures: 0,
            next_probe: now,
            changes: 0,
            retired: false,
        }
    }

    pub fn state(&self) -> NodeHealth {
        if self.retired {
            return NodeHealth::Down;
        }
        match self.failures {
            0 => NodeHealth::Healthy,
            f if f < DOWN_AFTER => NodeHealth::Degraded,
            _ => NodeHealth::Down,
        }
    }

    /// Whether the node was removed ([`Supervision::retire`]).
    pub fn is_retired(&self) -> bool {
        self.retired
    }

    /// Whether a probe is due.
    pub fn due(&self, now: Instant) -> bool {
        !self.retired && now >= self.next_probe
    }

    /// The node was removed: it is down from now on, whatever a probe or prefill says.
    pub fn retire(&mut self) -> Option<Change> {
        let before = self.state();
        self.retired = true;
        self.changed(before)
    }

    /// A probe or prefill worked.
    pub fn success(&mut self, now: Instant) -> Option<Change> {
        let before = self.state();
        self.failures = 0;
        self.next_probe = now + PROBE_EVERY;
        self.changed(before)
    }

    /// A probe or prefill failed: the next probe waits twice as long each time (bounded).
    pub fn failure(&mut self, now: Instant) -> Option<Change> {
        let before = self.state();
        self.failures = self.failures.saturating_add(1);
        let doublings = self.failures.saturating_sub(1).min(16);
        self.next_probe = now + (PROBE_EVERY * (1u32 << doublings)).min(BACKOFF_MAX);
        self.changed(before)
    }

    fn changed(&mut self, before: NodeHealth) -> Option<Change> {
        let after = self.state();
        (after != before).then(|| {
            self.changes += 1;
            (before, after)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_degrade_then_down_with_backoff_and_one_success_heals() {
        let t0 = Instant::now();
        let mut s = Supervision::new(t0);
        assert!(s.due(t0));
        assert_eq!(s.success(t0), None);
        assert!(!s.due(t0 + Duration::from_secs(1)));
        assert_eq!(
            s.failure(t0),
            Some((NodeHealth::Healthy, NodeHealth::Degraded))
        );
        assert_eq!(s.failure(t0), None);
        assert_eq!(
            s.failure(t0),
            Some((NodeHealth::Degraded, NodeHealth::Down))
        );
        // the third failure in a row waits 2 s x 4
        assert!(!s.due(t0 + Duration::from_secs(7)));
        assert!(s.due(t0 + Duration::from_secs(8)));
        for _ in 0..40 {
            s.failure(t0);
        }
        assert!(s.due(t0 + BACKOFF_MAX));
        assert_eq!(s.state(), NodeHealth::Down);
        assert_eq!(s.success(t0), Some((NodeHealth::Down, NodeHealth::Healthy)));
        assert_eq!(s.changes, 3);
        assert_eq!(s.retire(), Some((NodeHealth::Healthy, NodeHealth::Down)));
        assert_eq!(s.success(t0), None);
        assert_eq!(s.state(), NodeHealth::Down);
        assert!(!s.due(t0 + BACKOFF_MAX * 2));
    }
}
