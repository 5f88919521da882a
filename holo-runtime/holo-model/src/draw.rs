//! Drawing tokens where the logits are: on a GPU, a batch's logits (`[rows, vocab]`, 39 MB a step for
//! 64 rows of Qwen's 151,936 tokens) never come to the host. The device computes each row's
//! exponentiated, tempered logits and their sums over chunks of [`CHUNK`] tokens; the host picks a
//! chunk with the row's own uniform draw, and then the token within the one chunk it reads back. Two
//! small transfers a step instead of the whole vocabulary, and the same draw as the host's
//! [`choose`](super::sample): the first token whose cumulative weight passes `u × total`, with the
//! row's generator consumed identically, so a seed draws the same tokens on either side (up to f32
//! against f64 rounding at a boundary between two tokens).
//!
//! Rows with top-k, top-p or top log-probabilities need their whole row of logits and are drawn on the
//! host; the [scheduler](super::schedule) sends each row where it belongs.

use candle_core::{DType, Tensor};

use super::model::Result;
use super::sample::Drawn;

/// Tokens per chunk: what the host reads back of a sampled row (with its raw logits, 8 KiB).
pub(super) const CHUNK: usize = 1024;

/// One row to draw: its row of the logits, and how to draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Ask {
    /// The row of the logits (rows sharing a prompt share one).
    pub(super) row: usize,
    /// `None` for a greedy choice; else the temperature and the row's uniform draw in `[0, 1)`.
    pub(super) sample: Option<(f64, f64)>,
}

/// Draws a token for each ask from `logits` (`[rows, vocab]`, f32, on any device) over the whole
/// vocabulary; greedy asks take the largest logit (the lowest id among equals).
pub(super) fn draw(logits: &Tensor, asks: &[Ask]) -> Result<Vec<Drawn>> {
    if asks.is_empty() {
        return Ok(Vec::new());
    }
    let device = logits.device();
    let (_, vocab) = logits.dims2()?;
    let count = asks.len();
    let chunks = vocab.div_ceil(CHUNK);
    let padding = chunks * CHUNK - vocab;
    let rows: Vec<u32> = asks.iter().map(|ask| ask.row as u32).collect();
    let logits = logits
        .to_dtype(DType::F32)?
        .index_select(&Tensor::new(rows.as_slice(), device)?, 0)?;
    // Whole chunks: the padding's logits are -inf, of weight 0, never the largest and never drawn.
    let logits = match padding {
        0 => logits,
        _ => {
            let padding = Tensor::full(f32::NEG_INFINITY, (count, padding), device)?;
            Tensor::cat(&[&logits, &padding], 1)?
        }
    };
    // Greedy rows are tempered by 1: their weights are computed and not read.
    let temperatures: Vec<f32> = asks
        .iter()
        .map(|ask| {
            ask.sample
                .map_or(1.0, |(temperature, _)| temperature as f32)
        })
        .collect();
    let temperatures = Tensor::from_vec(temperatures, (count, 1), device)?;
    let tempered = logits.broadcast_div(&temperatures)?;
    let weights = tempered.broadcast_sub(&tempered.max_keepdim(1)?)?.exp()?;
    let chunk_sums = weights.reshape((count, chunks, CHUNK))?.sum(2)?;
    // The policy's normaliser at temperature 1, for the log-probability of a greedy or tempered draw.
    let largest = logits.max_keepdim(1)?;
    let normaliser = (logits
        .broadcast_sub(&largest)?
        .exp()?
        .sum_keepdim(1)?
        .log()?
        + &largest)?;
    // Ids are exact in f32 below 2^24, far above any vocabulary.
    let greedy = logits.argmax_keepdim(1)?.to_dtype(DType::F32)?;
    let summary =
        Tensor::cat(&[&chunk_sums, &normaliser, &greedy, &largest], 1)?.to_vec2::<f32>()?;

    // The host's half: each sampled row's chunk, then (after reading that chunk) its token.
    let mut drawn = vec![None; count];
    let mut picks = Vec::new();
    for (i, (ask, summary)) in asks.iter().zip(&summary).enumerate() {
        let (sums, normaliser) = (&summary[..chunks], summary[chunks]);
        match ask.sample {
            None => {
                drawn[i] = Some(Drawn {
                    token: summary[chunks + 1] as u32,
                    logprob: summary[chunks + 2] - normaliser,
                    sampling_logprob: 0.0,
                })
            }
            Some((temperature, uniform)) => {
                let total: f64 = sums.iter().map(|&sum| sum as f64).sum();
                let (chunk, threshold) = first_passing(sums, uniform * total);
                picks.push(Pick {
                    ask: i,
                    chunk,
                    threshold,
                    total,
                    temperature,
                    normaliser,
                });
            }
        }
    }
    if !picks.is_empty() {
        let flat: Vec<u32> = picks
            .iter()
            .map(|pick| (pick.ask * chunks + pick.chunk) as u32)
            .collect();
        let flat = Tensor::new(flat.as_slice(), device)?;
        let by_chunk = |tensor: &Tensor| {
            tensor
                .reshape((count * chunks, CHUNK))?
                .index_select(&flat, 0)
        };
        let read =
            Tensor::cat(&[&by_chunk(&weights)?, &by_chunk(&logits)?], 1)?.to_vec2::<f32>()?;
        for (pick, read) in picks.iter().zip(&read) {
            let (weights, logits) = read.split_at(CHUNK);
            let (within, _) = first_passing(weights, pick.threshold);
            let sampling_logprob = (weights[within] as f64 / pick.total).ln() as f32;
            // At temperature 1 the token was drawn from the policy itself.
            let logprob = match pick.temperature == 1.0 {
                true => sampling_logprob,
                false => logits[within] - pick.normaliser,
            };
            drawn[pick.ask] = Some(Drawn {
                token: (pick.chunk * CHUNK + within) as u32,
                logprob,
                sampling_logprob,
            });
        }
    }
    Ok(drawn
        .into_iter()
        .map(|drawn| drawn.expect("every ask is drawn"))
        .collect())
}

