//! The per-op backend's exact precision, on the host side: which rounding the CPU applies to
//! activations before each weight type's dot product (`op_fakequant` in ops.cu does it on the
//! device; [`fakequant_reference`] is the same loop here), and how Q4_1/Q5_1 weights are held
//! so that their mins meet the activations' stored block sums. The tests check both against
//! muser-quant and the CPU backend.

use muser_model::ModelError;

/// How the per-op backend multiplies by a weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// The CPU engine's numerics: weights dequantized exactly once (f32 on the device) and
    /// activations rounded as the CPU quantizes them for that weight type (Q8_K, Q8_0, Q8_1,
    /// F16, BF16), then f32 products: logits agree with the CPU's up to summation order.
    /// Needs 4 bytes per weight of device memory.
    #[default]
    Exact,
    /// Weights in their quantized form; small batches through the int8 decode GEMVs (16-value
    /// activation blocks), larger ones through bf16 cuBLAS. About 1e-2 from the CPU.
    Fast,
}

/// The `op_fakequant` kind that rounds activations as the CPU does before multiplying by a
/// weight of type `ty` (0: no rounding).
pub fn fakequant_kind(ty: muser_gguf::GgmlType) -> i32 {
    use muser_gguf::GgmlType as T;
    match muser_quant::vec_dot_type(ty) {
        T::F16 => 1,
        T::BF16 => 2,
        T::Q8_0 => 3,
        T::Q8_1 => 4,
        T::Q8_K => 5,
        _ => 0,
    }
}

/// What `op_fakequant` computes, on the host: `x` rounded in place as the CPU rounds
/// activations (`kind` as for [`fakequant_kind`]). The kernel is this loop, one block per
/// thread; the tests check it against muser-quant's quantizer and dequantizer.
pub fn fakequant_reference(kind: i32, x: &mut [f32]) {
    fakequant_reference_sums(kind, x, None)
}

/// [`fakequant_reference`], also giving each Q8_1 block's stored sum (`f16(d · Σq)`).
pub fn fakequant_reference_sums(kind: i32, x: &mut [f32], mut sums: Option<&mut Vec<f32>>) {
    use half::{bf16, f16};
    match kind {
        1 => x.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32()),
        2 => x.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32()),
        3..=5 => {
            for b in x.chunks_mut(fakequant_block(kind)) {
                let (mut amax, mut maxv) = (0f32, 0f32);
                for &v in b.iter() {
                    if v.abs() > amax {
                        amax = v.abs();
                        maxv = v;
                    }
                }
                if kind == 5 {
                    if amax == 0.0 {
                        b.fill(0.0);
                        continue;
                    }
                    let iscale = -127.0 / maxv;
                    let d = 1.0 / iscale;
                    for v in b.iter_mut() {
                        *v = d * ((iscale * *v).round_ties_even() as i32).min(127) as f32;
                    }
                } else {
                    let d32 = amax / 127.0;
                    let d = f16::from_f32(d32).to_f32();
                    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                    let mut sum = 0i32;
                    for v in b.iter_mut() {
                        let q = ((*v * id).round_ties_even() as i32).clamp(-128, 127);
                        sum += q;
                        *v = d * q as f32;
                    }
                    if let Some(s) = sums.as_deref_mut() {
                        s.push(f16::from_f32(d32 * sum as f32).to_f32());
                    }
                }
            }
        }
        _ => {}
    }
}

/// Values per block of an `op_fakequant` kind.
pub fn fakequant_block(kind: i32) -> usize {
    match kind {
        3 | 4 => 32,
        5 => 256,
        _ => 1,
    }
}

/// Q4_1 and Q5_1 (blocks of 32 with an f16 scale at byte 0 and an f16 min at byte 2),
/// whose dot product with Q8_1 activations adds `min · s` per block, `s` the activation
/// block's stored f16 sum: exact precision keeps the `d·q` part and the mins apart.
pub fn has_mins(ty: muser_gguf::GgmlType) -> bool {
    matches!(ty, muser_gguf::GgmlType::Q4_1 | muser_gguf::GgmlType::Q5_1)
}

/// For a weight with mins: every row's `d·q` values (the mins zeroed) as f32 bytes, and the
/// mins `[n_out][n_in / 32]` as f32 bytes.
pub fn split_mins(w: &muser_model::Weight) -> Result<(Vec<u8>, Vec<u8>), ModelError> {
    let rb = w.row_bytes();
    let nb = w.n_in / 32;
    let bb = rb / nb.max(1);
    let mut row = vec![0f32; w.n_in];
    let mut scaled = Vec::with_capacity(4 * w.n_in * w.n_out);
    let mut mins = Vec::with_capacity(4 * nb * w.n_out);
    let mut raw = vec![0u8; rb];
    for r in 0..w.n_out {
        raw.copy_from_slice(&w.data[r * rb..(r + 1) * rb]);
        for b in 0..nb {
            let m = u16::from_le_bytes([raw[b * bb + 2], raw[b * bb + 3]]);
            mins.extend(muser_quant::fp::f16_bits_to_f32(m).to_le_bytes());
            raw[b * bb + 2] = 0;
            raw[b * bb + 3] = 0;
        }
        muser_quant::dequantize_row(w.ty, &raw, &mut row)
            .map_err(|e| ModelError::Quant(format!("{}: {e}", w.name)))?;
        scaled.extend(row.iter().flat_map(|v| v.to_le_bytes()));
    }
    Ok((scaled, mins))
}

