//! `muser up`: serve the OpenAI-, llama.cpp- and Ollama-compatible HTTP APIs. Without
//! `--model` it fetches the default model (SHA-256 pinned) into the model store first.
//! Progress goes to stderr; stdout gets exactly one line, once the server is listening.

use crate::device::{self, Device};
use anyhow::Context;
use muser_cluster::Endpoint;
use muser_model::LoadOptions;
use muser_server::lane::{ConsumerConfig, LaneRole, LaneSetup, PrefillMode};
use muser_server::server::{self, ServeConfig};
use muser_server::store;
use muser_server::{auth, http};
use std::io::{IsTerminal, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model to serve (default: SmolLM2-135M-Instruct Q4_1, fetched into the model store).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Address to listen on. A non-loopback address needs an API key and TLS (or
    /// --insecure-public).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, default_value_t = 4949)]
    port: u16,
    /// Concurrent generations, each with its own KV cache of --ctx-size tokens (default 4;
    /// llama-server's `-np/--parallel N` too). A bare `--slots` (llama-server's switch for
    /// `GET /slots`, on by default here) changes nothing.
    #[arg(long, value_name = "N", num_args = 0..=1)]
    slots: Option<Option<usize>>,
    #[arg(long, value_name = "N", hide = true)]
    parallel: Option<usize>,
    /// Context per slot, in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    ctx_size: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health, the key read from the
    /// first line of this file (or from the MUSER_API_KEY environment variable).
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<PathBuf>,
    /// The API key on the command line (visible to every local user: prefer --api-key-file
    /// or MUSER_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// Serve HTTPS: the certificate chain (PEM, leaf first).
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Serve HTTPS: the certificate's private key (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// A host name (or address) clients may reach this server by, besides localhost and the
    /// loopback addresses; without an API key other `Host` headers are refused (403), which
    /// stops DNS-rebinding pages. Repeatable.
    #[arg(long, value_name = "NAME")]
    allow_host: Vec<String>,
    /// Directory for /slots/{id}?action=save|restore files.
    #[arg(long)]
    slot_save_path: Option<PathBuf>,
    /// Most MiB the files under --slot-save-path may take together (a save past it is 507).
    #[arg(long, value_name = "MIB", default_value_t = 4096)]
    slot_save_quota_mib: u64,
    /// kvpack operator key (32 raw bytes or 64 hex digits) sealing slot files and prompt-cache
    /// packs; default: a key generated on first use in the model store.
    #[arg(long)]
    kv_key_file: Option<PathBuf>,
    /// Prompt cache across requests and restarts: prompts' K/V are kept as sealed kvpack packs
    /// in this directory (and in memory), and a prompt sharing a cached prefix (256-token
    /// blocks) resumes it instead of recomputing it.
    #[arg(long, value_name = "DIR")]
    prompt_cache: Option<PathBuf>,
    /// Disk budget of --prompt-cache, in MiB (least recently used packs are evicted).
    #[arg(long, value_name = "MIB", default_value_t = 4096)]
    prompt_cache_disk_mib: u64,
    /// Memory budget of --prompt-cache, in MiB (0: disk only).
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    prompt_cache_ram_mib: u64,
    /// Session bundles (`/v1/sessions`): a slot's conversation and exact K/V, encrypted with a
    /// key derived from the operator key; default: `sessions` beside the model store.
    #[arg(long, value_name = "DIR")]
    session_dir: Option<PathBuf>,
    /// Allow a non-loopback bind without an API key or without TLS.
    #[arg(long, alias = "force-insecure")]
    insecure_public: bool,
    /// Compute threads (default: all cores).
    #[arg(short, long)]
    threads: Option<usize>,
    /// Where the model runs: cpu; cuda (muse-glimmer through the fused forward, others op by
    /// op); cuda-ops (always op by op). CUDA needs a muser built with `--features cuda`.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    #[command(flatten)]
    numerics: device::NumericsArgs,
    /// Requests allowed to wait for a slot before the server answers 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    #[command(flatten)]
    lane: LaneArgs,
    #[command(flatten)]
    llama: crate::llama_flags::LlamaArgs,
}

/// The disaggregated prefill lane (docs/disaggregated-prefill.md).
#[derive(clap::Args)]
struct LaneArgs {
    /// consumer: the HTTP APIs, prefilling here or on --producer nodes; producer: the
    /// prefill endpoint over mutual TLS for the --consumer nodes, no HTTP API.
    #[arg(long, value_enum, default_value_t = Role::Consumer)]
    role: Role,
    /// This node's certificate name (`muser tls issue NAME`); needed by a producer and by a
    /// consumer with --producer.
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
    /// Configuration directory holding tls/ and the lane ledger (default: $MUSER_CONFIG_DIR,
    /// else ~/.config/muser).
    #[arg(long, value_name = "DIR")]
    config_dir: Option<PathBuf>,
    /// Where prompts are prefilled: local; remote (always on a producer, failing the request
    /// when none answers); auto (on a producer from --remote-min-tokens, local on any
    /// producer failure).
    #[arg(long, value_enum, default_value_t = Prefill::Local)]
    prefill: Prefill,
    /// A producer, NAME=https://HOST:PORT (NAME: its certificate name); repeatable.
    #[arg(long, value_name = "NAME=URL")]
    producer: Vec<String>,
    /// With --prefill auto, prompts of at least this many tokens go to a producer.
    #[arg(long, default_value_t = 1024)]
    remote_min_tokens: usize,
    /// Longest a remote prefill may take, request to last byte, in milliseconds.
    #[arg(long, default_value_t = 120_000)]
    prefill_deadline_ms: u64,
    /// Another engine ABI to accept packs from (a producer with other numerics); repeatable.
    #[arg(long, value_name = "ABI")]
    accept_abi: Vec<String>,
    /// Producer: a consumer node name it serves; repeatable (others are refused).
    #[arg(long, value_name = "NAME")]
    consumer: Vec<String>,
    /// Producer: prefills allowed to wait beyond the slots before it answers 429.
    #[arg(long, default_value_t = 16)]
    lane_queue: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Role {
    Consumer,
    Producer,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Prefill {
    Local,
    Remote,
    Auto,
}

impl LaneArgs {
    /// The lane setup these flags ask for (`None`: a plain server).
    fn setup(self) -> anyhow::Result<Option<LaneSetup>> {
        let wants = self.role == Role::Producer
            || self.prefill != Prefill::Local
            || !self.producer.is_empty();
        if !wants {
            return Ok(None);
        }
        let node = self
            .name
            .context("the prefill lane needs this node's certificate name: --name NAME")?;
        let role = match self.role {
            Role::Producer => {
                anyhow::ensure!(
                    !self.consumer.is_empty(),
                    "a producer serves only enrolled consumers: give at least one --consumer NAME"
                );
                for c in &self.consumer {
                    muser_cluster::check_name(c)?;
                }
                LaneRole::Producer {
                    consumers: self.consumer,
                    max_queue: self.lane_queue,
                }
            }
            Role::Consumer => LaneRole::Consumer(ConsumerConfig {
                mode: match self.prefill {
                    Prefill::Local => PrefillMode::Local,
                    Prefill::Remote => PrefillMode::Remote,
                    Prefill::Auto => PrefillMode::Auto,
                },
                producers: self
                    .producer
                    .iter()
                    .map(|p| Endpoint::parse(p))
                    .collect::<Result<_, _>>()?,
                min_tokens: self.remote_min_tokens,
                deadline: Duration::from_millis(self.prefill_deadline_ms.max(1)),
                accept_abis: self.accept_abi,
            }),
        };
        Ok(Some(LaneSetup {
            config_dir: crate::cmd_tls::config_dir(self.config_dir)?,
            node,
            role,
        }))
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    if args.api_key.is_some() {
        eprintln!("muser: warning: --api-key puts the key in the process list for every local user; prefer --api-key-file or MUSER_API_KEY");
    }
    let api_key = auth::load_api_key(
        args.api_key_file.as_deref(),
        std::env::var("MUSER_API_KEY").ok(),
        args.api_key,
    )
    .map_err(anyhow::Error::msg)?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(http::tls_config(cert, key).map_err(anyhow::Error::msg)?),
        _ => None,
    };
    let lane = args.lane.setup()?;
    let producer = lane
        .clone()
        .filter(|l| matches!(l.role, LaneRole::Producer { .. }));
    // a producer serves enrolled nodes over mutual TLS only; the API's bind rules are for the API
    if producer.is_none() {
        auth::check_bind(
            args.host,
            api_key.as_deref(),
            tls.is_some(),
            args.insecure_public,
        )?;
    }
    let model_path = match args.model {
        Some(path) => path,
        None => {
            let dir = store::default_store_dir()?;
            store::ensure(&store::DEFAULT_MODEL, &dir)?
        }
    };
    let mut cfg = ServeConfig::new(&model_path);
    cfg.n_slots = match (args.slots.flatten(), args.parallel) {
        (Some(a), Some(b)) if a != b => {
            anyhow::bail!("--slots {a} and --parallel {b} disagree: give one")
        }
        (a, b) => a.or(b).unwrap_or(cfg.n_slots),
    };
    args.llama.apply(&mut cfg)?;
    cfg.n_ctx = args.ctx_size;
    cfg.queue_max = args.queue;
    cfg.api_key = api_key;
    cfg.allowed_hosts = args.allow_host;
    if !args.host.is_unspecified() {
        cfg.allowed_hosts.push(args.host.to_string());
    }
    cfg.slot_save_path = args.slot_save_path;
    cfg.slot_save_quota_bytes = args.slot_save_quota_mib << 20;
    cfg.kv_key_file = args.kv_key_file;
    cfg.prompt_cache = args.prompt_cache.map(|dir| {
        let mut pc = muser_engine::PromptCacheConfig::new(dir);
        pc.disk_budget_bytes = args.prompt_cache_disk_mib << 20;
        pc.memory_budget_bytes = args.prompt_cache_ram_mib << 20;
        pc
    });
    cfg.lane = lane;
    cfg.session_dir = Some(match args.session_dir {
        Some(dir) => dir,
        None => default_session_dir()?,
    });
    cfg.device = clap::ValueEnum::to_possible_value(&args.device)
        .map_or_else(|| "cpu".into(), |v| v.get_name().to_string());
    if let Some(t) = args.threads {
        cfg.threads = t.max(1);
    }
    if let Some(n) = args.numerics.resolve(args.device)? {
        eprintln!("numerics: {}", n.tag());
        cfg.numerics = n;
    }
    let state = with_spinner(&format!("loading {}", model_path.display()), || {
        let state = match args.device {
            Device::Cpu => server::load(&cfg)?,
            device => {
                let model =
                    device::load(&model_path, device, LoadOptions::default().threads, None)?;
                server::load_with(&cfg, model)?
            }
        };
        anyhow::Ok(state)
    })?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    http::raise_fd_limit();
    runtime.block_on(async move {
        let addr = SocketAddr::new(args.host, args.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        let host = match local.ip() {
            IpAddr::V6(ip) => format!("[{ip}]"),
            IpAddr::V4(ip) => ip.to_string(),
        };
        if let Some(setup) = &producer {
            println!(
                "muser producer ready: https://{host}:{} (node {}, model {}, {} slots x {} tokens)",
                local.port(),
                setup.node,
                state.model.id,
                cfg.n_slots,
                cfg.n_ctx
            );
            std::io::stdout().flush()?;
            server::serve_producer(state, setup, listener, shutdown_signal()).await?;
            return anyhow::Ok(());
        }
        let scheme = if tls.is_some() { "https" } else { "http" };
        println!(
            "muser ready: {scheme}://{host}:{} (model {}, {} slots x {} tokens)",
            local.port(),
            state.model.id,
            cfg.n_slots,
            cfg.n_ctx
        );
        std::io::stdout().flush()?;
        eprintln!("muser: dashboard at {scheme}://{host}:{}/", local.port());
        server::start_lane_refresh(&state).await;
        http::serve(state, listener, tls, shutdown_signal()).await?;
        anyhow::Ok(())
    })
}

/// `sessions` beside the model store (`$MUSER_HOME/sessions`, or `~/.cache/muser/sessions`).
fn default_session_dir() -> anyhow::Result<PathBuf> {
    let models = store::default_store_dir()?;
    Ok(models
        .parent()
        .map_or_else(|| models.join("sessions"), |p| p.join("sessions")))
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = ctrl_c => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
    eprintln!("muser: shutting down");
}

/// Runs `f` while a spinner turns on stderr (a single line when stderr is not a terminal).
fn with_spinner<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let start = std::time::Instant::now();
    if !std::io::stderr().is_terminal() {
        eprintln!("muser: {what}");
        let out = f();
        eprintln!("muser: done in {:.1} s", start.elapsed().as_secs_f64());
        return out;
    }
    let done = Arc::new(AtomicBool::new(false));
    let spinner = {
        let (done, what) = (done.clone(), what.to_string());
        std::thread::spawn(move || {
            let frames = ['|', '/', '-', '\\'];
            let mut i = 0;
            while !done.load(Ordering::Relaxed) {
                eprint!(
                    "\r{} {what} ({:.1} s)",
                    frames[i % 4],
                    start.elapsed().as_secs_f64()
                );
                i += 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        })
    };
    let out = f();
    done.store(true, Ordering::Relaxed);
    let _ = spinner.join();
    eprintln!("\r  {what}: done in {:.1} s", start.elapsed().as_secs_f64());
    out
}
