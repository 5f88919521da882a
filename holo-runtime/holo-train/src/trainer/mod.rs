//! The training loop: generation batches through the Loom, advantages, micro-batches, optimizer steps,
//! evaluation, checkpoints and metrics; see the [crate documentation](crate) for the order of events.
//! One loop for every backend ([`Backend`]): the weights live in process ([`Local`]) or on a Tinker
//! service (`holo_engines::tinker::train`), and the loop is the same.

mod ahead;
mod backend;
mod generation;
#[cfg(feature = "local")]
mod local;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use indicatif::ProgressBar;
use tokio::runtime::Runtime;

use self::ahead::Ahead;
pub use self::backend::{Backend, Update};
#[cfg(feature = "local")]
pub use self::local::Local;
use super::checkpoint::{RunDir, TrainerState};
use super::config::{Algorithm, GrpoConfig, TrainingConfig};
use super::curriculum::Stream;
use super::feed::Feed;
use super::guard;
use super::metrics::MetricsLog;
use super::provenance::{self, Provenance};
use super::rollouts::{self, Failures};
use super::run::{self, RunOptions, TrainError, Window};
pub use super::state::TrainSummary;
use holo_core::holophore::Holophore;
use holo_core::interpreter::Row;
use holo_core::loom::RolloutSource;
#[cfg(feature = "local")]
use {
    super::plan::Planned, super::run::Policy, candle_core::Var, holo_core::sampler::Sampler,
    holo_model::Model,
};

/// Seed salts, so that sampling, shuffling and evaluation draw independent streams (the data order's
/// is [`super::curriculum`]'s).
const SAMPLING: u64 = 2;
const SHUFFLE: u64 = 3;
const EVAL: u64 = 4;
#[cfg(feature = "local")]
const DROPOUT: u64 = 5;

/// The run folder's files of training and evaluation rollouts.
const TRAINING_FILE: &str = "rollouts.jsonl";
const EVAL_FILE: &str = "eval_rollouts.jsonl";

/// GRPO (or PPO) training of a policy on rollouts from a [`RolloutSource`]: by default a local model
/// ([`Local`]), or the weights of any other [`Backend`]; see the [crate documentation](crate).
// Without the model in process (feature `local`) there is no default backend to name.
pub struct Trainer<S, #[cfg(feature = "local")] B = Local, #[cfg(not(feature = "local"))] B> {
    /// Shared with the thread that draws generations ahead of the steps (`max_off_policy_steps`).
    source: Arc<S>,
    config: GrpoConfig,
    /// Where the weights are trained.
    backend: B,
    /// What the run is made from, and whether a resume may change it ([`Trainer::with_provenance`]).
    provenance: Option<(Provenance, bool)>,
    holophore: Holophore,
    run: RunDir,
    options: RunOptions,
    /// Where generation batches come from instead of the Loom ([`Trainer::with_feed`]).
    feed: Option<Box<dyn Feed>>,
    failures: Arc<Failures>,
    /// The last reply of the latest generation's first completed rollout: what the no-signal warning
    /// shows.
    example: Option<String>,
    /// The memory plan to write into the run folder once it is opened ([`Trainer::with_memory_plan`]).
    #[cfg(feature = "local")]
    memory_plan: Option<Planned>,
}

#[cfg(feature = "local")]
impl<S: RolloutSource> Trainer<S, Local> {
    /// Prepares the weights to train (every weight, or LoRA adapters), the reference model when `beta`
    /// > 0, and the in-process sampler sharing the trained weights.
    pub fn new(
        source: S,
        policy: Policy,
        config: GrpoConfig,
        options: RunOptions,
    ) -> Result<Self, TrainError> {
        validate(&config)?;
        let (local, holophore) = Local::new(policy, &config)?;
        Trainer::with_backend(source, local, holophore, config, options)
    }

    /// Samples rollouts with `sampler` (an OpenAI-compatible server, a bf16 copy) instead of the trained
    /// model in process. Its weights are its own: keep them in step with the trained ones (export and
    /// reload), or the rollouts drift off-policy. Its log-probabilities (at the run's temperature) are
    /// corrected for as TRL corrects vLLM's (`vllm_importance_sampling_correction` and its mode and
    /// bounds); `context` is its model's context length, when known.
    pub fn with_sampler(mut self, sampler: Box<dyn Sampler>, context: Option<usize>) -> Self {
        self.backend.external = Some((Arc::from(sampler), context));
        self
    }

