//! PPO with a value model (`algorithm = "ppo"`), with the option names and formulas of TRL's
//! `PPOTrainer` (`trl.experimental.ppo`, last shipped in TRL 1.12).
//!
//! One optimizer *step* of the run is one PPO update, as in TRL:
//! 1. **Generation**: `generation_batch_size = per_device_train_batch_size × gradient_accumulation_steps ×
//!    num_mini_batches` rollouts (`num_generations` per row; 1 is usual) through the Loom, as GRPO's,
//!    with the sampling policy's log-probabilities, the reference's (when `kl_coef` ≠ 0) and the value
//!    model's values of every trained token ([`critic()`], [`critic::Critic`]).
//! 2. **Advantages** ([`gae`]): per-token rewards (`−kl_coef · KL`, and the rollout's reward on its last
//!    trained token, less `missing_eos_penalty` when it ran out of tokens), optionally whitened, GAE with
//!    `gamma` and `lam` over the rollout's trained tokens (tool output between turns is skipped, not
//!    counted as steps), returns = advantages + values, advantages whitened over the batch.
//! 3. **`num_ppo_epochs` passes**, each over a fresh permutation of the batch split into
//!    `num_mini_batches` mini-batches; a mini-batch is `gradient_accumulation_steps` micro-batches, each
//!    adding the gradient of `(pg_loss + vf_coef · vf_loss) / gradient_accumulation_steps` ([`loss`]),
//!    and ends with one AdamW step over the policy's and the value model's weights together (one
//!    gradient norm clipped to `max_grad_norm`). The learning rate is the update's: TRL steps its
//!    scheduler once per update.
//!
//! Rollouts that failed (or were truncated under `mask_truncated_completions`) have no tokens in the
//! whitening or the losses. Metrics are TRL's names (`objective/kl`, `objective/entropy`,
//! `objective/non_score_reward`, `objective/rlhf_reward`, `objective/scores`, `policy/approxkl_avg`,
//! `policy/clipfrac_avg`, `loss/policy_avg`, `loss/value_avg`, `val/clipfrac_avg`,
//! `policy/entropy_avg`, `val/ratio`, `val/ratio_var`), each averaged over the micro-batches' trained
//! tokens (TRL's `approxkl`, `entropy` and `ratio` also average over padding), plus `kl` (the mean
//! per-token KL, what `rollback_kl` watches).

pub mod critic;
pub mod gae;
pub mod loss;

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::batch::{Completion, Sequence};
use super::checkpoint::Buffer;
pub use super::config::{Algorithm, KlEstimator};
use super::config::{GrpoConfig, TrainingConfig};
use super::error::TrainError;
use super::run::{mix, Trainable};
use super::score;
use critic::Critic;
use holo_model::Model;

/// Seed salts of PPO's own draws.
const PERMUTATION: u64 = 6;
const DROPOUT: u64 = 7;
const VALUE_HEAD: u64 = 8;

/// The value model of a PPO run: `value_model`'s folder (keeping its `score` head when it has one),
/// or a copy of the policy `base`, with a new head drawn from the run's seed.
pub fn critic(base: &holo_model::Model, config: &GrpoConfig) -> Result<Critic, TrainError> {
    let lora = config.training().lora();
    let seed = mix(config.training.seed ^ VALUE_HEAD);
    let built = match &config.value_model {
        None => Critic::new(base, None, lora.as_ref(), seed),
        Some(dir) => {
            let path = std::path::Path::new(dir);
            let fail =
                |message: String| TrainError::Input(format!("`value_model` `{dir}`: {message}"));
            let (model, mut extra) = holo_model::files::load_model_with(
                path,
                candle_core::DType::F32,
                base.device(),
                &[critic::HEAD],
            )
            .map_err(|error| fail(error.to_string()))?;
            if model.config.vocab_size != base.config.vocab_size {
                return Err(fail(format!(
                    "its vocabulary has {} tokens, the policy's {}: the value model reads the policy's token ids",
                    model.config.vocab_size, base.config.vocab_size
                )));
            }
            Critic::new(&model, extra.remove(critic::HEAD), lora.as_ref(), seed)
        }
    };
    built.map_err(|error| TrainError::Input(format!("the value model: {error}")))
}

/// What one PPO update did.
pub(crate) struct Outcome {
    /// The micro-batches' losses, averaged.
    pub loss: f64,
    /// The optimizer steps' gradient norms (before clipping), averaged.
    pub grad_norm: f64,
    pub learning_rate: f64,
    pub metrics: BTreeMap<String, f64>,
}

