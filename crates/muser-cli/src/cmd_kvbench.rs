//! `muser bench-resume`: what the prompt cache saves. For each model and prompt length, the
//! time to compute a prefix from scratch versus resuming it through the prompt cache
//! (`muser_engine::PromptCache`, the path a server request takes) from memory and from disk
//! (the pack read and verified completely: identity, seal, Merkle root, every segment's
//! SHA-256), with the page cache warm and after dropping the pack's pages; plus pack bytes
//! per token, the time to publish a pack, and the fraction of the bytes a delta pack moves
//! when the receiver holds the first half. Every resume is checked: the next token's logits
//! after it equal the recomputed ones bit for bit. Prints a table and writes a JSON receipt.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context};
use muser_engine::kvpack_bridge::{snapshot_to_state, state_to_snapshot};
use muser_engine::prompt_cache::Tier;
use muser_engine::{KvPackContext, KvType, PromptCache, PromptCacheConfig};
use muser_kvpack::{Keys, PackPlan, PackSpec, SegmentPlan, BLOCK_TOKENS};
use muser_model::{Batch, KvCache, LoadOptions, Model};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model(s) to measure.
    #[arg(short, long, required = true)]
    model: Vec<PathBuf>,
    /// Prefix lengths in tokens (a length at or beyond a model's training context is cut to
    /// the last 256-token block below it).
    #[arg(long, value_delimiter = ',', default_values_t = [2048u32, 8192, 32768])]
    tokens: Vec<u32>,
    /// Compute threads.
    #[arg(short, long, default_value_t = 2)]
    threads: usize,
    /// Repetitions of each resume (the best is reported; the recompute runs once).
    #[arg(short, long, default_value_t = 3)]
    reps: usize,
    /// Prompt chunk per forward pass (the engine's default prefill chunk).
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Scratch directory for the pack stores (default: the system temporary directory).
    #[arg(long)]
    scratch: Option<PathBuf>,
    /// JSON receipt to write.
    #[arg(short, long)]
    output: Option<PathBuf>,
}

struct Row {
    model: String,
    tokens: u32,
    kv_bytes: u64,
    pack_bytes: u64,
    recompute_s: f64,
    publish_s: f64,
    memory_s: f64,
    disk_warm_s: f64,
    disk_cold_s: f64,
    delta_fraction: f64,
    delta_base: u32,
}

/// Runs `tokens` from position 0 through the model in chunks; no logits.
fn prefill(model: &Model, kv: &mut KvCache, tokens: &[u32], chunk: usize) -> anyhow::Result<()> {
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let mut b = Batch::default();
        for (k, &t) in c.iter().enumerate() {
            b.push(t, (i * chunk + k) as u32, 0, false);
        }
        model.forward(kv, &b)?;
    }
    Ok(())
}

/// Logits of `token` at position `pos` (the cache holds `0..pos`).
fn next_logits(model: &Model, kv: &mut KvCache, token: u32, pos: u32) -> anyhow::Result<Vec<f32>> {
    let out = model.forward(kv, &Batch::single(0, &[token], pos, true))?;
    Ok(out.row(0, model.info().n_vocab).to_vec())
}

/// Drops the page-cache pages of every file under `dir` (best effort).
fn drop_pages(dir: &Path) {
    use std::os::unix::io::AsRawFd;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        if let Ok(f) = std::fs::File::open(e.path()) {
            // SAFETY: a valid descriptor; the call only advises the kernel.
            unsafe {
                libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
            }
        }
    }
}

