//! Helpers shared by the integration tests; a test file takes them with `mod common;`.
#![allow(dead_code)]

pub mod components;
pub mod http;
pub mod json;
#[cfg(feature = "local")]
pub mod logits;
pub mod parity;
pub mod process;
pub mod rollout;
#[cfg(feature = "local")]
pub mod served;
#[cfg(feature = "local")]
pub mod student;
pub mod tempdir;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root, where `hol/` and `examples/` are.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `holo ARGS`, run from the workspace root.
pub fn holo_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_holo"));
    command.args(args).current_dir(repo());
    command
}

/// The device the transformers parity tests run on: `HOLO_TEST_DEVICE` (`cpu`, `cuda:0`, …; the CPU
/// when unset). `scripts/gpu-check.sh` sets it to run them on a GPU; they compare in f32 there too.
#[cfg(feature = "local")]
pub fn test_device() -> candle_core::Device {
    let name = std::env::var("HOLO_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    holo_runtime::local::parse_device(&name)
        .unwrap_or_else(|error| panic!("HOLO_TEST_DEVICE={name}: {error}"))
}

/// A run folder's metrics.jsonl without the wall-clock figures (`step_time`, `time/*`): what two runs
/// of the same seed must agree on.
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
