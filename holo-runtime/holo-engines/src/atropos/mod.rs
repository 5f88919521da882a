//! Atropos, both ways: a Holoware environment that feeds any Atropos trainer ([`env`](mod@env), `holo
//! atropos-env`), and `holo train` fed by any Atropos environment (`batch`, `holo train --rollouts
//! atropos`).
//!
//! Atropos (`atroposlib`'s `run-api`) is a queue between environments and one trainer, in memory:
//!
//! ```text
//!  environment ──POST /register-env, GET /status-env, POST /scored_data──▶ run-api ◀──POST /register, GET /batch── trainer
//!  (rolls out against an OpenAI-compatible policy server)                  (queue)    (trains, serves or syncs the policy)
//! ```
//!
//! The wire types and the HTTP client are in [`api`]; they follow `atroposlib` 0.4.0's pydantic models
//! field for field and its `BaseEnv` client rule for rule (gzip, retries, registration, throttling).
//!
//! # One sequence per rollout
//!
//! A scored group is `G` sequences: each one a token list (`tokens`), the same list with `-100` on every
//! position that is not trained (`masks`), one score, and the sampler's log-probabilities aligned with
//! the tokens (`inference_logprobs`, `1.0` on the positions that are not trained). Atropos trainers
//! (`example_trainer`) train `tokens[:-1]` against `masks[1:]` with the sequence's advantage, and
//! `atroposlib`'s own multi-turn environments send the *whole transcript* with every assistant turn
//! unmasked (`tokenize_for_trainer(..., train_on_all_assistant_turns=True)`). A Holoware rollout's
//! trained context is exactly that: its token ids with the chat template's frames, the sampled turns
//! trained, tool results and user turns between them not. So each rollout is one sequence: its trained
//! context as the Holophore recorded it. A rollout with several trained contexts (ERL's attempt,
//! reflection and retry) has no single sequence and is refused with an error naming the row: Atropos's
//! queue packs groups of exactly `group_size` sequences, and one extra sequence per context would
//! change the group's size.

pub mod api;
#[cfg(feature = "local")]
pub mod batch;
pub mod env;
