//! `holo sft`: supervised fine-tuning of a local model on a JSONL file in TRL's SFT formats (what
//! `holo export-data --format sft` writes); options are TRL's `SFTConfig` names, from `--config sft.toml`
//! and from `--<name-in-kebab-case> VALUE` flags.

use std::path::PathBuf;
use std::process::ExitCode;

use holo_runtime::train::report::plot;
use holo_runtime::train::sft::{SftConfig, SftTrainer, Tokenizing};
use holo_runtime::train::{plan, RunOptions, TrainError};

use super::options::{self, Options};
use super::{EXIT_FAILURES, EXIT_USAGE};

/// `holo sft`'s own arguments (the options are split off before clap sees them).
#[derive(clap::Args)]
pub struct SftArgs {
    /// The examples, one JSON object per line: `messages`, `prompt` and `completion`, `text`, or
    /// `input_ids` (with `assistant_masks`), as TRL's SFTTrainer reads them.
    pub file: PathBuf,
    /// The model to train: a Hugging Face folder of a family README's "Local models" lists
    /// (config.json, safetensors, tokenizer.json and a chat template), or a `.gguf` file of qwen2,
    /// qwen3, qwen3moe, llama, smollm3, olmo2 (OLMo 2 and 3), gemma2, gemma3 or phi3 (dequantized to f32, or
    /// with --quantized its projections kept in their blocks under LoRA).
    #[arg(long)]
    pub model: PathBuf,
    /// The run folder: metrics.jsonl, TensorBoard events, checkpoints, plots.
    #[arg(long)]
    pub out: PathBuf,
    /// A TOML file of options (TRL's SFTConfig names; see `holo sft --help`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue the run in --out from its newest checkpoint (same file and options); a run killed
    /// before its first checkpoint starts over.
    #[arg(long)]
    pub resume: bool,
    /// cpu, cuda, cuda:N, metal or metal:N (cuda and metal need holo built with that feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The precision the model trains in: f32, or bf16 (weights, gradients and AdamW's moments; LoRA
    /// adapters stay f32). Default: f32 on the CPU, bf16 on CUDA (docs/cuda.md, "Precision").
    #[arg(long)]
    pub dtype: Option<String>,
    /// With a `.gguf` --model: keep its layers' quantized projections (Q4_0, Q8_0, Q2_K–Q6_K) in the
    /// file's blocks, frozen, and train LoRA adapters over them (QLoRA; `use_peft = true`, full
    /// fine-tuning is refused), as `holo train --quantized` does. On the CPU, in f32.
    #[arg(long)]
    pub quantized: bool,
}

/// The help text after `holo sft`'s arguments: every option with its default.
pub fn options_help() -> String {
    options::options_help::<SftConfig>("; `--recompute` is `--gradient-checkpointing true`")
}

pub fn run(args: SftArgs, options: Options) -> ExitCode {
    let config: SftConfig = match options::build(args.config.as_deref(), &options, &[], &[]) {
        Ok(config) => config,
        Err(error) => return usage(error),
    };
    let planned = match plan_memory(&args, &config) {
        Ok(planned) => planned,
        Err(message) => return usage(message),
    };
    let policy = match options::training_policy(
        &args.model,
        &args.device,
        args.dtype.as_deref(),
        args.quantized,
    ) {
        Ok(policy) => policy,
        Err(message) => return usage(message),
    };
    let dataset = match (Tokenizing {
        tokenizer: &policy.tokenizer,
        template: &policy.template,
        vocab_size: policy.model.config.vocab_size,
        config: &config,
    })
    .read(&args.file)
    {
        Ok(dataset) => dataset,
        Err(message) => return usage(message),
    };
    if !dataset.dropped.is_empty() {
        eprintln!(
            "warning: {} examples have nothing left to train after truncation to max_length {} and are left out (lines {:?})",
            dataset.dropped.len(),
            config.max_length.unwrap_or_default(),
            dataset.dropped
        );
    }
    let examples = dataset.examples;
    let options = RunOptions {
        out: args.out.clone(),
        resume: args.resume,
        progress: true,
    };
    let mut trainer = match SftTrainer::new(policy, config, options) {
        Ok(trainer) => trainer.with_memory_plan(planned),
        Err(error) => return usage(error),
    };
    let plan = trainer.plan(examples.len());
    let tokens: usize = examples.iter().map(|e| e.trained_tokens()).sum();
    eprintln!(
        "fine-tuning on {} examples of {} ({tokens} trained tokens{}) for {} steps into {}",
        examples.len(),
        args.file.display(),
        if dataset.completion_only_loss {
            ", completions only"
        } else {
            ""
        },
        plan.total_steps,
        args.out.display()
    );
    let summary = match trainer.train(&examples) {
        Ok(summary) => summary,
        Err(TrainError::Input(message)) => return usage(message),
        Err(error) => {
            eprintln!("error: {error}");
            eprintln!(
                "note: checkpoints written so far are in {}; `--resume` continues from the newest",
                args.out.display()
            );
            return ExitCode::from(EXIT_FAILURES);
        }
    };
    let value = |key: &str| {
        summary
            .last
            .get(key)
            .map_or("-".to_string(), |value| format!("{value:.4}"))
    };
    println!(
        "== {} steps: loss {}, mean_token_accuracy {}, entropy {}",
        summary.steps,
        value("loss"),
        value("mean_token_accuracy"),
        value("entropy")
    );
    match plot::plot_run(&summary.run_dir) {
        Ok(plots) => println!(
            "metrics, TensorBoard events, checkpoints and {} plots are in {}",
            plots.len(),
            summary.run_dir.display()
        ),
        Err(message) => eprintln!("warning: no plots: {message}"),
    }
    ExitCode::SUCCESS
}

/// The run's memory plan, printed, written to the run folder and checked before the weights are
/// loaded (`holo_runtime::train::plan`); examples are bounded by the data file's lines.
fn plan_memory(args: &SftArgs, config: &SftConfig) -> Result<Option<plan::Planned>, String> {
    let device = holo_runtime::local::parse_device(&args.device)?;
    let dtype = holo_runtime::local::parse_training_dtype(args.dtype.as_deref(), &device)?;
    let training = &config.training;
    if !device.is_cpu() {
        eprintln!(
            "note: the memory plan counts host memory; on {} it is not checked",
            args.device
        );
        return Ok(None);
    }
    let examples = plan::example_tokens(&args.file)
        .map_err(|error| format!("cannot read `{}`: {error}", args.file.display()))?;
    plan::before_loading(
        &args.model,
        training.memory_check,
        training.memory_limit,
        (&args.out, args.resume),
        |sizes, tokenizer_bytes| plan::Inputs {
            quantized: args.quantized,
            ..plan::Inputs::sft(sizes, config, dtype, tokenizer_bytes, examples)
        },
    )
}

fn usage(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(EXIT_USAGE)
}
