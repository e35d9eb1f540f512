//! The CUDA backend against the CPU backend, both through `muser_model::Model` (the same model
//! files), meant to run on the GPU machine.
//!
//!   muser-backend-check [MODEL.gguf ...] [--synth DIR] [--types q4_k,q8_0,...]
//!                       [--prompt TEXT] [--prompt-len N] [--tokens N] [--chunk N]
//!                       [--n-ctx N] [--cpu-threads N] [--json OUT]
//!
//! The CPU side runs on `--cpu-threads` threads (default 1): ggml's CPU attention splits a
//! decode row's cells between threads once there are 512 of them, and with one thread that
//! split is the single ordered pass the exact precision follows.
//!
//! For every model (the files given, plus with `--synth DIR` small synthetic muse-glimmer
//! files written there: one per weight type and one of the `tiny-array` geometry), loads it on
//! the CPU and on CUDA and checks, for the CUDA backend's exact precision (the CPU's activation
//! rounding, f32 products; the files given and every synthetic type) and its fast precision
//! (quantized weights, int8 GEMVs and bf16 GEMMs; synthetic types with a CUDA layout):
//! - `logits`: last-position logits after the prompt (prefill in `--chunk`-token batches,
//!   through the bf16 GEMM path; relative error = max|a-b| / max|a|);
//! - `greedy`: `--tokens` greedy tokens decoded by each (GEMV path), counted while equal;
//! - `kv`: the prompt's KV snapshot exported from the GPU cache against the CPU one (f16 rows,
//!   max abs difference, and relative to the largest value);
//! - `import`: the CPU snapshot imported into a fresh GPU cache, then one decode step against
//!   the CPU's;
//! - `mixed`: one batch with a decode token of sequence 0 and a 5-token prefill of sequence 1.
//!
//! Prompts: the model's tokenizer encodes `--prompt`; models without one (synthetic) get
//! `--prompt-len` fixed pseudo-random tokens (long enough by default to wrap the sliding-window
//! ring). A model passes when every relative error is below its bound: with float weights in
//! exact precision [`REL_MAX_EXACT`] and every greedy token equal, with quantized weights
//! [`REL_MAX`] (the floor any reordering of the CPU's own sums reaches on these random models),
//! in fast precision [`REL_MAX_FAST`]. Prints one line
//! per model, writes a JSON receipt with `--json`, exits 1 on a failure.
//! Any error (CUDA, model, I/O) is reported for its model, never a panic.

use std::path::{Path, PathBuf};
use std::time::Instant;

use muser_cuda::backend::{CudaBackend, Precision};
use muser_cuda::compare::{argmax, prefill_chunks, rel_err};
use muser_model::synth::{presets::preset, random_tokens, Plan, WeightType};
use muser_model::{Batch, KvSnapshot, KvType, LoadOptions, Model};
use serde_json::{json, Value};

type Error = Box<dyn std::error::Error>;

/// Largest relative error (max-abs) that passes with quantized weights. Any two orders of the
/// same f32 sums put these random tiny models about 1e-2 to 3e-2 apart: a last-bit difference
/// moves an activation across an int8 rounding boundary now and then, and the random weights
/// amplify it. `tests/exact_emulation.rs` measures that floor on the host (the CPU backend
/// against itself with only the matmul's summation order changed); both precisions land on it.
const REL_MAX: f64 = 5e-2;

/// The bound in fast precision, whose int8 activations in 16-value blocks (not the CPU's
/// Q8_K/Q8_0/Q8_1) and bf16 prefill GEMMs add their own rounding to that floor.
const REL_MAX_FAST: f64 = 1e-1;

/// The bound with float weights (F32, F16) in exact precision, where no int8 rounding
/// amplifies: what is left is the order of f32 sums, the GPU's own norm/RoPE/softmax
/// arithmetic and the f16 KV cache. Every greedy token must also agree.
const REL_MAX_EXACT: f64 = 5e-3;

/// A model to check, with the prefill batch size and bound for it.
struct Target {
    label: String,
    path: PathBuf,
    chunk: usize,
    precision: Precision,
    /// Float weights (F32, F16): no activation quantization on either side, so exact
    /// precision stays within [`REL_MAX_EXACT`] over whole runs.
    float_weights: bool,
}

impl Target {
    fn rel_max(&self) -> f64 {
        match self.precision {
            Precision::Exact if self.float_weights => REL_MAX_EXACT,
            Precision::Exact => REL_MAX,
            Precision::Fast => REL_MAX_FAST,
        }
    }
}

struct Args {
    models: Vec<Target>,
    prompt: String,
    prompt_len: usize,
    tokens: usize,
    n_ctx: usize,
    cpu_threads: usize,
}

