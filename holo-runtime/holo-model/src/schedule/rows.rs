//! The batch's rows, running and being prefilled: what the engine holds and the batch's passes advance.

use crate::model::KvCache;
use crate::sample::Row;

/// A row of the batch and the submission it belongs to.
pub(super) struct Live {
    pub(super) group: u64,
    pub(super) row: Row,
}

/// Sequences prefilled together: their new tokens right-aligned in one padded width, run a chunk of
/// columns at a time. Identical prompts share one row of the forward pass (a *slot*).
pub(super) struct Prefill {
    pub(super) live: Vec<Live>,
    /// Each live row's slot.
    pub(super) slots: Vec<usize>,
    /// Per slot, `width` new tokens (padding first) and their positions.
    pub(super) ids: Vec<u32>,
    pub(super) positions: Vec<u32>,
    /// Per slot, the key mask over the cached columns and the `width` new ones.
    pub(super) masks: Vec<Vec<u8>>,
    pub(super) cached_width: usize,
    pub(super) width: usize,
    /// Columns of `width` already run.
    pub(super) done: usize,
    pub(super) cache: KvCache,
    /// Per slot, when some row records routes: the experts of each prompt position computed so far
    /// (empty where not computed: padding, or a prefix the cache held).
    pub(super) routes: Option<Vec<Vec<Vec<u32>>>>,
    /// Per slot, when its rows asked for their prompt's log-probabilities: those of the chunks run so
    /// far.
    pub(super) scores: Vec<Option<PromptScores>>,
}

/// A slot's prompt log-probabilities so far.
pub(super) struct PromptScores {
    /// The most likely tokens to keep per position.
    pub(super) top: usize,
    /// Of prompt tokens 1, 2, … given the tokens before each.
    pub(super) logprobs: Vec<f32>,
    /// The rank of each of those tokens in its position's distribution (1: the most likely).
    pub(super) ranks: Vec<u32>,
    /// The `top` most likely tokens at each of those positions, most likely first.
    pub(super) top_logprobs: Vec<Vec<(u32, f32)>>,
}

impl PromptScores {
    pub(super) fn new(top: usize) -> Self {
        PromptScores {
            top,
            logprobs: Vec::new(),
            ranks: Vec::new(),
            top_logprobs: Vec::new(),
        }
    }
}
