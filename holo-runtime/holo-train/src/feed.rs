//! Generation batches made outside the trainer: a [`Feed`] hands [`Trainer`](super::Trainer) scored
//! rollouts in place of its own rollouts through the Loom (an Atropos API:
//! `holo_engines::atropos::batch`). The rest of a step is the same: advantages normalized within
//! each group (of its own size, which need not be `num_generations`: an Atropos batch may mix the
//! groups of environments with different group sizes), the importance-sampling correction for the
//! sampler's log-probabilities, the loss, the update. Where the source fixes a rollout's advantage
//! ([`Given`]), that one is used; per token, it reaches the loss as
//! [`Completion::token_advantages`](super::batch::Completion::token_advantages).

use std::collections::BTreeMap;

use super::error::TrainError;
use holo_core::loom::RolloutRecord;

/// An advantage a [`Feed`] fixed for one rollout, used instead of the group-normalized one.
#[derive(Debug, Clone, PartialEq)]
pub enum Given {
    /// One for the whole rollout.
    Sequence(f64),
    /// One per trained token, in the order of [`Completion::len`](super::batch::Completion::len)'s
    /// tokens ([`Completion::token_advantages`](super::batch::Completion::token_advantages)).
    Tokens(Vec<f32>),
}

/// One generation batch from a [`Feed`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fed {
    /// `generation_batch_size` rollouts, group after group, each with its `step`; their trained
    /// contexts carry token records with the sampler's log-probabilities, their rewards score them.
    pub records: Vec<RolloutRecord>,
    /// The size of each group of `records`, in order; empty when every group has `num_generations`.
    pub groups: Vec<usize>,
    /// Per record, an advantage the source fixed, or `None`; empty when none is fixed.
    pub advantages: Vec<Option<Given>>,
    /// The feed's own metrics of the batch.
    pub metrics: BTreeMap<String, f64>,
}

/// Where a trainer's generation batches come from when it does not roll out itself.
pub trait Feed {
    /// The batch of optimizer step `step` (1-based), waiting for it as long as the source needs.
    fn next(&mut self, runtime: &tokio::runtime::Runtime, step: u64) -> Result<Fed, TrainError>;
}
