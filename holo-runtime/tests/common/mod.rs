//! Helpers shared by the facade's integration tests; a test binary takes them with
//! `#[path = "../common/mod.rs"] mod common;`. What does not need the facade (the `holo` binary, the
//! trainer) is in `tests/support/`, which the layers' own test binaries share too.
#![allow(dead_code)]

#[path = "../support/mod.rs"]
mod support;
pub use support::*;

#[cfg(feature = "local")]
pub mod logits;
#[cfg(feature = "local")]
pub mod served;

use std::path::Path;
use std::process::Command;

/// The model parity fixtures (`tests/fixtures/models/NAME`, from `scripts/model_fixtures.py`), one per
/// family the local runtime implements.
pub const MODEL_FAMILIES: [&str; 16] = [
    "qwen2",
    "llama",
    "qwen3",
    "mistral",
    "ministral",
    "smollm3",
    "olmo2",
    "olmo3",
    "gemma2",
    "gemma3",
    "gemma3_softcap",
    "phi3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_moe",
    "gpt_oss",
];

/// The random Qwen3 fixture given Qwen3's real chat template (the fixture's own is a bare ChatML, which
/// renders no tools), copied into `dir/qwen3`. `max_positions` replaces the fixture's 512 where a test's
/// contexts are longer (the template's tool list alone is about 490 tokens of its small vocabulary); a
/// random model's limit is arbitrary.
pub fn qwen3_with_tools(dir: &Path, max_positions: Option<u64>) -> std::path::PathBuf {
    let model = dir.join("qwen3");
    std::fs::create_dir(&model).unwrap();
    let tiny = repo().join("holo-runtime/tests/fixtures/models/qwen3");
    for file in [
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ] {
        std::fs::copy(tiny.join(file), model.join(file)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny.join("config.json")).unwrap()).unwrap();
    if let Some(positions) = max_positions {
        config["max_position_embeddings"] = positions.into();
    }
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        repo().join("holo-runtime/tests/fixtures/chat/models/qwen3/tokenizer_config.json"),
        model.join("tokenizer_config.json"),
    )
    .unwrap();
    model
}

/// `holo ARGS`, run from the workspace root.
pub fn holo_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_holo"));
    command.args(args).current_dir(repo());
    command
}

