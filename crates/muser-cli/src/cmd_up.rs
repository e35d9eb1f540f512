//! `muser up`: serve the OpenAI-, llama.cpp- and Ollama-compatible HTTP APIs. Without
//! `--model` it fetches the default model (SHA-256 pinned) into the model store first.
//! Progress goes to stderr; stdout gets exactly one line, once the server is listening.

use crate::config::{Settings, Source};
use crate::device::{self, Device};
use anyhow::Context;
use muser_cluster::registry::Registry;
use muser_cluster::Endpoint;
use muser_model::LoadOptions;
use muser_server::lane::{ConsumerConfig, LaneListen, LaneRole, LaneSetup, PrefillMode};
use muser_server::server::{self, ServeConfig};
use muser_server::{auth, enroll, http};
use muser_store as store;
use std::io::{IsTerminal, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model to serve: a path or a name in the model store (`muser list`); default:
    /// SmolLM2-135M-Instruct Q4_1, fetched into the model store.
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Addresses to listen on, comma-separated (one server on each, as llama-server's
    /// `--host A,B`). A non-loopback address needs an API key and TLS (or --insecure-public).
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1", num_args = 1..)]
    host: Vec<IpAddr>,
    #[arg(long, default_value_t = 4949)]
    port: u16,
    /// Concurrent generations, each with its own KV cache, a share of --ctx-size (default 4;
    /// llama-server's `-np/--parallel N` too). A bare `--slots` (llama-server's switch for
    /// `GET /slots`, on by default here) changes nothing.
    #[arg(long, value_name = "N", num_args = 0..=1)]
    slots: Option<Option<usize>>,
    #[arg(long, value_name = "N", hide = true)]
    parallel: Option<usize>,
    /// Context of all slots together, in tokens, as llama-server's `-c`: each of the N slots
    /// gets -c/N, rounded up to a multiple of 256 as llama.cpp rounds (`--kv-unified`: each
    /// slot may use the whole -c). Default: 4096 per slot.
    #[arg(short = 'c', long = "ctx-size", value_name = "N")]
    ctx_size: Option<usize>,
    /// Most prompt tokens one forward pass carries (1 to 8192). The chunks a prompt is cut
    /// into are part of the numerics: a producer and its consumers use the same value.
    #[arg(long, value_name = "N", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..=8192))]
    prefill_chunk: u32,
    #[command(flatten)]
    spec: crate::spec::SpecArgs,
    /// Require `Authorization: Bearer KEY` on every route but /health, the key read from the
    /// first line of this file.
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<PathBuf>,
    /// The API key itself (on the command line it is visible to every local user: prefer
    /// --api-key-file, or MUSER_API_KEY).
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
    /// Image projector (a Muse Glimmer `mmproj` GGUF): requests may carry images (OpenAI
    /// `image_url` data URIs, Anthropic `image` blocks, Ollama `images`, `/completion`
    /// `multimodal_data`), encoded on the CPU, or on the GPU with `--device cuda|cuda-ops`.
    #[arg(long, value_name = "FILE")]
    mmproj: Option<PathBuf>,
    /// Images one request may carry; more is a 400.
    #[arg(long, value_name = "N", default_value_t = 8)]
    max_images: usize,
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
    #[command(flatten)]
    config: crate::config::ConfigArgs,
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
    /// producer failure). Default: auto with enrolled nodes, else local.
    #[arg(long, value_enum)]
    prefill: Option<Prefill>,
    /// A producer, NAME=https://HOST:PORT (NAME: its certificate name); repeatable. Without
    /// it, a consumer uses the nodes enrolled with `muser node add` (nodes.toml).
    #[arg(long, value_name = "NAME=URL")]
    producer: Vec<String>,
    /// Use only these enrolled nodes (repeatable).
    #[arg(long, value_name = "NAME", conflicts_with_all = ["local", "producer"])]
    node: Vec<String>,
    /// Ignore the enrolled nodes: prefill here unless --producer is given.
    #[arg(long)]
    local: bool,
    /// Producer: print a one-time enrollment code and wait for a consumer's
    /// `muser node add` before serving the lane (docs/nodes.md).
    #[arg(long)]
    enroll: bool,
    /// Producer: seconds the enrollment code stays valid.
    #[arg(long, default_value_t = 600, requires = "enroll")]
    enroll_ttl_s: u64,
    /// With --prefill auto, prompts of at least this many tokens go to a producer. Without
    /// it the threshold is measured: this engine's prefill rate at start-up against the
    /// producers' reported rates and the payload rate of their last handoff.
    #[arg(long, value_name = "N")]
    remote_min_tokens: Option<usize>,
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
    /// A node this one may move sessions to (`POST /v1/sessions/{id}/migrate`),
    /// NAME=https://HOST:PORT (its --lane-port); repeatable.
    #[arg(long, value_name = "NAME=URL")]
    migrate_to: Vec<String>,
    /// Consumer: also serve the lane over mutual TLS on this port (sessions migrated in from
    /// the --lane-peer nodes).
    #[arg(long, value_name = "PORT")]
    lane_port: Option<u16>,
    /// A node allowed to connect to --lane-port; repeatable.
    #[arg(long, value_name = "NAME")]
    lane_peer: Vec<String>,
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
    /// A consumer without --producer takes its producers from the node registry (every
    /// enrolled node, or the --node ones) and prefills `auto` unless --prefill says otherwise.
    fn use_registry(&mut self, config_dir: &Path) -> anyhow::Result<()> {
        if self.role != Role::Consumer || self.local || !self.producer.is_empty() {
            return Ok(());
        }
        let reg = Registry::load(config_dir)?;
        for n in &self.node {
            anyhow::ensure!(
                reg.get(n).is_some(),
                "node `{n}` is not enrolled (see `muser node list`)"
            );
        }
        let chosen: Vec<_> = reg
            .nodes
            .iter()
            .filter(|n| self.node.is_empty() || self.node.contains(&n.name))
            .collect();
        if chosen.is_empty() {
            return Ok(());
        }
        self.producer = chosen
            .iter()
            .map(|n| format!("{}={}", n.name, n.url))
            .collect();
        if self.name.is_none() {
            self.name = reg.consumer.clone();
        }
        self.prefill.get_or_insert(Prefill::Auto);
        let names: Vec<&str> = chosen.iter().map(|n| n.name.as_str()).collect();
        eprintln!("muser: enrolled nodes: {}", names.join(", "));
        Ok(())
    }

    /// A consumer whose producers are its registry's (no --producer, --node or --local)
    /// follows it while it runs: the settings a node enrolled meanwhile joins the lane with.
    fn follow(&self) -> anyhow::Result<Option<ConsumerConfig>> {
        let follows = self.role == Role::Consumer
            && !self.local
            && self.producer.is_empty()
            && self.node.is_empty();
        if !follows {
            return Ok(None);
        }
        let mode = self.prefill.unwrap_or(Prefill::Auto);
        Ok(Some(self.consumer_config(mode, Vec::new())?))
    }

    fn consumer_config(
        &self,
        prefill: Prefill,
        producers: Vec<Endpoint>,
    ) -> anyhow::Result<ConsumerConfig> {
        Ok(ConsumerConfig {
            mode: match prefill {
                Prefill::Local => PrefillMode::Local,
                Prefill::Remote => PrefillMode::Remote,
                Prefill::Auto => PrefillMode::Auto,
            },
            producers,
            min_tokens: self.remote_min_tokens,
            deadline: Duration::from_millis(self.prefill_deadline_ms.max(1)),
            accept_abis: self.accept_abi.clone(),
            migrate_to: self
                .migrate_to
                .iter()
                .map(|p| Endpoint::parse(p))
                .collect::<Result<_, _>>()?,
        })
    }

    /// The lane setup these flags ask for (`None`: a plain server, or a consumer that opens
    /// its lane when its first node is enrolled), and the registry-following settings.
    fn setup(mut self) -> anyhow::Result<(Option<LaneSetup>, Option<ConsumerConfig>)> {
        let config_dir = crate::cmd_tls::config_dir(self.config_dir.take())?;
        let follow = self.follow()?;
        self.use_registry(&config_dir)?;
        let waits_for_nodes = follow.is_some() && self.producer.is_empty();
        let prefill = self.prefill.unwrap_or(Prefill::Local);
        let wants = self.role == Role::Producer
            || (prefill != Prefill::Local && !waits_for_nodes)
            || !self.producer.is_empty()
            || !self.migrate_to.is_empty()
            || self.lane_port.is_some();
        if !wants {
            return Ok((None, follow));
        }
        let node = self
            .name
            .take()
            .context("the prefill lane needs this node's certificate name: --name NAME")?;
        anyhow::ensure!(
            !self.enroll || self.role == Role::Producer,
            "--enroll is for a producer (--role producer)"
        );
        let role = match self.role {
            Role::Producer => {
                let mut consumers = self.consumer;
                if let Some(e) = muser_cluster::enroll::load_enrolled(&config_dir, &node)? {
                    consumers.extend(e.consumers);
                }
                anyhow::ensure!(
                    !consumers.is_empty() || self.enroll,
                    "a producer serves only enrolled consumers: give at least one --consumer NAME, or --enroll"
                );
                for c in &consumers {
                    muser_cluster::check_name(c)?;
                }
                LaneRole::Producer {
                    consumers,
                    max_queue: self.lane_queue,
                    fault: None,
                }
            }
            Role::Consumer => {
                let producers = self
                    .producer
                    .iter()
                    .map(|p| Endpoint::parse(p))
                    .collect::<Result<_, _>>()?;
                LaneRole::Consumer(self.consumer_config(prefill, producers)?)
            }
        };
        let listen = match self.lane_port {
            None => None,
            Some(port) => {
                anyhow::ensure!(
                    self.role == Role::Consumer,
                    "--lane-port is for a consumer (a producer serves the lane on --port)"
                );
                anyhow::ensure!(
                    !self.lane_peer.is_empty(),
                    "--lane-port serves only enrolled nodes: give at least one --lane-peer NAME"
                );
                for p in &self.lane_peer {
                    muser_cluster::check_name(p)?;
                }
                Some(LaneListen {
                    port,
                    peers: self.lane_peer,
                })
            }
        };
        let setup = LaneSetup {
            config_dir,
            node,
            role,
            listen,
        };
        Ok((Some(setup), follow))
    }
}

pub fn run(mut args: Args, settings: Settings) -> anyhow::Result<()> {
    if args.config.print_config {
        print!("{}", settings.to_toml());
        return Ok(());
    }
    crate::config::note_llama_env();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    if settings.source("api_key") == Some(&Source::CommandLine) {
        eprintln!("muser: warning: --api-key puts the key in the process list for every local user; prefer --api-key-file or MUSER_API_KEY");
    }
    // of a key and a key file, the one from the higher-precedence source (the file on a tie)
    if let (Some(key), Some(file)) = (settings.source("api_key"), settings.source("api_key_file")) {
        if key.rank() < file.rank() {
            args.api_key_file = None;
        }
    }
    let api_key = auth::load_api_key(args.api_key_file.as_deref(), args.api_key)
        .map_err(anyhow::Error::msg)?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(http::tls_config(cert, key).map_err(anyhow::Error::msg)?),
        _ => None,
    };
    let enroll = args
        .lane
        .enroll
        .then(|| Duration::from_secs(args.lane.enroll_ttl_s.max(1)));
    let registry = match args.lane.role {
        Role::Consumer => Some(crate::cmd_tls::config_dir(args.lane.config_dir.clone())?),
        Role::Producer => None,
    };
    let (lane, follow) = args.lane.setup()?;
    let producer = lane
        .clone()
        .filter(|l| matches!(l.role, LaneRole::Producer { .. }));
    // an enrolled producer seals with the operator key its enrollment provisioned
    let enrolled_key = match &producer {
        Some(p) if enroll.is_none() => {
            muser_cluster::enroll::load_enrolled(&p.config_dir, &p.node)?.map(|e| e.kv_key_file)
        }
        _ => None,
    };
    // a producer serves enrolled nodes over mutual TLS only; the API's bind rules are for the API
    if producer.is_none() {
        for &host in &args.host {
            auth::check_bind(
                host,
                api_key.as_deref(),
                tls.is_some(),
                args.insecure_public,
            )?;
        }
    }
    // the first address is the one printed, and the one a lane listener and a producer use
    let host0 = args.host[0];
    let model_path = store::model_path(args.model.as_deref())?;
    let mut cfg = ServeConfig::new(&model_path);
    cfg.mmproj = args.mmproj;
    cfg.max_images = args.max_images;
    cfg.n_slots = match (args.slots.flatten(), args.parallel) {
        (Some(a), Some(b)) if a != b => {
            anyhow::bail!("--slots {a} and --parallel {b} disagree: give one")
        }
        (a, b) => a.or(b).unwrap_or(cfg.n_slots),
    };
    cfg.n_ctx = args.llama.slot_ctx(args.ctx_size, cfg.n_slots);
    cfg.api_key = api_key;
    args.llama.apply(&mut cfg)?;
    cfg.prefill_chunk = args.prefill_chunk as usize;
    cfg.queue_max = args.queue;
    cfg.spec = args.spec.config(args.device)?;
    cfg.dflash = args.spec.dflash_path().map(Into::into);
    cfg.allowed_hosts = args.allow_host;
    for host in args.host.iter().filter(|h| !h.is_unspecified()) {
        cfg.allowed_hosts.push(host.to_string());
    }
    cfg.slot_save_path = args.slot_save_path;
    cfg.slot_save_quota_bytes = args.slot_save_quota_mib << 20;
    cfg.kv_key_file = enrolled_key.or(args.kv_key_file);
    cfg.prompt_cache = args.prompt_cache.map(|dir| {
        let mut pc = muser_engine::PromptCacheConfig::new(dir);
        pc.disk_budget_bytes = args.prompt_cache_disk_mib << 20;
        pc.memory_budget_bytes = args.prompt_cache_ram_mib << 20;
        pc
    });
    cfg.lane = lane.clone();
    cfg.node_registry = registry;
    cfg.node_follow = follow;
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
                let path = model_path.clone();
                let threads = LoadOptions::default().threads;
                server::load_from(
                    &cfg,
                    Arc::new(move || {
                        device::load(&path, device, threads, None)
                            .map(Arc::new)
                            .map_err(|e| format!("{e:#}"))
                    }),
                )?
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
        let addr = SocketAddr::new(host0, args.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        let host = match local.ip() {
            IpAddr::V6(ip) => format!("[{ip}]"),
            IpAddr::V4(ip) => ip.to_string(),
        };
        if let Some(setup) = &producer {
            let (state, setup) = match enroll {
                Some(ttl) => enroll_producer(&state, setup, &listener, ttl).await?,
                None => (state, setup.clone()),
            };
            println!(
                "muser producer ready: https://{host}:{} (node {}, model {}, {} slots x {} tokens)",
                local.port(),
                setup.node,
                state.model.id,
                cfg.n_slots,
                cfg.n_ctx
            );
            std::io::stdout().flush()?;
            server::serve_producer(state, &setup, listener, shutdown_signal()).await?;
            return anyhow::Ok(());
        }
        // the other addresses take the first one's port (the same one when --port is 0)
        let mut listeners = vec![listener];
        for &host in &args.host[1..] {
            let addr = SocketAddr::new(host, local.port());
            listeners.push(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen on {addr}"))?,
            );
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
        if let Some((setup, listen)) = lane.as_ref().and_then(|l| Some((l, l.listen.as_ref()?))) {
            let addr = SocketAddr::new(host0, listen.port);
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} (--lane-port)"))?;
            eprintln!("muser: lane (sessions in) at https://{addr}");
            let (st, setup) = (state.clone(), setup.clone());
            tokio::spawn(async move {
                let peers = setup.listen.as_ref().map_or(&[][..], |l| &l.peers[..]);
                if let Err(e) = muser_server::migrate::serve_lane(
                    st,
                    &setup.config_dir,
                    &setup.node,
                    peers,
                    listener,
                )
                .await
                {
                    eprintln!("muser: the lane listener stopped: {e}");
                }
            });
        }
        server::start_lane_refresh(&state).await;
        http::serve(state, listeners, tls, shutdown_signal()).await?;
        anyhow::Ok(())
    })
}

/// Serves enrollment on `listener` until a consumer enrolled this producer (the code goes to
/// stdout only); returns the state and setup to serve the lane with.
async fn enroll_producer(
    state: &muser_server::state::SharedState,
    setup: &LaneSetup,
    listener: &tokio::net::TcpListener,
    ttl: Duration,
) -> anyhow::Result<(muser_server::state::SharedState, LaneSetup)> {
    let addr = listener.local_addr()?;
    let show = |code: &str| {
        println!(
            "muser producer enrolling: https://{addr} (node {}); one-time code, valid {} s: {code}",
            setup.node,
            ttl.as_secs()
        );
        let _ = std::io::stdout().flush();
    };
    enroll::enroll_producer(state, setup, listener, ttl, show)
        .await
        .map_err(anyhow::Error::msg)
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
