//! Prompt log-probabilities: every prompt position's logits, a chunk of the prefill at a time, turned
//! into the next prompt token's log-probability, its rank, and the most likely tokens there (vLLM's
//! `prompt_logprobs`, what `echo` with `logprobs` reports). Only slots whose rows ask pay for them.

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use super::batch::PARALLEL_VOCAB;
use super::engine::Engine;
use super::rows::Prefill;
use crate::model::Result;
use crate::sample::{log_sum_exp, most_likely};

/// Prompt positions whose logits are computed at once: the f32 logits held at a time are this many
/// rows of the vocabulary, however long the prompt or the chunk.
const POSITIONS_AT_ONCE: usize = 64;

/// One prompt position's score: its token's log-probability and rank, and the most likely tokens.
struct Scored {
    logprob: f32,
    rank: u32,
    alternatives: Vec<(u32, f32)>,
}

impl Engine<'_> {
    /// Scores the prompt tokens that the chunk just run (`hidden`: `[slots, columns, hidden]`, from
    /// column `prefill.done`) predicts, for the slots that keep scores. A scored slot read no prefix
    /// from the cache, so its prompt is its `width` columns after its padding; the logits of column `c`
    /// score the token in column `c + 1`, and the last column's are the first sampled token's.
    pub(super) fn score_chunk(
        &self,
        prefill: &mut Prefill,
        hidden: &Tensor,
        columns: usize,
    ) -> Result<()> {
        let (start, width) = (prefill.done, prefill.width);
        let vocab = self.model.config.vocab_size;
        let end = (start + columns).min(width - 1);
        for (slot, scores) in prefill.scores.iter_mut().enumerate() {
            let Some(scores) = scores.as_mut() else {
                continue;
            };
            let mask = &prefill.masks[slot][prefill.cached_width..];
            let padding = mask.iter().take_while(|&&m| m == 0).count();
            let ids = &prefill.ids[slot * width..(slot + 1) * width];
            let mut column = start.max(padding);
            while column < end {
                let count = (end - column).min(POSITIONS_AT_ONCE);
                let states = hidden.get(slot)?.narrow(0, column - start, count)?;
                let logits = self
                    .model
                    .logits(&states, self.ops())?
                    .to_dtype(DType::F32)?
                    .to_vec2::<f32>()?;
                let top = scores.top;
                let score = |(offset, row): (usize, &Vec<f32>)| {
                    let next = ids[column + offset + 1] as usize;
                    let normaliser = log_sum_exp(row);
                    let alternatives = match top {
                        0 => Vec::new(),
                        k => most_likely(row, k, normaliser),
                    };
                    // vLLM's rank: the tokens at least as likely, the token itself included.
                    let rank = row.iter().filter(|&&logit| logit >= row[next]).count() as u32;
                    Scored {
                        logprob: row[next] - normaliser,
                        rank,
                        alternatives,
                    }
                };
                // Over a large vocabulary, the softmax and the search for the most likely tokens
                // are worth sharing out, as sampling does.
                let positions: Vec<Scored> = if vocab >= PARALLEL_VOCAB {
                    logits.par_iter().enumerate().map(score).collect()
                } else {
                    logits.iter().enumerate().map(score).collect()
                };
                for scored in positions {
                    scores.logprobs.push(scored.logprob);
                    scores.ranks.push(scored.rank);
                    scores.top_logprobs.push(scored.alternatives);
                }
                column += count;
            }
        }
        Ok(())
    }
}
