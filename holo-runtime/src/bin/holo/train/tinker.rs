//! `holo train --backend tinker`: the holoware rolled out here, the model trained on a Tinker service.
//! Needs no model in process: a `holo` built without the `local` feature runs it.

use std::process::ExitCode;

use holo_runtime::engines::tinker;
use holo_runtime::train::provenance::Provenance;
use holo_runtime::train::{GrpoConfig, RunOptions};

use super::{checked_rows, finish, interpreted, usage, RolloutsFrom, TinkerLoss, TrainArgs};
use crate::load;

/// `holo train --backend tinker`: the holoware rolled out here, the model trained on the service.
pub fn run(args: TrainArgs, config: GrpoConfig) -> ExitCode {
    if args.rollouts == RolloutsFrom::Atropos {
        return usage("--rollouts atropos: not with --backend tinker");
    }
    if args.device.is_some() {
        return usage("--device: with --backend tinker the service chooses its devices");
    }
    if args.quantized {
        return usage("--quantized: with --backend tinker the service holds the base model");
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
