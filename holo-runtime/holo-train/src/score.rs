//! The policy's log-probabilities of the trained tokens, and their distributions' entropies.
//!
//! Sequences are laid out for one pass ([`pack`]: padded rows, or trees that share prefixes); the final
//! hidden states of the positions that predict a trained token are gathered (`[N, hidden]`) and only
//! those go through the output projection, divided by the sampling temperature as TRL's fused head
//! does: the logits of prompts and tool output are never built.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use super::batch::{Completion, Sequence};
use super::pack::{pack, Packed};
use holo_model::balance::Balance;
use holo_model::head::column;
use holo_model::model::RoutingDrift;
use holo_model::{Model, Ops};

pub type Result<T> = candle_core::Result<T>;

/// The sequences of `completions`, in order.
pub fn sequences(completions: &[Completion]) -> Vec<&Sequence> {
    completions.iter().flat_map(|c| &c.sequences).collect()
}

/// What the output projection gives at the positions that predict trained tokens.
pub struct Head {
    /// `[N]`: the log-probability of each trained token (differentiable).
    pub logprobs: Tensor,
    /// `[N]`: the entropy of each position's distribution (differentiable only with `entropy_gradient`).
    pub entropies: Tensor,
    /// `[N]` (f32, no gradient): 1 where the trained token is the most likely one (TRL's `is_top1`; on a
    /// tie, any of the most likely).
    pub top1: Tensor,
    /// Under routing replay (the sequences carry the sampler's routes): how often the trainer's own
    /// routers would have chosen other experts for the replayed tokens.
    pub routing: Option<RoutingDrift>,
    /// For a mixture-of-experts model trained with the load-balancing loss: its value over the pass
    /// (transformers' `aux_loss`, before `router_aux_loss_coef`).
    pub balance: Option<f64>,
}

/// The final hidden states `[N, hidden]` of the positions that predict `packed`'s trained tokens, from
/// those of every position `[R, T, hidden]`.
pub fn pick(hidden: &Tensor, packed: &Packed) -> Result<Tensor> {
    let (batch, len, size) = hidden.dims3()?;
    hidden
        .reshape((batch * len, size))?
        .index_select(&packed.rows, 0)
}

/// The [`Head`] of the trained tokens, from the final hidden states `[R, T, hidden]`; entropies are
/// differentiable only when `entropy_gradient` (for an entropy bonus).
pub fn head(
    model: &Model,
    hidden: &Tensor,
    packed: &Packed,
    temperature: f64,
    entropy_gradient: bool,
) -> Result<Head> {
    let scores = model.constrained_head_scores(
        &pick(hidden, packed)?,
        &packed.targets,
        temperature,
        &packed.allowed,
    )?;
    let scores_column = |index| scores.narrow(1, index, 1)?.squeeze(1);
    let entropies = scores_column(column::ENTROPY)?;
    Ok(Head {
        logprobs: scores_column(column::LOGPROB)?,
        entropies: if entropy_gradient {
            entropies
        } else {
            entropies.detach()
        },
        top1: scores_column(column::TOP1)?.detach().to_dtype(DType::F32)?,
        routing: packed
            .layout
            .routing
            .as_ref()
            .map(|routing| routing.drift()),
        balance: match &packed.layout.balance {
            Some(balance) => balance.value()?,
            None => None,
        },
    })
}

/// Log-probabilities (without gradient) of the trained tokens of `completions` under `model`, one vector
/// per completion (its sequences' in order); see [`sequence_logprobs`].
pub fn logprobs(
    model: &Model,
    completions: &[Completion],
    temperature: f64,
    batch: usize,
) -> Result<Vec<Vec<f32>>> {
    let mut per_sequence =
        sequence_logprobs(model, &sequences(completions), temperature, batch)?.into_iter();
    Ok(completions
        .iter()
        .map(|completion| {
            per_sequence
                .by_ref()
                .take(completion.sequences.len())
                .flatten()
                .collect()
        })
        .collect())
}

