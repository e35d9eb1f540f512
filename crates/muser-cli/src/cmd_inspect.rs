//! `muser inspect FILE.gguf`: architecture, geometry, tokenizer, tensor table and totals.
//! The report is built by `muser_gguf::report`; this only prints it.

use std::path::PathBuf;

use muser_gguf::report::Report;
use muser_gguf::GgufFile;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file.
    file: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let file = GgufFile::open(&args.file)?;
    print!("{}", Report::new(&file));
    Ok(())
}
