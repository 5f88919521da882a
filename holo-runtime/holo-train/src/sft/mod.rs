//! Supervised fine-tuning with TRL's `SFTTrainer` semantics: `holo sft`, and [`SftTrainer`] for callers.
//!
//! 1. **Data** ([`data`]): a JSONL file of TRL's dataset formats (what `holo export-data --format sft`
//!    writes), tokenized as TRL tokenizes it, with the model's chat template; each example is its own
//!    sequence (no packing).
//! 2. **Order**: each epoch a permutation of the examples (a function of `data_seed` and the epoch), cut
//!    into micro-batches of `per_device_train_batch_size` (the last one of an epoch may be short);
//!    `gradient_accumulation_steps` micro-batches make an optimizer step, and an epoch's last step takes
//!    what is left of it, as transformers' training loop does. Steps: `max_steps`, or
//!    `ceil(num_train_epochs × steps per epoch)`.
//! 3. **Loss** ([`loss`]): minus the log-probability of each trained token, summed over a micro-batch and
//!    divided by the trained tokens of the whole step; the gradients of the step's micro-batches summed.
//! 4. **The update**, **checkpoints**, **metrics** and **resume** are the GRPO trainer's
//!    ([`run`]): gradients clipped to `max_grad_norm`, one AdamW step at the scheduled
//!    learning rate, full weights or LoRA adapters; `metrics.jsonl` and TensorBoard events with TRL's names
//!    (`loss`, `grad_norm`, `learning_rate`, `entropy`, `mean_token_accuracy`, `num_tokens`, `epoch`) and
//!    `step_time`; a checkpoint every `save_steps` from which `--resume` continues exactly, since the data
//!    order and LoRA's dropout masks derive from the seed and the step.

pub mod config;
pub mod data;
pub mod loss;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;

pub use config::{SftConfig, SftLossType, TruncationMode};
pub use data::{Dataset, Example, Tokenizing};

use super::batch::Sequence;
use super::checkpoint::RunDir;
use super::config::TrainingConfig;
use super::plan::Planned;
use super::run::{self, mix, Policy, RunOptions, TrainError, Trainable, Window};
use super::score;

/// Seed salts (the GRPO trainer's), so that data order and dropout draw independent streams.
const DATA: u64 = 1;
const DROPOUT: u64 = 5;

/// What a finished SFT run did.
#[derive(Debug, Clone)]
pub struct SftSummary {
    pub steps: u64,
    /// The metrics of the last step.
    pub last: BTreeMap<String, f64>,
    pub run_dir: PathBuf,
}

/// How a run's examples are cut into steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub examples: usize,
    /// Micro-batches per epoch.
    pub batches_per_epoch: usize,
    /// Optimizer steps per epoch.
    pub steps_per_epoch: usize,
    pub total_steps: u64,
}

/// Supervised fine-tuning of a local model; see the [module documentation](self).
pub struct SftTrainer {
    config: SftConfig,
    trained: Trainable,
    run: RunDir,
    options: RunOptions,
    /// The memory plan to write into the run folder once it is opened.
    memory_plan: Option<Planned>,
}

impl SftTrainer {
    /// Prepares the weights to train (every weight, or LoRA adapters) of `policy`'s model.
    pub fn new(policy: Policy, config: SftConfig, options: RunOptions) -> Result<Self, TrainError> {
        config
            .validate()
            .map_err(|error| TrainError::Input(error.to_string()))?;
        let trained = Trainable::new(&policy.model, &policy.dir, &config)?;
        Ok(SftTrainer {
            config,
            trained,
            run: RunDir::new(options.out.clone()),
            options,
            memory_plan: None,
        })
    }

    /// Writes `plan` (the memory plan made before loading, [`crate::plan::before_loading`]) as
    /// `RUN_DIR/memory_plan.json` once the run folder is opened.
    pub fn with_memory_plan(mut self, plan: Option<Planned>) -> Self {
        self.memory_plan = plan;
        self
    }

    pub fn config(&self) -> &SftConfig {
        &self.config
    }

    /// The trained weights and their optimizer.
    pub fn trained(&self) -> &Trainable {
        &self.trained
    }

    /// How `examples` examples are cut into steps.
    pub fn plan(&self, examples: usize) -> Plan {
        let config = &self.config;
        let batches_per_epoch = examples
            .div_ceil(config.training.per_device_train_batch_size)
            .max(1);
        let steps_per_epoch =
            batches_per_epoch.div_ceil(config.training.gradient_accumulation_steps);
        let total_steps = if config.training.max_steps > 0 {
            config.training.max_steps as u64
        } else {
            ((config.training.num_train_epochs * steps_per_epoch as f64).ceil() as u64).max(1)
        };
        Plan {
            examples,
            batches_per_epoch,
            steps_per_epoch,
            total_steps,
        }
    }

