//! Time and peak memory of one training step's forward and backward pass on a local model folder, with
//! or without activation recomputation ([`Model::backward_recomputed`]).
//!
//!     cargo run --release -p holo-runtime --example train_step_bench -- MODEL_DIR \
//!         [--batch 8] [--len 64] [--steps 3] [--seed 0] [--lora RANK] [--recompute]
//!
//! Random token ids (seeded), every token real; the loss is the mean next-token log-probability, and all
//! weights (or, with `--lora`, rank-`RANK` adapters on every projection) are trained. Prints one JSON
//! object: the step times, their median, and the process's peak resident memory (`VmHWM`, Linux). Run it
//! once per setting: the peak is the process's whole life.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use holo_runtime::local::model::{LoraConfig, Targets, PROJECTIONS};
use holo_runtime::local::{files, Model, Ops};
use rand::{Rng, SeedableRng};

struct Settings {
    dir: PathBuf,
    batch: usize,
    len: usize,
    steps: usize,
    seed: u64,
    lora: Option<usize>,
    recompute: bool,
}

fn settings() -> Result<Settings, String> {
    let mut args = std::env::args().skip(1);
    let mut dir = None;
    let mut settings = Settings {
        dir: PathBuf::new(),
        batch: 8,
        len: 64,
        steps: 3,
        seed: 0,
        lora: None,
        recompute: false,
    };
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> Result<usize, String> {
            args.next()
                .and_then(|value| value.parse().ok())
                .ok_or(format!("{name} needs a number"))
        };
        match arg.as_str() {
            "--batch" => settings.batch = number("--batch")?.max(1),
            "--len" => settings.len = number("--len")?.max(2),
            "--steps" => settings.steps = number("--steps")?.max(1),
            "--seed" => settings.seed = number("--seed")? as u64,
            "--lora" => settings.lora = Some(number("--lora")?),
            "--recompute" => settings.recompute = true,
            _ if dir.is_none() && !arg.starts_with('-') => dir = Some(PathBuf::from(arg)),
            _ => return Err(format!("unexpected argument {arg:?}")),
        }
    }
    settings.dir = dir.ok_or("usage: train_step_bench MODEL_DIR [--batch N] [--len N] [--steps N] [--seed N] [--lora RANK] [--recompute]")?;
    Ok(settings)
}

/// The process's peak resident memory in MiB, where Linux reports it.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn main() -> ExitCode {
    holo_runtime::local::threads::settle();
    let settings = match settings() {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    let base = match files::load_model(&settings.dir, DType::F32, &Device::Cpu) {
        Ok(model) => model,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(1);
        }
    };
    let (model, vars) = match settings.lora {
        Some(rank) => base.with_lora(&LoraConfig {
            rank,
            alpha: 2.0 * rank as f64,
            targets: Targets::names(&PROJECTIONS),
            seed: settings.seed,
            dropout: 0.0,
            parameters: Vec::new(),
            ..Default::default()
        }),
        None => base.trainable(),
    }
    .expect("trainable model");
    drop(base);

    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(settings.seed);
    let vocab = model.config.vocab_size as u32;
    let ids: Vec<u32> = (0..settings.batch * settings.len)
        .map(|_| rng.random_range(0..vocab))
        .collect();
    let shape = (settings.batch, settings.len);
    let input = Tensor::from_vec(ids, shape, &Device::Cpu).expect("ids");
    let mask = Tensor::ones(shape, DType::U8, &Device::Cpu).expect("mask");
    let loss = |logprobs: &Tensor| logprobs.mean_all()?.neg();

    let step = |model: &Model| {
        let start = Instant::now();
        let grads = if settings.recompute {
            model
                .backward_recomputed(&input, &mask, loss)
                .expect("step")
                .1
        } else {
            let logprobs = model
                .token_logprobs(&input, &mask, Ops::Differentiable)
                .expect("forward");
            loss(&logprobs)
                .and_then(|loss| loss.backward())
                .expect("backward")
        };
        assert!(vars.iter().all(|(_, var)| grads.get(var).is_some()));
        start.elapsed().as_secs_f64()
    };
    let measured: Vec<f64> = (0..settings.steps).map(|_| step(&model)).collect();
    let mut sorted = measured.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "{}",
        serde_json::json!({
            "batch": settings.batch,
            "len": settings.len,
            "lora_rank": settings.lora,
            "recompute": settings.recompute,
            "trained_tensors": vars.len(),
            "times_s": measured,
            "median_s": sorted[sorted.len() / 2],
            "peak_rss_mib": peak_rss_mib(),
        })
    );
    ExitCode::SUCCESS
}
