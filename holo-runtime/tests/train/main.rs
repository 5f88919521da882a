//! The trainers (holo-train) through the facade: PPO's parity, the curriculum, the guard rails, ERL, the
//! library API, metrics, export.
//!
//! One test binary per layer (`cargo test -p holo-runtime --test train`); a file per subject.

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "local")]
mod ahead;
#[cfg(feature = "local")]
mod balance;
#[cfg(feature = "local")]
mod constrained;
#[cfg(feature = "local")]
mod curriculum;
#[cfg(feature = "local")]
mod dispatch;
#[cfg(feature = "local")]
mod erl;
#[cfg(feature = "local")]
mod guard;
#[cfg(feature = "local")]
mod moe_lora;
#[cfg(feature = "local")]
mod ppo_parity;
#[cfg(feature = "local")]
mod rollout_servers;
#[cfg(feature = "local")]
mod routing;
#[cfg(feature = "local")]
mod train_export;
#[cfg(feature = "local")]
mod train_library;
#[cfg(feature = "local")]
mod train_metrics;
