//! The SFT loss of a micro-batch, as TRL 1.16's `SFTTrainer.compute_loss` takes it: minus the
//! log-probability of each trained token (`nll`; `dft` weighs it by the token's probability, detached),
//! summed over the micro-batch and divided by the trained tokens of the whole optimizer step
//! (`num_items_in_batch`, at least 1), so that the micro-batches' losses add up to the token mean of the
//! step; and its metrics, TRL's `entropy` and `mean_token_accuracy` (the mean entropy of the trained
//! positions' distributions and the fraction of trained tokens that are the most likely one; 0 without
//! trained tokens).

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use super::config::SftLossType;
use crate::batch::Sequence;
use crate::score;
use holo_model::Model;

/// One micro-batch's loss, gradients and metrics.
pub struct MicroBatch {
    pub loss: f64,
    pub grads: GradStore,
    /// `entropy` and `mean_token_accuracy`.
    pub metrics: BTreeMap<String, f64>,
}

/// The loss of `sequences` (one micro-batch) and its gradients, the backward run as `pass` says (the
/// load-balancing loss of a mixture-of-experts model added there).
pub fn micro_batch(
    model: &Model,
    sequences: &[&Sequence],
    num_items_in_batch: usize,
    loss_type: SftLossType,
    pass: score::Pass,
) -> candle_core::Result<MicroBatch> {
    let mut metrics = BTreeMap::from([
        ("entropy".to_string(), 0.0),
        ("mean_token_accuracy".to_string(), 0.0),
    ]);
    let (value, grads) = score::backward_sequences(model, sequences, 1.0, pass, |head| {
        let nll = head.logprobs.neg()?;
        let per_token = match loss_type {
            SftLossType::Nll => nll,
            SftLossType::Dft => (nll * head.logprobs.exp()?.detach())?,
        };
        let scalar = |tensor: Tensor| -> candle_core::Result<f64> {
            tensor.to_dtype(DType::F64)?.to_scalar::<f64>()
        };
        metrics.insert("entropy".into(), scalar(head.entropies.mean_all()?)?);
        metrics.insert("mean_token_accuracy".into(), scalar(head.top1.mean_all()?)?);
        if let Some(balance) = head.balance {
            metrics.insert("aux_loss".into(), balance);
        }
        per_token.sum_all()? / num_items_in_batch.max(1) as f64
    })?;
    let loss = value.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok(MicroBatch {
        loss,
        grads,
        metrics,
    })
}
