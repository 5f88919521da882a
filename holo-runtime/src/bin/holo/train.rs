//! `holo train`: GRPO on a `.hol` environment with a local model; options are TRL's `GRPOConfig` names,
//! from `--config train.toml` and from `--<name-in-kebab-case> VALUE` flags.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use holo_runtime::engines::atropos::batch::{AtroposFeed, FeedOptions, NoHoloware};
use holo_runtime::engines::tinker;
use holo_runtime::holotypes::{CodeSandbox, ToolStats};
use holo_runtime::interpreter::{read_rows, Holoware, Row};
use holo_runtime::loom::{Interpreted, RolloutSource};
use holo_runtime::train::provenance::Provenance;
use holo_runtime::train::report::plot;
use holo_runtime::train::sync::SyncOptions;
use holo_runtime::train::{plan, GrpoConfig, Policy, RunOptions, TrainError, Trainer};

use super::options::{self, Options};
use super::{load, EXIT_FAILURES, EXIT_USAGE};

/// `holo train`'s own arguments (the options are split off before clap sees them).
#[derive(clap::Args)]
pub struct TrainArgs {
    /// The environment (with --rollouts atropos, only to evaluate on --eval-data).
    pub file: Option<PathBuf>,
    /// The model to train: a Hugging Face folder of a family README's "Local models" lists
    /// (config.json, safetensors, tokenizer.json and a chat template), or a `.gguf` file of qwen2,
    /// qwen3, qwen3moe, llama, smollm3, olmo2 (OLMo 2 and 3), gemma3 or phi3 (dequantized to f32).
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
    /// cpu, cuda, cuda:N, metal or metal:N (cuda and metal need holo built with that feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The precision the model trains in: f32, or bf16 (weights, gradients and AdamW's moments; LoRA
    /// adapters stay f32). Default: f32 on the CPU, bf16 on CUDA (docs/cuda.md, "Precision").
    #[arg(long)]
    pub dtype: Option<String>,
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
    /// which take the requests in turn. A LoRA run loads its adapter as `holo-policy`; a full
    /// fine-tuning replaces the served weights. The servers read the pushed weights from RUN_DIR/sync.
    #[arg(long = "vllm-server-base-url", value_name = "URL")]
    pub vllm_server_base_url: Vec<String>,
    /// Seconds every request to a rollout server may take, retries of a refused connection included
    /// (TRL's `vllm_server_timeout`).
    #[arg(long, default_value_t = 240.0, value_parser = crate::positive_seconds)]
    pub vllm_server_timeout: f64,
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
    let implied: &[(&str, toml::Value, &str)] = match args.backend {
        Backend::Tinker => &[("use_peft", toml::Value::Boolean(true), "--backend tinker")],
        Backend::Local => &[],
    };
    let config: GrpoConfig = match options::build(args.config.as_deref(), &options, implied) {
        Ok(config) => config,
        Err(error) => return usage(error),
    };
    let atropos = args.rollouts == RolloutsFrom::Atropos;
    if args.backend == Backend::Tinker {
        return train_on_tinker(args, config);
    }
    if atropos && !args.vllm_server_base_url.is_empty() {
        return usage(
            "--vllm-server-base-url: not with --rollouts atropos (the environments sample)",
        );
    }
    for (given, flag) in [
        (args.base_url.is_some(), "--base-url"),
        (args.tokenizer.is_some(), "--tokenizer"),
        (args.loss_fn != TinkerLoss::ImportanceSampling, "--loss-fn"),
    ] {
        if given {
            return usage(format!("{flag}: only with --backend tinker"));
        }
    }
    match (&args.file, &args.data, atropos) {
        (None, _, false) => return usage("FILE: the holoware to train on (or --rollouts atropos)"),
        (_, None, false) => return usage("--data: the training rows (or --rollouts atropos)"),
        (_, Some(_), true) => {
            return usage("--data: not with --rollouts atropos (the environments decide the data)")
        }
        (_, _, false) if args.api.is_some() => return usage("--api: only with --rollouts atropos"),
        (None, _, true) if args.eval_data.is_some() => {
            return usage("--eval-data: needs FILE, the holoware to evaluate on")
        }
        _ => {}
    }
    let holoware = match args.file.as_deref().map(load).transpose() {
        Ok(holoware) => holoware,
        Err(code) => return code,
    };
    let rows = match (&args.data, &holoware) {
        (Some(path), Some(holoware)) => match checked_rows(path, holoware) {
            Ok(rows) => rows,
            Err(code) => return code,
        },
        _ => Vec::new(),
    };
    let eval_rows = match (&args.eval_data, &holoware) {
        (Some(path), Some(holoware)) => match checked_rows(path, holoware) {
            Ok(rows) => rows,
            Err(code) => return code,
        },
        _ => Vec::new(),
    };
    let planned = match plan_memory(&args, &config, &rows) {
        Ok(planned) => planned,
        Err(message) => return usage(message),
    };
    let policy = match options::training_policy(&args.model, &args.device, args.dtype.as_deref()) {
        Ok(policy) => policy,
        Err(message) => return usage(message),
    };
    let feed = match &args.api {
        Some(url) if atropos => {
            let model = &policy.model.config;
            match AtroposFeed::new(
                url,
                &config,
                model.vocab_size,
                model.max_position_embeddings,
                &args.out,
                FeedOptions::default(),
            ) {
                Ok(feed) => Some(feed),
                Err(message) => return usage(message),
            }
        }
        _ => None,
    };
    let mut inputs = Vec::new();
    if let Some(file) = &args.file {
        inputs.push(("holoware", file.as_path()));
    }
    if let Some(path) = &args.data {
        inputs.push(("data", path.as_path()));
    }
    if let Some(path) = &args.eval_data {
        inputs.push(("eval data", path.as_path()));
    }
    inputs.push(("model", args.model.as_path()));
    let provenance = match Provenance::collect(&inputs, holo_runtime::build()) {
        Ok(provenance) => provenance,
        Err(message) => return usage(message),
    };
    let options = RunOptions {
        out: args.out.clone(),
        resume: args.resume,
        progress: true,
    };
    let Some(holoware) = holoware else {
        return train(
            NoHoloware,
            policy,
            config,
            options,
            (provenance, planned),
            feed,
            &args,
            &rows,
            &[],
        );
    };
    let source = match interpreted(&holoware, &config, &args) {
        Ok(source) => source,
        Err(code) => return code,
    };
    train(
        source,
        policy,
        config,
        options,
        (provenance, planned),
        feed,
        &args,
        &rows,
        &eval_rows,
    )
}