    /// Samples rollouts on the OpenAI-compatible servers of `options` (each request to the one that
    /// would be done with it first by its measured speed, [`QuickestServer`]) while the weights
    /// train here, pushing them to every server after each optimizer step and verifying the push
    /// with a probe ([`crate::sync`]: a LoRA run's adapter by vLLM's `load_lora_adapter`, a full
    /// fine-tuning's weights by `update_weights_from_disk`, both of which `holo serve` answers). The
    /// servers' log-probabilities are corrected for as [`Trainer::with_sampler`]'s are. Pushed weights are
    /// written under `RUN_DIR/sync/`, which the servers must be able to read.
    /// When the loop samples ahead of its steps (`max_off_policy_steps`), a LoRA adapter is loaded
    /// under a name of its own at each push ([`crate::sync::SyncOptions::versioned`]).
    ///
    /// [`QuickestServer`]: crate::sync::QuickestServer
    pub fn with_rollout_servers(mut self, mut options: crate::sync::SyncOptions) -> Self {
        options.versioned |= self.config.max_off_policy_steps > 0;
        self.backend.rollout = Some((options, self.run.path.join("sync")));
        self
    }

    /// Trains on the batches of `feed` (an Atropos API) instead of rolling out itself: `train` needs no
    /// training rows then, and the sampler's log-probabilities are corrected for as an external
    /// sampler's are ([`Trainer::with_sampler`]).
    pub fn with_feed(mut self, feed: Box<dyn Feed>) -> Self {
        self.feed = Some(feed);
        self.backend.fed = true;
        self
    }

    /// The model being trained (its weights are [`Var`]s).
    pub fn model(&self) -> &Model {
        self.backend.model()
    }

    /// The trained weights or adapters, by name.
    pub fn vars(&self) -> &[(String, Var)] {
        self.backend.vars()
    }
}

impl<S: RolloutSource, B: Backend> Trainer<S, B> {
    /// A trainer of the weights `backend` holds, recording rollouts with `holophore` (the policy's
    /// tokenizer and chat template).
    pub fn with_backend(
        source: S,
        backend: B,
        holophore: Holophore,
        config: GrpoConfig,
        options: RunOptions,
    ) -> Result<Self, TrainError> {
        validate(&config)?;
        if let Some(memory) = source.reflection_memory() {
            memory.set_capacity(if config.enable_memory {
                config.memory_size
            } else {
                0
            });
        }
        Ok(Trainer {
            source: Arc::new(source),
            config,
            backend,
            provenance: None,
            holophore,
            run: RunDir::new(options.out.clone()),
            options,
            feed: None,
            failures: Arc::default(),
            example: None,
            #[cfg(feature = "local")]
            memory_plan: None,
        })
    }

    /// Records what the run is made from in `RUN_DIR/provenance.json` ([`super::provenance`]); a resumed
    /// run is refused when its inputs changed, naming the first, unless `allow_changes` (then the change
    /// is recorded with the step it was made at).
    pub fn with_provenance(mut self, provenance: Provenance, allow_changes: bool) -> Self {
        self.provenance = Some((provenance, allow_changes));
        self
    }

    /// Writes `plan` (the memory plan made before loading, [`super::plan::before_loading`]) as
    /// `RUN_DIR/memory_plan.json` once the run folder is opened.
    #[cfg(feature = "local")]
    pub fn with_memory_plan(mut self, plan: Option<Planned>) -> Self {
        self.memory_plan = plan;
        self
    }

    pub fn config(&self) -> &GrpoConfig {
        &self.config
    }

