//! `holo train --backend local`: the model trained in this process (feature `local`), its rollouts from
//! the Loom or an Atropos API.

use std::path::Path;
use std::process::ExitCode;

use holo_runtime::engines::atropos::batch::{AtroposFeed, FeedOptions, NoHoloware};
use holo_runtime::interpreter::Row;
use holo_runtime::local::Grammars;
use holo_runtime::loom::RolloutSource;
use holo_runtime::train::provenance::Provenance;
use holo_runtime::train::sync::SyncOptions;
use holo_runtime::train::{plan, GrpoConfig, Policy, RunOptions, Trainer};

use super::{checked_rows, finish, interpreted, usage, RolloutsFrom, TinkerLoss, TrainArgs};
use crate::load;
use crate::options;

/// The run of `args` with `config`, the model loaded here.
pub fn run(args: TrainArgs, config: GrpoConfig) -> ExitCode {
    let atropos = args.rollouts == RolloutsFrom::Atropos;
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
    let policy = match options::training_policy(
        &args.model,
        args.device(),
        args.dtype.as_deref(),
        args.quantized,
    ) {
        Ok(policy) => policy,
        Err(message) => return usage(message),
    };
    if let Some(holoware) = &holoware {
        let grammars = Grammars::new(
            policy.tokenizer.clone(),
            policy.model.config.vocab_size,
            policy.end_of_turn.clone(),
        );
        if let Err(error) = grammars.check(holoware) {
            return usage(error);
        }
        // The constraints the rows give (`json_schema=name`), before any rollout too.
        for (option, rows) in [("--data", &rows), ("--eval-data", &eval_rows)] {
            let labelled = rows
                .iter()
                .map(|(index, row)| (format!("{option}: data row {}", index + 1), row));
            if let Err(errors) = grammars.check_rows(holoware, labelled) {
                return usage(errors.join("\nerror: "));
            }
        }
    }
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
    let device = holo_runtime::local::parse_device(args.device())?;
    let dtype = holo_runtime::local::parse_training_dtype(args.dtype.as_deref(), &device)?;
    let training = &config.training;
    if !device.is_cpu() {
        eprintln!(
            "note: the memory plan counts host memory; on {} it is not checked",
            args.device()
        );
        return Ok(None);
    }
    let prompt_tokens = plan::prompt_tokens(rows.iter().map(|(_, row)| row));
    plan::before_loading(
        &args.model,
        training.memory_check,
        training.memory_limit,
        (&args.out, args.resume),
        |sizes, tokenizer_bytes| plan::Inputs {
            quantized: args.quantized,
            ..plan::Inputs::grpo(sizes, config, dtype, prompt_tokens, tokenizer_bytes)
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
            concurrency: args.vllm_server_concurrency as usize,
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
