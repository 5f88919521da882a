//! The GRPO family of losses, as TRL's `GRPOTrainer._compute_loss` computes them, over a micro-batch of
//! [`Completion`]s.
//!
//! Tensors here are flat: one entry per trained token of the micro-batch, completion by completion
//! (`[N]`), or one entry per completion (`[C]`). Where TRL pads completions into `[B, T]` and multiplies
//! by the completion mask, a flat token list holds exactly the trained tokens, and per-completion sums are
//! a product with a `[C, N]` membership matrix; the numbers are the same.
//!
//! Each formula is its own function ([`log_importance_weights`], [`per_token_kl`], [`policy_loss`],
//! [`gamma_weights`], [`aggregate`], …) so that tests can check it alone; [`compute`] puts them together
//! in TRL's order.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};

use super::batch::Completion;
use super::config::{GrpoConfig, ImportanceSamplingLevel, LossType};

pub type Result<T> = candle_core::Result<T>;

/// How the trained tokens of a micro-batch belong to its completions.
pub struct Segments {
    /// `[C, N]`: 1 where token `n` belongs to completion `c`.
    membership: Tensor,
    /// `[N]` (u32): the completion of each token.
    owner: Tensor,
    /// `[N]`: the completion mask of each token's completion (0 or 1).
    pub mask: Tensor,
    /// `[C]`: trained tokens per completion under the mask, at least 1 (`mask.sum(-1).clamp(min=1)`).
    pub counts: Tensor,
    /// `[C]`: the same, possibly 0 (`mask.sum(-1)`).
    raw_counts: Vec<f32>,
    pub completions: usize,
    pub tokens: usize,
}

impl Segments {
    pub fn new(completions: &[Completion], dtype: DType, device: &Device) -> Result<Self> {
        let c = completions.len();
        let n: usize = completions.iter().map(Completion::len).sum();
        let mut membership = vec![0f32; c * n];
        let mut owner = Vec::with_capacity(n);
        let mut mask = Vec::with_capacity(n);
        let mut raw_counts = Vec::with_capacity(c);
        let mut token = 0;
        for (index, completion) in completions.iter().enumerate() {
            for _ in 0..completion.len() {
                membership[index * n + token] = 1.0;
                owner.push(index as u32);
                mask.push(completion.mask);
                token += 1;
            }
            raw_counts.push(completion.mask * completion.len() as f32);
        }
        let counts: Vec<f32> = raw_counts.iter().map(|count| count.max(1.0)).collect();
        Ok(Segments {
            membership: Tensor::from_vec(membership, (c, n), device)?.to_dtype(dtype)?,
            owner: Tensor::from_vec(owner, n, device)?,
            mask: Tensor::from_vec(mask, n, device)?.to_dtype(dtype)?,
            counts: Tensor::from_vec(counts, c, device)?.to_dtype(dtype)?,
            raw_counts,
            completions: c,
            tokens: n,
        })
    }

    /// `[N]` → `[C]`: each completion's sum.
    pub fn sum(&self, tokens: &Tensor) -> Result<Tensor> {
        self.membership.matmul(&tokens.unsqueeze(1)?)?.squeeze(1)
    }

    /// `[C]` → `[N]`: each token gets its completion's value.
    pub fn spread(&self, per_completion: &Tensor) -> Result<Tensor> {
        per_completion.index_select(&self.owner, 0)
    }

    /// Each completion's mean over its masked tokens (`(x · m).sum(-1) / m.sum(-1).clamp(min=1)`).
    pub fn masked_mean(&self, tokens: &Tensor) -> Result<Tensor> {
        self.sum(&(tokens * &self.mask)?)?.div(&self.counts)
    }
}

/// A value per token (`[N]`) or per completion (`[C]`), as TRL's `[B, T]` or `[B, 1]` tensors.
#[derive(Debug, Clone)]
pub enum Level {
    Token(Tensor),
    Sequence(Tensor),
}

impl Level {
    /// Per token, a completion's value repeated over its tokens.
    pub fn tokens(&self, segments: &Segments) -> Result<Tensor> {
        match self {
            Level::Token(tensor) => Ok(tensor.clone()),
            Level::Sequence(tensor) => segments.spread(tensor),
        }
    }

