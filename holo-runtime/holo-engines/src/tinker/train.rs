//! GRPO with the model on a Tinker service: [`TinkerTrainer`], `holo train --backend tinker`.
//!
//! One optimizer step:
//! 1. **Generation**: the next `generation_batch_size / num_generations` rows of the data stream
//!    ([`Stream`]: the same order, curriculum and seeds as the local trainer), `num_generations`
//!    rollouts each through the Loom, sampled by the service from the sampler weights saved after the
//!    last step ([`TinkerSampler`]), each with the sampler's log-probability of every sampled token;
//!    appended to `RUN_DIR/rollouts.jsonl`.
//! 2. **Advantages**, here: each reward component, weighted, normalized within each row's group
//!    ([`advantages`]).
//! 3. **Datums**: each trained context of a rollout is one datum: the model reads its tokens but the
//!    last, and predicts the next; a target the model sampled carries its sampling log-probability and
//!    the rollout's advantage, every other target 0 and 0. Tinker's losses sum over tokens, so each
//!    advantage is divided by what `loss_type` divides TRL's loss by ([`token_weight`]): the
//!    gradients are those of the local trainer's loss.
//! 4. **`forward_backward`** of each micro-batch of `per_device_train_batch_size` rollouts (shuffled as
//!    the local trainer shuffles them), with loss `importance_sampling` or `ppo` (ratio clipped to
//!    `[1 − epsilon, 1 + epsilon_high]`); then **`optim_step`** with the run's AdamW settings and the
//!    scheduled learning rate; then `save_weights_for_sampler`, which the next generation samples.
//! 5. **Evaluation** every `eval_steps`, metrics in `metrics.jsonl` and TensorBoard events, and every
//!    `save_steps` a **checkpoint**: `save_weights` (weights and optimizer state on the service), and
//!    `RUN_DIR/checkpoint-N/` with `tinker.json` (the service's URL, the base model, the `tinker://`
//!    paths), `trainer_state.json` and `config.toml`. `--resume` creates a new model on the service,
//!    loads the newest checkpoint's weights and optimizer state into it, and continues.
//!
//! The guard rails are the local trainer's ([`holo_train::guard`]): early stopping, and rollbacks on
//! the training reward, which restore a checkpoint into a new model on the service (it takes a
//! checkpoint only as a model's first request) and unload the one left behind.
//!
//! What the service cannot do as the local trainer does is refused before the run starts
//! ([`check_config`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use super::client::Client;
use super::sampler::TinkerSampler;
use super::wire::{self, AdamParams, Datum, LossFn};
use holo_core::chat::folder;
use holo_core::holophore::Holophore;
use holo_core::interpreter::Row;
use holo_core::loom::{mix, RolloutRecord, RolloutSource};
use holo_core::sampler::Sampler;
use holo_model::files as model_files;
use holo_train::advantages::{self, nanmean};
use holo_train::batch::{self, Completion};
use holo_train::checkpoint::{RunDir, TrainerState};
use holo_train::config::{Algorithm, GrpoConfig, ImportanceSamplingLevel, LossType};
use holo_train::curriculum::Stream;
use holo_train::guard;
use holo_train::metrics::{completion_metrics, print_completions, MetricsLog};
use holo_train::options::TrainingConfig;
use holo_train::provenance::{self, Provenance};
use holo_train::run::{self, RunOptions, TrainError};
use holo_train::{check_rows, Training};
use holo_train::{
    evaluation_metrics, optim, Failures, Rollouts, TrainSummary, EVAL, SAMPLING, SHUFFLE,
};

/// The file of a checkpoint that holds the service's side of it.
pub const SERVICE_FILE: &str = "tinker.json";

/// What a checkpoint keeps of the service: where the weights are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceCheckpoint {
    /// The service's URL when the checkpoint was saved.
    pub base_url: String,
    pub base_model: String,
    /// The model on the service that was trained.
    pub model_id: String,
    /// `save_weights`' path: the weights and the optimizer's state.
    pub weights: String,
    /// `save_weights_for_sampler`'s path of the same weights.
    pub sampler_weights: String,
}

/// The service side of a run.
pub struct TinkerOptions {
    pub client: Client,
    /// The base model on the service (`--model`).
    pub base_model: String,
    /// A folder with the base model's `tokenizer.json` and chat template (the rollouts are recorded
    /// token by token with them).
    pub tokenizer: PathBuf,
    pub loss: LossFn,
}