    /// The micro-batches of optimizer step `step` (0-based): example indices, in order.
    pub fn step_batches(&self, plan: &Plan, step: u64) -> Vec<Vec<usize>> {
        let epoch = step / plan.steps_per_epoch as u64;
        let within = (step % plan.steps_per_epoch as u64) as usize;
        let mut order: Vec<usize> = (0..plan.examples).collect();
        let seed = mix(mix(self.config.data_seed() ^ DATA) ^ epoch);
        order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
        let size = self.config.training.per_device_train_batch_size;
        let accumulation = self.config.training.gradient_accumulation_steps;
        let first = within * accumulation;
        let last = (first + accumulation).min(plan.batches_per_epoch);
        (first..last)
            .map(|batch| order[batch * size..((batch + 1) * size).min(plan.examples)].to_vec())
            .collect()
    }

    /// Trains on `examples` until the last step (continuing the run in the folder with `resume`).
    pub fn train(&mut self, examples: &[Example]) -> Result<SftSummary, TrainError> {
        if examples.is_empty() {
            return Err(TrainError::Input(
                "the data has no examples to train on".into(),
            ));
        }
        let config = self.config.clone();
        let plan = self.plan(examples.len());
        let total = plan.total_steps;
        let sequences: Vec<Sequence> = examples.iter().map(Example::sequence).collect();
        let opened = run::open(&self.run, self.options.resume, &config, &mut self.trained)?;
        if let Some(plan) = &self.memory_plan {
            plan.write(&self.run.path)?;
        }
        let (mut state, mut metrics_log) = (opened.state, opened.metrics);
        let progress = run::progress_bar(self.options.progress, total, "step");
        progress.set_position(state.global_step);
        let mut summary = SftSummary {
            steps: state.global_step,
            last: BTreeMap::new(),
            run_dir: self.run.path.clone(),
        };
        while state.global_step < total {
            let started = Instant::now();
            let batches: Vec<Vec<&Sequence>> = self
                .step_batches(&plan, state.global_step)
                .into_iter()
                .map(|batch| batch.into_iter().map(|index| &sequences[index]).collect())
                .collect();
            let num_items_in_batch: usize = batches
                .iter()
                .flatten()
                .map(|sequence| sequence.trained.len())
                .sum();
            let mut window = Window::default();
            let mut grads = self.trained.no_grads();
            for batch in &batches {
                // LoRA dropout masks: a function of the seed and the micro-batch (never 0, which is off).
                self.trained.model.set_dropout_seed(
                    mix(mix(config.training.seed ^ DROPOUT) ^ state.micro_step) | 1,
                );
                let pass = score::Pass {
                    recompute: config.gradient_checkpointing,
                    entropy_gradient: false,
                    // TRL averages the auxiliary loss over the step's micro-batches.
                    balance: self.trained.router_aux_loss_coef / batches.len() as f64,
                };
                let micro = loss::micro_batch(
                    &self.trained.model,
                    batch,
                    num_items_in_batch,
                    config.loss_type,
                    pass,
                )?;
                window.loss += micro.loss;
                window.extend(micro.metrics);
                self.trained.accumulate(&mut grads, &micro.grads)?;
                state.micro_step += 1;
                state.num_input_tokens_seen += batch
                    .iter()
                    .map(|sequence| sequence.ids.len() as u64)
                    .sum::<u64>();
                state.data_position += batch.len() as u64;
            }
            let (grad_norm, learning_rate) =
                self.trained
                    .step(&grads, &config, state.global_step, total, 1.0)?;
            state.global_step += 1;
            let step = state.global_step;

            let mut metrics = window.means();
            metrics.insert("loss".into(), window.loss);
            metrics.insert("grad_norm".into(), grad_norm);
            metrics.insert("learning_rate".into(), learning_rate);
            metrics.insert("num_tokens".into(), state.num_input_tokens_seen as f64);
            metrics.insert("epoch".into(), step as f64 / plan.steps_per_epoch as f64);
            metrics.insert("step_time".into(), started.elapsed().as_secs_f64());
            metrics_log.log(step, &metrics)?;
            progress.set_message(format!(
                "loss {:.4}, accuracy {:.3}",
                window.loss, metrics["mean_token_accuracy"]
            ));
            progress.set_position(step);
            if config.training.saves_after(step, step == total) {
                let saved = self.trained.save(&self.run, &state, &config)?;
                if self.options.progress {
                    progress.suspend(|| eprintln!("saved {}", saved.display()));
                }
            }
            summary.steps = step;
            summary.last = metrics;
        }
        progress.finish_and_clear();
        Ok(summary)
    }
}
