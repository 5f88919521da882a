//! What the loss trains on: rollouts turned into completions of trained tokens.
//!
//! A rollout is one *completion* in TRL's sense: its advantage applies to every token it sampled in a
//! trained context, over all its turns. Each trained context is one [`Sequence`] (the context's token ids,
//! chat-template frames included, and the positions the model sampled); a multi-turn rollout recorded in
//! one context is one sequence whose trained tokens come in several runs, with the tool output between
//! them scored by nobody.
//!
//! Per-token values ([`Completion::old_logprobs`], …) run over a completion's trained tokens in order:
//! sequence by sequence, position by position.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use holo_core::loom::{Constrained, ContextRecord, RolloutRecord};
use holo_core::Allowed;

/// One trained context: its tokens and which of them the model sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    pub ids: Vec<u32>,
    /// Positions (≥ 1) of the trained tokens in `ids`, increasing.
    pub trained: Vec<usize>,
    /// The sampler's log-probability of each trained token; `NaN` (`null` in JSON) where it gave none.
    #[serde(with = "nan_as_null")]
    pub sampling_logprobs: Vec<f32>,
    /// The experts the sampler routed each token through (aligned with `ids`, empty where not
    /// recorded), when it recorded them: a mixture-of-experts model's passes over this sequence replay
    /// them (see `routing_replay`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routes: Option<Vec<Vec<u32>>>,
    /// The runs of trained tokens the sampler drew under a constraint, and once the trainer has
    /// replayed them, what it allowed at each trained token: the trained log-probabilities are those
    /// of the masked distribution there.
    #[serde(default, skip_serializing_if = "Constraints::is_empty")]
    pub constraints: Constraints,
}

/// The constrained runs of a [`Sequence`] ([`TokensRecord::constraints`](holo_core::loom::TokensRecord)).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Constraints {
    /// Positions in the sequence's `ids` and the constraint each run was drawn under.
    pub runs: Vec<Constrained>,
    /// What the constraints allowed at each trained token (aligned with `trained`; `None` at tokens
    /// drawn whole), once replayed (holo-train's local backend does it); empty before, or when no run
    /// has a constraint.
    #[serde(skip)]
    pub allowed: Vec<Option<Allowed>>,
}

impl Constraints {
    /// No run was constrained.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// `allowed` set from each run's masks (`masks[r]`: one per token of run `r`), at the trained
    /// positions of `trained`.
    pub fn replayed(&mut self, trained: &[usize], masks: Vec<Vec<Allowed>>) {
        let mut allowed = vec![None; trained.len()];
        for (run, masks) in self.runs.iter().zip(masks) {
            for (offset, mask) in masks.into_iter().enumerate() {
                if let Ok(index) = trained.binary_search(&(run.start + offset)) {
                    allowed[index] = Some(mask);
                }
            }
        }
        self.allowed = allowed;
    }
}

/// JSON has no NaN: missing log-probabilities are written as `null`.
mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(values: &[f32], serializer: S) -> Result<S::Ok, S::Error> {
        let values: Vec<Option<f32>> = values
            .iter()
            .map(|value| (!value.is_nan()).then_some(*value))
            .collect();
        values.serialize(serializer)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<f32>, D::Error> {
        let values = Vec::<Option<f32>>::deserialize(deserializer)?;
        Ok(values
            .into_iter()
            .map(|value| value.unwrap_or(f32::NAN))
            .collect())
    }
}

/// A rollout as the loss sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub sequences: Vec<Sequence>,
    pub advantage: f32,
    /// Advantages that vary over the completion's tokens, one per trained token (in place of
    /// `advantage` in the loss): an Atropos environment's per-token `advantages`. See
    /// [`super::loss::per_token_advantages_refused`] for the losses that take them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_advantages: Option<Vec<f32>>,
    /// 1, or 0 when none of its tokens is trained (truncated under `mask_truncated_completions`, or
    /// failed): TRL's completion mask.
    pub mask: f32,
    /// A sample ran out of tokens (`max_completion_length` or the model's context).
    pub truncated: bool,
    /// Log-probabilities under the weights that sampled (when ratios need them), one per trained token.
    pub old_logprobs: Option<Vec<f32>>,
    /// Log-probabilities under the reference weights (when `beta` > 0).
    pub ref_logprobs: Option<Vec<f32>>,
    /// The importance-sampling correction for the sampler: one per token, or one for the completion.
    pub is_ratio: Option<Vec<f32>>,
    /// It belongs to the second of the step's two losses: ERL's reflections and second attempts under
    /// `erl_algorithm = 2` ([`super::erl`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub second_loss: bool,
}

