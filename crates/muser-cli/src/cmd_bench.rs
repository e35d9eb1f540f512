//! `muser bench`: what llama.cpp's benchmark tools measure, in the product binary, through the
//! engine's model on any device (`--device cpu|cuda|cuda-ops`) or Muse Glimmer's fused CUDA
//! forward driven directly (`--device cuda --fused`, see `fused.rs`).
//!
//! By default llama-bench's tests (`plan.rs`): `-p`/`-n` lists of prefill (`pp512`) and
//! generation (`tg128`) sizes, `-pg P,G` prompt-then-generate pairs (`pp512+tg128`), each at
//! every `-d` depth (`pp512 @ d4096`: the depth's tokens are prefilled untimed first), `-r`
//! repetitions and a `-t` list of thread counts (the model is loaded once per count). Prompts
//! go in batches of at most `-ub` tokens (llama-bench's default 512), generation one token per
//! forward pass; t/s counts the timed tokens over the timed span, mean ± sd over the
//! repetitions, as llama-bench does. `-o md|json|jsonl` prints llama-bench's table or its JSON
//! fields. With `--batched`, llama-batched-bench's measurement instead (`batched.rs`).
//! `--receipt FILE` writes a JSON receipt (command, git commit, machine, model, settings, peak
//! RSS, the rows). Random token ids make it work on tokenizer-less synthetic models.
//!
//! Decode streams the weights once per token, so it is bound by memory bandwidth: after the
//! tests on the CPU it states the weight traffic of the first decode test (weight bytes per
//! token × tokens/s) beside this machine's bandwidth measured on the same threads
//! (`bandwidth.rs`; after the peak RSS reading, which therefore leaves its buffers out).

mod bandwidth;
pub(crate) mod batched;
mod plan;

use crate::device::{self, Device};
use anyhow::{bail, Context};
use batched::{Config, Outcome, Row};
use muser_gguf::GgufFile;
use muser_model::{Batch, KvCache, KvType, Model, ModelInfo};
use plan::Test;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Instant;

/// llama-bench's and llama-batched-bench's multi-letter single-dash flags (clap's short flags
/// are one letter): the long spelling each stands for on `muser bench`.
pub const SINGLE_DASH: &[(&str, &str)] = &[
    ("-pg", "--pg"),
    ("-ub", "--ubatch-size"),
    ("-npp", "--npp"),
    ("-ntg", "--ntg"),
    ("-npl", "--npl"),
];

/// What goes to standard output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// llama-bench's (or llama-batched-bench's) markdown table.
    Md,
    /// A JSON array of the rows, with llama-bench's (llama-batched-bench's) field names.
    Json,
    /// One JSON object per row.
    Jsonl,
}

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF).
    #[arg(short = 'm', long)]
    model: PathBuf,
    /// Prompt sizes of the prefill tests, comma-separated (0 skips).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    n_prompt: Vec<usize>,
    /// Generated tokens of the decode tests, comma-separated (0 skips).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    n_gen: Vec<usize>,
    /// A prompt-then-generate test `P,G` (`-pg`; repeatable): P tokens prefilled then G
    /// generated, timed together.
    #[arg(long = "pg", value_name = "P,G", value_parser = plan::parse_pair)]
    pg: Vec<(usize, usize)>,
    /// Depths, comma-separated: each test runs after this many tokens prefilled untimed.
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    n_depth: Vec<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Thread counts, comma-separated (0 = one per core); the tests run for each.
    #[arg(short = 't', long, value_delimiter = ',', default_value = "0")]
    threads: Vec<usize>,
    /// Most prompt tokens per forward pass (`-ub`).
    #[arg(long = "ubatch-size", default_value_t = 512)]
    ubatch: usize,
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
    /// llama-batched-bench's measurement (`-npp`, `-ntg`, `-npl`) instead of llama-bench's.
    #[arg(long, conflicts_with_all = ["n_prompt", "n_gen", "pg", "n_depth"])]
    batched: bool,
    /// `--batched`: prompt tokens of each sequence, comma-separated (`-npp`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "128",
        requires = "batched"
    )]
    npp: Vec<usize>,
    /// `--batched`: tokens each sequence generates, comma-separated (`-ntg`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "128",
        requires = "batched"
    )]
    ntg: Vec<usize>,
    /// `--batched`: parallel sequences, comma-separated (`-npl`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16,32",
        requires = "batched"
    )]
    npl: Vec<usize>,
    /// Output format on standard output.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Md)]
    output: Format,
    /// Write a JSON receipt here.
    #[arg(long, value_name = "FILE")]
    receipt: Option<PathBuf>,
}

