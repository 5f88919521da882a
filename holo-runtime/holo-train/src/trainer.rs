//! The training loop: generation batches through the Loom, advantages, micro-batches, optimizer steps,
//! evaluation, checkpoints and metrics. See the [module documentation](super) for the order of events.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Tensor, Var};
use indicatif::ProgressBar;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::advantages::{self, nanmean};
use super::batch::{self, Completion};
use super::checkpoint::{Buffer, RunDir, TrainerState};
use super::config::{Algorithm, GrpoConfig, TrainingConfig};
use super::correction::importance_sampling;
use super::curriculum::Stream;
use super::erl;
use super::feed::{Feed, Given};
use super::guard;
use super::loss;
use super::metrics::{completion_metrics, print_completions, MetricsLog};
use super::ppo;
use super::provenance::{self, Provenance};
use super::rollouts::{self, evaluation_metrics, Failures, Rollouts};
use super::run::{self, mix, Policy, RunOptions, TrainError, Trainable, Window};
use super::sampling::Training;
use super::score;
pub use super::state::TrainSummary;
use holo_core::holophore::Holophore;
use holo_core::interpreter::Row;
use holo_core::loom::{RolloutRecord, RolloutSource, Summary};
use holo_core::sampler::Sampler;
use holo_model::{Limits, LocalModel, LocalOptions, Model};

/// Seed salts, so that sampling, shuffling and evaluation draw independent streams (the data order's
/// is [`super::curriculum`]'s).
pub const SAMPLING: u64 = 2;
pub const SHUFFLE: u64 = 3;
pub const EVAL: u64 = 4;
const DROPOUT: u64 = 5;

/// GRPO training of a local model on rollouts from a [`RolloutSource`]; see the [module
/// documentation](super).
pub struct Trainer<S> {
    source: S,
    config: GrpoConfig,
    /// The trained weights and their optimizer.
    trained: Trainable,
    reference: Option<Model>,
    sampler: LocalModel,
    /// A sampler of the caller's instead of `sampler`, and its model's context when known.
    external: Option<(Box<dyn Sampler>, Option<usize>)>,
    /// What the run is made from, and whether a resume may change it ([`Trainer::with_provenance`]).
    provenance: Option<(Provenance, bool)>,
    holophore: Holophore,
    run: RunDir,
    options: RunOptions,
    /// Where generation batches come from instead of the Loom ([`Trainer::with_feed`]).
    feed: Option<Box<dyn Feed>>,
    failures: Failures,
}

impl<S: RolloutSource> Trainer<S> {
    /// Prepares the weights to train (every weight, or LoRA adapters), the reference model when `beta`
    /// > 0, and the in-process sampler sharing the trained weights.
    pub fn new(
        source: S,
        policy: Policy,
        config: GrpoConfig,
        options: RunOptions,
    ) -> Result<Self, TrainError> {
        config
            .validate()
            .map_err(|error| TrainError::Input(error.to_string()))?;
        let base = policy.model;
        let mut trained = Trainable::new(&base, &policy.dir, &config)?;
        if config.algorithm == Algorithm::Ppo {
            trained = trained.with_critic(ppo::critic(&base, &config)?, &config);
        }
        // The frozen starting point: the base weights (LoRA trains beside them, so they are shared).
        let reference = config.uses_reference().then(|| base.detached());
        drop(base);
        let holophore = Holophore::new(
            std::sync::Arc::new(policy.tokenizer.clone()),
            std::sync::Arc::new(policy.template.clone()),
        )
        .map_err(|error| {
            TrainError::Input(format!("--model `{}`: {error}", policy.dir.display()))
        })?;
        let model = &trained.model;
        let sampler = LocalModel::new(
            model.detached(),
            policy.tokenizer,
            policy.template,
            policy.end_of_turn,
            LocalOptions {
                device: model.device().clone(),
                limits: Limits {
                    max_num_seqs: config.generation_batch_size().max(1),
                    ..Limits::default()
                },
                default_max_tokens: config.max_completion_length,
                seed: config.seed,
                ..LocalOptions::default()
            },
        );
        if let Some(memory) = source.reflection_memory() {
            memory.set_capacity(if config.enable_memory {
                config.memory_size
            } else {
                0
            });
        }
        Ok(Trainer {
            source,
            config,
            trained,
            reference,
            sampler,
            external: None,
            provenance: None,
            holophore,
            run: RunDir::new(options.out.clone()),
            options,
            feed: None,
            failures: Failures::default(),
        })
    }

