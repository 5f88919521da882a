//! Experiential RL (`erl = true`): how the rollouts of an ERL holoware (`hol/erl.hol`) become the step's
//! completions, advantages and internalized sequences.
//!
//! A rollout has up to three trained contexts, in order: the first attempt `y1`, scored by the reward
//! component `erl_first_reward` (`r1`); and, when its gate let it retry, the reflection `Δ` and the second
//! attempt `y2`, both scored by `erl_second_reward` (`r2`). Each context is a completion of its own.
//!
//! - **`erl_algorithm = 1`** (one joint GRPO update): a row's first attempts and its second attempts form
//!   one group: `A = (r − mean) / (std + 1e-4)` over the `G` values of `r1` and the `r2` of the rollouts
//!   that retried (`scale_rewards = batch` takes the standard deviation over the whole batch, `none`
//!   divides by nothing). `y1` gets its `r1`'s advantage, `Δ` and `y2` their `r2`'s; one loss over all.
//! - **`erl_algorithm = 2`** (two updates, each normalized on its own): `y1` as plain GRPO over the row's
//!   `r1`; `Δ` and `y2` over the `r2` of every retry in the batch (each row has at most one retry per
//!   rollout, so erl-trainer normalizes them batch-wide too). Two losses, each aggregated on its own
//!   tokens, the second weighted by `erl_rl_coef`.
//! - **Internalization** (`enable_internalization`): for each retry with `r2 > 0` (erl-trainer's
//!   test), the second attempt's tokens (exactly the ids it sampled, and what followed them in its context)
//!   re-framed under the first context's prompt (system message, question and the chat template's
//!   generation prompt): a cross-entropy of weight `internalization_coef`, so that the model gives the
//!   improved answer without the reflection.
//!
//! A value that is missing (a failed rollout, a component its holoware did not record) gives no
//! advantage (0), as in [`super::advantages`].

use std::collections::BTreeMap;

use super::advantages::{self, nanmean, nanstd, Rewards};
use super::batch::{self, Completion, Constraints, Sequence};
use super::config::{GrpoConfig, MultiObjectiveAggregation, ScaleRewards};
use holo_core::loom::{Constrained, RolloutRecord};
#[cfg(feature = "local")]
use {
    super::sft::{self, SftLossType},
    candle_core::{backprop::GradStore, Var},
    holo_model::Model,
};

/// The completions and internalized sequences of one generation batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    pub completions: Vec<Completion>,
    /// First prompts followed by successful second attempts; trained tokens are the second attempt's.
    pub internalized: Vec<Sequence>,
    /// `erl/*` metrics, and `reward`/`reward_std` of the first attempts.
    pub metrics: BTreeMap<String, f64>,
}

/// The phase of a trained context.
const PHASES: [&str; 3] = ["the first attempt", "the reflection", "the second attempt"];

/// Splits `records` (grouped: `group` consecutive rollouts per row) into ERL's completions; an error
/// names the rollout or the reward that does not fit ERL's shape.
pub fn split(
    records: &[RolloutRecord],
    group: usize,
    config: &GrpoConfig,
) -> Result<Split, String> {
    let reward =
        |record: &RolloutRecord, name: &str| match (&record.error, record.rewards.get(name)) {
            (None, Some(&value)) => value,
            _ => f64::NAN,
        };
    let first: Vec<f64> = records
        .iter()
        .map(|record| reward(record, &config.erl_first_reward))
        .collect();
    let second: Vec<f64> = records
        .iter()
        .map(|record| reward(record, &config.erl_second_reward))
        .collect();
    if records.iter().any(|record| record.error.is_none()) && first.iter().all(|r| r.is_nan()) {
        let mut names: Vec<&str> = records
            .iter()
            .flat_map(|record| record.rewards.keys().map(String::as_str))
            .collect();
        names.sort_unstable();
        names.dedup();
        return Err(format!(
            "erl_first_reward: no rollout recorded the reward `{}`; the rollouts recorded: {}",
            config.erl_first_reward,
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        ));
    }
    let (first_advantages, second_advantages) = match config.erl_algorithm {
        1 => joint_advantages(&first, &second, group, config.scale_rewards),
        _ => separate_advantages(&first, &second, group, config.scale_rewards),
    };

    let mut completions = Vec::new();
    let mut internalized = Vec::new();
    let mut retried = 0usize;
    let mut improved = 0usize;
    for (index, record) in records.iter().enumerate() {
        let contexts: Vec<_> = record.contexts.iter().filter(|c| c.trained).collect();
        if contexts.len() > PHASES.len() {
            return Err(format!(
                "row {} rollout {}: ERL expects at most three trained contexts (the first attempt, the reflection, the second attempt), found {}",
                record.row_index + 1,
                record.rollout_index + 1,
                contexts.len()
            ));
        }
        let sequences: Vec<Option<Sequence>> =
            contexts.iter().map(|c| batch::sequence(c)).collect();
        // A truncated rollout ended at its truncated sample: the last context that sampled.
        let truncated_at = if record.truncated {
            sequences.iter().rposition(Option::is_some)
        } else {
            None
        };
        if !second[index].is_nan() {
            retried += 1;
            improved += usize::from(second[index] > first[index]);
        }
        for (phase, sequence) in sequences.iter().enumerate() {
            let Some(sequence) = sequence else { continue };
            let truncated = truncated_at == Some(phase);
            let masked = record.error.is_some()
                || (truncated && config.mask_truncated_completions)
                || (phase > 0 && second[index].is_nan());
            let advantage = if phase == 0 {
                first_advantages[index]
            } else {
                second_advantages[index]
            };
            completions.push(Completion {
                sequences: vec![sequence.clone()],
                advantage: advantage as f32,
                token_advantages: None,
                mask: if masked { 0.0 } else { 1.0 },
                truncated,
                old_logprobs: None,
                ref_logprobs: None,
                is_ratio: None,
                second_loss: phase > 0 && config.erl_algorithm == 2,
            });
        }
        if config.enable_internalization && second[index] > 0.0 {
            if let (Some(Some(prompt)), Some(Some(retry))) = (sequences.first(), sequences.get(2)) {
                internalized.push(internalize(prompt, retry));
            }
        }
    }

    let mut metrics = BTreeMap::new();
    metrics.insert("reward".into(), nanmean(first.iter().copied()));
    metrics.insert("reward_std".into(), nanstd(&first));
    let scorable = first.iter().filter(|r| !r.is_nan()).count();
    metrics.insert(
        "erl/retry_ratio".into(),
        retried as f64 / scorable.max(1) as f64,
    );
    metrics.insert("erl/second_reward".into(), nanmean(second.iter().copied()));
    metrics.insert(
        "erl/improved_ratio".into(),
        if retried == 0 {
            0.0
        } else {
            improved as f64 / retried as f64
        },
    );
    metrics.insert("erl/internalized".into(), internalized.len() as f64);
    Ok(Split {
        completions,
        internalized,
        metrics,
    })
}