/// A sampled row between its two halves: the chunk it falls in and what is left of its threshold there.
struct Pick {
    ask: usize,
    chunk: usize,
    threshold: f64,
    total: f64,
    temperature: f64,
    normaliser: f32,
}

/// The first entry at which the running sum of `weights` passes `threshold`, and the threshold less
/// the entries before it. When rounding leaves the threshold beyond the sum, the last entry of positive
/// weight (one never drawn otherwise has weight 0).
fn first_passing(weights: &[f32], mut threshold: f64) -> (usize, f64) {
    for (i, &weight) in weights.iter().enumerate() {
        if threshold < weight as f64 {
            return (i, threshold);
        }
        threshold -= weight as f64;
    }
    let last = weights
        .iter()
        .rposition(|&weight| weight > 0.0)
        .unwrap_or(0);
    (last, weights[last] as f64)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::sample::{host_draw, GenerationParams};

    /// Logits over `vocab` tokens, spread like a model's (a few large, most far below).
    fn logits(rows: usize, vocab: usize, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..rows)
            .map(|_| {
                (0..vocab)
                    .map(|_| {
                        let x: f32 = rng.random();
                        12.0 * x.powi(3) - 4.0
                    })
                    .collect()
            })
            .collect()
    }

    /// Over vocabularies of one chunk, several and a part, for greedy and tempered rows (two reading
    /// one row of logits), the device draw takes the host's tokens with its log-probabilities, from
    /// generators seeded alike.
    #[test]
    fn the_device_draws_what_the_host_draws() {
        let mut compared = 0;
        for vocab in [37, CHUNK, 3 * CHUNK + 500] {
            let rows = logits(3, vocab, vocab as u64);
            let tensor = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
            let cases = [(0, 0.0), (1, 1.0), (1, 0.7), (2, 1.3), (2, 1.0)];
            for seed in 0..40 {
                let mut asks = Vec::new();
                let mut expected = Vec::new();
                for (i, &(row, temperature)) in cases.iter().enumerate() {
                    let params = GenerationParams {
                        temperature,
                        ..Default::default()
                    };
                    let mut host = ChaCha8Rng::seed_from_u64(seed * 10 + i as u64);
                    let mut device = host.clone();
                    expected.push(host_draw(&rows[row], &params, &mut host).0);
                    let sample = (temperature > 0.0).then(|| (temperature, device.random::<f64>()));
                    asks.push(Ask { row, sample });
                }
                let drawn = draw(&tensor, &asks).unwrap();
                for ((ask, drawn), expected) in asks.iter().zip(&drawn).zip(&expected) {
                    assert_eq!(drawn.token, expected.token, "{ask:?} over {vocab}");
                    assert!(
                        (drawn.sampling_logprob - expected.sampling_logprob).abs() < 1e-5,
                        "{ask:?}: {drawn:?} against {expected:?}"
                    );
                    assert!(
                        (drawn.logprob - expected.logprob).abs() < 1e-5,
                        "{ask:?}: {drawn:?} against {expected:?}"
                    );
                    compared += 1;
                }
            }
        }
        assert_eq!(compared, 3 * 40 * 5);
    }

    #[test]
    fn a_threshold_past_the_sum_takes_the_last_token_of_positive_weight() {
        let (entry, left) = first_passing(&[0.5, 0.25, 0.0], 0.6);
        assert!(entry == 1 && (left - 0.1).abs() < 1e-12, "{entry} {left}");
        assert_eq!(first_passing(&[0.5, 0.25, 0.0], 0.75), (1, 0.25));
        assert_eq!(first_passing(&[0.5, 0.25, 0.0], 0.0), (0, 0.0));
    }
}
