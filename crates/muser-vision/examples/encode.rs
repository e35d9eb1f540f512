//! Encodes one image with a projector and prints a JSON line of timings (decode+preprocess,
//! encode, per repeat) and the token grid; `--out FILE` writes the embeddings (f32, LE).
//!
//!   cargo run --release -p muser-vision --example encode -- MMPROJ IMAGE [--threads N]
//!       [--repeat N] [--out FILE]

use std::time::Instant;

use muser_model::CpuBackend;
use muser_vision::{decode, Limits, Projector};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        return Err("usage: encode MMPROJ IMAGE [--threads N] [--repeat N] [--out FILE]".into());
    }
    let opt = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let threads: usize = opt("--threads").map_or(Ok(0), |v| v.parse())?;
    let repeat: usize = opt("--repeat").map_or(Ok(1), |v| v.parse())?;
    let proj = Projector::open(args[0].as_ref())?;
    let cpu = CpuBackend::new(threads)?;
    let bytes = std::fs::read(&args[1])?;
    let t0 = Instant::now();
    let rgb = decode(&bytes, &Limits::default())?;
    let px = proj.preprocess(&rgb)?;
    let prep_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut encode_ms = Vec::new();
    let mut emb = None;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        emb = Some(proj.encode(&cpu, &px)?);
        encode_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let emb = emb.expect("at least one repeat");
    if let Some(path) = opt("--out") {
        let raw: Vec<u8> = emb.data.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(path, raw)?;
    }
    println!(
        "{{\"image\":[{},{}],\"resized\":[{},{}],\"tokens\":[{},{}],\"threads\":{},\"preprocess_ms\":{:.3},\"encode_ms\":{:?}}}",
        rgb.width, rgb.height, px.width, px.height, emb.n_x, emb.n_y, threads, prep_ms, encode_ms
    );
    Ok(())
}
