//! The output head at a real vocabulary, alone: the training head's forward and backward (the scores of
//! the trained tokens from the final hidden states, in blocks of logits, and their gradients into the
//! hidden states and the tied head) and decoding's head product.
//!
//!     cargo run -p holo-model --example head_bench -- \
//!         [--vocab 151936] [--hidden 896] [--tokens 2048] [--rows 16] [--repeats 3] [--decode-steps 8] \
//!         [--head-lora RANK]
//!
//! The head is trained whole (full fine-tuning of the tied embeddings) unless `--head-lora` is given:
//! then LoRA adapts `q_proj`, and with a `RANK` above 0 the head too (`lm_head`, at that rank), the head
//! staying frozen otherwise. `peak_rss_mb` is the process's resident memory before the head's passes and
//! its peak during them (Linux's `VmHWM`, reset through `/proc/self/clear_refs` before the passes).
//!
//! The defaults are one GRPO micro-batch at Qwen2.5-0.5B's shapes (16 completions of 128 tokens) and its
//! decoding batch. Prints one JSON object: for each phase the median wall seconds and the CPU seconds
//! the process spent (user and system, all threads), so that a run on a loaded machine still compares:
//! with `RAYON_NUM_THREADS=1` the CPU seconds are the work alone, no thread waiting on another.

use std::process::ExitCode;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use holo_model::config::Arch;
use holo_model::head::column;
use holo_model::testing::{config, random_model};
use holo_model::Ops;

fn main() -> ExitCode {
    holo_model::threads::settle();
    let mut args = std::env::args().skip(1);
    let (mut vocab, mut hidden, mut tokens, mut rows, mut repeats, mut decode_steps) =
        (151_936, 896, 2048, 16, 3, 8);
    let mut head_lora = None;
    while let Some(arg) = args.next() {
        let Some(value) = args.next().and_then(|value| value.parse::<usize>().ok()) else {
            eprintln!("error: {arg} needs a number");
            return ExitCode::from(2);
        };
        match arg.as_str() {
            "--vocab" => vocab = value,
            "--hidden" => hidden = value,
            "--tokens" => tokens = value,
            "--rows" => rows = value,
            "--repeats" => repeats = value.max(1),
            "--decode-steps" => decode_steps = value.max(1),
            "--head-lora" => head_lora = Some(value),
            other => {
                eprintln!("error: unknown argument {other}");
                return ExitCode::from(2);
            }
        }
    }
    match run(
        vocab,
        hidden,
        tokens,
        rows,
        repeats,
        decode_steps,
        head_lora,
    ) {
        Ok(report) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run(
    vocab: usize,
    hidden: usize,
    tokens: usize,
    rows: usize,
    repeats: usize,
    decode_steps: usize,
    head_lora: Option<usize>,
) -> candle_core::Result<serde_json::Value> {
    let mut shape = config(Arch::Qwen2);
    shape.vocab_size = vocab;
    shape.hidden_size = hidden;
    shape.num_attention_heads = 1;
    shape.num_key_value_heads = 1;
    shape.head_dim = hidden;
    let base = random_model(&shape, DType::F32);
    let (model, _vars) = match head_lora {
        None => base.trainable()?,
        Some(rank) => {
            let head = if rank > 0 { vec!["lm_head"] } else { vec![] };
            base.with_lora(&holo_model::model::LoraConfig {
                rank: rank.max(1),
                targets: holo_model::model::Targets::Names(
                    ["q_proj"]
                        .into_iter()
                        .chain(head)
                        .map(String::from)
                        .collect(),
                ),
                ..Default::default()
            })?
        }
    };
    drop(base);
    let states = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (tokens, hidden), &Device::Cpu)?))?;
    let targets: Vec<u32> = (0..tokens).map(|i| ((i * 7919) % vocab) as u32).collect();
    let targets = Tensor::new(targets.as_slice(), &Device::Cpu)?;
    let mut forward = Vec::new();
    let mut backward = Vec::new();
    // The peak from here on: building the random model peaked higher than a pass might.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let peak_before = peak_rss_mb();
    for _ in 0..repeats {
        let started = Clock::now();
        let scores = model.head_scores(states.as_tensor(), &targets, 1.0)?;
        let loss = scores.narrow(1, column::LOGPROB, 1)?.sum_all()?;
        forward.push(started.elapsed());
        let started = Clock::now();
        let grads = loss.backward()?;
        backward.push(started.elapsed());
        drop(grads);
    }
    let peak_after = peak_rss_mb();
    let decoding = model.detached();
    let last = Tensor::randn(0f32, 1.0, (rows, hidden), &Device::Cpu)?;
    let mut product = Vec::new();
    for _ in 0..repeats {
        let started = Clock::now();
        for _ in 0..decode_steps {
            std::hint::black_box(decoding.logits(&last, Ops::Fast)?);
        }
        product.push(started.elapsed());
    }
    Ok(serde_json::json!({
        "vocab": vocab,
        "hidden": hidden,
        "tokens": tokens,
        "rows": rows,
        "decode_steps": decode_steps,
        "threads": std::env::var("RAYON_NUM_THREADS").ok(),
        "head_lora": head_lora,
        "peak_rss_mb": {"before_head": peak_before, "after_head": peak_after},
        "training_head_forward": Spent::median(&forward),
        "training_head_backward": Spent::median(&backward),
        "decoding_head_product": Spent::median(&product),
    }))
}

/// The process's peak resident memory in MB (Linux: `VmHWM` of `/proc/self/status`); 0 elsewhere.
fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|kb| kb.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Wall and CPU time at one moment.
struct Clock {
    wall: Instant,
    cpu: f64,
}

impl Clock {
    fn now() -> Clock {
        Clock {
            wall: Instant::now(),
            cpu: cpu_seconds(),
        }
    }

    fn elapsed(&self) -> Spent {
        Spent {
            wall: self.wall.elapsed().as_secs_f64(),
            cpu: cpu_seconds() - self.cpu,
        }
    }
}

#[derive(Clone, Copy)]
struct Spent {
    wall: f64,
    cpu: f64,
}

impl Spent {
    /// The run with the median wall time, as `{"wall_s", "cpu_s"}`.
    fn median(runs: &[Spent]) -> serde_json::Value {
        let mut runs = runs.to_vec();
        runs.sort_by(|a, b| a.wall.total_cmp(&b.wall));
        let middle = runs[runs.len() / 2];
        serde_json::json!({"wall_s": middle.wall, "cpu_s": middle.cpu})
    }
}

/// The process's user and system CPU seconds, all threads (Linux: `/proc/self/stat`, in clock ticks of
/// 1/100 s); 0 elsewhere.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command's closing parenthesis: state is the 3rd field, utime the 14th, stime 15th.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i - 3)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(14) + ticks(15)) / 100.0
}
