//! Where an encoder runs: the CPU backend (matrix products through muser-model's `Backend`,
//! the rest on the host's threads), or (feature `cuda`) the device-resident GPU encoder
//! ([`crate::gpu::GpuEncoder`]: every step on the device, the weights uploaded once).

use muser_model::CpuBackend;

use crate::encoder::{Embeddings, EncodedImage};
use crate::preprocess::{decode, Limits, Pixels};
use crate::projector::Projector;
use crate::VisionError;

/// Where one GPU encode's device time went ([`Encoder::encode_staged`]): each step is waited
/// for, so the sum is the encode's device time plus launch gaps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stages {
    /// The host prelude (`Projector::prepare`: patches, position grid, window order, RoPE
    /// table), on the host's threads.
    pub prepare_ms: f64,
    /// Matrix products (with their activations' rounding and bias adds).
    pub products_ms: f64,
    /// Attention: scores, softmax, weighted values.
    pub attention_ms: f64,
    /// Everything else on the device: uploads, norms, RoPE, GELU, residual adds, permutations,
    /// pixel shuffle, the download.
    pub rest_ms: f64,
}

/// The device an [`Encoder`] runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// The first CUDA GPU (a muser-vision built with the `cuda` feature).
    Cuda,
}

enum Compute {
    Cpu(CpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::gpu::GpuEncoder>),
}

/// A projector and the device it encodes images on.
pub struct Encoder {
    projector: Projector,
    compute: Compute,
}

impl Encoder {
    /// `projector` encoding on `device` (its weights uploaded now); `threads` CPU threads for
    /// the CPU backend (0: one per core).
    pub fn new(
        projector: Projector,
        device: Device,
        threads: usize,
    ) -> Result<Encoder, VisionError> {
        let compute = match device {
            Device::Cpu => Compute::Cpu(CpuBackend::new(threads)?),
            #[cfg(feature = "cuda")]
            Device::Cuda => Compute::Cuda(Box::new(crate::gpu::GpuEncoder::new(&projector)?)),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => {
                return Err(VisionError::Device(
                    "this build has no CUDA support (muser-vision's `cuda` feature)".into(),
                ))
            }
        };
        Ok(Encoder { projector, compute })
    }

    pub fn projector(&self) -> &Projector {
        &self.projector
    }

    pub fn device(&self) -> Device {
        match self.compute {
            Compute::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Compute::Cuda(_) => Device::Cuda,
        }
    }

    /// The tokens an image file takes in the context: decoded (within `limits`), not encoded.
    pub fn n_tokens(&self, bytes: &[u8], limits: &Limits) -> Result<usize, VisionError> {
        self.projector.n_tokens(&decode(bytes, limits)?)
    }

    /// Decodes (within `limits`), preprocesses and encodes one image file's bytes.
    pub fn embed(&self, bytes: &[u8], limits: &Limits) -> Result<EncodedImage, VisionError> {
        let rgb = decode(bytes, limits)?;
        let embeddings = self.encode(&self.projector.preprocess(&rgb)?)?;
        Ok(EncodedImage {
            digest: rgb.digest(),
            embeddings,
        })
    }

    /// Encodes one preprocessed image on this encoder's device.
    pub fn encode(&self, px: &Pixels) -> Result<Embeddings, VisionError> {
        Ok(self.encode_staged(px, false)?.0)
    }

    /// [`Encoder::encode`], and with `stages` on a GPU, where its device time went (each step
    /// waited for: slower than a plain encode).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn encode_staged(
        &self,
        px: &Pixels,
        stages: bool,
    ) -> Result<(Embeddings, Option<Stages>), VisionError> {
        match &self.compute {
            Compute::Cpu(b) => Ok((self.projector.encode(b, px)?, None)),
            #[cfg(feature = "cuda")]
            Compute::Cuda(g) => g.encode(&self.projector, px, stages),
        }
    }
}
