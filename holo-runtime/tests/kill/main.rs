//! `holo train` (GRPO, PPO, ERL) and `holo sft` killed at any moment, resumed with `--resume` until they
//! finish: every trial must end with the metrics, rollouts and final weights of the run never
//! interrupted.
//!
//! A trial kills a run one to three times before letting it finish: at a named point inside a checkpoint
//! write or inside a resume's own rewriting of the run's files (`HOLO_KILL_AT`, holo-train's `kill`
//! module), or with SIGKILL from here after some of its stderr lines and a delay, which lands anywhere else
//! (loading, sampling, a backward pass, between the files of a save). Every choice comes from a random
//! generator seeded by the trainer and the trial's number, so a failing trial is repeated by its number.
//!
//! `HOLO_KILL_TRIALS` trials per trainer (default 3, so that `cargo test` stays quick);
//! `bash scripts/kill-trials.sh [TRIALS]` runs 50 each in release and prints each trainer's counts.

#![cfg(feature = "local")]

#[path = "../common/mod.rs"]
mod common;

mod trainers;
mod trial;