/// One llama-bench test's samples.
struct TestResult {
    test: Test,
    threads: usize,
    samples_ns: Vec<u64>,
}

impl TestResult {
    /// Tokens per second of each sample.
    fn samples_ts(&self) -> Vec<f64> {
        let n = self.test.n_tokens() as f64;
        self.samples_ns
            .iter()
            .map(|&ns| 1e9 * n / ns as f64)
            .collect()
    }

    fn mean_ts(&self) -> f64 {
        mean(&self.samples_ts())
    }

    fn sd_ts(&self) -> f64 {
        sd(&self.samples_ts())
    }
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len().max(1) as f64
}

/// Sample standard deviation (0 for fewer than two samples), as llama-bench states it.
fn sd(x: &[f64]) -> f64 {
    if x.len() < 2 {
        return 0.0;
    }
    let m = mean(x);
    (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (x.len() - 1) as f64).sqrt()
}

/// A fixed pseudo-random token stream (llama.cpp's tools also use random ids).
pub struct Tokens(u64);

impl Tokens {
    pub fn next(&mut self, n_vocab: usize) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n_vocab as u64) as u32
    }

    pub fn take(&mut self, n: usize, n_vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.next(n_vocab)).collect()
    }
}

/// What the tests run on.
enum Engine {
    /// The engine's model, on any device, with the single-sequence tests' KV cache (one pool
    /// kept across tests and repetitions and cleared before each, as llama-bench does: a device
    /// backend keeps what it built for the cache, such as captured decode graphs). Batched rows
    /// make their own cache of `pl` sequences.
    Model {
        model: Box<Model>,
        kv_type: KvType,
        kv: KvCache,
        ubatch: usize,
    },
    /// Muse Glimmer's fused CUDA forward.
    #[cfg(feature = "cuda")]
    Fused(Box<crate::fused::FusedBench>),
}

impl Engine {
    /// Loads the model for sequences of up to `n_ctx` positions.
    fn load(args: &Args, kv_type: KvType, threads: usize, n_ctx: usize) -> anyhow::Result<Engine> {
        let numerics = args.numerics.resolve(args.device)?;
        if args.fused {
            if args.device != Device::Cuda {
                bail!("--fused runs on the GPU: add --device cuda");
            }
            if kv_type != KvType::F16 {
                bail!("--fused keeps an f16 KV cache (--kv-type f16)");
            }
            return Engine::load_fused(args, n_ctx);
        }
        let model = device::load(&args.model, args.device, threads, numerics)?;
        let kv = model.new_kv_ubatch(n_ctx, 1, kv_type, args.ubatch as u32)?;
        Ok(Engine::Model {
            model: Box::new(model),
            kv_type,
            kv,
            ubatch: args.ubatch,
        })
    }

    #[cfg(feature = "cuda")]
    fn load_fused(args: &Args, n_ctx: usize) -> anyhow::Result<Engine> {
        let n_seq = match args.batched {
            true => args.npl.iter().copied().max().unwrap_or(1),
            false => 1,
        };
        let b = crate::fused::FusedBench::load(&args.model, n_ctx, args.ubatch, n_seq)
            .with_context(|| format!("loading {}", args.model.display()))?;
        Ok(Engine::Fused(Box::new(b)))
    }

    #[cfg(not(feature = "cuda"))]
    fn load_fused(_args: &Args, _n_ctx: usize) -> anyhow::Result<Engine> {
        Err(device::cuda_not_built("--fused"))
    }

    fn info(&self) -> &ModelInfo {
        match self {
            Engine::Model { model, .. } => model.info(),
            #[cfg(feature = "cuda")]
            Engine::Fused(f) => f.info(),
        }
    }

    fn gguf(&self) -> &GgufFile {
        match self {
            Engine::Model { model, .. } => model.gguf(),
            #[cfg(feature = "cuda")]
            Engine::Fused(f) => f.gguf(),
        }
    }

    /// The numerics profile of the forward pass (see `Model::numerics_tag`).
    fn numerics_tag(&self) -> Option<String> {
        match self {
            Engine::Model { model, .. } => model.numerics_tag(),
            #[cfg(feature = "cuda")]
            Engine::Fused(_) => None,
        }
    }

    /// Host threads of the forward pass (0 for the fused GPU path, which uses none).
    fn threads(&self) -> usize {
        match self {
            Engine::Model { model, .. } => model.threads(),
            #[cfg(feature = "cuda")]
            Engine::Fused(_) => 0,
        }
    }

