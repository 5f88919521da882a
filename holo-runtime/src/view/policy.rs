//! Policy log-probabilities for the page: each trained token's log-probability under a model (the
//! weights a run ended with, or any other), beside the sampler's recorded one, so that a reader sees where
//! the policy moved since the rollout was sampled (the importance ratio `exp(policy − sampling)`).

use crate::local::Model;
use crate::loom::RolloutRecord;
use crate::train::batch::{self, Completion};
use crate::train::score;

/// Per rollout, per context: the log-probability under `model` at `temperature` of each trained token of
/// the context, in order (`None` for a context without trained tokens). Sequences go through the model
/// `batch` at a time; `progress` is told how many rollouts are done.
pub fn logprobs(
    model: &Model,
    records: &[&RolloutRecord],
    temperature: f64,
    batch: usize,
    mut progress: impl FnMut(usize),
) -> candle_core::Result<Vec<Vec<Option<Vec<f32>>>>> {
    let mut out = Vec::with_capacity(records.len());
    for (done, chunk) in records.chunks(batch.max(1)).enumerate() {
        // One completion per trained context, remembering where it goes.
        let mut places = Vec::new();
        let mut completions = Vec::new();
        for (index, record) in chunk.iter().enumerate() {
            for (context_index, context) in record.contexts.iter().enumerate() {
                if let Some(sequence) = batch::sequence(context) {
                    places.push((index, context_index));
                    completions.push(Completion {
                        sequences: vec![sequence],
                        advantage: 0.0,
                        mask: 1.0,
                        truncated: false,
                        old_logprobs: None,
                        ref_logprobs: None,
                        is_ratio: None,
                        second_loss: false,
                    });
                }
            }
        }
        let scored = score::logprobs(model, &completions, temperature, batch)?;
        let mut rollouts: Vec<Vec<Option<Vec<f32>>>> = chunk
            .iter()
            .map(|record| vec![None; record.contexts.len()])
            .collect();
        for ((index, context), values) in places.into_iter().zip(scored) {
            rollouts[index][context] = Some(values);
        }
        out.extend(rollouts);
        progress((done * batch.max(1) + chunk.len()).min(records.len()));
    }
    Ok(out)
}
