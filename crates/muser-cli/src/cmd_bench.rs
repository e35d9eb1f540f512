//! `muser bench`: llama-bench-style throughput of the engine (`--device cpu|cuda`), or of
//! Muse Glimmer's fused CUDA forward (`--device cuda --fused`, see `fused.rs`).
//!
//! For each repetition: `pp<N>` decodes N random tokens as one batch into an empty cache (N
//! must fit one batch, as llama-bench's default `-ub 512`), `tg<M>` generates M tokens one at a
//! time from an empty cache. Prints mean ± sd of tokens/s over the repetitions and writes a JSON
//! receipt (command, git commit, machine, model, samples, peak RSS). Random token ids make it
//! work on tokenizer-less synthetic models.
//!
//! Decode streams the weights once per token, so it is bound by memory bandwidth: after the
//! tests it states the weight traffic of the decode test (weight bytes per token × tokens/s)
//! beside this machine's bandwidth measured on the same threads: reading the model's own
//! weights from the map, and `memcpy` between two 64 MiB buffers (allocated after the peak RSS
//! reading, which therefore leaves them out).

use crate::device::{self, Device};
use anyhow::{bail, Context};
use muser_gguf::GgufFile;
use muser_model::{Batch, KvCache, KvType, Model, ModelInfo};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF).
    #[arg(short = 'm', long)]
    model: PathBuf,
    /// Prompt tokens of the prefill test (0 to skip).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    n_prompt: usize,
    /// Generated tokens of the decode test (0 to skip).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    n_gen: usize,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Threads (0 = one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// Where the model runs: cpu; cuda (muse-glimmer through the fused forward, others op by
    /// op); cuda-ops (always op by op). CUDA needs a muser built with `--features cuda`.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    #[command(flatten)]
    numerics: device::NumericsArgs,
    /// KV cache type: f16 or f32.
    #[arg(long, default_value = "f16")]
    kv_type: String,
    /// With `--device cuda`: run muse-glimmer through muser-cuda's fused forward (the path of
    /// the CUDA benchmark tables) instead of the engine's model on the CUDA backend. F16 KV.
    #[arg(long)]
    fused: bool,
    /// Write a JSON receipt here.
    #[arg(short = 'o', long)]
    output: Option<PathBuf>,
}

struct TestResult {
    name: String,
    n_prompt: usize,
    n_gen: usize,
    samples_ts: Vec<f64>,
}

impl TestResult {
    fn mean(&self) -> f64 {
        self.samples_ts.iter().sum::<f64>() / self.samples_ts.len() as f64
    }

    fn sd(&self) -> f64 {
        let n = self.samples_ts.len();
        if n < 2 {
            return 0.0;
        }
        let m = self.mean();
        (self.samples_ts.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    }
}

/// A fixed pseudo-random token stream (llama-bench also uses random ids).
struct Tokens(u64);

impl Tokens {
    fn next(&mut self, n_vocab: usize) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n_vocab as u64) as u32
    }
}

/// What the tests run on.
enum Engine {
    /// The engine's model, on any device, with the tests' KV cache (one pool kept across tests
    /// and repetitions and cleared before each, as llama-bench does: a device backend keeps
    /// what it built for the cache, such as captured decode graphs).
    Model(Box<Model>, KvType, KvCache),
    /// Muse Glimmer's fused CUDA forward.
    #[cfg(feature = "cuda")]
    Fused(Box<crate::fused::FusedBench>),
}

impl Engine {
    fn load(args: &Args, kv_type: KvType) -> anyhow::Result<Engine> {
        let numerics = args.numerics.resolve(args.device)?;
        if args.fused {
            if args.device != Device::Cuda {
                bail!("--fused runs on the GPU: add --device cuda");
            }
            if kv_type != KvType::F16 {
                bail!("--fused keeps an f16 KV cache (--kv-type f16)");
            }
            return Engine::load_fused(args);
        }
        let model = device::load(&args.model, args.device, args.threads, numerics)?;
        let n_ctx = args.n_prompt.max(args.n_gen).max(32) + 1;
        let kv = model.new_kv_ubatch(n_ctx, 1, kv_type, args.n_prompt.max(32) as u32)?;
        Ok(Engine::Model(Box::new(model), kv_type, kv))
    }

