//! The local backend: a candle model trained in process ([`Local`]), which samples its own rollouts
//! with the trained weights (or those of a sampler of the caller's, corrected for as TRL corrects
//! vLLM's).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use tokio::runtime::Runtime;

use super::backend::{Backend, Update};
use super::DROPOUT;
use crate::batch::Completion;
use crate::checkpoint::{RunDir, Weights};
use crate::config::{Algorithm, GrpoConfig, LossType};
use crate::correction::importance_sampling;
use crate::error::TrainError;
use crate::run::{self, mix, Opened, Policy, Trainable, Window};
use crate::state::{Buffer, TrainerState};
use crate::sync::{SyncOptions, WeightSync};
use crate::{erl, loss, ppo, replay, score};
use holo_core::holophore::Holophore;
use holo_core::sampler::Sampler;
use holo_model::{Limits, LocalModel, LocalOptions, Model};

/// A model trained in process: its trained weights (every weight or LoRA adapters) and optimizer,
/// the frozen reference when `beta` > 0, and the sampler that shares the trained weights.
pub struct Local {
    /// The trained weights and their optimizer.
    pub(super) trained: Trainable,
    reference: Option<Model>,
    sampler: LocalModel,
    /// A sampler of the caller's instead of `sampler`, and its model's context when known.
    pub(super) external: Option<(Arc<dyn Sampler>, Option<usize>)>,
    /// Whether the generation batches come from a feed (another process's sampler).
    pub(super) fed: bool,
    /// Servers to sample on and push the weights to, with the folder pushed weights are written to,
    /// until [`Backend::start`] connects to them ([`super::Trainer::with_rollout_servers`]).
    pub(super) rollout: Option<(SyncOptions, PathBuf)>,
    /// The connected servers' sync: a push after every optimizer step and every restore.
    sync: Option<WeightSync>,
    /// The gradients the step's micro-batches added up so far.
    grads: Option<Vec<Option<Tensor>>>,
    /// The last optimizer step's gradients, kept through the generation and the scores that follow it
    /// and freed when the next training pass starts, after the memory those freed is returned
    /// (`holo_core::trim::release`): the allocator keeps them for that pass's gradients to reuse
    /// (a 0.5B model's 1.9 GB, mapped and zeroed again each step otherwise), and nothing else.
    spent: Option<Vec<Option<Tensor>>>,
}

