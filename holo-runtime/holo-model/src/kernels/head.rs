//! The output head's log-softmax read at target tokens, fused: for each row of logits, the target's
//! log-probability, the distribution's entropy and whether the target is the most likely token, in two
//! passes over the row, with a backward that writes the logits' gradient in one.
//!
//! Through candle's ops the same figures took a dozen `[N, vocab]` tensors (scaling, max, subtraction,
//! exponential, sum, logarithm, gather, entropy's product and sum, and as many again in the backward),
//! each a full pass over memory and most of them kept alive by the graph until the backward ran. With a
//! real vocabulary (151,936 for Qwen2) those are 0.6 GB apiece for 1,000 trained tokens; here only the
//! logits and their gradient exist at that size. Off the CPU the candle ops still run
//! (see [`target_scores`]).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, InplaceOp3, Layout, Shape, Tensor, D};

use super::kernel::Result;
use super::kernel::{contiguous, for_each_chunk, Real};

/// Columns of [`target_scores`]' result.
pub mod column {
    /// The target token's log-probability (differentiable).
    pub const LOGPROB: usize = 0;
    /// The entropy of the row's distribution (differentiable).
    pub const ENTROPY: usize = 1;
    /// 1 where the target is a most likely token (TRL's `is_top1`), else 0; carries no gradient.
    pub const TOP1: usize = 2;
    /// The log-normalizer `log Σ exp(logits / temperature)`, which the backward reads; carries no gradient.
    pub const NORMALIZER: usize = 3;
    /// How many columns there are.
    pub const COUNT: usize = 4;
}

/// For logits `[N, V]` (f32 or f64) divided by `temperature` and targets `[N]` (u32):
/// `[N, 4]` in the logits' dtype, the [`column`](mod@column)s. Gradients flow into the logits from the log-probability
/// and entropy columns.
pub fn target_scores(logits: &Tensor, targets: &Tensor, temperature: f64) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    if targets.dims1()? != rows {
        candle_core::bail!("{} targets for {rows} rows of logits", targets.dims1()?);
    }
    if !matches!(logits.dtype(), DType::F32 | DType::F64) {
        candle_core::bail!(
            "logits are {:?}; the head scores f32 or f64",
            logits.dtype()
        );
    }
    if vocab == 0 {
        candle_core::bail!("logits have no vocabulary");
    }
    let targets = targets.to_dtype(DType::U32)?;
    if logits.device().is_cpu() {
        logits
            .contiguous()?
            .apply_op2(&targets.contiguous()?, TargetScores { temperature })
    } else {
        with_tensor_ops(logits, &targets, temperature)
    }
}

/// [`target_scores`] through candle's ops, for devices the fused op has no kernel on.
fn with_tensor_ops(logits: &Tensor, targets: &Tensor, temperature: f64) -> Result<Tensor> {
    let scaled = if temperature == 1.0 {
        logits.clone()
    } else {
        (logits / temperature)?
    };
    let normalizer = {
        let max = scaled.max_keepdim(D::Minus1)?.detach();
        (scaled
            .broadcast_sub(&max)?
            .exp()?
            .sum_keepdim(D::Minus1)?
            .log()?
            + max)?
    };
    let logprobs = scaled.broadcast_sub(&normalizer)?;
    let chosen = logprobs.gather(&targets.unsqueeze(1)?, 1)?;
    // A masked entry (a `-inf` logit, a constraint's) has p = 0 and p · log p = 0, not 0 · -inf = NaN:
    // its log p is held at -1e4, below any log p of a p that is not 0 (f64's least is -745).
    let entropy = (logprobs.exp()? * logprobs.maximum(-1e4)?)?
        .sum_keepdim(D::Minus1)?
        .neg()?;
    let best = scaled.detach().max_keepdim(D::Minus1)?;
    let top1 = scaled
        .detach()
        .gather(&targets.unsqueeze(1)?, 1)?
        .ge(&best)?
        .to_dtype(logits.dtype())?;
    Tensor::cat(&[chosen, entropy, top1, normalizer.detach()], 1)
}

