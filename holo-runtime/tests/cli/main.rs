//! The `holo` binary end to end.
//!
//! One test binary per layer (`cargo test -p holo-runtime --test cli`); a file per subject.

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "local")]
mod compare_cli;
#[cfg(feature = "local")]
mod constrained_train;
mod demo_cli;
mod export_data_cli;
mod holo_cli;
mod holo_dry_model;
#[cfg(feature = "local")]
mod holo_local;
mod memory_plan;
mod native_tools_train;
mod sandbox_train;
mod sft_cli;
mod train_cli;
mod view_cli;