impl Completion {
    /// Trained tokens over all sequences.
    pub fn len(&self) -> usize {
        self.sequences.iter().map(|s| s.trained.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sampler's log-probabilities of every trained token, in order.
    pub fn sampling_logprobs(&self) -> Vec<f32> {
        self.sequences
            .iter()
            .flat_map(|s| s.sampling_logprobs.iter().copied())
            .collect()
    }
}

/// The completions of `records` with their `advantages` (in order), as the loss sees them: a failed
/// rollout, or a truncated one under `mask_truncated_completions`, trains nothing.
pub fn completions(
    records: &[RolloutRecord],
    advantages: &[f64],
    mask_truncated_completions: bool,
) -> Vec<Completion> {
    records
        .iter()
        .zip(advantages)
        .map(|(record, &advantage)| {
            let masked = record.error.is_some() || (record.truncated && mask_truncated_completions);
            Completion {
                sequences: sequences(record),
                advantage: advantage as f32,
                token_advantages: None,
                mask: if masked { 0.0 } else { 1.0 },
                truncated: record.truncated,
                old_logprobs: None,
                ref_logprobs: None,
                is_ratio: None,
                second_loss: false,
            }
        })
        .collect()
}

/// The trained sequences of a rollout record (its contexts that are trained and have tokens).
pub fn sequences(record: &RolloutRecord) -> Vec<Sequence> {
    record
        .contexts
        .iter()
        .filter(|context| context.trained)
        .filter_map(sequence)
        .collect()
}

/// A context as the loss sees it, when it has trained tokens.
pub fn sequence(context: &ContextRecord) -> Option<Sequence> {
    let tokens = context.tokens.as_ref()?;
    let trained: Vec<usize> = tokens
        .loss_mask
        .iter()
        .enumerate()
        .filter(|(position, &mask)| mask != 0 && *position > 0)
        .map(|(position, _)| position)
        .collect();
    if trained.is_empty() {
        return None;
    }
    let sampling_logprobs = trained
        .iter()
        .map(|&position| match tokens.logprobs.get(position) {
            // The holophore writes 0 where the sampler gave no log-probability.
            Some(&logprob) if logprob != 0.0 => logprob,
            _ => f32::NAN,
        })
        .collect();
    Some(Sequence {
        ids: tokens.ids.clone(),
        trained,
        sampling_logprobs,
        routes: tokens.routes.clone(),
        constraints: Constraints {
            runs: tokens.constraints.clone(),
            allowed: Vec::new(),
        },
    })
}

/// Each reward component's values over `records` (grouped as they are), `NaN` where a record has none;
/// a failed record has none at all. `overrides` replace the holoware's weights by name.
pub fn rewards(
    records: &[RolloutRecord],
    overrides: Option<&BTreeMap<String, f64>>,
) -> super::advantages::Rewards {
    let mut names: Vec<String> = records
        .iter()
        .flat_map(|record| record.rewards.keys().cloned())
        .collect();
    names.sort();
    names.dedup();
    let weights = names
        .iter()
        .map(|name| {
            overrides
                .and_then(|weights| weights.get(name).copied())
                .or_else(|| {
                    records
                        .iter()
                        .find_map(|record| record.weights.get(name).copied())
                })
                .unwrap_or(1.0)
        })
        .collect();
    let values = records
        .iter()
        .map(|record| {
            names
                .iter()
                .map(|name| match (&record.error, record.rewards.get(name)) {
                    (None, Some(&value)) => value,
                    _ => f64::NAN,
                })
                .collect()
        })
        .collect();
    super::advantages::Rewards {
        names,
        weights,
        values,
    }
}
