//! Checks and benchmarks for the CUDA backend, meant to run on the GPU machine.
//!
//!   muser-cuda-bench check [--json OUT]
//!       kernel checks on random data against the CPU reference (muser-quant dequantization,
//!       f64 sums): decode GEMV per weight type and batch (1 to 64, each batch's outputs also
//!       bit for bit against each row's batch-1 GEMV), bf16 dequantization, cuBLAS GEMM,
//!       embedding rows, the decode SwiGLU and norms (their int8 activations bit for bit
//!       against the host's statement of the quantization), the greedy argmax over split rows. Exit status 1 if any check fails.
//!   muser-cuda-bench model MODEL.gguf [--n-ctx N] [--chunk N] [--pp 512,2048] [--tg 128]
//!                    [--reps 3] [--json OUT] [--cpu-check] [--depth D] [--slots N]
//!                    [--tunes 'name:spec;name:spec']
//!       loads a muse-glimmer GGUF, prints its decode plan (one line per layer kind and batch
//!       bucket), checks prefill against token-by-token decode, then times prompt processing
//!       (ppN) and greedy generation (tgN, graph replays) like llama-bench; with --depth D both
//!       run after a D-token context (llama-bench -d D). --slots N also checks N-sequence
//!       decode against one sequence at a time and times aggregate generation; --tunes times
//!       tgN under other plans (plan::Overrides specs: tile=N, splits=N, gqa=POS|off).
//!   muser-cuda-bench check-sampling [--json OUT]
//!       only the GPU sampler's checks (part of `check`).
//!   muser-cuda-bench gemv [--tunes ...] [--json OUT]
//!       Q4_K decode GEMVs alone on Muse Glimmer's shapes (random valid blocks, copies past the
//!       L2 size), per override spec and batch (1 to 64 sequences): microseconds, TB/s of
//!       weights, and the floor the float terms set at the FP32 pipes' peak with the share of
//!       it reached.
//!
//! Prints a table; with --json writes a receipt.

mod checks;

use std::path::PathBuf;
use std::time::Instant;

use muser_cuda::glimmer::{CudaGlimmer, GpuOptions};
use muser_cuda::layout::MAX_GEMV_BATCH;
use muser_cuda::plan::Overrides;
use muser_cuda::runtime::{DeviceInfo, Gpu};
use muser_cuda::weights::{DevWeight, QActBufs, WType};
use muser_cuda::CudaError;
use muser_gguf::GgufFile;
use serde_json::json;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Roughly normal (sum of uniforms), mean 0, sd 1.
    fn normal(&mut self) -> f32 {
        let mut s = 0.0;
        for _ in 0..4 {
            s += (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        }
        ((s - 2.0) * 3f64.sqrt()) as f32
    }
}

pub(crate) fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let mut num = 0.0;
    let mut den = 0.0;
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += (*g as f64 - w) * (*g as f64 - w);
        den += w * w;
    }
    (num / den.max(1e-30)).sqrt()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct ModelArgs {
    path: PathBuf,
    n_ctx: usize,
    chunk: usize,
    pp: Vec<usize>,
    tg: usize,
    reps: usize,
    json: Option<PathBuf>,
    /// Also run the CPU model (muser-model) on the consistency prompt and compare logits.
    cpu_check: bool,
    depth: usize,
    slots: usize,
    /// Also load the model with full-length sliding-layer caches and compare with the rings.
    ring_check: bool,
    /// Tokens of the prefill-vs-decode consistency prompt (more than 64 exercise split merges).
    check_len: usize,
    tunes: Vec<(String, String)>,
}

fn parse_tunes(spec: &str) -> Vec<(String, String)> {
    spec.split(';')
        .filter(|s| !s.trim().is_empty())
        .map(|t| match t.split_once(':') {
            Some((n, v)) => (n.trim().to_string(), v.trim().to_string()),
            None => (t.trim().to_string(), t.trim().to_string()),
        })
        .collect()
}