/// ‖a-b‖ / ‖a‖ (infinite when any value is not finite or the lengths differ).
fn rel_l2(want: &[f32], got: &[f32]) -> f64 {
    if want.len() != got.len() || got.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let (mut d, mut m) = (0f64, 0f64);
    for (a, b) in want.iter().zip(got) {
        d += (*a as f64 - *b as f64).powi(2);
        m += (*a as f64).powi(2);
    }
    (d / m.max(1e-30)).sqrt()
}

/// max|a-b| / max|a| (infinite when any value is not finite or the lengths differ).
fn f16s(b: &[u8]) -> impl Iterator<Item = f32> + '_ {
    b.chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
}

/// (max abs difference, max abs value) over every K and V row of two snapshots.
fn kv_diff(a: &KvSnapshot, b: &KvSnapshot) -> Result<(f64, f64), Error> {
    if a.layout != b.layout || a.positions != b.positions || a.layers.len() != b.layers.len() {
        return Err("the GPU snapshot has another layout or range than the CPU one".into());
    }
    let (mut d, mut m) = (0f64, 0f64);
    for (la, lb) in a.layers.iter().zip(&b.layers) {
        if la.k.len() != lb.k.len() || la.v.len() != lb.v.len() {
            return Err("snapshot layers differ in size".into());
        }
        for (x, y) in f16s(&la.k)
            .zip(f16s(&lb.k))
            .chain(f16s(&la.v).zip(f16s(&lb.v)))
        {
            d = d.max((x as f64 - y as f64).abs());
            m = m.max((x as f64).abs());
        }
    }
    Ok((d, m))
}

/// The prompt: the tokenizer's encoding of the text, or fixed pseudo-random tokens.
fn prompt(model: &Model, a: &Args) -> Result<Vec<u32>, Error> {
    let g = model.gguf();
    let n_vocab = model.info().n_vocab;
    match g.get_str("tokenizer.ggml.model") {
        Err(_) | Ok("none") => Ok(random_tokens(a.prompt_len, n_vocab, 0x5eed)),
        Ok(_) => {
            let tok = muser_text::Tokenizer::from_gguf(g)?;
            let t = tok.encode(&a.prompt, true, true);
            if t.is_empty() {
                return Err("the prompt encodes to no tokens".into());
            }
            Ok(t)
        }
    }
}

