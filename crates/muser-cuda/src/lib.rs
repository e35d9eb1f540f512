//! CUDA backend for Muser: Muse Glimmer on an NVIDIA GPU.
//!
//! Behind the `cuda` feature. The CUDA libraries are loaded at run time (driver, NVRTC,
//! cuBLAS), so a build with the feature needs no toolkit; starting the backend on a machine
//! without them returns [`CudaError::LibraryMissing`] or [`CudaError::NoDevice`] instead of
//! panicking. Kernels are CUDA C++ (`src/kernels.cu`), compiled by NVRTC for the device's
//! architecture at start-up and cached on disk (`$MUSER_CACHE/kernels`, else
//! `~/.cache/muser/kernels`).
//!
//! - [`runtime::Gpu`]: device, stream, kernels, buffers, cuBLAS.
//! - [`weights::DevWeight`]: a quantized matrix on the device (Q4_K, Q6_K, Q8_0, NVFP4, F16,
//!   BF16, F32) with its decode GEMV, its bf16 dequantization for prefill, and row lookup.
//!   Decode GEMVs take 1 to [`layout::MAX_GEMV_BATCH`] (64) sequences: up to 4 through a kernel
//!   per batch size (Q4_K in the shapes of [`layout::Q4K_SHAPES`]), above through one batched
//!   kernel per type and Q4_K shape ([`layout::seq_gemv`], `gemv_*_bn`), whose Q4_K version
//!   loads a row's weights into registers once and loops over the sequences four at a time;
//!   from [`layout::Q4K_TILE_MIN_BATCH`] (8) sequences Q4_K runs on int8 tensor cores over
//!   tiles of 16 rows x 8 sequences ([`layout::q4k_tile`], `gemv_q4k_tile_w*`), which add
//!   each (row, sequence)'s float terms in its one-sequence order.
//!   Every batch size gives each sequence the sums of its one-sequence GEMV, bit for bit: the
//!   batched kernels keep the one-sequence kernel's warps per row, lane-to-super-block mapping
//!   and summation order (the argument is in `src/kernels.cu` above `SEQ_CHUNK`).
//! - [`backend::CudaBackend`]: muser-model's `Backend` trait on the GPU (per-op kernels in
//!   `src/ops.cu`), so `Model::load_with(path, CudaBackend::new(0)?)` runs any architecture
//!   with its KV cache in device memory.
//! - [`plan::DecodePlan`]: which kernel and launch shape each step of a fused decode step runs,
//!   per layer kind and batch bucket, derived once from the device and the model (and three
//!   benchmark overrides); the crate's README lists the plan and the kernels.
//! - [`glimmer::CudaGlimmer`]: the muse-glimmer forward pass (decode of up to 64 sequences at
//!   mixed positions as one CUDA graph per batch size, chunked prefill through cuBLAS), with
//!   its F16 KV cache.
//!
//! Without the feature only [`CudaError`], [`layout`] (weight layouts and kernel names, tested
//! everywhere), [`plan`], the GPU-free parts of [`backend`] and [`probe`] exist, and `probe` says how to get the backend.

pub mod backend;
pub mod compare;
mod error;
mod exact;
pub mod layout;
pub mod plan;
#[cfg(test)]
mod q4k_tile_tests;
pub use error::CudaError;

#[cfg(feature = "cuda")]
pub mod glimmer;
#[cfg(feature = "cuda")]
pub mod runtime;
#[cfg(feature = "cuda")]
mod staging;
pub mod vision;
#[cfg(feature = "cuda")]
pub mod weights;

/// Opens device 0 and describes it, or says why the backend is unavailable.
#[cfg(feature = "cuda")]
pub fn probe() -> Result<String, CudaError> {
    let gpu = runtime::Gpu::new(0)?;
    let i = gpu.info();
    Ok(format!(
        "{} (compute {}.{}, {} SMs, {:.1} GiB)",
        i.name,
        i.compute_capability.0,
        i.compute_capability.1,
        i.sm_count,
        i.total_mem as f64 / (1u64 << 30) as f64
    ))
}

/// Opens device 0 and describes it, or says why the backend is unavailable.
#[cfg(not(feature = "cuda"))]
pub fn probe() -> Result<String, CudaError> {
    Err(CudaError::NotBuilt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn probe_without_feature_says_how_to_enable() {
        let e = probe().unwrap_err();
        assert!(e.to_string().contains("--features cuda"), "{e}");
    }

    /// On a machine without a GPU (CI), starting the backend must fail with a typed error
    /// naming the missing piece, never panic.
    #[cfg(feature = "cuda")]
    #[test]
    fn probe_fails_cleanly_or_finds_a_device() {
        match probe() {
            Ok(desc) => assert!(!desc.is_empty()),
            Err(e) => assert!(
                matches!(
                    e,
                    CudaError::LibraryMissing { .. }
                        | CudaError::NoDevice(_)
                        | CudaError::HeadersMissing(_)
                ),
                "unexpected error {e}"
            ),
        }
    }
}