/// The second attempt `retry` under the first attempt's prompt: `first`'s tokens before its first
/// sampled one, then `retry`'s from its first sampled one on, trained where `retry` is.
pub fn internalize(first: &Sequence, retry: &Sequence) -> Sequence {
    let prompt = first.trained[0];
    let start = retry.trained[0];
    let mut ids = first.ids[..prompt].to_vec();
    ids.extend_from_slice(&retry.ids[start..]);
    Sequence {
        ids,
        trained: retry
            .trained
            .iter()
            .map(|&position| position - start + prompt)
            .collect(),
        sampling_logprobs: retry.sampling_logprobs.clone(),
        routes: None,
        // The retry's constrained runs, where its tokens now stand (replayed after this).
        constraints: Constraints {
            runs: retry
                .constraints
                .runs
                .iter()
                .filter(|run| run.start >= start)
                .map(|run| Constrained {
                    start: run.start - start + prompt,
                    ..run.clone()
                })
                .collect(),
            allowed: Vec::new(),
        },
    }
}

/// `(value − mean) / (std + 1e-4)`, or `value − mean` without scaling; a missing value gives 0.
fn normalize(value: f64, mean: f64, std: f64, scale: ScaleRewards) -> f64 {
    let advantage = match scale {
        ScaleRewards::None => value - mean,
        ScaleRewards::Group | ScaleRewards::Batch => (value - mean) / (std + 1e-4),
    };
    if advantage.is_nan() {
        0.0
    } else {
        advantage
    }
}

/// Algorithm 1: each row's first and second attempts normalized as one group.
pub fn joint_advantages(
    first: &[f64],
    second: &[f64],
    group: usize,
    scale: ScaleRewards,
) -> (Vec<f64>, Vec<f64>) {
    let group = group.max(1);
    let pool = |start: usize, end: usize| -> Vec<f64> {
        first[start..end]
            .iter()
            .chain(&second[start..end])
            .copied()
            .filter(|value| !value.is_nan())
            .collect()
    };
    let batch_std = nanstd(&pool(0, first.len()));
    let mut first_advantages = Vec::with_capacity(first.len());
    let mut second_advantages = Vec::with_capacity(first.len());
    for start in (0..first.len()).step_by(group) {
        let end = (start + group).min(first.len());
        let values = pool(start, end);
        let mean = nanmean(values.iter().copied());
        let std = match scale {
            ScaleRewards::Batch => batch_std,
            _ => nanstd(&values),
        };
        for index in start..end {
            first_advantages.push(normalize(first[index], mean, std, scale));
            second_advantages.push(normalize(second[index], mean, std, scale));
        }
    }
    (first_advantages, second_advantages)
}

/// Algorithm 2: first attempts normalized within their rows (GRPO's groups: [`advantages::advantages`]),
/// second attempts over the batch.
pub fn separate_advantages(
    first: &[f64],
    second: &[f64],
    group: usize,
    scale: ScaleRewards,
) -> (Vec<f64>, Vec<f64>) {
    let first_rewards = Rewards {
        names: vec!["first".into()],
        weights: vec![1.0],
        values: first.iter().map(|&value| vec![value]).collect(),
    };
    let first_advantages = advantages::advantages(
        &first_rewards,
        group,
        scale,
        MultiObjectiveAggregation::SumThenNormalize,
    )
    .advantages;
    let mean = nanmean(second.iter().copied());
    let std = nanstd(second);
    let second_advantages = second
        .iter()
        .map(|&value| normalize(value, mean, std, scale))
        .collect();
    (first_advantages, second_advantages)
}

