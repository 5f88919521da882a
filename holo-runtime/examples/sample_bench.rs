//! Batched sampling throughput of a local model folder, for `benches/sample_compare.py`.
//!
//!     cargo run --release -p holo-runtime --example sample_bench -- MODEL_DIR \
//!         [--batch 8] [--prompt-len 16] [--new 32] [--repeats 3] [--seed 0] [--dtype f32|f16|bf16]
//!         [--device cpu|cuda|cuda:N] [--quantized] [--steps 512,1024,.. [--filled]]
//!
//! Random prompt ids (seeded), temperature 1, no top-k/top-p, no end-of-turn: every row samples exactly
//! `--new` tokens, as transformers' `generate(min_new_tokens=new)` does on the Python side. Prints one
//! JSON object: the run times, new tokens per second (median and best) and the prefill time. On a GPU the
//! sampled tokens come back to the host at every step, so each timed run ends with the device's work.
//!
//! With `--quantized`, a `.gguf` file's quantized projections stay in their blocks on the CPU, as `holo
//! serve --quantized` keeps them. `weight_bytes_per_token` is what one decoding step reads of the
//! layers' projections and the output head (the bulk of the weights; norms and biases are left out).
//!
//! With `--steps 512,1024,..`, the cost of one decoding step at each of those contexts (for
//! `benches/context_curve.py`): the model's own forward through a KV cache instead of the scheduler, as
//! transformers' forward with `past_key_values` runs on the Python side. Seeded random prompt tokens run
//! [`STEPS_CHUNK`] a pass (a long prompt's scores in one pass would outgrow memory) until the cache holds the
//! first context (timed: the prefill), then one untimed step (its token's columns may be the cache's
//! first spare ones) and `--new` timed one-token steps, each with the output head and a greedy pick; the
//! prompt then goes on to the next context, and so on: one sequence prefilled once, not once per context.
//! `--prompt-len` and `--repeats` do not apply. Prints one JSON object per context, with the prefill's wall
//! and CPU seconds, the cache's bytes and the peak RSS so far. With `--filled`, each context's cache is filled instead of prefilled: standard
//! normal keys and values in the attention layers and, in the linear-attention layers, the states of
//! each row's first prompt token (a step's cost does not depend on what the cache holds), so that a
//! long context's step is measured without its prefill.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use holo_runtime::local::generate::{generate, GenerationParams, Stopping};
use holo_runtime::local::model::{positions_from_mask, KvCache, LayerSequence};
use holo_runtime::local::{files, gguf, parse_device, Model, Ops};
use rand::{Rng, SeedableRng};

/// Prompt tokens one `--steps` prefill pass runs: the scheduler's default `max_num_batched_tokens` is
/// 2,048; half keeps an 8k-token prompt's scores of a 16-head layer within 512 MiB.
const STEPS_CHUNK: usize = 1024;

fn main() -> ExitCode {
    holo_runtime::local::threads::settle();
    let mut args = std::env::args().skip(1);
    let mut dir = None;
    let mut dtype = DType::F32;
    let mut device = Device::Cpu;
    let mut quantized = false;
    let mut steps: Option<Vec<usize>> = None;
    let mut filled_cache = false;
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
            "--filled" => filled_cache = true,
            "--steps" => {
                let list = args.next().unwrap_or_default();
                steps = match list
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<Vec<usize>, _>>()
                {
                    Ok(contexts) if !contexts.is_empty() => Some(contexts),
                    _ => {
                        eprintln!("error: --steps takes contexts such as 512,1024, not {list:?}");
                        return ExitCode::from(2);
                    }
                };
            }
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
        eprintln!("usage: sample_bench MODEL_DIR [--batch N] [--prompt-len N] [--new N] [--repeats N] [--seed N] [--dtype T] [--device D] [--quantized] [--steps L,L.. [--filled]]");
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
    if let Some(contexts) = &steps {
        prompt_len = contexts.iter().copied().max().unwrap_or(prompt_len);
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let vocab = model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|_| {
            (0..prompt_len)
                .map(|_| rng.random_range(0..vocab))
                .collect()
        })
        .collect();
    if let Some(contexts) = &steps {
        return match timed_steps(&model, &prompts, contexts, new, filled_cache) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("error: {error}");
                ExitCode::from(1)
            }
        };
    }
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

