//! Muse Glimmer's image encoder: preprocessing and the ViT + projector on the CPU or a GPU.
//!
//! The projector is the GGUF llama.cpp's converter writes for Muse Glimmer
//! (`clip.projector_type = "muse-glimmer"`, loaded by `--mmproj FILE`), and the numbers
//! follow llama.cpp b11434's mtmd (`tools/mtmd/models/muse-glimmer.cpp` and the
//! `PROJECTOR_TYPE_MUSE_GLIMMER` branches of `clip.cpp` and `mtmd-image.cpp`):
//!
//! 1. [`preprocess`]: decode PNG/JPEG/WebP (bounded bytes and pixels) to 8-bit RGB the way
//!    stb_image does (alpha dropped, gray replicated), choose the aspect-preserving grid of
//!    `patch_size × merge` cells under 4096 output tokens, resize with Pillow's fixed-point
//!    Lanczos, then scale to [0, 1] and normalize with the file's mean and std.
//! 2. [`Projector::encode`]: conv patch embedding, the learned position grid resized
//!    bilinearly, the windowed ViT (LayerNorm, 2D RoPE: width positions in the first half of
//!    each head, height in the second; block-diagonal windows of the position grid's size,
//!    every 4th and the last layer global; erf-GELU MLP), pixel-shuffle 2×2, then the
//!    three-matrix projector (`mm.0`, GELU, `mm.1`, GELU, `mm.2`) into the text model's width.
//!
//! On the CPU, matrix products run through muser-model's `Backend::matmul` (ggml's CPU kernel
//! choice per weight type) and the rest is written here in f32 with ggml's accumulation types;
//! with the `cuda` feature, [`Encoder`] can run the whole encode on a GPU instead (`gpu.rs`:
//! the same steps from the same host prelude, activations kept on the device).
//! [`synth`] writes a synthetic projector with the converter's key and tensor names.

mod device;
mod encoder;
#[cfg(feature = "cuda")]
mod gpu;
pub mod preprocess;
mod projector;
pub mod synth;

pub use device::{Device, Encoder, Stages};
pub use encoder::{Embeddings, EncodedImage};
pub use preprocess::{decode, grid_size, preprocess, Limits, Pixels, Rgb8};
pub use projector::{Hparams, Projector, IMAGE_BEGIN, IMAGE_END, MAX_IMAGE_TOKENS, PROJECTOR_TYPE};

/// Errors of the vision encoder; each names what a user can fix.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    #[error(transparent)]
    Gguf(#[from] muser_gguf::Error),
    #[error("projector: {0}")]
    Projector(String),
    #[error("image: {0}")]
    Image(String),
    #[error("image too large: {0}")]
    TooLarge(String),
    #[error(transparent)]
    Model(#[from] muser_model::ModelError),
    #[error("image encoder device: {0}")]
    Device(String),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}