    /// The optimizer steps of a run over `rows` rows.
    pub fn total_steps(&self, rows: usize) -> u64 {
        let config = &self.config;
        if config.training.max_steps > 0 {
            return config.training.max_steps as u64;
        }
        let prompts = config.prompts_per_generation().max(1);
        let generations =
            (config.training.num_train_epochs * rows as f64 / prompts as f64).ceil() as u64;
        let micro =
            generations * config.steps_per_generation() as u64 * config.num_iterations as u64;
        micro
            .div_ceil(config.training.gradient_accumulation_steps as u64)
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
        self.backend.check(&config)?;
        if config.max_off_policy_steps > 0 {
            self.check_ahead()?;
        }
        let prompts = self.feed.is_none().then(|| config.prompts_per_generation());
        rollouts::check_rows(&*self.source, rows, eval_rows, prompts)?;
        let total = self.total_steps(rows.len());
        let stream = Stream::new(rows, &config).map_err(TrainError::Input)?;
        guard::check_eval_rows(&config, eval_rows.len())?;
        let runtime = self.backend.runtime()?;
        let (mut state, mut metrics_log) = self.open_run(&stream)?;
        if config.max_off_policy_steps == 0 && !state.ahead.is_empty() {
            return Err(TrainError::Input(format!(
                "--resume: the checkpoint at step {} keeps {} generations drawn ahead of its steps; \
                 resume with the `max_off_policy_steps` it was made with",
                state.global_step,
                state.ahead.len()
            )));
        }
        self.backend.start(&runtime, &state)?;

        let progress = run::progress_bar(self.options.progress, total, "step");
        progress.set_position(state.global_step);
        let mut summary = TrainSummary {
            steps: state.global_step,
            last: BTreeMap::new(),
            evaluations: Vec::new(),
            run_dir: self.run.path.clone(),
            stopped_early: false,
            stopped_by: None,
            rollbacks: 0,
        };
        // What the thread drawing ahead of the steps reads, shared with it and not borrowed from the
        // trainer, which the steps change.
        let source = Arc::clone(&self.source);
        let (holophore, failures) = (self.holophore.fork(), Arc::clone(&self.failures));
        let (run, drawing) = (self.run.clone(), config.clone());
        let outcome = std::thread::scope(|scope| {
            let mut ahead = match config.max_off_policy_steps {
                0 => None,
                _ => {
                    let drawer = generation::Drawer {
                        source: &*source,
                        holophore: &holophore,
                        config: &drawing,
                        failures: &failures,
                        run: &run,
                        stream: &stream,
                    };
                    Some(Ahead::start(scope, drawer, &mut state, &progress)?)
                }
            };
            self.steps(
                &runtime,
                &stream,
                rows,
                eval_rows,
                total,
                &mut state,
                &mut metrics_log,
                &mut summary,
                &progress,
                ahead.as_mut(),
            )
        });
        progress.finish_and_clear();
        summary.stopped_early = state.guard.stopped;
        summary.stopped_by = state
            .guard
            .stopped
            .then(|| state.guard.stopped_by(&self.config));
        summary.rollbacks = state.guard.rollbacks;
        outcome.map(|()| summary)
    }