/// Median seconds of `reps` runs of `f` (after one warm-up run).
fn time_median(
    gpu: &Gpu,
    reps: usize,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    f()?;
    let mut v = Vec::new();
    for _ in 0..reps.max(1) {
        gpu.sync()?;
        let s = Instant::now();
        f()?;
        gpu.sync()?;
        v.push(s.elapsed().as_secs_f64());
    }
    Ok(median(v))
}

/// Seconds per matrix of `launch` run once on each of `ws` (captured as one graph, median of
/// 5 replays): copies of one matrix, so the timing streams from memory rather than L2.
fn time_per_matrix(
    gpu: &Gpu,
    ws: &[DevWeight],
    mut launch: impl FnMut(&DevWeight) -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    gpu.begin_capture()?;
    let r = ws.iter().try_for_each(&mut launch);
    let graph = gpu.end_capture();
    r?;
    let graph = graph?;
    let sec = time_median(gpu, 5, || {
        graph
            .launch()
            .map_err(|e| CudaError::Driver(format!("{e:?}")))
    })?;
    Ok(sec / ws.len().max(1) as f64)
}

/// Logits of the last prompt token from the CPU backend (the numerics reference).
fn cpu_logits(path: &std::path::Path, prompt: &[u32]) -> Result<Vec<f32>, CudaError> {
    use muser_model::{Batch, KvType, LoadOptions, Model};
    let err = |e: muser_model::ModelError| CudaError::Model(format!("CPU reference: {e}"));
    let model = Model::load(path, &LoadOptions::default()).map_err(err)?;
    let mut kv = model
        .new_kv(prompt.len().next_power_of_two().max(256), 1, KvType::F16)
        .map_err(err)?;
    let out = model
        .forward(&mut kv, &Batch::single(0, prompt, 0, true))
        .map_err(err)?;
    Ok(out.row(0, model.info().n_vocab).to_vec())
}

fn argmax(v: &[f32]) -> usize {
    muser_cuda::compare::argmax(v) as usize
}

