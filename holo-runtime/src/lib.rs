//! The runtime that compiled holowares link against, and the `holo` tool.
//!
//! This crate is a facade over the layer crates nested under `holo-runtime/` (`docs/architecture.md`
//! draws them): every item of `holo-core` at the root and under its module names, and the other layers
//! as modules behind features.
//!
//! - [`Holotype`]: the trait user types implement to inject text, run tools, loop over bodies and give
//!   rewards; the `.hol` file refers to them by name.
//! - [`Machine`]: the sans-IO state machine that `include_holoware!` generates for a `.hol` file. It
//!   returns sample requests and never calls a model itself.
//! - [`Recorder`]: where a machine writes what happens (contexts, messages, text, completions, rewards);
//!   [`Transcript`] is the readable one used by tests and dry runs.
//! - `local` (feature `local`): Hugging Face and GGUF models in process on candle (`holo-model`);
//!   `train`: GRPO, PPO, SFT and ERL (`holo-train`; feature `train` alone gives its loop without
//!   candle, for the Tinker backend); `serve`: the OpenAI-compatible server (`holo-serve`); `engines`
//!   (feature `engines`): Atropos, NeMo Gym and Tinker (`holo-engines`).

#![forbid(unsafe_code)]

pub use holo_core::*;

#[cfg(feature = "local")]
pub mod demo;
#[cfg(feature = "engines")]
pub use holo_engines as engines;
#[cfg(feature = "local")]
pub use holo_model as local;
#[cfg(feature = "local")]
pub use holo_serve as serve;
#[cfg(feature = "train")]
pub use holo_train as train;

/// What this build of the runtime was made from (`build.rs`): the sources' git commit and whether they
/// had uncommitted changes, the workspace's `Cargo.lock`, and the crate of the built-in holotypes. A
/// training run records it in `provenance.json`.
#[cfg(feature = "train")]
pub fn build() -> train::provenance::Build {
    train::provenance::Build::new(
        env!("HOLO_GIT_COMMIT"),
        env!("HOLO_GIT_DIRTY"),
        include_bytes!(concat!(env!("OUT_DIR"), "/Cargo.lock")),
        &[("holo-core", holo_core::VERSION)],
    )
}
pub mod view;
