//! Start-up: load the model, tokenizer, template and engine into an [`AppState`], bind, serve.

use crate::metrics::Metrics;
use crate::state::{AppState, ModelMeta, ServerOptions, SharedState};
use muser_engine::{Engine, EngineConfig, ModelLoader};
use muser_model::{LoadOptions, Model};
use muser_text::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What `muser up` (or a test) configures.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub model_path: PathBuf,
    pub n_slots: usize,
    /// Context per slot, in tokens.
    pub n_ctx: usize,
    pub threads: usize,
    pub queue_max: usize,
    /// Most prompt tokens per forward pass (`EngineConfig::prefill_chunk`).
    pub prefill_chunk: usize,
    pub api_key: Option<String>,
    /// Host names accepted besides the loopback names and the bound address
    /// (`--allow-host`); checked only without an API key.
    pub allowed_hosts: Vec<String>,
    pub slot_save_path: Option<PathBuf>,
    /// Most bytes the slot files under `slot_save_path` may take together.
    pub slot_save_quota_bytes: u64,
    /// Operator key sealing slot files (kvpack); `None`: `kv.key` in the model store,
    /// generated on first use.
    pub kv_key_file: Option<PathBuf>,
    /// Prompt cache across requests and restarts (`--prompt-cache DIR`): prompts' K/V kept
    /// as packs sealed with the same key, in memory and in the directory.
    pub prompt_cache: Option<muser_engine::PromptCacheConfig>,
    /// A role on the disaggregated prefill lane (its packs are sealed with the same key).
    pub lane: Option<crate::lane::LaneSetup>,
    /// Session bundles (`/v1/sessions`) in this directory, sealed with a key derived from
    /// the operator key.
    pub session_dir: Option<PathBuf>,
    /// The device label of the telemetry (`cpu`, `cuda`, `cuda-ops`).
    pub device: String,
    /// The CPU backend's numerics profile (`--numerics`, `--flash-attn`).
    pub numerics: muser_model::Numerics,
    /// The configuration directory whose node registry `/v1/nodes` serves (a consumer).
    pub node_registry: Option<PathBuf>,
    /// A consumer whose producers are its registry's: the lane settings that nodes enrolled
    /// while it runs join with (`routes::nodes::follow_registry`).
    pub node_follow: Option<crate::lane::ConsumerConfig>,
    /// Speculative decoding for every slot (`--spec`, `--draft-max`); `None`: plain decoding.
    pub spec: Option<muser_engine::SpecConfig>,
    /// The DFlash drafter of speculative mode dflash (`--dflash FILE`).
    pub dflash: Option<PathBuf>,
    /// Names the model is reported as and answers to (`--alias`, comma-separated): the first
    /// in sorted order replaces the file name as its id.
    pub aliases: Vec<String>,
    /// Informational tags listed with the model (`--tags`, comma-separated).
    pub tags: Vec<String>,
    /// Unload the model after this long without requests, load it again on the next one
    /// (`--sleep-idle-seconds`), with the loader given to [`load_from`].
    pub sleep_idle: Option<std::time::Duration>,
    /// A chat template (Jinja source) used instead of the model's (`--chat-template`,
    /// `--chat-template-file`).
    pub chat_template: Option<String>,
    /// Sampling settings of a request that states none (`--temp`, `--seed`, `--top-k`, ...).
    pub sampling: muser_engine::SamplingParams,
    /// Most tokens a request that gives no limit generates (`-n/--n-predict`).
    pub n_predict: Option<u32>,
    /// The GBNF grammar of a request that asks for no structure (`--grammar`,
    /// `--grammar-file`); checked before the server starts.
    pub grammar: Option<String>,
    /// Serve `GET /slots` (llama-server's `--no-slots` turns it off).
    pub slots_endpoint: bool,
    /// Serve `GET /metrics` (`muser up --metrics`).
    pub metrics_endpoint: bool,
    /// Serve `/rerank` (`--rerank`).
    pub rerank_endpoint: bool,
    /// How the embedding routes pool a prompt's rows (`--pooling`).
    pub pooling: muser_engine::Pooling,
    /// The image projector (`--mmproj FILE`); `None`: requests with images are refused.
    pub mmproj: Option<PathBuf>,
    /// Images one request may carry (`--max-images`).
    pub max_images: usize,
    /// Which browser origins may call the server (`--cors-*`).
    pub cors: crate::cors::Cors,
}