fn cmd_model(a: ModelArgs) -> Result<bool, CudaError> {
    let t0 = Instant::now();
    let g = GgufFile::open(&a.path).map_err(|e| CudaError::Model(e.to_string()))?;
    let gpu = Gpu::new(0)?;
    let dev = gpu.info().name.clone();
    let mut m = CudaGlimmer::load(
        gpu,
        &g,
        GpuOptions {
            n_ctx: a.n_ctx,
            max_chunk: a.chunk,
            n_seq: a.slots.max(1),
            swa_ring: true,
        },
    )?;
    m.sync()?;
    let load_s = t0.elapsed().as_secs_f64();
    let info = m.info().clone();
    let wbytes = m.decode_weight_bytes();
    let plan = m.describe_plan();
    for line in &plan {
        println!("{line}");
    }
    println!(
        "model: {} layers, embd {}, vocab {}, {:.2} GB of weights read per token; loaded in {load_s:.1} s on {dev}",
        info.n_layer,
        info.n_embd,
        info.n_vocab,
        wbytes as f64 / 1e9
    );
    let mut rng = Rng(42);
    let vocab = info.n_vocab as u64;
    let mut tokens =
        |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next() % vocab) as u32).collect() };

    // Consistency: the prefill path (bf16 GEMMs, cuBLAS attention) against token-by-token
    // decode (int8 GEMVs, flash-decoding) on the same `--check-len` tokens.
    let prompt = tokens(a.check_len);
    let (lp, tp) = m.prefill(&prompt, 0)?;
    let base = m.plan().overrides;
    let want: Vec<f64> = lp.iter().map(|&v| v as f64).collect();
    let (mut ld, mut td) = (Vec::new(), 0);
    for (k, &tok) in prompt.iter().enumerate() {
        (ld, td) = m.decode(tok, k)?;
    }
    let cons_err = rel_err(&ld, &want);
    println!("consistency: prefill vs decode logits rel err {cons_err:.2e}, argmax {tp} vs {td}");

    // Sliding layers' KV rings against full-length caches: a prompt of three windows and then
    // 40 greedy decode steps, each side on its own model instance.
    let mut ring_json = json!(null);
    let mut ring_ok = true;
    let (mut gqa_json, mut gqa_ok) = (json!(null), true);
    if a.ring_check {
        let mut full = CudaGlimmer::load(
            Gpu::new(0)?,
            &g,
            GpuOptions {
                n_ctx: a.n_ctx,
                max_chunk: a.chunk,
                n_seq: 1,
                swa_ring: false,
            },
        )?;
        let nlong = (3 * info.n_swa as usize + 7).min(a.n_ctx.saturating_sub(64));
        let long = tokens(nlong);
        let (l1, t1) = m.prefill(&long, 0)?;
        let (l2, t2) = full.prefill(&long, 0)?;
        let ep = rel_err(&l1, &l2.iter().map(|&v| v as f64).collect::<Vec<_>>());
        // An argmax that differs is a near-tie when the two candidates' logits are closer
        // than the two runs' largest logit difference (rounding, not a wrong row, chose).
        let tie = muser_cuda::compare::near_tie;
        let mut same = t1 == t2;
        let mut flips = usize::from(t1 != t2);
        let mut flips_tied = t1 == t2 || tie(&l1, &l2, t1, t2);
        let mut worst = 0f64;
        let mut tok = t1;
        for k in 0..40 {
            let (a1, n1) = m.decode(tok, nlong + k)?;
            let (a2, n2) = full.decode(tok, nlong + k)?;
            worst = worst.max(rel_err(
                &a1,
                &a2.iter().map(|&v| v as f64).collect::<Vec<_>>(),
            ));
            if n1 != n2 {
                same = false;
                flips += 1;
                flips_tied &= tie(&a1, &a2, n1, n2);
            }
            tok = n1;
        }
        // Not bit-equal: with a ring, a window that wraps is multiplied in two cuBLAS calls,
        // whose rounding differs; the int8 and bf16 roundings downstream amplify that to the
        // size of the prefill-vs-decode differences (both runs are fed the same tokens). A
        // wrong row would show as a large error or an argmax change that is not a near-tie.
        ring_ok = flips_tied && ep < 2e-2 && worst < 2e-2;
        println!(
            "sliding-window rings vs full caches: {nlong}-token prompt logits rel err {ep:.2e}, 40 decode steps max rel err {worst:.2e}, same tokens {same} ({flips} argmax changes, all near-ties: {flips_tied})"
        );
        ring_json = json!({"prompt_tokens": nlong, "prefill_rel_err": ep, "decode_steps": 40,
            "decode_max_rel_err": worst, "same_tokens": same, "argmax_changes": flips,
            "argmax_changes_near_ties": flips_tied, "pass": ring_ok});
        let (gj, gok) = grouped_check(&mut m, base, &long)?;
        gqa_json = gj;
        gqa_ok = gok;
    }
    let mut cpu = json!(null);
    if a.cpu_check {
        let s = Instant::now();
        match cpu_logits(&a.path, &prompt) {
            Ok(c) => {
                let want: Vec<f64> = c.iter().map(|&v| v as f64).collect();
                let (ep, ed) = (rel_err(&lp, &want), rel_err(&ld, &want));
                let am = argmax(&c);
                println!(
                    "cpu reference ({:.1} s): prefill rel err {ep:.2e}, decode rel err {ed:.2e}; argmax cpu {am} gpu prefill {tp} decode {td}",
                    s.elapsed().as_secs_f64()
                );
                cpu = json!({"prefill_rel_err": ep, "decode_rel_err": ed, "argmax_cpu": am, "argmax_prefill": tp, "argmax_decode": td});
            }
            Err(e) => {
                println!("cpu reference failed: {e}");
                cpu = json!({"error": e.to_string()});
            }
        }
    }

    // Context of `depth` tokens (llama-bench -d): prefilled once, kept for tg and pp.
    let d = a.depth;
    if d > 0 {
        let ctx = tokens(d);
        let s = Instant::now();
        m.prefill(&ctx, 0)?;
        println!(
            "depth {d}: context prefilled in {:.2} s",
            s.elapsed().as_secs_f64()
        );
    }
    // Generation: capture once, replay.
    let graph = m.capture_decode()?;
    let t = m.generate(&graph, prompt[0], d, 8)?; // warm-up
    let mut tg_times = Vec::new();
    for _ in 0..a.reps {
        m.sync()?;
        let s = Instant::now();
        let _ = m.generate(&graph, t[0], d, a.tg)?;
        tg_times.push(s.elapsed().as_secs_f64());
    }
    let tg_s = median(tg_times);
    let tg_tps = a.tg as f64 / tg_s;
    let bw = wbytes as f64 * tg_tps / 1e12;
    println!(
        "tg{}: {tg_tps:.1} tok/s ({:.3} ms/token, weights at {bw:.2} TB/s)",
        a.tg,
        1e3 * tg_s / a.tg as f64
    );
    // Graph replay must agree with the step-by-step path.
    let (_, step0) = m.decode(prompt[0], d)?;
    let replay = m.generate(&graph, prompt[0], d, 1)?;
    let graph_ok = replay.first() == Some(&step0);
    println!("graph replay matches a plain decode step: {graph_ok}");
    // Reference continuation and logits for the tunings below (same start, default choices).
    let ref_tokens = m.generate(&graph, t[0], d, 32)?;
    let (ref_logits, _) = m.decode(t[0], d)?;
    drop(graph);

    // Other decode choices, same context.
    let mut tune_rows = Vec::new();
    for (name, spec) in &a.tunes {
        let tu = match base.parse(spec) {
            Ok(t) => t,
            Err(e) => {
                println!("tune {name}: {e}");
                continue;
            }
        };
        m.set_overrides(tu);
        let gr = m.capture_decode()?;
        let sec = time_median(m.gpu(), a.reps, || {
            m.generate(&gr, t[0], d, a.tg).map(|_| ())
        })?;
        let tps = a.tg as f64 / sec;
        let same = m.generate(&gr, t[0], d, 32)? == ref_tokens;
        // One plain step's logits against the default's (0 when a choice is bit-exact).
        let (lg, _) = m.decode(t[0], d)?;
        let diff = muser_cuda::compare::max_abs_diff(&lg, &ref_logits);
        println!(
            "tune {name:<12} tg{}: {tps:.1} tok/s ({:.3} ms/token, weights at {:.2} TB/s)  [{spec}] same 32 tokens: {same}, logits max |diff| {diff:.3e}",
            a.tg,
            1e3 * sec / a.tg as f64,
            wbytes as f64 * tps / 1e12
        );
        tune_rows.push(json!({"name": name, "spec": spec, "tok_per_s": tps, "ms_per_token": 1e3 * sec / a.tg as f64, "same_32_tokens_as_default": same, "logits_max_abs_diff": diff}));
        m.set_overrides(base);
    }

    // Several sequences per decode step: each sequence's greedy tokens must equal its
    // one-sequence run; then aggregate throughput.
    let mut slots_json = json!(null);
    let mut slots_ok = true;
    if a.slots > 1 {
        let nb = a.slots;
        let plen = 8;
        let steps = 16;
        let prompts: Vec<Vec<u32>> = (0..nb).map(|_| tokens(plen)).collect();
        let mut firsts = Vec::new();
        for (b, p) in prompts.iter().enumerate() {
            firsts.push(m.prefill_seq(p, 0, b)?.1);
        }
        let gb = m.capture_decode_batch(nb)?;
        let batched = m.generate_batch(&gb, &firsts, &vec![plen; nb], steps)?;
        let g1 = m.capture_decode()?;
        for (b, p) in prompts.iter().enumerate() {
            let (_, f) = m.prefill(p, 0)?;
            let single = m.generate(&g1, f, plen, steps)?;
            let same = f == firsts[b] && single == batched[b];
            slots_ok &= same;
            if !same {
                println!("slot {b}: batched {:?} vs single {:?}", batched[b], single);
            }
        }
        println!("{nb}-sequence decode equals one-sequence decode for {steps} steps: {slots_ok}");
        // Aggregate: every sequence at the benchmark depth.
        let starts = vec![d.max(plen); nb];
        if d > 0 {
            let ctx = tokens(d);
            for b in 0..nb {
                m.prefill_seq(&ctx, 0, b)?;
            }
        }
        let sec = time_median(m.gpu(), a.reps, || {
            m.generate_batch(&gb, &firsts, &starts, a.tg).map(|_| ())
        })?;
        let agg = (nb * a.tg) as f64 / sec;
        println!(
            "{nb} sequences tg{}: {agg:.1} tok/s aggregate ({:.1} per sequence, {:.3} ms per step)",
            a.tg,
            agg / nb as f64,
            1e3 * sec / a.tg as f64
        );
        slots_json = json!({"sequences": nb, "check_steps": steps, "equal_to_single": slots_ok,
            "aggregate_tok_per_s": agg, "per_sequence_tok_per_s": agg / nb as f64,
            "ms_per_step": 1e3 * sec / a.tg as f64});
        if d > 0 {
            // Sequence 0 again holds the depth context for the prefill timings below.
            let ctx = tokens(d);
            m.prefill(&ctx, 0)?;
        }
    }

    let mut pp_rows = Vec::new();
    for &n in &a.pp {
        let toks = tokens(n);
        m.prefill(&toks, d)?; // warm-up
        let mut times = Vec::new();
        for _ in 0..a.reps {
            m.sync()?;
            let s = Instant::now();
            m.prefill(&toks, d)?;
            times.push(s.elapsed().as_secs_f64());
        }
        let sec = median(times);
        println!("pp{n}: {:.0} tok/s ({:.1} ms)", n as f64 / sec, sec * 1e3);
        pp_rows.push(json!({"test": format!("pp{n}"), "tokens": n, "seconds": sec, "tok_per_s": n as f64 / sec}));
    }
    if let Some(p) = a.json {
        let doc = json!({
            "kind": "cuda-model-bench",
            "device": dev,
            "model": a.path.file_name().map(|f| f.to_string_lossy().into_owned()),
            "n_layer": info.n_layer, "n_embd": info.n_embd, "n_vocab": info.n_vocab,
            "n_ctx": a.n_ctx, "prefill_chunk": a.chunk, "reps": a.reps, "depth": d,
            "overrides": format!("{base:?}"),
            "decode_plan": plan,
            "tunes": tune_rows,
            "slots": slots_json,
            "ring_vs_full_cache": ring_json,
            "grouped_vs_per_head_attention": gqa_json,
            "load_seconds": load_s,
            "decode_weight_bytes": wbytes,
            "consistency_rel_err": cons_err, "consistency_argmax_equal": tp == td,
            "graph_replay_matches": graph_ok,
            "cpu_reference": cpu,
            "tg": {"test": format!("tg{}", a.tg), "tok_per_s": tg_tps, "ms_per_token": 1e3 * tg_s / a.tg as f64, "weight_tb_per_s": bw},
            "pp": pp_rows,
        });
        std::fs::write(p, serde_json::to_string_pretty(&doc).unwrap_or_default())?;
    }
    Ok(graph_ok && slots_ok && ring_ok && gqa_ok)
}