/// Resumes `prompt[..n]` through `pc` into a cleared `kv` (as the scheduler does); returns
/// the seconds taken and the tier.
fn resume(
    pc: &PromptCache,
    kv: &mut KvCache,
    prompt: &[u32],
    n: u32,
) -> anyhow::Result<(f64, Tier)> {
    let t = Instant::now();
    let r = pc
        .resume(prompt, n as usize, 0)
        .context("the prompt cache did not resume the prefix")?;
    ensure!(
        r.state.positions == (0..n),
        "resumed {:?}",
        r.state.positions
    );
    let snap = state_to_snapshot(r.state, kv.layout())?;
    kv.clear(0);
    kv.import(0, &snap)?;
    Ok((t.elapsed().as_secs_f64(), r.tier))
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn measure(model: &Model, path: &Path, n: u32, args: &Args, scratch: &Path) -> anyhow::Result<Row> {
    let n_vocab = model.info().n_vocab;
    let prompt = muser_model::synth::random_tokens(n as usize + 1, n_vocab, 0x5eed ^ u64::from(n));
    let n_ctx = n as usize + 1;
    let mk = || model.new_kv_ubatch(n_ctx, 1, KvType::F16, args.chunk as u32);

    eprintln!("  {n} tokens: recomputing the prefix ...");
    let mut kv = mk()?;
    let t = Instant::now();
    prefill(model, &mut kv, &prompt[..n as usize], args.chunk)?;
    let recompute_s = t.elapsed().as_secs_f64();
    let state = snapshot_to_state(kv.export(0, 0..n)?);
    let kv_bytes = state.total_bytes();
    let want = next_logits(model, &mut kv, prompt[n as usize], n)?;
    drop(kv);

    let key: [u8; 32] = std::array::from_fn(|i| (i as u8).wrapping_mul(37) ^ 0xa5);
    let ctx = Arc::new(KvPackContext::new(
        model,
        Some(path),
        KvType::F16,
        Keys::derive(&key),
    )?);
    let budget = 4 * kv_bytes + (1 << 30);
    let open = |name: &str, memory: u64| -> anyhow::Result<PromptCache> {
        let dir = scratch.join(name);
        let _ = std::fs::remove_dir_all(&dir);
        let mut cfg = PromptCacheConfig::new(&dir);
        cfg.disk_budget_bytes = budget;
        cfg.memory_budget_bytes = memory;
        Ok(PromptCache::open(ctx.clone(), &cfg)?.0)
    };
    let check = |kv: &mut KvCache, what: &str| -> anyhow::Result<()> {
        let got = next_logits(model, kv, prompt[n as usize], n)?;
        if got
            .iter()
            .map(|x| x.to_bits())
            .ne(want.iter().map(|x| x.to_bits()))
        {
            bail!("{what}: the logits after the resume differ from the recomputed ones");
        }
        kv.truncate(0, n);
        Ok(())
    };

    // disk: no memory tier
    let disk = open("disk", 0)?;
    let t = Instant::now();
    disk.offer(prompt[..n as usize].to_vec(), state.clone());
    disk.flush();
    let publish_s = t.elapsed().as_secs_f64();
    let st = disk.stats();
    ensure!(st.published == 1, "publishing failed: {st:?}");
    let pack_bytes = st.disk_bytes;
    let mut kv = mk()?;
    let (mut warm, mut cold) = (Vec::new(), Vec::new());
    for _ in 0..args.reps {
        let (s, tier) = resume(&disk, &mut kv, &prompt, n)?;
        ensure!(tier == Tier::Disk);
        warm.push(s);
    }
    check(&mut kv, "disk")?;
    for _ in 0..args.reps {
        drop_pages(&scratch.join("disk/packs"));
        let (s, _) = resume(&disk, &mut kv, &prompt, n)?;
        cold.push(s);
    }
    check(&mut kv, "disk (cold)")?;
    drop(disk);

    // memory: the resident radix holds the blocks
    let mem = open("memory", budget)?;
    mem.offer(prompt[..n as usize].to_vec(), state.clone());
    mem.flush();
    let mut memory = Vec::new();
    for _ in 0..args.reps {
        let (s, tier) = resume(&mem, &mut kv, &prompt, n)?;
        ensure!(tier == Tier::Memory, "expected a memory hit");
        memory.push(s);
    }
    check(&mut kv, "memory")?;
    drop(mem);

    // delta against a receiver holding the first half (block-aligned)
    let chain = ctx.hasher.chain(&prompt[..n as usize]);
    let half = (n / 2 / BLOCK_TOKENS) * BLOCK_TOKENS;
    let plan = |base: u32| -> anyhow::Result<u64> {
        let spec = PackSpec {
            identity: &ctx.identity,
            chain: &chain,
            generation: 1,
            stream: None,
            base_tokens: base,
            plan: SegmentPlan::default(),
            threads: muser_kvpack::default_threads(),
        };
        let delta_state;
        let s = if base == 0 {
            &state
        } else {
            // what a delta carries: the state from `base` on
            let mut kv = mk()?;
            kv.import(0, &state_to_snapshot(state.clone(), kv.layout())?)?;
            delta_state = snapshot_to_state(kv.export(0, base..n)?);
            &delta_state
        };
        Ok(PackPlan::new(s, &ctx.keys, &spec)?.file_len())
    };
    let delta_fraction = plan(half)? as f64 / plan(0)? as f64;
    let _ = std::fs::remove_dir_all(scratch.join("disk"));
    let _ = std::fs::remove_dir_all(scratch.join("memory"));

    Ok(Row {
        model: path
            .file_name()
            .map(|f| f.to_string_lossy().trim_end_matches(".gguf").to_string())
            .unwrap_or_default(),
        tokens: n,
        kv_bytes,
        pack_bytes,
        recompute_s,
        publish_s,
        memory_s: best(&memory),
        disk_warm_s: best(&warm),
        disk_cold_s: best(&cold),
        delta_fraction,
        delta_base: half,
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let scratch = args
        .scratch
        .clone()
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("muser-bench-resume-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let mut rows = Vec::new();
    for path in &args.model {
        let model = Model::load(
            path,
            &LoadOptions {
                threads: args.threads,
                ..Default::default()
            },
        )
        .with_context(|| format!("loading {}", path.display()))?;
        let n_train = model.info().n_ctx_train;
        eprintln!("{} (context {n_train})", path.display());
        let mut sizes: Vec<u32> = args
            .tokens
            .iter()
            .map(|&n| {
                if n_train > 0 && n >= n_train {
                    ((n_train - 1) / BLOCK_TOKENS) * BLOCK_TOKENS
                } else {
                    n
                }
            })
            .filter(|&n| n >= BLOCK_TOKENS)
            .collect();
        sizes.dedup();
        for n in sizes {
            let row = measure(&model, path, n, &args, &scratch)?;
            eprintln!("{}", table_row(&row));
            rows.push(row);
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    println!("{}", table(&rows));
    if let Some(out) = &args.output {
        std::fs::write(out, receipt(&args, &rows))?;
        eprintln!("receipt: {}", out.display());
    }
    Ok(())
}

fn ms(s: f64) -> String {
    if s >= 10.0 {
        format!("{:.1} s", s)
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

fn table_row(r: &Row) -> String {
    format!(
        "| {} | {} | {:.0} | {} | {} | {} | {} | {} | {:.0}× / {:.0}× | {:.3} |",
        r.model,
        r.tokens,
        r.pack_bytes as f64 / f64::from(r.tokens),
        ms(r.recompute_s),
        ms(r.memory_s),
        ms(r.disk_warm_s),
        ms(r.disk_cold_s),
        ms(r.publish_s),
        r.recompute_s / r.memory_s,
        r.recompute_s / r.disk_cold_s,
        r.delta_fraction,
    )
}

fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| model | tokens | pack bytes/token | recompute | resume (memory) | resume (disk, warm) | resume (disk, cold) | publish | speed-up memory / disk cold | delta/full, half held |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(s, "{}", table_row(r));
    }
    s
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn first_line(path: &str, prefix: &str) -> String {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(prefix))
                .map(|l| l.split(':').nth(1).unwrap_or(l).trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn receipt(args: &Args, rows: &[Row]) -> String {
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or("unknown".into(), |o| {
            String::from_utf8_lossy(&o.stdout).trim().to_string()
        });
    let models: Vec<String> = args
        .model
        .iter()
        .map(|m| {
            format!(
                "-m $MUSER_MODELS/{}",
                m.file_name().unwrap_or_default().to_string_lossy()
            )
        })
        .collect();
    let command = format!(
        "muser bench-resume {} --tokens {} -t {} -r {} -o docs/receipts/kvpack-resume.json",
        models.join(" "),
        args.tokens
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
        args.threads,
        args.reps
    );
    let mut s = String::from("{\n");
    let _ = writeln!(s, "  \"bench\": \"kvpack-resume\",");
    let _ = writeln!(s, "  \"command\": {},", json_str(&command));
    let _ = writeln!(s, "  \"commit\": {},", json_str(&commit));
    let _ = writeln!(
        s,
        "  \"machine\": {{\"cpu\": {}, \"logical_cpus\": {}}},",
        json_str(&first_line("/proc/cpuinfo", "model name")),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let _ = writeln!(s, "  \"load_average_at_end\": {},", json_str(load.trim()));
    let _ = writeln!(
        s,
        "  \"settings\": {{\"threads\": {}, \"reps\": {}, \"chunk\": {}, \"kv_type\": \"f16\"}},",
        args.threads, args.reps, args.chunk
    );
    let _ = writeln!(
        s,
        "  \"notes\": \"recompute: forward passes over the prefix in chunks, once. resume: PromptCache::resume (memory: resident radix; disk: PackStore restore with full verification) plus the import into a cleared KV cache, best of reps; disk cold: the pack's pages dropped with posix_fadvise before each rep. Each resume checked: next-token logits bit-identical to the recomputed ones. publish: seal, write, fsync, ledger, rename. delta_fraction: delta pack bytes over full pack bytes with the first half (block-aligned) held.\","
    );
    s.push_str("  \"rows\": [\n");
    for (i, r) in rows.iter().enumerate() {
        let _ = write!(
            s,
            "    {{\"model\": {}, \"tokens\": {}, \"kv_bytes\": {}, \"pack_bytes\": {}, \"pack_bytes_per_token\": {:.1}, \"recompute_s\": {:.6}, \"resume_memory_s\": {:.6}, \"resume_disk_warm_s\": {:.6}, \"resume_disk_cold_s\": {:.6}, \"publish_s\": {:.6}, \"speedup_memory\": {:.1}, \"speedup_disk_cold\": {:.1}, \"delta_base_tokens\": {}, \"delta_fraction\": {:.4}, \"logits_bit_identical\": true}}",
            json_str(&r.model),
            r.tokens,
            r.kv_bytes,
            r.pack_bytes,
            r.pack_bytes as f64 / f64::from(r.tokens),
            r.recompute_s,
            r.memory_s,
            r.disk_warm_s,
            r.disk_cold_s,
            r.publish_s,
            r.recompute_s / r.memory_s,
            r.recompute_s / r.disk_cold_s,
            r.delta_base,
            r.delta_fraction,
        );
        s.push_str(if i + 1 < rows.len() { ",\n" } else { "\n" });
    }
    s.push_str("  ]\n}\n");
    s
}
