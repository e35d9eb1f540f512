//! How long drafts should be: what a verification row costs (measured) against how likely a
//! draft is to be taken (per slot).
//!
//! A verification of `k` drafts costs `1 + c·k` one-row steps, where `c` is what one more row
//! adds to a step; it yields `1 + p + p² + … + pᵏ` tokens when each draft is taken with
//! probability `p` once the ones before it were. The best length maximizes tokens per unit of
//! time; none pays when `p < c` (one draft gives `(1 + p) / (1 + c) < 1`).

/// Weight of the newest observation in the running sums (about the last 50 steps count).
const NEW: f64 = 0.02;
/// `c` before two different batch sizes were timed.
const PRIOR_ROW_RATIO: f64 = 0.25;
/// Verifications whose outcome weighs in the acceptance estimate decay by this each time.
const KEEP: f32 = 0.8;

/// Forward times of decode batches (one row per decoding slot, plus drafts), fitted as
/// `seconds = base + per_row · rows` over decaying sums.
#[derive(Clone, Copy, Debug, Default)]
pub struct RowCost {
    /// Decaying sums of 1, rows, rows², seconds and rows·seconds.
    n: f64,
    x: f64,
    xx: f64,
    y: f64,
    xy: f64,
}

impl RowCost {
    /// A decode batch of `rows` rows took `seconds`.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        if rows == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let x = rows as f64;
        let keep = 1.0 - NEW;
        self.n = self.n * keep + 1.0;
        self.x = self.x * keep + x;
        self.xx = self.xx * keep + x * x;
        self.y = self.y * keep + seconds;
        self.xy = self.xy * keep + x * seconds;
    }

    /// What one more row adds to a step, as a fraction of a one-row step (`c`): the fitted
    /// slope over the fitted one-row time, [`PRIOR_ROW_RATIO`] until the sizes seen differ.
    pub fn row_ratio(&self) -> f32 {
        let var = self.n * self.xx - self.x * self.x;
        // rows seen must vary (by about a row in every few steps) for a slope
        if self.n < 1.0 || var < 0.1 * self.n * self.n {
            return PRIOR_ROW_RATIO as f32;
        }
        let slope = ((self.n * self.xy - self.x * self.y) / var).max(0.0);
        let base = (self.y - slope * self.x) / self.n;
        let one_row = base + slope;
        match one_row > 0.0 {
            true => (slope / one_row).min(1.0) as f32,
            false => PRIOR_ROW_RATIO as f32,
        }
    }
}

/// One slot's recent acceptance: the chance that a draft is taken once the ones before it
/// were, from decaying counts of taken drafts and of verifications that refused one.
#[derive(Clone, Copy, Debug)]
pub struct Acceptance {
    taken: f32,
    refused: f32,
}

impl Default for Acceptance {
    /// One taken and one refused: even odds before anything was verified.
    fn default() -> Self {
        Acceptance {
            taken: 1.0,
            refused: 1.0,
        }
    }
}

impl Acceptance {
    /// A verification took `accepted` of `drafted` drafts (the first refused one ends it).
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        let accepted = accepted.min(drafted);
        self.taken = self.taken * KEEP + accepted as f32;
        self.refused = self.refused * KEEP + f32::from(accepted < drafted);
    }

    /// The chance that the next draft is taken.
    pub fn p(&self) -> f32 {
        self.taken / (self.taken + self.refused).max(f32::MIN_POSITIVE)
    }
}

/// The number of drafts (0..=`max`) that gives the most tokens per unit of time when each is
/// taken with probability `p` (given the ones before it were) and each row costs `c` of a
/// one-row step; the shorter one on a tie.
pub fn best_len(p: f32, c: f32, max: usize) -> usize {
    let (p, c) = (p.clamp(0.0, 1.0) as f64, c.max(0.0) as f64);
    let (mut best, mut best_rate) = (0, 1.0);
    let (mut tokens, mut p_j) = (1.0, 1.0);
    for k in 1..=max {
        p_j *= p;
        tokens += p_j;
        let rate = tokens / (1.0 + c * k as f64);
        if rate > best_rate * (1.0 + 1e-9) {
            (best, best_rate) = (k, rate);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_length_grows_with_acceptance_and_shrinks_with_row_cost() {
        // nothing pays below break-even (p < c)
        assert_eq!(best_len(0.2, 0.25, 8), 0);
        assert_eq!(best_len(0.0, 0.0, 8), 0);
        assert_eq!(best_len(0.5, 0.25, 8), 1);
        assert_eq!(best_len(0.8, 0.25, 8), 3);
        assert_eq!(best_len(0.95, 0.1, 8), 8);
        // free rows: draft all that may be taken
        assert_eq!(best_len(0.3, 0.0, 8), 8);
        assert_eq!(best_len(0.8, 0.6, 8), 1);
        assert_eq!(best_len(1.0, 0.1, 0), 0);
        let lens: Vec<usize> = [0.3, 0.5, 0.7, 0.9, 0.99]
            .iter()
            .map(|&p| best_len(p, 0.1, 16))
            .collect();
        assert!(lens.windows(2).all(|w| w[0] <= w[1]), "{lens:?}");
    }

    #[test]
    fn the_row_cost_is_the_fitted_slope_over_a_one_row_step() {
        let mut c = RowCost::default();
        assert_eq!(c.row_ratio(), PRIOR_ROW_RATIO as f32);
        // one row alone: no slope yet
        for _ in 0..20 {
            c.observe(1, 0.010);
        }
        assert_eq!(c.row_ratio(), PRIOR_ROW_RATIO as f32);
        // 10 ms for one row, 2 ms more per row
        for k in 0..200 {
            let rows = 1 + k % 9;
            c.observe(rows, 0.010 + 0.002 * (rows - 1) as f64);
        }
        assert!((c.row_ratio() - 0.2).abs() < 1e-3, "{}", c.row_ratio());
        // nonsense is ignored
        c.observe(0, 1.0);
        c.observe(3, f64::NAN);
        c.observe(3, -1.0);
        assert!((c.row_ratio() - 0.2).abs() < 1e-3, "{}", c.row_ratio());
    }

    #[test]
    fn acceptance_follows_recent_verifications() {
        let mut a = Acceptance::default();
        assert_eq!(a.p(), 0.5);
        for _ in 0..20 {
            a.record(8, 8);
        }
        assert!(a.p() > 0.95, "{}", a.p());
        for _ in 0..20 {
            a.record(4, 0);
        }
        assert!(a.p() < 0.1, "{}", a.p());
        // one taken of two, each time
        for _ in 0..50 {
            a.record(2, 1);
        }
        assert!((a.p() - 0.5).abs() < 0.01, "{}", a.p());
    }
}