fn check_model(t: &Target, a: &Args) -> Result<(Value, bool), Error> {
    let (path, chunk, rel_max) = (&t.path, t.chunk, t.rel_max());
    let cpu = Model::load(
        path,
        &LoadOptions {
            threads: a.cpu_threads,
            ..Default::default()
        },
    )?;
    let s = Instant::now();
    let gpu = Model::load_with(path, CudaBackend::with_precision(0, t.precision)?)?;
    let load_s = s.elapsed().as_secs_f64();
    let p = prompt(&cpu, a)?;
    let n = p.len();
    if n + a.tokens + 8 > a.n_ctx {
        return Err(format!(
            "prompt {n} + {} tokens do not fit --n-ctx {}",
            a.tokens, a.n_ctx
        )
        .into());
    }
    let ub = chunk.max(8) as u32;
    let mut kc = cpu.new_kv_ubatch(a.n_ctx, 2, KvType::F16, ub)?;
    let mut kg = gpu.new_kv_ubatch(a.n_ctx, 2, KvType::F16, ub)?;

    // (a) prompt logits.
    let s = Instant::now();
    let lc = prefill_chunks(&cpu, &mut kc, 0, &p, chunk)?;
    let cpu_s = s.elapsed().as_secs_f64();
    let s = Instant::now();
    let lg = prefill_chunks(&gpu, &mut kg, 0, &p, chunk)?;
    let gpu_s = s.elapsed().as_secs_f64();
    let logits_err = rel_err(&lc, &lg);
    let logits_l2 = rel_l2(&lc, &lg);

    // (c) KV snapshots of the prompt.
    let sc = kc.export(0, 0..n as u32)?;
    let sg = kg.export(0, 0..n as u32)?;
    let (kv_abs, kv_max) = kv_diff(&sc, &sg)?;
    let kv_rel = kv_abs / kv_max.max(1e-30);

    // (b) greedy decoding, each model on its own tokens.
    let (mut tc, mut tg) = (argmax(&lc), argmax(&lg));
    let mut same = 0usize;
    let mut step_err = 0f64;
    let mut first_cpu_logits = Vec::new();
    let first_tok = tc;
    for i in 0..a.tokens {
        if tc != tg {
            break;
        }
        same += 1;
        if i + 1 == a.tokens {
            break;
        }
        let pos = (n + i) as u32;
        let oc = cpu.forward(&mut kc, &Batch::single(0, &[tc], pos, true))?;
        let og = gpu.forward(&mut kg, &Batch::single(0, &[tg], pos, true))?;
        step_err = step_err.max(rel_err(&oc.logits, &og.logits));
        if i == 0 {
            first_cpu_logits = oc.logits.clone();
        }
        tc = argmax(&oc.logits);
        tg = argmax(&og.logits);
    }

    // (d) the CPU snapshot imported into a fresh GPU cache, then one decode step.
    let mut ki = gpu.new_kv_ubatch(a.n_ctx, 1, KvType::F16, ub)?;
    ki.import(0, &sc)?;
    let oi = gpu.forward(&mut ki, &Batch::single(0, &[first_tok], n as u32, true))?;
    let import_err = if first_cpu_logits.is_empty() {
        let mut kx = cpu.new_kv_ubatch(a.n_ctx, 1, KvType::F16, ub)?;
        kx.import(0, &sc)?;
        let ox = cpu.forward(&mut kx, &Batch::single(0, &[first_tok], n as u32, true))?;
        rel_err(&ox.logits, &oi.logits)
    } else {
        rel_err(&first_cpu_logits, &oi.logits)
    };

    // (e) a mixed batch: the next decode token of sequence 0 and a prefill of sequence 1, on
    // caches whose sequence 0 may have diverged: restart sequence 0 from the prompt on both.
    kc.truncate(0, n as u32);
    kg.truncate(0, n as u32);
    let mut b = Batch::default();
    for (i, &t) in p.iter().take(5).enumerate() {
        b.push(t, i as u32, 1, true);
    }
    b.push(first_tok, n as u32, 0, true);
    let (mc, mg) = (cpu.forward(&mut kc, &b)?, gpu.forward(&mut kg, &b)?);
    let mixed_err = rel_err(&mc.logits, &mg.logits);

    // Exact precision with float weights: whole runs agree, every greedy token. Otherwise
    // the quantized-weight floor (see REL_MAX).
    let all_tokens = !(t.precision == Precision::Exact && t.float_weights) || same == a.tokens;
    let pass = all_tokens
        && [logits_err, step_err, kv_rel, import_err, mixed_err]
            .iter()
            .all(|&e| e < rel_max);
    let v = json!({
        "prompt_tokens": n, "n_ctx": a.n_ctx, "chunk": chunk,
        "load_s": load_s, "prefill_cpu_s": cpu_s, "prefill_gpu_s": gpu_s,
        "logits_rel_err": logits_err, "logits_rel_l2": logits_l2,
        "greedy_tokens": a.tokens, "greedy_same": same, "decode_max_rel_err": step_err,
        "kv_max_abs_diff": kv_abs, "kv_max_abs": kv_max, "kv_rel": kv_rel,
        "import_rel_err": import_err, "mixed_rel_err": mixed_err,
        "precision": format!("{:?}", t.precision).to_lowercase(),
        "rel_max": rel_max, "pass": pass,
    });
    Ok((v, pass))
}

/// Writes the small synthetic models into `dir` (kept when already there): the `tiny`
/// geometry in each of `types` and `tiny-array` in Q4_K, prefilled in `chunk`-token batches,
/// each checked in exact precision, and in fast precision where the type has a CUDA layout.
fn synth_models(dir: &Path, types: &str, chunk: usize) -> Result<Vec<Target>, Error> {
    std::fs::create_dir_all(dir)?;
    let mut out = Vec::new();
    let mut want: Vec<(&str, &str)> = types
        .split(',')
        .filter(|t| !t.is_empty())
        .map(|t| ("tiny", t))
        .collect();
    want.push(("tiny-array", "q4_k"));
    for (geom, ty) in want {
        let wt = WeightType::from_name(ty)?;
        let path = dir.join(format!("synth-{geom}-{}.gguf", wt.name()));
        if !path.is_file() {
            Plan::new(preset(geom)?, wt, 7, None).write_file(&path, &mut |_| {})?;
        }
        let native = !matches!(ty, "f32" | "q4_0");
        let float_weights = matches!(ty, "f32" | "f16");
        for precision in [Precision::Exact, Precision::Fast] {
            if precision == Precision::Fast && !native {
                continue;
            }
            out.push(Target {
                label: format!(
                    "{geom} {} chunk {chunk} {}",
                    wt.name(),
                    format!("{precision:?}").to_lowercase()
                ),
                path: path.clone(),
                chunk,
                precision,
                float_weights,
            });
        }
    }
    Ok(out)
}

