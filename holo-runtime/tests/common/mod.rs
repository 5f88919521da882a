//! Helpers shared by the integration tests; a test file takes them with `mod common;`.
#![allow(dead_code)]

pub mod http;
pub mod json;

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