/// The plan's grouped decode attention on every layer and at every position (`gqa=0`) against
/// the per-head kernel everywhere (`gqa=off`): after `prompt`, 32 decode steps fed the same
/// tokens, each step's logits under both, then 24 greedy steps from graph replays under both.
/// Returns the JSON record and whether it passed.
fn grouped_check(
    m: &mut CudaGlimmer,
    outer: Overrides,
    prompt: &[u32],
) -> Result<(serde_json::Value, bool), CudaError> {
    let (base, grouped) = (outer.parse("gqa=off")?, outer.parse("gqa=0")?);
    let n = prompt.len();
    m.set_overrides(base);
    let (_, mut tok) = m.prefill(prompt, 0)?;
    let tie = muser_cuda::compare::near_tie;
    let (mut worst, mut flips, mut tied) = (0f64, 0usize, true);
    for k in 0..32 {
        let (a1, n1) = m.decode(tok, n + k)?;
        m.set_overrides(grouped);
        let r = m.decode(tok, n + k);
        m.set_overrides(base);
        let (a2, n2) = r?;
        worst = worst.max(rel_err(
            &a2,
            &a1.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        ));
        if n1 != n2 {
            flips += 1;
            tied &= tie(&a1, &a2, n1, n2);
        }
        tok = n1;
    }
    // Graph replays: the per-head graph and the grouped one from the same start.
    let start = n + 32;
    let g1 = m.capture_decode()?;
    let t1 = m.generate(&g1, tok, start, 24)?;
    drop(g1);
    m.set_overrides(grouped);
    let g2 = m.capture_decode();
    m.set_overrides(outer);
    let t2 = m.generate(&g2?, tok, start, 24)?;
    let same_prefix = t1.iter().zip(&t2).take_while(|(a, b)| a == b).count();
    let ok = tied && worst < 2e-2;
    println!(
        "grouped vs per-head decode attention: {n}-token context, 32 steps max rel err {worst:.2e} ({flips} argmax changes, all near-ties: {tied}); graph replays agree on {same_prefix} of 24 tokens"
    );
    let row = json!({"context_tokens": n, "decode_steps": 32, "max_rel_err": worst,
        "argmax_changes": flips, "argmax_changes_near_ties": tied,
        "graph_tokens_agreeing": same_prefix, "pass": ok});
    Ok((row, ok))
}

