//! GRPO training with TRL's semantics: `holo train`, and [`Trainer`] for machines compiled in Rust.
//!
//! One optimizer step, as TRL's `GRPOTrainer` takes it:
//! 1. **Generation** (every `steps_per_generation × num_iterations` micro-batches): the next
//!    `generation_batch_size / num_generations` distinct rows of the data (a fresh permutation each
//!    epoch) each get `num_generations` rollouts through the [`Loom`](holo_core::loom::Loom), recorded
//!    token by token by the Holophore and sampled by the trained model itself, at the run's
//!    `temperature`, `top_p` and `top_k`, each sample capped at `max_completion_length` tokens. A
//!    sample that runs out of tokens makes its rollout *truncated* (never failed). Every rollout is
//!    appended to `RUN_DIR/rollouts.jsonl` with its `step`.
//! 2. **Advantages** ([`advantages`]): each reward component (a holotype's reward, `NaN` where a rollout
//!    has none; a failed rollout has none at all), weighted by `reward_weights` or the holoware's weights,
//!    normalized within each row's group.
//! 3. **Log-probabilities**: of the weights that sampled (when `num_iterations` > 1 or steps and
//!    generations are misaligned), and of the frozen reference (when `beta` > 0).
//! 4. **Micro-batches** of `per_device_train_batch_size` rollouts from the shuffled generation batch: a
//!    forward pass over each trained context (`score`: only the positions that predict a trained token
//!    reach the output projection), the loss of `loss_type` (`loss`), and its backward pass (one layer
//!    at a time under `gradient_checkpointing`). A rollout's advantage applies to every token it sampled in
//!    a trained context, over all its turns; under `erl` each trained context has its own ([`erl`]), and
//!    successful second attempts add a cross-entropy under the first attempt's prompt.
//! 5. **The update** ([`optim`]): gradients summed over `gradient_accumulation_steps` micro-batches,
//!    clipped to `max_grad_norm`, one AdamW step at the scheduled learning rate. The sampler shares the
//!    weights, so the next generation samples from the new policy.
//! 6. **Evaluation** every `eval_steps` on held-out rows (`eval/reward`, `eval/pass@1`, `eval/pass@G`),
//!    one line of metrics per step ([`metrics`]: `metrics.jsonl` and TensorBoard events), and a
//!    checkpoint every `save_steps` ([`checkpoint`]) from which `--resume` continues exactly.
//!
//! Around these steps: the [`curriculum`] decides which rows a generation draws (lowest difficulty level
//! first, the next when the level's moving mean reward passes `curriculum_threshold`); DAPO's dynamic
//! sampling drops groups whose rewards are all equal and draws further rows in their place; the
//! [`guard`] rails stop a run whose `eval/reward` no longer improves, and roll a collapsing one (KL or
//! training reward) back to its last good checkpoint with a lower learning rate.
//!
//! Every random choice (data order, sampling seeds, shuffles, LoRA's initialization) is a function of
//! `seed` and the step, so a resumed run repeats the uninterrupted one.
//!
//! The loop, its configuration, advantages, metrics, checkpoints' folders and state, guard rails,
//! curriculum and reports need no model: they are what a remote backend (`holo_engines::tinker`) trains
//! with. The feature `local` (on by default) adds the model trained in process on candle: the `Local`
//! backend, the losses on tensors, PPO, SFT, AdamW, the memory plan, the weight sync and `holo export`.

// The documentation links the model's items (`loss`, `ppo`, `checkpoint::save`, …), which a build
// without `local` leaves out; the default build's `cargo doc` checks every link.
#![cfg_attr(not(feature = "local"), allow(rustdoc::broken_intra_doc_links))]

pub mod advantages;
pub mod batch;
pub mod builder;
pub mod checkpoint;
pub mod config;
pub mod correction;
pub mod curriculum;
pub mod erl;
mod error;
#[cfg(feature = "local")]
pub mod export;
pub mod feed;
pub mod guard;
pub mod kill;
#[cfg(feature = "local")]
pub mod loss;
pub mod metrics;
pub mod optim;
pub mod options;
#[cfg(feature = "local")]
pub mod pack;
#[cfg(feature = "local")]
pub mod plan;
#[cfg(feature = "local")]
pub mod ppo;
pub mod provenance;
#[cfg(feature = "local")]
pub mod replay;
pub mod report;
mod rollouts;
pub mod run;
mod sampling;
#[cfg(feature = "local")]
pub mod score;
#[cfg(feature = "local")]
pub mod sft;
pub mod state;
#[cfg(feature = "local")]
pub mod sync;
mod trainer;

pub use builder::ConfigBuilder;
pub use config::{
    ChatTemplateKwargs, ConfigError, GrpoConfig, Inert, SandboxConfig, TrainingArguments,
    TrainingConfig,
};
pub use correction::importance_sampling;
pub use error::TrainError;
#[cfg(feature = "local")]
pub use run::Policy;
pub use run::RunOptions;
pub use state::TrainSummary;
#[cfg(feature = "local")]
pub use trainer::Local;
pub use trainer::{Backend, Trainer, Update};
