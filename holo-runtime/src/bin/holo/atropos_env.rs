//! `holo atropos-env`: a holoware as an Atropos environment, feeding whichever trainer is registered
//! with the API (`holo train --rollouts atropos`, `atroposlib`'s example trainer, ...).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use holo_runtime::engines::atropos::api::{Api, Retry};
use holo_runtime::engines::atropos::env::{self, EnvOptions, Rollouts};
use holo_runtime::holophore::Holophore;
use holo_runtime::holotypes::CodeSandbox;
use holo_runtime::interpreter::{read_rows, Row};
use holo_runtime::{OpenAi, OpenAiConfig};

use crate::{load, runtime, EXIT_FAILURES, EXIT_USAGE};

#[derive(Args)]
pub struct AtroposEnvArgs {
    /// The environment.
    pub file: PathBuf,
    /// The Atropos API (`run-api`), `http://host:port`.
    #[arg(long)]
    pub api: String,
    /// The policy: an OpenAI-compatible server (`holo serve`, vLLM, SGLang) the rollouts sample from.
    #[arg(long)]
    pub policy_url: String,
    /// The policy's model folder: its `tokenizer.json` and chat template record every rollout token by
    /// token (Atropos takes token ids), and prompts are sent as token ids.
    #[arg(long)]
    pub model: PathBuf,
    /// The model id the policy server serves (default: --model as given, as vLLM and `holo serve`
    /// name it).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Data rows, one JSON object per line, taken in turn (and again from the first when they run
    /// out). Without it, one empty row (for a holoware without inputs).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Rollouts per row: the sequences of one scored group.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub group_size: u32,
    /// The environment's name at the API (it appends `_N`).
    #[arg(long, default_value = "holoware")]
    pub name: String,
    /// The environment's weight among the API's environments (`inference_weight`): run-api turns it
    /// into the environment's share of the inference servers (`env_weight`); it does not change what a
    /// batch holds (--min-batch-allocation does).
    #[arg(long, default_value_t = 1.0)]
    pub weight: f64,
    /// The longest sequence the environment declares it makes.
    #[arg(long, default_value_t = 2048)]
    pub max_token_length: i64,
    /// The share (0 to 1) of every batch this environment is guaranteed while it is connected: at
    /// least ⌊batch_size · share⌋ of its sequences (run-api scales shares down when they add up to more
    /// than 1).
    #[arg(long)]
    pub min_batch_allocation: Option<f64>,
    /// Batches the API's queue may hold before generation pauses.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i64).range(1..))]
    pub max_batches_offpolicy: i64,
    /// Rows rolled out at once, at most.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_workers: u32,
    /// Stop after this many trainer steps (default: the trainer's `num_steps`).
    #[arg(long)]
    pub total_steps: Option<i64>,
    /// The sampling temperature of every request (sent with each group as `generation_params`).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Post groups whose scores are all equal (by default they are dropped, as atroposlib's `BaseEnv`
    /// drops them: they have no advantage to train on).
    #[arg(long)]
    pub keep_equal_scores: bool,
    /// The run seed; every rollout's sampling seed is derived from it and the rollout's place.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Requests to the policy in flight at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency: u32,
    /// Seconds the API may be gone in the middle of the run (restarting) before the environment gives
    /// up.
    #[arg(long, default_value_t = 300)]
    pub reconnect_timeout: u64,
    /// Run model-written code (CodeExecutor) without a sandbox where this machine cannot sandbox it.
    #[arg(long)]
    pub allow_unsandboxed_code: bool,
}

pub fn run(args: AtroposEnvArgs) -> ExitCode {
    let holoware = match load(&args.file) {
        Ok(holoware) => holoware,
        Err(code) => return code,
    };
    let rows = match rows(args.data.as_deref(), &holoware) {
        Ok(rows) => rows,
        Err(message) => return usage(message),
    };
    if let Some(share) = args.min_batch_allocation {
        if !(0.0..=1.0).contains(&share) {
            return usage(format!(
                "--min-batch-allocation {share}: must be from 0 to 1"
            ));
        }
    }
    let holophore = match Holophore::from_dir(&args.model) {
        Ok(holophore) => holophore,
        Err(error) => return usage(format!("--model `{}`: {error}", args.model.display())),
    };
    let model_name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| args.model.display().to_string());
    let policy = match OpenAi::new(OpenAiConfig {
        max_concurrency: args.concurrency as usize,
        ..OpenAiConfig::new(args.policy_url.clone(), model_name)
    }) {
        Ok(policy) => policy,
        Err(error) => return usage(format!("--policy-url: {error}")),
    };
    let api = match Api::new(&args.api, Retry::default()) {
        Ok(api) => api,
        Err(message) => return usage(format!("--api: {message}")),
    };
    let mut resources = crate::resources();
    if let Err(code) = crate::prepare_rollouts(
        &holoware,
        &mut resources,
        CodeSandbox {
            allow_unsandboxed: args.allow_unsandboxed_code,
            ..CodeSandbox::default()
        },
    ) {
        return code;
    }
    let options = EnvOptions {
        group_size: args.group_size as usize,
        name: args.name,
        weight: args.weight,
        max_token_length: args.max_token_length,
        min_batch_allocation: args.min_batch_allocation,
        max_batches_offpolicy: args.max_batches_offpolicy,
        max_workers: args.max_workers as usize,
        total_steps: args.total_steps,
        temperature: args.temperature,
        keep_equal_scores: args.keep_equal_scores,
        seed: args.seed,
        concurrency: args.concurrency as usize,
        reconnect_timeout: Duration::from_secs(args.reconnect_timeout),
        ..EnvOptions::default()
    };
    let rollouts = Rollouts {
        holoware,
        resources,
        holophore,
        policy: &policy,
        rows: &rows,
    };
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    match runtime.block_on(env::run(&api, &rollouts, &options)) {
        Ok(summary) => {
            println!(
                "{} groups posted ({} dropped: {} with a failed rollout, {} with equal scores, {} too long); mean score {}{}",
                summary.posted,
                summary.failed + summary.equal_scores + summary.too_long,
                summary.failed,
                summary.equal_scores,
                summary.too_long,
                summary
                    .mean_score
                    .map_or("-".to_string(), |mean| format!("{mean:.4}")),
                if summary.reregistrations > 0 {
                    format!("; registered again {} times", summary.reregistrations)
                } else {
                    String::new()
                }
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(EXIT_FAILURES)
        }
    }
}

/// The rows of `--data` checked against the holoware (`(line, row)`), or one empty row.
fn rows(
    data: Option<&Path>,
    holoware: &holo_runtime::interpreter::Holoware,
) -> Result<Vec<(usize, Row)>, String> {
    let Some(path) = data else {
        let row = Row::new();
        holoware.check_row(&row).map_err(|missing| {
            format!("{missing}: the holoware has inputs; give them with --data")
        })?;
        return Ok(vec![(1, row)]);
    };
    let mut rows = Vec::new();
    for (line, row) in read_rows(path)? {
        let row = row
            .and_then(|row| {
                holoware
                    .check_row(&row)
                    .map(|()| row)
                    .map_err(|missing| missing.to_string())
            })
            .map_err(|message| format!("{}:{line}: {message}", path.display()))?;
        rows.push((line, row));
    }
    if rows.is_empty() {
        return Err(format!("`{}` has no rows", path.display()));
    }
    Ok(rows)
}

fn usage(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(EXIT_USAGE)
}
