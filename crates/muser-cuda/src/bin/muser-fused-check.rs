//! The fused forward as the engine runs it (`Model::with_fused` over `FusedGlimmer`: a
//! positional `KvCache` in a `CudaKv`, mixed batches, a slot table) against the fused model
//! run directly (`CudaGlimmer` with its own cache) and against the CPU. Meant for the GPU
//! machine:
//!
//!   muser-fused-check MODEL.gguf [--prompt-len N] [--tokens N] [--chunk N] [--n-ctx N]
//!                     [--batches 1,2,4,8,16,32,64] [--json OUT]
//!
//! Checks (one line each; exit 1 when any fails; errors are reported, never a panic):
//! - `direct`: one sequence, the prompt in `--chunk`-token batches then `--tokens` greedy
//!   steps through `Model::forward`, against `CudaGlimmer::prefill` and graph generation with
//!   its own cache: the same kernels, so the same tokens and the same first logits, bit for bit.
//! - `images`: prompt rows given as embeddings (`Batch::input_embd`, as an image's rows
//!   arrive) holding their tokens' embedding rows as the device gathers them, with ids past
//!   the vocabulary, in mtmd's chunks (text, image, text): the same last logits bit for bit as
//!   the prompt by id through `CudaGlimmer::prefill` in the same spans, and for the 5-row
//!   image the same greedy tokens as the prompt by id through the model; an image of 5 rows
//!   and one of 1 row (its sequence's lone row in the batch: a prefill chunk, not a decode
//!   step); and the logits after the 5-row image against the CPU model fed the same rows.
//! - `argmax`: the same greedy run with its decode rows marked `argmax_only`: the tokens the
//!   decode graph's argmax hands back (no logits cross) equal the logits path's.
//! - `cpu`: the prompt's last logits against the CPU model's (relative error, max-abs).
//! - `slots`: four sequences of different prompt lengths scheduled as the engine does (each
//!   batch: one token of every generating sequence plus a prompt chunk of the next one): each
//!   sequence's greedy tokens against its own run alone.
//! - `truncate`: a sequence cut back into its generated tokens and fed them again continues
//!   as before.
//! - `kvpack`: a sequence's K/V exported from the device cache and imported into another slot
//!   continues as the original does.
//! - `embeddings`: the final-norm hidden state of the prompt's last token against the CPU's.
//! - `batch N` (one per `--batches` size): N sequences of mixed prompt lengths (5 to 200
//!   tokens: mixed depths, and past the sliding-window ring for some) decode
//!   [`BATCH_TOKENS`] greedy steps together, every step one decode of all N (every other one
//!   answered by the device argmax): each sequence's tokens against its run alone.
//!
//! With the default sizes the sliding-window ring of the small synthetic models wraps, so
//! the positional cells are exercised past the ring.

use std::path::PathBuf;

use muser_cuda::compare::{argmax, prefill_chunks, rel_err};
use muser_cuda::glimmer::{CudaGlimmer, FusedGlimmer, GpuOptions};
use muser_cuda::layout::MAX_GEMV_BATCH;
use muser_cuda::runtime::Gpu;
use muser_gguf::GgufFile;
use muser_model::synth::random_tokens;
use muser_model::{Batch, InputEmbd, KvCache, KvType, LoadOptions, Model};
use serde_json::{json, Value};

type Error = Box<dyn std::error::Error>;

/// Largest relative error (max-abs) of the fused forward against the CPU that passes: its
/// int8 activations in 16-value blocks and bf16 prefill GEMMs on random models (as
/// `muser-backend-check`'s fast precision).
const REL_MAX_CPU: f64 = 1e-1;

/// Greedy steps of the `batch N` checks.
const BATCH_TOKENS: usize = 24;

struct Args {
    model: PathBuf,
    prompt_len: usize,
    tokens: usize,
    chunk: usize,
    n_ctx: usize,
    batches: Vec<usize>,
    json: Option<PathBuf>,
}