    /// Samples rollouts with `sampler` (an OpenAI-compatible server, a bf16 copy) instead of the trained
    /// model in process. Its weights are its own: keep them in step with the trained ones (export and
    /// reload), or the rollouts drift off-policy. Its log-probabilities (at the run's temperature) are
    /// corrected for as TRL corrects vLLM's (`vllm_importance_sampling_correction` and its mode and
    /// bounds); `context` is its model's context length, when known.
    /// Records what the run is made from in `RUN_DIR/provenance.json` ([`super::provenance`]); a resumed
    /// run is refused when its inputs changed, naming the first, unless `allow_changes` (then the change
    /// is recorded with the step it was made at).
    pub fn with_provenance(mut self, provenance: Provenance, allow_changes: bool) -> Self {
        self.provenance = Some((provenance, allow_changes));
        self
    }

    pub fn with_sampler(mut self, sampler: Box<dyn Sampler>, context: Option<usize>) -> Self {
        self.external = Some((sampler, context));
        self
    }

    /// Trains on the batches of `feed` (an Atropos API) instead of rolling out itself: `train` needs no
    /// training rows then, and the sampler's log-probabilities are corrected for as an external
    /// sampler's are ([`Trainer::with_sampler`]).
    pub fn with_feed(mut self, feed: Box<dyn Feed>) -> Self {
        self.feed = Some(feed);
        self
    }

    pub fn config(&self) -> &GrpoConfig {
        &self.config
    }

    /// The model being trained (its weights are [`Var`]s).
    pub fn model(&self) -> &Model {
        &self.trained.model
    }