/// Context tokens per slot when nothing sets them.
pub const N_CTX_DEFAULT: usize = 4096;

impl ServeConfig {
    pub fn new(model_path: impl Into<PathBuf>) -> Self {
        Self {
            model_path: model_path.into(),
            n_slots: 4,
            n_ctx: N_CTX_DEFAULT,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            queue_max: 64,
            prefill_chunk: EngineConfig::default().prefill_chunk,
            api_key: None,
            allowed_hosts: Vec::new(),
            slot_save_path: None,
            slot_save_quota_bytes: 4 << 30,
            kv_key_file: None,
            prompt_cache: None,
            lane: None,
            session_dir: None,
            device: "cpu".into(),
            spec: None,
            dflash: None,
            numerics: muser_model::Numerics::PORTABLE,
            node_registry: None,
            node_follow: None,
            aliases: Vec::new(),
            tags: Vec::new(),
            sleep_idle: None,
            chat_template: None,
            sampling: muser_engine::SamplingParams::default(),
            n_predict: None,
            grammar: None,
            slots_endpoint: true,
            metrics_endpoint: true,
            rerank_endpoint: false,
            pooling: muser_engine::Pooling::Last,
            mmproj: None,
            max_images: 8,
            cors: crate::cors::Cors::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("loading {path}: {message}")]
    Model { path: PathBuf, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("--chat-template: {0}")]
    Template(String),
    #[error("starting the engine: {0}")]
    Engine(String),
    #[error("--slot-save-path {path}: {source}")]
    SlotDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "each slot's context ({n_ctx} tokens: -c/--ctx-size divided among the slots) must be between 16 and the model's training context {n_ctx_train}"
    )]
    Context { n_ctx: usize, n_ctx_train: usize },
    #[error("--slots must be between 1 and 256, got {0}")]
    Slots(usize),
    #[error("{0}")]
    KvKey(String),
    #[error("--session-dir {path}: {message}")]
    Sessions { path: PathBuf, message: String },
    #[error("--prompt-cache {path}: {message}")]
    PromptCache { path: PathBuf, message: String },
    #[error("prefill lane: {0}")]
    Lane(String),
    #[error("--mmproj {path}: {message}")]
    Projector { path: PathBuf, message: String },
}

/// Loads everything a server needs, the model on the CPU backend.
pub fn load(cfg: &ServeConfig) -> Result<SharedState, StartError> {
    let (path, opts) = (
        cfg.model_path.clone(),
        LoadOptions {
            threads: cfg.threads,
            numerics: cfg.numerics,
        },
    );
    load_from(
        cfg,
        Arc::new(move || {
            Model::load(&path, &opts)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        }),
    )
}