    /// The run's steps from `state` to the last, with the evaluations, rollbacks and checkpoints
    /// between them.
    #[allow(clippy::too_many_arguments)]
    fn steps(
        &mut self,
        runtime: &Runtime,
        stream: &Stream<'_>,
        rows: &[(usize, Row)],
        eval_rows: &[(usize, Row)],
        total: u64,
        state: &mut TrainerState,
        metrics_log: &mut MetricsLog,
        summary: &mut TrainSummary,
        progress: &ProgressBar,
        mut ahead: Option<&mut Ahead>,
    ) -> Result<(), TrainError> {
        let config = self.config.clone();
        let fresh = state.global_step == 0 && !self.options.resume;
        if config.eval_on_start && fresh && !eval_rows.is_empty() {
            let metrics = self.evaluate(runtime, eval_rows, 0, progress)?;
            state.guard.evaluated(&config, metrics["eval/reward"]);
            metrics_log.log(0, &metrics)?;
            summary.evaluations.push((0, metrics));
        }
        if config.rolls_back() && fresh {
            // The starting weights: what a trip before the first saved checkpoint returns to.
            self.save(runtime, state, None)?;
        }
        while state.global_step < total && !state.guard.stopped {
            let started = Instant::now();
            let step = state.global_step + 1;
            let mut window = Window::default();
            let update = match config.algorithm {
                Algorithm::Grpo => self.grpo_step(
                    runtime,
                    stream,
                    state,
                    total,
                    progress,
                    &mut window,
                    ahead.as_deref_mut(),
                )?,
                Algorithm::Ppo => {
                    let generating = Instant::now();
                    let (buffer, generated) =
                        self.generate(runtime, stream, state, step, progress)?;
                    window.time("generation", generating);
                    window.extend(generated);
                    let updating = Instant::now();
                    let update =
                        self.backend
                            .ppo_update(&config, &buffer, state, total, &mut window)?;
                    window.time("update", updating);
                    state.micro_step +=
                        (config.steps_per_generation() * config.num_ppo_epochs) as u64;
                    update
                }
            };
            state.global_step = step;

            let mut metrics = window.means();
            metrics.insert("loss".into(), window.loss);
            if let Some(grad_norm) = update.grad_norm {
                metrics.insert("grad_norm".into(), grad_norm);
            }
            metrics.insert("learning_rate".into(), update.learning_rate);
            metrics.insert("num_tokens".into(), state.num_input_tokens_seen as f64);
            if !rows.is_empty() {
                metrics.insert(
                    "epoch".into(),
                    state.data_position as f64 / rows.len() as f64,
                );
            }
            metrics.insert("step_time".into(), started.elapsed().as_secs_f64());
            if let Some(trip) = state.guard.check(&config, step, &metrics) {
                if !config.rolls_back() {
                    return Err(guard::stop_without_rollback(&trip));
                }
                let (restored, note) = self.rewind(runtime, trip, state, &metrics, metrics_log)?;
                guard::after_rewind(summary, &restored, &note, progress);
                *state = restored;
                continue;
            }
            let last_step = step == total;
            if let Some(every) = config.eval_steps {
                if (step.is_multiple_of(every) || last_step) && !eval_rows.is_empty() {
                    let evaluation = self.evaluate(runtime, eval_rows, step, progress)?;
                    metrics.extend(evaluation.clone());
                    if state.guard.evaluated(&config, evaluation["eval/reward"]) {
                        progress.suspend(|| eprintln!("{}", state.guard.stopping_note(step)));
                    }
                    summary.evaluations.push((step, evaluation));
                }
            }
            if state.guard.without_signal(&config, &metrics) {
                let note = guard::no_signal_note(&config, step, &metrics, self.example.as_deref());
                progress.suspend(|| eprintln!("{note}"));
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
            if config
                .training
                .saves_after(step, last_step || state.guard.stopped)
            {
                let saved = self.save(runtime, state, ahead.as_deref_mut())?;
                if self.options.progress {
                    progress.suspend(|| eprintln!("saved {}", saved.display()));
                }
            }
            summary.steps = step;
            summary.last = metrics;
        }
        Ok(())
    }

    /// One GRPO optimizer step: `gradient_accumulation_steps` micro-batches of the current generation
    /// batch (generating the next one when it is used up, or taking it from those drawn `ahead`), then
    /// the update.
    #[allow(clippy::too_many_arguments)]
    fn grpo_step(
        &mut self,
        runtime: &Runtime,
        stream: &Stream<'_>,
        state: &mut TrainerState,
        total: u64,
        progress: &ProgressBar,
        window: &mut Window,
        mut ahead: Option<&mut Ahead>,
    ) -> Result<Update, TrainError> {
        let config = self.config.clone();
        let step = state.global_step + 1;
        let generate_every = (config.steps_per_generation() * config.num_iterations) as u64;
        for _ in 0..config.training.gradient_accumulation_steps {
            if state.micro_step.is_multiple_of(generate_every) || state.buffer.is_none() {
                let started = Instant::now();
                let (buffer, generated) = match ahead.as_deref_mut() {
                    Some(ahead) => {
                        let accumulation = config.training.gradient_accumulation_steps as u64;
                        let drawn =
                            ahead.next(&mut self.backend, state, generate_every, accumulation)?;
                        // The trainer's stream stands where this generation left it.
                        state.set_position(drawn.position.clone());
                        self.record(drawn, state, step)?
                    }
                    None => self.generate(runtime, stream, state, step, progress)?,
                };
                window.time("generation", started);
                window.extend(generated);
                state.buffer = Some(buffer);
            }
            let buffer = state.buffer.as_ref().expect("generated above");
            let slot = (state.micro_step % config.steps_per_generation() as u64) as usize;
            let started = Instant::now();
            self.backend
                .micro_step(runtime, &config, state, buffer, slot, window)?;
            window.time("backward", started);
            state.micro_step += 1;
            if state.micro_step.is_multiple_of(generate_every) {
                state.buffer = None;
            }
        }
        let started = Instant::now();
        let update = self
            .backend
            .optimizer_step(runtime, &config, state, total, window)?;
        window.time("optimizer", started);
        Ok(update)
    }

    /// Refuses, before any work, what cannot draw generations ahead of the steps.
    fn check_ahead(&self) -> Result<(), TrainError> {
        match self.feed {
            Some(_) => Err(TrainError::Input(format!(
                "`max_off_policy_steps` is {}, but the generations come from a feed, which paces \
                 them itself; set it to 0 (synchronous)",
                self.config.max_off_policy_steps
            ))),
            None => Ok(()),
        }
    }

    /// Answers a trip of the guard rails ([`guard::rewind`]): the run folder back at its last good
    /// checkpoint, restored into the backend.
    fn rewind(
        &mut self,
        runtime: &Runtime,
        trip: guard::Trip,
        state: &TrainerState,
        metrics: &BTreeMap<String, f64>,
        metrics_log: &mut MetricsLog,
    ) -> Result<(TrainerState, String), TrainError> {
        let Trainer {
            backend,
            config,
            run,
            source,
            ..
        } = self;
        backend.rewind(runtime, run, |backend| {
            guard::rewind(
                run,
                config,
                trip,
                &state.guard,
                metrics,
                metrics_log,
                |dir| {
                    let state = backend.restore(runtime, run, dir, config)?;
                    after_restore(run, &**source, &state)?;
                    Ok(state)
                },
            )
        })
    }

    /// Opens the run folder (see [`run::open_with`]) with its rollout files: new ones, or those of the
    /// resumed run cut back to its checkpoint; a new run's curriculum starts at its first level.
    fn open_run(&mut self, stream: &Stream<'_>) -> Result<(TrainerState, MetricsLog), TrainError> {
        let changes = match (&self.provenance, self.options.resume) {
            (Some((now, allow)), true) => self.check_provenance(now, *allow)?,
            _ => None,
        };
        let opened = self
            .backend
            .open(&self.run, self.options.resume, &self.config)?;
        #[cfg(feature = "local")]
        if let Some(plan) = &self.memory_plan {
            plan.write(&self.run.path)?;
        }
        // A resume that found no checkpoint started the run over: from here on it is a new run, which
        // evaluates at step 0 and saves its starting weights as a new run does.
        self.options.resume = opened.resumed;
        let mut state = opened.state;
        if let Some((now, _)) = &self.provenance {
            match changes {
                Some((mut saved, change)) => {
                    saved.changes.push(provenance::Change {
                        step: state.global_step,
                        inputs: now.inputs.clone(),
                        build: now.build.clone(),
                        message: change,
                    });
                    saved.write(&self.run.path)?;
                }
                None if !opened.resumed => now.write(&self.run.path)?,
                None => {}
            }
        }
        if opened.resumed {
            after_restore(&self.run, &*self.source, &state)?;
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
    /// the run has no provenance to compare with). Another build of `holo` (a new commit, changed
    /// sources) resumes with a warning and is recorded as a change: the inputs are the same, but the
    /// steps from here on may not be what the first build would have done.
    fn check_provenance(
        &self,
        now: &Provenance,
        allow: bool,
    ) -> Result<Option<(Provenance, String)>, TrainError> {
        let Some(saved) = Provenance::read(&self.run.path).map_err(TrainError::Input)? else {
            return Ok(None);
        };
        let build = saved.build_changed(now);
        if let Some(build) = &build {
            eprintln!("warning: {build}");
        }
        match saved.changed(now) {
            None => Ok(build.map(|build| (saved, build))),
            Some(change) if allow => {
                eprintln!("warning: {change}; resuming anyway (--allow-changes)");
                let change = match build {
                    Some(build) => format!("{change}; {build}"),
                    None => change,
                };
                Ok(Some((saved, change)))
            }
            Some(change) => Err(TrainError::Input(format!(
                "--resume: {change}; pass --allow-changes to resume with the changed inputs"
            ))),
        }
    }

    /// Writes a checkpoint of `state`, with ERL's memory as it is now, and the generations drawn
    /// `ahead` of it (once drawn).
    fn save(
        &mut self,
        runtime: &Runtime,
        state: &mut TrainerState,
        ahead: Option<&mut Ahead>,
    ) -> Result<PathBuf, TrainError> {
        state.memory = self
            .source
            .reflection_memory()
            .map(|memory| memory.entries())
            .unwrap_or_default();
        let checkpoint = self.run.checkpoint(state.global_step);
        let kept = match ahead {
            Some(ahead) => Some(ahead.settled(state)?),
            None => None,
        };
        self.backend
            .save(
                runtime,
                &self.run,
                kept.as_ref().unwrap_or(state),
                &self.config,
            )
            .map_err(|error| match error {
                // Name what was being written: "No space left on device" alone does not say where.
                TrainError::Io(error) => TrainError::Io(std::io::Error::new(
                    error.kind(),
                    format!("writing {}: {error}", checkpoint.display()),
                )),
                error => error,
            })
    }
}

/// `config` checked before any work ([`TrainingConfig::validate`]).
fn validate(config: &GrpoConfig) -> Result<(), TrainError> {
    config
        .validate()
        .map_err(|error| TrainError::Input(error.to_string()))
}

/// What a restored checkpoint brings back besides the weights: the rollout files cut back to its
/// step, and ERL's memory.
fn after_restore(
    run: &RunDir,
    source: &impl RolloutSource,
    state: &TrainerState,
) -> Result<(), TrainError> {
    for file in ["rollouts.jsonl", "eval_rollouts.jsonl"] {
        run.keep_records_until(file, state.global_step)?;
    }
    if let Some(memory) = source.reflection_memory() {
        memory.restore(state.memory.clone());
    }
    Ok(())
}