/// `count` rows of `hol/qa.hol` ("What is i+4?", i = 1 … count), written to `dir/rows.jsonl`.
pub fn qa_rows(dir: &Path, count: usize) -> std::path::PathBuf {
    let data = dir.join("rows.jsonl");
    let rows: String = (1..=count)
        .map(|i| {
            let row = serde_json::json!({
                "question": format!("What is {i}+4?"),
                "expected": (i + 4).to_string(),
            });
            format!("{row}\n")
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    data
}

/// `holo train hol/qa.hol --model MODEL --data DATA --out OUT` for `steps` steps of 4 rollouts per
/// prompt in batches of 8, 8 completion tokens: the small runs of the mixture-of-experts and export
/// tests; the caller adds its options.
pub fn qa_train(model: &Path, data: &Path, out: &Path, steps: u32) -> Vec<String> {
    let mut args: Vec<String> = ["train", "hol/qa.hol", "--model"]
        .map(String::from)
        .to_vec();
    args.push(model.to_str().unwrap().into());
    args.extend(["--data".into(), data.to_str().unwrap().into()]);
    args.extend(["--out".into(), out.to_str().unwrap().into()]);
    args.extend(["--max-steps".to_string(), steps.to_string()]);
    args.extend(
        [
            "--num-generations",
            "4",
            "--per-device-train-batch-size",
            "8",
            "--max-completion-length",
            "8",
        ]
        .map(String::from),
    );
    args
}

/// `holo ARGS` run to its end, arguments as [`qa_train`] and [`tiny_train`] give them.
pub fn holo_output(args: &[String]) -> std::process::Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    holo_command(&args).output().unwrap()
}

/// [`holo_output`] of a command that must succeed: its stderr is the failure's message otherwise.
pub fn holo_succeeds(args: &[String]) -> std::process::Output {
    let output = holo_output(args);
    assert!(
        output.status.success(),
        "holo {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// `holo train HOLOWARE --model <the committed tiny Qwen2> --data DATA --out OUT`, the fixtures named
/// `relative` to `tests/fixtures`: how every end-to-end training command of the tests starts; the
/// caller adds its budget and options.
pub fn tiny_train(holoware: &str, data: &str, out: &Path) -> Vec<String> {
    vec![
        "train".into(),
        fixture(holoware),
        "--model".into(),
        fixture("models/qwen2"),
        "--data".into(),
        fixture(data),
        "--out".into(),
        out.to_str().unwrap().into(),
    ]
}

/// `holo train HOLOWARE` (relative to `tests/fixtures/train`) on the committed rows (also held out) for
/// `steps` steps with the small GRPO budget the end-to-end tests share (G 4, batches of 4 in 2
/// micro-batches, 12 completion tokens, a KL term, evaluation every 3 steps, 2 checkpoints kept, seed 7);
/// then `extra`.
pub fn tiny_grpo(holoware: &str, out: &Path, steps: u32, extra: &[&str]) -> Vec<String> {
    let mut args = tiny_train(&format!("train/{holoware}"), "train/rows.jsonl", out);
    args.extend(["--eval-data".into(), fixture("train/rows.jsonl")]);
    args.extend(["--max-steps".to_string(), steps.to_string()]);
    args.extend(
        [
            "--num-generations",
            "4",
            "--per-device-train-batch-size",
            "4",
            "--gradient-accumulation-steps",
            "2",
            "--max-completion-length",
            "12",
            "--learning-rate",
            "0.003",
            "--beta",
            "0.04",
            "--save-total-limit",
            "2",
            "--eval-steps",
            "3",
            "--seed",
            "7",
        ]
        .iter()
        .chain(extra)
        .map(|arg| arg.to_string()),
    );
    args
}

/// `holo sft DATA` on the committed tiny Qwen2 into `out`: batches of 2, two per step (the five
/// committed examples make an epoch of 2 steps, the second of one batch), three epochs, a checkpoint every
/// 2 steps; then `extra`.
pub fn sft_args(data: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "sft".to_string(),
        data.to_str().unwrap().into(),
        "--model".into(),
        fixture("models/qwen2"),
        "--out".into(),
        out.to_str().unwrap().into(),
    ];
    args.extend(
        [
            "--per-device-train-batch-size",
            "2",
            "--gradient-accumulation-steps",
            "2",
            "--num-train-epochs",
            "3",
            "--learning-rate",
            "3e-3",
            "--lr-scheduler-type",
            "cosine",
            "--save-steps",
            "2",
            "--seed",
            "11",
        ]
        .iter()
        .chain(extra)
        .map(|arg| arg.to_string()),
    );
    args
}

/// The device the transformers parity tests run on: `HOLO_TEST_DEVICE` (`cpu`, `cuda:0`, …; the CPU
/// when unset). `scripts/gpu-check.sh` sets it to run them on a GPU; they compare in f32 there too.
#[cfg(feature = "local")]
pub fn test_device() -> candle_core::Device {
    let name = std::env::var("HOLO_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    holo_runtime::local::parse_device(&name)
        .unwrap_or_else(|error| panic!("HOLO_TEST_DEVICE={name}: {error}"))
}

/// A run folder's training rollouts (`rollouts.jsonl`), in the file's order.
pub fn run_rollouts(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// The weight versions a rollout record's sampled parts carry, in order (`None` where a part has none).
pub fn sampled_versions(record: &serde_json::Value) -> Vec<Option<u64>> {
    let mut versions = Vec::new();
    for context in record["contexts"].as_array().unwrap() {
        for message in context["messages"].as_array().unwrap() {
            for part in message["parts"].as_array().unwrap() {
                if part["sampled"] == true {
                    versions.push(part["weight_version"].as_u64());
                }
            }
        }
    }
    versions
}

/// A run folder's metrics.jsonl without the wall-clock figures (`step_time`, `time/*`): what two runs
/// of the same seed must agree on.
#[cfg(feature = "train")]
pub fn run_metrics(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            let mut value: serde_json::Value = serde_json::from_str(line).unwrap();
            value
                .as_object_mut()
                .unwrap()
                .retain(|name, _| !holo_runtime::train::run::is_wall_clock(name));
            value
        })
        .collect()
}
