//! The kernels of muser-vision's device-resident image encoder (`src/vision.cu`): LayerNorm,
//! erf-GELU, 2D RoPE from a host table, row softmax, f16 rounding and pixel shuffle. The
//! encoder's graph lives in muser-vision; this crate holds its CUDA source beside the others
//! so one compile check covers every module.

use muser_gguf::GgmlType;

use crate::exact::{fakequant_block, fakequant_kind};

/// How the GPU encoder holds a weight matrix and multiplies by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightForm {
    /// The file's f16 values; the activations rounded to f16 (what the CPU's F16 dot product
    /// does), an f16 cuBLAS product with f32 accumulation: the CPU's products, in another
    /// summation order.
    F16,
    /// f32 rows from the host dequantizer; the activations rounded as `op_fakequant` kind
    /// `kind` (0: not at all, f32 weights) rounds them, an f32 product.
    F32 { kind: i32 },
}

/// How the GPU encoder holds a weight of type `ty` with `n_in` inputs, or why it cannot.
pub fn weight_form(ty: GgmlType, n_in: usize) -> Result<WeightForm, String> {
    if ty == GgmlType::F16 {
        return Ok(WeightForm::F16);
    }
    if crate::exact::has_mins(ty) {
        // The CPU adds each block's min times the rounded activations' f16 sum apart from the
        // `d·q` products; a dequantized f32 row folds the mins in, which is another number.
        return Err(format!(
            "{ty:?} weights (per-block mins) are not supported by the GPU encoder"
        ));
    }
    let kind = fakequant_kind(ty);
    let block = fakequant_block(kind);
    if !n_in.is_multiple_of(block) {
        return Err(format!(
            "{n_in} inputs are not whole activation blocks of {block} for {ty:?}"
        ));
    }
    Ok(WeightForm::F32 { kind })
}

/// The source, compiled after `common.cuh` ([`crate::runtime::compile_source`]).
pub const VISION_CU: &str = include_str!("vision.cu");

/// Kernels of [`VISION_CU`], loaded with `Gpu::load_module`.
pub const VISION_KERNELS: [&str; 6] = [
    "vis_layer_norm",
    "vis_gelu_erf",
    "vis_rope_2d",
    "vis_softmax",
    "vis_to_f16",
    "vis_pixel_shuffle",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_forms_follow_the_cpu_rounding() {
        assert_eq!(weight_form(GgmlType::F16, 588), Ok(WeightForm::F16));
        assert_eq!(
            weight_form(GgmlType::F32, 588),
            Ok(WeightForm::F32 { kind: 0 })
        );
        assert_eq!(
            weight_form(GgmlType::Q8_0, 1536),
            Ok(WeightForm::F32 {
                kind: fakequant_kind(GgmlType::Q8_0)
            })
        );
        assert!(
            weight_form(GgmlType::Q8_0, 588).is_err(),
            "588 is not whole Q8_0 blocks"
        );
    }

    #[test]
    fn vision_kernels_exist_in_the_source() {
        for name in VISION_KERNELS {
            assert!(
                VISION_CU.contains(&format!("__global__ void {name}(")),
                "kernel {name} not found in vision.cu"
            );
        }
        assert_eq!(
            VISION_CU.matches("__global__ void ").count(),
            VISION_KERNELS.len(),
            "every kernel of vision.cu is listed"
        );
    }

    /// vision.cu compiles with NVRTC for sm_90 into exactly its listed kernels. Needs NVRTC and
    /// the CUDA headers, no GPU: `scripts/cuda-compile-check.sh` sets `MUSER_NVRTC_CHECK=1`.
    #[cfg(feature = "cuda")]
    #[test]
    fn vision_kernels_compile_with_nvrtc() {
        if std::env::var_os("MUSER_NVRTC_CHECK").is_none() {
            eprintln!("not compiled: run scripts/cuda-compile-check.sh");
            return;
        }
        let ptx =
            crate::runtime::compile_source(VISION_CU, "sm_90").unwrap_or_else(|e| panic!("{e}"));
        for n in VISION_KERNELS {
            assert!(
                ptx.contains(&format!(".entry {n}(")),
                "kernel {n} missing from the PTX"
            );
        }
        assert_eq!(ptx.matches(".entry ").count(), VISION_KERNELS.len());
    }
}
