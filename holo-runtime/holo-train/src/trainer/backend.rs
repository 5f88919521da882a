//! Where the policy of a [`Trainer`](super::Trainer) lives: the [`Backend`] trait. The trainer owns the
//! loop (data stream, rollouts through the Loom, advantages, micro-batches, guard rails, evaluation,
//! metrics, checkpoints' folders); a backend owns the weights: it samples, takes each micro-batch's loss
//! and gradients, steps the optimizer, and saves and restores what a checkpoint holds of them.
//! [`Local`](super::Local) trains a candle model in process; `holo_engines::tinker::train` trains one
//! on a Tinker service.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::runtime::Runtime;

use crate::batch::Completion;
use crate::checkpoint::RunDir;
use crate::config::GrpoConfig;
use crate::error::TrainError;
use crate::run::{Opened, Window};
use crate::state::{Buffer, TrainerState};
use holo_core::sampler::Sampler;

/// What an optimizer step reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Update {
    /// The scheduled learning rate the step used (the guard rails' factor included).
    pub learning_rate: f64,
    /// The gradients' norm before clipping, when the backend knows it.
    pub grad_norm: Option<f64>,
}

/// The weights a [`Trainer`](super::Trainer) trains, and the operations its loop asks of them, in the
/// order it asks: [`Backend::open`] and [`Backend::start`] once; per generation batch
/// [`Backend::score`]; per micro-batch [`Backend::micro_step`], then [`Backend::optimizer_step`] (or,
/// under PPO, [`Backend::ppo_update`] on the whole batch); [`Backend::save`] at checkpoints,
/// [`Backend::restore`] (inside [`Backend::rewind`]) when the guard rails roll the run back.
pub trait Backend {
    /// The runtime the run's rollouts (and whatever the backend runs beside its steps) run on.
    fn runtime(&self) -> std::io::Result<Runtime> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    }

    /// Refuses, before any work, what this backend cannot train with `config`.
    fn check(&self, _config: &GrpoConfig) -> Result<(), TrainError> {
        Ok(())
    }

    /// The sampler of the run's rollouts, and its model's context length when known.
    fn sampler(&self) -> (&dyn Sampler, Option<usize>);

    /// A sampler of the weights as they are now, which the steps that follow leave as they are, marked
    /// with weight `version` (the optimizer steps taken): what generations drawn ahead of the steps
    /// sample with (`max_off_policy_steps`); with its model's context length when known. A backend
    /// that samples only between its steps refuses.
    fn snapshot(&mut self, _version: u64) -> Result<(Arc<dyn Sampler>, Option<usize>), TrainError> {
        Err(TrainError::Input(
            "`max_off_policy_steps`: this backend samples only between its steps; set it to 0"
                .into(),
        ))
    }

    /// An error the sampler kept instead of failing a rollout (a service gone): it stops the run.
    fn sampler_error(&self) -> Option<String> {
        None
    }

    /// Opens the run folder ([`crate::run::open_with`]): a new run, or with `resume` the newest
    /// checkpoint's state, its weights restored into the backend.
    fn open(
        &mut self,
        run: &RunDir,
        resume: bool,
        config: &GrpoConfig,
    ) -> Result<Opened, TrainError>;

    /// Starts what runs beside the steps, once the run folder is open at `state`.
    fn start(&mut self, _runtime: &Runtime, _state: &TrainerState) -> Result<(), TrainError> {
        Ok(())
    }

    /// Adds what the loss needs besides the rollouts to a new generation batch's `completions`
    /// (log-probabilities of the weights that sampled, of a reference, the masks of constrained
    /// tokens), before they are shuffled. A backend that leaves this as it is cannot train tokens
    /// drawn under a constraint as the masked distribution they were drawn from, and refuses them.
    fn score(
        &mut self,
        _config: &GrpoConfig,
        completions: &mut [Completion],
        _metrics: &mut BTreeMap<String, f64>,
    ) -> Result<(), TrainError> {
        match completions
            .iter()
            .flat_map(|c| &c.sequences)
            .find_map(|s| s.constraints.runs.first())
        {
            Some(run) => Err(TrainError::Input(format!(
                "a rollout sampled under {} (a sampler tag's constraint): this backend computes \
                 log-probabilities over the whole vocabulary, not the masked distribution the \
                 tokens were drawn from; train it locally or drop the constraint",
                run.constraint.kind()
            ))),
            None => Ok(()),
        }
    }

    /// The loss and gradients of micro-batch `slot` of `buffer` (of `steps_per_generation`), added to
    /// the step's; `state` is the run's before the micro-batch. Losses and metrics go to `window`.
    fn micro_step(
        &mut self,
        runtime: &Runtime,
        config: &GrpoConfig,
        state: &TrainerState,
        buffer: &Buffer,
        slot: usize,
        window: &mut Window,
    ) -> Result<(), TrainError>;

    /// The optimizer step on the gradients the step's micro-batches added up, at the scheduled
    /// learning rate of step `state.global_step + 1` of `total`.
    fn optimizer_step(
        &mut self,
        runtime: &Runtime,
        config: &GrpoConfig,
        state: &TrainerState,
        total: u64,
        window: &mut Window,
    ) -> Result<Update, TrainError>;

    /// PPO's update on a whole generation batch (its epochs of mini-batches, policy and value model).
    fn ppo_update(
        &mut self,
        _config: &GrpoConfig,
        _buffer: &Buffer,
        _state: &TrainerState,
        _total: u64,
        _window: &mut Window,
    ) -> Result<Update, TrainError> {
        Err(TrainError::Input(
            "`algorithm`: ppo trains a value model, which only a local model has".into(),
        ))
    }

    /// Writes the checkpoint of `state` into the run folder; returns its folder.
    fn save(
        &mut self,
        runtime: &Runtime,
        run: &RunDir,
        state: &TrainerState,
        config: &GrpoConfig,
    ) -> Result<PathBuf, TrainError>;

    /// Brings back the checkpoint in `dir` (made with `config`); returns its state.
    fn restore(
        &mut self,
        runtime: &Runtime,
        run: &RunDir,
        dir: &Path,
        config: &GrpoConfig,
    ) -> Result<TrainerState, TrainError>;

    /// Runs the guard rails' rollback `rewind` (which calls [`Backend::restore`]); a backend with
    /// checkpoints outside the run folder removes those the rollback abandoned.
    fn rewind(
        &mut self,
        _runtime: &Runtime,
        _run: &RunDir,
        rewind: impl FnOnce(&mut Self) -> Result<(TrainerState, String), TrainError>,
    ) -> Result<(TrainerState, String), TrainError>
    where
        Self: Sized,
    {
        rewind(self)
    }
}