#[cfg(test)]
mod tests {
    use super::*;
    use muser_gguf::GgmlType;

    /// Uniform values in [-1, 1) from a xorshift generator.
    fn uniform(mut state: u64) -> impl FnMut() -> f32 {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        }
    }

    /// Exact precision's matmul, computed on the host the way the GPU does it (activations
    /// rounded by `fakequant_reference`, weights dequantized by muser-quant, f32 sums), agrees
    /// with the CPU backend's matmul for one row and for batches, in every weight type.
    #[test]
    fn exact_matmul_math_equals_the_cpu_backend() {
        use muser_model::{Backend, CpuBackend, Weight};
        let cpu = CpuBackend::new(1).unwrap();
        let mut next = uniform(0x9E37_79B9_7F4A_7C15u64);
        let (n_in, n_out) = (512usize, 64usize);
        for ty in [
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_1,
            GgmlType::NVFP4,
            GgmlType::F16,
        ] {
            let wf: Vec<f32> = (0..n_in * n_out).map(|_| next()).collect();
            let rb = muser_quant::row_size(ty, n_in).unwrap();
            let mut data = vec![0u8; rb * n_out];
            for (src, dst) in wf.chunks(n_in).zip(data.chunks_mut(rb)) {
                muser_quant::quantize_row(ty, src, dst).unwrap();
            }
            let w = Weight {
                name: "w",
                ty,
                n_in,
                n_out,
                data: &data,
            };
            let f32s = |b: &[u8]| -> Vec<f32> {
                b.chunks(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            };
            // As the GPU holds it: f32 rows, and for Q4_1/Q5_1 the d·q part and the mins.
            let (wd, mins) = if has_mins(ty) {
                let (scaled, mins) = split_mins(&w).unwrap();
                (f32s(&scaled), Some(f32s(&mins)))
            } else {
                let mut wd = vec![0f32; n_in * n_out];
                for (src, dst) in data.chunks(rb).zip(wd.chunks_mut(n_in)) {
                    muser_quant::dequantize_row(ty, src, dst).unwrap();
                }
                (wd, None)
            };
            for n in [1usize, 6, 64] {
                let x: Vec<f32> = (0..n * n_in).map(|_| next() * 3.0).collect();
                let want = cpu
                    .download(
                        &cpu.matmul(&w, &cpu.upload(n, n_in, x.clone()).unwrap())
                            .unwrap(),
                    )
                    .unwrap();
                let mut xr = x.clone();
                let mut sums = Vec::new();
                fakequant_reference_sums(fakequant_kind(ty), &mut xr, Some(&mut sums));
                let nb = n_in / 32;
                let mut worst = 0f64;
                for t in 0..n {
                    for o in 0..n_out {
                        let mut got: f64 = (0..n_in)
                            .map(|i| xr[t * n_in + i] as f64 * wd[o * n_in + i] as f64)
                            .sum();
                        if let Some(m) = &mins {
                            got += (0..nb)
                                .map(|b| m[o * nb + b] as f64 * sums[t * nb + b] as f64)
                                .sum::<f64>();
                        }
                        let w = want[t * n_out + o] as f64;
                        worst = worst.max((got - w).abs() / (1.0 + w.abs()));
                    }
                }
                assert!(worst < 5e-5, "{ty:?} n {n}: worst {worst:.2e}");
            }
        }
    }

    /// Exact precision's activation rounding is the CPU's: quantized by muser-quant's
    /// activation quantizer and dequantized, value for value, for every rounding kind.
    #[test]
    fn fakequant_equals_the_cpu_activation_quantizer() {
        let mut next = uniform(0x2545_F491_4F6C_DD1Du64);
        for (wt, kind) in [
            (GgmlType::Q4_0, 3),
            (GgmlType::NVFP4, 3),
            (GgmlType::Q4_1, 4),
            (GgmlType::Q4_K, 5),
            (GgmlType::Q6_K, 5),
            (GgmlType::F16, 1),
            (GgmlType::BF16, 2),
            (GgmlType::F32, 0),
        ] {
            assert_eq!(fakequant_kind(wt), kind, "{wt:?}");
            for scale in [1e-3f32, 1.0, 37.5] {
                let mut x: Vec<f32> = (0..1024).map(|_| next() * scale).collect();
                // A block of zeros, a block with a repeated extreme, exact halves.
                x[256..512].fill(0.0);
                x[512] = -2.0 * scale;
                x[513] = 2.0 * scale;
                x[600] = 0.5;
                let want: Vec<f32> = match kind {
                    0 => x.clone(),
                    1 | 2 => x
                        .iter()
                        .map(|&v| {
                            if kind == 1 {
                                half::f16::from_f32(v).to_f32()
                            } else {
                                half::bf16::from_f32(v).to_f32()
                            }
                        })
                        .collect(),
                    _ => {
                        let vdt = muser_quant::vec_dot_type(wt);
                        let bytes = muser_quant::row_size(vdt, x.len()).unwrap();
                        let mut q = vec![0u8; bytes];
                        muser_quant::quantize_activations(vdt, &x, &mut q).unwrap();
                        let mut d = vec![0f32; x.len()];
                        muser_quant::dequantize_row(vdt, &q, &mut d).unwrap();
                        d
                    }
                };
                let mut got = x.clone();
                fakequant_reference(kind, &mut got);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{wt:?} scale {scale}"
                );
            }
        }
    }
}
