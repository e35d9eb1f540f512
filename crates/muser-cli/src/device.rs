//! `--device cpu|cuda`: which backend a command loads the model onto.

use anyhow::Context;
use muser_model::{FlashAttn, LoadOptions, Model, Numerics, NumericsMode};
use std::path::Path;

/// Where the forward pass runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// The CPU backend (llama.cpp's CPU numerics, token for token).
    #[default]
    Cpu,
    /// The first CUDA GPU (needs a muser built with `--features cuda`): muse-glimmer through
    /// the fused forward (quantized GEMVs, decode steps as CUDA graph replays), other
    /// architectures through the op-by-op CUDA backend.
    Cuda,
    /// The first CUDA GPU, always through the op-by-op CUDA backend (the model files op by op;
    /// the CPU's numerics when the weights fit as f32).
    CudaOps,
}

impl Device {
    /// Where images encode when the text model runs here: the CPU, or the GPU (the
    /// encoder's matrix products on the op-by-op backend, beside either CUDA forward).
    pub fn image_device(self) -> muser_vision::Device {
        match self {
            Device::Cpu => muser_vision::Device::Cpu,
            Device::Cuda | Device::CudaOps => muser_vision::Device::Cuda,
        }
    }

    /// The name in tables and receipts.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "CPU",
            Device::Cuda => "CUDA",
            Device::CudaOps => "CUDA (ops)",
        }
    }
}

/// `--numerics` (run, bench, up): which profile the CPU backend computes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum NumericsArg {
    /// One order on every x86 host: llama.cpp b11434's AVX512 build (for a lane or a pack
    /// store shared by hosts of different instruction sets)
    Portable,
    /// llama.cpp b11434 as built natively for this CPU, with its default settings
    Host,
}

/// `--flash-attn` in llama.cpp's spelling.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum FlashAttnArg {
    On,
    Off,
    /// On for the CPU backend, as llama.cpp resolves it
    #[default]
    Auto,
}

/// The numerics flags shared by `run`, `bench` and `up` (see `docs/exactness.md`).
#[derive(Clone, Copy, Debug, Default, clap::Args)]
pub struct NumericsArgs {
    /// Numerics profile of the CPU backend [default: host, the order of llama.cpp built for
    /// this CPU; portable on a CPU without AVX2, which no llama.cpp order of Muser's matches]
    #[arg(long, value_enum)]
    pub numerics: Option<NumericsArg>,
    /// Flash attention (llama.cpp's `-fa`)
    #[arg(long = "flash-attn", value_enum, default_value_t = FlashAttnArg::Auto)]
    pub flash_attn: FlashAttnArg,
}

impl NumericsArgs {
    /// The profile these flags name on this host, refused with a message when the CPU backend
    /// does not implement it, or when a device backend (which has its own numerics) is asked
    /// for anything but the defaults. `None` for device backends.
    pub fn resolve(&self, device: Device) -> anyhow::Result<Option<Numerics>> {
        let isa = muser_quant::detected_isa();
        let mode = match self.numerics {
            Some(NumericsArg::Portable) => NumericsMode::Portable,
            Some(NumericsArg::Host) => NumericsMode::Host,
            // the default: equal to the llama.cpp a user builds on this machine
            None if isa == muser_quant::Isa::Scalar => NumericsMode::Portable,
            None => NumericsMode::Host,
        };
        let fa = match self.flash_attn {
            FlashAttnArg::On => FlashAttn::On,
            FlashAttnArg::Off => FlashAttn::Off,
            FlashAttnArg::Auto => FlashAttn::Auto,
        };
        if device != Device::Cpu {
            if self.numerics.is_some() || fa != FlashAttn::Auto {
                anyhow::bail!(
                    "--numerics and --flash-attn choose the CPU backend's order; --device {} \
                     computes in its own",
                    device.name()
                );
            }
            return Ok(None);
        }
        Ok(Some(Numerics::resolve(mode, fa, isa)?))
    }
}

/// Loads `path` onto `device` with `threads` CPU threads (0: one per core), the CPU backend
/// in `numerics` (what [`NumericsArgs::resolve`] gave; `None` on the other devices); an error
/// names the file.
pub fn load(
    path: &Path,
    device: Device,
    threads: usize,
    numerics: Option<Numerics>,
) -> anyhow::Result<Model> {
    let model = match device {
        Device::Cpu => Model::load(
            path,
            &LoadOptions {
                threads,
                numerics: numerics.unwrap_or_default(),
            },
        )
        .map_err(anyhow::Error::from),
        Device::Cuda => load_cuda(path, true),
        Device::CudaOps => load_cuda(path, false),
    };
    model.with_context(|| format!("loading {}", path.display()))
}

