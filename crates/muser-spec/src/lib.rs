//! muser-spec: what proposes draft tokens for speculative decoding, and when to stop asking.
//! The engine verifies the drafts against the target model.
//!
//! - [`Ngram`]: prompt lookup. The longest recent suffix of the sequence (prompt and output)
//!   that occurred earlier proposes the tokens that followed it then.
//! - [`DflashDrafter`]: DFlash block drafting from the target's hidden states (a `dflash`
//!   GGUF run by muser-model), one draft cache per sequence.
//! - [`Gate`]: the adaptive off-switch. Per slot, acceptance over a window of drafted tokens;
//!   below the threshold, drafting pauses for a while and then probes again.
//! - [`RowCost`], [`best_len`]: how many drafts pay, from what a verification row costs (the
//!   engine times its decode batches) and how often the slot's drafts are taken.

mod cost;
mod dflash;
mod gate;
mod ngram;

pub use cost::{best_len, Acceptance, RowCost};
pub use dflash::DflashDrafter;
pub use gate::Gate;
pub use ngram::Ngram;

/// Most draft tokens one verification may carry (a bound on the rows one slot adds to a batch
/// and on the K/V a rollback restores).
pub const DRAFT_MAX_LIMIT: usize = 32;

/// Which drafter proposes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMode {
    /// Prompt lookup over the slot's own tokens (no extra model).
    Ngram,
    /// A DFlash drafter fed with the target's hidden states (`--dflash FILE`).
    Dflash,
}

impl SpecMode {
    /// The mode's name, as `--spec` and `speculative.type` take it.
    pub fn name(self) -> &'static str {
        match self {
            SpecMode::Ngram => "ngram",
            SpecMode::Dflash => "dflash",
        }
    }
}

impl std::str::FromStr for SpecMode {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "ngram" | "ngram-simple" | "lookup" => Ok(SpecMode::Ngram),
            "dflash" | "draft-dflash" => Ok(SpecMode::Dflash),
            other => Err(SpecError::UnknownMode(other.to_string())),
        }
    }
}

/// How a slot speculates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecConfig {
    pub mode: SpecMode,
    /// Most draft tokens per verification (1..=[`DRAFT_MAX_LIMIT`]).
    pub draft_max: usize,
    /// Fewest draft tokens worth a verification (0..=`draft_max`): a shorter proposal is
    /// dropped and the slot decodes plainly.
    pub draft_min: usize,
    /// Acceptance (accepted / drafted, over the gate's window) below which drafting pauses.
    pub min_acceptance: f32,
    /// Drafts as many as pay ([`best_len`]) and pause where they cost more time than they
    /// save; false: always up to `draft_max`, pausing only below `min_acceptance`.
    pub adaptive: bool,
}

impl SpecConfig {
    /// `mode` with the defaults: up to 8 drafts, as many as pay; pause below 25% acceptance
    /// or below break-even.
    pub fn new(mode: SpecMode) -> SpecConfig {
        SpecConfig {
            mode,
            draft_max: 8,
            draft_min: 0,
            min_acceptance: 0.25,
            adaptive: true,
        }
    }

