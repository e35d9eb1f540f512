//! llama-server's command-line spellings on `muser up`, so that a llama-server command line
//! starts Muser unchanged. Flags with a meaning here are mapped onto the server's settings;
//! flags that do not apply to Muser are accepted and named in one start-up line; anything else
//! llama-server takes is refused by clap like any unknown flag.

use anyhow::Context;
use muser_engine::SamplingParams;
use muser_server::server::ServeConfig;
use std::ffi::OsString;
use std::path::PathBuf;

/// llama-server's multi-letter single-dash flags (clap's short flags are one letter): the
/// long spelling each stands for.
const SINGLE_DASH: &[(&str, &str)] = &[
    ("-np", "--parallel"),
    ("-fa", "--flash-attn"),
    ("-ngl", "--n-gpu-layers"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-ub", "--ubatch-size"),
    ("-cb", "--cont-batching"),
    ("-nocb", "--no-cont-batching"),
    ("-kvu", "--kv-unified"),
    ("-mm", "--mmproj"),
];

/// Rewrites llama.cpp's multi-letter single-dash flags to their long spellings: llama-server's
/// on `muser up`, llama-bench's and llama-batched-bench's on `muser bench`
/// (`cmd_bench::SINGLE_DASH`); other commands' arguments pass unchanged.
pub fn normalize(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut args: Vec<OsString> = args.into_iter().collect();
    let table = match args.get(1).and_then(|a| a.to_str()) {
        Some("up") => SINGLE_DASH,
        Some("bench") => crate::cmd_bench::SINGLE_DASH,
        _ => return args,
    };
    for a in args.iter_mut().skip(2) {
        if let Some((_, long)) = table.iter().find(|(short, _)| a == *short) {
            *a = OsString::from(*long);
        }
    }
    args
}

/// The flags of llama-server that `muser up` takes besides its own.
#[derive(clap::Args, Default)]
pub struct LlamaArgs {
    /// Names the model is reported as and answers to, comma-separated (the first in sorted
    /// order becomes its id); any name is accepted on the OpenAI and llama.cpp routes anyway.
    #[arg(long, value_name = "NAMES")]
    alias: Option<String>,
    /// Informational tags listed with the model in `/v1/models`, comma-separated.
    #[arg(long, value_name = "TAGS")]
    tags: Option<String>,
    /// A chat template instead of the model's: a built-in name (`chatml`, `llama3`,
    /// `command-r`), or Jinja source.
    #[arg(long, value_name = "TEMPLATE")]
    chat_template: Option<String>,
    /// A chat template (Jinja) read from a file instead of the model's.
    #[arg(long, value_name = "FILE", conflicts_with = "chat_template")]
    chat_template_file: Option<PathBuf>,
    /// Most tokens a request without its own limit generates (-1: until the context is full).
    #[arg(
        short = 'n',
        long = "n-predict",
        visible_alias = "predict",
        value_name = "N"
    )]
    n_predict: Option<i64>,
    /// The GBNF grammar of requests that ask for no structure (no `grammar`, `json_schema`,
    /// `response_format` or forced tool).
    #[arg(long, value_name = "GBNF")]
    grammar: Option<String>,
    /// `--grammar` read from a file.
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    grammar_file: Option<PathBuf>,
    /// Default temperature of requests that give none.
    #[arg(long = "temp", value_name = "T")]
    temperature: Option<f32>,
    /// Default seed of requests that give none (-1: a fresh one per request).
    #[arg(short = 's', long, value_name = "SEED", allow_negative_numbers = true)]
    seed: Option<i64>,
    /// Default top-k of requests that give none.
    #[arg(long, value_name = "K")]
    top_k: Option<i32>,
    /// Default top-p of requests that give none.
    #[arg(long, value_name = "P")]
    top_p: Option<f32>,
    /// Default min-p of requests that give none.
    #[arg(long, value_name = "P")]
    min_p: Option<f32>,
    /// Default repeat penalty of requests that give none.
    #[arg(long, value_name = "X")]
    repeat_penalty: Option<f32>,
    /// Unload the model (weights and K/V) after N seconds without requests; the next request
    /// loads it again and waits for it (-1: never, the default). `/props` says `is_sleeping`.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    sleep_idle_seconds: Option<i64>,
    /// Turns off `GET /slots` (501).
    #[arg(long)]
    no_slots: bool,
    /// Serve `GET /metrics` (Prometheus text; 501 without, as llama-server answers).
    #[arg(long)]
    metrics: bool,
    /// `GET /metrics` off (the default).
    #[arg(long, conflicts_with = "metrics")]
    no_metrics: bool,
    /// The embedding routes (always on here).
    #[arg(long, alias = "embeddings")]
    embedding: bool,
    /// Serve `/rerank` and `/v1/rerank` (scores by embedding similarity).
    #[arg(long, alias = "reranking")]
    rerank: bool,
    /// Pooling of the embedding routes: `last` (the default; `rank` too), `mean` or `none`
    /// (every token's vector, on /embedding only).
    #[arg(long, value_name = "TYPE")]
    pooling: Option<String>,
    /// KV cache types: only f16 (Muser's) is implemented.
    #[arg(long, value_name = "TYPE")]
    cache_type_k: Option<String>,
    #[arg(long, value_name = "TYPE")]
    cache_type_v: Option<String>,
    /// Browser origins allowed to call the server: `localhost` (pages served from this
    /// machine), `*` (any site), or a comma-separated list of origins. Default: `localhost`,
    /// or `*` with an API key (llama-server's default; the key protects the server).
    #[arg(long, value_name = "ORIGINS")]
    cors_origins: Option<String>,
    /// `Access-Control-Allow-Methods` of a CORS preflight.
    #[arg(long, value_name = "METHODS")]
    cors_methods: Option<String>,
    /// `Access-Control-Allow-Headers` of a CORS preflight.
    #[arg(long, value_name = "HEADERS")]
    cors_headers: Option<String>,
    /// Allow credentials on cross-origin requests (the default).
    #[arg(long)]
    cors_credentials: bool,
    /// Disallow credentials on cross-origin requests (`*` is then sent as is).
    #[arg(long, conflicts_with = "cors_credentials")]
    no_cors_credentials: bool,
    // Accepted without effect (named at start-up, see `ignored`).
    #[arg(long, alias = "gpu-layers", value_name = "N", hide = true)]
    n_gpu_layers: Option<String>,
    #[arg(short = 'b', long, value_name = "N", hide = true)]
    batch_size: Option<usize>,
    #[arg(long, value_name = "N", hide = true)]
    ubatch_size: Option<usize>,
    #[arg(long, hide = true)]
    cont_batching: bool,
    /// Every slot may use the whole --ctx-size (llama-server shares one cache among the
    /// slots; Muser gives each slot a cache of that size).
    #[arg(long)]
    kv_unified: bool,
    #[arg(long, hide = true)]
    swa_full: bool,
    #[arg(long, hide = true)]
    jinja: bool,
    #[arg(long, hide = true, conflicts_with = "jinja")]
    no_jinja: bool,
    #[arg(long, value_name = "FORMAT", hide = true)]
    reasoning_format: Option<String>,
    #[arg(long, alias = "no-ui", hide = true)]
    no_webui: bool,
    #[arg(long, hide = true)]
    offline: bool,
    /// Load no projector, even with --mmproj.
    #[arg(long, alias = "no-mmproj-auto", hide = true)]
    no_mmproj: bool,
    #[arg(short = 'v', long, hide = true)]
    verbose: bool,
    #[arg(long = "backend_sampling", alias = "backend-sampling", hide = true)]
    backend_sampling: bool,
    #[arg(long, value_name = "MIB", hide = true)]
    cache_ram: Option<String>,
    #[arg(long, hide = true)]
    no_cache_idle_slots: bool,
}