/// Internalization on one micro-batch's share of a generation's internalized sequences:
/// `internalization_coef` × the summed negative log-likelihood (temperature 1, the SFT loss:
/// [`sft::loss::micro_batch`]) of their trained tokens over `total`, the trained tokens of all of them,
/// so that the micro-batches add up to the mean cross-entropy of the generation. Returns the loss, its
/// gradients (for `vars`) and `erl/internalization_loss`, the micro-batch's mean cross-entropy. The
/// local backend's only (feature `local`): the Tinker backend refuses `erl`.
#[cfg(feature = "local")]
pub fn internalization_step(
    model: &Model,
    vars: &[(String, Var)],
    config: &GrpoConfig,
    sequences: &[Sequence],
    total: usize,
) -> candle_core::Result<(f64, GradStore, BTreeMap<String, f64>)> {
    let sequences: Vec<&Sequence> = sequences.iter().collect();
    let micro = sft::loss::micro_batch(
        model,
        &sequences,
        total,
        SftLossType::Nll,
        crate::score::Pass {
            recompute: config.gradient_checkpointing,
            ..Default::default()
        },
    )?;
    let coef = config.internalization_coef;
    let tokens: usize = sequences.iter().map(|s| s.trained.len()).sum();
    // Its loss is its summed negative log-likelihood over `total`.
    let cross_entropy = micro.loss * total as f64 / tokens.max(1) as f64;
    let mut grads = micro.grads;
    if coef != 1.0 {
        for (_, var) in vars {
            if let Some(grad) = grads.remove(var.as_tensor()) {
                grads.insert(var.as_tensor(), (grad * coef)?);
            }
        }
    }
    let metrics = BTreeMap::from([("erl/internalization_loss".to_string(), cross_entropy)]);
    Ok((micro.loss * coef, grads, metrics))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAN: f64 = f64::NAN;

    #[test]
    fn joint_advantages_pool_a_rows_first_and_second_attempts() {
        // Row of 3: r1 = 1, 0, 0; the two failures retried with r2 = 1 and 0.
        let (first, second) =
            joint_advantages(&[1.0, 0.0, 0.0], &[NAN, 1.0, 0.0], 3, ScaleRewards::Group);
        let pool = [1.0, 0.0, 0.0, 1.0, 0.0];
        let mean = 0.4;
        let std = nanstd(&pool);
        assert!((first[0] - (1.0 - mean) / (std + 1e-4)).abs() < 1e-12);
        assert!((first[1] - (0.0 - mean) / (std + 1e-4)).abs() < 1e-12);
        assert_eq!(second[0], 0.0, "no retry, no advantage");
        assert!((second[1] - (1.0 - mean) / (std + 1e-4)).abs() < 1e-12);
        assert!((second[2] - first[2]).abs() < 1e-12);
    }

    #[test]
    fn separate_advantages_normalize_first_attempts_by_row_and_retries_over_the_batch() {
        let (first, second) = separate_advantages(
            &[1.0, 0.0, 0.0, 0.0],
            &[NAN, 1.0, NAN, 0.0],
            2,
            ScaleRewards::Group,
        );
        let std = nanstd(&[1.0, 0.0]);
        assert!((first[0] - 0.5 / (std + 1e-4)).abs() < 1e-12);
        assert_eq!(
            &first[2..],
            &[0.0, 0.0],
            "a row without spread teaches nothing"
        );
        assert!((second[1] - 0.5 / (std + 1e-4)).abs() < 1e-12);
        assert!((second[3] + 0.5 / (std + 1e-4)).abs() < 1e-12);
        assert_eq!(second[0], 0.0);
    }

    #[test]
    fn internalizing_puts_the_retry_under_the_first_prompt() {
        let first = Sequence {
            ids: vec![1, 2, 3, 10, 11, 99, 5],
            trained: vec![3, 4, 5],
            sampling_logprobs: vec![-0.1, -0.2, -0.3],
            routes: None,
            constraints: Default::default(),
        };
        let retry = Sequence {
            ids: vec![1, 7, 7, 7, 3, 20, 21, 99, 5],
            trained: vec![5, 6, 7],
            sampling_logprobs: vec![-1.0, -2.0, -3.0],
            routes: None,
            constraints: Default::default(),
        };
        let sequence = internalize(&first, &retry);
        assert_eq!(sequence.ids, [1, 2, 3, 20, 21, 99, 5]);
        assert_eq!(sequence.trained, [3, 4, 5]);
        let trained: Vec<u32> = sequence.trained.iter().map(|&p| sequence.ids[p]).collect();
        let sampled: Vec<u32> = retry.trained.iter().map(|&p| retry.ids[p]).collect();
        assert_eq!(
            trained, sampled,
            "exactly the ids the second attempt sampled"
        );
    }
}