/// The options a Tinker run cannot honor, named with why; `None` when it can run.
pub fn check_config(config: &GrpoConfig, loss: LossFn) -> Result<(), String> {
    let refuse = |key: &str, why: &str| Err(format!("`{key}`: {why} with --backend tinker"));
    if config.algorithm != Algorithm::Grpo {
        return refuse(
            "algorithm",
            "only grpo runs (PPO's value model has no place on the service)",
        );
    }
    if config.beta != 0.0 {
        return refuse(
            "beta",
            "must be 0 (the service keeps no reference model for a KL term)",
        );
    }
    if config.num_iterations != 1
        || config.steps_per_generation() != config.gradient_accumulation_steps
    {
        return refuse(
            "num_iterations",
            "each generation batch is one optimizer step: num_iterations = 1 and steps_per_generation = gradient_accumulation_steps",
        );
    }
    if config.temperature != 1.0 || config.top_p != 1.0 || config.top_k != 0 {
        return refuse(
            "temperature",
            "sampling must be at temperature 1 over the whole vocabulary (top_p = 1, top_k = 0): the service scores the policy at temperature 1, so other sampling makes the importance ratios wrong",
        );
    }
    if !matches!(
        config.loss_type,
        LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo | LossType::Luspo
    ) {
        return refuse(
            "loss_type",
            "grpo, bnpo, dr_grpo, dapo or luspo (the service computes importance_sampling or ppo; CISPO, SAPO and VESPO are other losses)",
        );
    }
    if config.importance_sampling_level != ImportanceSamplingLevel::Token {
        return refuse(
            "importance_sampling_level",
            "only token (the service's ratios are per token)",
        );
    }
    if config.delta.is_some() && matches!(loss, LossFn::Ppo { .. }) {
        return refuse("delta", "the service's ppo loss has no two-sided clipping");
    }
    if config.entropy_coef != 0.0 || config.top_entropy_quantile != 1.0 {
        return refuse(
            "entropy_coef",
            "the service reports no entropies (entropy_coef = 0, top_entropy_quantile = 1)",
        );
    }
    if config.erl {
        return refuse(
            "erl",
            "ERL's second loss and internalization run locally only",
        );
    }
    if config.dynamic_sampling {
        return refuse("dynamic_sampling", "not built for the Tinker backend");
    }
    if config.off_policy_mask_threshold.is_some() {
        return refuse(
            "off_policy_mask_threshold",
            "the service's losses have no off-policy mask",
        );
    }
    Ok(())
}

/// What each trained token's advantage is multiplied by so that the service's sum over tokens is
/// `loss_type`'s normalization: `length` is the completion's trained tokens, `completions` and
/// `tokens` the micro-batch's (rollouts kept, trained tokens), `batch_tokens` the generation batch's.
pub fn token_weight(
    config: &GrpoConfig,
    length: usize,
    completions: usize,
    tokens: usize,
    batch_tokens: usize,
) -> f64 {
    let accumulation = config.gradient_accumulation_steps as f64;
    let completions = completions.max(1) as f64;
    match config.loss_type {
        LossType::Grpo => 1.0 / (length.max(1) as f64 * completions * accumulation),
        LossType::Bnpo => 1.0 / (tokens.max(1) as f64 * accumulation),
        LossType::DrGrpo => {
            1.0 / (completions * config.max_completion_length as f64 * accumulation)
        }
        LossType::Luspo => 1.0 / (completions * accumulation),
        // DAPO's normalizer is the generation batch's trained tokens (one generation per step here).
        _ => 1.0 / batch_tokens.max(1) as f64,
    }
}

/// The datums of one completion: one per trained sequence, `weight` × its advantage on each trained
/// target. Errors when a trained token has no sampling log-probability.
pub fn datums(completion: &Completion, weight: f64) -> Result<Vec<Datum>, String> {
    let advantage = (f64::from(completion.advantage) * weight * f64::from(completion.mask)) as f32;
    completion
        .sequences
        .iter()
        .map(|sequence| {
            let targets = sequence.ids.len().saturating_sub(1);
            let mut logprobs = vec![0.0; targets];
            let mut advantages = vec![0.0; targets];
            for (&position, &logprob) in sequence.trained.iter().zip(&sequence.sampling_logprobs) {
                if logprob.is_nan() {
                    return Err(format!(
                        "the sampler gave no log-probability for the trained token at position {position}"
                    ));
                }
                logprobs[position - 1] = logprob;
                advantages[position - 1] = advantage;
            }
            Ok(Datum {
                tokens: sequence.ids.clone(),
                logprobs,
                advantages,
            })
        })
        .collect()
}

/// GRPO of a model on a Tinker service on rollouts from a [`RolloutSource`]; see the [module
/// documentation](self).
pub struct TinkerTrainer<S> {
    source: S,
    config: GrpoConfig,
    tinker: TinkerOptions,
    options: RunOptions,
    holophore: Holophore,
    tokenizer: Arc<Tokenizer>,
    end_of_turn: Vec<u32>,
    run: RunDir,
    provenance: Option<(Provenance, bool)>,
    failures: Failures,
}