struct TargetScores {
    temperature: f64,
}

impl CustomOp2 for TargetScores {
    fn name(&self) -> &'static str {
        "target-scores"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        logits_layout: &Layout,
        targets: &CpuStorage,
        targets_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const WHAT: &str = "target-scores";
        let (rows, vocab) = logits_layout.shape().dims2()?;
        let targets = contiguous::<u32>(targets, targets_layout, WHAT)?;
        let scores = match logits.dtype() {
            DType::F32 => CpuStorage::F32(forward(
                contiguous(logits, logits_layout, WHAT)?,
                vocab,
                targets,
                self.temperature as f32,
            )?),
            DType::F64 => CpuStorage::F64(forward(
                contiguous(logits, logits_layout, WHAT)?,
                vocab,
                targets,
                self.temperature,
            )?),
            other => candle_core::bail!("{WHAT}: logits are {other:?}"),
        };
        Ok((scores, Shape::from((rows, column::COUNT))))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        scores: &Tensor,
        grad_scores: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The graph's logits stay as they are: the gradient goes into a copy, of the detached logits
        // so that it carries no graph. `Tensor::copy` records a `Copy` of its tracked argument, which
        // made autograd's sum of this gradient a tracked tensor as well, holding its zeros and the copy
        // (two `[N, vocabulary]` tensors) past the addition: a SmolLM2-135M LoRA run at 49,152 tokens
        // peaked 450 MiB higher (`benches/memory_plan.py`, "135m 49k B8 C128 LoRA").
        let grad = logits_gradient(
            logits.detach().copy()?,
            0,
            &targets.to_vec1::<u32>()?,
            scores,
            grad_scores,
            self.temperature,
        )?;
        Ok((Some(grad), None))
    }
}

/// The gradient of a block of logits `[N, C]`, the vocabulary's columns `first..first + C` (f32 or f64,
/// CPU), from the scores [`target_scores`] gave for the whole rows and the scores' gradient `[N, 4]`:
/// what the fused op's backward computes, for a caller that recomputes the logits a block at a time
/// instead of keeping them (the chunked output head). Each entry needs only its own logit and its row's
/// scores (normalizer, entropy), so any block of columns can be done alone.
///
/// The gradient is written over the logits, which the caller hands over (their storage must be no one
/// else's): a block is 256 MiB at the head's default budget, and a fresh zeroed buffer for its gradient
/// cost 4% of the head's backward at Qwen's vocabulary in page faults and filling (`head_bench`).
pub(crate) fn logits_gradient(
    logits: Tensor,
    first: usize,
    targets: &[u32],
    scores: &Tensor,
    grad_scores: &Tensor,
    temperature: f64,
) -> Result<Tensor> {
    let logits = logits.contiguous()?;
    logits.inplace_op3(
        &scores.contiguous()?,
        &grad_scores.contiguous()?,
        &TargetScoresBackward {
            temperature,
            targets: targets.to_vec(),
            first,
        },
    )?;
    Ok(logits)
}

/// The logits' gradient: `(g_lp · (onehot − p) − g_H · p · (log p + H)) / temperature` per row, from the
/// logits, the forward's scores (normalizer and entropy) and the scores' gradient. The logits may be a
/// block of the vocabulary's columns, starting at `first`.
struct TargetScoresBackward {
    temperature: f64,
    targets: Vec<u32>,
    first: usize,
}

