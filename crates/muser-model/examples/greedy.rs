//! Greedy decoding from token ids, for quick checks against the comparator's golden program:
//! `cargo run --release -p muser-model --example greedy -- MODEL 1,2,3 [N] [THREADS] [CHUNK]`.

use muser_model::{Batch, KvType, LoadOptions, Model};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        return Err("usage: greedy MODEL IDS [N] [THREADS]".into());
    }
    let prompt: Vec<u32> = args[2]
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let n: usize = args.get(3).map_or(Ok(16), |s| s.parse())?;
    let threads: usize = args.get(4).map_or(Ok(2), |s| s.parse())?;
    let chunk: usize = args.get(5).map_or(Ok(0), |s| s.parse())?;
    let model = Model::load(
        args[1].as_ref(),
        &LoadOptions {
            threads,
            ..Default::default()
        },
    )?;
    let n_vocab = model.info().n_vocab;
    let mut kv = model.new_kv(1024, 1, KvType::F16)?;
    let t0 = Instant::now();
    let chunk = if chunk == 0 { prompt.len() } else { chunk };
    let mut logits = Vec::new();
    for (i, c) in prompt.chunks(chunk).enumerate() {
        logits = model
            .forward(&mut kv, &Batch::single(0, c, (i * chunk) as u32, true))?
            .logits;
    }
    let t_prefill = t0.elapsed();
    let mut ids = Vec::new();
    let t1 = Instant::now();
    for s in 0..n {
        let (id, top) =
            logits[..n_vocab]
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &x)| if x > b.1 { (i, x) } else { b },
                );
        ids.push(id);
        eprintln!("step {s}: {id} {top:.9}");
        if s + 1 < n {
            let pos = (prompt.len() + s) as u32;
            logits = model
                .forward(&mut kv, &Batch::single(0, &[id as u32], pos, true))?
                .logits;
        }
    }
    let t_gen = t1.elapsed();
    println!("{ids:?}");
    eprintln!(
        "prefill {} tok in {:.1} ms, {} steps in {:.1} ms",
        prompt.len(),
        t_prefill.as_secs_f64() * 1e3,
        n,
        t_gen.as_secs_f64() * 1e3
    );
    Ok(())
}