fn parse() -> Result<Args, Error> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        model: it
            .next()
            .ok_or("usage: muser-fused-check MODEL.gguf [options]")?
            .into(),
        prompt_len: 300,
        tokens: 200,
        chunk: 64,
        n_ctx: 1024,
        batches: Vec::new(),
        json: None,
    };
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--prompt-len" => a.prompt_len = v()?.parse()?,
            "--tokens" => a.tokens = v()?.parse()?,
            "--chunk" => a.chunk = v()?.parse()?,
            "--n-ctx" => a.n_ctx = v()?.parse()?,
            "--batches" => {
                a.batches = v()?
                    .split(',')
                    .map(|n| n.trim().parse::<usize>())
                    .collect::<Result<_, _>>()?
            }
            "--json" => a.json = Some(v()?.into()),
            _ => return Err(format!("unknown option {k}").into()),
        }
    }
    if a.batches.iter().any(|&n| n == 0 || n > MAX_GEMV_BATCH) {
        return Err(format!("--batches: sizes 1..={MAX_GEMV_BATCH}").into());
    }
    if a.prompt_len < 2 || a.tokens < 16 || a.chunk == 0 || a.prompt_len + a.tokens + 1 > a.n_ctx {
        return Err(
            "need prompt-len >= 2, tokens >= 16, chunk > 0, prompt-len + tokens < n-ctx".into(),
        );
    }
    Ok(a)
}

/// `n` greedy tokens of `seq` after `logits`, one step at a time.
fn greedy(
    m: &Model,
    kv: &mut KvCache,
    seq: u32,
    mut logits: Vec<f32>,
    n: usize,
) -> Result<Vec<u32>, Error> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        let pos = kv.seq_len(seq);
        logits = m.forward(kv, &Batch::single(seq, &[t], pos, true))?.logits;
    }
    Ok(out)
}

fn same_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The `batch N` checks: the first N of `prompts` decoded together, each sequence's tokens
/// against `solo`, its run alone.
fn batches(
    m: &Model,
    a: &Args,
    prompts: &[Vec<u32>],
    solo: &[Vec<u32>],
    results: &mut Vec<Value>,
) -> Result<bool, Error> {
    let n_vocab = m.info().n_vocab;
    let mut ok = true;
    for &n in &a.batches {
        let mut kv = m.new_kv_ubatch(a.n_ctx, n, KvType::F16, a.chunk.max(4) as u32)?;
        let mut next = Vec::with_capacity(n);
        for (s, p) in prompts[..n].iter().enumerate() {
            next.push(argmax(&prefill_chunks(m, &mut kv, s as u32, p, a.chunk)?));
        }
        let mut got: Vec<Vec<u32>> = vec![Vec::new(); n];
        for _ in 0..BATCH_TOKENS {
            let mut b = Batch::default();
            for (s, &t) in next.iter().enumerate() {
                let pos = kv.seq_len(s as u32);
                match s % 2 {
                    0 => b.push(t, pos, s as u32, true),
                    _ => b.push_argmax(t, pos, s as u32),
                }
                got[s].push(t);
            }
            let o = m.forward(&mut kv, &b)?;
            for (r, &i) in o.rows.iter().enumerate() {
                next[i] = argmax(o.row(r, n_vocab));
            }
            for &(i, t) in &o.argmax {
                next[i] = t;
            }
        }
        let agree: Vec<usize> = (0..n).map(|s| same_prefix(&got[s], &solo[s])).collect();
        let worst = agree.iter().copied().min().unwrap_or(0);
        ok &= report(
            results,
            &format!("batch {n}"),
            worst == BATCH_TOKENS,
            format!(
                "{n} sequences at depths {}..{}, {BATCH_TOKENS} steps together: fewest tokens equal to a sequence alone {worst}",
                prompts[..n].iter().map(Vec::len).min().unwrap_or(0),
                prompts[..n].iter().map(Vec::len).max().unwrap_or(0),
            ),
        );
    }
    Ok(ok)
}

/// The prompt's last logits and `n_gen` greedy tokens after it, fed in mtmd's chunks (text,
/// the `n` rows at `at`, text); with `rows`, those rows are given as these embeddings and
/// their ids lie past the vocabulary.
fn image_run(
    m: &Model,
    a: &Args,
    prompt: &[u32],
    (at, n): (usize, usize),
    rows: Option<&[f32]>,
    n_gen: usize,
) -> Result<(Vec<f32>, Vec<u32>), Error> {
    let n_vocab = m.info().n_vocab as u32;
    let mut kv = m.new_kv_ubatch(a.n_ctx, 1, KvType::F16, a.chunk.max(8) as u32)?;
    prefill_chunks(m, &mut kv, 0, &prompt[..at], a.chunk)?;
    let mut b = Batch::single(0, &prompt[at..at + n], at as u32, true);
    if let Some(values) = rows {
        b.tokens = (0..n as u32).map(|k| n_vocab + k).collect();
        b.input_embd = InputEmbd {
            rows: (0..n).collect(),
            values: values.to_vec(),
        };
    }
    let mut logits = m.forward(&mut kv, &b)?.logits;
    if at + n < prompt.len() {
        logits = prefill_chunks(m, &mut kv, 0, &prompt[at + n..], a.chunk)?;
    }
    let toks = match n_gen {
        0 => Vec::new(),
        _ => greedy(m, &mut kv, 0, logits.clone(), n_gen)?,
    };
    Ok((logits, toks))
}

