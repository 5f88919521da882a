//! GRPO with the model on a Tinker service: the [`Tinker`] backend of [`holo_train::Trainer`]'s loop,
//! `holo train --backend tinker`. The loop is the local trainer's (the same data stream, curriculum,
//! seeds, advantages, guard rails, evaluations and run folder); what the backend does on the service:
//!
//! 1. **Sampling**: rollouts are sampled by the service from the sampler weights saved after the last
//!    step ([`TinkerSampler`]), each with the sampler's log-probability of every sampled token.
//! 2. **Datums**: each trained context of a rollout is one datum: the model reads its tokens but the
//!    last, and predicts the next; a target the model sampled carries its sampling log-probability and
//!    the rollout's advantage, every other target 0 and 0. Tinker's losses sum over tokens, so each
//!    advantage is divided by what `loss_type` divides TRL's loss by ([`token_weight`]): the
//!    gradients are those of the local trainer's loss.
//! 3. **`forward_backward`** of each micro-batch of the shuffled generation batch, with loss
//!    `importance_sampling` or `ppo` (ratio clipped to `[1 − epsilon, 1 + epsilon_high]`); then
//!    **`optim_step`** with the run's AdamW settings and the scheduled learning rate; then
//!    `save_weights_for_sampler`, which the next generation samples.
//! 4. **Checkpoints**: `save_weights` (weights and optimizer state on the service), and
//!    `RUN_DIR/checkpoint-N/` with `tinker.json` (the service's URL, the base model, the `tinker://`
//!    paths), `trainer_state.json` and `config.toml`. `--resume` creates a new model on the service,
//!    loads the newest checkpoint's weights and optimizer state into it, and continues; a rollback of
//!    the guard rails restores a checkpoint into a new model the same way (the service takes a
//!    checkpoint only as a model's first request) and unloads the one left behind.
//!
//! What the service cannot do as the local trainer does is refused before the run starts
//! ([`check_config`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;
use tokio::runtime::Runtime;

use super::client::Client;
use super::sampler::TinkerSampler;
use super::wire::{self, AdamParams, Datum, LossFn};
use holo_core::chat::folder;
use holo_core::holophore::Holophore;
use holo_core::loom::RolloutSource;
use holo_core::sampler::Sampler;
use holo_train::advantages::nanmean;
use holo_train::batch::Completion;
use holo_train::checkpoint::{self, RunDir, TrainerState};
use holo_train::config::{Algorithm, GrpoConfig, ImportanceSamplingLevel, LossType};
use holo_train::optim;
use holo_train::options::{Inert, TrainingConfig};
use holo_train::run::{self, Opened, RunOptions, TrainError, Window};
use holo_train::state::Buffer;
use holo_train::{Backend, Trainer, Update};

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

/// The options a Tinker run has no use for, whatever their values: the run's configuration refuses
/// them when they are set ([`holo_train::ConfigBuilder::unused`]), instead of ignoring them.
pub const UNUSED: &[Inert] = &[
    Inert {
        keys: &["lora_dropout", "lora_rank_pattern", "lora_alpha_pattern"],
        reason:
            "with --backend tinker the service's LoRA configuration is the rank alone (`lora_r`): \
                 it chooses dropout, alpha and one rank for every module itself",
    },
    Inert {
        keys: &["gradient_checkpointing", "memory_check", "memory_limit"],
        reason:
            "with --backend tinker the model is on the service: nothing of it is in memory here",
    },
    Inert {
        keys: &["router_aux_loss_coef"],
        reason: "with --backend tinker the service's losses have no router load-balancing term",
    },
    Inert {
        keys: &[
            "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_min",
            "vllm_importance_sampling_clip_max",
        ],
        reason:
            "with --backend tinker the service's losses take its sampler's log-probabilities as \
                 the old policy's, so there is no second ratio to correct",
    },
];