/// The service's side of a run in progress.
struct Remote {
    model_id: String,
    /// The session's next model's number (a rollback opens a new model).
    model_seq: u64,
    /// The next training request's sequence number.
    seq_id: u64,
    sampler: TinkerSampler,
    session_id: String,
    /// The sampler weights that checkpoints record; others are deleted from the service once the
    /// sampler has newer ones.
    recorded: BTreeSet<String>,
}

impl Remote {
    fn next_seq(&mut self) -> u64 {
        let seq = self.seq_id;
        self.seq_id += 1;
        seq
    }
}

impl<S: RolloutSource> TinkerTrainer<S> {
    /// Checks the configuration ([`check_config`]) and loads the tokenizer and chat template.
    pub fn new(
        source: S,
        config: GrpoConfig,
        tinker: TinkerOptions,
        options: RunOptions,
    ) -> Result<Self, TrainError> {
        config
            .validate()
            .map_err(|error| TrainError::Input(error.to_string()))?;
        check_config(&config, tinker.loss).map_err(TrainError::Input)?;
        let dir = &tinker.tokenizer;
        let fail = |error: model_files::LoadError| {
            TrainError::Input(format!("--tokenizer `{}`: {error}", dir.display()))
        };
        let tokenizer = Arc::new(model_files::load_tokenizer(dir).map_err(fail)?);
        let template = Arc::new(model_files::load_template(dir).map_err(fail)?);
        let end_of_turn = folder::end_of_turn_ids(dir, &tokenizer, &template)
            .map_err(|error| fail(error.into()))?;
        if end_of_turn.is_empty() {
            return Err(TrainError::Input(format!(
                "--tokenizer `{}`: no end-of-turn token (eos_token_id in generation_config.json or config.json, or the template's eos_token)",
                dir.display()
            )));
        }
        let holophore = Holophore::new(Arc::clone(&tokenizer), template).map_err(|error| {
            TrainError::Input(format!("--tokenizer `{}`: {error}", dir.display()))
        })?;
        Ok(TinkerTrainer {
            source,
            config,
            run: RunDir::new(options.out.clone()),
            tinker,
            options,
            holophore,
            tokenizer,
            end_of_turn,
            provenance: None,
            failures: Failures::default(),
        })
    }

    /// Records what the run is made from, as [`holo_train::Trainer::with_provenance`] does.
    pub fn with_provenance(mut self, provenance: Provenance, allow_changes: bool) -> Self {
        self.provenance = Some((provenance, allow_changes));
        self
    }

    /// The optimizer steps of a run over `rows` rows: `max_steps`, or the epochs' generations.
    pub fn total_steps(&self, rows: usize) -> u64 {
        let config = &self.config;
        if config.max_steps > 0 {
            return config.max_steps as u64;
        }
        let prompts = config.prompts_per_generation().max(1);
        ((config.num_train_epochs * rows as f64 / prompts as f64).ceil() as u64).max(1)
    }