    /// One sample of test `t`: the depth prefilled untimed into an empty cache, then the
    /// prompt and the generation timed together; nanoseconds.
    fn sample(&mut self, t: &Test, rng: &mut Tokens) -> anyhow::Result<u64> {
        let n_vocab = self.info().n_vocab;
        let depth = rng.take(t.n_depth, n_vocab);
        let prompt = rng.take(t.n_prompt, n_vocab);
        let first = rng.next(n_vocab);
        let start = match self {
            Engine::Model {
                model, kv, ubatch, ..
            } => {
                kv.clear(0);
                prefill(model, kv, &depth, 0, *ubatch)?;
                let start = Instant::now();
                prefill(model, kv, &prompt, t.n_depth, *ubatch)?;
                generate(model, kv, first, t.n_depth + t.n_prompt, t.n_gen, rng)?;
                start
            }
            #[cfg(feature = "cuda")]
            Engine::Fused(f) => {
                f.prefill(&depth, 0)?;
                let start = Instant::now();
                f.prefill(&prompt, t.n_depth)?;
                f.generate(first, t.n_depth + t.n_prompt, t.n_gen)?;
                start
            }
        };
        Ok(start.elapsed().as_nanos().max(1) as u64)
    }

    /// One llama-batched-bench row.
    fn batched(&mut self, c: Config, rng: &mut Tokens) -> Outcome {
        match self {
            Engine::Model {
                model,
                kv_type,
                ubatch,
                ..
            } => match batched::on_model(model, *kv_type, *ubatch, c, rng) {
                Ok(t) => Outcome::Timed(t),
                Err(e) => Outcome::Failed(format!("{e:#}")),
            },
            #[cfg(feature = "cuda")]
            Engine::Fused(f) => f.batched(c, rng),
        }
    }

    /// Pages the weights in and starts the threads (llama-bench and llama-batched-bench warm
    /// up too).
    fn warm_up(&mut self, batched: bool, rng: &mut Tokens) -> anyhow::Result<()> {
        if let (true, Engine::Model { model, kv_type, .. }) = (batched, &*self) {
            return batched::warm_up(model, *kv_type, rng);
        }
        let t = Test {
            n_prompt: 16,
            n_gen: 1,
            n_depth: 0,
        };
        self.sample(&t, rng).map(drop)
    }
}

/// `tokens` at positions `pos..` of sequence 0, in batches of at most `ubatch`.
fn prefill(
    model: &Model,
    kv: &mut KvCache,
    tokens: &[u32],
    pos: usize,
    ubatch: usize,
) -> anyhow::Result<()> {
    for (i, chunk) in tokens.chunks(ubatch).enumerate() {
        model.forward(
            kv,
            &Batch::single(0, chunk, (pos + i * ubatch) as u32, true),
        )?;
    }
    Ok(())
}

/// `n` one-token steps of sequence 0 from `pos`, `token` first, then random tokens.
fn generate(
    model: &Model,
    kv: &mut KvCache,
    token: u32,
    pos: usize,
    n: usize,
    rng: &mut Tokens,
) -> anyhow::Result<()> {
    let n_vocab = model.info().n_vocab;
    let mut tok = token;
    for p in pos..pos + n {
        model.forward(kv, &Batch::single(0, &[tok], p as u32, true))?;
        tok = rng.next(n_vocab);
    }
    Ok(())
}

/// The model's description in tables and rows: file name, weight bytes and parameters.
struct ModelDesc {
    file: String,
    arch: &'static str,
    file_bytes: u64,
    tensor_bytes: u64,
    params: u64,
}

impl ModelDesc {
    fn of(args: &Args, engine: &Engine) -> ModelDesc {
        let g = engine.gguf();
        ModelDesc {
            file: args
                .model
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            arch: engine.info().arch.name(),
            file_bytes: engine.info().file_bytes,
            tensor_bytes: g.tensors().iter().map(|t| t.size as u64).sum(),
            params: g.tensors().iter().map(|t| t.n_elements()).sum(),
        }
    }
}

