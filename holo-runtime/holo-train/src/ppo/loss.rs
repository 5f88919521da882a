//! PPO's clipped losses over one micro-batch's trained tokens, as TRL's `PPOTrainer.train` computes them:
//! each a mean over the micro-batch's tokens (TRL's `masked_mean`), their sum `pg_loss + vf_coef ·
//! vf_loss` the micro-batch's loss.

use candle_core::{DType, Result, Tensor};

/// Sum over the tokens whose `mask` is 1, divided by their count (TRL's `masked_mean`).
pub fn masked_mean(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    (values * mask)?.sum_all()? / mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?
}

/// The policy loss and what TRL logs of it.
pub struct PolicyLoss {
    /// `mean(max(−A·r, −A·clip(r, 1 − ε, 1 + ε)))` (differentiable).
    pub loss: Tensor,
    /// The fraction of tokens whose clipped term is the larger (`policy/clipfrac_avg`).
    pub clipfrac: f64,
    /// `0.5 · mean((log r)²)` (`policy/approxkl_avg`).
    pub approxkl: f64,
    /// The mean ratio (`val/ratio`).
    pub ratio: f64,
}

/// PPO's clipped surrogate of the policy's `logprobs` (differentiable) against those at sampling
/// (`old`), with per-token `advantages`, over the tokens of `mask`.
pub fn policy_loss(
    logprobs: &Tensor,
    old: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cliprange: f64,
) -> Result<PolicyLoss> {
    let log_ratio = (logprobs - old)?;
    let ratio = log_ratio.exp()?;
    let unclipped = (advantages.neg()? * &ratio)?;
    let clipped = (advantages.neg()? * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)?)?;
    let loss = masked_mean(&unclipped.maximum(&clipped)?, mask)?;
    let scalar = |tensor: Tensor| -> Result<f64> {
        masked_mean(&tensor, mask)?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()
    };
    let clipfrac = scalar(clipped.gt(&unclipped)?.to_dtype(mask.dtype())?)?;
    let approxkl = 0.5 * scalar(log_ratio.detach().sqr()?)?;
    let ratio = scalar(ratio.detach())?;
    Ok(PolicyLoss {
        loss,
        clipfrac,
        approxkl,
        ratio,
    })
}

/// The value loss and the fraction of tokens where its clipped term is the larger (`val/clipfrac_avg`).
pub struct ValueLoss {
    /// `0.5 · mean(max((V − R)², (clip(V, V_old ± ε_v) − R)²))` (differentiable).
    pub loss: Tensor,
    pub clipfrac: f64,
}

/// PPO's clipped value loss of the predictions `values` (differentiable) against `returns`, clipped to
/// `cliprange_value` around the values at sampling (`old`), over the tokens of `mask`.
pub fn value_loss(
    values: &Tensor,
    old: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    cliprange_value: f64,
) -> Result<ValueLoss> {
    let clipped_values = values
        .maximum(&(old - cliprange_value)?)?
        .minimum(&(old + cliprange_value)?)?;
    let unclipped = (values - returns)?.sqr()?;
    let clipped = (clipped_values - returns)?.sqr()?;
    let loss = (masked_mean(&unclipped.maximum(&clipped)?, mask)? * 0.5)?;
    let clipfrac = masked_mean(&clipped.gt(&unclipped)?.to_dtype(mask.dtype())?, mask)?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    Ok(ValueLoss { loss, clipfrac })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn tensor(values: &[f32]) -> Tensor {
        Tensor::new(values, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_policy_loss_clips_the_ratio_in_the_advantages_direction_only() {
        // Ratios e^0.5 ≈ 1.65 (clipped to 1.2 for A > 0) and e^-0.5 ≈ 0.61 (for A > 0, unclipped wins).
        let new = tensor(&[0.5, -0.5, 0.0]);
        let old = tensor(&[0.0, 0.0, 0.0]);
        let advantages = tensor(&[1.0, 1.0, 2.0]);
        let mask = tensor(&[1.0, 1.0, 0.0]);
        let loss = policy_loss(&new, &old, &advantages, &mask, 0.2).unwrap();
        let value = loss.loss.to_scalar::<f32>().unwrap();
        let expected = (-1.2 + -(-0.5f32).exp()) / 2.0;
        assert!((value - expected).abs() < 1e-6, "{value} vs {expected}");
        assert!((loss.clipfrac - 0.5).abs() < 1e-9);
        assert!((loss.approxkl - 0.125).abs() < 1e-7);
    }

    #[test]
    fn the_value_loss_takes_the_worse_of_the_clipped_and_unclipped_errors() {
        let values = tensor(&[1.0, 0.0]);
        let old = tensor(&[0.0, 0.0]);
        let returns = tensor(&[1.0, 1.0]);
        let mask = tensor(&[1.0, 1.0]);
        let loss = value_loss(&values, &old, &returns, &mask, 0.2).unwrap();
        // Token 0: unclipped 0, clipped (0.2 − 1)² = 0.64; token 1: 1 and 1.
        let value = loss.loss.to_scalar::<f32>().unwrap();
        assert!((value - 0.5 * (0.64 + 1.0) / 2.0).abs() < 1e-6);
        assert!((loss.clipfrac - 0.5).abs() < 1e-9);
    }
}
