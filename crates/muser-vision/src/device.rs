//! Where an encoder's matrix products run: the CPU backend, or (feature `cuda`) muser-cuda's
//! op-by-op `CudaBackend` in its exact precision (f32 weights on the device, activations
//! rounded as the CPU rounds them). Everything else of the encoder (norms, RoPE, attention,
//! pixel shuffle) runs on the host either way.

use muser_model::CpuBackend;

use crate::encoder::{Embeddings, EncodedImage};
use crate::preprocess::{Limits, Pixels};
use crate::projector::Projector;
use crate::VisionError;

/// The device an [`Encoder`] multiplies on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// The first CUDA GPU (a muser-vision built with the `cuda` feature).
    Cuda,
}

enum Compute {
    Cpu(CpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(muser_cuda::backend::CudaBackend),
}

/// A projector and the backend it encodes images on.
pub struct Encoder {
    projector: Projector,
    compute: Compute,
}

impl Encoder {
    /// `projector` encoding on `device`; `threads` CPU threads for the CPU backend (0: one per
    /// core).
    pub fn new(
        projector: Projector,
        device: Device,
        threads: usize,
    ) -> Result<Encoder, VisionError> {
        let compute = match device {
            Device::Cpu => Compute::Cpu(CpuBackend::new(threads)?),
            #[cfg(feature = "cuda")]
            Device::Cuda => Compute::Cuda(
                muser_cuda::backend::CudaBackend::new(0)
                    .map_err(|e| VisionError::Device(format!("starting CUDA: {e}")))?,
            ),
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
        self.projector.n_tokens(&crate::decode(bytes, limits)?)
    }

    /// [`Projector::embed`] on this encoder's device.
    pub fn embed(&self, bytes: &[u8], limits: &Limits) -> Result<EncodedImage, VisionError> {
        match &self.compute {
            Compute::Cpu(b) => self.projector.embed(b, bytes, limits),
            #[cfg(feature = "cuda")]
            Compute::Cuda(b) => self.projector.embed(b, bytes, limits),
        }
    }

    /// [`Projector::encode`] on this encoder's device.
    pub fn encode(&self, px: &Pixels) -> Result<Embeddings, VisionError> {
        match &self.compute {
            Compute::Cpu(b) => self.projector.encode(b, px),
            #[cfg(feature = "cuda")]
            Compute::Cuda(b) => self.projector.encode(b, px),
        }
    }
}
