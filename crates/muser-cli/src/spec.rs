//! The speculative-decoding flags `muser run`, `muser bench` and `muser up` share.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use muser_engine::{SpecConfig, SpecMode};
use muser_model::models::dflash::Dflash;

use crate::device::Device;

#[derive(clap::Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("speculative").args(["spec", "dflash"]).multiple(true)))]
pub struct SpecArgs {
    /// Speculative decoding: `ngram` (prompt lookup over the slot's own tokens, no extra
    /// model) or `dflash` (with `--dflash`). Greedy output is unchanged; sampling keeps its
    /// distribution.
    #[arg(long = "spec", value_name = "MODE")]
    spec: Option<SpecMode>,
    /// A DFlash drafter GGUF (llama.cpp's `dflash` architecture, made for this model):
    /// speculative mode dflash.
    #[arg(long = "dflash", value_name = "FILE")]
    dflash: Option<PathBuf>,
    /// Most draft tokens one verification carries (1..=32; a DFlash drafter also stops at
    /// its block size - 1).
    #[arg(long = "draft-max", default_value_t = 8, requires = "speculative")]
    draft_max: usize,
}

impl SpecArgs {
    /// The engine's speculative configuration on `device`, `None` without `--spec`.
    /// Refused on the GPU paths: their multi-token batches run other kernels than their
    /// decode steps (the fused prefill's bf16 GEMMs), so a verification's greedy tokens would
    /// not be plain decoding's.
    pub fn config(&self, device: Device) -> anyhow::Result<Option<SpecConfig>> {
        let mode = match (self.spec, &self.dflash) {
            (None, None) => return Ok(None),
            (Some(SpecMode::Dflash), None) => anyhow::bail!("--spec dflash needs --dflash FILE"),
            (Some(SpecMode::Ngram), Some(_)) => {
                anyhow::bail!("--dflash drafts in mode dflash, not --spec ngram")
            }
            (Some(mode), None) => mode,
            (_, Some(_)) => SpecMode::Dflash,
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

    /// The `--dflash` file, if given.
    pub fn dflash_path(&self) -> Option<&Path> {
        self.dflash.as_deref()
    }

    /// The `--dflash` drafter, loaded.
    pub fn dflash(&self) -> anyhow::Result<Option<Arc<Dflash>>> {
        let Some(path) = &self.dflash else {
            return Ok(None);
        };
        let d = Dflash::load(path, 0).with_context(|| format!("--dflash {}", path.display()))?;
        Ok(Some(Arc::new(d)))
    }
}
