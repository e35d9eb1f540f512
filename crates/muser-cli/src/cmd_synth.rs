//! `muser synth`: write a synthetic Muse Glimmer GGUF (random weights, real geometry).
//! The work is in `muser_model::synth`; this parses arguments and draws the progress bar.

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use muser_gguf::report::thousands;
use muser_gguf::GgufFile;
use muser_model::synth::presets::{preset, PRESET_NAMES};
use muser_model::synth::{dflash, Plan, Vocab, WeightType};
use muser_text::muse;

#[derive(clap::Args)]
pub struct Args {
    /// Model geometry; a `vision-*` preset writes a Muse Glimmer image projector (an
    /// `--mmproj` file, `--type f32|f16`) for the text preset of its width; a `dflash-*`
    /// preset writes a DFlash drafter (a `--dflash` file, `--type f32|f16`) for `--target`.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(
        PRESET_NAMES.iter().chain(&muser_vision::synth::PRESET_NAMES).chain(&dflash::PRESET_NAMES)))]
    preset: String,
    /// Tensor types (q4_k_m: llama-quantize's mix; norms are always f32).
    #[arg(long = "type", value_name = "TYPE", default_value = "q4_k",
          value_parser = clap::builder::PossibleValuesParser::new(WeightType::NAMES))]
    ty: String,
    /// Output file.
    #[arg(short = 'o', long)]
    output: PathBuf,
    /// Seed of the random weights (same seed, same bytes).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Copy the tokenizer of this GGUF, add the Muse special tokens and chat template.
    /// Without it the file has no tokenizer (enough for llama-bench, not for text).
    #[arg(long, value_name = "DONOR.gguf")]
    vocab_from: Option<PathBuf>,
    /// Write the metadata only (geometry and tokenizer, no tensors): a small vocabulary file
    /// that `--vocab-from` takes as a donor, e.g. to carry a real tokenizer to another machine.
    #[arg(long)]
    vocab_only: bool,
    /// The target model a `dflash-*` drafter is made for (its width, depth and tokenizer).
    #[arg(long, value_name = "TARGET.gguf")]
    target: Option<PathBuf>,
}

/// The `--type` of a projector or drafter: f32 or f16 matrices.
fn float_type(ty: &str, what: &str) -> anyhow::Result<muser_gguf::GgmlType> {
    match ty {
        "f32" => Ok(muser_gguf::GgmlType::F32),
        "f16" => Ok(muser_gguf::GgmlType::F16),
        t => anyhow::bail!("a {what}'s matrices are f32 or f16, not {t}"),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(p) = dflash::preset(&args.preset) {
        let ty = float_type(&args.ty, "drafter")?;
        let Some(target) = &args.target else {
            anyhow::bail!("--preset {} needs --target TARGET.gguf", p.name);
        };
        let t = GgufFile::open(target).with_context(|| format!("{}", target.display()))?;
        dflash::write_drafter(&args.output, &p, &t, ty, args.seed)?;
        eprintln!(
            "wrote {} (drafter {}, for {})",
            args.output.display(),
            p.name,
            target.display()
        );
        return Ok(());
    }
    if let Some(p) = muser_vision::synth::preset(&args.preset) {
        let ty = float_type(&args.ty, "projector")?;
        muser_vision::synth::write_projector(&args.output, &p, ty, args.seed)?;
        eprintln!(
            "wrote {} (projector {}, for the text preset {})",
            args.output.display(),
            p.name,
            p.text
        );
        return Ok(());
    }
    let preset = preset(&args.preset)?;
    let weight_type = WeightType::from_name(&args.ty)?;
    let vocab = match &args.vocab_from {
        Some(path) => {
            let donor = GgufFile::open(path)?;
            // Muse's own tokens, and `<|endoftext|>` (an end-of-generation token by its text).
            let mut specials = muse::SPECIAL_TOKENS.to_vec();
            specials.push("<|endoftext|>");
            let vocab = Vocab::from_donor(&donor, &specials, muse::CHAT_TEMPLATE)
                .with_context(|| format!("vocabulary from {}", path.display()))?;
            Some(vocab)
        }
        None => None,
    };
    let mut plan = Plan::new(preset, weight_type, args.seed, vocab);
    if args.vocab_only {
        plan = plan.without_tensors();
    }
    eprintln!(
        "{} ({}): {} parameters, {} bytes of tensors -> {}",
        plan.preset.name,
        weight_type.name(),
        thousands(plan.n_params()),
        thousands(plan.n_bytes()),
        args.output.display()
    );
    let bar = ProgressBar::new(plan.n_bytes()).with_style(ProgressStyle::with_template(
        "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
    )?);
    plan.write_file(&args.output, &mut |p| {
        bar.set_position(p.bytes_done);
        bar.set_message(p.tensor.to_string());
    })?;
    bar.finish_and_clear();
    eprintln!("wrote {}", args.output.display());
    Ok(())
}
