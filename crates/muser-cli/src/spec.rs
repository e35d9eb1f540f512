//! The speculative-decoding flags `muser run`, `muser bench` and `muser up` share.

use muser_engine::{SpecConfig, SpecMode};

use crate::device::Device;

#[derive(clap::Args, Debug, Clone)]
pub struct SpecArgs {
    /// Speculative decoding: `ngram` (prompt lookup over the slot's own tokens, no extra
    /// model). Greedy output is unchanged; sampling keeps its distribution.
    #[arg(long = "spec", value_name = "MODE")]
    spec: Option<SpecMode>,
    /// Most draft tokens one verification carries (1..=32).
    #[arg(long = "draft-max", default_value_t = 8, requires = "spec")]
    draft_max: usize,
}

impl SpecArgs {
    /// The engine's speculative configuration on `device`, `None` without `--spec`.
    /// Refused on the GPU paths: their multi-token batches run other kernels than their
    /// decode steps (the fused prefill's bf16 GEMMs), so a verification's greedy tokens would
    /// not be plain decoding's.
    pub fn config(&self, device: Device) -> anyhow::Result<Option<SpecConfig>> {
        let Some(mode) = self.spec else {
            return Ok(None);
        };
        if device != Device::Cpu {
            anyhow::bail!(
                "--spec runs on the CPU backend only for now: a GPU verifies drafts with its \
                 prefill kernels, whose rounding differs from its decode step"
            );
        }
        let cfg = SpecConfig {
            draft_max: self.draft_max,
            ..SpecConfig::new(mode)
        };
        cfg.validate()?;
        Ok(Some(cfg))
    }
}
