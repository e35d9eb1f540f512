//! `muser synth` (owned by the crate that implements it; see ARCHITECTURE.md).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`muser synth` is not built yet")
}
