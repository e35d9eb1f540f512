//! Encodes one image with a projector and prints a JSON line of timings (the encoder's start
//! with its weight upload, decode+preprocess, encode per repeat) and the token grid; `--out
//! FILE` writes the embeddings (f32, LE). `--device cuda` encodes on the GPU (build with
//! `--features cuda`); `--stages` adds one more encode, each step waited for, and where its
//! time went (`stages_ms`: the host prelude, products, attention, the rest on the device).
//!
//!   cargo run --release -p muser-vision --example encode -- MMPROJ IMAGE [--threads N]
//!       [--repeat N] [--out FILE] [--device cpu|cuda] [--stages]

use std::time::Instant;

use muser_vision::{decode, Device, Encoder, Limits, Projector};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        return Err(
            "usage: encode MMPROJ IMAGE [--threads N] [--repeat N] [--out FILE] [--device cpu|cuda] [--stages]"
                .into(),
        );
    }
    let opt = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let threads: usize = opt("--threads").map_or(Ok(0), |v| v.parse())?;
    let repeat: usize = opt("--repeat").map_or(Ok(1), |v| v.parse())?;
    let device = match opt("--device").as_deref() {
        None | Some("cpu") => Device::Cpu,
        Some("cuda") => Device::Cuda,
        Some(other) => return Err(format!("--device {other}: cpu or cuda").into()),
    };
    let t0 = Instant::now();
    let enc = Encoder::new(Projector::open(args[0].as_ref())?, device, threads)?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let bytes = std::fs::read(&args[1])?;
    let t0 = Instant::now();
    let rgb = decode(&bytes, &Limits::default())?;
    let px = enc.projector().preprocess(&rgb)?;
    let prep_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut encode_ms = Vec::new();
    let mut emb = None;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        emb = Some(enc.encode(&px)?);
        encode_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let emb = emb.expect("at least one repeat");
    let stages = if args.iter().any(|a| a == "--stages") {
        match enc.encode_staged(&px, true)?.1 {
            Some(s) => format!(
                ",\"stages_ms\":{{\"prepare\":{:.3},\"products\":{:.3},\"attention\":{:.3},\"rest\":{:.3}}}",
                s.prepare_ms, s.products_ms, s.attention_ms, s.rest_ms
            ),
            None => String::new(),
        }
    } else {
        String::new()
    };
    if let Some(path) = opt("--out") {
        let raw: Vec<u8> = emb.data.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(path, raw)?;
    }
    println!(
        "{{\"image\":[{},{}],\"resized\":[{},{}],\"tokens\":[{},{}],\"device\":\"{:?}\",\"threads\":{},\"load_ms\":{:.3},\"preprocess_ms\":{:.3},\"encode_ms\":{:?}{stages}}}",
        rgb.width, rgb.height, px.width, px.height, emb.n_x, emb.n_y, device, threads, load_ms, prep_ms, encode_ms
    );
    Ok(())
}
