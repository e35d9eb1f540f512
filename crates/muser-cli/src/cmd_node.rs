//! `muser node add | list | status | remove`: the producers a consumer enrolled
//! (docs/nodes.md). `add` runs the enrollment steps of muser-server's `onboard` with this
//! consumer's model; the others read and change the registry (`nodes.toml`) and probe the
//! nodes over the lane.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use muser_cluster::enroll::EnrollCode;
use muser_cluster::registry::{FailureLog, NodeEntry, Registry};
use muser_cluster::{LaneClient, Pki};
use muser_server::kvkey;
use muser_server::lane::{ConsumerConfig, LaneRole, LaneSetup, PrefillMode};
use muser_server::onboard::{Onboarding, Step};
use muser_server::server::{self, ServeConfig};
use muser_store as store;

#[derive(clap::Args)]
pub struct Args {
    /// Configuration directory (default: $MUSER_CONFIG_DIR, else ~/.config/muser).
    #[arg(long, global = true, value_name = "DIR")]
    config_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Enroll producer NAME at https://HOST:PORT with the code it printed: preflight, model
    /// verification, key enrollment, one verified handoff; recorded only when all pass.
    Add(AddArgs),
    /// Every enrolled node: address, device, engine ABI, health now, last handoff rate.
    List,
    /// One node's record, its status now and its recent failures (enrollment steps, probes
    /// and prefills of a running consumer).
    Status { name: String },
    /// Remote against local prefill, `--reps` times at each of `--sizes` tokens: identical
    /// tokens, TTFT both ways, payload rate; writes a JSON receipt.
    Qualify(QualifyArgs),
    /// Revoke NAME's certificates and forget it.
    Remove { name: String },
}

#[derive(clap::Args)]
struct AddArgs {
    name: String,
    /// The node's address, https://HOST:PORT.
    url: String,
    /// The one-time code the node printed (else --code-file, else read from stdin).
    #[arg(long, conflicts_with = "code_file")]
    code: Option<String>,
    /// Read the code from the first line of this file.
    #[arg(long, value_name = "FILE")]
    code_file: Option<PathBuf>,
    /// This consumer's certificate name (default: the registry's, else `consumer`).
    #[arg(long = "as", value_name = "NAME")]
    consumer: Option<String>,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(clap::Args)]
struct QualifyArgs {
    name: String,
    /// Prompt lengths in tokens (the node and this consumer need a context above the largest).
    #[arg(long, value_delimiter = ',', default_values_t = [2048, 8000])]
    sizes: Vec<usize>,
    /// Trials at each length.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    reps: u32,
    /// The receipt (default: CONFIG/qualify/NAME-UNIXTIME.json).
    #[arg(short, long)]
    output: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
}

/// The consumer's engine for a handoff or a qualification: its model and operator key.
#[derive(clap::Args)]
struct EngineArgs {
    /// The consumer's model (default: the model store's default model, as `muser up`).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// kvpack operator key file (default: `kv.key` in the model store, as `muser up`).
    #[arg(long)]
    kv_key_file: Option<PathBuf>,
    /// Accept the node's engine ABI besides this engine's own (as `muser up --accept-abi`).
    #[arg(long, value_name = "ABI")]
    accept_abi: Vec<String>,
    /// Compute threads.
    #[arg(short, long)]
    threads: Option<usize>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let config = crate::cmd_tls::config_dir(args.config_dir)?;
    match args.command {
        Command::Add(a) => add(&config, a),
        Command::List => list(&config),
        Command::Status { name } => status(&config, &name),
        Command::Qualify(a) => qualify(&config, a),
        Command::Remove { name } => remove(&config, &name),
    }
}

fn read_code(a: &AddArgs) -> anyhow::Result<EnrollCode> {
    let text = match (&a.code, &a.code_file) {
        (Some(c), _) => c.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("--code-file {}", f.display()))?
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
        (None, None) => {
            if std::io::stdin().is_terminal() {
                eprint!("enrollment code: ");
                std::io::stderr().flush()?;
            }
            let mut line = String::new();
            std::io::Read::take(std::io::stdin().lock(), 256).read_line(&mut line)?;
            line
        }
    };
    Ok(EnrollCode::parse(&text)?)
}