/// What a run measured, for the receipt.
enum Measured {
    Tests(Vec<TestResult>),
    Batched(Vec<Row>),
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
    if args.ubatch == 0 || args.ubatch > plan::MAX_TOKENS {
        bail!("-ub must be between 1 and {}", plan::MAX_TOKENS);
    }
    let (tests, configs) = if args.batched {
        (
            Vec::new(),
            batched::configs(&args.npp, &args.ntg, &args.npl)?,
        )
    } else {
        let t = plan::tests(&args.n_prompt, &args.n_gen, &args.pg, &args.n_depth)?;
        (t, Vec::new())
    };
    // the single-sequence cache's positions (and the warm-up's); batched rows size their own
    let n_ctx = tests
        .iter()
        .map(Test::n_ctx)
        .chain(configs.iter().map(|c| c.pp + c.tg))
        .max()
        .unwrap_or(0)
        .max(32)
        + 1;
    let load_start = load_average();
    let backend = if args.fused {
        "cuda-fused"
    } else {
        args.device.name()
    };
    let mut rng = Tokens(42);
    let mut results = Vec::new();
    let mut rows = Vec::new();
    let mut bandwidth = Vec::new();
    let mut peak_rss = None;
    let mut last = None;
    if args.output == Format::Md && args.batched {
        println!("{}", batched::md_header());
    }
    for &threads in &args.threads {
        let mut engine = Engine::load(&args, kv_type, threads, n_ctx)?;
        let desc = ModelDesc::of(&args, &engine);
        if args.output == Format::Md && !args.batched && results.is_empty() {
            println!("| model | size | params | backend | threads | kv | test | t/s |");
            println!("| --- | ---: | ---: | --- | ---: | --- | ---: | ---: |");
        }
        engine.warm_up(args.batched, &mut rng)?;
        for &c in &configs {
            let r = Row {
                config: c,
                outcome: engine.batched(c, &mut rng),
            };
            match args.output {
                Format::Md => println!("{}", batched::md_row(&r)),
                Format::Jsonl => println!("{}", batched::json_row(&r)),
                Format::Json => {}
            }
            rows.push(r);
        }
        let first = results.len();
        for t in &tests {
            let samples_ns = (0..args.repetitions)
                .map(|_| engine.sample(t, &mut rng))
                .collect::<anyhow::Result<Vec<u64>>>()
                .with_context(|| format!("test {}", t.name()))?;
            let r = TestResult {
                test: *t,
                threads: engine.threads(),
                samples_ns,
            };
            match args.output {
                Format::Md => println!(
                    "| {} | {:.2} MiB | {:.2} M | {backend} | {} | {} | {} | {:.2} ± {:.2} |",
                    desc.file,
                    desc.tensor_bytes as f64 / (1 << 20) as f64,
                    desc.params as f64 / 1e6,
                    r.threads,
                    kv_type.name(),
                    t.name(),
                    r.mean_ts(),
                    r.sd_ts()
                ),
                Format::Jsonl => println!("{}", test_json(&desc, &args, backend, kv_type, &r)),
                Format::Json => {}
            }
            results.push(r);
        }
        // The host's bandwidth bounds decode only when the weights are read from host memory.
        if let (Engine::Model { model, .. }, Device::Cpu) = (&engine, args.device) {
            let decode = results[first..]
                .iter()
                .find(|r| r.test.n_prompt == 0 && r.test.n_depth == 0)
                .or_else(|| results[first..].iter().find(|r| r.test.n_gen > 0));
            if let Some(r) = decode {
                // before the first probe, whose buffers are not the engine's
                peak_rss.get_or_insert_with(peak_rss_bytes);
                let bw = bandwidth::probe(model, model.threads());
                bandwidth.push(bandwidth_json(model, r, &bw));
            }
        }
        last = Some((desc, engine.numerics_tag()));
    }
    let Some((desc, numerics)) = last else {
        bail!("-t needs at least one thread count");
    };
    let measured = if args.batched {
        Measured::Batched(rows)
    } else {
        Measured::Tests(results)
    };
    let peak_rss = peak_rss.unwrap_or_else(peak_rss_bytes);
    finish(
        &args, kv_type, backend, &desc, numerics, peak_rss, bandwidth, load_start, measured,
    )
}