    /// Trains on `rows`, evaluating on `eval_rows` every `eval_steps`. Blocks until the last step.
    pub fn train(
        &mut self,
        rows: &[(usize, Row)],
        eval_rows: &[(usize, Row)],
    ) -> Result<TrainSummary, TrainError> {
        let config = self.config.clone();
        check_rows(
            &self.source,
            rows,
            eval_rows,
            Some(config.prompts_per_generation()),
        )?;
        guard::check_eval_rows(&config, eval_rows.len())?;
        let total = self.total_steps(rows.len());
        let stream = Stream::new(rows, &config).map_err(TrainError::Input)?;
        // Heartbeats run beside the steps: a runtime with a worker of its own.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let (mut state, mut metrics_log, resumed_from) = self.open_run(&stream)?;
        let mut remote = runtime
            .block_on(self.connect(resumed_from.as_ref(), state.global_step))
            .map_err(TrainError::Source)?;
        let heartbeat = {
            let (client, session) = (self.tinker.client.clone(), remote.session_id.clone());
            runtime.spawn(async move {
                loop {
                    tokio::time::sleep(std::time::Duration::from_secs(10)).await;
                    // A missed heartbeat is not fatal: the next operation reports a service gone.
                    let _ = client.heartbeat(&session).await;
                }
            })
        };
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
        let fresh = state.global_step == 0 && resumed_from.is_none();
        let outcome = (|| {
            if config.eval_on_start && fresh && !eval_rows.is_empty() {
                let metrics = self.evaluate(&runtime, &remote, eval_rows, 0, &progress)?;
                state.guard.evaluated(&config, metrics["eval/reward"]);
                metrics_log.log(0, &metrics)?;
                summary.evaluations.push((0, metrics));
            }
            if config.rolls_back() && fresh {
                // The starting weights: what a trip before the first saved checkpoint returns to.
                self.save(&runtime, &mut remote, &state)?;
            }
            while state.global_step < total && !state.guard.stopped {
                let step = state.global_step + 1;
                let mut metrics =
                    self.step(&runtime, &stream, &mut state, &mut remote, total, &progress)?;
                metrics.insert(
                    "epoch".into(),
                    state.data_position as f64 / rows.len() as f64,
                );
                if let Some(trip) = state.guard.check(&config, step, &metrics) {
                    let run = self.run.clone();
                    let saved = self.service_checkpoints()?;
                    let rewound = guard::rewind(
                        &run,
                        &config,
                        trip,
                        &state.guard,
                        &metrics,
                        &mut metrics_log,
                        |dir| self.restore(&runtime, &mut remote, dir),
                    );
                    // The checkpoints the rollback abandoned, on the service too.
                    let kept = self.service_checkpoints()?;
                    for (step, service) in &saved {
                        if !kept.iter().any(|(kept, _)| kept == step) {
                            self.discard(&runtime, &mut remote, service.as_ref());
                        }
                    }
                    let (restored, note) = rewound?;
                    guard::after_rewind(&mut summary, &restored, &note, &progress);
                    state = restored;
                    continue;
                }
                let last_step = step == total;
                if let Some(every) = config.eval_steps {
                    if (step % every == 0 || last_step) && !eval_rows.is_empty() {
                        let evaluation =
                            self.evaluate(&runtime, &remote, eval_rows, step, &progress)?;
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
                    "reward {:.3}",
                    metrics.get("reward").copied().unwrap_or(f64::NAN)
                ));
                progress.set_position(step);
                if step % config.save_steps == 0 || last_step || state.guard.stopped {
                    let saved = self.save(&runtime, &mut remote, &state)?;
                    if self.options.progress {
                        progress.suspend(|| eprintln!("saved {}", saved.display()));
                    }
                }
                summary.steps = step;
                summary.last = metrics;
            }
            Ok(())
        })();
        heartbeat.abort();
        progress.finish_and_clear();
        summary.stopped_early = state.guard.stopped;
        summary.rollbacks = state.guard.rollbacks;
        outcome.map(|()| summary)
    }

    /// One optimizer step; returns its metrics.
    fn step(
        &self,
        runtime: &tokio::runtime::Runtime,
        stream: &Stream<'_>,
        state: &mut TrainerState,
        remote: &mut Remote,
        total: u64,
        progress: &indicatif::ProgressBar,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let config = &self.config;
        let started = Instant::now();
        let step = state.global_step + 1;
        let group = config.num_generations;
        let mut metrics = state
            .curriculum
            .as_ref()
            .map(|curriculum| stream.metrics(curriculum))
            .unwrap_or_default();

        let drawn = stream.next(state, config.prompts_per_generation(), &[]);
        let seed = mix(mix(config.seed ^ SAMPLING) ^ state.generations);
        let generation = state.generations;
        state.generations += 1;
        let (records, _) = self.rollouts(
            runtime,
            &remote.sampler,
            &drawn,
            group,
            seed,
            step,
            "rollouts.jsonl",
        )?;
        if let Some(error) = remote.sampler.take_error() {
            return Err(TrainError::Source(error));
        }
        self.failures
            .check(&records, step, "rollouts.jsonl", progress)?;

        let rewards = batch::rewards(&records, config.reward_weights.as_ref());
        let scored = advantages::advantages(
            &rewards,
            group,
            config.scale_rewards,
            config.multi_objective_aggregation,
        );
        metrics.extend(scored.metrics.clone());
        if let Some(curriculum) = state.curriculum.as_mut() {
            let means: Vec<f64> = scored
                .totals
                .chunks(group)
                .map(|totals| nanmean(totals.iter().copied()))
                .collect();
            let (mean, advance) = stream.observe(curriculum, &means);
            metrics.insert("curriculum/mean_reward".into(), mean);
            if let Some(advance) = advance {
                progress.suspend(|| eprintln!("{advance} (after step {step})"));
            }
        }
        let mut completions = batch::completions(
            &records,
            &scored.advantages,
            config.mask_truncated_completions,
        );
        completion_metrics(&records, &completions, &mut metrics);
        if config.log_completions {
            print_completions(
                &records,
                &scored.advantages,
                config.num_completions_to_print,
                step,
            );
        }
        state.num_input_tokens_seen += completions
            .iter()
            .flat_map(|c| &c.sequences)
            .map(|s| s.ids.len() as u64)
            .sum::<u64>();
        let shuffle = mix(mix(config.seed ^ SHUFFLE) ^ generation);
        completions.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(shuffle));