/// Random valid Q4_K rows (small fixed scales, random quant bits), as synth_muse.py writes.
fn q4k_random(rng: &mut Rng, rows: usize, cols: usize) -> Vec<u8> {
    let nb = rows * cols / 256;
    let mut v = vec![0u8; nb * 144];
    for c in v.chunks_exact_mut(8) {
        c.copy_from_slice(&rng.next().to_le_bytes());
    }
    let d = half::f16::from_f32(2e-5).to_le_bytes();
    let m = half::f16::from_f32(1.5e-4).to_le_bytes();
    for b in v.chunks_exact_mut(144) {
        b[0..2].copy_from_slice(&d);
        b[2..4].copy_from_slice(&m);
    }
    v
}

/// FP32-pipe operations of one Q4_K term (one sequence, 32 weights: q4k_term in kernels.cu):
/// two exact integer conversions' subtractions and q4k_term's nine operations.
const Q4K_TERM_FLOPS: f64 = 11.0;

/// Microseconds the float terms of a Q4_K GEMV take at the FP32 pipes' peak (128 lanes per
/// multiprocessor per clock): the floor of a batched GEMV once the weight reads are shared.
fn q4k_term_floor_us(info: &DeviceInfo, rows: usize, cols: usize, batch: usize) -> f64 {
    let terms = (rows * batch * (cols / 32)) as f64;
    let per_us = info.sm_count as f64 * 128.0 * info.clock_khz as f64 * 1e-3;
    terms * Q4K_TERM_FLOPS / per_us
}

