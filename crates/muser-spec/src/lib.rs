//! muser-spec: what proposes draft tokens for speculative decoding, and when to stop asking.
//! The engine verifies the drafts against the target model.
//!
//! - [`Ngram`]: prompt lookup. The longest recent suffix of the sequence (prompt and output)
//!   that occurred earlier proposes the tokens that followed it then.
//! - [`DflashDrafter`]: DFlash block drafting from the target's hidden states (a `dflash`
//!   GGUF run by muser-model), one draft cache per sequence.
//! - [`Gate`]: the adaptive off-switch. Per slot, acceptance over a window of drafted tokens;
//!   below the threshold, drafting pauses for a while and then probes again.

mod dflash;
mod gate;
mod ngram;

pub use dflash::DflashDrafter;
pub use gate::Gate;
pub use ngram::Ngram;

/// Most draft tokens one verification may carry. A verification stays below 64 rows of one
/// sequence, where the CPU backend's attention changes kernel (llama.cpp's tiled flash
/// attention) and its rows would stop matching one-token steps bit for bit.
pub const DRAFT_MAX_LIMIT: usize = 32;

/// Which drafter proposes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMode {
    /// Prompt lookup over the slot's own tokens (no extra model).
    Ngram,
    /// A DFlash drafter fed with the target's hidden states (`--dflash FILE`).
    Dflash,
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
    /// Acceptance (accepted / drafted, over the gate's window) below which drafting pauses.
    pub min_acceptance: f32,
}

impl SpecConfig {
    /// `mode` with the defaults: 8 drafts, pause below 25% acceptance.
    pub fn new(mode: SpecMode) -> SpecConfig {
        SpecConfig {
            mode,
            draft_max: 8,
            min_acceptance: 0.25,
        }
    }

    pub fn validate(&self) -> Result<(), SpecError> {
        if !(1..=DRAFT_MAX_LIMIT).contains(&self.draft_max) {
            return Err(SpecError::DraftMax(self.draft_max));
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
}

/// One slot's drafting: the drafter and its gate.
#[derive(Clone, Debug)]
pub struct Drafting {
    cfg: SpecConfig,
    ngram: Ngram,
    gate: Gate,
}

impl Drafting {
    pub fn new(cfg: SpecConfig) -> Drafting {
        Drafting {
            cfg,
            ngram: Ngram::default(),
            gate: Gate::new(cfg.min_acceptance),
        }
    }

    /// Drafts to verify after `history` (every token of the sequence, the one about to be
    /// decoded last), at most `room` of them; empty when the gate is closed or nothing
    /// matches. Counts one decode step for the gate.
    pub fn propose(&mut self, history: &[u32], room: usize) -> Vec<u32> {
        match self.open(room) {
            Some(max) => self.ngram.draft(history, max),
            None => Vec::new(),
        }
    }

    /// The drafts `draft(max)` proposes, at most `room` and `--draft-max` of them; empty (and
    /// `draft` not called) when the gate is closed. Counts one decode step for the gate.
    pub fn propose_with(&mut self, room: usize, draft: impl FnOnce(usize) -> Vec<u32>) -> Vec<u32> {
        self.open(room).map(draft).unwrap_or_default()
    }

    /// How many drafts this step may have, `None` while the gate is closed.
    fn open(&mut self, room: usize) -> Option<usize> {
        self.gate.step().then(|| self.cfg.draft_max.min(room))
    }

    pub fn mode(&self) -> SpecMode {
        self.cfg.mode
    }

    /// How a verification went: `drafted` proposed, the first `accepted` of them taken.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.gate.record(drafted, accepted);
    }

    pub fn gate(&self) -> &Gate {
        &self.gate
    }
}