/// A rollout's trained tokens as PPO's losses see them, one entry per token in order.
pub struct Targets {
    /// Whether its tokens are trained (not failed, not masked as truncated, not empty).
    pub valid: bool,
    /// The value model's values at sampling.
    pub values: Vec<f32>,
    /// Whitened over the batch (0 where not `valid`).
    pub advantages: Vec<f32>,
    pub returns: Vec<f32>,
}

/// One PPO update on `buffer` (its completions with their sampling and reference log-probabilities,
/// `scores` their rewards): see the [module documentation](self). `completed` updates were done before,
/// of `total`; `generation` seeds the permutations.
pub(crate) fn update(
    trained: &mut Trainable,
    config: &GrpoConfig,
    buffer: &Buffer,
    generation: u64,
    completed: u64,
    total: u64,
    lr_factor: f64,
) -> Result<Outcome, TrainError> {
    let completions = &buffer.completions;
    let critic = trained
        .critic
        .as_ref()
        .expect("a PPO run's Trainable has a value model");
    critic.model.set_dropout_seed(0);
    let mut metrics = BTreeMap::new();
    let (targets, penalties) = targets(critic, config, completions, &buffer.scores, &mut metrics)?;

    let accumulation = config.training.gradient_accumulation_steps;
    let (mut losses, mut norms, mut learning_rate) = (Vec::new(), Vec::new(), 0.0);
    let mut stats: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut micro_index = 0u64;
    for epoch in 0..config.num_ppo_epochs as u64 {
        let mut order: Vec<usize> = (0..completions.len()).collect();
        let seed = mix(mix(mix(config.training.seed ^ PERMUTATION) ^ generation) ^ epoch);
        order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
        for mini in 0..config.num_mini_batches {
            let mini_batch = Buffer::slot(&order, mini, config.num_mini_batches);
            let mut grads = trained.no_grads();
            for micro in 0..accumulation {
                let indices = Buffer::slot(mini_batch, micro, accumulation);
                let dropout = mix(mix(config.training.seed ^ DROPOUT) ^ generation) ^ micro_index;
                micro_index += 1;
                trained.model.set_dropout_seed(mix(dropout) | 1);
                if let Some(critic) = &trained.critic {
                    critic.model.set_dropout_seed(mix(dropout ^ 1) | 1);
                }
                let Some(batch) = micro_batch(completions, &targets, indices) else {
                    continue;
                };
                let critic = trained
                    .critic
                    .as_ref()
                    .expect("a PPO run's Trainable has a value model");
                let step = micro_step(
                    &trained.model,
                    critic,
                    config,
                    trained.router_aux_loss_coef,
                    &batch,
                )?;
                trained.accumulate(&mut grads, &step.policy_grads)?;
                trained.accumulate(&mut grads, &step.value_grads)?;
                losses.push(step.loss);
                for (name, value) in step.stats {
                    stats.entry(name).or_default().push(value);
                }
            }
            let (norm, rate) = trained.step(&grads, config, completed, total, lr_factor)?;
            norms.push(norm);
            learning_rate = rate;
        }
    }
    let mean = |values: &[f64]| super::advantages::nanmean(values.iter().copied());
    for (name, values) in &stats {
        metrics.insert(name.to_string(), mean(values));
    }
    if let Some(ratios) = stats.get("val/ratio") {
        metrics.insert("val/ratio_var".into(), variance(ratios));
    }
    metrics.insert("ppo/missing_eos_penalized".into(), penalties as f64);
    Ok(Outcome {
        loss: mean(&losses),
        grad_norm: mean(&norms),
        learning_rate,
        metrics,
    })
}

