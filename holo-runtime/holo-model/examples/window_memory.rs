//! The keys and values one long sequence holds in the scheduler's cache, for a model with windowed
//! layers (the figure in `docs/architecture.md`'s invariant on windows).
//!
//!     cargo run -p holo-model --example window_memory -- \
//!         [--arch gemma3_text] [--preset small|tiny] [--tokens 4096] [--new 64] [--batch 1] \
//!         [--dtype f32|bf16]
//!
//! Writes `holo init-model --arch ARCH --preset PRESET` (`small`: the family's real layer shapes and
//! windows, gemma-3-1b's 26 layers, five of six sliding over 512 positions; `tiny`: two layers of
//! width 64, windows of 8, where what a step costs besides the weights shows) into a temporary folder, samples
//! `--batch` sequences of `--tokens` tokens each (a random prompt, then `--new` sampled tokens), and
//! prints one JSON object: the cache's bytes after the last step (what the scheduler reports as
//! `kv_bytes`), what the same columns would take if every layer kept them all, and the decoding rate
//! at that length (new tokens once every row has its first token, so without the prefill): per second
//! of wall time, and per second of CPU time of all the process's threads (Linux: from
//! `/proc/self/task/*/schedstat`), which other work on a busy machine moves far less.

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use holo_core::{Prompt, Request, SampleParams};
use holo_model::init::{init_model, parse_arch, InitOptions, Preset};
use holo_model::{parse_dtype, LocalModel, LocalOptions};
use rand::{Rng, SeedableRng};

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut arch, mut preset, mut tokens, mut new, mut batch, mut dtype) =
        ("gemma3_text".to_string(), Preset::Small, 4096, 64, 1, None);
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_default();
        match arg.as_str() {
            "--arch" => arch = value,
            "--preset" => match value.parse() {
                Ok(parsed) => preset = parsed,
                Err(error) => {
                    eprintln!("error: {error}");
                    return ExitCode::from(2);
                }
            },
            "--tokens" => tokens = value.parse().unwrap_or(0),
            "--new" => new = value.parse().unwrap_or(0),
            "--batch" => batch = value.parse().unwrap_or(0),
            "--dtype" => dtype = Some(value),
            other => {
                eprintln!("error: unknown argument {other}");
                return ExitCode::from(2);
            }
        }
    }
    if new < 2 || tokens <= new || batch == 0 {
        eprintln!("error: --tokens must be larger than --new, --new at least 2, --batch positive");
        return ExitCode::from(2);
    }
    match run(&arch, preset, tokens, new, batch, dtype.as_deref()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run(
    arch: &str,
    preset: Preset,
    tokens: usize,
    new: usize,
    batch: usize,
    dtype: Option<&str>,
) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("holo-window-memory-{}", std::process::id()));
    let options = InitOptions {
        arch: parse_arch(arch)?,
        preset,
        seed: 0,
        force: true,
        vocab: None,
        layers: None,
    };
    init_model(&dir, &options).map_err(|error| error.to_string())?;
    let device = candle_core::Device::Cpu;
    let model = LocalModel::load(
        &dir,
        LocalOptions {
            dtype: parse_dtype(dtype, &device)?,
            ..LocalOptions::default()
        },
    );
    std::fs::remove_dir_all(&dir).map_err(|error| error.to_string())?;
    let model = model.map_err(|error| error.to_string())?;
    let config = model.config().clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let requests: Vec<Request> = (0..batch)
        .map(|row| Request {
            prompt: Prompt::Tokens(
                (0..tokens - new)
                    .map(|_| rng.random_range(3..config.vocab_size as u32))
                    .collect(),
            ),
            params: SampleParams {
                max_tokens: Some(new as u32),
                ignore_eos: true,
                seed: Some(row as u64),
                ..SampleParams::default()
            },
        })
        .collect();
    // The scheduler publishes the cache's bytes after each step; the sink reads them at each token
    // (after the step before), so the last token's reading is the cache after `tokens - 1` positions.
    // The decoding rate counts the tokens after the one that gives the last row its first (every
    // prompt is prefilled: a batch too wide for one prefill joins a row or a few at a time), up to the
    // last token.
    let stats = model.scheduler_stats();
    let (last, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let decoding = Arc::new(Mutex::new(Decoding {
        started: vec![false; batch],
        joined: None,
        after: 0,
        last: Instant::now(),
    }));
    let sink = {
        let (stats, last, peak) = (Arc::clone(&stats), Arc::clone(&last), Arc::clone(&peak));
        let decoding = Arc::clone(&decoding);
        Arc::new(move |row: usize, _: u32, _: f32| {
            last.store(stats.kv_bytes(), Ordering::Relaxed);
            peak.fetch_max(stats.kv_bytes(), Ordering::Relaxed);
            let mut decoding = decoding.lock().expect("no panics");
            decoding.last = Instant::now();
            if decoding.joined.is_some() {
                decoding.after += 1;
            } else {
                decoding.started[row] = true;
                if decoding.started.iter().all(|&started| started) {
                    decoding.joined = Some((decoding.last, cpu_seconds()));
                }
            }
            true
        })
    };
    let started = Instant::now();
    let completions = model.sample_blocking_streaming(&requests, sink);
    let seconds = started.elapsed().as_secs_f64();
    let end_cpu = cpu_seconds();
    let mut sampled = 0;
    for completion in completions {
        sampled += completion.map_err(|error| error.to_string())?.tokens.len();
    }
    let decoding = decoding.lock().expect("no panics");
    let (joined, joined_cpu) = decoding.joined.ok_or("a row sampled nothing")?;
    let (decoded, decoding_cpu) = (decoding.after, end_cpu - joined_cpu);
    let decoding = decoding.last - joined;
    let attention_layers = config.layers.iter().filter(|layer| !layer.linear).count();
    let windows: Vec<Option<usize>> = config.layers.iter().map(|layer| layer.window).collect();
    let column_bytes =
        2 * config.num_key_value_heads * config.head_dim * model.model().dtype().size_in_bytes();
    let columns = tokens - 1;
    println!(
        "{}",
        serde_json::json!({
            "arch": arch,
            "preset": preset.to_string(),
            "layers": attention_layers,
            "windows": windows,
            "tokens": tokens,
            "batch": batch,
            "sampled": sampled,
            "kv_bytes_last_step": last.load(Ordering::Relaxed),
            "kv_bytes_peak_while_decoding": peak.load(Ordering::Relaxed),
            "every_layer_every_column_bytes": attention_layers * columns * column_bytes,
            "seconds": seconds,
            "decode_tokens_per_s": decoded as f64 / decoding.as_secs_f64(),
            "decode_cpu_seconds": decoding_cpu,
            "decode_tokens_per_cpu_s": decoded as f64 / decoding_cpu,
        })
    );
    Ok(())
}

/// The sampled tokens as the sink sees them: which rows have their first, when the last did (the wall
/// and CPU clocks), and how many came after it.
struct Decoding {
    started: Vec<bool>,
    joined: Option<(Instant, f64)>,
    after: usize,
    last: Instant,
}

/// CPU seconds the process's threads have run (NaN where `/proc` does not say).
fn cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return f64::NAN;
    };
    let nanoseconds: u64 = tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|stat| stat.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    nanoseconds as f64 / 1e9
}
