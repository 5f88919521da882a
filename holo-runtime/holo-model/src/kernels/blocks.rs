//! The differentiable product with a frozen matrix kept as a GGUF file's quantized blocks (QLoRA's base):
//! `y = x · Wᵀ` forward and `∂x = ∂y · W` backward, `W` expanded from its blocks for the one product
//! and dropped after it, as bitsandbytes does. The graph keeps the blocks (shared with the model), not
//! the expanded matrix, so a training step holds one projection's f32 at a time on top of the blocks.
//! `W` gets no gradient: the blocks are frozen.
//!
//! The expanded values are exactly the dequantized model's, so the products equal that model's up to
//! the order of the sums. The sampler's products (`Ops::Fast`) are ggml's instead, which round each
//! row of activations to 8 bits per block.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::quantized::QTensor;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

use super::kernel::{contiguous, Result};
use super::matrix::multiply;

/// `x` `[rows, in]` times the transpose of `blocks` `[out, in]`, differentiable with respect to `x`.
pub(crate) fn matmul(x: &Tensor, blocks: &Arc<QTensor>) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Blocks(Arc::clone(blocks)))
}

/// The blocks expanded to `dtype`: the matrix one product multiplies by.
pub(crate) fn expand(blocks: &QTensor, dtype: DType) -> Result<Tensor> {
    blocks.dequantize(&Device::Cpu)?.to_dtype(dtype)
}

struct Blocks(Arc<QTensor>);

impl CustomOp1 for Blocks {
    fn name(&self) -> &'static str {
        "quantized-blocks-matmul"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, inputs) = layout.shape().dims2()?;
        let out = self.0.shape().dims2()?.0;
        let ys = match xs.dtype() {
            DType::F32 => {
                let x = Tensor::from_slice(
                    contiguous::<f32>(xs, layout, "blocks")?,
                    (rows, inputs),
                    &Device::Cpu,
                )?;
                CpuStorage::F32(product(&x, &self.0)?.flatten_all()?.to_vec1()?)
            }
            DType::F64 => {
                let x = Tensor::from_slice(
                    contiguous::<f64>(xs, layout, "blocks")?,
                    (rows, inputs),
                    &Device::Cpu,
                )?;
                CpuStorage::F64(product(&x, &self.0)?.flatten_all()?.to_vec1()?)
            }
            other => {
                candle_core::bail!("quantized blocks train in f32 or f64 arithmetic, not {other:?}")
            }
        };
        Ok((ys, Shape::from((rows, out))))
    }

    /// `∂x = ∂y · W`, the blocks expanded again (the forward's copy is gone).
    fn bwd(&self, _xs: &Tensor, _ys: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let weight = expand(&self.0, grad.dtype())?;
        Ok(Some(multiply(&grad.contiguous()?, &weight)?))
    }
}

/// `x · Wᵀ` with `W` expanded to `x`'s type.
fn product(x: &Tensor, blocks: &QTensor) -> Result<Tensor> {
    let weight = expand(blocks, x.dtype())?;
    multiply(x, &weight.t()?)
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;
    use candle_core::Var;

    use super::*;
    use crate::testing::{max_abs, max_difference, sines};

    /// The product and its gradient at the input equal those of the dequantized matrix as a plain
    /// tensor (candle's product and autograd), for each block type QLoRA keeps: the values multiplied are
    /// the same, so only the order of the f32 sums differs, a few units in the last place of the
    /// `in`-term sums (bound: `in · 2⁻²⁴` of `|x| · |W|ᵀ`, here 512 terms: 3e-5 relative).
    #[test]
    fn blocks_multiply_and_differentiate_as_their_dequantized_matrix() {
        let (out, inputs, rows) = (48, 512, 5);
        let weight = sines((out, inputs), 0.37, DType::F32);
        for dtype in [
            GgmlDType::Q8_0,
            GgmlDType::Q4_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let blocks = Arc::new(QTensor::quantize(&weight, dtype).unwrap());
            let dense = blocks.dequantize(&Device::Cpu).unwrap();
            let x = Var::from_tensor(&sines((rows, inputs), 0.11, DType::F32)).unwrap();
            let upstream = sines((rows, out), 0.23, DType::F32);
            let got = matmul(x.as_tensor(), &blocks).unwrap();
            let expected = x.as_tensor().matmul(&dense.t().unwrap()).unwrap();
            let scale = max_abs(
                &x.as_tensor()
                    .abs()
                    .unwrap()
                    .matmul(&dense.abs().unwrap().t().unwrap())
                    .unwrap(),
            );
            let limit = scale * inputs as f64 * f64::from(f32::EPSILON) / 2.0;
            let difference = max_difference(&got, &expected);
            assert!(
                difference <= limit,
                "{dtype:?} forward: {difference} > {limit}"
            );
            let grad_of = |ys: &Tensor| {
                let grads = (ys * &upstream)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                grads.get(x.as_tensor()).unwrap().clone()
            };
            let (got, expected) = (grad_of(&got), grad_of(&expected));
            let scale = max_abs(
                &upstream
                    .abs()
                    .unwrap()
                    .matmul(&dense.abs().unwrap())
                    .unwrap(),
            );
            let limit = scale * out as f64 * f64::from(f32::EPSILON) / 2.0;
            let difference = max_difference(&got, &expected);
            assert!(
                max_abs(&expected) > 100.0 * limit,
                "{dtype:?}: a gradient to compare"
            );
            assert!(
                difference <= limit,
                "{dtype:?} backward: {difference} > {limit}"
            );
        }
    }
}