/// [`load`] with the model from `loader` (any backend), which also loads it again after a
/// sleep (`ServeConfig::sleep_idle`).
pub fn load_from(cfg: &ServeConfig, loader: ModelLoader) -> Result<SharedState, StartError> {
    if !(1..=256).contains(&cfg.n_slots) {
        return Err(StartError::Slots(cfg.n_slots));
    }
    let model = loader().map_err(|message| StartError::Model {
        path: cfg.model_path.clone(),
        message,
    })?;
    let sleep = cfg.sleep_idle.map(|idle| muser_engine::SleepConfig {
        idle,
        reload: loader,
    });
    let gguf = model.gguf();
    let tokenizer =
        Arc::new(Tokenizer::from_gguf(gguf).map_err(|e| StartError::Tokenizer(e.to_string()))?);
    let template = match &cfg.chat_template {
        Some(source) => Some(
            muser_text::ChatTemplate::new(source, &tokenizer)
                .map_err(|e| StartError::Template(e.to_string()))?,
        ),
        None => muser_text::ChatTemplate::from_gguf(gguf, &tokenizer)
            .map_err(|e| StartError::Tokenizer(e.to_string()))?,
    };
    let info = model.info();
    let vision = match &cfg.mmproj {
        Some(path) => {
            let projector_error = |message: String| StartError::Projector {
                path: path.clone(),
                message,
            };
            // images encode where the text model runs
            let device = match cfg.device.as_str() {
                "cpu" => muser_vision::Device::Cpu,
                "cuda" | "cuda-ops" => muser_vision::Device::Cuda,
                other => {
                    return Err(projector_error(format!(
                        "no image encoder for device {other}"
                    )))
                }
            };
            let v = crate::vision::Vision::load(
                path,
                info.n_embd,
                &tokenizer,
                (device, cfg.threads),
                cfg.max_images,
            )
            .map_err(projector_error)?;
            Some(Arc::new(v))
        }
        None => None,
    };
    let n_ctx_train = info.n_ctx_train as usize;
    if cfg.n_ctx < 16 || (n_ctx_train > 0 && cfg.n_ctx > n_ctx_train) {
        return Err(StartError::Context {
            n_ctx: cfg.n_ctx,
            n_ctx_train,
        });
    }
    if let Some(dir) = &cfg.slot_save_path {
        muser_store::private_dir(dir).map_err(|source| StartError::SlotDir {
            path: dir.clone(),
            source,
        })?;
    }
    let needs_key = cfg.slot_save_path.is_some()
        || cfg.prompt_cache.is_some()
        || cfg.session_dir.is_some()
        || cfg.lane.is_some();
    let (kvpack, sessions) = match needs_key {
        true => {
            let mut operator_key = crate::kvkey::load_or_create(cfg.kv_key_file.as_deref())
                .map_err(StartError::KvKey)?;
            let ctx = muser_engine::KvPackContext::new(
                &model,
                Some(&cfg.model_path),
                muser_engine::KvType::F16,
                muser_kvpack::Keys::derive(&operator_key),
            )
            .map_err(|e| StartError::KvKey(e.to_string()))?;
            let sessions = cfg
                .session_dir
                .as_deref()
                .map(|dir| {
                    crate::routes::sessions::Sessions::open(dir, &operator_key, &ctx, cfg.n_ctx)
                        .map_err(|e| StartError::Sessions {
                            path: dir.to_path_buf(),
                            message: e.to_string(),
                        })
                })
                .transpose();
            operator_key.fill(0);
            (Some(Arc::new(ctx)), sessions?)
        }
        false => (None, None),
    };
    let prompt_cache = match (&cfg.prompt_cache, &kvpack) {
        (Some(pc), Some(ctx)) => {
            muser_store::private_dir(&pc.dir).map_err(|e| StartError::PromptCache {
                path: pc.dir.clone(),
                message: e.to_string(),
            })?;
            let (cache, report) =
                muser_engine::PromptCache::open(ctx.clone(), pc).map_err(|e| {
                    StartError::PromptCache {
                        path: pc.dir.clone(),
                        message: e.to_string(),
                    }
                })?;
            tracing::info!(
                dir = %pc.dir.display(),
                packs = report.kept,
                quarantined = report.quarantined.len(),
                "prompt cache ready"
            );
            Some(Arc::new(cache))
        }
        _ => None,
    };
    let mut meta = model_meta(&cfg.model_path, &model, tokenizer.n_vocab());
    if let Some(source) = &cfg.chat_template {
        meta.chat_template = Some(source.clone());
    }
    let sorted = |names: &[String]| {
        let set: std::collections::BTreeSet<&String> = names.iter().collect();
        set.into_iter().cloned().collect::<Vec<String>>()
    };
    let aliases = sorted(&cfg.aliases);
    if let Some(first) = aliases.first() {
        meta.id = first.clone();
        meta.aliases = aliases;
    }
    meta.tags = sorted(&cfg.tags);
    let engine_cfg = EngineConfig {
        n_slots: cfg.n_slots,
        n_ctx: cfg.n_ctx,
        queue_max: cfg.queue_max,
        prefill_chunk: cfg.prefill_chunk,
        prompt_cache,
        spec: cfg.spec,
        pooling: cfg.pooling,
        sleep,
        dflash: match &cfg.dflash {
            Some(p) => Some(Arc::new(
                muser_model::models::dflash::Dflash::load(p, 0)
                    .map_err(|e| StartError::Engine(format!("--dflash {}: {e}", p.display())))?,
            )),
            None => None,
        },
        ..Default::default()
    };
    let engine = Engine::start(model, tokenizer.clone(), engine_cfg)
        .map_err(|e| StartError::Engine(e.to_string()))?;
    let lane = match (&cfg.lane, &kvpack) {
        (Some(setup), Some(ctx)) => match &setup.role {
            crate::lane::LaneRole::Consumer(c) => {
                let creds = muser_cluster::enroll::node_creds(&setup.config_dir, &setup.node)
                    .map_err(|e| StartError::Lane(e.to_string()))?;
                let lane = crate::lane::Lane::open(
                    c,
                    &creds,
                    &setup.config_dir,
                    ctx.clone(),
                    cfg.n_ctx,
                    cfg.prefill_chunk,
                )
                .map_err(StartError::Lane)?;
                std::sync::OnceLock::from(Arc::new(lane))
            }
            crate::lane::LaneRole::Producer { .. } => std::sync::OnceLock::new(),
        },
        _ => std::sync::OnceLock::new(),
    };
    Ok(Arc::new(AppState {
        engine: Arc::new(engine),
        lane,
        kvpack,
        vision,
        tokenizer,
        template,
        model: meta,
        options: ServerOptions {
            api_key: cfg.api_key.clone(),
            allowed_hosts: ["localhost", "127.0.0.1", "::1"]
                .iter()
                .map(|h| h.to_string())
                .chain(cfg.allowed_hosts.iter().map(|h| h.to_ascii_lowercase()))
                .collect(),
            slot_save_path: cfg.slot_save_path.clone(),
            slot_save_quota_bytes: cfg.slot_save_quota_bytes,
            n_slots: cfg.n_slots,
            n_ctx: cfg.n_ctx,
            sampling: cfg.sampling.clone(),
            n_predict: cfg.n_predict,
            grammar: cfg.grammar.clone(),
            slots_endpoint: cfg.slots_endpoint,
            metrics_endpoint: cfg.metrics_endpoint,
            rerank_endpoint: cfg.rerank_endpoint,
            cors: cfg.cors.clone(),
        },
        metrics: Arc::new(Metrics::new(&cfg.device)),
        sessions,
        nodes: cfg.node_registry.as_ref().map(|dir| {
            let consumer = cfg.lane.as_ref().and_then(|l| match &l.role {
                crate::lane::LaneRole::Consumer(c) => Some((l.node.clone(), c.accept_abis.clone())),
                crate::lane::LaneRole::Producer { .. } => None,
            });
            crate::routes::nodes::NodeAdmin::new(
                dir.clone(),
                consumer.as_ref().map(|c| c.0.clone()),
                cfg.kv_key_file.clone(),
                consumer.map(|c| c.1).unwrap_or_default(),
                cfg.node_follow.clone(),
            )
        }),
        in_flight: Arc::new(tokio::sync::Semaphore::new(crate::limits::IN_FLIGHT_MAX)),
        started_unix_s: crate::routes::unix_now(),
    }))
}