    /// The trained weights or adapters, by name.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.trained.vars
    }

    /// The optimizer steps of a run over `rows` rows.
    pub fn total_steps(&self, rows: usize) -> u64 {
        let config = &self.config;
        if config.max_steps > 0 {
            return config.max_steps as u64;
        }
        let prompts = config.prompts_per_generation().max(1);
        let generations = (config.num_train_epochs * rows as f64 / prompts as f64).ceil() as u64;
        let micro =
            generations * config.steps_per_generation() as u64 * config.num_iterations as u64;
        micro
            .div_ceil(config.gradient_accumulation_steps as u64)
            .max(1)
    }

    /// Trains on `rows` (`(index, row)`: the index names the row in the records), evaluating on
    /// `eval_rows` every `eval_steps`. Blocks until the last step.
    pub fn train(
        &mut self,
        rows: &[(usize, Row)],
        eval_rows: &[(usize, Row)],
    ) -> Result<TrainSummary, TrainError> {
        let config = self.config.clone();
        if self.sampler_correction()
            && config.loss_type == super::config::LossType::Vespo
            && config.vllm_importance_sampling_mode.is_sequence()
        {
            return Err(TrainError::Input(
                "`vllm_importance_sampling_mode`: VESPO weighs sequences itself and takes only token_truncate or token_mask".into(),
            ));
        }
        let prompts = self.feed.is_none().then(|| config.prompts_per_generation());
        rollouts::check_rows(&self.source, rows, eval_rows, prompts)?;
        let total = self.total_steps(rows.len());
        let stream = Stream::new(rows, &config).map_err(TrainError::Input)?;
        guard::check_eval_rows(&config, eval_rows.len())?;
        let (mut state, mut metrics_log) = self.open_run(&stream)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;

        let progress = run::progress_bar(self.options.progress, total, "step");
        progress.set_position(state.global_step);
        let mut summary = TrainSummary {
            steps: state.global_step,
            last: BTreeMap::new(),
            evaluations: Vec::new(),
            run_dir: self.run.path.clone(),
            stopped_early: false,
            rollbacks: 0,
        };
        let fresh = state.global_step == 0 && !self.options.resume;
        if config.eval_on_start && fresh && !eval_rows.is_empty() {
            let metrics = self.evaluate(&runtime, eval_rows, 0, &progress)?;
            state.guard.evaluated(&config, metrics["eval/reward"]);
            metrics_log.log(0, &metrics)?;
            summary.evaluations.push((0, metrics));
        }
        if config.rolls_back() && fresh {
            // The starting weights: what a trip before the first saved checkpoint returns to.
            self.save(&mut state)?;
        }
        while state.global_step < total && !state.guard.stopped {
            let started = Instant::now();
            let step = state.global_step + 1;
            let mut window = Window::default();
            let (grad_norm, learning_rate) = match config.algorithm {
                Algorithm::Grpo => {
                    self.grpo_step(&runtime, &stream, &mut state, total, &progress, &mut window)?
                }
                Algorithm::Ppo => {
                    let generating = Instant::now();
                    let (buffer, generated) =
                        self.generate(&runtime, &stream, &mut state, step, &progress)?;
                    window.time("generation", generating);
                    window.extend(generated);
                    let updating = Instant::now();
                    let outcome = ppo::update(
                        &mut self.trained,
                        &config,
                        &buffer,
                        state.generations,
                        state.global_step,
                        total,
                        state.guard.lr_factor,
                    )?;
                    window.time("update", updating);
                    state.micro_step +=
                        (config.steps_per_generation() * config.num_ppo_epochs) as u64;
                    window.loss += outcome.loss;
                    window.extend(outcome.metrics);
                    (outcome.grad_norm, outcome.learning_rate)
                }
            };
            // The sampler shares the weights; its cached prefixes belong to the old ones.
            self.sampler.prefix_cache().clear();
            state.global_step = step;

            let mut metrics = window.means();
            metrics.insert("loss".into(), window.loss);
            metrics.insert("grad_norm".into(), grad_norm);
            metrics.insert("learning_rate".into(), learning_rate);
            metrics.insert("num_tokens".into(), state.num_input_tokens_seen as f64);
            if !rows.is_empty() {
                metrics.insert(
                    "epoch".into(),
                    state.data_position as f64 / rows.len() as f64,
                );
            }
            metrics.insert("step_time".into(), started.elapsed().as_secs_f64());
            if let Some(trip) = state.guard.check(&config, step, &metrics) {
                let run = self.run.clone();
                let (restored, note) = guard::rewind(
                    &run,
                    &config,
                    trip,
                    &state.guard,
                    &metrics,
                    &mut metrics_log,
                    |dir| self.restore(dir),
                )?;
                guard::after_rewind(&mut summary, &restored, &note, &progress);
                state = restored;
                continue;
            }
            let last_step = step == total;
            if let Some(every) = config.eval_steps {
                if (step % every == 0 || last_step) && !eval_rows.is_empty() {
                    let evaluation = self.evaluate(&runtime, eval_rows, step, &progress)?;
                    metrics.extend(evaluation.clone());
                    if state.guard.evaluated(&config, evaluation["eval/reward"]) {
                        progress.suspend(|| eprintln!("{}", state.guard.stopping_note(step)));
                    }
                    summary.evaluations.push((step, evaluation));
                }
            }
            metrics.extend(state.guard.metrics(&config));
            metrics_log.log(step, &metrics)?;
            progress.set_message(format!(
                "reward {:.3}{}",
                metrics.get("reward").copied().unwrap_or(f64::NAN),
                metrics
                    .get("kl")
                    .map_or(String::new(), |kl| format!(", kl {kl:.4}")),
            ));
            progress.set_position(step);
            if step % config.save_steps == 0 || last_step || state.guard.stopped {
                let saved = self.save(&mut state)?;
                if self.options.progress {
                    progress.suspend(|| eprintln!("saved {}", saved.display()));
                }
            }
            summary.steps = step;
            summary.last = metrics;
        }
        progress.finish_and_clear();
        summary.stopped_early = state.guard.stopped;
        summary.rollbacks = state.guard.rollbacks;
        Ok(summary)
    }

    /// One GRPO optimizer step: `gradient_accumulation_steps` micro-batches of the current generation
    /// batch (generating the next one when it is used up), then the update. Returns the gradients' norm
    /// and the learning rate.
    fn grpo_step(
        &mut self,
        runtime: &tokio::runtime::Runtime,
        stream: &Stream<'_>,
        state: &mut TrainerState,
        total: u64,
        progress: &ProgressBar,
        window: &mut Window,
    ) -> Result<(f64, f64), TrainError> {
        let config = self.config.clone();
        let step = state.global_step + 1;
        let generate_every = (config.steps_per_generation() * config.num_iterations) as u64;
        let accumulation = config.gradient_accumulation_steps as u64;
        let mut grads = self.trained.no_grads();
        for _ in 0..accumulation {
            if state.micro_step.is_multiple_of(generate_every) || state.buffer.is_none() {
                let started = Instant::now();
                let (buffer, generated) = self.generate(runtime, stream, state, step, progress)?;
                window.time("generation", started);
                window.extend(generated);
                state.buffer = Some(buffer);
            }
            let buffer = state.buffer.as_ref().expect("generated above");
            let slot = (state.micro_step % config.steps_per_generation() as u64) as usize;
            let steps = config.steps_per_generation();
            let micro = Buffer::slot(&buffer.completions, slot, steps);
            // LoRA dropout masks: a function of the seed and the micro-batch (never 0, which is off).
            self.trained
                .model
                .set_dropout_seed(mix(mix(config.seed ^ DROPOUT) ^ state.micro_step) | 1);
            let started = Instant::now();
            let (value, micro_grads, metrics) = self.micro_step(micro, buffer)?;
            window.loss += value;
            window.extend(metrics);
            self.trained.accumulate(&mut grads, &micro_grads)?;
            window.time("backward", started);
            let internalized = Buffer::slot(&buffer.internalized, slot, steps);
            if !internalized.is_empty() {
                let total = buffer
                    .internalized
                    .iter()
                    .map(|s| s.trained.len())
                    .sum::<usize>();
                let (value, internal_grads, metrics) = erl::internalization_step(
                    &self.trained.model,
                    &self.trained.vars,
                    &config,
                    internalized,
                    total,
                )?;
                window.loss += value;
                window.extend(metrics);
                self.trained.accumulate(&mut grads, &internal_grads)?;
            }
            state.micro_step += 1;
            if state.micro_step.is_multiple_of(generate_every) {
                state.buffer = None;
            }
        }
        let started = Instant::now();
        let stepped = self.trained.step(
            &grads,
            &config,
            state.global_step,
            total,
            state.guard.lr_factor,
        )?;
        window.time("optimizer", started);
        Ok(stepped)
    }

    /// Opens the run folder (see [`run::open`]) with its rollout files: new ones, or those of the
    /// resumed run cut back to its checkpoint; a new run's curriculum starts at its first level.
    fn open_run(&mut self, stream: &Stream<'_>) -> Result<(TrainerState, MetricsLog), TrainError> {
        let changes = match (&self.provenance, self.options.resume) {
            (Some((now, allow)), true) => self.check_provenance(now, *allow)?,
            _ => None,
        };
        let opened = run::open(
            &self.run,
            self.options.resume,
            &self.config,
            &mut self.trained,
        )?;
        let mut state = opened.state;
        if let Some((now, _)) = &self.provenance {
            match changes {
                Some((mut saved, change)) => {
                    saved.changes.push(provenance::Change {
                        step: state.global_step,
                        inputs: now.inputs.clone(),
                        message: change,
                    });
                    saved.write(&self.run.path)?;
                }
                None if !opened.resumed => now.write(&self.run.path)?,
                None => {}
            }
        }
        if opened.resumed {
            self.after_restore(&state)?;
            stream.check_resumed(&state).map_err(TrainError::Input)?;
            guard::keep_events(&self.run, state.guard.rollbacks)?;
        } else {
            for file in ["rollouts.jsonl", "eval_rollouts.jsonl"] {
                std::fs::File::create(self.run.path.join(file))?;
            }
            state.curriculum = stream.start();
        }
        Ok((state, opened.metrics))
    }

    /// The run's recorded provenance against `now`'s: an error naming the first changed input, or with
    /// `allow`, the recorded provenance and the change to add to it; `None` when nothing changed (or
    /// the run has no provenance to compare with).
    fn check_provenance(
        &self,
        now: &Provenance,
        allow: bool,
    ) -> Result<Option<(Provenance, String)>, TrainError> {
        let Some(saved) = Provenance::read(&self.run.path).map_err(TrainError::Input)? else {
            return Ok(None);
        };
        match saved.changed(now) {
            None => Ok(None),
            Some(change) if allow => {
                eprintln!("warning: {change}; resuming anyway (--allow-changes)");
                Ok(Some((saved, change)))
            }
            Some(change) => Err(TrainError::Input(format!(
                "--resume: {change}; pass --allow-changes to resume with the changed inputs"
            ))),
        }
    }

    /// Restores the checkpoint in `dir` (made with this configuration; see [`run::restore`]) and what
    /// goes with it ([`Trainer::after_restore`]). Returns its state.
    fn restore(&mut self, dir: &Path) -> Result<TrainerState, TrainError> {
        let state = run::restore(dir, &self.config, &mut self.trained, &self.run.path)?;
        self.after_restore(&state)?;
        Ok(state)
    }

    /// What a restored checkpoint brings back besides the weights: the rollout files cut back to its
    /// step, ERL's memory, and a sampler without the old weights' cached prefixes.
    fn after_restore(&self, state: &TrainerState) -> Result<(), TrainError> {
        for file in ["rollouts.jsonl", "eval_rollouts.jsonl"] {
            self.run.keep_records_until(file, state.global_step)?;
        }
        if let Some(memory) = self.source.reflection_memory() {
            memory.restore(state.memory.clone());
        }
        self.sampler.prefix_cache().clear();
        Ok(())
    }

    /// Writes a checkpoint of `state`, with ERL's memory as it is now.
    fn save(&self, state: &mut TrainerState) -> Result<PathBuf, TrainError> {
        state.memory = self
            .source
            .reflection_memory()
            .map(|memory| memory.entries())
            .unwrap_or_default();
        self.trained.save(&self.run, state, &self.config)
    }

    /// One generation batch: rollouts, rewards, advantages, and the log-probabilities the loss needs,
    /// shuffled. Returns it with the metrics TRL logs at generation.
    fn generate(
        &mut self,
        runtime: &tokio::runtime::Runtime,
        stream: &Stream<'_>,
        state: &mut TrainerState,
        step: u64,
        progress: &ProgressBar,
    ) -> Result<(Buffer, BTreeMap<String, f64>), TrainError> {
        let config = self.config.clone();
        let group = config.num_generations;
        let generation = state.generations;
        let stats = self.source.tool_stats();
        let tools_before = stats.as_ref().map(|stats| stats.counts());
        let (records, mut metrics, groups, given) = match self.feed.as_mut() {
            Some(feed) => {
                let fed = feed.next(runtime, step)?;
                (fed.records, fed.metrics, fed.groups, fed.advantages)
            }
            None => {
                let (records, metrics) = self.draw(runtime, stream, state, step, progress)?;
                (records, metrics, Vec::new(), Vec::new())
            }
        };
        let tools = stats
            .zip(tools_before)
            .map(|(stats, before)| stats.counts() - before);

        let rewards = batch::rewards(&records, config.reward_weights.as_ref());
        let mut scored = if groups.is_empty() {
            advantages::advantages(
                &rewards,
                group,
                config.scale_rewards,
                config.multi_objective_aggregation,
            )
        } else {
            advantages::grouped_advantages(
                &rewards,
                &groups,
                config.scale_rewards,
                config.multi_objective_aggregation,
            )
        };
        for (advantage, given) in scored.advantages.iter_mut().zip(&given) {
            match given {
                Some(Given::Sequence(value)) => *advantage = *value,
                // What the printed completions show; the loss takes the tokens' own.
                Some(Given::Tokens(values)) => {
                    *advantage = advantages::nanmean(values.iter().map(|&value| value as f64))
                }
                None => {}
            }
        }
        metrics.extend(scored.metrics);
        let (mut completions, mut internalized) = if config.erl {
            let split = erl::split(&records, group, &config).map_err(TrainError::Input)?;
            metrics.extend(split.metrics);
            (split.completions, split.internalized)
        } else {
            let mut completions = batch::completions(
                &records,
                &scored.advantages,
                config.mask_truncated_completions,
            );
            for (completion, given) in completions.iter_mut().zip(&given) {
                if let Some(Given::Tokens(values)) = given {
                    completion.token_advantages = Some(values.clone());
                }
            }
            (completions, Vec::new())
        };
        if let Some(memory) = self.source.reflection_memory() {
            // What this generation's rollouts remembered becomes visible to the next one.
            memory.commit();
            metrics.insert("erl/memory_size".into(), memory.len() as f64);
        }
        completion_metrics(&records, &completions, &mut metrics);
        if let Some(tools) = tools {
            // Counts over the generation: code runs, those that failed (an exception, a limit, a
            // timeout, code that could not run), and those stopped at the timeout.
            metrics.insert("tools/calls".into(), tools.calls as f64);
            metrics.insert("tools/failed".into(), tools.failed as f64);
            metrics.insert("tools/timed_out".into(), tools.timed_out as f64);
        }
        state.num_input_tokens_seen += completions
            .iter()
            .flat_map(|c| &c.sequences)
            .map(|s| s.ids.len() as u64)
            .sum::<u64>();
        let items = |second: bool| -> f64 {
            completions
                .iter()
                .filter(|c| c.second_loss == second)
                .map(|c| c.mask as f64 * c.len() as f64)
                .sum()
        };
        let (num_items_in_batch, second_num_items) = (items(false), items(true));

        let batch_size = config.per_device_train_batch_size;
        let generate_every = config.steps_per_generation() * config.num_iterations;
        let correction = self.sampler_correction();
        // Log-probabilities of the policy as it sampled: without dropout.
        self.trained.model.set_dropout_seed(0);
        let ppo = config.algorithm == Algorithm::Ppo;
        if !config
            .gradient_accumulation_steps
            .is_multiple_of(generate_every)
            || correction
            || ppo
        {
            let old = score::logprobs(
                &self.trained.model,
                &completions,
                config.temperature,
                batch_size,
            )?;
            for (completion, old) in completions.iter_mut().zip(old) {
                completion.old_logprobs = Some(old);
            }
        }
        if correction {
            importance_sampling(&config, &mut completions, &mut metrics);
        }
        if let Some(reference) = &self.reference {
            let logprobs =
                score::logprobs(reference, &completions, config.temperature, batch_size)?;
            for (completion, logprobs) in completions.iter_mut().zip(logprobs) {
                completion.ref_logprobs = Some(logprobs);
            }
        }
        // PPO draws a permutation per epoch itself, and keeps each completion beside its reward.
        let scores = if ppo {
            // A failed rollout has no reward component (`batch::rewards`), so its total is NaN.
            advantages::weighted_totals(&rewards)
                .into_iter()
                .map(|score| score as f32)
                .collect()
        } else {
            let shuffle = mix(mix(config.seed ^ SHUFFLE) ^ generation);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(shuffle);
            completions.shuffle(&mut rng);
            internalized.shuffle(&mut rng);
            Vec::new()
        };
        if config.log_completions {
            print_completions(
                &records,
                &scored.advantages,
                config.num_completions_to_print,
                step,
            );
        }
        Ok((
            Buffer {
                completions,
                num_items_in_batch,
                second_num_items,
                internalized,
                step,
                scores,
            },
            metrics,
        ))
    }

    /// The rollouts of one generation batch, grouped: `prompts_per_generation` rows of the stream, `G`
    /// rollouts each. Under `dynamic_sampling` (DAPO), groups whose rewards are all equal are dropped and
    /// the stream's next rows drawn in their place, up to `max_num_gen_batches` draws in all; a batch
    /// still short is completed with dropped groups, first dropped first. Each draw takes a generation
    /// number of its own (its sampling seed). The curriculum takes every group's mean reward, and may
    /// move to its next level for the next batch.
    fn draw(
        &self,
        runtime: &tokio::runtime::Runtime,
        stream: &Stream<'_>,
        state: &mut TrainerState,
        step: u64,
        progress: &ProgressBar,
    ) -> Result<(Vec<RolloutRecord>, BTreeMap<String, f64>), TrainError> {
        let config = &self.config;
        let (group, wanted) = (config.num_generations, config.prompts_per_generation());
        let draws_allowed = if config.dynamic_sampling {
            config.max_num_gen_batches
        } else {
            1
        };
        let mut metrics = state
            .curriculum
            .as_ref()
            .map(|curriculum| stream.metrics(curriculum))
            .unwrap_or_default();
        let (mut kept, mut dropped) = (Vec::new(), Vec::new());
        let (mut group_means, mut all_totals) = (Vec::new(), Vec::new());
        let mut draws = 0;
        while kept.len() < wanted * group && draws < draws_allowed {
            // A row already in the batch is not drawn again for it.
            let exclude: Vec<usize> = kept
                .iter()
                .step_by(group)
                .map(|record: &RolloutRecord| record.row_index)
                .collect();
            let rows = stream.next(state, wanted - kept.len() / group, &exclude);
            let seed = mix(mix(config.seed ^ SAMPLING) ^ state.generations);
            state.generations += 1;
            draws += 1;
            let (records, _) =
                self.rollouts(runtime, &rows, group, seed, step, "rollouts.jsonl")?;
            self.failures
                .check(&records, step, "rollouts.jsonl", progress)?;
            let totals = advantages::weighted_totals(&batch::rewards(
                &records,
                config.reward_weights.as_ref(),
            ));
            for (records, totals) in records.chunks(group).zip(totals.chunks(group)) {
                group_means.push(nanmean(totals.iter().copied()));
                all_totals.extend_from_slice(totals);
                if !config.dynamic_sampling || advantages::spread(totals) {
                    kept.extend_from_slice(records);
                } else {
                    dropped.push(records.to_vec());
                }
            }
        }
        let short = wanted - kept.len() / group;
        if config.dynamic_sampling {
            metrics.insert("dynamic_sampling/dropped".into(), dropped.len() as f64);
            metrics.insert("dynamic_sampling/refills".into(), (draws - 1) as f64);
            metrics.insert("dynamic_sampling/short".into(), short as f64);
            metrics.insert("dynamic_sampling/reward".into(), nanmean(all_totals));
            if short > 0 {
                progress.suspend(|| eprintln!(
                    "step {step}: dynamic sampling found {} groups with a reward spread in {draws} draws (max_num_gen_batches); {short} without one complete the batch",
                    wanted - short
                ));
            }
        }
        kept.extend(dropped.into_iter().take(short).flatten());
        if let Some(curriculum) = state.curriculum.as_mut() {
            let (mean, advance) = stream.observe(curriculum, &group_means);
            metrics.insert("curriculum/mean_reward".into(), mean);
            if let Some(advance) = advance {
                progress.suspend(|| eprintln!("{advance} (after step {step})"));
            }
        }
        Ok((kept, metrics))
    }

    /// Whether the sampler's log-probabilities need TRL's importance-sampling correction. The in-process
    /// sampler is the trained f32 model itself: like TRL without vLLM, it needs none; a feed's sampler is
    /// another process's.
    fn sampler_correction(&self) -> bool {
        (self.external.is_some() || self.feed.is_some())
            && self.config.vllm_importance_sampling_correction
    }

    /// Runs `G` rollouts of each row through the Loom with the training sampler, appends them (with
    /// `step`) to `file` in the run folder, and returns them grouped: row by row, rollouts in order.
    fn rollouts(
        &self,
        runtime: &tokio::runtime::Runtime,
        rows: &[(usize, Row)],
        group: usize,
        seed: u64,
        step: u64,
        file: &str,
    ) -> Result<(Vec<RolloutRecord>, Summary), TrainError> {
        let sampler = match &self.external {
            Some((sampler, context)) => Training::new(sampler.as_ref(), &self.config, *context),
            None => Training::new(
                &self.sampler as &dyn Sampler,
                &self.config,
                Some(self.trained.model.config.max_position_embeddings),
            ),
        };
        let rollouts = Rollouts {
            source: &self.source,
            holophore: &self.holophore,
            sampler: &sampler,
            run: &self.run,
        };
        rollouts.run(runtime, rows, group, seed, step, file)
    }

    /// Loss and gradients of one micro-batch: one loss, or (ERL's `erl_algorithm = 2`) the first loss
    /// plus `erl_rl_coef` times the second, each aggregated over its own completions.
    fn micro_step(
        &self,
        micro: &[Completion],
        buffer: &Buffer,
    ) -> Result<(f64, candle_core::backprop::GradStore, BTreeMap<String, f64>), TrainError> {
        // The first loss's completions, then the second's: each takes its slice of the token tensors.
        // Only ERL's second loss needs a reordered copy; a plain micro-batch is used as it is.
        let completions: Cow<'_, [Completion]> = if micro.iter().any(|c| c.second_loss) {
            let mut sorted = micro.to_vec();
            sorted.sort_by_key(|completion| completion.second_loss);
            Cow::Owned(sorted)
        } else {
            Cow::Borrowed(micro)
        };
        let split = completions.partition_point(|completion| !completion.second_loss);
        let (first, second) = completions.split_at(split);
        let first_tokens: usize = first.iter().map(Completion::len).sum();
        let second_tokens: usize = second.iter().map(Completion::len).sum();
        let correction = self.sampler_correction();
        let mut metrics = BTreeMap::new();
        let (value, grads) = score::backward(
            &self.trained.model,
            &completions,
            self.config.temperature,
            self.config.gradient_checkpointing,
            self.config.entropy_coef != 0.0,
            |head| {
                let mut total: Option<Tensor> = None;
                for (part, offset, tokens, items, weight, prefix) in [
                    (first, 0, first_tokens, buffer.num_items_in_batch, 1.0, ""),
                    (
                        second,
                        first_tokens,
                        second_tokens,
                        buffer.second_num_items,
                        self.config.erl_rl_coef,
                        "erl/",
                    ),
                ] {
                    if part.is_empty() {
                        continue;
                    }
                    let inputs = loss::Inputs {
                        completions: part,
                        num_items_in_batch: items,
                        sampler_correction: correction,
                    };
                    let computed = loss::compute(
                        &self.config,
                        &inputs,
                        &head.logprobs.narrow(0, offset, tokens)?,
                        &head.entropies.narrow(0, offset, tokens)?,
                    )?;
                    metrics.extend(
                        computed
                            .metrics
                            .into_iter()
                            .map(|(name, value)| (format!("{prefix}{name}"), value)),
                    );
                    let weighted = (computed.loss * weight)?;
                    total = Some(match total {
                        Some(sum) => (sum + weighted)?,
                        None => weighted,
                    });
                }
                match total {
                    Some(total) => Ok(total),
                    None => Tensor::zeros((), head.logprobs.dtype(), head.logprobs.device()),
                }
            },
        )?;
        let value = value
            .to_dtype(candle_core::DType::F64)?
            .to_scalar::<f64>()?;
        Ok((value, grads, metrics))
    }

    /// Rollouts of the held-out rows with the current weights (the same seed at every evaluation, so
    /// that only the weights change): `eval/reward`, `eval/pass@1`, `eval/pass@G`, each component's mean.
    fn evaluate(
        &self,
        runtime: &tokio::runtime::Runtime,
        rows: &[(usize, Row)],
        step: u64,
        progress: &ProgressBar,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let group = self.config.num_generations_eval();
        let seed = mix(self.config.seed ^ EVAL);
        let (records, summary) =
            self.rollouts(runtime, rows, group, seed, step, "eval_rollouts.jsonl")?;
        self.failures
            .check(&records, step, "eval_rollouts.jsonl", progress)?;
        if let Some(memory) = self.source.reflection_memory() {
            // Held-out rows must not teach the run: what their rollouts remembered is dropped.
            memory.discard_pending();
        }
        Ok(evaluation_metrics(&records, &summary))
    }
}