/// Q4_K GEMVs alone on Muse Glimmer's shapes: copies of each matrix past the L2 size, one
/// graph launching each copy once, per tuning; beside each, the float terms' floor
/// ([`q4k_term_floor_us`]) and the fraction of it reached.
fn cmd_gemv(tunes: Vec<(String, String)>, json_out: Option<PathBuf>) -> Result<bool, CudaError> {
    let gpu = Gpu::new(0)?;
    println!("device: {:?}", gpu.info());
    let base = gpu.overrides();
    let mut rng = Rng(7);
    // (name, rows, cols): qkv+gate, attn output, gate+up, down, vocabulary projection.
    let shapes = [
        ("qkvg", 8704usize, 6656usize),
        ("wo", 6656, 4096),
        ("gate_up", 39936, 6656),
        ("down", 6656, 19968),
    ];
    let mut rows_json = Vec::new();
    let mut mats = Vec::new();
    for (name, rows, cols) in shapes {
        let host = q4k_random(&mut rng, rows, cols);
        let copies = (400_000_000 / host.len()).max(2);
        let mut ws = Vec::new();
        for _ in 0..copies {
            ws.push(DevWeight::upload(&gpu, WType::Q4K, cols, &[&host])?);
        }
        mats.push((name, rows, cols, host.len(), ws));
    }
    let maxc = 19968;
    let bmax = MAX_GEMV_BATCH;
    let x: Vec<f32> = (0..bmax * maxc).map(|_| rng.normal()).collect();
    let xd = gpu.alloc(4 * x.len())?;
    gpu.upload(&xd, 0, &x)?;
    let qbufs = QActBufs::quantize(&gpu, xd.ptr(), maxc, bmax)?;
    let qa = qbufs.act();
    let y = gpu.alloc(4 * bmax * 39936)?;
    let mut tunes = tunes;
    if tunes.is_empty() {
        tunes.push(("default".into(), String::new()));
    }
    for (tname, spec) in &tunes {
        gpu.set_overrides(base.parse(spec)?);
        for batch in [1usize, 4, 8, 16, 32, bmax] {
            for (name, rows, cols, bytes, ws) in &mats {
                let per = time_per_matrix(&gpu, ws, |w| {
                    w.gemv(&gpu, batch, qa, xd.ptr(), y.ptr(), w.rows)
                })?;
                let tbs = *bytes as f64 / per / 1e12;
                let us = per * 1e6;
                let floor_us = q4k_term_floor_us(gpu.info(), *rows, *cols, batch);
                println!(
                    "gemv {tname:<10} B={batch} {name:<8} {us:>7.1} us  {tbs:.2} TB/s  float floor {floor_us:>6.1} us ({:.0}%)",
                    100.0 * floor_us / us
                );
                rows_json.push(
                    json!({"tune": tname, "spec": spec, "batch": batch, "matrix": name,
                    "bytes": bytes, "us": us, "tb_per_s": tbs, "float_floor_us": floor_us,
                    "floor_fraction": floor_us / us}),
                );
            }
        }
    }
    gpu.set_overrides(base);
    if let Some(p) = json_out {
        let doc =
            json!({"kind": "cuda-gemv-bench", "device": gpu.info().name, "results": rows_json});
        std::fs::write(p, serde_json::to_string_pretty(&doc).unwrap_or_default())?;
    }
    Ok(true)
}