/// Each slot's context when no -c is given.
const SLOT_CTX_DEFAULT: usize = muser_server::server::N_CTX_DEFAULT;

/// llama.cpp's unit of context sizes: `-c` and each slot's share are rounded up to it.
const CTX_PAD: usize = 256;

impl LlamaArgs {
    /// Each slot's context from `-c` (the total, llama-server's meaning) and the slot count,
    /// as llama.cpp sizes it: the total rounded up to a multiple of 256, divided among the
    /// slots, the share rounded up to a multiple of 256 again; with `--kv-unified` the whole
    /// rounded total. No -c: [`SLOT_CTX_DEFAULT`] per slot.
    pub fn slot_ctx(&self, total: Option<usize>, n_slots: usize) -> usize {
        let Some(total) = total else {
            return SLOT_CTX_DEFAULT;
        };
        let total = total.next_multiple_of(CTX_PAD);
        if self.kv_unified {
            total
        } else {
            (total / n_slots.max(1)).next_multiple_of(CTX_PAD)
        }
    }

    /// Applies the flags that have a meaning here to `cfg` (after its API key is set: the
    /// default CORS origins depend on it); prints the ones that do not, and refuses values
    /// Muser does not implement.
    pub fn apply(self, cfg: &mut ServeConfig) -> anyhow::Result<()> {
        if self.no_mmproj {
            cfg.mmproj = None;
        }
        let list = |names: &Option<String>| -> Vec<String> {
            names
                .iter()
                .flat_map(|n| n.split(','))
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .collect()
        };
        cfg.aliases = list(&self.alias);
        cfg.tags = list(&self.tags);
        cfg.chat_template = match (&self.chat_template, &self.chat_template_file) {
            (Some(src), _) if src.contains("{%") || src.contains("{{") => Some(src.clone()),
            (Some(name), _) => match muser_text::builtin_template(name) {
                Some(src) => Some(src.to_string()),
                None => anyhow::bail!(
                    "--chat-template {name}: Muser's built-in templates are {}; give any other as Jinja source or with --chat-template-file",
                    muser_text::BUILTIN_TEMPLATES
                        .iter()
                        .map(|(n, _)| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            },
            (None, Some(path)) => Some(read_template(path)?),
            (None, None) => None,
        };
        cfg.n_predict = match self.n_predict {
            None | Some(-1) => None,
            Some(n) => Some(
                u32::try_from(n)
                    .ok()
                    .context("-n/--n-predict must be -1 or a token count")?,
            ),
        };
        cfg.sampling = self.sampling()?;
        cfg.grammar = match (&self.grammar, &self.grammar_file) {
            (Some(src), _) => Some(src.clone()),
            (None, Some(path)) => Some(read_grammar(path)?),
            (None, None) => None,
        };
        if let Some(src) = &cfg.grammar {
            muser_engine::constraint::gbnf::compile(src)?;
        }
        cfg.sleep_idle = match self.sleep_idle_seconds {
            None | Some(-1) => None,
            Some(n) if n >= 1 => Some(std::time::Duration::from_secs(n as u64)),
            Some(n) => anyhow::bail!("--sleep-idle-seconds {n}: give seconds (at least 1) or -1"),
        };
        cfg.slots_endpoint = !self.no_slots;
        cfg.metrics_endpoint = self.metrics;
        cfg.rerank_endpoint = self.rerank;
        cfg.cors.origins = match &self.cors_origins {
            Some(spec) => muser_server::cors::Origins::parse(spec).map_err(anyhow::Error::msg)?,
            None => muser_server::cors::Origins::default_for(cfg.api_key.is_some()),
        };
        if let Some(m) = &self.cors_methods {
            cfg.cors.methods = m.clone();
        }
        if let Some(h) = &self.cors_headers {
            cfg.cors.headers = h.clone();
        }
        cfg.cors.credentials = self.cors_credentials || !self.no_cors_credentials;
        cfg.pooling = match self.pooling.as_deref() {
            None | Some("last" | "rank") => muser_engine::Pooling::Last,
            Some("mean") => muser_engine::Pooling::Mean,
            Some("none") => muser_engine::Pooling::None,
            Some(p) => anyhow::bail!(
                "--pooling {p}: Muser pools last (also for rank: /rerank scores by similarity), mean or none"
            ),
        };
        for (flag, ty) in [
            ("--cache-type-k", &self.cache_type_k),
            ("--cache-type-v", &self.cache_type_v),
        ] {
            if let Some(t) = ty.as_deref().filter(|t| *t != "f16") {
                anyhow::bail!("{flag} {t}: Muser's KV cache is f16");
            }
        }
        let ignored = self.ignored();
        if !ignored.is_empty() {
            eprintln!(
                "muser: llama-server flags accepted without effect: {}",
                ignored.join("; ")
            );
        }
        Ok(())
    }

    /// The server's default sampling settings, checked like a request's.
    fn sampling(&self) -> anyhow::Result<SamplingParams> {
        let opts = muser_server::gen::SamplingOptions {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
            ..Default::default()
        };
        opts.to_params(&SamplingParams::default())
            .map_err(|e| anyhow::anyhow!("sampling flags: {}", e.message))
    }

    /// The accepted flags that change nothing here, each with the reason.
    fn ignored(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut note = |on: bool, what: &str| {
            if on {
                out.push(what.to_string());
            }
        };
        note(
            self.n_gpu_layers.is_some(),
            "-ngl (the whole model runs where --device says)",
        );
        note(
            self.batch_size.is_some() || self.ubatch_size.is_some(),
            "-b/-ub (prefill runs in Muser's own chunks)",
        );
        note(self.cont_batching, "--cont-batching (always on)");
        note(
            self.swa_full,
            "--swa-full (no sliding-window cache to size)",
        );
        note(
            self.jinja || self.no_jinja,
            "--jinja/--no-jinja (templates are always Jinja)",
        );
        note(
            self.reasoning_format.is_some(),
            "--reasoning-format (reasoning is split out for Muse models only)",
        );
        note(
            self.embedding,
            "--embedding (the embedding routes are always on)",
        );
        note(
            self.no_metrics,
            "--no-metrics (/metrics is off unless --metrics)",
        );
        note(self.no_webui, "--no-webui (the dashboard stays at /)");
        note(
            self.offline,
            "--offline (nothing is downloaded with --model)",
        );
        note(self.verbose, "--verbose (set RUST_LOG=debug)");
        note(
            self.backend_sampling,
            "--backend_sampling (sampling runs on the CPU, with the same probabilities)",
        );
        note(
            self.cache_ram.is_some() || self.no_cache_idle_slots,
            "--cache-ram/--no-cache-idle-slots (an idle slot keeps its K/V; prompts across slots and restarts: --prompt-cache DIR with --prompt-cache-ram-mib)",
        );
        out
    }
}

/// A grammar file, read no further than the longest grammar (a longer one is refused).
fn read_grammar(path: &std::path::Path) -> anyhow::Result<String> {
    use std::io::Read;
    let mut src = String::new();
    std::fs::File::open(path)
        .and_then(|f| {
            f.take(muser_engine::constraint::gbnf::MAX_TEXT as u64 + 1)
                .read_to_string(&mut src)
        })
        .with_context(|| format!("--grammar-file {}", path.display()))?;
    Ok(src)
}

/// A template file, bounded like the templates read from a GGUF.
fn read_template(path: &std::path::Path) -> anyhow::Result<String> {
    const TEMPLATE_BYTES_MAX: u64 = 1 << 20;
    let len = std::fs::metadata(path)
        .with_context(|| format!("--chat-template-file {}", path.display()))?
        .len();
    anyhow::ensure!(
        len <= TEMPLATE_BYTES_MAX,
        "--chat-template-file {}: {len} bytes, more than {TEMPLATE_BYTES_MAX}",
        path.display()
    );
    std::fs::read_to_string(path)
        .with_context(|| format!("--chat-template-file {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn metrics_are_off_unless_asked_and_pooling_maps_onto_the_engine() {
        let applied = |args: LlamaArgs| {
            let mut cfg = ServeConfig::new(PathBuf::from("m.gguf"));
            args.apply(&mut cfg).map(|()| cfg)
        };
        let cfg = applied(LlamaArgs::default()).unwrap();
        assert!(!cfg.metrics_endpoint);
        assert_eq!(cfg.pooling, muser_engine::Pooling::Last);
        let cfg = applied(LlamaArgs {
            metrics: true,
            pooling: Some("mean".into()),
            ..Default::default()
        })
        .unwrap();
        assert!(cfg.metrics_endpoint);
        assert_eq!(cfg.pooling, muser_engine::Pooling::Mean);
        for (p, want) in [
            ("none", muser_engine::Pooling::None),
            ("rank", muser_engine::Pooling::Last),
        ] {
            let args = LlamaArgs {
                pooling: Some(p.into()),
                ..Default::default()
            };
            assert_eq!(applied(args).unwrap().pooling, want);
        }
        let cls = LlamaArgs {
            pooling: Some("cls".into()),
            ..Default::default()
        };
        assert!(applied(cls)
            .unwrap_err()
            .to_string()
            .contains("--pooling cls"));
    }

    #[test]
    fn ctx_size_is_shared_among_slots_as_llama_server_shares_it() {
        let args = LlamaArgs::default();
        assert_eq!(args.slot_ctx(None, 4), SLOT_CTX_DEFAULT);
        assert_eq!(args.slot_ctx(Some(512), 2), 256);
        assert_eq!(args.slot_ctx(Some(4096), 4), 1024);
        assert_eq!(args.slot_ctx(Some(2048), 1), 2048);
        // rounded up to 256 twice, as llama_context rounds n_ctx and n_ctx_seq
        assert_eq!(args.slot_ctx(Some(1000), 1), 1024);
        assert_eq!(args.slot_ctx(Some(8192), 3), 2816);
        assert_eq!(args.slot_ctx(Some(100), 4), 256);
        let unified = LlamaArgs {
            kv_unified: true,
            ..Default::default()
        };
        assert_eq!(unified.slot_ctx(Some(1000), 4), 1024);
    }

    #[test]
    fn an_api_key_opens_cors_to_any_origin_unless_origins_are_given() {
        use muser_server::cors::Origins;
        let applied = |args: LlamaArgs, key: bool| {
            let mut cfg = ServeConfig::new(PathBuf::from("m.gguf"));
            cfg.api_key = key.then(|| "k".to_string());
            args.apply(&mut cfg).map(|()| cfg.cors.origins).unwrap()
        };
        assert_eq!(applied(LlamaArgs::default(), false), Origins::Localhost);
        assert_eq!(applied(LlamaArgs::default(), true), Origins::Any);
        let local = || LlamaArgs {
            cors_origins: Some("localhost".into()),
            ..Default::default()
        };
        assert_eq!(applied(local(), true), Origins::Localhost);
    }

    #[test]
    fn single_dash_spellings_become_long_flags_of_up_only() {
        assert_eq!(
            normalize(os(&[
                "muser", "up", "-np", "2", "-fa", "on", "-ngl", "99", "-c", "512"
            ])),
            os(&[
                "muser",
                "up",
                "--parallel",
                "2",
                "--flash-attn",
                "on",
                "--n-gpu-layers",
                "99",
                "-c",
                "512"
            ])
        );
        assert_eq!(
            normalize(os(&["muser", "run", "-np"])),
            os(&["muser", "run", "-np"])
        );
    }
}