/// The consumer side of onboarding over this consumer's model, with a context of `n_ctx`.
fn onboarding(
    config: &Path,
    consumer: String,
    a: &EngineArgs,
    n_ctx: usize,
) -> anyhow::Result<(Onboarding, PathBuf)> {
    let model_path = store::model_path(a.model.as_deref())?;
    let mut cfg = ServeConfig::new(&model_path);
    cfg.n_slots = 1;
    cfg.n_ctx = n_ctx;
    cfg.kv_key_file = a.kv_key_file.clone();
    if let Some(t) = a.threads {
        cfg.threads = t.max(1);
    }
    // a lane of no producers: the consumer's identity and kvpack context
    cfg.lane = Some(LaneSetup {
        config_dir: config.to_path_buf(),
        node: consumer.clone(),
        role: LaneRole::Consumer(ConsumerConfig {
            mode: PrefillMode::Local,
            producers: Vec::new(),
            min_tokens: Some(0),
            deadline: Duration::from_secs(60),
            accept_abis: a.accept_abi.clone(),
            migrate_to: Vec::new(),
        }),
        listen: None,
    });
    eprintln!("muser: loading {}", model_path.display());
    let app = server::load(&cfg)?;
    let key = kvkey::load_or_create(a.kv_key_file.as_deref()).map_err(anyhow::Error::msg)?;
    let onboarding = Onboarding {
        app,
        config_dir: config.to_path_buf(),
        consumer,
        operator_key_hex: hex::encode(key),
        accept_abis: a.accept_abi.clone(),
    };
    Ok((onboarding, model_path))
}

fn add(config: &Path, a: AddArgs) -> anyhow::Result<()> {
    let code = read_code(&a)?;
    let consumer = muser_server::onboard::consumer_identity(config, a.consumer.clone())?;
    let (onboarding, _) = onboarding(config, consumer, &a.engine, 2048)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut progress = |step: Step, what: &str| println!("{:<10} {what}", step.name());
    let r = runtime.block_on(onboarding.add(&a.name, &a.url, &code, &mut progress));
    match r {
        Ok(entry) => {
            println!("node `{}` enrolled: healthy", entry.name);
            Ok(())
        }
        Err(e) => {
            println!("{:<10} FAILED: {}", e.step.name(), e.message);
            anyhow::bail!("node `{}` not enrolled: {e}", a.name)
        }
    }
}

/// The lane client of this consumer, for probing its nodes.
fn client(config: &Path, reg: &Registry) -> anyhow::Result<LaneClient> {
    let name = reg
        .consumer
        .as_deref()
        .context("no node is enrolled here (muser node add)")?;
    let creds = muser_cluster::enroll::node_creds(config, name)?;
    Ok(LaneClient::new(muser_cluster::client_config(&creds)?))
}