/// Log-probabilities (without gradient) of the trained tokens of each sequence under `model`, in order;
/// sequences go through the model `batch` at a time. The arithmetic is the training forward's, so that
/// ratios against these start at exactly 1.
pub fn sequence_logprobs(
    model: &Model,
    sequences: &[&Sequence],
    temperature: f64,
    batch: usize,
) -> Result<Vec<Vec<f32>>> {
    let model = model.detached();
    let model = &model;
    let mut flat = Vec::with_capacity(sequences.iter().map(|s| s.trained.len()).sum());
    for chunk in sequences.chunks(batch.max(1)) {
        let packed = pack(chunk, model)?;
        if packed.tokens == 0 {
            continue;
        }
        let hidden = final_hidden(model, &packed, Ops::Differentiable)?;
        let scored = head(model, &hidden, &packed, temperature, false)?;
        flat.extend(scored.logprobs.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    let mut offset = 0;
    Ok(sequences
        .iter()
        .map(|sequence| {
            let values = flat[offset..offset + sequence.trained.len()].to_vec();
            offset += sequence.trained.len();
            values
        })
        .collect())
}

/// The final hidden states `[R, T, hidden]` of `packed`'s rows.
pub fn final_hidden(model: &Model, packed: &Packed, ops: Ops) -> Result<Tensor> {
    model.forward_hidden_in(&packed.ids, &packed.layout, ops)
}

/// How a backward pass runs: with the whole graph kept or one layer's at a time, with the entropy's
/// gradient or not, with the load-balancing loss or not.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pass {
    /// Activation recomputation: one layer's graph alive at a time.
    pub recompute: bool,
    /// The entropies of [`Head`] carry their gradient (for an entropy bonus).
    pub entropy_gradient: bool,
    /// For a mixture-of-experts model, what the load-balancing loss is added to the loss with
    /// (`router_aux_loss_coef` over the micro-batches it is summed over); 0 adds none.
    pub balance: f64,
}

/// The gradients of `loss(head)` over `completions`' trained tokens (see [`head`]), plus the
/// load-balancing loss where `pass` asks for it; returns the loss's value and the gradients.
pub fn backward(
    model: &Model,
    completions: &[Completion],
    temperature: f64,
    pass: Pass,
    loss: impl FnOnce(&Head) -> Result<Tensor>,
) -> Result<(Tensor, GradStore)> {
    backward_sequences(model, &sequences(completions), temperature, pass, loss)
}

/// [`backward`] over sequences.
pub fn backward_sequences(
    model: &Model,
    sequences: &[&Sequence],
    temperature: f64,
    pass: Pass,
    loss: impl FnOnce(&Head) -> Result<Tensor>,
) -> Result<(Tensor, GradStore)> {
    let Pass {
        recompute,
        entropy_gradient,
        balance,
    } = pass;
    let mut packed = pack(sequences, model)?;
    if balance != 0.0 && model.config.experts.is_some() {
        // The model's pass adds it where it recomputes; with the graph kept, it is added below.
        packed.layout.balance = Some(Arc::new(Balance::new(packed.holders.clone(), balance)));
    }
    if packed.tokens == 0 {
        // Nothing trained in this micro-batch: no gradient, as TRL's zero loss gives.
        let zero = Tensor::zeros((), model.logits_dtype(), model.device())?;
        return Ok((zero, GradStore::default()));
    }
    if recompute {
        model.backward_recomputed_with_head(&packed.ids, &packed.layout, &[], |hidden| {
            loss(&head(
                model,
                hidden,
                &packed,
                temperature,
                entropy_gradient,
            )?)
        })
    } else {
        let hidden = final_hidden(model, &packed, Ops::Differentiable)?;
        let mut value = loss(&head(
            model,
            &hidden,
            &packed,
            temperature,
            entropy_gradient,
        )?)?;
        if let Some(balance) = &packed.layout.balance {
            if let Some(weighted) = balance.weighted()? {
                let dtype = value.dtype();
                value = (value + weighted.to_dtype(dtype)?)?;
            }
        }
        let grads = value.backward()?;
        Ok((value.detach(), grads))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;
    use crate::pack::tests::sequence;
    use holo_model::config::Arch;
    use holo_model::testing::{config, max_difference, random_model};

    /// The training head in blocks (a budget of three rows of logits) gives the loss and every
    /// weight's gradient of the whole head, with the graph kept and with layers recomputed, the
    /// entropy's gradient included.
    #[test]
    fn a_head_in_blocks_trains_as_the_whole_head() {
        let sequences = [
            sequence(&[5, 6, 7, 8, 9, 10, 11, 12, 13], 6..9),
            sequence(&[5, 6, 7, 8, 9, 10, 14, 15], 5..8),
            sequence(&[20, 21, 22, 23, 24], 2..5),
        ];
        let sequences: Vec<&Sequence> = sequences.iter().collect();
        let base = random_model(&config(Arch::Qwen2), DType::F64);
        let vocab = base.config.vocab_size;
        let (whole, vars) = base.trainable().unwrap();
        let blocked = whole.clone().with_head_budget(3 * vocab);
        let loss = |head: &Head| {
            let weights =
                Tensor::arange(0u32, head.logprobs.dim(0)? as u32, head.logprobs.device())?
                    .to_dtype(DType::F64)?
                    .affine(0.3, -1.0)?;
            head.logprobs.mul(&weights)?.sum_all()? - (head.entropies.sum_all()? * 0.1)?
        };
        let pass = |recompute| Pass {
            recompute,
            entropy_gradient: true,
            balance: 0.0,
        };
        for recompute in [false, true] {
            let (a, grads_a) =
                backward_sequences(&whole, &sequences, 0.9, pass(recompute), loss).unwrap();
            let (b, grads_b) =
                backward_sequences(&blocked, &sequences, 0.9, pass(recompute), loss).unwrap();
            assert!(
                max_difference(&a, &b) < 1e-12,
                "recompute {recompute}: loss"
            );
            for (name, var) in &vars {
                let (x, y) = (
                    grads_a.get(var.as_tensor()).unwrap(),
                    grads_b.get(var.as_tensor()).unwrap(),
                );
                assert!(
                    max_difference(x, y) < 1e-10,
                    "recompute {recompute}: {name} differs by {}",
                    max_difference(x, y)
                );
            }
        }
    }
}
