//! `muser run`: one generation from the command line.
//!
//! Only generated text goes to stdout, flushed piece by piece; everything else (load time,
//! prompt and generation speed at the end, as llama.cpp prints its timings) goes to stderr.
//!
//! - Without `--chat` the prompt is tokenized as is, with the model's BOS and with special
//!   tokens parsed (`<|im_start|>` in the text becomes that token).
//! - `--chat` renders the model's chat template around one user message (and `--system`). For
//!   Muse Glimmer models the output is split by the Muse parser: reasoning goes to stderr
//!   under a `[reasoning]` header (dimmed on a terminal), the answer to stdout.
//! - Models without a tokenizer (synthetic ones) take the prompt as a JSON array of token ids
//!   (`-p "[1, 2, 3]"`, also accepted with `--ids` for any model) and print the generated ids
//!   as a JSON array.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::device::{self, Device};
use anyhow::{bail, Context};
use muser_engine::{
    place_images, Engine, EngineConfig, Event, GenerateRequest, MediaMarkers, PromptImage,
    SamplingParams, Timings,
};
use muser_model::{Arch, Model};
use muser_vision::{Encoder, Limits, Projector, IMAGE_BEGIN, IMAGE_END};

/// The marker of an image in a prompt (llama.cpp's `mtmd_default_marker`).
const MEDIA_MARKER: &str = "<__media__>";
use muser_text::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model file.
    #[arg(short = 'm', long = "model")]
    model: PathBuf,
    /// Prompt text (a JSON array of token ids with `--ids` or for models without a tokenizer).
    #[arg(short = 'p', long = "prompt")]
    prompt: String,
    /// Tokens to generate; -1: until end of generation or the context is full.
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_negative_numbers = true)]
    n_predict: i64,
    /// Context size in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    ctx_size: usize,
    /// Compute threads; 0: one per core.
    #[arg(short = 't', long = "threads", default_value_t = 0)]
    threads: usize,
    /// Where the model runs: cpu; cuda (muse-glimmer through the fused forward, others op by
    /// op); cuda-ops (always op by op). CUDA needs a muser built with `--features cuda`.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    #[command(flatten)]
    numerics: device::NumericsArgs,
    /// Temperature; 0 or less samples greedily.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temp: f32,
    #[arg(long = "top-k", default_value_t = 40, allow_negative_numbers = true)]
    top_k: i32,
    #[arg(long = "top-p", default_value_t = 0.95)]
    top_p: f32,
    #[arg(long = "min-p", default_value_t = 0.05)]
    min_p: f32,
    #[arg(long = "typical", default_value_t = 1.0)]
    typical: f32,
    /// Random seed; -1: a fresh one.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    seed: i64,
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Tokens the repeat penalty looks back over; -1: the whole context.
    #[arg(
        long = "repeat-last-n",
        default_value_t = 64,
        allow_negative_numbers = true
    )]
    repeat_last_n: i32,
    #[arg(
        long = "presence-penalty",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    presence_penalty: f32,
    #[arg(
        long = "frequency-penalty",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    frequency_penalty: f32,
    /// Apply the model's chat template to the prompt as a user message.
    #[arg(long)]
    chat: bool,
    /// System message for `--chat`.
    #[arg(short = 's', long = "system")]
    system: Option<String>,
    /// Reasoning effort passed to the chat template (Muse: low, medium, high).
    #[arg(long = "reasoning-effort")]
    reasoning_effort: Option<String>,
    /// The prompt is a JSON array of token ids.
    #[arg(long)]
    ids: bool,
    /// Print control tokens (e.g. the end-of-turn token) in the output.
    #[arg(long)]
    special: bool,
    #[command(flatten)]
    spec: crate::spec::SpecArgs,
    /// Image projector (a Muse Glimmer `mmproj` GGUF) for `--image`.
    #[arg(long, value_name = "FILE", requires = "image")]
    mmproj: Option<PathBuf>,
    /// An image (PNG, JPEG, WebP) for the prompt, placed at its next `<__media__>` marker
    /// (all at the start when the prompt has none, as llama-mtmd-cli does). Repeatable.
    #[arg(long, value_name = "FILE", requires = "mmproj")]
    image: Vec<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let numerics = args.numerics.resolve(args.device)?;
    let model = device::load(&args.model, args.device, args.threads, numerics)?;
    let tokenizer = load_tokenizer(&model)?.map(Arc::new);
    let info = model.info();
    eprintln!(
        "muser: loaded {} ({}, {} layers, n_embd {}, vocab {}) in {:.0} ms, {}, {} threads, \
         numerics {}",
        args.model.display(),
        info.arch.name(),
        info.n_layer,
        info.n_embd,
        info.n_vocab,
        t0.elapsed().as_secs_f64() * 1e3,
        args.device.name(),
        model.threads(),
        model.numerics_tag().as_deref().unwrap_or("of the device"),
    );
    let is_muse = info.arch == Arch::MuseGlimmer;

    let mut images = Vec::new();
    let prompt = match (&tokenizer, args.ids) {
        (Some(tok), false) if !args.image.is_empty() => {
            let (ids, placed) = image_prompt(&args, &model, tok)?;
            images = placed;
            ids
        }
        (Some(tok), false) => text_prompt(&args, &model, tok)?,
        _ => {
            if args.chat {
                bail!("--chat needs a tokenizer; this prompt is token ids");
            }
            parse_ids(&args.prompt)?
        }
    };

    let model = Arc::new(model);
    let cfg = EngineConfig {
        n_slots: 1,
        n_ctx: args.ctx_size,
        queue_max: 1,
        request_timeout: None,
        spec: args.spec.config(args.device)?,
        dflash: args.spec.dflash()?,
        ..Default::default()
    };
    let engine = match &tokenizer {
        Some(tok) => Engine::start(model, tok.clone(), cfg)?,
        None => Engine::start_without_tokenizer(model, cfg)?,
    };
    let req = GenerateRequest {
        prompt,
        params: sampling(&args),
        max_tokens: u32::try_from(args.n_predict).ok(),
        // the Muse parser reads the message markers, which are control tokens
        special: args.special || (args.chat && is_muse),
        cache_prompt: false,
        images,
        ..Default::default()
    };
    let mut rx = engine.submit(req)?;

    let mut out = Output::new(tokenizer.is_none(), args.chat && is_muse);
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, text, .. } => out.token(id, &text)?,
            Event::Embedding(_) | Event::Progress(_) => {}
            Event::Done {
                reason,
                n_prompt,
                n_cached,
                n_gen,
                timings,
            } => {
                out.finish()?;
                eprintln!();
                report(
                    n_prompt - n_cached,
                    n_gen,
                    timings,
                    engine.stats().draft_row_cost,
                );
                eprintln!("muser: stopped by {reason:?}");
                return Ok(());
            }
            Event::Error(e) => bail!("generation failed: {e}"),
        }
    }
    bail!("the engine stopped before the generation finished")
}