/// The options a Tinker run cannot honor, named with why; `None` when it can run.
pub fn check_config(config: &GrpoConfig, loss: LossFn) -> Result<(), String> {
    let refuse = |key: &str, why: &str| Err(format!("`{key}`: {why} with --backend tinker"));
    if config.algorithm != Algorithm::Grpo {
        return refuse(
            "algorithm",
            "only grpo runs (PPO's value model has no place on the service)",
        );
    }
    if !config.training.use_peft {
        return refuse(
            "use_peft",
            "must be true (the service trains LoRA adapters, never every weight)",
        );
    }
    if config.training.lora_target_modules.is_some()
        || config.training.lora_target_parameters.is_some()
    {
        return refuse(
            "lora_target_modules",
            "the service chooses what its adapters train (its LoRA configuration is the rank); \
             leave lora_target_modules and lora_target_parameters unset",
        );
    }
    if config.training.lora_alpha != wire::LORA_ALPHA {
        return refuse(
            "lora_alpha",
            "the service fixes alpha at 32 whatever the rank; leave lora_alpha unset (or 32)",
        );
    }
    if config.routing_replay {
        return refuse(
            "routing_replay",
            "cannot run (the service neither reports nor replays its routing)",
        );
    }
    if config.max_off_policy_steps > 0 {
        return refuse(
            "max_off_policy_steps",
            "must be 0 (the service's sampling client samples between the steps)",
        );
    }
    if config.training.save_only_model {
        return refuse(
            "save_only_model",
            "does nothing (the service saves the weights with the optimizer's state, and the run \
             folder holds only their paths)",
        );
    }
    if config.beta != 0.0 {
        return refuse(
            "beta",
            "must be 0 (the service keeps no reference model for a KL term)",
        );
    }
    if config.num_iterations != 1
        || config.steps_per_generation() != config.training.gradient_accumulation_steps
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
            "grpo, bnpo, dr_grpo, dapo or luspo (the service computes importance_sampling or ppo; CISPO, SAPO, VESPO and DPPO are other losses)",
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
    let accumulation = config.training.gradient_accumulation_steps as f64;
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

/// The weights of a [`Trainer`] on a Tinker service: a LoRA of the base model, trained with
/// `forward_backward` and `optim_step`, sampled from its saved sampler weights; see the [module
/// documentation](self).
pub struct Tinker {
    tinker: TinkerOptions,
    lora: wire::LoraConfig,
    sampler: TinkerSampler,
    remote: Remote,
    /// The service's side of the checkpoint a resumed run continues from, until [`Backend::start`].
    resumed: Option<ServiceCheckpoint>,
    /// The service's side of checkpoints beyond `save_total_limit` that a resume removed from the run
    /// folder (a kill between a save and its pruning leaves them), deleted from the service by
    /// [`Backend::start`], which has the runtime.
    pruned: Vec<ServiceCheckpoint>,
    /// The service's log-probabilities of the sampled tokens minus the sampler's, over the step.
    differences: Vec<f64>,
}

/// The service's side of a run in progress.
struct Remote {
    model_id: String,
    /// The session's next model's number (a rollback opens a new model).
    model_seq: u64,
    /// The next training request's sequence number.
    seq_id: u64,
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

impl Tinker {
    /// A trainer of `source`'s rollouts with the model on the service: checks the configuration
    /// ([`check_config`]) and loads the tokenizer and chat template the rollouts are recorded with.
    pub fn trainer<S: RolloutSource>(
        source: S,
        config: GrpoConfig,
        tinker: TinkerOptions,
        options: RunOptions,
    ) -> Result<Trainer<S, Tinker>, TrainError> {
        config
            .validate()
            .map_err(|error| TrainError::Input(error.to_string()))?;
        check_config(&config, tinker.loss).map_err(TrainError::Input)?;
        let dir = &tinker.tokenizer;
        let fail = |error: folder::FolderError| {
            TrainError::Input(format!("--tokenizer `{}`: {error}", dir.display()))
        };
        let tokenizer: Arc<Tokenizer> = Arc::new(folder::load_tokenizer(dir).map_err(fail)?);
        let template = Arc::new(folder::load_template(dir).map_err(fail)?);
        let end_of_turn = folder::end_of_turn_ids(dir, &tokenizer, &template).map_err(fail)?;
        if end_of_turn.is_empty() {
            return Err(TrainError::Input(format!(
                "--tokenizer `{}`: no end-of-turn token (eos_token_id in generation_config.json or config.json, or the template's eos_token)",
                dir.display()
            )));
        }
        let kwargs = config
            .chat_template_kwargs
            .as_ref()
            .map(|kwargs| kwargs.variables())
            .unwrap_or_default();
        let holophore = Holophore::with_template_kwargs(Arc::clone(&tokenizer), template, kwargs)
            .map_err(|error| {
            TrainError::Input(format!("--tokenizer `{}`: {error}", dir.display()))
        })?;
        let holophore = match config
            .tool_format()
            .map_err(|error| TrainError::Input(error.to_string()))?
        {
            Some(format) => holophore.with_tool_format(format),
            None => holophore,
        };
        let sampler = TinkerSampler::new(
            tinker.client.clone(),
            tokenizer,
            end_of_turn,
            config.max_completion_length as u32,
            String::new(),
        );
        let backend = Tinker {
            lora: wire::LoraConfig {
                rank: config.training.lora_r,
                seed: Some(config.training.seed),
            },
            tinker,
            sampler,
            remote: Remote {
                model_id: String::new(),
                model_seq: 0,
                seq_id: 1,
                session_id: String::new(),
                recorded: BTreeSet::new(),
            },
            resumed: None,
            pruned: Vec::new(),
            differences: Vec::new(),
        };
        Trainer::with_backend(source, backend, holophore, config, options)
    }

    /// The session's next model: a fresh LoRA, or one loaded from `checkpoint` (weights and optimizer
    /// state); and sampler weights of it, named after `step`, for the sampler.
    async fn open_model(
        &mut self,
        checkpoint: Option<&ServiceCheckpoint>,
        step: u64,
    ) -> Result<(), String> {
        let client = &self.tinker.client;
        let remote = &mut self.remote;
        remote.model_id = client
            .create_model(
                &remote.session_id,
                remote.model_seq,
                &self.tinker.base_model,
                self.lora.clone(),
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
        self.sampler.set_weights(weights);
        Ok(())
    }

    /// The checkpoint in `newest` that a resumed run continues from: its trainer state, after checking
    /// that it trains this base model with this configuration; its service side is kept for
    /// [`Backend::start`].
    fn resume_from(
        &mut self,
        newest: &Path,
        config: &GrpoConfig,
    ) -> Result<TrainerState, TrainError> {
        let dir = newest.parent().unwrap_or(newest);
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
        let (state, saved): (TrainerState, GrpoConfig) =
            checkpoint::read_state(newest).map_err(TrainError::Input)?;
        run::check_same_config(config, &saved, dir)?;
        self.resumed = Some(service);
        Ok(state)
    }

    /// The run folder's checkpoints by step, with what each keeps on the service (a folder without a
    /// readable `tinker.json` keeps nothing there).
    fn service_checkpoints(
        run: &RunDir,
    ) -> Result<Vec<(u64, Option<ServiceCheckpoint>)>, TrainError> {
        Ok(run
            .checkpoints()?
            .into_iter()
            .map(|(step, dir)| (step, read_checkpoint_file(&dir, SERVICE_FILE).ok()))
            .collect())
    }

    /// Removes the checkpoints beyond the newest `keep` from the run folder (all are kept without a
    /// limit); returns what they kept on the service.
    fn prune(run: &RunDir, keep: Option<usize>) -> Result<Vec<ServiceCheckpoint>, TrainError> {
        let Some(keep) = keep else {
            return Ok(Vec::new());
        };
        let checkpoints = Tinker::service_checkpoints(run)?;
        let surplus = checkpoints.len().saturating_sub(keep);
        let mut removed = Vec::new();
        for (step, service) in checkpoints.into_iter().take(surplus) {
            run.remove_checkpoint(step, &run.checkpoint(step))?;
            removed.extend(service);
        }
        Ok(removed)
    }

    /// Deletes a checkpoint the run no longer keeps from the service: its weights, and its sampler
    /// weights unless the sampler is using them.
    fn discard(&mut self, runtime: &Runtime, service: Option<&ServiceCheckpoint>) {
        let Some(service) = service else {
            return;
        };
        self.delete(runtime, &service.weights, false);
        self.remote.recorded.remove(&service.sampler_weights);
        if service.sampler_weights != self.sampler.weights() {
            self.delete(runtime, &service.sampler_weights, true);
        }
    }

    /// Deletes sampler weights the sampler has left behind from the service, unless a checkpoint
    /// records them.
    fn forget_sampler_weights(&self, runtime: &Runtime, path: &str) {
        if !self.remote.recorded.contains(path) {
            self.delete(runtime, path, true);
        }
    }

    /// Deletes `path` (sampler weights with `sampler`) from the service. Storage is not worth stopping
    /// a run for: a failure is a warning.
    fn delete(&self, runtime: &Runtime, path: &str, sampler: bool) {
        if path.is_empty() {
            return;
        }
        if let Err(error) = runtime.block_on(self.tinker.client.delete_checkpoint(path, sampler)) {
            eprintln!("warning: {error}; it stays on the service");
        }
    }
}

impl Backend for Tinker {
    /// Heartbeats run beside the steps: a runtime with a worker of its own.
    fn runtime(&self) -> std::io::Result<Runtime> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
    }

    fn sampler(&self) -> (&dyn Sampler, Option<usize>) {
        (&self.sampler, None)
    }

    fn sampler_error(&self) -> Option<String> {
        self.sampler.take_error()
    }

    /// Opens the run folder; a resume removes the checkpoints beyond `save_total_limit` that a kill
    /// left, as the local trainer's does ([`Backend::start`] deletes them from the service).
    fn open(
        &mut self,
        run: &RunDir,
        resume: bool,
        config: &GrpoConfig,
    ) -> Result<Opened, TrainError> {
        let opened = run::open_with(
            run,
            resume,
            config,
            |_| Ok(()),
            |newest| self.resume_from(newest, config),
        )?;
        if opened.resumed {
            self.pruned = Tinker::prune(run, config.training.save_total_limit)?;
        }
        Ok(opened)
    }

    /// A new session on the service with a model in it (the resumed checkpoint's, or a fresh LoRA),
    /// and its heartbeats until the runtime ends; then the weights of the checkpoints the resume
    /// pruned are deleted from the service.
    fn start(&mut self, runtime: &Runtime, state: &TrainerState) -> Result<(), TrainError> {
        let resumed = self.resumed.take();
        runtime
            .block_on(async {
                let (session_id, seed_bits) = self
                    .tinker
                    .client
                    .create_session()
                    .await
                    .map_err(|e| e.to_string())?;
                self.remote.session_id = session_id;
                self.sampler.set_seed_bits(seed_bits);
                self.open_model(resumed.as_ref(), state.global_step).await
            })
            .map_err(TrainError::Source)?;
        for pruned in std::mem::take(&mut self.pruned) {
            self.discard(runtime, Some(&pruned));
        }
        let (client, session) = (self.tinker.client.clone(), self.remote.session_id.clone());
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(10)).await;
                // A missed heartbeat is not fatal: the next operation reports a service gone.
                let _ = client.heartbeat(&session).await;
            }
        });
        Ok(())
    }

    fn micro_step(
        &mut self,
        runtime: &Runtime,
        config: &GrpoConfig,
        state: &TrainerState,
        buffer: &Buffer,
        slot: usize,
        window: &mut Window,
    ) -> Result<(), TrainError> {
        let step = state.global_step + 1;
        let kept = |part: &[Completion]| -> (usize, usize) {
            let kept: Vec<&Completion> = part.iter().filter(|c| c.mask != 0.0).collect();
            (kept.len(), kept.iter().map(|c| c.len()).sum())
        };
        // The generation batch's trained tokens (no ERL here, so every completion's).
        let batch_tokens = buffer.num_items_in_batch as usize;
        let micro = Buffer::slot(
            &buffer.completions,
            slot,
            config.training.gradient_accumulation_steps,
        );
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
            return Ok(());
        }
        let seq = self.remote.next_seq();
        let result = runtime
            .block_on(self.tinker.client.forward_backward(
                &self.remote.model_id,
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
        window.loss += match result.metrics.get("loss:sum") {
            Some(&sum) => sum,
            None => result
                .outputs
                .iter()
                .filter_map(|output| output.get("elementwise_loss"))
                .flatten()
                .map(|&value| f64::from(value))
                .sum(),
        };
        // The service's log-probabilities of the sampled tokens under the weights that sampled them:
        // how far its sampler is from its trainer.
        for (index, trained, logprobs) in sampled {
            if let Some(scored) = result.outputs[index].get("logprobs") {
                for (&position, &sampled) in trained.iter().zip(&logprobs) {
                    if let Some(&now) = scored.get(position - 1) {
                        self.differences.push(f64::from(now) - f64::from(sampled));
                    }
                }
            }
        }
        Ok(())
    }

    /// `optim_step`, then sampler weights of the new weights for the next generation (the sampler's
    /// previous ones deleted unless a checkpoint records them).
    fn optimizer_step(
        &mut self,
        runtime: &Runtime,
        config: &GrpoConfig,
        state: &TrainerState,
        total: u64,
        window: &mut Window,
    ) -> Result<Update, TrainError> {
        let step = state.global_step + 1;
        let learning_rate =
            optim::learning_rate(config, state.global_step, total) * state.guard.lr_factor;
        let seq = self.remote.next_seq();
        let optimized = runtime
            .block_on(self.tinker.client.optim_step(
                &self.remote.model_id,
                seq,
                AdamParams {
                    learning_rate,
                    beta1: config.training.adam_beta1,
                    beta2: config.training.adam_beta2,
                    eps: config.training.adam_epsilon,
                    weight_decay: config.training.weight_decay,
                    grad_clip_norm: config.training.max_grad_norm,
                },
            ))
            .map_err(|error| TrainError::Source(error.to_string()))?;
        let seq = self.remote.next_seq();
        let sampler_weights = runtime
            .block_on(self.tinker.client.save_weights(
                &self.remote.model_id,
                seq,
                &format!("sampler-step-{step}"),
                true,
            ))
            .map_err(|error| TrainError::Source(error.to_string()))?;
        let superseded = self.sampler.weights();
        self.sampler.set_weights(sampler_weights);
        self.forget_sampler_weights(runtime, &superseded);

        let service = optimized.metrics.unwrap_or_default();
        let grad_norm = service
            .get("skyrl.ai/grad_norm")
            .or_else(|| service.get("grad_norm"))
            .copied();
        let mut metrics: BTreeMap<String, f64> = service
            .iter()
            .map(|(name, value)| (format!("tinker/{name}"), *value))
            .collect();
        let differences = std::mem::take(&mut self.differences);
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
        window.extend(metrics);
        Ok(Update {
            learning_rate,
            grad_norm,
        })
    }

    /// `save_weights` on the service, then `RUN_DIR/checkpoint-N/` (written into a temporary folder
    /// and renamed into place), keeping the newest `save_total_limit` checkpoints (the older ones'
    /// weights deleted from the service too).
    fn save(
        &mut self,
        runtime: &Runtime,
        run: &RunDir,
        state: &TrainerState,
        config: &GrpoConfig,
    ) -> Result<PathBuf, TrainError> {
        let step = state.global_step;
        let seq = self.remote.next_seq();
        let weights = runtime
            .block_on(self.tinker.client.save_weights(
                &self.remote.model_id,
                seq,
                &format!("checkpoint-{step}"),
                false,
            ))
            .map_err(|error| TrainError::Source(error.to_string()))?;
        let service = ServiceCheckpoint {
            base_url: self.tinker.client.url().to_string(),
            base_model: self.tinker.base_model.clone(),
            model_id: self.remote.model_id.clone(),
            weights,
            sampler_weights: self.sampler.weights(),
        };
        self.remote.recorded.insert(service.sampler_weights.clone());
        run.remove_partial()?;
        let staging = run
            .path
            .join(format!(".checkpoint-{step}-{}.tmp", std::process::id()));
        std::fs::create_dir_all(&staging)?;
        write_synced(&staging.join(SERVICE_FILE), &pretty(&service))?;
        write_synced(&staging.join("trainer_state.json"), &pretty(state))?;
        write_synced(&staging.join("config.toml"), &config.to_toml())?;
        checkpoint::write_checksums(&staging)?;
        let target = run.checkpoint(step);
        if target.exists() {
            run.remove_checkpoint(step, &target)?;
        }
        std::fs::rename(&staging, &target)?;
        for old in Tinker::prune(run, config.training.save_total_limit)? {
            self.discard(runtime, Some(&old));
        }
        Ok(target)
    }

    /// The service takes a checkpoint only as a new model's first request, so the model the run leaves
    /// is unloaded (a failure there is only warned of: the run can go on without it) and a new one
    /// opened with the checkpoint's weights and optimizer state.
    fn restore(
        &mut self,
        runtime: &Runtime,
        _run: &RunDir,
        dir: &Path,
        _config: &GrpoConfig,
    ) -> Result<TrainerState, TrainError> {
        let service: ServiceCheckpoint = read_checkpoint_file(dir, SERVICE_FILE)?;
        let state: TrainerState = read_checkpoint_file(dir, "trainer_state.json")?;
        self.forget_sampler_weights(runtime, &self.sampler.weights());
        runtime
            .block_on(async {
                if let Err(error) = self.tinker.client.unload_model(&self.remote.model_id).await {
                    eprintln!("warning: {error}; the abandoned model stays on the service");
                }
                self.open_model(Some(&service), state.global_step).await
            })
            .map_err(TrainError::Source)?;
        Ok(state)
    }

    /// The rollback, then the checkpoints it abandoned deleted from the service too.
    fn rewind(
        &mut self,
        runtime: &Runtime,
        run: &RunDir,
        rewind: impl FnOnce(&mut Self) -> Result<(TrainerState, String), TrainError>,
    ) -> Result<(TrainerState, String), TrainError> {
        let saved = Tinker::service_checkpoints(run)?;
        let rewound = rewind(self);
        let kept = Tinker::service_checkpoints(run)?;
        for (step, service) in &saved {
            if !kept.iter().any(|(kept, _)| kept == step) {
                self.discard(runtime, service.as_ref());
            }
        }
        rewound
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

#[cfg(test)]
mod tests {
    use super::*;

    /// LoRA's targets are the service's: a run that names them is refused, whichever build checked
    /// their names (without the `local` feature nothing else does).
    #[test]
    fn lora_targets_are_refused() {
        let mut config = GrpoConfig::default();
        config.training.use_peft = true;
        assert_eq!(check_config(&config, LossFn::ImportanceSampling), Ok(()));
        let mut modules = config.clone();
        modules.training.lora_target_modules = Some(holo_core::peft::Targets::names(&["q_proj"]));
        let mut parameters = config.clone();
        parameters.training.lora_target_parameters = Some(vec!["mlp.experts.down_proj".into()]);
        for config in [modules, parameters] {
            let refused = check_config(&config, LossFn::ImportanceSampling).unwrap_err();
            assert!(
                refused.starts_with("`lora_target_modules`: the service chooses"),
                "{refused}"
            );
        }
    }
}