/// The run's memory plan, printed, written to the run folder and checked before the weights are
/// loaded (`holo_runtime::train::plan`); prompts are bounded by the longest training row.
fn plan_memory(
    args: &TrainArgs,
    config: &GrpoConfig,
    rows: &[(usize, Row)],
) -> Result<Option<plan::Planned>, String> {
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
    let prompt_tokens = plan::prompt_tokens(rows.iter().map(|(_, row)| row));
    plan::before_loading(
        &args.model,
        training.memory_check,
        training.memory_limit,
        (&args.out, args.resume),
        |sizes, tokenizer_bytes| {
            plan::Inputs::grpo(sizes, config, dtype, prompt_tokens, tokenizer_bytes)
        },
    )
}

/// The run (with its provenance and its memory plan to write), its report and its plots.
#[allow(clippy::too_many_arguments)]
fn train<S: RolloutSource>(
    source: S,
    policy: Policy,
    config: GrpoConfig,
    options: RunOptions,
    (provenance, planned): (Provenance, Option<plan::Planned>),
    feed: Option<AtroposFeed>,
    args: &TrainArgs,
    rows: &[(usize, Row)],
    eval_rows: &[(usize, Row)],
) -> ExitCode {
    let mut trainer = match Trainer::new(source, policy, config, options) {
        Ok(trainer) => trainer
            .with_provenance(provenance, args.allow_changes)
            .with_memory_plan(planned),
        Err(error) => return usage(error),
    };
    if let Some(feed) = feed {
        trainer = trainer.with_feed(Box::new(feed));
    }
    if !args.vllm_server_base_url.is_empty() {
        trainer = trainer.with_rollout_servers(SyncOptions {
            timeout: std::time::Duration::from_secs_f64(args.vllm_server_timeout),
            tolerance: args.weight_sync_tolerance,
            ..SyncOptions::new(args.vllm_server_base_url.clone())
        });
    }
    let total = trainer.total_steps(rows.len());
    match (&args.api, &args.file) {
        (Some(url), _) if args.rollouts == RolloutsFrom::Atropos => eprintln!(
            "training on the batches of the Atropos API at {url} ({} held out) for {total} steps into {}",
            eval_rows.len(),
            args.out.display()
        ),
        (_, file) => eprintln!(
            "training {} on {} rows ({} held out) for {total} steps into {}",
            file.as_deref().unwrap_or(Path::new("?")).display(),
            rows.len(),
            eval_rows.len(),
            args.out.display()
        ),
    }
    finish(trainer.train(rows, eval_rows), args)
}