fn model_meta(path: &Path, model: &Model, n_vocab: usize) -> ModelMeta {
    let gguf = model.gguf();
    let info = model.info();
    let arch = gguf
        .get_str("general.architecture")
        .unwrap_or("unknown")
        .to_string();
    let file_type = gguf
        .get("general.file_type")
        .and_then(|v| v.as_u64_lossless())
        .map_or_else(|| "unknown".to_string(), |t| file_type_name(t as u32));
    let id = path
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".into());
    ModelMeta {
        aliases: vec![id.clone()],
        file_id: id.clone(),
        id,
        tags: Vec::new(),
        path: path.to_path_buf(),
        is_muse: info.arch == muser_model::Arch::MuseGlimmer,
        arch,
        n_vocab,
        n_embd: info.n_embd,
        n_ctx_train: info.n_ctx_train as usize,
        n_params: gguf.tensors().iter().map(|t| t.n_elements()).sum(),
        size_bytes: std::fs::metadata(path).map_or(0, |m| m.len()),
        file_type,
        chat_template: gguf
            .get_str("tokenizer.chat_template")
            .ok()
            .map(str::to_string),
    }
}

/// llama.cpp's `general.file_type` names for the common types.
fn file_type_name(ft: u32) -> String {
    match ft {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        32 => "BF16",
        other => return format!("type {other}"),
    }
    .to_string()
}

