//! Helpers the integration tests of every layer share: the facade's (`tests/common/`) and the layers'
//! own test binaries (`holo-core/tests/core/`). They name only holo-core, never the facade or the
//! `holo` binary, so that a layer's tests link nothing above it. A test binary takes them with
//! `#[path = "…/holo-runtime/tests/support/mod.rs"] mod common;`.
#![allow(dead_code)]

pub mod components;
pub mod http;
pub mod json;
pub mod parity;
pub mod process;
pub mod rollout;
pub mod student;
pub mod tempdir;

use std::path::{Path, PathBuf};

/// The workspace root, where `hol/` and `examples/` are: the nearest folder above the test's crate
/// that holds `Cargo.lock` (the crates sit at different depths).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|folder| folder.join("Cargo.lock").is_file())
        .expect("the workspace root (a folder with Cargo.lock) above CARGO_MANIFEST_DIR")
        .to_path_buf()
}

/// The committed fixtures (`holo-runtime/tests/fixtures`), for every layer's tests.
pub fn fixtures() -> PathBuf {
    repo().join("holo-runtime/tests/fixtures")
}

/// A committed fixture's path (`relative` to `holo-runtime/tests/fixtures`), as a command line takes it.
pub fn fixture(relative: &str) -> String {
    fixtures().join(relative).to_str().unwrap().to_string()
}