    pub fn validate(&self) -> Result<(), SpecError> {
        if !(1..=DRAFT_MAX_LIMIT).contains(&self.draft_max) {
            return Err(SpecError::DraftMax(self.draft_max));
        }
        if self.draft_min > self.draft_max {
            return Err(SpecError::DraftMin(self.draft_min, self.draft_max));
        }
        if !(0.0..=1.0).contains(&self.min_acceptance) {
            return Err(SpecError::Threshold(self.min_acceptance));
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SpecError {
    #[error("unknown speculative mode {0:?} (known: ngram, dflash)")]
    UnknownMode(String),
    #[error("draft-max {0} is outside 1..={DRAFT_MAX_LIMIT}")]
    DraftMax(usize),
    #[error("the acceptance threshold {0} is outside 0..=1")]
    Threshold(f32),
    #[error("draft-min {0} exceeds draft-max {1}")]
    DraftMin(usize, usize),
}

/// A request's own speculative settings (llama-server's `speculative.type`,
/// `speculative.n_max` and `speculative.n_min` request fields) over the server's.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpecOverride {
    /// `Some(None)`: no speculation for this request; `Some(Some(mode))`: this drafter, even
    /// where the server does not speculate.
    pub mode: Option<Option<SpecMode>>,
    /// Most drafts per verification; 0 turns speculation off for the request.
    pub draft_max: Option<usize>,
    /// Fewest drafts worth a verification.
    pub draft_min: Option<usize>,
}

impl SpecOverride {
    /// The request's configuration over the server's `base` (`None`: no speculation).
    pub fn apply(&self, base: Option<SpecConfig>) -> Result<Option<SpecConfig>, SpecError> {
        let cfg = match (self.mode, base) {
            (Some(None), _) | (None, None) => return Ok(None),
            (Some(Some(mode)), base) => SpecConfig {
                mode,
                ..base.unwrap_or(SpecConfig::new(mode))
            },
            (None, Some(base)) => base,
        };
        if self.draft_max == Some(0) {
            return Ok(None);
        }
        let cfg = SpecConfig {
            draft_max: self.draft_max.unwrap_or(cfg.draft_max),
            draft_min: self.draft_min.unwrap_or(cfg.draft_min),
            ..cfg
        };
        cfg.validate()?;
        Ok(Some(cfg))
    }
}

/// One slot's drafting: the drafter, its gate and its recent acceptance.
#[derive(Clone, Debug)]
pub struct Drafting {
    cfg: SpecConfig,
    ngram: Ngram,
    gate: Gate,
    acceptance: Acceptance,
}

impl Drafting {
    pub fn new(cfg: SpecConfig) -> Drafting {
        Drafting {
            cfg,
            ngram: Ngram::default(),
            gate: Gate::new(cfg.min_acceptance),
            acceptance: Acceptance::default(),
        }
    }

    /// Drafts to verify after `history` (every token of the sequence, the one about to be
    /// decoded last), at most `room` of them and, when adaptive, as many as pay where a row
    /// costs `row_cost` of a one-row step; empty when the gate is closed or nothing matches.
    /// Counts one decode step for the gate.
    pub fn propose(&mut self, history: &[u32], room: usize, row_cost: f32) -> Vec<u32> {
        let Some(max) = self.open(room, row_cost) else {
            return Vec::new();
        };
        let drafts = self.ngram.draft(history, max);
        self.at_least_min(drafts)
    }

    /// The drafts `draft(max)` proposes, with `max` as [`Drafting::propose`] bounds them;
    /// empty (and `draft` not called) when the gate is closed. Counts one decode step for the
    /// gate.
    pub fn propose_with(
        &mut self,
        room: usize,
        row_cost: f32,
        draft: impl FnOnce(usize) -> Vec<u32>,
    ) -> Vec<u32> {
        let drafts = self.open(room, row_cost).map(draft).unwrap_or_default();
        self.at_least_min(drafts)
    }

    /// `drafts`, or none when they are fewer than `draft_min` (not worth a verification).
    fn at_least_min(&self, drafts: Vec<u32>) -> Vec<u32> {
        match drafts.len() < self.cfg.draft_min {
            true => Vec::new(),
            false => drafts,
        }
    }

    /// How many drafts this step may have, `None` while the gate is closed. Adaptive, at
    /// least one while the gate is open: that probe measures the acceptance, and the gate
    /// closes where it stays below break-even.
    fn open(&mut self, room: usize, row_cost: f32) -> Option<usize> {
        if !self.gate.step() {
            return None;
        }
        let max = self.cfg.draft_max.min(room);
        Some(match self.cfg.adaptive {
            true => best_len(self.acceptance.p(), row_cost, max).max(1).min(max),
            false => max,
        })
    }

    pub fn mode(&self) -> SpecMode {
        self.cfg.mode
    }

    /// How a verification went: `drafted` proposed, the first `accepted` of them taken, a
    /// row costing `row_cost` of a one-row step.
    pub fn record(&mut self, drafted: usize, accepted: usize, row_cost: f32) {
        self.acceptance.record(drafted, accepted);
        let break_even = if self.cfg.adaptive { row_cost } else { 0.0 };
        self.gate.record(drafted, accepted, break_even);
    }

    pub fn gate(&self) -> &Gate {
        &self.gate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_override_turns_speculation_off_on_or_resizes_it() {
        let server = Some(SpecConfig::new(SpecMode::Ngram));
        let off = SpecOverride {
            mode: Some(None),
            ..Default::default()
        };
        assert_eq!(off.apply(server), Ok(None));
        let zero = SpecOverride {
            draft_max: Some(0),
            ..Default::default()
        };
        assert_eq!(zero.apply(server), Ok(None));
        // sizes alone change nothing where the server does not speculate
        let sized = SpecOverride {
            draft_max: Some(4),
            draft_min: Some(2),
            ..Default::default()
        };
        assert_eq!(sized.apply(None), Ok(None));
        let got = sized.apply(server).unwrap().unwrap();
        assert_eq!((got.draft_max, got.draft_min), (4, 2));
        let on = SpecOverride {
            mode: Some(Some(SpecMode::Ngram)),
            ..sized
        };
        assert_eq!(on.apply(None).unwrap().unwrap().draft_max, 4);
        let bad = SpecOverride {
            draft_max: Some(33),
            ..Default::default()
        };
        assert_eq!(bad.apply(server), Err(SpecError::DraftMax(33)));
        let inverted = SpecOverride {
            draft_max: Some(2),
            draft_min: Some(3),
            ..Default::default()
        };
        assert_eq!(inverted.apply(server), Err(SpecError::DraftMin(3, 2)));
    }

    #[test]
    fn a_proposal_shorter_than_draft_min_is_dropped() {
        let history = [1, 2, 3, 4, 1, 2, 3];
        let fixed = SpecConfig {
            adaptive: false,
            ..SpecConfig::new(SpecMode::Ngram)
        };
        let mut d = Drafting::new(fixed);
        assert_eq!(d.propose(&history, 8, 0.25), vec![4, 1, 2, 3]);
        let mut d = Drafting::new(SpecConfig {
            draft_min: 5,
            ..fixed
        });
        assert!(d.propose(&history, 8, 0.25).is_empty());
    }

    #[test]
    fn adaptive_drafts_lengthen_while_taken_shorten_when_refused_and_pause_below_break_even() {
        let history: Vec<u32> = (0..40).chain(0..20).collect();
        let mut d = Drafting::new(SpecConfig::new(SpecMode::Ngram));
        // even odds at first: one draft where a row costs a quarter of a step
        assert_eq!(d.propose(&history, 8, 0.25).len(), 1);
        for _ in 0..5 {
            d.record(8, 8, 0.25);
        }
        assert_eq!(d.propose(&history, 8, 0.25).len(), 8);
        // cheaper rows, longer drafts at the same odds
        let mut cheap = d.clone();
        for _ in 0..5 {
            d.record(4, 1, 0.25);
            cheap.record(4, 1, 0.05);
        }
        let (n, n_cheap) = (
            d.propose(&history, 8, 0.25).len(),
            cheap.propose(&history, 8, 0.05).len(),
        );
        assert!(1 <= n && n < n_cheap, "{n} {n_cheap}");
        // below break-even the gate closes, though above the 25% threshold
        let mut d = Drafting::new(SpecConfig::new(SpecMode::Ngram));
        d.record(16, 6, 0.5);
        assert!(d.gate().is_paused());
        assert!(d.propose(&history, 8, 0.5).is_empty());
    }
}