impl InplaceOp3 for TargetScoresBackward {
    fn name(&self) -> &'static str {
        "target-scores-backward"
    }

    fn cpu_fwd(
        &self,
        logits: &mut CpuStorage,
        logits_layout: &Layout,
        scores: &CpuStorage,
        scores_layout: &Layout,
        grad: &CpuStorage,
        grad_layout: &Layout,
    ) -> Result<()> {
        const WHAT: &str = "target-scores-backward";
        let vocab = logits_layout.shape().dims2()?.1;
        if scores.dtype() != logits.dtype() || grad.dtype() != logits.dtype() {
            candle_core::bail!(
                "{WHAT}: logits {:?}, scores {:?}, gradient {:?}",
                logits.dtype(),
                scores.dtype(),
                grad.dtype()
            );
        }
        let Some((start, end)) = logits_layout.contiguous_offsets() else {
            candle_core::bail!("{WHAT} of a non-contiguous tensor");
        };
        match logits {
            CpuStorage::F32(values) => backward(
                &mut values[start..end],
                (vocab, self.first),
                &self.targets,
                contiguous(scores, scores_layout, WHAT)?,
                contiguous(grad, grad_layout, WHAT)?,
                self.temperature as f32,
            ),
            CpuStorage::F64(values) => backward(
                &mut values[start..end],
                (vocab, self.first),
                &self.targets,
                contiguous(scores, scores_layout, WHAT)?,
                contiguous(grad, grad_layout, WHAT)?,
                self.temperature,
            ),
            other => candle_core::bail!("{WHAT}: logits are {:?}", other.dtype()),
        }
        Ok(())
    }
}

fn forward<T: Real>(logits: &[T], vocab: usize, targets: &[u32], temperature: T) -> Result<Vec<T>> {
    if let Some(&target) = targets.iter().find(|&&t| t as usize >= vocab) {
        candle_core::bail!("target token {target} is outside the vocabulary of {vocab}");
    }
    let mut scores = vec![T::ZERO; targets.len() * column::COUNT];
    for_each_chunk(&mut scores, column::COUNT, vocab, |index, scores| {
        let (row, target) = (&logits[index * vocab..][..vocab], targets[index]);
        let max = row
            .iter()
            .fold(T::NEG_INFINITY, |max, &z| Real::max(max, z / temperature));
        // Σ e and Σ e · (z/t − max), with e = exp(z/t − max): the entropy is log Σe − Σ e·(z/t − max) / Σe.
        let (sum, weighted) = row.iter().fold((T::ZERO, T::ZERO), |(sum, weighted), &z| {
            let shifted = z / temperature - max;
            let e = shifted.exp();
            // A −∞ logit contributes nothing (0 · −∞ would be NaN).
            let term = if e == T::ZERO { T::ZERO } else { e * shifted };
            (sum + e, weighted + term)
        });
        let log_sum = sum.ln();
        let target_logit = row[target as usize] / temperature;
        scores[column::LOGPROB] = target_logit - max - log_sum;
        scores[column::ENTROPY] = log_sum - weighted / sum;
        scores[column::TOP1] = if target_logit >= max { T::ONE } else { T::ZERO };
        scores[column::NORMALIZER] = max + log_sum;
    });
    Ok(scores)
}