/// Runs `width` tokens of every row (row-major in `ids`) after the `cached` columns of `cache`; the
/// greedy pick of each row's last.
fn pass(
    model: &Model,
    cache: &mut KvCache,
    ids: Vec<u32>,
    width: usize,
    cached: usize,
) -> candle_core::Result<Vec<u32>> {
    let device = model.device();
    let batch = ids.len() / width;
    let ids = Tensor::new(ids, device)?.reshape((batch, width))?;
    let columns: Vec<u32> = (cached as u32..(cached + width) as u32).collect();
    let positions = Tensor::new(columns, device)?
        .unsqueeze(0)?
        .repeat((batch, 1))?;
    let mask = Tensor::ones((batch, cached + width), DType::U8, device)?;
    let hidden = model.forward_hidden(&ids, &positions, &mask, Some(cache), Ops::Fast)?;
    let logits = model.logits(&hidden.narrow(1, width - 1, 1)?, Ops::Fast)?;
    logits.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()
}

/// `--filled`: a cache of `context` columns without running them: every row's first prompt token run
/// alone gives the linear-attention layers' states (of fixed size, whatever the context), and the
/// attention layers get `context` columns of standard normal keys and values, which a step reads as
/// it reads a prompt's.
fn filled(model: &Model, prompts: &[Vec<u32>], context: usize) -> candle_core::Result<KvCache> {
    let mut first = KvCache::new(&model.config);
    let ids = prompts.iter().map(|prompt| prompt[0]).collect();
    pass(model, &mut first, ids, 1, 0)?;
    let mut rows = Vec::with_capacity(prompts.len());
    for row in 0..prompts.len() {
        let mut layers = first.row(row, &[1])?;
        for layer in &mut layers {
            if let LayerSequence::KeysValues { keys, values, .. } = layer {
                let (_, heads, _, head_dim) = keys.dims4()?;
                let shape = (1, heads, context, head_dim);
                *keys = Tensor::randn(0f32, 1.0, shape, keys.device())?.to_dtype(keys.dtype())?;
                *values =
                    Tensor::randn(0f32, 1.0, shape, values.device())?.to_dtype(values.dtype())?;
            }
        }
        rows.push(Some((context, layers)));
    }
    let mut cache = KvCache::new(&model.config);
    cache.prefill(&rows, context, model)?;
    Ok(cache)
}

/// `--steps`: for each context, a cache that holds it (the prompts run through it [`STEPS_CHUNK`]
/// tokens a pass, going on from the previous context; or with `filled`, [`filled`]'s), one untimed step,
/// then `new` timed greedy steps. One JSON object per context.
fn timed_steps(
    model: &Model,
    prompts: &[Vec<u32>],
    contexts: &[usize],
    new: usize,
    filled_cache: bool,
) -> candle_core::Result<()> {
    let batch = prompts.len();
    let mut cache = KvCache::new(&model.config);
    // Columns cached, and prompt tokens taken so far (the steps' own tokens count as context too).
    let (mut cached, mut taken) = (0, 0);
    for &context in contexts {
        let (start, cpu) = (Instant::now(), process_cpu_seconds());
        let mut picked = prompts.iter().map(|prompt| prompt[0]).collect();
        if filled_cache {
            cache = filled(model, prompts, context)?;
            cached = context;
        } else if context <= cached {
            candle_core::bail!(
                "contexts must grow by more than the steps between them (at {cached} columns, {context} asked)"
            );
        }
        while cached < context {
            let width = STEPS_CHUNK.min(context - cached);
            let ids = prompts
                .iter()
                .flat_map(|prompt| &prompt[taken..taken + width])
                .copied()
                .collect();
            picked = pass(model, &mut cache, ids, width, cached)?;
            (cached, taken) = (cached + width, taken + width);
        }
        let (prefill, prefill_cpu) = (start.elapsed().as_secs_f64(), process_cpu_seconds() - cpu);
        picked = pass(model, &mut cache, picked, 1, cached)?;
        cached += 1;
        let start = Instant::now();
        for _ in 0..new {
            picked = pass(model, &mut cache, picked, 1, cached)?;
            cached += 1;
        }
        let decode = start.elapsed().as_secs_f64();
        println!(
            "{}",
            serde_json::json!({
                "batch": batch,
                "context": context,
                "filled": filled_cache,
                "new_tokens": new,
                "prefill_s": (!filled_cache).then_some(prefill),
                "prefill_cpu_s": (!filled_cache).then_some(prefill_cpu),
                "decode_s": decode,
                "per_token_ms": decode / new as f64 * 1e3,
                "decode_tokens_per_s": (batch * new) as f64 / decode,
                "cache_bytes": cache.bytes(),
                "peak_rss_mib": peak_rss_mib(),
            })
        );
    }
    Ok(())
}

/// This process's peak resident memory so far (Linux's `VmHWM`), in MiB.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}
