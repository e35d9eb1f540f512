//! One error type for the CUDA backend; every variant says what a user can do about it.

/// What can go wrong when starting or running the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The crate was built without the `cuda` feature.
    #[error("this build has no CUDA support: rebuild with `--features cuda`")]
    NotBuilt,
    /// A CUDA shared library could not be loaded.
    #[error(
        "CUDA library {lib} not found ({hint}); install it or add its folder to LD_LIBRARY_PATH"
    )]
    LibraryMissing {
        /// Library that is missing.
        lib: &'static str,
        /// Where it usually comes from.
        hint: &'static str,
    },
    /// The driver loaded but reports no usable device.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// NVRTC needs the toolkit headers (cuda_fp16.h and friends).
    #[error("CUDA headers not found (looked for cuda_fp16.h in {0}); set CUDA_HOME or CUDA_PATH to the toolkit root")]
    HeadersMissing(String),
    /// NVRTC rejected the kernel source.
    #[error("kernel compilation failed: {0}")]
    Compile(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// The model or tensor is outside what the kernels support.
    #[error("unsupported by the CUDA backend: {0}")]
    Unsupported(String),
    /// A size or shape that does not fit.
    #[error("bad shape: {0}")]
    Shape(String),
    /// The model file is missing something the forward pass needs.
    #[error("model: {0}")]
    Model(String),
    /// File system error (kernel cache, model file).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