    #[cfg(feature = "cuda")]
    fn load_fused(args: &Args) -> anyhow::Result<Engine> {
        let b = crate::fused::FusedBench::load(&args.model, args.n_prompt, args.n_gen)
            .with_context(|| format!("loading {}", args.model.display()))?;
        Ok(Engine::Fused(Box::new(b)))
    }

    #[cfg(not(feature = "cuda"))]
    fn load_fused(_args: &Args) -> anyhow::Result<Engine> {
        Err(device::cuda_not_built("--fused"))
    }

    fn info(&self) -> &ModelInfo {
        match self {
            Engine::Model(m, ..) => m.info(),
            #[cfg(feature = "cuda")]
            Engine::Fused(f) => f.info(),
        }
    }

    fn gguf(&self) -> &GgufFile {
        match self {
            Engine::Model(m, ..) => m.gguf(),
            #[cfg(feature = "cuda")]
            Engine::Fused(f) => f.gguf(),
        }
    }

    /// The numerics profile of the forward pass (see `Model::numerics_tag`).
    fn numerics_tag(&self) -> Option<String> {
        match self {
            Engine::Model(m, ..) => m.numerics_tag(),
            #[cfg(feature = "cuda")]
            Engine::Fused(_) => None,
        }
    }

    /// Host threads of the forward pass (0 for the fused GPU path, which uses none).
    fn threads(&self) -> usize {
        match self {
            Engine::Model(m, ..) => m.threads(),
            #[cfg(feature = "cuda")]
            Engine::Fused(_) => 0,
        }
    }

    fn decode_weight_bytes(&self) -> u64 {
        match self {
            Engine::Model(m, ..) => m.decode_weight_bytes(),
            #[cfg(feature = "cuda")]
            Engine::Fused(f) => f.decode_weight_bytes(),
        }
    }

    fn kv_name(&self) -> &'static str {
        match self {
            Engine::Model(_, kv, _) => kv.name(),
            #[cfg(feature = "cuda")]
            Engine::Fused(_) => KvType::F16.name(),
        }
    }

    /// One `pp n` test: n random tokens as one batch into an empty cache; tokens per second.
    fn prefill(&mut self, n: usize, rng: &mut Tokens) -> anyhow::Result<f64> {
        match self {
            Engine::Model(m, ty, kv) => prefill(m, n, rng, test_kv(m, kv, n, n, *ty)?),
            #[cfg(feature = "cuda")]
            Engine::Fused(f) => {
                let n_vocab = f.info().n_vocab;
                let tokens: Vec<u32> = (0..n).map(|_| rng.next(n_vocab)).collect();
                f.prefill(&tokens)
            }
        }
    }

    /// One `tg n` test from an empty cache; tokens per second.
    fn generate(&mut self, n: usize, rng: &mut Tokens) -> anyhow::Result<f64> {
        match self {
            Engine::Model(m, ty, kv) => generate(m, n, rng, test_kv(m, kv, n + 1, 1, *ty)?),
            #[cfg(feature = "cuda")]
            Engine::Fused(f) => {
                let token = rng.next(f.info().n_vocab);
                f.generate(token, n)
            }
        }
    }
}

/// The tests' cache, cleared; made again only when it lacks `n_ctx` positions or batches of
/// `n_ubatch` tokens (never with the sizes `Engine::load` makes it with).
fn test_kv<'a>(
    model: &Model,
    kv: &'a mut KvCache,
    n_ctx: usize,
    n_ubatch: usize,
    kv_type: KvType,
) -> anyhow::Result<&'a mut KvCache> {
    if (kv.n_ctx() as usize) < n_ctx || (kv.n_ubatch() as usize) < n_ubatch {
        *kv = model.new_kv_ubatch(n_ctx.max(1), 1, kv_type, n_ubatch.max(1) as u32)?;
    }
    kv.clear(0);
    Ok(kv)
}