/// The model's tokenizer, or `None` for a GGUF that declares none (synthetic models).
fn load_tokenizer(model: &Model) -> anyhow::Result<Option<Tokenizer>> {
    match model.gguf().get_str("tokenizer.ggml.model") {
        Err(_) | Ok("none") => Ok(None),
        Ok(_) => Ok(Some(
            Tokenizer::from_gguf(model.gguf()).context("reading the tokenizer")?,
        )),
    }
}

fn text_prompt(args: &Args, model: &Model, tok: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    if !args.chat {
        return Ok(tok.encode(&args.prompt, true, true));
    }
    let text = chat::render(model, tok, args, &args.prompt)?;
    // as llama-server tokenizes a rendered conversation
    Ok(tok.encode(&text, true, true))
}

/// The prompt with `--image`s encoded by `--mmproj` and placed at their markers.
fn image_prompt(
    args: &Args,
    model: &Model,
    tok: &Tokenizer,
) -> anyhow::Result<(Vec<u32>, Vec<PromptImage>)> {
    let path = args.mmproj.as_deref().context("--image needs --mmproj")?;
    let projector = Projector::open_for(path, model.info().n_embd)?;
    let encoder = Encoder::new(
        projector,
        args.device.image_device(),
        model.threads().max(1),
    )?;
    let mut images = Vec::new();
    for file in &args.image {
        let t0 = Instant::now();
        let bytes = std::fs::read(file).with_context(|| format!("--image {}", file.display()))?;
        let img = encoder
            .embed(&bytes, &Limits::default())
            .with_context(|| format!("--image {}", file.display()))?;
        eprintln!(
            "muser: {}: {} image tokens, encoded in {:.0} ms",
            file.display(),
            img.embeddings.n_tokens(),
            t0.elapsed().as_secs_f64() * 1e3
        );
        images.push(PromptImage {
            at: 0,
            n_tokens: img.embeddings.n_tokens(),
            values: Arc::new(img.embeddings.data),
            digest: img.digest,
        });
    }
    let marker = MEDIA_MARKER;
    let mut prompt = args.prompt.clone();
    if !prompt.contains(marker) {
        prompt = marker.repeat(images.len()) + &prompt;
    }
    let text = match args.chat {
        true => chat::render(model, tok, args, &prompt)?,
        false => prompt,
    };
    let markers = MediaMarkers {
        marker: marker.to_string(),
        begin: IMAGE_BEGIN,
        end: IMAGE_END,
    };
    let ids = place_images(tok, &text, true, &markers, &mut images, usize::MAX)?;
    Ok((ids, images))
}

