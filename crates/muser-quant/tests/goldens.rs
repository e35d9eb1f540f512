//! Byte-for-byte and bit-for-bit comparisons against data produced by ggml itself
//! (llama.cpp b11434) through `scripts/quant-goldens.sh`; see `scripts/quant/goldens.c`.

use std::path::PathBuf;

use muser_quant::{
    dequantize_row, quantize_activations, quantize_row, scalar, vec_dot, vec_dot_type, GgmlType,
};

const DOT_N: usize = 2048;
const FLOAT_N: usize = 1000;

fn data(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (regenerate with scripts/quant-goldens.sh)",
            path.display()
        )
    })
}

fn floats(name: &str) -> Vec<f32> {
    data(name)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

const WEIGHTS: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
];

#[test]
fn reference_quantizers_match_ggml_bytes() {
    let input = floats("input.f32");
    for ty in WEIGHTS {
        if matches!(ty, GgmlType::Q2_K | GgmlType::Q3_K) {
            continue; // no reference quantizer here: dequantization goldens only
        }
        let want = data(&format!("quant_{}.bin", ty.name()));
        let mut got = vec![0u8; want.len()];
        quantize_row(ty, &input, &mut got).unwrap();
        let bs = ty.type_size();
        let bad: Vec<usize> = (0..want.len() / bs)
            .filter(|&i| got[i * bs..(i + 1) * bs] != want[i * bs..(i + 1) * bs])
            .collect();
        assert!(
            bad.is_empty(),
            "{ty}: {} of {} blocks differ from ggml, first {}",
            bad.len(),
            want.len() / bs,
            bad[0]
        );
    }
}

#[test]
fn q8_1_reference_quantizer_matches_ggml() {
    let input = floats("input.f32");
    let want = data("ref_q8_1.bin");
    let mut got = vec![0u8; want.len()];
    quantize_row(GgmlType::Q8_1, &input, &mut got).unwrap();
    assert!(got == want, "quantize_row_q8_1_ref differs");
}

#[test]
fn dequantization_matches_ggml_floats() {
    for ty in WEIGHTS {
        let mut cases = vec![("quant", "deq")];
        if ty.is_quantized() {
            cases.push(("rand", "rand"));
        }
        for (src, dst) in cases {
            let bytes = data(&format!("{src}_{}.bin", ty.name()));
            let want = floats(&format!("{dst}_{}.f32", ty.name()));
            let mut got = vec![0f32; want.len()];
            dequantize_row(ty, &bytes, &mut got).unwrap();
            let bad = (0..want.len()).find(|&i| !same_bits(got[i], want[i]));
            assert!(
                bad.is_none(),
                "{ty} {src}: value {} is {} where ggml has {}",
                bad.unwrap(),
                got[bad.unwrap()],
                want[bad.unwrap()]
            );
        }
    }
}

#[test]
fn activation_quantizers_match_ggml_cpu_path() {
    let input = floats("act_input.f32");
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q8_K,
        GgmlType::F16,
        GgmlType::BF16,
    ] {
        let want = data(&format!("act_{}.bin", ty.name()));
        let mut got = vec![0u8; want.len()];
        quantize_activations(ty, &input, &mut got).unwrap();
        let bs = ty.type_size();
        let bad =
            (0..want.len() / bs).find(|&i| got[i * bs..(i + 1) * bs] != want[i * bs..(i + 1) * bs]);
        assert!(
            bad.is_none(),
            "{ty}: block {} differs from ggml's CPU from_float",
            bad.unwrap()
        );
    }
}

#[test]
fn dot_products_match_ggml_cpu_bits() {
    let input = floats("input.f32");
    let act_input = floats("act_input.f32");
    for ty in WEIGHTS {
        let n = if ty.is_quantized() { DOT_N } else { FLOAT_N };
        let rows = input.len() / n;
        let want = floats(&format!("dot_{}.f32", ty.name()));
        assert_eq!(want.len(), rows);
        let vt = vec_dot_type(ty);
        let (wb, ab) = (
            n / ty.block_size() * ty.type_size(),
            n / vt.block_size() * vt.type_size(),
        );
        let ggml_quants = data(&format!("quant_{}.bin", ty.name()));
        for r in 0..rows {
            let w = if ty.is_quantized() {
                ggml_quants[r * wb..(r + 1) * wb].to_vec()
            } else {
                let mut w = vec![0u8; wb];
                quantize_row(ty, &input[r * n..(r + 1) * n], &mut w).unwrap();
                w
            };
            let mut a = vec![0u8; ab];
            quantize_activations(vt, &act_input[r * n..(r + 1) * n], &mut a).unwrap();
            let (s, v) = (scalar::vec_dot(ty, n, &w, &a), vec_dot(ty, n, &w, &a));
            assert!(
                same_bits(s, want[r]),
                "{ty} row {r}: scalar {s} ggml {}",
                want[r]
            );
            assert!(
                same_bits(v, want[r]),
                "{ty} row {r}: simd {v} ggml {}",
                want[r]
            );
        }
    }
}

#[test]
fn prompt_matmul_order_matches_ggml_mul_mat() {
    const ROWS: usize = 8;
    const TOKENS: usize = 3;
    let input = floats("input.f32");
    let act_input = floats("act_input.f32");
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        assert!(muser_quant::uses_gemm_path(ty, ROWS, TOKENS));
        let mut differs_from_vec_dot = 0;
        let want = floats(&format!("mm_{}.f32", ty.name()));
        let vt = vec_dot_type(ty);
        let (wb, ab) = (FLOAT_N * ty.type_size(), FLOAT_N * vt.type_size());
        let mut w = vec![0u8; wb * ROWS];
        quantize_row(ty, &input[..FLOAT_N * ROWS], &mut w).unwrap();
        for t in 0..TOKENS {
            let mut a = vec![0u8; ab];
            quantize_activations(vt, &act_input[t * FLOAT_N..(t + 1) * FLOAT_N], &mut a).unwrap();
            for r in 0..ROWS {
                let got = muser_quant::vec_dot_gemm(ty, FLOAT_N, &w[r * wb..(r + 1) * wb], &a);
                let g = want[t * ROWS + r];
                assert!(
                    same_bits(got, g),
                    "{ty} token {t} row {r}: {got} where ggml_mul_mat gives {g}"
                );
                let vd = vec_dot(ty, FLOAT_N, &w[r * wb..(r + 1) * wb], &a);
                differs_from_vec_dot += usize::from(!same_bits(vd, g));
            }
        }
        // the two orders round differently often enough that the goldens tell them apart
        assert!(
            differs_from_vec_dot > 0,
            "{ty}: vec_dot equals the matmul everywhere"
        );
    }
}
