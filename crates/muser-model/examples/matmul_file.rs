//! One matmul on the CPU backend from raw files, to compare with ggml bit for bit:
//! `matmul_file TYPE K M N W.bin X.bin > Y.bin` (W: M rows of K values of TYPE; X: N×K f32).

use muser_model::{Backend, CpuBackend, Weight};
use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 7 {
        return Err("usage: matmul_file TYPE K M N W.bin X.bin".into());
    }
    let ty = muser_gguf::GgmlType::from_name(&a[1]).ok_or("unknown type")?;
    let (k, m, n): (usize, usize, usize) = (a[2].parse()?, a[3].parse()?, a[4].parse()?);
    let w = std::fs::read(&a[5])?;
    let x: Vec<f32> = std::fs::read(&a[6])?
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let be = CpuBackend::new(2)?;
    let weight = Weight {
        name: "w",
        ty,
        n_in: k,
        n_out: m,
        data: &w,
    };
    let y = be.download(&be.matmul(&weight, &be.upload(n, k, x)?)?)?;
    let bytes: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::io::stdout().write_all(&bytes)?;
    Ok(())
}