/// Prints what is left to print and writes the receipt.
#[allow(clippy::too_many_arguments)]
fn finish(
    args: &Args,
    kv_type: KvType,
    backend: &str,
    desc: &ModelDesc,
    numerics: Option<String>,
    peak_rss: Option<u64>,
    bandwidth: Vec<Value>,
    load_start: String,
    measured: Measured,
) -> anyhow::Result<()> {
    let rows: Vec<Value> = match &measured {
        Measured::Tests(results) => results
            .iter()
            .map(|r| test_json(desc, args, backend, kv_type, r))
            .collect(),
        Measured::Batched(rows) => rows.iter().map(batched::json_row).collect(),
    };
    if args.output == Format::Json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    for b in &bandwidth {
        eprintln!(
            "decode {} ({} threads): {:.1} MB of weights per token → {:.2} GB/s; this machine: \
             read {:.2} GB/s, copy {:.2} GB/s (read + write) → {:.0}% of read, {:.0}% of copy \
             bandwidth",
            b["decode_test"].as_str().unwrap_or(""),
            b["probe_threads"],
            b["weight_bytes_per_token"].as_f64().unwrap_or(0.0) / 1e6,
            b["decode_weight_gb_s"].as_f64().unwrap_or(0.0),
            b["machine_read_gb_s"].as_f64().unwrap_or(0.0),
            b["machine_copy_gb_s"].as_f64().unwrap_or(0.0),
            100.0 * b["fraction_of_read"].as_f64().unwrap_or(0.0),
            100.0 * b["fraction_of_copy"].as_f64().unwrap_or(0.0),
        );
    }
    if let Some(rss) = peak_rss {
        eprintln!(
            "peak RSS {:.1} MiB (model file {:.1} MiB)",
            rss as f64 / (1 << 20) as f64,
            desc.file_bytes as f64 / (1 << 20) as f64
        );
    }
    let Some(path) = &args.receipt else {
        return Ok(());
    };
    let command: Vec<String> = std::env::args().collect();
    let receipt = json!({
        "tool": if args.batched { "muser bench --batched" } else { "muser bench" },
        "command": command.join(" "),
        "git_commit": git_commit(),
        "machine": {
            "cpu": cpu_model(),
            "logical_cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "isa": muser_quant::detected_isa().name(),
            "isa_hardware": muser_quant::hardware_isa().name(),
            "load_average_at_start": load_start,
            "load_average_at_end": load_average(),
        },
        "model": {
            "file": desc.file,
            "file_bytes": desc.file_bytes,
            "tensor_bytes": desc.tensor_bytes,
            "params": desc.params,
            "arch": desc.arch,
        },
        "settings": {
            "device": backend,
            "numerics": numerics,
            "threads": args.threads,
            "kv_type": kv_type.name(),
            "repetitions": args.repetitions,
            "n_ubatch": args.ubatch,
        },
        "peak_rss_bytes": peak_rss,
        "bandwidth": bandwidth,
        "results": rows,
    });
    std::fs::write(path, serde_json::to_string_pretty(&receipt)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("receipt: {}", path.display());
    Ok(())
}

/// A test's row with llama-bench's JSON field names (and `test`, its table name).
fn test_json(desc: &ModelDesc, args: &Args, backend: &str, kv: KvType, r: &TestResult) -> Value {
    let ns: Vec<f64> = r.samples_ns.iter().map(|&n| n as f64).collect();
    json!({
        "model_filename": desc.file,
        "model_type": desc.arch,
        "model_size": desc.tensor_bytes,
        "model_n_params": desc.params,
        "backends": backend,
        "n_threads": r.threads,
        "n_ubatch": args.ubatch,
        "type_k": kv.name(),
        "type_v": kv.name(),
        "n_prompt": r.test.n_prompt,
        "n_gen": r.test.n_gen,
        "n_depth": r.test.n_depth,
        "test": r.test.name(),
        "avg_ns": mean(&ns).round() as u64,
        "stddev_ns": sd(&ns).round() as u64,
        "avg_ts": r.mean_ts(),
        "stddev_ts": r.sd_ts(),
        "samples_ns": r.samples_ns,
        "samples_ts": r.samples_ts(),
    })
}

/// The decode test's weight traffic beside the machine's bandwidth on the same threads.
fn bandwidth_json(model: &Model, r: &TestResult, bw: &bandwidth::Bandwidth) -> Value {
    let weight_bytes = model.decode_weight_bytes();
    let gb_s = weight_bytes as f64 * r.mean_ts() / 1e9;
    json!({
        "decode_test": r.test.name(),
        "weight_bytes_per_token": weight_bytes,
        "decode_weight_gb_s": gb_s,
        "machine_read_gb_s": bw.read_gb_s,
        "machine_copy_gb_s": bw.copy_gb_s,
        "probe_bytes": bandwidth::PROBE_BYTES,
        "probe_threads": model.threads(),
        "fraction_of_read": gb_s / bw.read_gb_s,
        "fraction_of_copy": gb_s / bw.copy_gb_s,
    })
}

/// `/proc/loadavg` (the machine may be shared: the receipt says how busy it was).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
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
        match Engine::load(&cli.args, KvType::F16, 0, 64) {
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
