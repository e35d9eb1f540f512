//! Every SIMD dot product returns exactly the scalar reference's bits on random rows (both
//! emulate ggml's lane order), and the dots agree with a plain f64 dot of the dequantized rows.

use muser_quant::{
    dequantize_row, detected_isa, quantize_activations, quantize_row, scalar, vec_dot_gemm_isa,
    vec_dot_isa, vec_dot_type, GgmlType, Isa,
};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

const DOT_TYPES: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// A weight row: random floats through the reference quantizer where one exists, otherwise
/// random bytes with sane f16 scales.
fn weight_row(rng: &mut Rng, ty: GgmlType, n: usize) -> Vec<u8> {
    let bytes = n / ty.block_size() * ty.type_size();
    let x: Vec<f32> = (0..n).map(|_| rng.f32() * 2.0).collect();
    let mut w = vec![0u8; bytes];
    if quantize_row(ty, &x, &mut w).is_ok() {
        return w;
    }
    let mut w = rng.bytes(bytes);
    let ts = ty.type_size();
    for b in w.chunks_exact_mut(ts) {
        // Q2_K keeps d, dmin at the end, Q3_K keeps d at the end: make them small halves
        match ty {
            GgmlType::Q2_K => {
                b[80..82].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                b[82..84].copy_from_slice(&half::f16::from_f32(0.02).to_le_bytes());
            }
            GgmlType::Q3_K => b[108..110].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes()),
            _ => {}
        }
    }
    w
}

#[test]
fn simd_equals_scalar_bit_for_bit() {
    let isa = detected_isa();
    if isa == Isa::Scalar {
        eprintln!("no AVX2 on this machine: only the scalar kernels exist");
        return;
    }
    let mut rng = Rng(0x9E3779B97F4A7C15);
    for ty in DOT_TYPES {
        for &n in &[256usize, 512, 1000, 1056, 1536, 4352] {
            if n % ty.block_size() != 0 {
                continue;
            }
            for _ in 0..8 {
                let w = weight_row(&mut rng, ty, n);
                let x: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
                let at = vec_dot_type(ty);
                let mut a = vec![0u8; n / at.block_size() * at.type_size()];
                quantize_activations(at, &x, &mut a).unwrap();
                let s = scalar::vec_dot(ty, n, &w, &a);
                let g = scalar::vec_dot_gemm(ty, n, &w, &a);
                for isa in [Isa::Avx2, Isa::Avx512] {
                    let v = vec_dot_isa(isa, ty, n, &w, &a);
                    assert_eq!(
                        s.to_bits(),
                        v.to_bits(),
                        "{ty} n={n} {isa:?}: scalar {s} simd {v}"
                    );
                    let v = vec_dot_gemm_isa(isa, ty, n, &w, &a);
                    assert_eq!(
                        g.to_bits(),
                        v.to_bits(),
                        "gemm order {ty} n={n} {isa:?}: scalar {g} simd {v}"
                    );
                }
            }
        }
    }
}

#[test]
fn dot_matches_dequantized_dot() {
    let mut rng = Rng(42);
    for ty in DOT_TYPES {
        let n = 1024;
        let w = weight_row(&mut rng, ty, n);
        let x: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
        let at = vec_dot_type(ty);
        let mut a = vec![0u8; n / at.block_size() * at.type_size()];
        quantize_activations(at, &x, &mut a).unwrap();
        let (mut wf, mut af) = (vec![0f32; n], vec![0f32; n]);
        dequantize_row(ty, &w, &mut wf).unwrap();
        dequantize_row(at, &a, &mut af).unwrap();
        let exact: f64 = wf.iter().zip(&af).map(|(p, q)| *p as f64 * *q as f64).sum();
        let scale: f64 = wf
            .iter()
            .zip(&af)
            .map(|(p, q)| (*p as f64 * *q as f64).abs())
            .sum();
        let got = muser_quant::vec_dot(ty, n, &w, &a) as f64;
        assert!(
            (got - exact).abs() <= 1e-4 * scale.max(1e-3),
            "{ty}: dot {got} vs dequantized {exact} (scale {scale})"
        );
    }
}

/// `RowDot::dot` and `RowDot::dot_tile` (4 weight rows × 1 to 4 tokens, on AVX512 two rows per
/// 512-bit register, and the edges; 70 rows of 256 values span two of the L1-sized chunks
/// the weights are gone through in) return exactly `vec_dot`'s bits for every pair, written
/// token-major at the given stride.
#[test]
fn row_dot_tile_equals_vec_dot() {
    let mut rng = Rng(0x5eed_7a11);
    for ty in DOT_TYPES {
        for (n, n_a, n_w) in [
            (256usize, 7usize, 11usize),
            (1536, 6, 11),
            (512, 1, 11),
            (256, 2, 11),
            (512, 3, 11),
            (256, 4, 70),
        ] {
            let stride = n_w + 2;
            let w: Vec<u8> = (0..n_w).flat_map(|_| weight_row(&mut rng, ty, n)).collect();
            let at = vec_dot_type(ty);
            let ab = at.row_bytes(n).unwrap();
            let mut a = vec![0u8; ab * n_a];
            for row in a.chunks_exact_mut(ab) {
                let x: Vec<f32> = (0..n).map(|_| rng.f32() * 3.0).collect();
                quantize_activations(at, &x, row).unwrap();
            }
            // every kernel family this CPU has (AVX2's tile kernels run on AVX512 hosts too)
            for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
                let k = muser_quant::RowDot::with_isa(ty, n, isa).unwrap();
                let wb = k.weight_row_bytes();
                let mut out = vec![f32::NAN; (n_a - 1) * stride + n_w];
                k.dot_tile(&w, &a, &mut out, stride);
                for t in 0..n_a {
                    for r in 0..n_w {
                        let (wr, ar) = (&w[r * wb..(r + 1) * wb], &a[t * ab..(t + 1) * ab]);
                        let want = muser_quant::vec_dot(ty, n, wr, ar);
                        assert_eq!(
                            k.dot(wr, ar).to_bits(),
                            want.to_bits(),
                            "{ty} dot r{r} t{t}"
                        );
                        assert_eq!(
                            out[t * stride + r].to_bits(),
                            want.to_bits(),
                            "{ty} tile r{r} t{t} {isa:?}"
                        );
                    }
                }
            }
        }
    }
}
