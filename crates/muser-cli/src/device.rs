//! `--device cpu|cuda`: which backend a command loads the model onto.

use muser_model::{LoadOptions, Model};
use std::path::Path;

/// Where the forward pass runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// The CPU backend (llama.cpp's CPU numerics, token for token).
    #[default]
    Cpu,
    /// The first CUDA GPU (needs a muser built with `--features cuda`).
    Cuda,
}

impl Device {
    /// The name in tables and receipts.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "CPU",
            Device::Cuda => "CUDA",
        }
    }
}

/// Loads `path` onto `device`.
pub fn load(path: &Path, device: Device, opts: &LoadOptions) -> anyhow::Result<Model> {
    let model = match device {
        Device::Cpu => Model::load(path, opts)?,
        Device::Cuda => load_cuda(path)?,
    };
    Ok(model)
}

#[cfg(feature = "cuda")]
fn load_cuda(path: &Path) -> anyhow::Result<Model> {
    use anyhow::Context;
    let backend = muser_cuda::backend::CudaBackend::new(0).context("starting the CUDA backend")?;
    Ok(Model::load_with(path, backend)?)
}

#[cfg(not(feature = "cuda"))]
fn load_cuda(_path: &Path) -> anyhow::Result<Model> {
    anyhow::bail!(
        "--device cuda: this muser was built without CUDA support; rebuild it with \
         `cargo build --release -p muser-cli --features cuda`"
    )
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use super::*;

    #[test]
    fn cuda_without_the_feature_names_it() {
        let opts = LoadOptions::default();
        let Err(e) = load(Path::new("unused.gguf"), Device::Cuda, &opts) else {
            panic!("--device cuda loaded a model without the cuda feature");
        };
        assert!(format!("{e:#}").contains("--features cuda"), "{e:#}");
    }
}
