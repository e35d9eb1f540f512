//! ggml block formats: layouts, dequantization, reference quantizers (byte-identical to ggml),
//! activation quantizers (Q8_0, Q8_1, Q8_K) and dot products (scalar reference + AVX2/AVX512).
//!
//! CONTRACT (other crates code against these names):
//! - `dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32])`.
//! - `quantize_row(ty, src: &[f32], dst: &mut [u8])` for the types with quantizers.
//! - `vec_dot_type(ty) -> GgmlType`: the activation format ggml's CPU path uses for weight `ty`.
//! - `quantize_activations(vec_dot_ty, src: &[f32], dst: &mut [u8])`.
//! - `vec_dot(ty, n, weight_row: &[u8], act_row: &[u8]) -> f32`: dispatches to SIMD at run time.
//! - `scalar::vec_dot(...)`: the scalar reference the SIMD paths are tested against.
