//! `muser tokenize` and `muser template`.

use std::path::PathBuf;

use anyhow::Context;
use muser_gguf::GgufFile;
use muser_text::{unix_from_date, ChatRequest, ChatTemplate, Tokenizer};

#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// The GGUF file whose tokenizer to use.
    #[arg(short, long)]
    model: PathBuf,
    /// Treat control tokens written in the text as plain text (user-defined tokens still match).
    #[arg(long)]
    no_special: bool,
    /// Do not add BOS even if the model asks for it.
    #[arg(long)]
    no_bos: bool,
    /// The text to tokenize.
    text: String,
}

#[derive(clap::Args)]
pub struct TemplateArgs {
    /// The GGUF file whose chat template to use (ChatML when it has none, as llama.cpp does).
    #[arg(short, long)]
    model: PathBuf,
    /// Fix the date `strftime_now` sees (YYYY-MM-DD, UTC) instead of today.
    #[arg(long)]
    date: Option<String>,
    /// A messages array, or {"messages", "tools"?, "add_generation_prompt"?,
    /// "reasoning_effort"?, "chat_template_kwargs"?}.
    conversation: PathBuf,
}

fn open(path: &std::path::Path) -> anyhow::Result<(GgufFile, Tokenizer)> {
    let gguf = GgufFile::open(path).with_context(|| format!("reading {}", path.display()))?;
    let tok =
        Tokenizer::from_gguf(&gguf).with_context(|| format!("tokenizer of {}", path.display()))?;
    Ok((gguf, tok))
}

/// Prints the ids like `llama-tokenize --ids`: `[1, 2, 3]`.
pub fn tokenize(args: TokenizeArgs) -> anyhow::Result<()> {
    let (_, tok) = open(&args.model)?;
    let add_special = tok.add_bos() && !args.no_bos;
    let ids = tok.encode(&args.text, add_special, !args.no_special);
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    println!("[{}]", list.join(", "));
    Ok(())
}

/// Prints the rendered prompt exactly (no newline added).
pub fn template(args: TemplateArgs) -> anyhow::Result<()> {
    let (gguf, tok) = open(&args.model)?;
    let text = std::fs::read_to_string(&args.conversation)
        .with_context(|| format!("reading {}", args.conversation.display()))?;
    let mut req = ChatRequest::from_json_str(&text)?;
    if let Some(d) = &args.date {
        req.now_unix_s =
            Some(unix_from_date(d).with_context(|| format!("--date {d}: expected YYYY-MM-DD"))?);
    }
    let tmpl = ChatTemplate::from_gguf_or_chatml(&gguf, &tok)?;
    print!("{}", tmpl.render(&req)?);
    Ok(())
}