fn sampling(args: &Args) -> SamplingParams {
    SamplingParams {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        typical_p: args.typical,
        repeat_penalty: args.repeat_penalty,
        repeat_last_n: args.repeat_last_n,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        seed: u64::try_from(args.seed).ok(),
        ..Default::default()
    }
}

/// `[1, 2, 3]` (brackets optional, commas or spaces between ids).
fn parse_ids(s: &str) -> anyhow::Result<Vec<u32>> {
    let inner = s.trim().trim_start_matches('[').trim_end_matches(']');
    inner
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .with_context(|| format!("{t:?} is not a token id (the prompt must be ids)"))
        })
        .collect()
}

/// llama.cpp-style timings on stderr.
fn report(n_prompt: usize, n_gen: usize, t: Timings, draft_row_cost: f32) {
    let rate = |n: usize, ms: f64| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    eprintln!(
        "muser: prompt eval {:>8.2} ms / {:>5} tokens ({:>8.2} tokens per second)",
        t.prompt_ms,
        n_prompt,
        rate(n_prompt, t.prompt_ms)
    );
    // the first token comes with the prompt pass; the rest are one decode step each
    let n_eval = n_gen.saturating_sub(1);
    eprintln!(
        "muser:        eval {:>8.2} ms / {:>5} runs   ({:>8.2} tokens per second)",
        t.gen_ms,
        n_eval,
        rate(n_eval, t.gen_ms)
    );
    if t.draft_n > 0 {
        eprintln!(
            "muser:       draft {:>5} tokens, {:>5} accepted ({:.1}%); a verification row costs {:.2} of a decode step",
            t.draft_n,
            t.draft_n_accepted,
            100.0 * t.draft_n_accepted as f64 / t.draft_n as f64,
            draft_row_cost
        );
    }
}

/// Where generated pieces go.
struct Output {
    ids_only: bool,
    n_ids: usize,
    muse: Option<chat::MuseView>,
}

impl Output {
    fn new(ids_only: bool, muse: bool) -> Self {
        Output {
            ids_only,
            n_ids: 0,
            muse: muse.then(chat::MuseView::new),
        }
    }

    fn token(&mut self, id: u32, text: &str) -> anyhow::Result<()> {
        let mut stdout = std::io::stdout().lock();
        if self.ids_only {
            let sep = if self.n_ids == 0 { "[" } else { ", " };
            write!(stdout, "{sep}{id}")?;
            self.n_ids += 1;
        } else if let Some(m) = &mut self.muse {
            m.push(text)?;
        } else {
            stdout.write_all(text.as_bytes())?;
        }
        stdout.flush()?;
        Ok(())
    }

    fn finish(&mut self) -> anyhow::Result<()> {
        let mut stdout = std::io::stdout().lock();
        if self.ids_only {
            writeln!(stdout, "{}]", if self.n_ids == 0 { "[" } else { "" })?;
        } else if let Some(m) = &mut self.muse {
            m.finish()?;
        } else {
            writeln!(stdout)?;
        }
        stdout.flush()?;
        Ok(())
    }
}