fn usage() -> ! {
    eprintln!("usage: muser-cuda-bench check [--json OUT] | gemv [--tunes T] [--json OUT] | model MODEL.gguf [--n-ctx N] [--chunk N] [--pp 512,2048] [--tg 128] [--reps 3] [--json OUT] [--cpu-check] [--depth D] [--slots N] [--check-len N] [--ring-check] [--tunes 'name:spec;...']");
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let num =
        |name: &str, d: usize| flag(name).map_or(d, |v| v.parse().unwrap_or_else(|_| usage()));
    let json_out = flag("--json").map(PathBuf::from);
    let tunes = parse_tunes(&flag("--tunes").unwrap_or_default());
    let r = match args.first().map(String::as_str) {
        Some("check") => checks::cmd_check(json_out),
        Some("check-sampling") => Gpu::new(0).and_then(|gpu| {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
            let mut results = Vec::new();
            let ok = checks::check_sampling(&gpu, &mut rng, &mut results)?;
            if let Some(p) = json_out {
                let doc = json!({"kind": "cuda-sampling-checks", "device": gpu.info().name, "all_pass": ok, "results": results});
                std::fs::write(p, serde_json::to_string_pretty(&doc).unwrap_or_default())?;
            }
            Ok(ok)
        }),
        Some("gemv") => cmd_gemv(tunes, json_out),
        Some("model") => {
            let path = args.get(1).map(PathBuf::from).unwrap_or_else(|| usage());
            let pp = flag("--pp")
                .unwrap_or_else(|| "512,2048".into())
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().unwrap_or_else(|_| usage()))
                .collect();
            cmd_model(ModelArgs {
                path,
                n_ctx: num("--n-ctx", 4096),
                chunk: num("--chunk", 2048),
                pp,
                tg: num("--tg", 128),
                reps: num("--reps", 3),
                json: json_out,
                cpu_check: args.iter().any(|a| a == "--cpu-check"),
                depth: num("--depth", 0),
                slots: num("--slots", 1),
                ring_check: args.iter().any(|a| a == "--ring-check"),
                check_len: num("--check-len", 48).max(1),
                tunes,
            })
        }
        _ => usage(),
    };
    match r {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1)
        }
    }
}