/// `holo train --backend tinker`: the holoware rolled out here, the model trained on the service.
fn train_on_tinker(args: TrainArgs, config: GrpoConfig) -> ExitCode {
    if args.rollouts == RolloutsFrom::Atropos {
        return usage("--rollouts atropos: not with --backend tinker");
    }
    if args.dtype.is_some() {
        return usage("--dtype: with --backend tinker the service trains in its own precision");
    }
    if !args.vllm_server_base_url.is_empty() {
        return usage("--vllm-server-base-url: not with --backend tinker (the service samples)");
    }
    let (Some(file), Some(data)) = (&args.file, &args.data) else {
        return usage("--backend tinker needs FILE, the holoware, and --data, its rows");
    };
    let Some(url) = &args.base_url else {
        return usage("--base-url: the Tinker service");
    };
    let tokenizer = match &args.tokenizer {
        Some(dir) => dir.clone(),
        None if args.model.is_dir() => args.model.clone(),
        None => {
            return usage(format!(
                "--tokenizer: a folder with the tokenizer and chat template of `{}` (--model is not a folder)",
                args.model.display()
            ))
        }
    };
    let key = match tinker::client::api_key_from_env() {
        Ok(key) => key,
        Err(message) => return usage(message),
    };
    let waits = match tinker::client::Waits::from_env() {
        Ok(waits) => waits,
        Err(message) => return usage(message),
    };
    let client = match tinker::client::Client::new(url, &key, waits) {
        Ok(client) => client,
        Err(message) => return usage(format!("--base-url: {message}")),
    };
    let loss = match args.loss_fn {
        TinkerLoss::ImportanceSampling => tinker::wire::LossFn::ImportanceSampling,
        TinkerLoss::Ppo => tinker::wire::LossFn::Ppo {
            low: 1.0 - config.epsilon,
            high: 1.0 + config.epsilon_high(),
        },
    };
    let holoware = match load(file) {
        Ok(holoware) => holoware,
        Err(code) => return code,
    };
    let rows = match checked_rows(data, &holoware) {
        Ok(rows) => rows,
        Err(code) => return code,
    };
    let eval_rows = match &args.eval_data {
        Some(path) => match checked_rows(path, &holoware) {
            Ok(rows) => rows,
            Err(code) => return code,
        },
        None => Vec::new(),
    };
    let mut inputs = vec![("holoware", file.as_path()), ("data", data.as_path())];
    if let Some(path) = &args.eval_data {
        inputs.push(("eval data", path.as_path()));
    }
    inputs.push(("tokenizer", tokenizer.as_path()));
    let provenance = match Provenance::collect(&inputs, holo_runtime::build()) {
        Ok(provenance) => provenance,
        Err(message) => return usage(message),
    };
    let source = match interpreted(&holoware, &config, &args) {
        Ok(source) => source,
        Err(code) => return code,
    };
    let options = RunOptions {
        out: args.out.clone(),
        resume: args.resume,
        progress: true,
    };
    let service = tinker::train::TinkerOptions {
        client,
        base_model: args.model.display().to_string(),
        tokenizer,
        loss,
    };
    let mut trainer = match tinker::train::Tinker::trainer(source, config, service, options) {
        Ok(trainer) => trainer.with_provenance(provenance, args.allow_changes),
        Err(error) => return usage(error),
    };
    let total = trainer.total_steps(rows.len());
    eprintln!(
        "training {} of the Tinker service at {url} on {} ({} rows, {} held out) for {total} steps into {}",
        args.model.display(),
        file.display(),
        rows.len(),
        eval_rows.len(),
        args.out.display()
    );
    finish(trainer.train(&rows, &eval_rows), &args)
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