fn prefill(model: &Model, n: usize, rng: &mut Tokens, kv: &mut KvCache) -> anyhow::Result<f64> {
    let n_vocab = model.info().n_vocab;
    let tokens: Vec<u32> = (0..n).map(|_| rng.next(n_vocab)).collect();
    let t = Instant::now();
    model.forward(kv, &Batch::single(0, &tokens, 0, true))?;
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

fn generate(model: &Model, n: usize, rng: &mut Tokens, kv: &mut KvCache) -> anyhow::Result<f64> {
    let n_vocab = model.info().n_vocab;
    let mut tok = rng.next(n_vocab);
    let t = Instant::now();
    for pos in 0..n {
        model.forward(kv, &Batch::single(0, &[tok], pos as u32, true))?;
        tok = rng.next(n_vocab);
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let kv_type = match args.kv_type.as_str() {
        "f16" => KvType::F16,
        "f32" => KvType::F32,
        other => bail!("--kv-type must be f16 or f32, not {other:?}"),
    };
    if args.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    let mut engine = Engine::load(&args, kv_type)?;
    let info = engine.info().clone();
    let n_params: u64 = engine.gguf().tensors().iter().map(|t| t.n_elements()).sum();
    let model_bytes: u64 = engine.gguf().tensors().iter().map(|t| t.size as u64).sum();
    let mut rng = Tokens(42);

    // Warm-up, as llama-bench does: page the weights in and start the threads.
    if args.n_prompt > 0 {
        engine.prefill(args.n_prompt.min(32), &mut rng)?;
    }
    engine.generate(1, &mut rng)?;

    let mut results = Vec::new();
    for (name, n_prompt, n_gen) in [
        (format!("pp{}", args.n_prompt), args.n_prompt, 0),
        (format!("tg{}", args.n_gen), 0, args.n_gen),
    ] {
        if n_prompt + n_gen == 0 {
            continue;
        }
        let mut samples_ts = Vec::with_capacity(args.repetitions);
        for _ in 0..args.repetitions {
            samples_ts.push(if n_prompt > 0 {
                engine.prefill(n_prompt, &mut rng)?
            } else {
                engine.generate(n_gen, &mut rng)?
            });
        }
        results.push(TestResult {
            name,
            n_prompt,
            n_gen,
            samples_ts,
        });
    }
    let peak_rss = peak_rss_bytes();
    // After the RSS reading: the probe's buffers are not the engine's.
    let weight_bytes = engine.decode_weight_bytes();
    // The host's bandwidth bounds decode only when the weights are read from host memory.
    let bw = match &engine {
        Engine::Model(m, ..)
            if args.device == Device::Cpu && results.iter().any(|r| r.n_gen > 0) =>
        {
            Some(bandwidth_probe(m, m.threads()))
        }
        _ => None,
    };
    let backend = if args.fused {
        "cuda-fused"
    } else {
        args.device.name()
    };

    let model_name = args
        .model
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    println!("| model | size | params | backend | threads | kv | test | t/s |");
    println!("| --- | ---: | ---: | --- | ---: | --- | ---: | ---: |");
    for r in &results {
        println!(
            "| {} | {:.2} MiB | {:.2} M | {} | {} | {} | {} | {:.2} ± {:.2} |",
            model_name,
            model_bytes as f64 / (1 << 20) as f64,
            n_params as f64 / 1e6,
            backend,
            engine.threads(),
            engine.kv_name(),
            r.name,
            r.mean(),
            r.sd()
        );
    }
    let decode = results.iter().find(|r| r.n_gen > 0).map(|r| {
        let gb_s = weight_bytes as f64 * r.mean() / 1e9;
        (r.name.clone(), gb_s)
    });
    if let (Some((name, gb_s)), Some(bw)) = (&decode, &bw) {
        println!();
        println!(
            "decode {name}: {:.1} MB of weights per token → {gb_s:.2} GB/s; this machine ({} threads): \
             read {:.2} GB/s, copy {:.2} GB/s (read + write) → {:.0}% of read, {:.0}% of copy bandwidth",
            weight_bytes as f64 / 1e6,
            engine.threads(),
            bw.read_gb_s,
            bw.copy_gb_s,
            100.0 * gb_s / bw.read_gb_s,
            100.0 * gb_s / bw.copy_gb_s
        );
    }
    if let Some(rss) = peak_rss {
        eprintln!(
            "peak RSS {:.1} MiB (model file {:.1} MiB)",
            rss as f64 / (1 << 20) as f64,
            info.file_bytes as f64 / (1 << 20) as f64
        );
    }

    if let Some(path) = &args.output {
        let command: Vec<String> = std::env::args().collect();
        let tests: Vec<String> = results
            .iter()
            .map(|r| {
                format!(
                    "{{\"test\":{},\"n_prompt\":{},\"n_gen\":{},\"avg_ts\":{:.3},\"stddev_ts\":{:.3},\"samples_ts\":[{}]}}",
                    json_str(&r.name),
                    r.n_prompt,
                    r.n_gen,
                    r.mean(),
                    r.sd(),
                    r.samples_ts.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(",")
                )
            })
            .collect();
        let receipt = format!(
            "{{\n  \"tool\":\"muser bench\",\n  \"command\":{},\n  \"git_commit\":{},\n  \"machine\":{{\"cpu\":{},\"logical_cpus\":{},\"isa\":{},\"isa_hardware\":{}}},\n  \
             \"model\":{{\"file\":{},\"file_bytes\":{},\"tensor_bytes\":{},\"params\":{},\"arch\":{}}},\n  \
             \"settings\":{{\"device\":{},\"numerics\":{},\"threads\":{},\"kv_type\":{},\"repetitions\":{}}},\n  \"peak_rss_bytes\":{},\n  \
             \"bandwidth\":{},\n  \"results\":[{}]\n}}\n",
            json_str(&command.join(" ")),
            json_str(&git_commit()),
            json_str(&cpu_model()),
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            json_str(muser_quant::detected_isa().name()),
            json_str(muser_quant::hardware_isa().name()),
            json_str(&model_name),
            info.file_bytes,
            model_bytes,
            n_params,
            json_str(info.arch.name()),
            json_str(backend),
            engine
                .numerics_tag()
                .map_or("null".to_string(), |t| json_str(&t)),
            engine.threads(),
            json_str(engine.kv_name()),
            args.repetitions,
            peak_rss.map_or("null".to_string(), |b| b.to_string()),
            match (&decode, &bw) {
                (Some((name, gb_s)), Some(bw)) => format!(
                    "{{\"decode_test\":{},\"weight_bytes_per_token\":{weight_bytes},\"decode_weight_gb_s\":{gb_s:.3},\
                     \"machine_read_gb_s\":{:.3},\"machine_copy_gb_s\":{:.3},\"probe_bytes\":{},\"probe_threads\":{},\
                     \"fraction_of_read\":{:.3},\"fraction_of_copy\":{:.3}}}",
                    json_str(name),
                    bw.read_gb_s,
                    bw.copy_gb_s,
                    PROBE_BYTES,
                    engine.threads(),
                    gb_s / bw.read_gb_s,
                    gb_s / bw.copy_gb_s
                ),
                _ => "null".to_string(),
            },
            tests.join(",")
        );
        std::fs::write(path, receipt).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("receipt: {}", path.display());
    }
    Ok(())
}

/// Size of each of the two buffers of the copy probe: several times the last-level cache.
const PROBE_BYTES: usize = 64 << 20;

/// The machine's memory bandwidth as the decode loop can use it.
struct Bandwidth {
    /// Reading the model's weights from the memory map (what decode does), GB/s.
    read_gb_s: f64,
    /// `memcpy` between two buffers, bytes read plus bytes written (STREAM's convention), GB/s.
    copy_gb_s: f64,
}

/// Times, on `threads` threads (each its own part), reading every weight byte of `model` and
/// copying `PROBE_BYTES` between two buffers; best of five, after touching every page.
fn bandwidth_probe(model: &Model, threads: usize) -> Bandwidth {
    let threads = threads.max(1);
    let g = model.gguf();
    let slices: Vec<&[u8]> = g.tensors().iter().map(|t| g.tensor_data(t)).collect();
    let total: usize = slices.iter().map(|s| s.len()).sum();
    let parts = split_bytes(&slices, total.div_ceil(threads));
    let n = PROBE_BYTES / 8;
    let src: Vec<u64> = (0..n as u64).collect();
    let mut dst = vec![1u64; n];
    let per = n.div_ceil(threads);
    let mut copy_gb_s = 0f64;
    let mut read_gb_s = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(per).zip(src.chunks(per)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        });
        copy_gb_s = copy_gb_s.max(2.0 * PROBE_BYTES as f64 / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        let sum = std::thread::scope(|s| {
            let hs: Vec<_> = parts
                .iter()
                .map(|p| s.spawn(move || p.iter().fold(0u64, |a, x| a.wrapping_add(read_sum(x)))))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        read_gb_s = read_gb_s.max(total as f64 / t.elapsed().as_secs_f64() / 1e9);
        std::hint::black_box(sum);
    }
    std::hint::black_box(&dst);
    Bandwidth {
        read_gb_s,
        copy_gb_s,
    }
}

/// `slices` cut into consecutive parts of about `per` bytes each.
fn split_bytes<'a>(slices: &[&'a [u8]], per: usize) -> Vec<Vec<&'a [u8]>> {
    let per = per.max(1);
    let mut parts = vec![Vec::new()];
    let mut room = per;
    for s in slices {
        let mut s: &[u8] = s;
        while !s.is_empty() {
            if room == 0 {
                parts.push(Vec::new());
                room = per;
            }
            let (a, b) = s.split_at(room.min(s.len()));
            if let Some(p) = parts.last_mut() {
                p.push(a);
            }
            room -= a.len();
            s = b;
        }
    }
    parts
}

