//! `muser node add | list | status | remove`: the producers a consumer enrolled
//! (docs/nodes.md). `add` runs the enrollment steps of muser-server's `onboard` with this
//! consumer's model; the others read and change the registry (`nodes.toml`) and probe the
//! nodes over the lane.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use muser_cluster::enroll::EnrollCode;
use muser_cluster::registry::{NodeEntry, Registry};
use muser_cluster::{LaneClient, Pki};
use muser_server::lane::{ConsumerConfig, LaneRole, LaneSetup, PrefillMode};
use muser_server::onboard::{Onboarding, Step};
use muser_server::server::{self, ServeConfig};
use muser_server::{kvkey, store};

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
    /// One node's record and its status now.
    Status { name: String },
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
    /// The consumer's model (default: the model store's default model, as `muser up`).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// kvpack operator key file (default: `kv.key` in the model store, as `muser up`).
    #[arg(long)]
    kv_key_file: Option<PathBuf>,
    /// Accept the node's engine ABI besides this engine's own (as `muser up --accept-abi`).
    #[arg(long, value_name = "ABI")]
    accept_abi: Vec<String>,
    /// Compute threads for the handoff check.
    #[arg(short, long)]
    threads: Option<usize>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let config = crate::cmd_tls::config_dir(args.config_dir)?;
    match args.command {
        Command::Add(a) => add(&config, a),
        Command::List => list(&config),
        Command::Status { name } => status(&config, &name),
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

/// This consumer's name and certificate: the CA and the certificate are created on first use.
fn consumer_identity(config: &Path, flag: Option<String>) -> anyhow::Result<String> {
    let registry = Registry::load(config)?;
    let name = match (flag, registry.consumer) {
        (Some(f), Some(r)) if f != r => anyhow::bail!(
            "this consumer enrolled its nodes as `{r}`; `--as {f}` would split the lane"
        ),
        (f, r) => f.or(r).unwrap_or_else(|| "consumer".into()),
    };
    muser_cluster::check_name(&name)?;
    let pki = Pki::at(config);
    if !pki.dir().join("ca.key").exists() {
        pki.init()?;
        eprintln!("muser: created the lane CA in {}", pki.dir().display());
    }
    if pki.node(&name).is_err() {
        let now = time::OffsetDateTime::now_utc() - time::Duration::minutes(1);
        pki.issue(&name, now, 365)?;
        eprintln!("muser: issued this consumer's certificate `{name}`");
    }
    Ok(name)
}

fn add(config: &Path, a: AddArgs) -> anyhow::Result<()> {
    let code = read_code(&a)?;
    let consumer = consumer_identity(config, a.consumer.clone())?;
    let model_path = match &a.model {
        Some(p) => p.clone(),
        None => store::ensure(&store::DEFAULT_MODEL, &store::default_store_dir()?)?,
    };
    let mut cfg = ServeConfig::new(&model_path);
    cfg.n_slots = 1;
    cfg.n_ctx = 2048;
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
            min_tokens: 0,
            deadline: Duration::from_secs(60),
            accept_abis: a.accept_abi.clone(),
        }),
    });
    eprintln!("muser: loading {}", model_path.display());
    let app = server::load(&cfg)?;
    let key = kvkey::load_or_create(a.kv_key_file.as_deref()).map_err(anyhow::Error::msg)?;
    let onboarding = Onboarding {
        app,
        config_dir: config.to_path_buf(),
        consumer,
        operator_key_hex: hex::encode(key),
        accept_abis: a.accept_abi,
    };
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
            .map_or_else(|| "-".into(), |h| format!("{:.2} GB/s", h.gb_per_s()));
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
    let reg = Registry::load(config)?;
    let n = reg
        .get(name)
        .with_context(|| format!("node `{name}` is not enrolled (see `muser node list`)"))?;
    let (_, health) = runtime()?.block_on(probe(&client(config, &reg)?, n));
    println!("name:          {}", n.name);
    println!("address:       {}", n.url);
    println!("device:        {}", n.device);
    println!("engine ABI:    {}", n.engine_abi);
    println!("model weights: {}", n.model_weights);
    println!("enrolled:      unix {}", n.enrolled_unix);
    if let Some(h) = n.handoff {
        println!(
            "last handoff:  {} tokens, {} KiB in {:.1} ms ({:.2} GB/s)",
            h.tokens,
            h.kv_bytes >> 10,
            h.ms,
            h.gb_per_s()
        );
    }
    println!("now:           {health}");
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
    println!("node `{name}` removed: {revoked} certificate(s) revoked");
    Ok(())
}
