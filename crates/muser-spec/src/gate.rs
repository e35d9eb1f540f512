//! The adaptive off-switch: speculation pauses where it does not pay and probes again later.

/// Drafted tokens a window holds before the gate judges it.
const WINDOW: usize = 16;
/// Decode steps without drafts after a poor window, before probing again. Short: code edits
/// alternate copied runs with rewritten stretches, and a long first pause skipped the next
/// copy (replaying SmolLM2's code-rename output, a first pause of 64 steps gave 1.16x where 16
/// gave 1.30x at the same row cost); text that never accepts still doubles it up to
/// [`PAUSE_MAX`].
const PAUSE_STEPS: u32 = 16;
/// The longest pause: each poor window in a row doubles the pause up to this.
const PAUSE_MAX: u32 = 1024;

/// Windowed acceptance of one slot's drafts. Closed (no drafts) for [`PAUSE_STEPS`] decode
/// steps after a window of at least [`WINDOW`] drafted tokens accepted fewer than the
/// threshold (or than break-even, where the caller knows it); then open again with a fresh window (the probe). Each further poor window in a
/// row doubles the pause (up to [`PAUSE_MAX`]), so text that never accepts pays one poor
/// window per ever longer stretch; a good window brings the pause back to [`PAUSE_STEPS`].
#[derive(Clone, Debug)]
pub struct Gate {
    min_acceptance: f32,
    drafted: usize,
    accepted: usize,
    paused: u32,
    /// The next pause's length.
    pause: u32,
    /// Times the gate closed.
    pauses: u64,
}

impl Gate {
    pub fn new(min_acceptance: f32) -> Gate {
        Gate {
            min_acceptance,
            drafted: 0,
            accepted: 0,
            paused: 0,
            pause: PAUSE_STEPS,
            pauses: 0,
        }
    }

    /// One decode step: true when this step may draft.
    pub fn step(&mut self) -> bool {
        if self.paused > 0 {
            self.paused -= 1;
            return false;
        }
        true
    }

    /// A verification's outcome. A window is poor below the threshold, or below `break_even`
    /// (the acceptance under which drafting costs more time than it saves) where that is higher.
    pub fn record(&mut self, drafted: usize, accepted: usize, break_even: f32) {
        self.drafted += drafted;
        self.accepted += accepted.min(drafted);
        if self.drafted >= WINDOW {
            let threshold = self.min_acceptance.max(break_even);
            if (self.accepted as f32) < threshold * self.drafted as f32 {
                self.paused = self.pause;
                self.pause = (self.pause * 2).min(PAUSE_MAX);
                self.pauses += 1;
            } else {
                self.pause = PAUSE_STEPS;
            }
            self.drafted = 0;
            self.accepted = 0;
        }
    }

    /// Whether drafting is paused now.
    pub fn is_paused(&self) -> bool {
        self.paused > 0
    }

    /// Times the gate closed so far.
    pub fn pauses(&self) -> u64 {
        self.pauses
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poor_window_pauses_drafting_then_the_gate_probes_again() {
        let mut g = Gate::new(0.25);
        assert!(g.step());
        // 16 drafted, 3 accepted (< 25%): closed
        g.record(8, 2, 0.0);
        assert!(!g.is_paused());
        g.record(8, 1, 0.0);
        assert!(g.is_paused());
        assert_eq!(g.pauses(), 1);
        let open = (0..PAUSE_STEPS + 1).filter(|_| g.step()).count();
        assert_eq!(open, 1, "closed for exactly the pause");
        // the probe: a good window keeps it open
        g.record(8, 4, 0.0);
        g.record(8, 0, 0.0);
        assert!(!g.is_paused());
        assert!(g.step());
        assert_eq!(g.pauses(), 1);
    }

    #[test]
    fn poor_windows_in_a_row_double_the_pause_and_a_good_one_resets_it() {
        let mut g = Gate::new(0.25);
        let closed = |g: &mut Gate| (0..2 * PAUSE_MAX).take_while(|_| !g.step()).count() as u32;
        for want in [16, 32, 64, 128, 256, 512, 1024, 1024] {
            g.record(16, 0, 0.0);
            assert_eq!(closed(&mut g), want);
        }
        g.record(16, 8, 0.0);
        g.record(16, 0, 0.0);
        assert_eq!(closed(&mut g), PAUSE_STEPS);
    }

    #[test]
    fn a_window_below_break_even_is_poor_whatever_the_threshold() {
        let mut g = Gate::new(0.0);
        g.record(16, 4, 0.3);
        assert!(g.is_paused());
        let mut g = Gate::new(0.0);
        g.record(16, 5, 0.3);
        assert!(!g.is_paused());
    }

    #[test]
    fn threshold_zero_never_closes() {
        let mut g = Gate::new(0.0);
        for _ in 0..100 {
            g.record(8, 0, 0.0);
            assert!(g.step());
        }
    }
}
