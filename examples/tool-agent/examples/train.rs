//! GRPO on `hol/tool.hol` compiled to Rust: the same [`Trainer`] as `holo train`, fed by the typed machine
//! `include_holoware!` generates (with this crate's own holotypes) instead of the interpreter.
//!
//!     cargo run --release -p tool-agent --example train -- MODEL_DIR RUN_DIR [STEPS]
//!
//! MODEL_DIR is a Hugging Face Qwen2 / Llama folder (`holo init-model DIR` makes a tiny random one);
//! RUN_DIR receives metrics.jsonl, TensorBoard events, rollouts and checkpoints, as with `holo train`.

use std::path::PathBuf;
use std::process::ExitCode;

use holo_runtime::interpreter::Row;
use holo_runtime::train::{GrpoConfig, Policy, RunOptions, Trainer, TrainingArguments};
use holo_runtime::{Machine, Resources, Rollout};
use tool_agent::tool;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (Some(model), Some(out)) = (args.next(), args.next()) else {
        eprintln!("usage: train MODEL_DIR RUN_DIR [STEPS]");
        return ExitCode::from(2);
    };
    let steps: i64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(4);

    // Arithmetic questions in the form this crate's ExactAnswer checks: "... = 42?".
    let rows: Vec<(usize, Row)> = (0..16)
        .map(|i| {
            let (a, b) = (3 + i, 7 + 2 * i);
            let row = serde_json::json!({
                "query": format!("What is {a} * {b}? Answer as {a} * {b} = {}?", a * b),
                "expected": (a * b).to_string(),
            });
            (i, serde_json::from_value(row).expect("a JSON object"))
        })
        .collect();

    // Any `Fn(&Row) -> Result<Box<dyn Rollout + Send>, String>` is a rollout source.
    let resources = Resources::default();
    let source = move |row: &Row| -> Result<Box<dyn Rollout + Send>, String> {
        let input: tool::Input = serde_json::from_value(serde_json::Value::Object(row.clone()))
            .map_err(|error| error.to_string())?;
        let machine =
            tool::Machine::with_resources(input, &resources).map_err(|e| e.to_string())?;
        Ok(Box::new(machine))
    };

    let config = GrpoConfig {
        training: TrainingArguments {
            max_steps: steps,
            per_device_train_batch_size: 8,
            learning_rate: 1e-4,
            save_steps: 2,
            ..GrpoConfig::default().training
        },
        num_generations: 4,
        max_completion_length: 32,
        ..GrpoConfig::default()
    };
    let cpu = holo_runtime::local::parse_device("cpu").expect("the CPU");
    let policy = match Policy::load(model.as_ref(), &cpu) {
        Ok(policy) => policy,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    let options = RunOptions {
        out: PathBuf::from(out),
        resume: false,
        progress: true,
    };
    let result = Trainer::new(source, policy, config, options)
        .and_then(|mut trainer| trainer.train(&rows, &[]));
    match result {
        Ok(summary) => {
            println!(
                "{} steps; last reward {:?}; run in {}",
                summary.steps,
                summary.last.get("reward"),
                summary.run_dir.display()
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(1)
        }
    }
}
