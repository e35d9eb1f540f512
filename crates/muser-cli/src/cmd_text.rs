//! `muser tokenize` and `muser template`.

#[derive(clap::Args)]
pub struct TokenizeArgs {}

#[derive(clap::Args)]
pub struct TemplateArgs {}

pub fn tokenize(_args: TokenizeArgs) -> anyhow::Result<()> {
    anyhow::bail!("`muser tokenize` is not built yet")
}

pub fn template(_args: TemplateArgs) -> anyhow::Result<()> {
    anyhow::bail!("`muser template` is not built yet")
}