    fn map(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Level> {
        Ok(match self {
            Level::Token(tensor) => Level::Token(f(tensor)?),
            Level::Sequence(tensor) => Level::Sequence(f(tensor)?),
        })
    }

    fn tensor(&self) -> &Tensor {
        match self {
            Level::Token(tensor) | Level::Sequence(tensor) => tensor,
        }
    }

    /// TRL's `global_masked_mean`: over masked tokens, or over completions (unmasked) at sequence level.
    fn global_masked_mean(&self, segments: &Segments) -> Result<f64> {
        match self {
            Level::Token(tensor) => {
                let sum = (tensor * &segments.mask)?.sum_all()?.to_dtype(DType::F64)?;
                let count = segments.mask.sum_all()?.to_dtype(DType::F64)?;
                Ok(sum.to_scalar::<f64>()? / count.to_scalar::<f64>()?.max(1.0))
            }
            Level::Sequence(tensor) => {
                let sum = tensor.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                Ok(sum / (segments.completions as f64).max(1.0))
            }
        }
    }

    /// TRL's `masked_seq_mean`: one value per completion (`NaN` for a completion with no masked token).
    fn masked_seq_mean(&self, segments: &Segments) -> Result<Vec<f64>> {
        match self {
            Level::Token(tensor) => {
                let sums = segments.sum(&(tensor * &segments.mask)?)?;
                let sums = sums.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                Ok(sums
                    .iter()
                    .zip(&segments.raw_counts)
                    .map(|(sum, &count)| sum / count as f64)
                    .collect())
            }
            Level::Sequence(tensor) => tensor.to_dtype(DType::F64)?.to_vec1::<f64>(),
        }
    }
}

/// `log π_θ − log π_old` per token, or its masked mean per completion (GSPO).
pub fn log_importance_weights(
    log_ratio: &Tensor,
    level: ImportanceSamplingLevel,
    segments: &Segments,
) -> Result<Level> {
    match level {
        ImportanceSamplingLevel::Token => Ok(Level::Token(log_ratio.clone())),
        ImportanceSamplingLevel::Sequence => Ok(Level::Sequence(segments.masked_mean(log_ratio)?)),
    }
}

/// The k3 estimator of KL(π_θ ‖ π_ref) per token: `exp(ref − ℓ) − (ref − ℓ) − 1`.
pub fn per_token_kl(logprobs: &Tensor, reference: &Tensor) -> Result<Tensor> {
    let difference = (reference - logprobs)?;
    (difference.exp()? - difference)? - 1.0
}

/// The policy term of each loss type before masking (`per_token_loss` in TRL), with `coef_1` as TRL
/// leaves it for the clip metrics (capped by `delta` when set). `log_ratio` is `log π_θ − log π_old`
/// per token (for `dppo`, to the sampler's log-probabilities).
pub fn policy_loss(
    config: &GrpoConfig,
    coef_1: &Level,
    advantages: &Level,
    (logprobs, log_ratio): (&Tensor, &Tensor),
    phi: Option<&Tensor>,
    segments: &Segments,
) -> Result<(Level, Level)> {
    let (low, high) = (config.epsilon, config.epsilon_high());
    let advantage_tokens = advantages.tokens(segments)?;
    match config.loss_type {
        LossType::Cispo => {
            let clamped = coef_1.tensor().clamp(f64::NEG_INFINITY, high)?.detach();
            let clamped = match coef_1 {
                Level::Token(_) => clamped,
                Level::Sequence(_) => segments.spread(&clamped)?,
            };
            let loss = (clamped * advantage_tokens)?.mul(logprobs)?.neg()?;
            Ok((Level::Token(loss), coef_1.clone()))
        }
        LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo | LossType::Luspo => {
            let coef_2 = coef_1.map(|coef| coef.clamp(1.0 - low, 1.0 + high))?;
            let coef_1 = match config.delta {
                Some(delta) => coef_1.map(|coef| coef.clamp(f64::NEG_INFINITY, delta))?,
                None => coef_1.clone(),
            };
            let advantage = match coef_1 {
                Level::Token(_) => advantage_tokens,
                Level::Sequence(_) => advantages.tensor().clone(),
            };
            let unclipped = (coef_1.tensor() * &advantage)?;
            let clipped = (coef_2.tensor() * &advantage)?;
            let loss = unclipped.minimum(&clipped)?.neg()?;
            let loss = match coef_1 {
                Level::Token(_) => Level::Token(loss),
                Level::Sequence(_) => Level::Sequence(loss),
            };
            Ok((loss, coef_1))
        }
        LossType::Sapo => {
            let advantage = match coef_1 {
                Level::Token(_) => advantage_tokens,
                Level::Sequence(_) => advantages.tensor().clone(),
            };
            let positive = advantage.gt(0.0)?;
            let temperature = positive.where_cond(
                &advantage
                    .ones_like()?
                    .affine(config.sapo_temperature_pos, 0.0)?,
                &advantage
                    .ones_like()?
                    .affine(config.sapo_temperature_neg, 0.0)?,
            )?;
            let gate = candle_nn::ops::sigmoid(&((coef_1.tensor() - 1.0)? * &temperature)?)?;
            let soft = ((gate * 4.0)? / temperature)?;
            let loss = (soft * advantage)?.neg()?;
            let loss = match coef_1 {
                Level::Token(_) => Level::Token(loss),
                Level::Sequence(_) => Level::Sequence(loss),
            };
            Ok((loss, coef_1.clone()))
        }
        LossType::Vespo => {
            let phi = phi.expect("vespo needs its gamma weights");
            let loss = (segments.spread(phi)? * advantage_tokens)?
                .mul(logprobs)?
                .neg()?;
            Ok((Level::Token(loss), coef_1.clone()))
        }
        LossType::Dppo => {
            let loss = dppo_loss(config, log_ratio, logprobs, &advantage_tokens)?;
            Ok((Level::Token(loss), coef_1.clone()))
        }
    }
}

/// VESPO's gamma weights per completion, without gradient: `φ(w) = exp(λ + k log w − λ w)` of the
/// sequence importance weight `w` (TRL's `get_gamma_weights`).
pub fn gamma_weights(
    config: &GrpoConfig,
    advantages: &[f32],
    log_ratio: &Tensor,
    is_ratio: Option<&Tensor>,
    segments: &Segments,
) -> Result<Tensor> {
    let lower = (1e-8f64).ln();
    let clamped = log_ratio.detach().clamp(-20.0, 20.0)?;
    let mut sequence = segments.sum(&(clamped * &segments.mask)?)?;
    if let Some(ratio) = is_ratio {
        let log_is = ratio.log()?.clamp(lower, 20.0)?;
        sequence = (sequence + segments.sum(&log_is)?)?;
    }
    // In f32, as TRL computes it: φ magnifies rounding, and parity wants the same rounding.
    let log_w = sequence
        .clamp(lower, 20.0)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    let phi: Vec<f32> = log_w
        .iter()
        .zip(advantages)
        .map(|(&log_w, &advantage)| {
            let (k, lambda) = if advantage >= 0.0 {
                (config.vespo_k_pos, config.vespo_lambda_pos)
            } else {
                (config.vespo_k_neg, config.vespo_lambda_neg)
            };
            let (k, lambda) = (k as f32, lambda.max(1e-4) as f32);
            let phi = (lambda + k * log_w - lambda * log_w.exp()).exp();
            if phi.is_finite() {
                phi
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(phi, segments.completions, log_ratio.device())?.to_dtype(log_ratio.dtype())
}

/// Off-policy sequence masking (DeepSeek-V3.2): 1 for a completion to keep (advantage ≥ 0, or mean KL
/// to the sampler ≤ `threshold`), 0 to drop; `[C]`.
pub fn off_policy_mask(
    advantages: &[f32],
    logprobs: &Tensor,
    sampling: &Tensor,
    threshold: f64,
    segments: &Segments,
) -> Result<Tensor> {
    let divergence = (sampling - logprobs.detach())?;
    // Tokens the sampler could not score (NaN) give no evidence.
    let divergence = divergence
        .ne(&divergence)?
        .where_cond(&divergence.zeros_like()?, &divergence)?;
    let mean = segments
        .masked_mean(&divergence)?
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()?;
    let keep: Vec<f32> = mean
        .iter()
        .zip(advantages)
        .map(|(&kl, &advantage)| f32::from(advantage >= 0.0 || kl <= threshold))
        .collect();
    Tensor::from_vec(keep, segments.completions, logprobs.device())?.to_dtype(logprobs.dtype())
}

/// prime-rl's trust region for `loss_type = "dppo"` (its DPPO-binary-TV mask), per token, from
/// `log_ratio` = `log π_θ − log π_sampler` and the policy's `logprobs`: 1 where the token's probability
/// moved past it in the direction its advantage pushes (`π_θ − π_sampler > dppo_mask_high` for
/// `A > 0`, `< −dppo_mask_low` otherwise), then the flags of each side alone (rose with `A > 0`, fell
/// with `A < 0`).
pub fn dppo_mask(
    config: &GrpoConfig,
    log_ratio: &Tensor,
    logprobs: &Tensor,
    advantages: &Tensor,
) -> Result<[Tensor; 3]> {
    let sampler = (logprobs - log_ratio)?.detach();
    let difference = (logprobs.detach().exp()? - sampler.exp()?)?;
    let positive = advantages.gt(0.0)?;
    let high = difference.gt(config.dppo_mask_high)?;
    let low = difference.lt(-config.dppo_mask_low)?;
    let dtype = log_ratio.dtype();
    Ok([
        positive.where_cond(&high, &low)?.to_dtype(dtype)?,
        positive.mul(&high)?.to_dtype(dtype)?,
        advantages.lt(0.0)?.mul(&low)?.to_dtype(dtype)?,
    ])
}

/// prime-rl's default loss per token (`default_loss_fn`: the [`dppo_mask`] trust region and Kimi
/// K2.5's penalty): `−keep · adv_tau · A · exp(log_ratio) + kl_tau · log_ratio²`, `keep` being 0 where
/// the mask leaves the token out of the policy term.
pub fn dppo_loss(
    config: &GrpoConfig,
    log_ratio: &Tensor,
    logprobs: &Tensor,
    advantages: &Tensor,
) -> Result<Tensor> {
    let [masked, _, _] = dppo_mask(config, log_ratio, logprobs, advantages)?;
    let policy = ((1.0 - masked)? * advantages)?
        .affine(config.adv_tau, 0.0)?
        .mul(&log_ratio.exp()?)?;
    log_ratio.sqr()?.affine(config.kl_tau, 0.0)? - policy
}

/// The tokens whose entropy is at least the `quantile` of the masked tokens' entropies (linear
/// interpolation, as `torch.quantile`); `[N]` of 0/1, 0 on masked tokens.
pub fn high_entropy_mask(entropies: &[f32], mask: &[f32], quantile: f64) -> Vec<f32> {
    let mut kept: Vec<f32> = entropies
        .iter()
        .zip(mask)
        .filter(|(_, &m)| m != 0.0)
        .map(|(&entropy, _)| entropy)
        .collect();
    if kept.is_empty() {
        return vec![0.0; entropies.len()];
    }
    kept.sort_by(f32::total_cmp);
    let position = quantile * (kept.len() - 1) as f64;
    let below = position.floor() as usize;
    let above = position.ceil() as usize;
    let fraction = (position - below as f64) as f32;
    let threshold = kept[below] + (kept[above] - kept[below]) * fraction;
    entropies
        .iter()
        .zip(mask)
        .map(|(&entropy, &m)| f32::from(m != 0.0 && entropy * m >= threshold))
        .collect()
}

/// Reduces the masked token losses to the micro-batch's loss, by `loss_type` (before the division by the
/// gradient-accumulation steps, which [`compute`] applies). `num_items_in_batch` is the trained tokens
/// of the whole generation batch (`dapo`, `cispo`, `vespo`).
pub fn aggregate(
    config: &GrpoConfig,
    per_token: &Tensor,
    segments: &Segments,
    num_items_in_batch: f64,
) -> Result<Tensor> {
    let masked = (per_token * &segments.mask)?;
    let completions = segments.completions.max(1) as f64;
    match config.loss_type {
        LossType::Grpo | LossType::Sapo => {
            (segments.sum(&masked)? / &segments.counts)?.sum_all()? / completions
        }
        LossType::Bnpo => {
            let count = segments
                .mask
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            masked.sum_all()? / count.max(1.0)
        }
        LossType::DrGrpo => masked.sum_all()? / (completions * config.max_completion_length as f64),
        LossType::Dapo | LossType::Cispo | LossType::Vespo | LossType::Dppo => {
            // TRL rescales the generation batch's token count to one accumulation window.
            let normalizer = num_items_in_batch.max(1.0)
                * config.training.gradient_accumulation_steps as f64
                / config.steps_per_generation() as f64;
            masked.sum_all()? / normalizer
        }
        LossType::Luspo => segments.sum(&masked)?.sum_all()? / completions,
    }
}

/// Why `config`'s loss cannot take advantages that vary from token to token
/// ([`Completion::token_advantages`]), or `None` when it can. The token-level policy terms (`grpo`,
/// `bnpo`, `dr_grpo`, `dapo`, `luspo`, `cispo`, `sapo` with token-level ratios) weigh each token's ratio
/// by an advantage, so a per-token one slots in; the options below need one advantage per sequence.
pub fn per_token_advantages_refused(config: &GrpoConfig) -> Option<String> {
    if config.importance_sampling_level == ImportanceSamplingLevel::Sequence {
        return Some(
            "`importance_sampling_level = \"sequence\"` (GSPO) weighs one ratio per sequence by one advantage per sequence".into(),
        );
    }
    if config.loss_type == LossType::Vespo {
        return Some(
            "`loss_type = \"vespo\"` picks each sequence's gamma weights by the sign of its one advantage".into(),
        );
    }
    if config.off_policy_mask_threshold.is_some() {
        return Some(
            "`off_policy_mask_threshold` keeps or drops a whole sequence by the sign of its one advantage".into(),
        );
    }
    None
}

/// The loss of a micro-batch and the metrics TRL logs for it.
pub struct Loss {
    /// Divided by the accumulation steps where TRL divides it: call `backward` on it.
    pub loss: Tensor,
    pub metrics: BTreeMap<String, f64>,
}

/// What [`compute`] needs besides the model's log-probabilities.
pub struct Inputs<'a> {
    pub completions: &'a [Completion],
    /// The trained tokens of the whole generation batch, under the completion mask.
    pub num_items_in_batch: f64,
    /// Whether `is_ratio` corrects for the sampler (TRL: `use_vllm and vllm_importance_sampling_correction`).
    pub sampler_correction: bool,
}

/// TRL's `_compute_loss` over one micro-batch: `logprobs` `[N]` are the policy's log-probabilities of the
/// trained tokens (differentiable), `entropy` `[N]` their distributions' entropies (differentiable when
/// `entropy_coef` is not 0: the entropy bonus).
pub fn compute(
    config: &GrpoConfig,
    inputs: &Inputs<'_>,
    logprobs: &Tensor,
    entropy: &Tensor,
) -> Result<Loss> {
    let entropies: Vec<f32> = entropy.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let entropies = entropies.as_slice();
    let (dtype, device) = (logprobs.dtype(), logprobs.device().clone());
    let segments = Segments::new(inputs.completions, dtype, &device)?;
    let per_token = |values: Vec<f32>| -> Result<Tensor> {
        Tensor::from_vec(values, segments.tokens, &device)?.to_dtype(dtype)
    };
    let gather = |pick: &dyn Fn(&Completion) -> Option<&Vec<f32>>| -> Option<Vec<f32>> {
        let mut values = Vec::with_capacity(segments.tokens);
        for completion in inputs.completions {
            values.extend_from_slice(pick(completion)?);
        }
        Some(values)
    };

    let advantage_values: Vec<f32> = inputs.completions.iter().map(|c| c.advantage).collect();
    let advantages = if inputs
        .completions
        .iter()
        .any(|c| c.token_advantages.is_some())
    {
        if let Some(refusal) = per_token_advantages_refused(config) {
            candle_core::bail!("per-token advantages: {refusal}");
        }
        let mut values = Vec::with_capacity(segments.tokens);
        for (index, completion) in inputs.completions.iter().enumerate() {
            match &completion.token_advantages {
                Some(tokens) if tokens.len() == completion.len() => {
                    values.extend_from_slice(tokens)
                }
                Some(tokens) => candle_core::bail!(
                    "completion {index}: {} per-token advantages for {} trained tokens",
                    tokens.len(),
                    completion.len()
                ),
                None => values.extend(std::iter::repeat_n(completion.advantage, completion.len())),
            }
        }
        Level::Token(per_token(values)?)
    } else {
        Level::Sequence(
            Tensor::from_vec(advantage_values.clone(), segments.completions, &device)?
                .to_dtype(dtype)?,
        )
    };
    let mask_values: Vec<f32> = segments.mask.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let entropy_mask = (config.top_entropy_quantile < 1.0)
        .then(|| high_entropy_mask(entropies, &mask_values, 1.0 - config.top_entropy_quantile));

    let old = if config.loss_type == LossType::Dppo {
        // prime-rl's ratio is to the sampler's own log-probabilities, whatever else scored the tokens.
        // A token the sampler gave none (`NaN`: the Holophore also writes a certain token's 0 as none,
        // a grammar's forced token) is taken as on-policy, its ratio 1, as TRL's correction takes it.
        let sampling = per_token(
            inputs
                .completions
                .iter()
                .flat_map(Completion::sampling_logprobs)
                .collect(),
        )?;
        sampling
            .ne(&sampling)?
            .where_cond(&logprobs.detach(), &sampling)?
    } else {
        match gather(&|c| c.old_logprobs.as_ref()) {
            Some(old) => per_token(old)?,
            None => logprobs.detach(),
        }
    };
    let log_ratio = (logprobs - &old)?;
    let log_weights =
        log_importance_weights(&log_ratio, config.importance_sampling_level, &segments)?;
    let coef_1 = log_weights.map(|weights| weights.exp())?;

    let is_ratio = if inputs.sampler_correction && config.loss_type != LossType::Dppo {
        inputs
            .completions
            .iter()
            .map(|c| c.is_ratio.clone())
            .collect::<Option<Vec<Vec<f32>>>>()
            .map(|ratios| ratios.concat())
    } else {
        None
    };
    let is_ratio = match is_ratio {
        Some(values) if values.len() == segments.tokens => Some(Level::Token(per_token(values)?)),
        Some(values) if values.len() == segments.completions => Some(Level::Sequence(
            Tensor::from_vec(values, segments.completions, &device)?.to_dtype(dtype)?,
        )),
        Some(values) => candle_core::bail!(
            "{} importance-sampling ratios for {} tokens of {} completions",
            values.len(),
            segments.tokens,
            segments.completions
        ),
        None => None,
    };

    let kl = if config.beta != 0.0 {
        let Some(reference) = gather(&|c| c.ref_logprobs.as_ref()) else {
            candle_core::bail!(
                "beta > 0 needs the reference log-probabilities of every completion"
            );
        };
        let kl = per_token_kl(logprobs, &per_token(reference)?)?;
        Some(if config.use_bias_correction_kl {
            (kl * coef_1.tokens(&segments)?)?
        } else {
            kl
        })
    } else {
        None
    };

    let phi = match config.loss_type {
        LossType::Vespo => {
            let token_ratio = match &is_ratio {
                Some(Level::Token(ratio)) => Some(ratio),
                _ => None,
            };
            Some(gamma_weights(
                config,
                &advantage_values,
                &log_ratio,
                token_ratio,
                &segments,
            )?)
        }
        _ => None,
    };
    let (loss, coef_1) = policy_loss(
        config,
        &coef_1,
        &advantages,
        (logprobs, &log_ratio),
        phi.as_ref(),
        &segments,
    )?;
    let mut per_token_loss = loss.tokens(&segments)?;
    if let Some(threshold) = config.off_policy_mask_threshold {
        // TRL measures the distance to the sampler's log-probabilities when it has them, else to the old ones.
        let sampling = if inputs.sampler_correction {
            per_token(
                inputs
                    .completions
                    .iter()
                    .flat_map(Completion::sampling_logprobs)
                    .collect(),
            )?
        } else {
            old.clone()
        };
        let keep = off_policy_mask(&advantage_values, logprobs, &sampling, threshold, &segments)?;
        per_token_loss = (per_token_loss * segments.spread(&keep)?)?;
    }
    if let Some(mask) = &entropy_mask {
        per_token_loss = (per_token_loss * per_token(mask.clone())?)?;
    }
    if let Some(ratio) = &is_ratio {
        if config.loss_type != LossType::Vespo {
            per_token_loss = (per_token_loss * ratio.tokens(&segments)?)?;
        }
    }
    if let Some(kl) = &kl {
        per_token_loss = (per_token_loss + (kl * config.beta)?)?;
    }

    let policy = aggregate(
        config,
        &per_token_loss,
        &segments,
        inputs.num_items_in_batch,
    )?;
    let mut loss = match config.loss_type {
        LossType::Dapo | LossType::Cispo | LossType::Vespo | LossType::Dppo => policy,
        _ => (policy / config.training.gradient_accumulation_steps as f64)?,
    };

    let mut metrics = BTreeMap::new();
    if config.entropy_coef != 0.0 {
        // The bonus is the mean entropy of the tokens the policy term acts on, whatever the loss type's
        // normalization, scaled only for accumulation.
        let effective = match &entropy_mask {
            Some(mask) => (&segments.mask * per_token(mask.clone())?)?,
            None => segments.mask.clone(),
        };
        let count = effective
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?
            .max(1.0);
        let bonus = ((entropy * &effective)?.sum_all()? / count)?
            / config.training.gradient_accumulation_steps as f64;
        let policy_loss = loss.detach().to_dtype(DType::F64)?.to_scalar::<f64>()?;
        metrics.insert("policy_loss".to_string(), policy_loss);
        metrics.insert("entropy_coef".to_string(), config.entropy_coef);
        loss = (loss - (bonus? * config.entropy_coef)?)?;
    }
    if let Some(kl) = &kl {
        metrics.insert(
            "kl".to_string(),
            Level::Token(kl.detach()).global_masked_mean(&segments)?,
        );
    }
    let entropy = Level::Token(per_token(entropies.to_vec())?);
    metrics.insert("entropy".into(), entropy.global_masked_mean(&segments)?);
    let coef_1 = coef_1.map(|coef| Ok(coef.detach()))?;
    match config.loss_type {
        LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo | LossType::Luspo => {
            let advantage = match coef_1 {
                Level::Token(_) => advantages.tokens(&segments)?,
                Level::Sequence(_) => advantages.tensor().clone(),
            };
            let low = coef_1
                .map(|coef| coef.lt(1.0 - config.epsilon))?
                .map(|below| below.mul(&advantage.lt(0.0)?))?
                .map(|flag| flag.to_dtype(dtype))?;
            let high = coef_1
                .map(|coef| coef.gt(1.0 + config.epsilon_high()))?
                .map(|above| above.mul(&advantage.gt(0.0)?))?
                .map(|flag| flag.to_dtype(dtype))?;
            let region = low.map(|low| {
                let high = high.tensor();
                (low + high)?.clamp(0.0, 1.0)
            })?;
            metrics.insert(
                "clip_ratio/low_mean".into(),
                low.global_masked_mean(&segments)?,
            );
            metrics.insert(
                "clip_ratio/high_mean".into(),
                high.global_masked_mean(&segments)?,
            );
            metrics.insert(
                "clip_ratio/region_mean".into(),
                region.global_masked_mean(&segments)?,
            );
            let nan_fold = |values: Vec<f64>, pick: fn(f64, f64) -> f64| {
                values
                    .into_iter()
                    .filter(|value| !value.is_nan())
                    .reduce(pick)
                    .unwrap_or(f64::NAN)
            };
            metrics.insert(
                "clip_ratio/low_min".into(),
                nan_fold(low.masked_seq_mean(&segments)?, f64::min),
            );
            metrics.insert(
                "clip_ratio/high_max".into(),
                nan_fold(high.masked_seq_mean(&segments)?, f64::max),
            );
        }
        LossType::Cispo => {
            let advantage = match coef_1 {
                Level::Token(_) => advantages.tokens(&segments)?,
                Level::Sequence(_) => advantages.tensor().clone(),
            };
            let clipped = coef_1
                .map(|coef| coef.gt(config.epsilon_high()))?
                .map(|above| above.mul(&advantage.gt(0.0)?))?
                .map(|flag| flag.to_dtype(dtype))?;
            metrics.insert(
                "cispo_clip_ratio".into(),
                clipped.global_masked_mean(&segments)?,
            );
        }
        LossType::Vespo => {
            let phi = phi.expect("computed above");
            metrics.insert(
                "vespo/phi_seq_mean".into(),
                Level::Sequence(phi).global_masked_mean(&segments)?,
            );
        }
        LossType::Dppo => {
            let [masked, rose, fell] =
                dppo_mask(config, &log_ratio, logprobs, &advantages.tokens(&segments)?)?;
            let log_ratio = log_ratio.detach();
            // The sampler-trainer mismatch (k3) over the tokens left out and over those kept.
            let mismatch = ((log_ratio.exp()? - &log_ratio)? - 1.0)?;
            let kept = (1.0 - &masked)?;
            let over = |tokens: &Tensor| -> Result<f64> {
                let weights = (tokens * &segments.mask)?;
                let count = weights
                    .sum_all()?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?;
                let sum = (&mismatch * weights)?
                    .sum_all()?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?;
                Ok(sum / count.max(1.0))
            };
            metrics.insert("dppo/masked_mismatch_kl".into(), over(&masked)?);
            metrics.insert("dppo/unmasked_mismatch_kl".into(), over(&kept)?);
            for (key, flags) in [
                ("dppo/is_masked", masked),
                ("dppo/is_masked_high", rose),
                ("dppo/is_masked_low", fell),
            ] {
                metrics.insert(
                    key.into(),
                    Level::Token(flags).global_masked_mean(&segments)?,
                );
            }
        }
        LossType::Sapo => {}
    }
    Ok(Loss { loss, metrics })
}

#[cfg(test)]
mod tests {
    use candle_core::Var;

    use super::*;
    use crate::batch::Sequence;
    use crate::TrainingArguments;

    fn completion(trained: usize, advantage: f32, tokens: Option<Vec<f32>>) -> Completion {
        Completion {
            sequences: vec![Sequence {
                ids: vec![1; trained + 1],
                trained: (1..=trained).collect(),
                sampling_logprobs: vec![f32::NAN; trained],
                routes: None,
                constraints: Default::default(),
            }],
            advantage,
            token_advantages: tokens,
            mask: 1.0,
            truncated: false,
            old_logprobs: Some(vec![-1.0; trained]),
            ref_logprobs: None,
            is_ratio: None,
            second_loss: false,
        }
    }

    /// The loss and its gradient with respect to the log-probabilities of `logprobs`' tokens.
    fn loss_and_gradient(
        config: &GrpoConfig,
        completions: &[Completion],
        logprobs: &[f32],
    ) -> Result<(f32, Vec<f32>)> {
        let var = Var::new(logprobs, &Device::Cpu)?;
        let entropy = Tensor::zeros(logprobs.len(), DType::F32, &Device::Cpu)?;
        let inputs = Inputs {
            completions,
            num_items_in_batch: logprobs.len() as f64,
            sampler_correction: false,
        };
        let loss = compute(config, &inputs, var.as_tensor(), &entropy)?.loss;
        let gradient = loss.backward()?.get(&var).expect("a gradient").to_vec1()?;
        Ok((loss.to_scalar()?, gradient))
    }

    #[test]
    fn per_token_advantages_weigh_each_token_by_its_own_advantage() {
        let config = GrpoConfig {
            training: TrainingArguments {
                gradient_accumulation_steps: 1,
                ..GrpoConfig::default().training
            },
            loss_type: LossType::Grpo,
            ..GrpoConfig::default()
        };
        // Completion 0: per-token advantages 1 and −2, ratios 1.1 (inside the clip range) and 0.5
        // (below it, with a negative advantage: clipped). Completion 1: one advantage, 0.5, ratio 1.
        let completions = [
            completion(2, 9.0, Some(vec![1.0, -2.0])),
            completion(3, 0.5, None),
        ];
        let logprobs = [-1.0 + 1.1f32.ln(), -1.0 + 0.5f32.ln(), -1.0, -1.0, -1.0];
        let (loss, gradient) = loss_and_gradient(&config, &completions, &logprobs).unwrap();
        // Per token: −min(ρA, clip(ρ, 0.8, 1.2)A) = −1.1, −min(−1, −1.6) = 1.6; −0.5 three times.
        // grpo: the mean over completions of each one's token mean.
        let expected = ((-1.1 + 1.6) / 2.0 + (-0.5 * 3.0) / 3.0) / 2.0;
        assert!((loss - expected).abs() < 1e-6, "{loss} vs {expected}");
        // d/dℓ of −ρA is −ρA (ρ = exp(ℓ − ℓ_old)), over 2 tokens and 2 completions; the clipped token
        // has none; completion 1's tokens get −0.5 / 3 / 2 each.
        let expected = [-1.1 / 4.0, 0.0, -1.0 / 12.0, -1.0 / 12.0, -1.0 / 12.0];
        for (got, want) in gradient.iter().zip(expected) {
            assert!((got - want).abs() < 1e-6, "{gradient:?} vs {expected:?}");
        }
    }

    #[test]
    fn losses_that_need_one_advantage_per_sequence_refuse_per_token_ones() {
        let completions = [completion(2, 0.0, Some(vec![1.0, 0.0]))];
        let cases = [
            (
                GrpoConfig {
                    importance_sampling_level: ImportanceSamplingLevel::Sequence,
                    ..GrpoConfig::default()
                },
                "importance_sampling_level",
            ),
            (
                GrpoConfig {
                    loss_type: LossType::Vespo,
                    ..GrpoConfig::default()
                },
                "vespo",
            ),
            (
                GrpoConfig {
                    off_policy_mask_threshold: Some(0.5),
                    ..GrpoConfig::default()
                },
                "off_policy_mask_threshold",
            ),
        ];
        for (config, named) in cases {
            let error = loss_and_gradient(&config, &completions, &[-1.0, -1.0])
                .unwrap_err()
                .to_string();
            assert!(
                error.contains("per-token advantages") && error.contains(named),
                "{error}"
            );
        }
        let mut short = completions[0].clone();
        short.token_advantages = Some(vec![1.0]);
        let error = loss_and_gradient(&GrpoConfig::default(), &[short], &[-1.0, -1.0])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("completion 0: 1 per-token advantages for 2 trained tokens"),
            "{error}"
        );
    }
}
