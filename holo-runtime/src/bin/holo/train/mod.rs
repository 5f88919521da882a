//! `holo train`: GRPO on a `.hol` environment with a local model (`local.rs`) or on a Tinker service
//! (`tinker.rs`); options are TRL's `GRPOConfig` names, from `--config train.toml` and from
//! `--<name-in-kebab-case> VALUE` flags.

#[cfg(feature = "local")]
mod local;
mod tinker;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use holo_runtime::holotypes::{CodeSandbox, ToolStats};
use holo_runtime::interpreter::{read_rows, Holoware, Row};
use holo_runtime::loom::Interpreted;
use holo_runtime::train::report::plot;
use holo_runtime::train::{GrpoConfig, TrainError};

use super::options::{self, Options};
use super::{EXIT_FAILURES, EXIT_USAGE};

/// `holo train`'s own arguments (the options are split off before clap sees them).
#[derive(clap::Args)]
// Without the `local` feature, the options of the model in process are parsed and refused with it.
#[cfg_attr(not(feature = "local"), allow(dead_code))]
pub struct TrainArgs {
    /// The environment (with --rollouts atropos, only to evaluate on --eval-data).
    pub file: Option<PathBuf>,
    /// The model to train: a Hugging Face folder of a family README's "Local models" lists
    /// (config.json, safetensors, tokenizer.json and a chat template), or a `.gguf` file of qwen2,
    /// qwen3, qwen3moe, llama, smollm3, olmo2 (OLMo 2 and 3), gemma2, gemma3 or phi3 (dequantized to f32, or
    /// with --quantized its projections kept in their blocks under LoRA).
    /// With --backend tinker: the base model's name on the service.
    #[arg(long)]
    pub model: PathBuf,
    /// Where the model is trained: `local` (in this process) or `tinker` (sampling, forward/backward
    /// passes and optimizer steps on the Tinker service at --base-url; API key from TINKER_API_KEY).
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    pub backend: Backend,
    /// The Tinker service, `http(s)://host:port`, with --backend tinker.
    #[arg(long, required_if_eq("backend", "tinker"))]
    pub base_url: Option<String>,
    /// With --backend tinker: a folder with the base model's tokenizer.json and chat template (default:
    /// --model, when it is a folder).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// With --backend tinker: the loss the service computes, `importance-sampling` or `ppo` (the ratio
    /// clipped to [1 - epsilon, 1 + epsilon_high]).
    #[arg(long, value_enum, default_value_t = TinkerLoss::ImportanceSampling)]
    pub loss_fn: TinkerLoss,
    /// Training rows, one JSON object per line (not with --rollouts atropos: the environments decide
    /// the data).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Where the rollouts come from: `loom` (the trainer rolls FILE out on --data itself) or `atropos`
    /// (it registers with the Atropos API at --api and trains on its batches; `max_steps` required,
    /// `num_generations` the environments' group size).
    #[arg(long, value_enum, default_value_t = RolloutsFrom::Loom)]
    pub rollouts: RolloutsFrom,
    /// The Atropos API (`run-api`), `http://host:port`, with --rollouts atropos.
    #[arg(long, required_if_eq("rollouts", "atropos"))]
    pub api: Option<String>,
    /// Held-out rows for evaluation every `eval_steps`.
    #[arg(long)]
    pub eval_data: Option<PathBuf>,
    /// The run folder: metrics.jsonl, TensorBoard events, rollouts, checkpoints, plots.
    #[arg(long)]
    pub out: PathBuf,
    /// A TOML file of options (TRL's GRPOConfig names; see `holo train --help`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue the run in --out from its newest checkpoint (same .hol file, data and options); a run
    /// killed before its first checkpoint starts over.
    #[arg(long)]
    pub resume: bool,
    /// cpu (the default), cuda, cuda:N, metal or metal:N (cuda and metal need holo built with that
    /// feature). Not with --backend tinker, whose service chooses its devices.
    #[arg(long)]
    pub device: Option<String>,
    /// The precision the model trains in: f32, or bf16 (weights, gradients and AdamW's moments; LoRA
    /// adapters stay f32). Default: f32 on the CPU, bf16 on CUDA (docs/cuda.md, "Precision").
    #[arg(long)]
    pub dtype: Option<String>,
    /// With a `.gguf` --model: keep its layers' quantized projections (Q4_0, Q8_0, Q2_K–Q6_K) in the
    /// file's blocks, frozen, and train LoRA adapters over them (QLoRA; `use_peft = true`, full
    /// fine-tuning is refused): the base takes the blocks' bytes instead of f32's 4 a weight, each
    /// product expanding one projection's blocks for the moment it runs. The rollouts sample from the
    /// same blocks. On the CPU, in f32.
    #[arg(long)]
    pub quantized: bool,
    /// Run model-written code (CodeExecutor) without a sandbox where this machine cannot sandbox it
    /// (not Linux, user namespaces disabled). Without it such a run is refused before it starts.
    /// Unsandboxed code can read, change and delete what this user can, the run included.
    #[arg(long)]
    pub allow_unsandboxed_code: bool,
    /// With --resume: continue although the .hol file, the data or the model changed since the run
    /// started (the change is recorded in RUN_DIR/provenance.json). Without it such a resume is refused,
    /// naming the file.
    #[arg(long, requires = "resume")]
    pub allow_changes: bool,
    /// Sample the rollouts on this OpenAI-compatible server (`holo serve`, vLLM) instead of in process,
    /// pushing the trained weights to it after every optimizer step and verifying them there with a
    /// probe (TRL's `vllm_mode = "server"` with `vllm_server_base_url`). Repeat it for several servers,
    /// each request going to the one that would be done with it first by its requests outstanding and
    /// measured speed. A LoRA run loads its adapter as
    /// `holo-policy`; a full fine-tuning replaces the served weights. The servers read the pushed weights from RUN_DIR/sync.
    #[arg(long = "vllm-server-base-url", value_name = "URL")]
    pub vllm_server_base_url: Vec<String>,
    /// Seconds every request to a rollout server may take, retries of a refused connection included
    /// (TRL's `vllm_server_timeout`).
    #[arg(long, default_value_t = 240.0, value_parser = crate::positive_seconds)]
    pub vllm_server_timeout: f64,
    /// Rollout requests each server runs at once at most (`holo serve`'s `--max-num-seqs` by default;
    /// give a vLLM server's). The others wait here and go to the first server done with one. Below it,
    /// each request goes to the server that would be done with it first, its requests outstanding
    /// weighed by its measured time per token, so a faster server takes more of them.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub vllm_server_concurrency: u32,
    /// The largest difference allowed between a rollout server's log-probabilities of the sync probe and
    /// the trainer's own (raise it for a bf16 server).
    #[arg(long, default_value_t = 1e-3)]
    pub weight_sync_tolerance: f32,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// The model in this process.
    Local,
    /// A Tinker service (Thinking Machines' or SkyRL's).
    Tinker,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TinkerLoss {
    /// Tinker's `importance_sampling`.
    ImportanceSampling,
    /// Tinker's `ppo`.
    Ppo,
}

impl TrainArgs {
    /// `--device`, or the CPU.
    #[cfg(feature = "local")]
    fn device(&self) -> &str {
        self.device.as_deref().unwrap_or("cpu")
    }
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RolloutsFrom {
    /// The trainer's own rollouts of FILE through the Loom.
    Loom,
    /// Scored groups from an Atropos API.
    Atropos,
}

/// The help text after `holo train`'s arguments: every option with its default.
pub fn options_help() -> String {
    options::options_help::<GrpoConfig>("; `--recompute` is `--gradient-checkpointing true`")
}

pub fn run(args: TrainArgs, options: Options) -> ExitCode {
    // A Tinker service trains LoRA adapters, never every weight: LoRA's options are the run's.
    let (implied, unused): (&[(&str, toml::Value, &str)], _) = match args.backend {
        Backend::Tinker => (
            &[("use_peft", toml::Value::Boolean(true), "--backend tinker")],
            holo_runtime::engines::tinker::train::UNUSED,
        ),
        Backend::Local => (&[], &[][..]),
    };
    let config: GrpoConfig = match options::build(args.config.as_deref(), &options, implied, unused)
    {
        Ok(config) => config,
        Err(error) => return usage(error),
    };
    match args.backend {
        Backend::Tinker => tinker::run(args, config),
        #[cfg(feature = "local")]
        Backend::Local => local::run(args, config),
        #[cfg(not(feature = "local"))]
        Backend::Local => usage(
            "--backend local: this holo was built without the `local` feature (the model in \
             process); --backend tinker trains on a Tinker service",
        ),
    }
}

/// The outcome of a run: its report and plots, or its error.
fn finish(
    outcome: Result<holo_runtime::train::TrainSummary, TrainError>,
    args: &TrainArgs,
) -> ExitCode {
    let summary = match outcome {
        Ok(summary) => summary,
        Err(TrainError::Input(message)) => return usage(message),
        Err(error) => {
            eprintln!("error: {error}");
            // A diverged run would diverge again from its newest checkpoint with the same options: its
            // error says what is left and what to do instead.
            if !matches!(error, TrainError::Diverged(_)) {
                eprintln!(
                    "note: checkpoints written so far are in {}; `--resume` continues from the newest",
                    args.out.display()
                );
            }
            return ExitCode::from(EXIT_FAILURES);
        }
    };
    println!("{}", report(&summary));
    match plot::plot_run(&summary.run_dir) {
        Ok(plots) => println!(
            "metrics, TensorBoard events, rollouts, checkpoints and {} plots are in {}",
            plots.len(),
            summary.run_dir.display()
        ),
        Err(message) => eprintln!("warning: no plots: {message}"),
    }
    ExitCode::SUCCESS
}

/// The rows of `path`, each checked against the holoware; every bad row is reported before failing.
fn checked_rows(
    path: &std::path::Path,
    holoware: &holo_runtime::interpreter::Holoware,
) -> Result<Vec<(usize, Row)>, ExitCode> {
    let numbered = read_rows(path).map_err(usage)?;
    let mut rows = Vec::with_capacity(numbered.len());
    let mut bad = 0;
    for (index, (line, row)) in numbered.into_iter().enumerate() {
        match row.and_then(|row| {
            holoware
                .check_row(&row)
                .map(|()| row)
                .map_err(|missing| missing.to_string())
        }) {
            Ok(row) => rows.push((index, row)),
            Err(message) => {
                eprintln!("error: {}:{line}: {message}", path.display());
                bad += 1;
            }
        }
    }
    if bad > 0 {
        return Err(ExitCode::from(EXIT_USAGE));
    }
    if rows.is_empty() {
        eprintln!("error: `{}` has no rows", path.display());
        return Err(ExitCode::from(EXIT_USAGE));
    }
    Ok(rows)
}

fn usage(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(EXIT_USAGE)
}

/// The run in a few lines: the last step's main metrics and each evaluation.
fn report(summary: &holo_runtime::train::TrainSummary) -> String {
    let value = |metrics: &std::collections::BTreeMap<String, f64>, key: &str| {
        metrics
            .get(key)
            .map_or("-".to_string(), |value| format!("{value:.4}"))
    };
    let mut text = format!(
        "== {} steps: reward {}, kl {}, entropy {}\n",
        summary.steps,
        value(&summary.last, "reward"),
        value(&summary.last, "kl"),
        value(&summary.last, "entropy"),
    );
    match summary.stopped_by {
        Some("stop_on_no_signal") => text.push_str(
            "stopped early: every group's rewards were identical for no_signal_steps steps (stop_on_no_signal)\n",
        ),
        Some(_) => {
            text.push_str("stopped early: eval/reward stopped improving (early_stopping_patience)\n")
        }
        None => {}
    }
    if summary.rollbacks > 0 {
        text.push_str(&format!(
            "{} rollbacks (rollbacks.jsonl has what was abandoned)\n",
            summary.rollbacks
        ));
    }
    if !summary.evaluations.is_empty() {
        text.push_str("step  eval/reward  eval/pass@1  eval/pass@G\n");
        for (step, metrics) in &summary.evaluations {
            let pass_g = metrics
                .iter()
                .find(|(key, _)| key.starts_with("eval/pass@") && key.as_str() != "eval/pass@1")
                .map_or("-".to_string(), |(_, value)| format!("{value:.4}"));
            text.push_str(&format!(
                "{step:>4}  {:>11}  {:>11}  {pass_g:>11}\n",
                value(metrics, "eval/reward"),
                value(metrics, "eval/pass@1"),
            ));
        }
    }
    text
}

/// The holoware with the built-in resources, tool statistics and the run's code sandbox.
fn interpreted(
    holoware: &Arc<Holoware>,
    config: &GrpoConfig,
    args: &TrainArgs,
) -> Result<Interpreted, ExitCode> {
    let mut resources = crate::resources();
    resources.insert(ToolStats::default());
    let limits = config
        .sandbox
        .limits()
        .expect("ConfigBuilder::build checked the [sandbox] table");
    crate::prepare_rollouts(
        holoware,
        &mut resources,
        CodeSandbox {
            limits,
            allow_unsandboxed: args.allow_unsandboxed_code,
        },
    )?;
    Ok(Interpreted {
        holoware: Arc::clone(holoware),
        resources,
    })
}