fn usage() -> ! {
    eprintln!(
        "usage: muser-backend-check [MODEL.gguf ...] [--synth DIR] [--types q4_k,q8_0,...] \
         [--prompt TEXT] [--prompt-len N] [--tokens N] [--chunk N] [--n-ctx N] [--cpu-threads N] \
         [--json OUT]"
    );
    std::process::exit(2)
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut models = Vec::new();
    let mut opts: std::collections::HashMap<&str, String> = Default::default();
    let mut i = 0;
    while i < argv.len() {
        let arg = argv[i].as_str();
        match arg {
            "--synth" | "--types" | "--prompt" | "--prompt-len" | "--tokens" | "--chunk"
            | "--n-ctx" | "--json" | "--cpu-threads" => {
                let v = argv.get(i + 1).cloned().unwrap_or_else(|| usage());
                opts.insert(arg, v);
                i += 2;
            }
            a if a.starts_with("--") => usage(),
            a => {
                models.push(a.to_string());
                i += 1;
            }
        }
    }
    let num = |k: &str, d: usize| {
        opts.get(k)
            .map_or(d, |v| v.parse().unwrap_or_else(|_| usage()))
    };
    let chunk = num("--chunk", 64).max(1);
    let mut models: Vec<Target> = models
        .into_iter()
        .map(|m| Target {
            label: m.clone(),
            path: PathBuf::from(m),
            chunk,
            precision: Precision::Exact,
            float_weights: false,
        })
        .collect();
    if let Some(dir) = opts.get("--synth") {
        let types = opts
            .get("--types")
            .cloned()
            .unwrap_or_else(|| "q4_k,q4_k_m,q6_k,q8_0,nvfp4,f16,q4_0,f32".into());
        match synth_models(Path::new(dir), &types, chunk) {
            Ok(m) => models.extend(m),
            Err(e) => {
                eprintln!("writing the synthetic models: {e}");
                std::process::exit(1)
            }
        }
    }
    if models.is_empty() {
        usage();
    }
    let a = Args {
        models,
        prompt: opts.get("--prompt").cloned().unwrap_or_else(|| {
            "The history of the printing press begins in the fifteenth century, when".into()
        }),
        prompt_len: num("--prompt-len", 300).max(1),
        tokens: num("--tokens", 128).max(1),
        n_ctx: num("--n-ctx", 512),
        cpu_threads: num("--cpu-threads", 1),
    };
    let device = muser_cuda::probe().unwrap_or_else(|e| format!("no device: {e}"));
    println!("device: {device}");
    let mut rows = Vec::new();
    let mut all = true;
    for t in &a.models {
        let (label, path) = (&t.label, &t.path);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check_model(t, &a)));
        let (mut v, pass) = match r {
            Ok(Ok((v, pass))) => {
                println!(
                    "{label}: logits rel err {:.2e} (l2 {:.2e}), greedy {}/{} same (decode max rel err {:.2e}), kv max|diff| {:.3e} (rel {:.2e}), import rel err {:.2e}, mixed batch rel err {:.2e}: {}",
                    v["logits_rel_err"].as_f64().unwrap_or(f64::NAN),
                    v["logits_rel_l2"].as_f64().unwrap_or(f64::NAN),
                    v["greedy_same"], v["greedy_tokens"],
                    v["decode_max_rel_err"].as_f64().unwrap_or(f64::NAN),
                    v["kv_max_abs_diff"].as_f64().unwrap_or(f64::NAN),
                    v["kv_rel"].as_f64().unwrap_or(f64::NAN),
                    v["import_rel_err"].as_f64().unwrap_or(f64::NAN),
                    v["mixed_rel_err"].as_f64().unwrap_or(f64::NAN),
                    if pass { "PASS" } else { "FAIL" }
                );
                (v, pass)
            }
            Ok(Err(e)) => {
                println!("{label}: error: {e}: FAIL");
                (json!({"error": e.to_string(), "pass": false}), false)
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                println!("{label}: panic: {msg}: FAIL");
                (
                    json!({"error": format!("panic: {msg}"), "pass": false}),
                    false,
                )
            }
        };
        v["model"] = json!(label);
        v["file"] = json!(path.file_name().map(|f| f.to_string_lossy().into_owned()));
        rows.push(v);
        all &= pass;
    }
    if let Some(out) = opts.get("--json") {
        let doc =
            json!({"kind": "cuda-backend-check", "device": device, "pass": all, "models": rows});
        if let Err(e) = std::fs::write(out, serde_json::to_string_pretty(&doc).unwrap_or_default())
        {
            eprintln!("writing {out}: {e}");
            all = false;
        }
    }
    if !all {
        std::process::exit(1);
    }
}