/// The `images` check (see the header).
fn images(
    m: &Model,
    cpu: &Model,
    d: &mut CudaGlimmer,
    a: &Args,
    prompt: &[u32],
    results: &mut Vec<Value>,
) -> Result<bool, Error> {
    let n_gen = 32.min(a.tokens);
    let mut ok = true;
    let mut cpu_err = None;
    for n in [5usize, 1] {
        let at = prompt.len().saturating_sub(n) / 2;
        if at == 0 || at + n >= prompt.len() {
            continue;
        }
        let rows = d.embedding_rows(&prompt[at..at + n])?;
        // the fused model run directly by id in the same spans: the span's rows as a prefill
        // chunk, as the model runs the image's (a lone row included)
        d.prefill(&prompt[..at], 0)?;
        d.prefill(&prompt[at..at + n], at)?;
        let (want, _) = d.prefill(&prompt[at + n..], at + n)?;
        let (got, got_t) = image_run(m, a, prompt, (at, n), Some(&rows), n_gen)?;
        let bits = want.len() == got.len()
            && want
                .iter()
                .zip(&got)
                .all(|(x, y)| x.to_bits() == y.to_bits());
        let mut detail = format!(
            "{n} rows at {at} as embeddings: last logits {} the prompt by id",
            if bits { "bit for bit" } else { "DIFFER from" }
        );
        let mut pass = bits;
        if n > 1 {
            // a multi-row span by id takes the same prefill path through the model
            let (_, want_t) = image_run(m, a, prompt, (at, n), None, n_gen)?;
            let same = same_prefix(&want_t, &got_t);
            pass &= same == n_gen;
            detail += &format!(", {same} of {n_gen} greedy tokens equal");
            let (cl, _) = image_run(cpu, a, prompt, (at, n), Some(&rows), 0)?;
            cpu_err = Some(rel_err(&cl, &got));
        }
        ok &= report(results, &format!("images {n}"), pass, detail);
    }
    if let Some(e) = cpu_err {
        ok &= report(
            results,
            "images cpu",
            e < REL_MAX_CPU,
            format!("logits after the 5 embedding rows against the cpu fed the same rows: rel err {e:.2e} (bound {REL_MAX_CPU:.0e})"),
        );
    }
    Ok(ok)
}

/// Prompt lengths of the `batch N` checks: 5 to 200 tokens, spread.
fn batch_prompt_len(s: usize) -> usize {
    5 + (s * 53) % 196
}

fn report(results: &mut Vec<Value>, name: &str, pass: bool, detail: String) -> bool {
    println!("{name}: {} ({detail})", if pass { "ok" } else { "FAILED" });
    results.push(json!({"check": name, "pass": pass, "detail": detail}));
    pass
}

