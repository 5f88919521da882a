//! Policy log-probabilities for the page: each trained token's log-probability under a model (the
//! weights a run ended with, or any other), beside the sampler's recorded one, so that a reader sees where
//! the policy moved since the rollout was sampled (the importance ratio `exp(policy − sampling)`).

use crate::local::{Grammars, Model};
use crate::loom::RolloutRecord;
use crate::train::{batch, replay, score};

/// Per rollout, per context: the log-probability under `model` at `temperature` of each trained token of
/// the context, in order (`None` for a context without trained tokens). Tokens a constraint held are
/// scored under its masks, replayed with `grammars` (the model's vocabulary), as the trainer scores
/// them. Rollouts go through the model `batch` at a time; `progress` is told how many are done.
pub fn logprobs(
    model: &Model,
    grammars: &Grammars,
    records: &[&RolloutRecord],
    temperature: f64,
    batch: usize,
    mut progress: impl FnMut(usize),
) -> candle_core::Result<Vec<Vec<Option<Vec<f32>>>>> {
    let mut out = Vec::with_capacity(records.len());
    for chunk in records.chunks(batch.max(1)) {
        let mut rollouts: Vec<Vec<Option<batch::Sequence>>> = chunk
            .iter()
            .map(|record| record.contexts.iter().map(batch::sequence).collect())
            .collect();
        replay::replay_sequences(grammars, rollouts.iter_mut().flatten().flatten())
            .map_err(|error| candle_core::Error::Msg(error.to_string()))?;
        let sequences: Vec<&batch::Sequence> = rollouts.iter().flatten().flatten().collect();
        let mut scored =
            score::sequence_logprobs(model, &sequences, temperature, batch)?.into_iter();
        out.extend(rollouts.iter().map(|contexts| {
            contexts
                .iter()
                .map(|sequence| sequence.as_ref().map(|_| scored.next().unwrap_or_default()))
                .collect::<Vec<_>>()
        }));
        progress(out.len());
    }
    Ok(out)
}
