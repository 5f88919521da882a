//! Chaos: faults injected into real runs, each bounded by deadlines on real events (a process's exit, a
//! request's arrival, a line on stderr), loopback only, over several seeds where a seed decides where
//! the fault lands. For every fault the run ends within its deadline, recovers or stops with an error
//! that names the fault, and loses nothing it had done (records, metrics, checkpoints; `--resume`
//! continues from them).
//!
//! | family | faults |
//! |---|---|
//! | `rollout_server` | the server dies holding a request (a stub; `holo serve` SIGKILLed), accepts and never answers, stalls its answer's body, answers 5xx, is SIGSTOPped |
//! | `holotypes` | model-written code that never ends (the sandbox's time limit), a holotype that panics |
//! | `nan_loss` | a learning rate that blows the weights up: a NaN loss |
//! | `checkpoints` | the disk fills while a checkpoint is written (a small tmpfs), a truncated or corrupt checkpoint, a flipped bit (the checksums) |
//! | `engine_api` | an Atropos API answering 5xx, for a while and for good |
//!
//! One test binary (`cargo test -p holo-runtime --test chaos`); a file per family of faults.

#[path = "../common/mod.rs"]
mod common;

#[cfg(all(feature = "local", feature = "cli"))]
mod faults;
mod support;

#[cfg(all(feature = "local", feature = "cli"))]
mod checkpoints;
#[cfg(all(feature = "local", feature = "cli"))]
mod engine_api;
#[cfg(feature = "cli")]
mod holotypes;
#[cfg(all(feature = "local", feature = "cli"))]
mod nan_loss;
#[cfg(all(feature = "local", feature = "cli"))]
mod rollout_server;