fn run(a: &Args, results: &mut Vec<Value>) -> Result<bool, Error> {
    let g = GgufFile::open(&a.model)?;
    let fused = FusedGlimmer::load(Gpu::new(0)?, &g)?;
    let device = fused.gpu().info().name.clone();
    let m = Model::with_fused(g, Box::new(fused))?;
    let info = m.info().clone();
    println!(
        "model: {} layers, vocab {}, window {} on {device}",
        info.n_layer, info.n_vocab, info.n_swa
    );
    let prompt = random_tokens(a.prompt_len, info.n_vocab, 11);
    let mut ok = true;

    // direct
    let mut kv = m.new_kv_ubatch(a.n_ctx, 4, KvType::F16, a.chunk.max(4) as u32)?;
    let first = prefill_chunks(&m, &mut kv, 0, &prompt, a.chunk)?;
    let via_model = greedy(&m, &mut kv, 0, first.clone(), a.tokens)?;
    let opts = GpuOptions {
        n_ctx: a.n_ctx,
        max_chunk: a.chunk,
        n_seq: 1,
        swa_ring: true,
    };
    let mut d = CudaGlimmer::load(Gpu::new(0)?, &GgufFile::open(&a.model)?, opts)?;
    for line in d.describe_plan() {
        println!("{line}");
    }
    let direct_logits;
    let direct_tokens = {
        let (l, t0) = d.prefill(&prompt, 0)?;
        direct_logits = l;
        let graph = d.capture_decode()?;
        let mut toks = vec![t0];
        toks.extend(d.generate(&graph, t0, prompt.len(), a.tokens - 1)?);
        toks
    };
    let same = same_prefix(&via_model, &direct_tokens);
    let e = rel_err(&direct_logits, &first);
    ok &= report(
        results,
        "direct",
        same == a.tokens && e == 0.0,
        format!(
            "{same} of {} greedy tokens equal, first logits rel err {e:.2e}",
            a.tokens
        ),
    );

    // argmax: the same run with its decode rows marked `argmax_only`: each step's token comes
    // back from the graph's own argmax (4 bytes instead of the logits) and equals the host's
    // argmax of the logits above.
    let first1 = prefill_chunks(&m, &mut kv, 1, &prompt, a.chunk)?;
    let (mut t, mut toks, mut by_token) = (argmax(&first1), Vec::new(), 0);
    for _ in 0..a.tokens {
        toks.push(t);
        let mut b = Batch::default();
        b.push_argmax(t, kv.seq_len(1), 1);
        let o = m.forward(&mut kv, &b)?;
        t = match o.argmax[..] {
            [(0, next)] if o.rows.is_empty() => {
                by_token += 1;
                next
            }
            _ => argmax(&o.logits),
        };
    }
    let same = same_prefix(&toks, &via_model);
    ok &= report(
        results,
        "argmax",
        same == a.tokens && by_token == a.tokens,
        format!(
            "{same} of {} greedy tokens equal to the logits path's, {by_token} steps answered by the device argmax",
            a.tokens
        ),
    );

    // cpu + embeddings
    let cpu = Model::load(
        &a.model,
        &LoadOptions {
            threads: 0,
            ..Default::default()
        },
    )?;
    let mut ckv = cpu.new_kv(a.n_ctx, 1, KvType::F16)?;
    let ckv_chunked = |m: &Model, kv: &mut KvCache| -> Result<(Vec<f32>, Vec<f32>), Error> {
        let (head, last) = prompt.split_at(prompt.len() - 1);
        prefill_chunks(m, kv, 0, head, a.chunk)?;
        let mut lb = Batch::single(0, last, head.len() as u32, true);
        lb.embeddings = true;
        let o = m.forward(kv, &lb)?;
        Ok((o.logits, o.embeddings))
    };
    let (cl, ce) = ckv_chunked(&cpu, &mut ckv)?;
    drop(ckv);
    ok &= images(&m, &cpu, &mut d, a, &prompt, results)?;
    drop(d);
    let e = rel_err(&cl, &first);
    ok &= report(
        results,
        "cpu",
        e < REL_MAX_CPU,
        format!(
            "last-token logits rel err {e:.2e} (bound {REL_MAX_CPU:.0e}), argmax cpu {} gpu {}",
            argmax(&cl),
            argmax(&first)
        ),
    );
    let mut ekv = m.new_kv_ubatch(a.n_ctx, 1, KvType::F16, a.chunk.max(4) as u32)?;
    let (_, ge) = ckv_chunked(&m, &mut ekv)?;
    let e = rel_err(&ce, &ge);
    ok &= report(
        results,
        "embeddings",
        ge.len() == info.n_embd && e < REL_MAX_CPU,
        format!("{} values, rel err {e:.2e} against the cpu", ge.len()),
    );
    drop(ekv);

    // slots: solo references first (a fresh cache each).
    let lens = [37usize, 120, 5, a.prompt_len.min(260)];
    let n_gen = 48.min(a.tokens);
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(n, info.n_vocab, 100 + i as u64))
        .collect();
    let mut solo = Vec::new();
    for p in &prompts {
        let mut kv = m.new_kv_ubatch(a.n_ctx, 4, KvType::F16, a.chunk.max(4) as u32)?;
        let l = prefill_chunks(&m, &mut kv, 0, p, a.chunk)?;
        solo.push(greedy(&m, &mut kv, 0, l, n_gen)?);
    }
    // Engine-like schedule on one cache.
    let mut kv = m.new_kv_ubatch(a.n_ctx, 4, KvType::F16, (a.chunk + 4) as u32)?;
    let mut fed = [0usize; 4];
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 4];
    let mut next = [0u32; 4];
    let mut steps = 0;
    while got.iter().any(|g| g.len() < n_gen) {
        steps += 1;
        let mut batch = Batch::default();
        let mut who = Vec::new();
        for s in 0..4 {
            if fed[s] == prompts[s].len() && got[s].len() < n_gen && !got[s].is_empty() {
                batch.push(next[s], kv.seq_len(s as u32), s as u32, true);
                who.push(s);
            }
        }
        if let Some(s) = (0..4).find(|&s| fed[s] < prompts[s].len()) {
            let end = (fed[s] + a.chunk).min(prompts[s].len());
            for (k, &t) in prompts[s][fed[s]..end].iter().enumerate() {
                batch.push(
                    t,
                    (fed[s] + k) as u32,
                    s as u32,
                    end == prompts[s].len() && fed[s] + k + 1 == end,
                );
            }
            if end == prompts[s].len() {
                who.push(s);
            }
            fed[s] = end;
        }
        if batch.is_empty() {
            break;
        }
        let out = m.forward(&mut kv, &batch)?;
        // Output rows are in batch order: decode rows by slot, then the chunk's last row.
        for (r, &s) in who.iter().enumerate() {
            let t = argmax(out.row(r, info.n_vocab));
            if got[s].len() < n_gen {
                got[s].push(t);
                next[s] = t;
            }
        }
    }
    let agree: Vec<usize> = (0..4).map(|s| same_prefix(&got[s], &solo[s])).collect();
    ok &= report(
        results,
        "slots",
        agree.iter().all(|&n| n == n_gen),
        format!("{steps} mixed batches; greedy tokens equal to each sequence alone: {agree:?} of {n_gen}"),
    );

    // truncate: seq 3 back to 10 tokens after its prompt, fed its own tokens again one step
    // at a time (as they were first computed), must reproduce them.
    let s = 3u32;
    let keep = prompts[3].len() + 10;
    kv.truncate(s, keep as u32);
    let mut again = Vec::new();
    for &t in &got[3][10..n_gen - 1] {
        let pos = kv.seq_len(s);
        let l = m
            .forward(&mut kv, &Batch::single(s, &[t], pos, true))?
            .logits;
        again.push(argmax(&l));
    }
    let same = same_prefix(&again, &got[3][11..]);
    ok &= report(
        results,
        "truncate",
        same == n_gen - 11,
        format!(
            "cut to {keep} positions, refed {} tokens: {same} next tokens as before",
            n_gen - 11
        ),
    );

    // kvpack: seq 1's cache into slot 2.
    let len1 = kv.seq_len(1);
    let snap = kv.export(1, 0..len1)?;
    kv.clear(2);
    kv.import(2, &snap)?;
    let last1 = got[1][n_gen - 1];
    let a1 = {
        let l = m
            .forward(&mut kv, &Batch::single(1, &[last1], len1, true))?
            .logits;
        greedy(&m, &mut kv, 1, l, 16)?
    };
    let a2 = {
        let l = m
            .forward(&mut kv, &Batch::single(2, &[last1], len1, true))?
            .logits;
        greedy(&m, &mut kv, 2, l, 16)?
    };
    ok &= report(
        results,
        "kvpack",
        a1 == a2,
        format!(
            "{len1} positions exported and imported; 16 continuation tokens equal: {}",
            a1 == a2
        ),
    );

    // batch N: solo references (one cache of one sequence, cleared between), then the sizes.
    if let Some(&most) = a.batches.iter().max() {
        let prompts: Vec<Vec<u32>> = (0..most)
            .map(|s| random_tokens(batch_prompt_len(s), info.n_vocab, 500 + s as u64))
            .collect();
        let mut kv = m.new_kv_ubatch(a.n_ctx, 1, KvType::F16, a.chunk.max(4) as u32)?;
        let mut solo = Vec::with_capacity(most);
        for p in &prompts {
            kv.clear(0);
            let l = prefill_chunks(&m, &mut kv, 0, p, a.chunk)?;
            solo.push(greedy(&m, &mut kv, 0, l, BATCH_TOKENS)?);
        }
        drop(kv);
        ok &= batches(&m, a, &prompts, &solo, results)?;
    }
    Ok(ok)
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("muser-fused-check: {e}");
            std::process::exit(2);
        }
    };
    let mut results = Vec::new();
    let ok = match run(&a, &mut results) {
        Ok(ok) => ok,
        Err(e) => {
            println!("error: {e}");
            results.push(json!({"check": "run", "pass": false, "detail": e.to_string()}));
            false
        }
    };
    println!(
        "fused engine checks: {}",
        if ok { "all passed" } else { "FAILED" }
    );
    if let Some(p) = &a.json {
        let doc = json!({"model": a.model.display().to_string(), "pass": ok, "checks": results});
        if let Err(e) = std::fs::write(p, serde_json::to_string_pretty(&doc).unwrap_or_default()) {
            eprintln!("writing {}: {e}", p.display());
        }
    }
    std::process::exit(if ok { 0 } else { 1 });
}
