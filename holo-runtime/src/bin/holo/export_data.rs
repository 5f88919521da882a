//! `holo export-data`: rollouts as SFT or DPO datasets in the JSONL shapes TRL's trainers read.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use holo_runtime::export::dpo::{self, DpoOptions};
use holo_runtime::export::sft::{self, SftOptions};
use holo_runtime::export::{read_rollouts, Rollout};
use serde::Serialize;

use super::{EXIT_FAILURES, EXIT_USAGE};

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// `{"messages": [...]}` per trained context of each kept rollout (TRL's SFTTrainer).
    Sft,
    /// `{"prompt": [...], "chosen": [...], "rejected": [...]}` pairs (TRL's DPOTrainer).
    Dpo,
}

/// `holo export-data`'s arguments.
#[derive(clap::Args)]
pub struct ExportDataArgs {
    /// A rollouts JSONL written by `holo eval` or `holo train` (rollouts.jsonl, eval_rollouts.jsonl),
    /// or a run folder (its rollouts.jsonl).
    pub path: PathBuf,
    #[arg(long, value_enum)]
    pub format: Format,
    /// The JSONL file to write, one example per line.
    #[arg(long)]
    pub out: PathBuf,
    /// sft: keep the rollouts whose total reward is at least this (may be negative).
    #[arg(long, allow_negative_numbers = true)]
    pub min_reward: Option<f64>,
    /// sft: keep at most this many rollouts of each row's group (one data row at one training step),
    /// highest reward first, ties by rollout index.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub top_k: Option<u64>,
    /// sft: write `{"prompt": [...], "completion": [...]}` instead of `messages`: the prompt is the
    /// messages before the first sampled assistant turn, the completion that turn and every later one.
    #[arg(long)]
    pub prompt_completion: bool,
    /// dpo: the least reward margin between chosen and rejected (default: any margin above 0).
    #[arg(long, allow_negative_numbers = true)]
    pub min_margin: Option<f64>,
    /// dpo: the most pairs drawn from one row's group, largest margin (best against worst) first
    /// [default: 1].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub pairs_per_row: Option<u64>,
    /// Add the recorded token ids and loss masks (needs rollouts recorded with a model folder). sft:
    /// `input_ids` and `assistant_masks` (1 on the sampled tokens); TRL's SFTTrainer then trains on
    /// these ids as they are. dpo: `prompt_ids`, `chosen_ids`, `rejected_ids` (the names of TRL's
    /// DataCollatorForPreference) and `chosen_loss_mask`, `rejected_loss_mask`.
    #[arg(long)]
    pub tokens: bool,
}

pub fn run(args: ExportDataArgs) -> ExitCode {
    if let Err(message) = check_options(&args) {
        eprintln!("error: {message}");
        return ExitCode::from(EXIT_USAGE);
    }
    let read = match read_rollouts(&args.path) {
        Ok(read) => read,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    for bad in &read.bad_lines {
        eprintln!("warning: {}:{bad}; skipped", read.path.display());
    }
    if !read.bad_lines.is_empty() {
        eprintln!(
            "{}: {} lines skipped (not rollout records)",
            read.path.display(),
            read.bad_lines.len()
        );
    }
    let source = read.path.display().to_string();
    match export(args, read.rollouts, &source) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(EXIT_FAILURES)
        }
    }
}

/// Options of the other format are refused rather than ignored: they would not do what they say.
fn check_options(args: &ExportDataArgs) -> Result<(), String> {
    let sft_only = [
        ("--min-reward", args.min_reward.is_some()),
        ("--top-k", args.top_k.is_some()),
        ("--prompt-completion", args.prompt_completion),
    ];
    let dpo_only = [
        ("--min-margin", args.min_margin.is_some()),
        ("--pairs-per-row", args.pairs_per_row.is_some()),
    ];
    let (others, format) = match args.format {
        Format::Sft => (&dpo_only[..], "sft"),
        Format::Dpo => (&sft_only[..], "dpo"),
    };
    if let Some((option, _)) = others.iter().find(|(_, given)| *given) {
        return Err(format!("{option} does not apply to --format {format}"));
    }
    dpo::check_min_margin(args.min_margin)
}

/// Builds the examples, reports on stderr what each filter dropped, then writes them to `--out`.
fn export(args: ExportDataArgs, rollouts: Vec<Rollout>, source: &str) -> Result<(), String> {
    let written = match args.format {
        Format::Sft => {
            let options = SftOptions {
                min_reward: args.min_reward,
                top_k: args.top_k.map(|k| k as usize),
                prompt_completion: args.prompt_completion,
                tokens: args.tokens,
            };
            let (examples, report) = sft::export(rollouts, &options)?;
            eprintln!("{source}: {report}");
            write_examples(&args.out, &examples)?
        }
        Format::Dpo => {
            let options = DpoOptions {
                min_margin: args.min_margin,
                pairs_per_row: args.pairs_per_row.unwrap_or(1) as usize,
                tokens: args.tokens,
            };
            let (examples, report) = dpo::export(rollouts, &options)?;
            eprintln!("{source}: {report}");
            write_examples(&args.out, &examples)?
        }
    };
    eprintln!("wrote {written} examples to {}", args.out.display());
    Ok(())
}

/// Writes one JSON object per line; nothing is written when there is no example (an empty dataset is an
/// error, not a file a trainer would fail on later).
fn write_examples<T: Serialize>(out: &Path, examples: &[T]) -> Result<usize, String> {
    if examples.is_empty() {
        return Err(format!(
            "no example left to write to {} (the counts above say what each filter dropped)",
            out.display()
        ));
    }
    let cannot = |error: std::io::Error| format!("cannot write `{}`: {error}", out.display());
    let file = std::fs::File::create(out).map_err(cannot)?;
    let mut writer = std::io::BufWriter::new(file);
    for example in examples {
        serde_json::to_writer(&mut writer, example).map_err(|error| cannot(error.into()))?;
        writer.write_all(b"\n").map_err(cannot)?;
    }
    writer.flush().map_err(cannot)?;
    Ok(examples.len())
}
