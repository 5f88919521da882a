//! Generation batches made outside the trainer: a [`Feed`] hands [`Trainer`](super::Trainer) scored
//! rollouts in place of its own rollouts through the Loom (an Atropos API:
//! [`crate::engines::atropos::batch`]). The rest of a step is the same: advantages normalized within
//! each group of `num_generations` rollouts, the importance-sampling correction for the sampler's
//! log-probabilities, the loss, the update.

use std::collections::BTreeMap;

use super::run::TrainError;
use crate::loom::RolloutRecord;

/// One generation batch from a [`Feed`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fed {
    /// `generation_batch_size` rollouts, grouped `num_generations` apiece, each with its `step`; their
    /// trained contexts carry token records with the sampler's log-probabilities, their rewards score
    /// them.
    pub records: Vec<RolloutRecord>,
    /// Per record, an advantage the source fixed (used instead of the group-normalized one), or
    /// `None`; empty when none is fixed.
    pub advantages: Vec<Option<f64>>,
    /// The feed's own metrics of the batch.
    pub metrics: BTreeMap<String, f64>,
}

/// Where a trainer's generation batches come from when it does not roll out itself.
pub trait Feed {
    /// The batch of optimizer step `step` (1-based), waiting for it as long as the source needs.
    fn next(&mut self, runtime: &tokio::runtime::Runtime, step: u64) -> Result<Fed, TrainError>;
}
