//! Batched sampling throughput of a local model folder, for `benches/sample_compare.py`.
//!
//!     cargo run --release -p holo-runtime --example sample_bench -- MODEL_DIR \
//!         [--batch 8] [--prompt-len 16] [--new 32] [--repeats 3] [--seed 0] [--dtype f32|f16|bf16]
//!         [--device cpu|cuda|cuda:N] [--quantized]
//!
//! Random prompt ids (seeded), temperature 1, no top-k/top-p, no end-of-turn: every row samples exactly
//! `--new` tokens, as transformers' `generate(min_new_tokens=new)` does on the Python side. Prints one
//! JSON object: the run times, new tokens per second (median and best) and the prefill time. On a GPU the
//! sampled tokens come back to the host at every step, so each timed run ends with the device's work.
//!
//! With `--quantized`, a `.gguf` file's quantized projections stay in their blocks on the CPU, as `holo
//! serve --quantized` keeps them. `weight_bytes_per_token` is what one decoding step reads of the
//! layers' projections and the output head (the bulk of the weights; norms and biases are left out).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use holo_runtime::local::generate::{generate, GenerationParams, Stopping};
use holo_runtime::local::model::positions_from_mask;
use holo_runtime::local::{files, gguf, parse_device, Ops};
use rand::{Rng, SeedableRng};

fn main() -> ExitCode {
    holo_runtime::local::threads::settle();
    let mut args = std::env::args().skip(1);
    let mut dir = None;
    let mut dtype = DType::F32;
    let mut device = Device::Cpu;
    let mut quantized = false;
    let (mut batch, mut prompt_len, mut new, mut repeats, mut seed) =
        (8usize, 16usize, 32usize, 3usize, 0u64);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> usize {
            match args.next().and_then(|v| v.parse().ok()) {
                Some(v) => v,
                None => {
                    eprintln!("error: {name} needs a number");
                    std::process::exit(2);
                }
            }
        };
        match arg.as_str() {
            "--batch" => batch = value("--batch"),
            "--prompt-len" => prompt_len = value("--prompt-len"),
            "--new" => new = value("--new"),
            "--repeats" => repeats = value("--repeats").max(1),
            "--seed" => seed = value("--seed") as u64,
            "--quantized" => quantized = true,
            "--dtype" => {
                dtype = match args.next().as_deref() {
                    Some("f32") => DType::F32,
                    Some("f16") => DType::F16,
                    Some("bf16") => DType::BF16,
                    other => {
                        eprintln!("error: --dtype takes f32, f16 or bf16, not {other:?}");
                        return ExitCode::from(2);
                    }
                }
            }
            "--device" => {
                let name = args.next().unwrap_or_default();
                device = match parse_device(&name) {
                    Ok(device) => device,
                    Err(error) => {
                        eprintln!("error: --device: {error}");
                        return ExitCode::from(2);
                    }
                }
            }
            _ if dir.is_none() && !arg.starts_with('-') => dir = Some(PathBuf::from(arg)),
            _ => {
                eprintln!("error: unexpected argument {arg:?}");
                return ExitCode::from(2);
            }
        }
    }
    let Some(dir) = dir else {
        eprintln!("usage: sample_bench MODEL_DIR [--batch N] [--prompt-len N] [--new N] [--repeats N] [--seed N] [--dtype T] [--device D] [--quantized]");
        return ExitCode::from(2);
    };
    let quantized = quantized && device.is_cpu() && gguf::is_gguf(&dir);
    let loaded = match quantized {
        true => gguf::load_quantized(&dir, dtype, &device),
        false => files::load_model(&dir, dtype, &device),
    }
    .and_then(|model| Ok((model, files::load_tokenizer(&dir)?)));
    let (model, tokenizer) = match loaded {
        Ok(loaded) => loaded,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(1);
        }
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let vocab = model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|_| {
            (0..prompt_len)
                .map(|_| rng.random_range(0..vocab))
                .collect()
        })
        .collect();
    let stopping = Stopping {
        eos: &[],
        tokenizer: &tokenizer,
    };
    // Each run's wall seconds and the process's CPU seconds: on a machine shared with other work the
    // CPU time of a one-thread run is what the run cost, where its wall time also counts the waits.
    let run = |round: usize| -> (f64, f64) {
        let params: Vec<GenerationParams> = (0..batch)
            .map(|row| GenerationParams {
                max_tokens: new,
                temperature: 1.0,
                seed: seed + (round * batch + row) as u64,
                ..Default::default()
            })
            .collect();
        let (start, cpu) = (Instant::now(), process_cpu_seconds());
        let out = generate(&model, &stopping, &prompts, &params, None).expect("generation");
        let elapsed = start.elapsed().as_secs_f64();
        let cpu = process_cpu_seconds() - cpu;
        assert!(out.iter().all(|g| g.tokens.len() == new));
        (elapsed, cpu)
    };
    run(0); // warm-up
    let (mut times, mut cpu_times): (Vec<f64>, Vec<f64>) = (1..=repeats).map(run).unzip();
    let prefill = {
        let ids = Tensor::new(prompts.concat(), &device)
            .and_then(|t| t.reshape((batch, prompt_len)))
            .expect("prompt tensor");
        let mask = Tensor::ones((batch, prompt_len), DType::U8, &device).expect("mask");
        device.synchronize().expect("device");
        let start = Instant::now();
        let hidden = model
            .forward_hidden(
                &ids,
                &positions_from_mask(&mask).expect("positions"),
                &mask,
                None,
                Ops::Fast,
            )
            .expect("prefill");
        model
            .logits(
                &hidden.narrow(1, prompt_len - 1, 1).expect("last"),
                Ops::Fast,
            )
            .expect("logits");
        device.synchronize().expect("device");
        start.elapsed().as_secs_f64()
    };
    let measured = times.clone();
    let measured_cpu = cpu_times.clone();
    times.sort_by(f64::total_cmp);
    cpu_times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let median_cpu = cpu_times[cpu_times.len() / 2];
    let tokens = (batch * new) as f64;
    println!(
        "{}",
        serde_json::json!({
            "batch": batch,
            "prompt_len": prompt_len,
            "new_tokens": new,
            "times_s": measured,
            "median_s": median,
            "new_tokens_per_s": tokens / median,
            "best_new_tokens_per_s": tokens / times[0],
            "cpu_times_s": measured_cpu,
            "new_tokens_per_cpu_s": tokens / median_cpu,
            "prefill_s": prefill,
            "device": format!("{:?}", device.location()),
            "dtype": format!("{dtype:?}"),
            "quantized": quantized,
            "weight_bytes_per_token": model.decoding_bytes(),
        })
    );
    ExitCode::SUCCESS
}

/// The CPU time this process has used, all its threads together.
fn process_cpu_seconds() -> f64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to write.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) };
    assert_eq!(status, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9
}