/// A sum over the bytes of `x` as u64 words with independent lanes, so that it runs at load
/// bandwidth.
fn read_sum(x: &[u8]) -> u64 {
    // SAFETY: any bit pattern is a valid u64.
    let (head, words, tail) = unsafe { x.align_to::<u64>() };
    let mut acc = [0u64; 8];
    let mut chunks = words.chunks_exact(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*v);
        }
    }
    let rest = chunks
        .remainder()
        .iter()
        .fold(0u64, |a, v| a.wrapping_add(*v));
    let bytes = head
        .iter()
        .chain(tail)
        .fold(0u64, |a, &b| a.wrapping_add(u64::from(b)));
    acc.iter()
        .fold(rest.wrapping_add(bytes), |a, v| a.wrapping_add(*v))
}

fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

pub(crate) fn git_commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or_else(
            || "unknown".to_string(),
            |o| String::from_utf8_lossy(&o.stdout).trim().to_string(),
        )
}

pub(crate) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string())
}

/// Peak resident set size of this process (Linux `VmHWM`).
fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn load_err(argv: &[&str]) -> String {
        let cli = Cli::try_parse_from(argv).expect("arguments parse");
        match Engine::load(&cli.args, KvType::F16) {
            Ok(_) => panic!("{argv:?} loaded a model"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn fused_needs_the_cuda_device() {
        let e = load_err(&["bench", "-m", "no-such.gguf", "--fused"]);
        assert!(e.contains("--device cuda"), "{e}");
    }

    #[test]
    fn numerics_flags_resolve_or_are_refused_before_loading() {
        // every CPU profile resolves: the error is about the missing file
        let e = load_err(&["bench", "-m", "no-such.gguf", "--flash-attn", "off"]);
        assert!(e.contains("no-such.gguf"), "{e}");
        let e = load_err(&[
            "bench",
            "-m",
            "no-such.gguf",
            "--numerics",
            "host",
            "--device",
            "cuda",
        ]);
        assert!(e.contains("CPU backend's order"), "{e}");
        let e = load_err(&[
            "bench",
            "-m",
            "no-such.gguf",
            "--numerics",
            "portable",
            "--flash-attn",
            "on",
        ]);
        assert!(e.contains("no-such.gguf"), "{e}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn fused_without_the_feature_names_it() {
        let e = load_err(&["bench", "-m", "no-such.gguf", "--fused", "--device", "cuda"]);
        assert!(e.contains("--features cuda"), "{e}");
    }
}