/// Share of device memory the exact precision's f32 weights may take.
#[cfg(feature = "cuda")]
const EXACT_SHARE: f64 = 0.4;

/// The CUDA backend's precision for a model of `n_weights` values on a device of `mem` bytes:
/// exact (the CPU's numerics, f32 weights) when they fit in [`EXACT_SHARE`] of it, else fast
/// (quantized weights on the device).
#[cfg(feature = "cuda")]
fn precision_for(n_weights: u64, mem: usize) -> muser_cuda::backend::Precision {
    use muser_cuda::backend::Precision;
    if (4 * n_weights) as f64 <= EXACT_SHARE * mem as f64 {
        Precision::Exact
    } else {
        Precision::Fast
    }
}

#[cfg(feature = "cuda")]
fn load_cuda(path: &Path, fused: bool) -> anyhow::Result<Model> {
    use muser_cuda::backend::CudaBackend;
    use muser_cuda::glimmer::FusedGlimmer;
    use muser_cuda::runtime::Gpu;
    let g =
        muser_gguf::GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    if fused {
        let gpu = Gpu::new(0).context("starting CUDA")?;
        match FusedGlimmer::load(gpu, &g) {
            Ok(f) => {
                eprintln!(
                    "CUDA: fused muse-glimmer forward on {} ({:.2} GB of weights per decode \
                     step)",
                    f.gpu().info().name,
                    f.decode_weight_bytes() as f64 / 1e9
                );
                return Ok(Model::with_fused(g, Box::new(f))?);
            }
            // Other architectures, shapes or types: the op-by-op backend.
            Err(muser_cuda::CudaError::Unsupported(why)) => {
                eprintln!("CUDA: {why}; running op by op")
            }
            Err(e) => return Err(e).context("loading the fused muse-glimmer model"),
        }
    }
    let n: u64 = g.tensors().iter().map(|t| t.n_elements()).sum();
    let mut backend = CudaBackend::new(0).context("starting the CUDA backend")?;
    let mem = backend.gpu().info().total_mem;
    let precision = precision_for(n, mem);
    backend.set_precision(precision)?;
    eprintln!(
        "CUDA backend: {} precision ({:.2} G weights, {:.0} GiB device memory)",
        format!("{precision:?}").to_lowercase(),
        n as f64 / 1e9,
        mem as f64 / (1u64 << 30) as f64
    );
    Ok(Model::from_gguf_with(g, backend)?)
}

#[cfg(not(feature = "cuda"))]
fn load_cuda(_path: &Path, _fused: bool) -> anyhow::Result<Model> {
    Err(cuda_not_built("--device cuda"))
}

/// The error of a CUDA option (`flag`) in a muser built without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn cuda_not_built(flag: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{flag}: this muser was built without CUDA support; rebuild it with \
         `cargo build --release -p muser-cli --features cuda`"
    )
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::*;
    use muser_cuda::backend::Precision;

    #[test]
    fn exact_precision_while_f32_weights_fit() {
        let gib = 1usize << 30;
        // SmolLM2 (135 M values) and a 1 B model on a 24 GiB card: exact.
        assert_eq!(precision_for(135_000_000, 24 * gib), Precision::Exact);
        assert_eq!(precision_for(1_000_000_000, 24 * gib), Precision::Exact);
        // Muse Glimmer (27.85 G values) on an H200: 111 GB of f32 is too much.
        assert_eq!(precision_for(27_854_794_240, 141 * gib), Precision::Fast);
    }
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use super::*;

    #[test]
    fn cuda_without_the_feature_names_it() {
        let Err(e) = load(Path::new("unused.gguf"), Device::Cuda, 0, None) else {
            panic!("--device cuda loaded a model without the cuda feature");
        };
        assert!(format!("{e:#}").contains("--features cuda"), "{e:#}");
        assert!(format!("{e:#}").contains("loading unused.gguf"), "{e:#}");
    }

    #[test]
    fn both_cuda_devices_parse_and_name_the_missing_feature() {
        use clap::ValueEnum;
        for (name, want) in [("cuda", Device::Cuda), ("cuda-ops", Device::CudaOps)] {
            assert_eq!(Device::from_str(name, false), Ok(want));
            let Err(e) = load(Path::new("unused.gguf"), want, 0, None) else {
                panic!("--device {name} loaded a model without the cuda feature");
            };
            assert!(format!("{e:#}").contains("--features cuda"), "{e:#}");
        }
    }
}