        let kept = |part: &[Completion]| -> (usize, usize) {
            let kept: Vec<&Completion> = part.iter().filter(|c| c.mask != 0.0).collect();
            (kept.len(), kept.iter().map(|c| c.len()).sum())
        };
        let (_, batch_tokens) = kept(&completions);
        let steps = config.gradient_accumulation_steps;
        let (mut loss, mut differences) = (0.0, Vec::new());
        for slot in 0..steps {
            let micro = holo_train::checkpoint::Buffer::slot(&completions, slot, steps);
            let (count, tokens) = kept(micro);
            let mut data = Vec::new();
            let mut sampled = Vec::new();
            for completion in micro {
                let weight = token_weight(config, completion.len(), count, tokens, batch_tokens);
                let made = datums(completion, weight)
                    .map_err(|message| TrainError::Source(format!("step {step}: {message}")))?;
                for (datum, sequence) in made.into_iter().zip(&completion.sequences) {
                    if completion.mask != 0.0 {
                        sampled.push((
                            data.len(),
                            sequence.trained.clone(),
                            sequence.sampling_logprobs.clone(),
                        ));
                    }
                    data.push(datum);
                }
            }
            if data.is_empty() {
                continue;
            }
            let seq = remote.next_seq();
            let result = runtime
                .block_on(self.tinker.client.forward_backward(
                    &remote.model_id,
                    seq,
                    &data,
                    self.tinker.loss,
                ))
                .map_err(|error| TrainError::Source(error.to_string()))?;
            if result.outputs.len() != data.len() {
                return Err(TrainError::Source(format!(
                    "the Tinker service at {} answered forward_backward of {} datums with {} outputs",
                    self.tinker.client.url(),
                    data.len(),
                    result.outputs.len()
                )));
            }
            loss += match result.metrics.get("loss:sum") {
                Some(&sum) => sum,
                None => result
                    .outputs
                    .iter()
                    .filter_map(|output| output.get("elementwise_loss"))
                    .flatten()
                    .map(|&value| f64::from(value))
                    .sum(),
            };
            // The service's log-probabilities of the sampled tokens under the weights that sampled
            // them: how far its sampler is from its trainer.
            for (index, trained, logprobs) in sampled {
                if let Some(scored) = result.outputs[index].get("logprobs") {
                    for (&position, &sampled) in trained.iter().zip(&logprobs) {
                        if let Some(&now) = scored.get(position - 1) {
                            differences.push(f64::from(now) - f64::from(sampled));
                        }
                    }
                }
            }
        }
        let learning_rate =
            optim::learning_rate(config, state.global_step, total) * state.guard.lr_factor;
        let seq = remote.next_seq();
        let optimized = runtime
            .block_on(self.tinker.client.optim_step(
                &remote.model_id,
                seq,
                AdamParams {
                    learning_rate,
                    beta1: config.adam_beta1,
                    beta2: config.adam_beta2,
                    eps: config.adam_epsilon,
                    weight_decay: config.weight_decay,
                    grad_clip_norm: config.max_grad_norm,
                },
            ))
            .map_err(|error| TrainError::Source(error.to_string()))?;
        let seq = remote.next_seq();
        let sampler_weights = runtime
            .block_on(self.tinker.client.save_weights(
                &remote.model_id,
                seq,
                &format!("sampler-step-{step}"),
                true,
            ))
            .map_err(|error| TrainError::Source(error.to_string()))?;
        let superseded = remote.sampler.weights();
        remote.sampler.set_weights(sampler_weights);
        self.forget_sampler_weights(runtime, remote, &superseded);
        state.micro_step += steps as u64;
        state.global_step = step;