impl Local {
    /// Prepares the weights to train, the value model under PPO, the reference model when `beta` > 0,
    /// and the in-process sampler sharing the trained weights; with the Holophore of the policy's
    /// tokenizer and template.
    pub fn new(policy: Policy, config: &GrpoConfig) -> Result<(Self, Holophore), TrainError> {
        let base = policy.model;
        if config.routing_replay && base.config.experts.is_none() {
            return Err(TrainError::Input(format!(
                "`routing_replay`: the {} model `{}` has no mixture of experts, so there is no routing \
                 to replay",
                base.config.arch,
                policy.dir.display()
            )));
        }
        let mut trained = Trainable::new(&base, &policy.dir, config)?;
        if config.algorithm == Algorithm::Ppo {
            trained = trained.with_critic(ppo::critic(&base, config)?, config);
        }
        // The frozen starting point: the base weights (LoRA trains beside them, so they are shared).
        let reference = config.uses_reference().then(|| base.detached());
        drop(base);
        let holophore = Holophore::with_template_kwargs(
            Arc::new(policy.tokenizer.clone()),
            Arc::new(policy.template.clone()),
            config
                .chat_template_kwargs
                .as_ref()
                .map(|kwargs| kwargs.variables())
                .unwrap_or_default(),
        )
        .map_err(|error| {
            TrainError::Input(format!("--model `{}`: {error}", policy.dir.display()))
        })?;
        let holophore = match config
            .tool_format()
            .map_err(|error| TrainError::Input(error.to_string()))?
        {
            Some(format) => holophore.with_tool_format(format),
            None => holophore,
        };
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
                seed: config.training.seed,
                record_routes: config.routing_replay,
                ..LocalOptions::default()
            },
        );
        let local = Local {
            trained,
            reference,
            sampler,
            external: None,
            fed: false,
            rollout: None,
            sync: None,
            grads: None,
            spent: None,
        };
        Ok((local, holophore))
    }

    /// The model being trained (its weights are [`Var`]s).
    pub fn model(&self) -> &Model {
        &self.trained.model
    }

    /// The trained weights or adapters, by name.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.trained.vars
    }

    /// A checkpoint's generation batch in use with its constrained tokens' masks, which are not saved
    /// with it (each is replayed from its run, [`replay`]).
    fn replay_buffer(&self, state: &mut TrainerState) -> Result<(), TrainError> {
        match &mut state.buffer {
            Some(buffer) => replay::replay(self.sampler.grammars(), &mut buffer.completions),
            None => Ok(()),
        }
    }

    /// Whether the rollouts are sampled elsewhere than by the trained model in process.
    fn samples_elsewhere(&self) -> bool {
        self.external.is_some() || self.fed || self.rollout.is_some() || self.sync.is_some()
    }

    /// Whether the sampler's log-probabilities need TRL's importance-sampling correction. The
    /// in-process sampler is the trained f32 model itself: like TRL without vLLM, it needs none,
    /// unless it samples ahead of the steps (`max_off_policy_steps`) with weights they have since
    /// changed; a caller's sampler or a feed's is another process's.
    fn corrects_sampler(&self, config: &GrpoConfig) -> bool {
        self.sampler_differs(config) && config.vllm_importance_sampling_correction
    }

    /// Whether the weights that sampled may differ from those that train (another process's, or a
    /// snapshot drawing ahead), or their products do: over a quantized base (QLoRA) the sampler
    /// multiplies the blocks as ggml does, rounding each row of activations to 8 bits per block, while
    /// training multiplies their exact values.
    fn sampler_differs(&self, config: &GrpoConfig) -> bool {
        self.samples_elsewhere()
            || config.max_off_policy_steps > 0
            || self.trained.model.holds_blocks()
    }

    /// Pushes the trained weights to the rollout servers, if any (see [`crate::sync`]), into the
    /// step's metrics.
    fn push(
        &mut self,
        runtime: &Runtime,
        step: u64,
        window: Option<&mut Window>,
    ) -> Result<(), TrainError> {
        let Some(sync) = &mut self.sync else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        let weights = self.trained.weights();
        let pushed = runtime.block_on(sync.push(&self.trained.model, &weights, step))?;
        // The next rollouts sample the pushed weights (under their own name, when each push has one).
        if let Some(sampler) = sync.sampler() {
            let context = self.trained.model.config.max_position_embeddings;
            self.external = Some((sampler, Some(context)));
        }
        if let (Some(window), Some(pushed)) = (window, pushed) {
            let mut metrics = BTreeMap::from([
                ("sync/mismatch".to_string(), f64::from(pushed.mismatch)),
                ("sync/change".to_string(), f64::from(pushed.change)),
                ("sync/servers".to_string(), pushed.servers as f64),
            ]);
            if let Some(version) = pushed.version {
                metrics.insert("sync/weight_version".into(), version as f64);
            }
            window.extend(metrics);
            window.time("sync", started);
        }
        Ok(())
    }

    /// Loss and gradients of one micro-batch: one loss, or (ERL's `erl_algorithm = 2`) the first loss
    /// plus `erl_rl_coef` times the second, each aggregated over its own completions.
    fn backward(
        &self,
        config: &GrpoConfig,
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
        let correction = self.corrects_sampler(config);
        let mut metrics = BTreeMap::new();
        let pass = score::Pass {
            recompute: config.gradient_checkpointing,
            entropy_gradient: config.entropy_coef != 0.0,
            // TRL divides the auxiliary loss by the accumulation steps, as the policy loss is scaled.
            balance: self.trained.router_aux_loss_coef
                / config.training.gradient_accumulation_steps as f64,
        };
        let (value, grads) = score::backward(
            &self.trained.model,
            &completions,
            config.temperature,
            pass,
            |head| {
                let mut total: Option<Tensor> = None;
                for (part, offset, tokens, items, weight, prefix) in [
                    (first, 0, first_tokens, buffer.num_items_in_batch, 1.0, ""),
                    (
                        second,
                        first_tokens,
                        second_tokens,
                        buffer.second_num_items,
                        config.erl_rl_coef,
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
                        config,
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
                if let Some(drift) = head.routing {
                    metrics.insert("routing/replay_differ".into(), drift.fraction());
                }
                if let Some(balance) = head.balance {
                    metrics.insert("aux_loss".into(), balance);
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
}

impl Backend for Local {
    fn check(&self, config: &GrpoConfig) -> Result<(), TrainError> {
        if config.routing_replay && self.samples_elsewhere() {
            return Err(TrainError::Input(
                "`routing_replay`: only the in-process sampler records the experts it routes \
                 tokens through; this run samples elsewhere"
                    .into(),
            ));
        }
        if self.corrects_sampler(config)
            && config.loss_type == LossType::Vespo
            && config.vllm_importance_sampling_mode.is_sequence()
        {
            return Err(TrainError::Input(
                "`vllm_importance_sampling_mode`: VESPO weighs sequences itself and takes only token_truncate or token_mask".into(),
            ));
        }
        Ok(())
    }

    fn sampler(&self) -> (&dyn Sampler, Option<usize>) {
        match &self.external {
            Some((sampler, context)) => (sampler.as_ref(), *context),
            None => (
                &self.sampler,
                Some(self.trained.model.config.max_position_embeddings),
            ),
        }
    }

    fn snapshot(&mut self, version: u64) -> Result<(Arc<dyn Sampler>, Option<usize>), TrainError> {
        if let Some((sampler, context)) = &self.external {
            // Its weights are its own (the rollout servers take each step's after it).
            return Ok((Arc::clone(sampler), *context));
        }
        // The trained tensors copied (every weight, or the adapters): a sampler of their own with
        // this one's tokenizer and options. Its log-probabilities enter the loss (the correction), so
        // it samples batch-invariantly where it can (the CPU, f32 or bf16): a sequence's numbers then
        // do not depend on which others the scheduler's timing batched with it, and a resumed run
        // samples what the uninterrupted one did, to the bit.
        let model = &self.trained.model;
        let limits = Limits {
            batch_invariant: model.device().is_cpu()
                && matches!(model.dtype(), DType::F32 | DType::BF16),
            ..self.sampler.limits()
        };
        let sampler = self.sampler.with_model(model.snapshot()?, limits);
        sampler.set_weight_version(version);
        Ok((
            Arc::new(sampler),
            Some(self.trained.model.config.max_position_embeddings),
        ))
    }

    fn start(&mut self, runtime: &Runtime, state: &TrainerState) -> Result<(), TrainError> {
        // The in-process sampler's rollouts say which weights sampled them: the optimizer steps taken.
        self.sampler.set_weight_version(state.global_step);
        let Some((options, dir)) = self.rollout.take() else {
            return Ok(());
        };
        let model = &self.trained.model;
        let lora = matches!(self.trained.weights(), Weights::Adapters { .. });
        let sync = runtime.block_on(WeightSync::connect(
            options,
            dir,
            lora,
            model.config.vocab_size,
        ))?;
        self.sync = Some(sync);
        // The first push makes the sampler.
        self.push(runtime, state.global_step, None)
    }

    fn open(
        &mut self,
        run: &RunDir,
        resume: bool,
        config: &GrpoConfig,
    ) -> Result<Opened, TrainError> {
        let mut opened = run::open(run, resume, config, &mut self.trained)?;
        // The sampler shares the weights; its cached prefixes belong to the old ones.
        self.sampler.prefix_cache().clear();
        self.replay_buffer(&mut opened.state)?;
        Ok(opened)
    }

    fn score(
        &mut self,
        config: &GrpoConfig,
        completions: &mut [Completion],
        metrics: &mut BTreeMap<String, f64>,
    ) -> Result<(), TrainError> {
        let batch_size = config.training.per_device_train_batch_size;
        let generate_every = config.steps_per_generation() * config.num_iterations;
        let correction = self.corrects_sampler(config);
        replay::replay(self.sampler.grammars(), completions)?;
        // Log-probabilities of the policy as it sampled: without dropout.
        self.trained.model.set_dropout_seed(0);
        // The ratios' old log-probabilities where the loss needs them; without the correction, the
        // mismatch with a sampler whose weights differ is still measured, by the same pass.
        let keeps_old = !config
            .training
            .gradient_accumulation_steps
            .is_multiple_of(generate_every)
            || correction
            || config.algorithm == Algorithm::Ppo;
        let measures = !correction && self.sampler_differs(config);
        if keeps_old || measures {
            let old = score::logprobs(
                &self.trained.model,
                completions,
                config.temperature,
                batch_size,
            )?;
            if measures {
                crate::correction::mismatch(completions, &old, metrics);
            }
            if keeps_old {
                for (completion, old) in completions.iter_mut().zip(old) {
                    completion.old_logprobs = Some(old);
                }
            }
        }
        if correction {
            importance_sampling(config, completions, metrics);
        }
        if let Some(reference) = &self.reference {
            let logprobs = score::logprobs(reference, completions, config.temperature, batch_size)?;
            for (completion, logprobs) in completions.iter_mut().zip(logprobs) {
                completion.ref_logprobs = Some(logprobs);
            }
        }
        Ok(())
    }

    fn micro_step(
        &mut self,
        _runtime: &Runtime,
        config: &GrpoConfig,
        state: &TrainerState,
        buffer: &Buffer,
        slot: usize,
        window: &mut Window,
    ) -> Result<(), TrainError> {
        if let Some(spent) = self.spent.take() {
            holo_core::trim::release();
            drop(spent);
        }
        let steps = config.steps_per_generation();
        let micro = Buffer::slot(&buffer.completions, slot, steps);
        // LoRA dropout masks: a function of the seed and the micro-batch (never 0, which is off).
        self.trained
            .model
            .set_dropout_seed(mix(mix(config.training.seed ^ DROPOUT) ^ state.micro_step) | 1);
        let (value, micro_grads, metrics) = self.backward(config, micro, buffer)?;
        window.loss += value;
        window.extend(metrics);
        let grads = self.grads.get_or_insert_with(|| self.trained.no_grads());
        self.trained.accumulate(grads, &micro_grads)?;
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
                config,
                internalized,
                total,
            )?;
            window.loss += value;
            window.extend(metrics);
            self.trained.accumulate(grads, &internal_grads)?;
        }
        Ok(())
    }

    fn optimizer_step(
        &mut self,
        runtime: &Runtime,
        config: &GrpoConfig,
        state: &TrainerState,
        total: u64,
        window: &mut Window,
    ) -> Result<Update, TrainError> {
        let grads = match self.grads.take() {
            Some(grads) => grads,
            None => self.trained.no_grads(),
        };
        let (grad_norm, learning_rate) = self.trained.step(
            &grads,
            config,
            state.global_step,
            total,
            state.guard.lr_factor,
        )?;
        self.spent = Some(grads);
        // The sampler shares the weights; its cached prefixes belong to the old ones.
        self.sampler.prefix_cache().clear();
        self.sampler.set_weight_version(state.global_step + 1);
        self.push(runtime, state.global_step + 1, Some(window))?;
        Ok(Update {
            learning_rate,
            grad_norm: Some(grad_norm),
        })
    }

    fn ppo_update(
        &mut self,
        config: &GrpoConfig,
        buffer: &Buffer,
        state: &TrainerState,
        total: u64,
        window: &mut Window,
    ) -> Result<Update, TrainError> {
        let outcome = ppo::update(
            &mut self.trained,
            config,
            buffer,
            state.generations,
            state.global_step,
            total,
            state.guard.lr_factor,
        )?;
        self.sampler.prefix_cache().clear();
        self.sampler.set_weight_version(state.global_step + 1);
        window.loss += outcome.loss;
        window.extend(outcome.metrics);
        Ok(Update {
            learning_rate: outcome.learning_rate,
            grad_norm: Some(outcome.grad_norm),
        })
    }

    fn save(
        &mut self,
        _runtime: &Runtime,
        run: &RunDir,
        state: &TrainerState,
        config: &GrpoConfig,
    ) -> Result<PathBuf, TrainError> {
        self.trained.save(run, state, config)
    }

    fn restore(
        &mut self,
        runtime: &Runtime,
        run: &RunDir,
        dir: &Path,
        config: &GrpoConfig,
    ) -> Result<TrainerState, TrainError> {
        let mut state = run::restore(dir, config, &mut self.trained, &run.path)?;
        self.sampler.prefix_cache().clear();
        self.replay_buffer(&mut state)?;
        self.sampler.set_weight_version(state.global_step);
        self.push(runtime, state.global_step, None)?;
        Ok(state)
    }
}