/// `(vocab, first)`: the block's width and its first column in the vocabulary. The logits `values` are
/// replaced by their gradient.
fn backward<T: Real>(
    values: &mut [T],
    (vocab, first): (usize, usize),
    targets: &[u32],
    scores: &[T],
    grad: &[T],
    temperature: T,
) {
    for_each_chunk(values, vocab, vocab, |index, row| {
        let scores = &scores[index * column::COUNT..][..column::COUNT];
        let grad = &grad[index * column::COUNT..][..column::COUNT];
        let target = targets[index];
        let (g_logprob, g_entropy) = (grad[column::LOGPROB], grad[column::ENTROPY]);
        let (normalizer, entropy) = (scores[column::NORMALIZER], scores[column::ENTROPY]);
        if g_entropy == T::ZERO {
            for value in row.iter_mut() {
                *value = -g_logprob * (*value / temperature - normalizer).exp() / temperature;
            }
        } else {
            for value in row.iter_mut() {
                let logp = *value / temperature - normalizer;
                let p = logp.exp();
                // p · log p is 0 where p is (a −∞ logit).
                let entropy_term = if p == T::ZERO {
                    T::ZERO
                } else {
                    p * (logp + entropy)
                };
                *value = -(g_logprob * p + g_entropy * entropy_term) / temperature;
            }
        }
        if let Some(column) = (target as usize)
            .checked_sub(first)
            .filter(|&column| column < vocab)
        {
            row[column] += g_logprob / temperature;
        }
    });
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::testing::max_difference;

    fn logits(dtype: DType) -> Var {
        let values: Vec<f64> = (0..5 * 11)
            .map(|i| 3.0 * (i as f64 * 0.73).sin() + (i % 7) as f64 * 0.2)
            .collect();
        Var::from_tensor(
            &Tensor::from_vec(values, (5, 11), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap()
    }

    /// `Σ a · logprob + Σ b · entropy` (and the top-1 column times 7, which must not reach the logits).
    fn loss(scores: &Tensor) -> Tensor {
        let device = scores.device();
        let weights = Tensor::from_vec(
            vec![
                0.3, -1.1, 7.0, 0.0, //
                -0.5, 0.25, 7.0, 0.0, //
                1.5, 0.0, 7.0, 0.0, //
                0.0, 2.0, 7.0, 0.0, //
                -2.0, -0.75, 7.0, 0.0,
            ],
            (5, 4),
            device,
        )
        .unwrap()
        .to_dtype(scores.dtype())
        .unwrap();
        let top1 = scores.narrow(1, column::TOP1, 1).unwrap().detach();
        let detached = Tensor::cat(
            &[
                scores.narrow(1, 0, 2).unwrap(),
                top1,
                scores.narrow(1, 3, 1).unwrap().detach(),
            ],
            1,
        )
        .unwrap();
        (detached * weights).unwrap().sum_all().unwrap()
    }

    #[test]
    fn the_fused_head_gives_candles_figures_and_gradients() {
        let targets = Tensor::new(&[3u32, 0, 10, 7, 4], &Device::Cpu).unwrap();
        for (dtype, tolerance) in [(DType::F64, 1e-12), (DType::F32, 2e-6)] {
            for temperature in [1.0, 0.7] {
                let logits = logits(dtype);
                let fused = target_scores(logits.as_tensor(), &targets, temperature).unwrap();
                let plain = with_tensor_ops(logits.as_tensor(), &targets, temperature).unwrap();
                assert_eq!(fused.dims(), [5, column::COUNT]);
                assert!(
                    max_difference(&fused, &plain) < tolerance,
                    "{dtype:?} T={temperature}: {fused} vs {plain}"
                );
                let before = logits.as_tensor().copy().unwrap();
                let fused_grad = loss(&fused).backward().unwrap();
                assert_eq!(
                    max_difference(logits.as_tensor(), &before),
                    0.0,
                    "the backward writes its gradient over a copy, not the graph's logits"
                );
                let plain_grad = loss(&plain).backward().unwrap();
                let (fused_grad, plain_grad) = (
                    fused_grad.get(&logits).unwrap(),
                    plain_grad.get(&logits).unwrap(),
                );
                // Autograd keeps what a tracked gradient was computed from (its zeros, the copy)
                // alive beside it.
                assert!(
                    !fused_grad.track_op(),
                    "the logits' gradient carries no graph"
                );
                assert!(
                    max_difference(fused_grad, plain_grad) < tolerance,
                    "{dtype:?} T={temperature}: {fused_grad} vs {plain_grad}"
                );
            }
        }
    }

    #[test]
    fn the_top1_column_marks_targets_that_are_most_likely() {
        let logits = Tensor::new(&[[1f32, 5., 5.], [0., 2., 1.]], &Device::Cpu).unwrap();
        let targets = Tensor::new(&[2u32, 0], &Device::Cpu).unwrap();
        let scores = target_scores(&logits, &targets, 1.0).unwrap();
        let top1: Vec<f32> = scores
            .narrow(1, column::TOP1, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(top1, [1.0, 0.0], "a tie counts as most likely");
    }

    #[test]
    fn masked_logits_take_no_probability_and_give_finite_figures() {
        let inf = f64::NEG_INFINITY;
        let logits =
            Var::from_tensor(&Tensor::new(&[[0.5f64, inf, 1.5, inf]], &Device::Cpu).unwrap())
                .unwrap();
        let targets = Tensor::new(&[2u32], &Device::Cpu).unwrap();
        let scores = target_scores(logits.as_tensor(), &targets, 1.0).unwrap();
        let values: Vec<f64> = scores.flatten_all().unwrap().to_vec1().unwrap();
        // Two tokens with logits 0.5 and 1.5: p = (σ(−1), σ(1)).
        let p = 1.0 / (1.0 + (-1f64).exp());
        assert!(
            (values[column::LOGPROB] - p.ln()).abs() < 1e-12,
            "{values:?}"
        );
        let entropy = -(p * p.ln() + (1.0 - p) * (1.0 - p).ln());
        assert!(
            (values[column::ENTROPY] - entropy).abs() < 1e-12,
            "{values:?}"
        );
        let grads = loss_of_both(&scores).backward().unwrap();
        let grad: Vec<f64> = grads
            .get(&logits)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(grad.iter().all(|g| g.is_finite()), "{grad:?}");
        assert_eq!((grad[1], grad[3]), (0.0, 0.0), "{grad:?}");
    }

    fn loss_of_both(scores: &Tensor) -> Tensor {
        scores.narrow(1, 0, 2).unwrap().sum_all().unwrap()
    }

    #[test]
    fn a_target_outside_the_vocabulary_is_an_error() {
        let logits = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
        let targets = Tensor::new(&[1u32, 4], &Device::Cpu).unwrap();
        let error = target_scores(&logits, &targets, 1.0).unwrap_err();
        assert!(
            error.to_string().contains("outside the vocabulary of 4"),
            "{error}"
        );
    }

    /// Logits at `-inf` (a constraint's mask) score and train alike in the fused op and in candle's
    /// ops (the devices without the fused kernel): nothing is NaN, and the masked entries get no
    /// gradient.
    #[test]
    fn masked_logits_give_the_same_figures_both_ways() {
        let targets = Tensor::new(&[3u32, 0, 10, 7, 4], &Device::Cpu).unwrap();
        let mut bias = vec![0f64; 5 * 11];
        for (index, value) in bias.iter_mut().enumerate() {
            let (row, column) = (index / 11, index % 11);
            if (column + row) % 3 == 0 && column != [3, 0, 10, 7, 4][row] {
                *value = f64::NEG_INFINITY;
            }
        }
        let bias = Tensor::from_vec(bias, (5, 11), &Device::Cpu).unwrap();
        for temperature in [1.0, 0.7] {
            let logits = logits(DType::F64);
            let masked = logits.as_tensor().broadcast_add(&bias).unwrap();
            let fused = target_scores(&masked, &targets, temperature).unwrap();
            let plain = with_tensor_ops(&masked, &targets, temperature).unwrap();
            assert!(max_difference(&fused, &plain) < 1e-12, "{fused} vs {plain}");
            let fused_grad = loss(&fused).backward().unwrap();
            let plain_grad = loss(&plain).backward().unwrap();
            let (fused_grad, plain_grad) = (
                fused_grad.get(&logits).unwrap(),
                plain_grad.get(&logits).unwrap(),
            );
            assert!(max_difference(fused_grad, plain_grad) < 1e-12);
            let grads: Vec<f64> = fused_grad.flatten_all().unwrap().to_vec1().unwrap();
            let biases: Vec<f64> = bias.flatten_all().unwrap().to_vec1().unwrap();
            for (grad, bias) in grads.iter().zip(&biases) {
                assert!(grad.is_finite());
                if bias.is_infinite() {
                    assert_eq!(*grad, 0.0);
                }
            }
        }
    }
}