        metrics.insert("loss".into(), loss);
        metrics.insert("learning_rate".into(), learning_rate);
        let service = optimized.metrics.unwrap_or_default();
        for (name, value) in &service {
            metrics.insert(format!("tinker/{name}"), *value);
        }
        if let Some(&norm) = service
            .get("skyrl.ai/grad_norm")
            .or_else(|| service.get("grad_norm"))
        {
            metrics.insert("grad_norm".into(), norm);
        }
        if !differences.is_empty() {
            let ratios: Vec<f64> = differences.iter().map(|d| d.exp()).collect();
            let fold = |values: &[f64], f: fn(f64, f64) -> f64| {
                values.iter().copied().reduce(f).unwrap_or(f64::NAN)
            };
            let absolute: Vec<f64> = differences.iter().map(|d| d.abs()).collect();
            metrics.insert(
                "sampling/sampling_logp_difference/mean".into(),
                nanmean(absolute.iter().copied()),
            );
            metrics.insert(
                "sampling/sampling_logp_difference/max".into(),
                fold(&absolute, f64::max),
            );
            metrics.insert(
                "sampling/importance_sampling_ratio/min".into(),
                fold(&ratios, f64::min),
            );
            metrics.insert(
                "sampling/importance_sampling_ratio/mean".into(),
                nanmean(ratios.iter().copied()),
            );
            metrics.insert(
                "sampling/importance_sampling_ratio/max".into(),
                fold(&ratios, f64::max),
            );
        }
        metrics.insert("num_tokens".into(), state.num_input_tokens_seen as f64);
        metrics.insert("step_time".into(), started.elapsed().as_secs_f64());
        Ok(metrics)
    }

    /// Rollouts sampled by the service's sampler.
    #[allow(clippy::too_many_arguments)]
    fn rollouts(
        &self,
        runtime: &tokio::runtime::Runtime,
        sampler: &TinkerSampler,
        rows: &[(usize, Row)],
        group: usize,
        seed: u64,
        step: u64,
        file: &str,
    ) -> Result<(Vec<RolloutRecord>, holo_core::loom::Summary), TrainError> {
        let training = Training::new(sampler as &dyn Sampler, &self.config, None);
        Rollouts {
            source: &self.source,
            holophore: &self.holophore,
            sampler: &training,
            run: &self.run,
        }
        .run(runtime, rows, group, seed, step, file)
    }

    /// Rollouts of the held-out rows with the current weights (the same seed at every evaluation).
    fn evaluate(
        &self,
        runtime: &tokio::runtime::Runtime,
        remote: &Remote,
        rows: &[(usize, Row)],
        step: u64,
        progress: &indicatif::ProgressBar,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let group = self.config.num_generations_eval();
        let seed = mix(self.config.seed ^ EVAL);
        let (records, summary) = self.rollouts(
            runtime,
            &remote.sampler,
            rows,
            group,
            seed,
            step,
            "eval_rollouts.jsonl",
        )?;
        if let Some(error) = remote.sampler.take_error() {
            return Err(TrainError::Source(error));
        }
        self.failures
            .check(&records, step, "eval_rollouts.jsonl", progress)?;
        Ok(evaluation_metrics(&records, &summary))
    }

    /// A new session on the service with a model in it ([`TinkerTrainer::open_model`]).
    async fn connect(
        &self,
        resumed: Option<&ServiceCheckpoint>,
        step: u64,
    ) -> Result<Remote, String> {
        let client = &self.tinker.client;
        let session_id = client.create_session().await.map_err(|e| e.to_string())?;
        let mut remote = Remote {
            model_id: String::new(),
            model_seq: 0,
            seq_id: 1,
            sampler: TinkerSampler::new(
                client.clone(),
                Arc::clone(&self.tokenizer),
                self.end_of_turn.clone(),
                self.config.max_completion_length as u32,
                String::new(),
            ),
            session_id,
            recorded: BTreeSet::new(),
        };
        self.open_model(&mut remote, resumed, step).await?;
        Ok(remote)
    }

    /// The session's next model: a fresh LoRA, or one loaded from `checkpoint` (weights and optimizer
    /// state); and sampler weights of it, named after `step`, for the sampler.
    async fn open_model(
        &self,
        remote: &mut Remote,
        checkpoint: Option<&ServiceCheckpoint>,
        step: u64,
    ) -> Result<(), String> {
        let client = &self.tinker.client;
        remote.model_id = client
            .create_model(
                &remote.session_id,
                remote.model_seq,
                &self.tinker.base_model,
                wire::LoraConfig {
                    rank: self.config.lora_r,
                    seed: Some(self.config.seed),
                },
            )
            .await
            .map_err(|e| e.to_string())?;
        remote.model_seq += 1;
        remote.seq_id = 1;
        if let Some(checkpoint) = checkpoint {
            let seq = remote.next_seq();
            client
                .load_weights(&remote.model_id, seq, &checkpoint.weights)
                .await
                .map_err(|error| {
                    format!(
                        "{error}; the checkpoint was saved on the service at {} as model {}",
                        checkpoint.base_url, checkpoint.model_id
                    )
                })?;
        }
        let seq = remote.next_seq();
        let weights = client
            .save_weights(&remote.model_id, seq, &format!("sampler-step-{step}"), true)
            .await
            .map_err(|e| e.to_string())?;
        remote.sampler.set_weights(weights);
        Ok(())
    }

    /// A rollback's restoration of the checkpoint in `dir`: the service takes a checkpoint only as a
    /// new model's first request, so the model the run leaves is unloaded (a failure there is only
    /// warned of: the run can go on without it) and a new one opened with the checkpoint's weights and
    /// optimizer state. Returns the checkpoint's state.
    fn restore(
        &self,
        runtime: &tokio::runtime::Runtime,
        remote: &mut Remote,
        dir: &Path,
    ) -> Result<TrainerState, TrainError> {
        let service: ServiceCheckpoint = read_checkpoint_file(dir, SERVICE_FILE)?;
        let state: TrainerState = read_checkpoint_file(dir, "trainer_state.json")?;
        self.forget_sampler_weights(runtime, remote, &remote.sampler.weights());
        runtime
            .block_on(async {
                if let Err(error) = self.tinker.client.unload_model(&remote.model_id).await {
                    eprintln!("warning: {error}; the abandoned model stays on the service");
                }
                self.open_model(remote, Some(&service), state.global_step)
                    .await
            })
            .map_err(TrainError::Source)?;
        Ok(state)
    }

    /// Opens the run folder: a new run (refusing a folder that holds one), or with `resume` the
    /// newest checkpoint of the run in it, made with the same configuration and base model. Returns
    /// the state, the metrics log and the resumed checkpoint's service side.
    fn open_run(
        &mut self,
        stream: &Stream<'_>,
    ) -> Result<(TrainerState, MetricsLog, Option<ServiceCheckpoint>), TrainError> {
        let dir = self.run.path.clone();
        std::fs::create_dir_all(&dir)?;
        self.run.remove_partial()?;
        let checkpoints = self.run.checkpoints()?;
        if !self.options.resume {
            if !checkpoints.is_empty() || dir.join(holo_train::metrics::METRICS_FILE).exists() {
                return Err(TrainError::Input(format!(
                    "`{}` already holds a run: pass --resume to continue it, or choose another --out",
                    dir.display()
                )));
            }
            std::fs::write(dir.join("config.toml"), self.config.to_toml())?;
            if let Some((now, _)) = &self.provenance {
                now.write(&dir)?;
            }
            for file in ["rollouts.jsonl", "eval_rollouts.jsonl"] {
                std::fs::File::create(dir.join(file))?;
            }
            let state = TrainerState {
                curriculum: stream.start(),
                ..TrainerState::default()
            };
            return Ok((state, MetricsLog::create(&dir)?, None));
        }
        let Some((step, newest)) = checkpoints.last() else {
            return Err(TrainError::Input(format!(
                "--resume: `{}` has no checkpoint to resume from",
                dir.display()
            )));
        };
        self.check_provenance()?;
        let read = |file: &str| {
            std::fs::read_to_string(newest.join(file))
                .map_err(|error| TrainError::Input(format!("{}/{file}: {error}", newest.display())))
        };
        let service: ServiceCheckpoint =
            read_checkpoint_file(newest, SERVICE_FILE).map_err(|error| {
                TrainError::Input(format!(
                    "{error} (a checkpoint of a local run resumes without --backend tinker)"
                ))
            })?;
        if service.base_model != self.tinker.base_model {
            return Err(TrainError::Input(format!(
                "--resume: --model is `{}` but the run in `{}` trains `{}`",
                self.tinker.base_model,
                dir.display(),
                service.base_model
            )));
        }
        let saved: GrpoConfig = toml::from_str(&read("config.toml")?).map_err(|error| {
            TrainError::Input(format!(
                "{}/config.toml: {}",
                newest.display(),
                error.message()
            ))
        })?;
        if let Some((key, saved, now)) = self.config.differs_from(&saved) {
            return Err(TrainError::Input(format!(
                "--resume: `{key}` is {now} but the run in `{}` was made with {saved}; resume with the same configuration",
                dir.display()
            )));
        }
        let state: TrainerState = read_checkpoint_file(newest, "trainer_state.json")?;
        stream.check_resumed(&state).map_err(TrainError::Input)?;
        for file in ["rollouts.jsonl", "eval_rollouts.jsonl"] {
            self.run.keep_records_until(file, *step)?;
        }
        guard::keep_events(&self.run, state.guard.rollbacks)?;
        Ok((state, MetricsLog::resume(&dir, *step)?, Some(service)))
    }

    /// The run's recorded provenance against this one's, as the local trainer checks it.
    fn check_provenance(&self) -> Result<(), TrainError> {
        let Some((now, allow)) = &self.provenance else {
            return Ok(());
        };
        let Some(mut saved) = Provenance::read(&self.run.path).map_err(TrainError::Input)? else {
            return Ok(());
        };
        match saved.changed(now) {
            None => Ok(()),
            Some(change) if *allow => {
                eprintln!("warning: {change}; resuming anyway (--allow-changes)");
                let step = self.run.checkpoints()?.last().map_or(0, |(step, _)| *step);
                saved.changes.push(provenance::Change {
                    step,
                    inputs: now.inputs.clone(),
                    message: change,
                });
                Ok(saved.write(&self.run.path)?)
            }
            Some(change) => Err(TrainError::Input(format!(
                "--resume: {change}; pass --allow-changes to resume with the changed inputs"
            ))),
        }
    }

    /// The run folder's checkpoints by step, with what each keeps on the service (a folder without a
    /// readable `tinker.json` keeps nothing there).
    fn service_checkpoints(&self) -> Result<Vec<(u64, Option<ServiceCheckpoint>)>, TrainError> {
        Ok(self
            .run
            .checkpoints()?
            .into_iter()
            .map(|(step, dir)| (step, read_checkpoint_file(&dir, SERVICE_FILE).ok()))
            .collect())
    }

    /// Deletes a checkpoint the run no longer keeps from the service: its weights, and its sampler
    /// weights unless the sampler is using them.
    fn discard(
        &self,
        runtime: &tokio::runtime::Runtime,
        remote: &mut Remote,
        service: Option<&ServiceCheckpoint>,
    ) {
        let Some(service) = service else {
            return;
        };
        self.delete(runtime, &service.weights, false);
        remote.recorded.remove(&service.sampler_weights);
        if service.sampler_weights != remote.sampler.weights() {
            self.delete(runtime, &service.sampler_weights, true);
        }
    }

    /// Deletes sampler weights the sampler has left behind from the service, unless a checkpoint
    /// records them.
    fn forget_sampler_weights(
        &self,
        runtime: &tokio::runtime::Runtime,
        remote: &Remote,
        path: &str,
    ) {
        if !remote.recorded.contains(path) {
            self.delete(runtime, path, true);
        }
    }

    /// Deletes `path` (sampler weights with `sampler`) from the service. Storage is not worth stopping
    /// a run for: a failure is a warning.
    fn delete(&self, runtime: &tokio::runtime::Runtime, path: &str, sampler: bool) {
        if path.is_empty() {
            return;
        }
        if let Err(error) = runtime.block_on(self.tinker.client.delete_checkpoint(path, sampler)) {
            eprintln!("warning: {error}; it stays on the service");
        }
    }

    /// `save_weights` on the service, then `RUN_DIR/checkpoint-N/` (written into a temporary folder
    /// and renamed into place), keeping the newest `save_total_limit` checkpoints (the older ones'
    /// weights deleted from the service too).
    fn save(
        &self,
        runtime: &tokio::runtime::Runtime,
        remote: &mut Remote,
        state: &TrainerState,
    ) -> Result<PathBuf, TrainError> {
        let step = state.global_step;
        let seq = remote.next_seq();
        let weights = runtime
            .block_on(self.tinker.client.save_weights(
                &remote.model_id,
                seq,
                &format!("checkpoint-{step}"),
                false,
            ))
            .map_err(|error| TrainError::Source(error.to_string()))?;
        let service = ServiceCheckpoint {
            base_url: self.tinker.client.url().to_string(),
            base_model: self.tinker.base_model.clone(),
            model_id: remote.model_id.clone(),
            weights,
            sampler_weights: remote.sampler.weights(),
        };
        remote.recorded.insert(service.sampler_weights.clone());
        self.run.remove_partial()?;
        let staging = self
            .run
            .path
            .join(format!(".checkpoint-{step}-{}.tmp", std::process::id()));
        std::fs::create_dir_all(&staging)?;
        write_synced(&staging.join(SERVICE_FILE), &pretty(&service))?;
        write_synced(&staging.join("trainer_state.json"), &pretty(state))?;
        write_synced(&staging.join("config.toml"), &self.config.to_toml())?;
        let target = self.run.checkpoint(step);
        if target.exists() {
            std::fs::remove_dir_all(&target)?;
        }
        std::fs::rename(&staging, &target)?;
        if let Some(keep) = self.config.save_total_limit {
            let checkpoints = self.service_checkpoints()?;
            for (step, old) in checkpoints
                .iter()
                .take(checkpoints.len().saturating_sub(keep))
            {
                std::fs::remove_dir_all(self.run.checkpoint(*step))?;
                self.discard(runtime, remote, old.as_ref());
            }
        }
        Ok(target)
    }
}

/// A JSON file of the checkpoint in `dir`, or an error naming it.
fn read_checkpoint_file<T: serde::de::DeserializeOwned>(
    dir: &Path,
    file: &str,
) -> Result<T, TrainError> {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path)
        .map_err(|error| TrainError::Input(format!("{}: {error}", path.display())))?;
    serde_json::from_str(&text)
        .map_err(|error| TrainError::Input(format!("{}: {error}", path.display())))
}

fn pretty(value: &impl Serialize) -> String {
    serde_json::to_string_pretty(value).expect("the checkpoint's files serialize")
}

fn write_synced(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::File::create(path)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()
}