/// Each completion's values, per-token rewards, advantages and returns (steps 4–6 of TRL's update),
/// from its sampling and reference log-probabilities and its reward in `scores`; the `objective/*`
/// metrics go to `metrics`. Also returns how many rewards `missing_eos_penalty` lowered.
pub fn targets(
    critic: &Critic,
    config: &GrpoConfig,
    completions: &[Completion],
    scores: &[f32],
    metrics: &mut BTreeMap<String, f64>,
) -> Result<(Vec<Targets>, usize), TrainError> {
    let sequences: Vec<&Sequence> = score::sequences(completions);
    let mut per_sequence = critic
        .values(&sequences, config.training.per_device_train_batch_size)?
        .into_iter();
    let mut penalties = 0;
    let (mut rewards, mut kls, mut all_values, mut valid) = (vec![], vec![], vec![], vec![]);
    let (mut scores_used, mut non_scores, mut entropies) = (vec![], vec![], vec![]);
    for (completion, &score) in completions.iter().zip(scores) {
        let values: Vec<f32> = per_sequence
            .by_ref()
            .take(completion.sequences.len())
            .flatten()
            .collect();
        let old = completion
            .old_logprobs
            .as_ref()
            .expect("PPO computes the sampling policy's log-probabilities");
        let kl = completion
            .ref_logprobs
            .as_ref()
            .map(|reference| gae::kl(old, reference, config.kl_estimator));
        // A rollout without any reward (it failed) scores 0; its tokens are masked anyway.
        let mut score = if score.is_nan() { 0.0 } else { score };
        if let (Some(penalty), true) = (config.missing_eos_penalty, completion.truncated) {
            score -= penalty as f32;
            penalties += 1;
        }
        let (row, non_score) = gae::token_rewards(
            score,
            kl.as_deref(),
            config.kl_coef as f32,
            completion.len(),
        );
        let is_valid = completion.mask > 0.0 && !completion.is_empty();
        if is_valid {
            scores_used.push(score as f64);
            non_scores.push(non_score.iter().map(|&x| x as f64).sum::<f64>());
            entropies.push(old.iter().map(|&x| -x as f64).sum::<f64>());
        }
        rewards.push(row);
        kls.push(kl.unwrap_or_default());
        all_values.push(values);
        valid.push(is_valid);
    }
    if config.whiten_rewards {
        gae::whiten(&mut rewards, &valid, false);
    }
    let (mut advantages, returns): (Vec<_>, Vec<_>) = rewards
        .iter()
        .zip(&all_values)
        .map(|(rewards, values)| gae::gae(rewards, values, config.gamma, config.lam))
        .unzip();
    gae::whiten(&mut advantages, &valid, true);
    let targets = all_values
        .into_iter()
        .zip(advantages)
        .zip(returns)
        .zip(&valid)
        .map(|(((values, advantages), returns), &valid)| Targets {
            valid,
            values,
            advantages,
            returns,
        })
        .collect();
    let mean = |values: &[f64]| super::advantages::nanmean(values.iter().copied());
    let valid_kls: Vec<&Vec<f32>> = kls
        .iter()
        .zip(&valid)
        .filter(|(_, &v)| v)
        .map(|(k, _)| k)
        .collect();
    if completions.iter().any(|c| c.ref_logprobs.is_some()) {
        let sums: Vec<f64> = valid_kls
            .iter()
            .map(|kl| kl.iter().map(|&x| x as f64).sum())
            .collect();
        metrics.insert("objective/kl".into(), mean(&sums));
        let tokens: Vec<f64> = valid_kls
            .iter()
            .flat_map(|kl| kl.iter().map(|&x| x as f64))
            .collect();
        metrics.insert("kl".into(), mean(&tokens));
    }
    metrics.insert("objective/entropy".into(), mean(&entropies));
    metrics.insert("objective/non_score_reward".into(), mean(&non_scores));
    metrics.insert("objective/scores".into(), mean(&scores_used));
    metrics.insert(
        "objective/rlhf_reward".into(),
        mean(&non_scores) + mean(&scores_used),
    );
    Ok((targets, penalties))
}

/// One micro-batch as PPO's losses see it: its sequences and, for each of their trained tokens in
/// order, the log-probability and value at sampling, the advantage, the return, and 1 (trained) or 0.
pub struct MicroBatch<'a> {
    pub sequences: Vec<&'a Sequence>,
    pub old_logprobs: Vec<f32>,
    pub values: Vec<f32>,
    pub advantages: Vec<f32>,
    pub returns: Vec<f32>,
    pub mask: Vec<f32>,
}