/// `healthy (queue N, R tok/s)` or `down: why`, from one bounded status probe.
async fn probe(client: &LaneClient, n: &NodeEntry) -> (bool, String) {
    let ep = match n.endpoint() {
        Ok(ep) => ep,
        Err(e) => return (false, e.to_string()),
    };
    match muser_server::lane::probe(client, &ep, Duration::from_secs(3)).await {
        Ok(s) if s.engine_abi != n.engine_abi => (
            false,
            format!(
                "degraded: engine ABI changed from {} to {}",
                n.engine_abi, s.engine_abi
            ),
        ),
        Ok(s) => (
            true,
            format!(
                "healthy (queue {}, {:.0} tok/s)",
                s.queue_depth, s.prefill_tok_s
            ),
        ),
        Err(e) => (false, format!("down: {e}")),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn list(config: &Path) -> anyhow::Result<()> {
    let reg = Registry::load(config)?;
    if reg.nodes.is_empty() {
        println!("no node is enrolled (muser node add NAME https://HOST:PORT --code CODE)");
        return Ok(());
    }
    let client = client(config, &reg)?;
    let rt = runtime()?;
    println!(
        "{:<16} {:<28} {:<6} {:<10} {:<10} HEALTH",
        "NAME", "ADDRESS", "DEVICE", "MODEL", "HANDOFF"
    );
    for n in &reg.nodes {
        let (_, health) = rt.block_on(probe(&client, n));
        let rate = n
            .handoff
            .map_or_else(|| "-".into(), |h| rate_text(h.gb_per_s()));
        println!(
            "{:<16} {:<28} {:<6} {:<10} {:<10} {health}",
            n.name,
            n.url,
            n.device,
            &n.model_weights[..n.model_weights.len().min(8)],
            rate
        );
    }
    Ok(())
}

fn status(config: &Path, name: &str) -> anyhow::Result<()> {
    muser_cluster::check_name(name)?;
    let reg = Registry::load(config)?;
    let failures = FailureLog::at(config, name).load()?;
    let Some(n) = reg.get(name) else {
        print_failures(&failures);
        anyhow::bail!("node `{name}` is not enrolled (see `muser node list`)");
    };
    let (_, health) = runtime()?.block_on(probe(&client(config, &reg)?, n));
    println!("name:          {}", n.name);
    println!("address:       {}", n.url);
    println!("device:        {}", n.device);
    println!("engine ABI:    {}", n.engine_abi);
    println!("model weights: {}", n.model_weights);
    println!("enrolled:      unix {}", n.enrolled_unix);
    if let Some(h) = n.handoff {
        println!(
            "last handoff:  {} tokens, {} KiB in {:.1} ms ({})",
            h.tokens,
            h.kv_bytes >> 10,
            h.ms,
            rate_text(h.gb_per_s())
        );
    }
    println!("now:           {health}");
    print_failures(&failures);
    Ok(())
}

/// A handoff's payload rate: GB/s, or MB/s below 1 GB/s (a CPU node's handoff time is
/// mostly its prefill).
fn rate_text(gb_per_s: f64) -> String {
    if gb_per_s >= 1.0 {
        format!("{gb_per_s:.2} GB/s")
    } else {
        format!("{:.1} MB/s", gb_per_s * 1e3)
    }
}

/// A node's recent failures, newest first, with their UTC time.
fn print_failures(failures: &[muser_cluster::registry::Failure]) {
    if failures.is_empty() {
        println!("failures:      none recorded");
        return;
    }
    println!("failures:      {} recent, newest first", failures.len());
    for f in failures.iter().rev() {
        let at = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(f.unix_ms) * 1_000_000)
            .map(|t| {
                format!(
                    "{:04}-{:02}-{:02} {:02}:{:02}:{:02}Z",
                    t.year(),
                    u8::from(t.month()),
                    t.day(),
                    t.hour(),
                    t.minute(),
                    t.second()
                )
            })
            .unwrap_or_else(|_| format!("unix ms {}", f.unix_ms));
        println!("  {at}  {:<16} {}", f.what, f.why);
    }
}

fn qualify(config: &Path, a: QualifyArgs) -> anyhow::Result<()> {
    let mut reg = Registry::load(config)?;
    let entry = reg
        .get(&a.name)
        .cloned()
        .with_context(|| format!("node `{}` is not enrolled (see `muser node list`)", a.name))?;
    let consumer = reg
        .consumer
        .clone()
        .context("the registry names no consumer")?;
    let largest = a.sizes.iter().copied().max().unwrap_or(0);
    anyhow::ensure!(
        a.sizes.iter().all(|&n| n > 512),
        "--sizes: every prompt needs more than one 512-token chunk to cross the lane"
    );
    let (onboarding, model_path) =
        onboarding(config, consumer, &a.engine, (largest + 64).max(2048))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let trials = rt
        .block_on(onboarding.qualify(&entry.endpoint()?, &a.sizes, a.reps))
        .map_err(|e| anyhow::anyhow!("qualify {}: {e}", a.name))?;
    println!(
        "{:>7} {:>4} {:>12} {:>12} {:>10} {:>9}  tokens",
        "tokens", "rep", "local ttft", "remote ttft", "handoff", "GB/s"
    );
    let mut runs = Vec::new();
    for (i, (n, t)) in trials.iter().enumerate() {
        let rep = i as u32 % a.reps;
        println!(
            "{n:>7} {rep:>4} {:>9.1} ms {:>9.1} ms {:>7.1} ms {:>9.3}  {}",
            t.local_ttft_ms,
            t.remote_ttft_ms,
            t.handoff.ms,
            t.handoff.gb_per_s(),
            if t.identical() { "identical" } else { "DIFFER" }
        );
        runs.push(serde_json::json!({
            "tokens": n,
            "rep": rep,
            "local_ttft_ms": t.local_ttft_ms,
            "remote_ttft_ms": t.remote_ttft_ms,
            "handoff_ms": t.handoff.ms,
            "kv_bytes": t.handoff.kv_bytes,
            "gb_per_s": t.handoff.gb_per_s(),
            "tokens_identical": t.identical(),
        }));
    }
    let identical = trials.iter().all(|(_, t)| t.identical());
    let receipt = serde_json::json!({
        "tool": "muser node qualify",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "git_commit": crate::cmd_bench::git_commit(),
        "machine": {
            "cpu": crate::cmd_bench::cpu_model(),
            "logical_cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
        },
        "model": model_path.file_name().map(|f| f.to_string_lossy().into_owned()),
        "node": {
            "name": entry.name,
            "url": entry.url,
            "device": entry.device,
            "engine_abi": entry.engine_abi,
        },
        "reps": a.reps,
        "runs": runs,
        "tokens_identical": identical,
    });
    let path = match a.output {
        Some(p) => p,
        None => {
            let dir = config.join("qualify");
            std::fs::create_dir_all(&dir)?;
            let unix = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            dir.join(format!("{}-{unix}.json", a.name))
        }
    };
    std::fs::write(&path, serde_json::to_string_pretty(&receipt)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    println!("receipt: {}", path.display());
    if let (Some((_, last)), Some(e)) = (
        trials.last(),
        reg.nodes.iter_mut().find(|e| e.name == a.name),
    ) {
        e.handoff = Some(last.handoff);
        reg.save(config)?;
    }
    anyhow::ensure!(
        identical,
        "node `{}`: remote and local tokens differ",
        a.name
    );
    Ok(())
}

fn remove(config: &Path, name: &str) -> anyhow::Result<()> {
    let mut reg = Registry::load(config)?;
    anyhow::ensure!(
        reg.get(name).is_some(),
        "node `{name}` is not enrolled (see `muser node list`)"
    );
    let revoked = Pki::at(config).revoke(name)?;
    reg.remove(name);
    reg.save(config)?;
    FailureLog::at(config, name).clear()?;
    println!("node `{name}` removed: {revoked} certificate(s) revoked");
    Ok(())
}