/// How often a consumer asks its producers for their status.
const LANE_REFRESH: std::time::Duration = std::time::Duration::from_secs(2);

/// Starts a consumer's lane upkeep (no-op without a lane or a registry to follow): follows
/// the node registry and asks the producers for their status now, then every
/// [`LANE_REFRESH`] while the server state lives.
pub async fn start_lane_refresh(state: &SharedState) {
    let follows = state.nodes.as_ref().is_some_and(|n| n.follow.is_some());
    if state.lane.get().is_none() && !follows {
        return;
    }
    lane_upkeep(state).await;
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(LANE_REFRESH).await;
            match weak.upgrade() {
                Some(state) => lane_upkeep(&state).await,
                None => return,
            }
        }
    });
}

async fn lane_upkeep(state: &SharedState) {
    if let Err(e) = crate::routes::nodes::follow_registry(state, false) {
        tracing::warn!(error = %e, "prefill lane: following the node registry");
    }
    if let Some(lane) = state.lane.get().cloned() {
        lane.refresh().await;
        if lane.measures() && lane.claim_measurement() {
            measure_local_rate(state, lane);
        }
    }
}

/// `auto`'s threshold needs this engine's own prefill rate: measured once, over two chunks
/// of a synthetic prompt, in the background.
fn measure_local_rate(state: &SharedState, lane: Arc<crate::lane::Lane>) {
    let engine = state.engine.clone();
    let n = (2 * engine.config().prefill_chunk).min(state.options.n_ctx - 1);
    let n_vocab = state.tokenizer.n_vocab();
    tokio::spawn(async move {
        match crate::lane::measure_prefill(&engine, n_vocab, n).await {
            Ok(rate) => {
                lane.set_local_rate(rate);
                let (min, from) = lane.min_tokens();
                tracing::info!(
                    tok_s = rate,
                    remote_min_tokens = min,
                    from,
                    "prefill lane: local prefill rate measured"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "prefill lane: measuring the local prefill rate failed")
            }
        }
    });
}

/// Serves the producer role: the prefill lane's routes over mutual TLS to the enrolled
/// `consumers`, as node `setup.node`, until `shutdown` resolves.
pub async fn serve_producer(
    state: SharedState,
    setup: &crate::lane::LaneSetup,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    let crate::lane::LaneRole::Producer {
        consumers,
        max_queue,
        fault,
    } = &setup.role
    else {
        return Err(StartError::Lane("not a producer".into()));
    };
    let lane = |e: &dyn std::fmt::Display| StartError::Lane(e.to_string());
    let creds =
        muser_cluster::enroll::node_creds(&setup.config_dir, &setup.node).map_err(|e| lane(&e))?;
    let tls = muser_cluster::server_config(&creds).map_err(|e| lane(&e))?;
    let producer = crate::producer::Producer::new(state, &setup.node, *max_queue, fault.clone())
        .map_err(|e| lane(&e))?;
    tokio::spawn(producer.clone().warm_up());
    muser_cluster::serve(
        listener,
        tls,
        consumers.iter().cloned().collect(),
        producer.router(),
        shutdown,
    )
    .await
    .map_err(|e| lane(&e))
}
