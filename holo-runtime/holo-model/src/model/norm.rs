//! RMSNorm, with Gemma's `(1 + w)` weights.

use super::*;

#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Tensor,
    eps: f64,
    /// The weight is stored as an offset from one (Gemma's `x̂ · (1 + w)`).
    offset: bool,
}

impl RmsNorm {
    pub(super) fn load(vb: VarBuilder, size: usize, config: &ModelConfig) -> Result<Self> {
        Ok(RmsNorm {
            weight: vb.get(size, "weight")?,
            eps: config.rms_norm_eps,
            offset: config.variant.norm_offset,
        })
    }

    /// A norm whose weight multiplies the normalized input as it is, whatever the family's other norms
    /// do (Gated DeltaNet's output norm).
    pub(super) fn plain(weight: Tensor, eps: f64) -> Self {
        RmsNorm {
            weight,
            eps,
            offset: false,
        }
    }

    /// What the normalized input is multiplied by: the weight, or one plus it.
    pub(crate) fn scale(&self) -> Result<Tensor> {
        match self.offset {
            true => self.weight.affine(1.0, 1.0),
            false => Ok(self.weight.clone()),
        }
    }

    pub(crate) fn forward(&self, xs: &Tensor, ops: Ops) -> Result<Tensor> {
        match ops {
            // One row at a time, each summed in order: the same bits whatever the batch.
            Ops::Fast | Ops::Invariant => {
                candle_nn::ops::rms_norm(&xs.contiguous()?, &self.scale()?, self.eps as f32)
            }
            Ops::Differentiable => Ok(self.forward_parts(xs)?.0),
        }
    }

    /// The differentiable forward, with what its backward reads: the normalized input (before the
    /// weight, in f32 or f64) and each row's root mean square `[.., 1]`.
    pub(crate) fn forward_parts(&self, xs: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let dtype = xs.dtype();
        let xs = match dtype {
            DType::F16 | DType::BF16 => xs.to_dtype(DType::F32)?,
            _ => xs.clone(),
        };
        let variance = xs.sqr()?.mean_keepdim(D::Minus1)?;
        let root = (variance + self.eps)?.sqrt()?;
        let normed = xs.broadcast_div(&root)?;
        let out = normed.to_dtype(dtype)?.broadcast_mul(&self.scale()?)?;
        Ok((out, normed, root))
    }
}
