//! Why training stopped or could not start: the one error every layer of the trainer returns.

use std::io;

/// Why training stopped or could not start.
#[derive(Debug)]
pub enum TrainError {
    /// The configuration, the data or the run folder is wrong; nothing was done.
    Input(String),
    /// Writing the run's files failed.
    Io(io::Error),
    /// The model in process failed (feature `local`).
    #[cfg(feature = "local")]
    Model(candle_core::Error),
    /// The guard rails stopped the run: a rollback condition tripped after `max_rollbacks` rollbacks, or
    /// with no good checkpoint to return to.
    Diverged(String),
    /// Every rollout of a generation batch or an evaluation failed (the first one's error is in the
    /// message, each in the rollouts file): there is nothing to train on, and nothing suggests the next
    /// batch would fare better.
    Rollouts(String),
    /// The batches' source outside the trainer failed ([`crate::feed`]: an Atropos API gone for good, a
    /// malformed batch).
    Source(String),
}

impl std::fmt::Display for TrainError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TrainError::Input(message) => f.write_str(message),
            TrainError::Io(error) => write!(f, "cannot write the run: {error}"),
            #[cfg(feature = "local")]
            TrainError::Model(error) => write!(f, "the model failed: {error}"),
            TrainError::Diverged(message) => write!(f, "the run diverged: {message}"),
            TrainError::Source(message) => f.write_str(message),
            TrainError::Rollouts(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for TrainError {}

impl From<io::Error> for TrainError {
    fn from(error: io::Error) -> Self {
        TrainError::Io(error)
    }
}

#[cfg(feature = "local")]
impl From<candle_core::Error> for TrainError {
    fn from(error: candle_core::Error) -> Self {
        TrainError::Model(error)
    }
}
