//! `muser tls init | issue NAME | revoke NAME`: the prefill lane's certificate authority in
//! the configuration directory (see muser-cluster's `pki`).

use std::path::PathBuf;

use anyhow::Context;
use muser_cluster::Pki;

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
    /// Create the CA (key file 0600 in a 0700 directory); never overwrites one.
    Init,
    /// Issue node NAME's certificate (server and client use), signed by the CA.
    Issue {
        name: String,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(i64).range(1..=3650))]
        days: i64,
    },
    /// Revoke every certificate issued to NAME; nodes refuse it from their next start.
    Revoke { name: String },
}

/// The configuration directory: the flag, else the default.
pub fn config_dir(flag: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match flag {
        Some(d) => Ok(d),
        None => Ok(muser_cluster::default_config_dir()?),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let pki = Pki::at(&config_dir(args.config_dir)?);
    match args.command {
        Command::Init => {
            pki.init().context("muser tls init")?;
            println!("CA created in {}", pki.dir().display());
        }
        Command::Issue { name, days } => {
            let now = time_now();
            let crt = pki.issue(&name, now, days).context("muser tls issue")?;
            println!("{}", crt.display());
        }
        Command::Revoke { name } => {
            let n = pki.revoke(&name).context("muser tls revoke")?;
            println!("revoked {n} certificate(s) of `{name}`");
        }
    }
    Ok(())
}

/// A minute ago, so a certificate is valid at once on a peer whose clock runs a little
/// behind.
fn time_now() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc() - time::Duration::minutes(1)
}
