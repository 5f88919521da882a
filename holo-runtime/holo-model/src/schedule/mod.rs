//! Continuous batching for the local model: sequences join the running batch and leave it at every
//! decoding step, as vLLM, TGI and llama.cpp's server schedule.
//!
//! The engine holds *submissions* (one [`Sampler`](holo_core::Sampler) call: a Loom request, the `n`
//! samples of one HTTP request), each a group of sequences, and advances all of them one step at a time:
//! 1. **Fair shares.** A free place in the batch goes to the submission with the fewest sequences
//!    admitted (the oldest among equals), so a request with `n` = 4096 advances beside the others
//!    instead of owning the model. When the batch is full and a submission has nothing admitted, the
//!    submission with the most sequences admitted (at least two) gives one back: the sequence is paused
//!    with its keys and values, and resumes where it stopped, without running anything again.
//! 2. **Admission**, while no prefill is in progress: sequences join a prefill while the batch holds
//!    fewer than [`Limits::max_num_seqs`], the prefill's padded tokens stay within
//!    [`Limits::max_num_batched_tokens`], and the keys and values of the batch (with each sequence's
//!    linear-attention states, of fixed size) would stay within [`Limits::kv_budget_bytes`] (a budget for
//!    admission: running sequences are never stopped for it).
//!    Prompts that extend a sequence in the [`PrefixCache`](super::sample::PrefixCache) only run their
//!    new tokens (with linear-attention layers, only prompts that extend a whole cached sequence: a
//!    state holds the sequence's last token, not its prefixes), and identical prompts admitted together
//!    (the `G` rollouts of a GRPO group) run once.
//!    A sequence that asks for its prompt's log-probabilities reads no prefix from the cache: its prompt
//!    runs whole, and each chunk's hidden states are turned into them (see `score`).
//! 3. **Chunked prefill**: a prefill runs at most `max_num_batched_tokens` tokens a step, so a long
//!    prompt does not stall the decoding of the others; when its last chunk has run, its sequences
//!    sample their first token and join the running batch.
//! 4. **Decoding**: one token for every running sequence; sequences that end leave (into the prefix
//!    cache), and their submission hears of it when its last sequence has ended.
//!
//! A sequence's tokens depend only on its prompt, its parameters and its seed, not on what else is in
//! the batch (up to floating-point rounding of the batched products, far below sampling's resolution).
//!
//! Each [`LocalModel`](super::LocalModel) runs one engine on its own thread, started by its first sample:
//! every caller's submissions share the batch. [`LocalModel::scheduler_stats`](super::LocalModel::scheduler_stats)
//! says what it is doing.

mod batch;
mod engine;
mod rows;
mod score;
mod thread;

pub(crate) use engine::Engine;
pub(crate) use thread::Scheduler;
pub use thread::{Overloaded, SchedulerStats};

use super::sample::Generation;

/// How much the engine takes on at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Sequences in the batch (prefilling or decoding) at most.
    pub max_num_seqs: usize,
    /// Tokens one prefill runs per step at most (padding included); a prompt longer than this is
    /// prefilled over several steps.
    pub max_num_batched_tokens: usize,
    /// Keys and values of the batch, in bytes, beyond which no sequence is admitted (one always is when
    /// nothing runs); `usize::MAX` for none. Admission counts the columns sequences fill (no more than a
    /// window and a [`trim_block`](crate::model::trim_block) of them in a windowed layer, which lets go
    /// of the rest), and the states each sequence keeps in linear-attention layers; the cache
    /// allocates up to an eighth more (and 16 columns) for the steps to come to write into.
    pub kv_budget_bytes: usize,
    /// Batch-invariant sampling: a sequence's tokens and log-probabilities are the same, bit for bit,
    /// whatever else runs beside it (other sequences, their lengths, prefill chunks), as they are for
    /// vLLM's batch-invariant mode; see [`Ops::Invariant`](super::Ops::Invariant). CPU only, with f32 or
    /// bf16 weights. Costs prefill speed: every product goes through the row-by-row kernel.
    pub batch_invariant: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            kv_budget_bytes: usize::MAX,
            batch_invariant: false,
        }
    }
}

/// Whoever waits for a submission's sequences.
pub(crate) trait Listener {
    /// Sequence `index` sampled `token`; whether it still wants tokens.
    fn token(&mut self, index: usize, token: u32, logprob: f32, top: &[(u32, f32)]) -> bool;
    /// Whether sequence `index`, not admitted yet, is still wanted.
    fn wanted(&self, index: usize) -> bool;
    /// Sequence `index` joins a prefill: it has left the queue.
    fn started(&mut self, index: usize) {
        let _ = index;
    }
    /// Sequence `index`, which asked for [`GenerationParams::prompt_logprobs`](crate::GenerationParams),
    /// has its prompt scored (see [`holo_core::TokenSink::prompt_logprobs`]).
    fn prompt_logprobs(
        &mut self,
        index: usize,
        logprobs: &[f32],
        ranks: &[u32],
        top: &[Vec<(u32, f32)>],
    ) {
        let _ = (index, logprobs, ranks, top);
    }
}

/// A submission's results, in sequence order: a generation, or why the model failed it.
pub(crate) type Results = Vec<std::result::Result<Generation, String>>;