/// Chat templating and the Muse reasoning/answer split.
mod chat {
    use super::*;
    use muser_text::muse::{MuseParser, ParseEvent};
    use muser_text::{ChatRequest, ChatTemplate};

    /// The prompt text for `--chat`: the model's template (ChatML when it has none) around
    /// the system message and the user message `user`.
    pub fn render(
        model: &Model,
        tok: &Tokenizer,
        args: &Args,
        user: &str,
    ) -> anyhow::Result<String> {
        let template = ChatTemplate::from_gguf_or_chatml(model.gguf(), tok)
            .context("reading the chat template")?;
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(message("system", system));
        }
        messages.push(message("user", user));
        let mut conversation = format!("{{\"messages\": [{}]", messages.join(", "));
        if let Some(effort) = &args.reasoning_effort {
            conversation.push_str(&format!(", \"reasoning_effort\": {}", json_string(effort)));
        }
        conversation.push('}');
        let req = ChatRequest::from_json_str(&conversation).context("building the conversation")?;
        template.render(&req).context("rendering the chat template")
    }

    fn message(role: &str, content: &str) -> String {
        format!(
            "{{\"role\": \"{role}\", \"content\": {}}}",
            json_string(content)
        )
    }

    /// `s` as a JSON string literal.
    pub fn json_string(s: &str) -> String {
        let mut out = String::with_capacity(s.len() + 2);
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
        out
    }

    /// Shows Muse output: reasoning on stderr under a `[reasoning]` header (dimmed on a
    /// terminal), the answer on stdout, tool calls on stdout as `[tool call] name(args)`.
    pub struct MuseView {
        parser: MuseParser,
        dim: bool,
        in_reasoning: bool,
    }

    impl MuseView {
        pub fn new() -> Self {
            MuseView {
                parser: MuseParser::new(None),
                dim: std::io::stderr().is_terminal(),
                in_reasoning: false,
            }
        }

        pub fn push(&mut self, text: &str) -> anyhow::Result<()> {
            let events = self.parser.push(text);
            self.show(events)
        }

        pub fn finish(&mut self) -> anyhow::Result<()> {
            let events = self.parser.finish();
            self.show(events)?;
            self.end_reasoning()?;
            writeln!(std::io::stdout())?;
            Ok(())
        }

        fn show(&mut self, events: Vec<ParseEvent>) -> anyhow::Result<()> {
            for ev in events {
                match ev {
                    ParseEvent::Reasoning(r) => {
                        let mut err = std::io::stderr().lock();
                        if !self.in_reasoning {
                            self.in_reasoning = true;
                            let dim = if self.dim { "\x1b[2m" } else { "" };
                            writeln!(err, "{dim}[reasoning]")?;
                        }
                        err.write_all(r.as_bytes())?;
                        err.flush()?;
                    }
                    ParseEvent::Content(c) => {
                        self.end_reasoning()?;
                        std::io::stdout().write_all(c.as_bytes())?;
                    }
                    ParseEvent::ToolCall {
                        name,
                        arguments_json,
                    } => {
                        self.end_reasoning()?;
                        writeln!(std::io::stdout(), "[tool call] {name}({arguments_json})")?;
                    }
                }
            }
            Ok(())
        }

        fn end_reasoning(&mut self) -> anyhow::Result<()> {
            if self.in_reasoning {
                self.in_reasoning = false;
                let reset = if self.dim { "\x1b[0m" } else { "" };
                write!(std::io::stderr(), "{reset}\n[answer]\n")?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(
            chat::json_string("a\"b\\c\nd\u{1}"),
            "\"a\\\"b\\\\c\\nd\\u0001\""
        );
    }

    #[test]
    fn ids_parse_with_or_without_brackets() {
        assert_eq!(parse_ids("[1, 2,3]").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_ids(" 4 5 ").unwrap(), vec![4, 5]);
        assert_eq!(parse_ids("[]").unwrap(), Vec::<u32>::new());
        assert!(parse_ids("[1, x]").is_err());
        assert!(parse_ids("[-1]").is_err());
    }
}
