//! What a run carries from step to step and hands back at its end: [`TrainerState`], saved in every
//! checkpoint's `trainer_state.json` with the parts the curriculum ([`CurriculumState`]) and the guard
//! rails ([`GuardState`]) keep, and [`TrainSummary`]. Plain data: the code that advances each part is in
//! `checkpoint`, `curriculum` and `guard`, which all read this module and none of which this module reads.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::batch::{Completion, Sequence};
use holo_core::holotypes::Reflection;
use holo_core::loom::RolloutRecord;

/// What `trainer_state.json` holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub global_step: u64,
    /// Micro-batches done.
    pub micro_step: u64,
    /// Generation batches drawn.
    pub generations: u64,
    /// Rows taken from the data stream (epoch after epoch, each a permutation of the rows).
    pub data_position: u64,
    /// Prompt and completion tokens trained on so far (TRL's `num_input_tokens_seen`).
    pub num_input_tokens_seen: u64,
    /// The generation batch in use, when the next micro-batch still comes from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer: Option<Buffer>,
    /// ERL's reflection memory, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory: Vec<Reflection>,
    /// The curriculum's level and window (runs with `difficulty_column`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub curriculum: Option<CurriculumState>,
    /// Early stopping's and rollback's state.
    #[serde(default)]
    pub guard: GuardState,
    /// Under `max_off_policy_steps`, the generations drawn ahead of the step, oldest first: a checkpoint
    /// waits for those being sampled and keeps them, so that a resumed run trains on the rollouts the
    /// uninterrupted one would have (they were sampled by weights the checkpoint no longer holds). The
    /// drawing fields above (`generations`, `data_position`, `curriculum`) are then where the newest
    /// of them left the data stream.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ahead: Vec<Drawn>,
}

/// A generation's rollouts as drawn, before the trainer rewards and scores them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Drawn {
    /// The generation's groups, row by row, rollouts in order.
    pub records: Vec<RolloutRecord>,
    /// Rollouts drawn but not trained (dynamic sampling's dropped groups beyond those that complete
    /// the batch): recorded in the rollouts file with the others.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unused: Vec<RolloutRecord>,
    /// The draw's metrics: the curriculum's, dynamic sampling's and the tools' counts.
    pub metrics: BTreeMap<String, f64>,
    /// The generation number its draws started at: the seed of its shuffle.
    pub generation: u64,
    /// Where the data stream stood after this generation was drawn.
    pub position: Position,
}

/// Where the data stream stands: what drawing a generation advances.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Position {
    pub generations: u64,
    pub data_position: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub curriculum: Option<CurriculumState>,
}

impl TrainerState {
    /// Where this state's data stream stands.
    pub fn position(&self) -> Position {
        Position {
            generations: self.generations,
            data_position: self.data_position,
            curriculum: self.curriculum.clone(),
        }
    }

    /// Moves this state's data stream to `position`.
    pub fn set_position(&mut self, position: Position) {
        self.generations = position.generations;
        self.data_position = position.data_position;
        self.curriculum = position.curriculum;
    }
}

/// A generation batch, shuffled and ready to be split into micro-batches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    pub completions: Vec<Completion>,
    /// The trained tokens of the whole generation batch (for `dapo`-like normalization).
    pub num_items_in_batch: f64,
    /// The same for the completions of the second loss (ERL's `erl_algorithm = 2`).
    #[serde(default)]
    pub second_num_items: f64,
    /// ERL's internalized sequences, shuffled, split over the micro-batches as the completions are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub internalized: Vec<Sequence>,
    /// The step whose generation this is.
    pub step: u64,
    /// PPO: each completion's reward (its components weighted and summed; `NaN` for none), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scores: Vec<f32>,
}

impl Buffer {
    /// Micro-batch `slot` of `steps` of `items`: the generation split into `steps` nearly equal parts
    /// (`per_device_train_batch_size` each when it holds `generation_batch_size` completions; ERL's
    /// generations hold more, as many as their rollouts have contexts).
    pub fn slot<T>(items: &[T], slot: usize, steps: usize) -> &[T] {
        let size = items.len().div_ceil(steps.max(1));
        let end = ((slot + 1) * size).min(items.len());
        &items[(slot * size).min(end)..end]
    }
}

/// Where the curriculum stands; part of [`TrainerState`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CurriculumState {
    /// The level served (0: the lowest difficulty).
    pub level: usize,
    /// Rows taken from this level's stream.
    pub position: u64,
    /// Mean rewards of this level's most recent groups, oldest first (at most `curriculum_window`).
    pub window: Vec<f64>,
}

/// What the guard rails remember; part of the checkpoints' `TrainerState`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GuardState {
    /// The best `eval/reward` so far.
    pub best_eval: Option<f64>,
    /// Evaluations since `eval/reward` last improved.
    pub evals_since_best: u64,
    /// Early stopping ended the run.
    pub stopped: bool,
    /// The training rewards of the latest generating steps, oldest first (at most `rollback_window`).
    pub rewards: Vec<f64>,
    /// The curriculum level those rewards were drawn at.
    pub rewards_level: Option<usize>,
    /// The best moving mean of the training reward.
    pub best_mean_reward: Option<f64>,
    /// Rollbacks so far (not restored by a rollback).
    pub rollbacks: u64,
    /// The learning rate's factor: `rollback_lr_factor` to the power of the rollbacks.
    pub lr_factor: f64,
    /// Generating steps in a row whose every group had identical rewards.
    pub steps_without_signal: u64,
}

impl Default for GuardState {
    fn default() -> Self {
        GuardState {
            best_eval: None,
            evals_since_best: 0,
            stopped: false,
            rewards: Vec::new(),
            rewards_level: None,
            best_mean_reward: None,
            rollbacks: 0,
            lr_factor: 1.0,
            steps_without_signal: 0,
        }
    }
}

/// What a finished run did.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub steps: u64,
    /// The metrics of the last step.
    pub last: BTreeMap<String, f64>,
    /// Each evaluation's metrics by step.
    pub evaluations: Vec<(u64, BTreeMap<String, f64>)>,
    pub run_dir: PathBuf,
    /// Early stopping ended the run before its last step.
    pub stopped_early: bool,
    /// The option that stopped it: `early_stopping_patience` or `stop_on_no_signal`.
    pub stopped_by: Option<&'static str>,
    /// Rollbacks the guard rails took.
    pub rollbacks: u64,
}