/// One micro-batch's gradients and statistics.
pub struct MicroStep {
    /// `pg_loss + vf_coef · vf_loss`, before the division for accumulation.
    pub loss: f64,
    pub policy_grads: candle_core::backprop::GradStore,
    pub value_grads: candle_core::backprop::GradStore,
    /// TRL's names: `loss/policy_avg`, `loss/value_avg`, `policy/clipfrac_avg`, `val/clipfrac_avg`,
    /// `policy/approxkl_avg`, `policy/entropy_avg`, `val/ratio`.
    pub stats: Vec<(&'static str, f64)>,
}

/// The gradients of `(pg_loss + vf_coef · vf_loss) / gradient_accumulation_steps` of `batch` for the
/// policy `model` and the value model `critic` (two backward passes: the two losses share no weight),
/// the policy's with a mixture-of-experts model's load-balancing loss times `router_aux_loss_coef`.
pub fn micro_step(
    model: &Model,
    critic: &Critic,
    config: &GrpoConfig,
    router_aux_loss_coef: f64,
    batch: &MicroBatch<'_>,
) -> candle_core::Result<MicroStep> {
    let device = model.device();
    // In the losses' type (f32 over a bf16 model), as the log-probabilities and values are.
    let tensor = |values: &[f32]| Tensor::new(values, device)?.to_dtype(model.logits_dtype());
    let old_logprobs = tensor(&batch.old_logprobs)?;
    let advantages = tensor(&batch.advantages)?;
    let returns = tensor(&batch.returns)?;
    let old_values = tensor(&batch.values)?;
    let mask = tensor(&batch.mask)?;
    let scalar = |tensor: &Tensor| -> candle_core::Result<f64> {
        tensor.to_dtype(DType::F64)?.to_scalar::<f64>()
    };
    let scale = 1.0 / config.training.gradient_accumulation_steps as f64;
    let mut stats = Vec::new();
    let pass = score::Pass {
        recompute: config.gradient_checkpointing,
        entropy_gradient: false,
        balance: router_aux_loss_coef * scale,
    };
    let (policy_value, policy_grads) =
        score::backward_sequences(model, &batch.sequences, config.temperature, pass, |head| {
            let policy = loss::policy_loss(
                &head.logprobs,
                &old_logprobs,
                &advantages,
                &mask,
                config.cliprange,
            )?;
            stats.extend([
                ("loss/policy_avg", scalar(&policy.loss)?),
                ("policy/clipfrac_avg", policy.clipfrac),
                ("policy/approxkl_avg", policy.approxkl),
                (
                    "policy/entropy_avg",
                    scalar(&loss::masked_mean(&head.entropies, &mask)?)?,
                ),
                ("val/ratio", policy.ratio),
            ]);
            policy.loss * scale
        })?;
    let (value_value, value_grads) =
        critic.backward(&batch.sequences, config.gradient_checkpointing, |values| {
            let value =
                loss::value_loss(values, &old_values, &returns, &mask, config.cliprange_value)?;
            stats.extend([
                ("loss/value_avg", scalar(&value.loss)?),
                ("val/clipfrac_avg", value.clipfrac),
            ]);
            value.loss * (config.vf_coef * scale)
        })?;
    Ok(MicroStep {
        loss: (scalar(&policy_value)? + scalar(&value_value)?) / scale,
        policy_grads,
        value_grads,
        stats,
    })
}

/// The [`MicroBatch`] of the completions at `indices` (those with trained tokens); `None` when none of
/// them is trained.
fn micro_batch<'a>(
    completions: &'a [Completion],
    targets: &[Targets],
    indices: &[usize],
) -> Option<MicroBatch<'a>> {
    let picked: Vec<usize> = indices
        .iter()
        .copied()
        .filter(|&i| !completions[i].is_empty())
        .collect();
    if !picked.iter().any(|&i| targets[i].valid) {
        return None;
    }
    let gather = |field: fn(&Targets) -> &[f32]| -> Vec<f32> {
        picked
            .iter()
            .flat_map(|&i| field(&targets[i]).iter().copied())
            .collect()
    };
    Some(MicroBatch {
        sequences: picked
            .iter()
            .flat_map(|&i| &completions[i].sequences)
            .collect(),
        old_logprobs: picked
            .iter()
            .flat_map(|&i| completions[i].old_logprobs.iter().flatten().copied())
            .collect(),
        values: gather(|t| &t.values),
        advantages: gather(|t| &t.advantages),
        returns: gather(|t| &t.returns),
        mask: picked
            .iter()
            .flat_map(|&i| {
                let trained = if targets[i].valid { 1.0 } else { 0.0 };
                std::iter::repeat_n(trained, completions[i].len())
            })
            .collect(),
    })
}

/// The unbiased variance (torch's `var`), 0 for fewer than 2 values.
fn variance(values: &[f64]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (values.len() - 1) as f64
}
