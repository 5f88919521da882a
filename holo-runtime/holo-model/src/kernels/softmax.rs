//! Softmax over the last dimension on the CPU as one operation with a backward.
//!
//! candle's fused softmax has no backward, so the differentiable forward composed it (maximum,
//! subtraction, exponential, sum, division: five tensors the size of the attention scores, each kept by
//! the graph); at a small model's shapes that was a tenth of a training step's backward pass.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, D};

use super::kernel::{contiguous, for_each_chunk, Real};
use super::kernel::{Ops, Result};

/// `softmax(xs)` over the last dimension, f32 or f64 on the CPU: each row's exponentials of its
/// differences to the row's maximum, divided by their sum. Differentiable with [`Ops::Differentiable`].
pub fn softmax(xs: &Tensor, ops: Ops) -> Result<Tensor> {
    let xs = xs.contiguous()?;
    match ops {
        Ops::Fast | Ops::Invariant => xs.apply_op1_no_bwd(&Softmax),
        Ops::Differentiable => xs.apply_op1(Softmax),
    }
}

struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "softmax-last-dim"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let width = layout.shape().dims().last().copied().unwrap_or(1).max(1);
        let weights = match xs.dtype() {
            DType::F32 => CpuStorage::F32(rows::<f32>(contiguous(xs, layout, "softmax")?, width)),
            DType::F64 => CpuStorage::F64(rows::<f64>(contiguous(xs, layout, "softmax")?, width)),
            other => candle_core::bail!("softmax of {other:?}"),
        };
        Ok((weights, layout.shape().clone()))
    }

    /// `∂x = y · (∂y − Σ ∂y · y)` per row.
    fn bwd(&self, _xs: &Tensor, weights: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let projection = (grad * weights)?.sum_keepdim(D::Minus1)?;
        Ok(Some((grad.broadcast_sub(&projection)? * weights)?))
    }
}

fn rows<T: Real>(values: &[T], width: usize) -> Vec<T> {
    let mut out = vec![T::ZERO; values.len()];
    for_each_chunk(&mut out, width, width, |index, out| {
        let row = &values[index * width..][..width];
        let max = row
            .iter()
            .fold(T::NEG_INFINITY, |max, &x| Real::max(max, x));
        let mut sum = T::ZERO;
        for (out, &x) in out.iter_mut().zip(row) {
            *out = (x - max).exp();
            sum += *out;
        }
        for out in out.iter_mut() {
            *out /= sum;
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::testing::{max_difference, weighted_sum_gradients};

    #[test]
    fn softmax_and_its_gradient_are_candles() {
        let device = Device::Cpu;
        for dtype in [DType::F64, DType::F32] {
            let tolerance = if dtype == DType::F64 { 1e-12 } else { 1e-6 };
            let mut values: Vec<f64> = (0..4 * 7).map(|i| 4.0 * (i as f64 * 0.37).sin()).collect();
            // A masked entry, as attention's mask leaves.
            values[3] = f64::NEG_INFINITY;
            let xs = Var::from_tensor(
                &Tensor::from_vec(values, (2, 2, 7), &device)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap();
            let upstream = Tensor::from_vec(
                (0..28).map(|i| (i as f64 * 0.21).cos()).collect::<Vec<_>>(),
                (2, 2, 7),
                &device,
            )
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
            let ours = softmax(xs.as_tensor(), Ops::Differentiable).unwrap();
            let plain = candle_nn::ops::softmax(xs.as_tensor(), D::Minus1).unwrap();
            assert!(max_difference(&ours, &plain) < tolerance, "{dtype:?}");
            let fast = softmax(xs.as_tensor(), Ops::Fast).unwrap();
            assert!(max_difference(&fast, &ours) == 0.0);
            let (ours, plain) = (
                weighted_sum_gradients(&ours, &upstream),
                weighted_sum_gradients(&plain, &upstream),
            );
            let (ours, plain) = (ours.get(&xs).unwrap(), plain.get(&xs).unwrap());
            assert!(max_difference(ours, plain) < tolerance, "{dtype:?}");
            let masked: f64 = ours
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()[3];
            assert_eq!(masked, 0.0, "a masked entry gets no gradient");
        }
    }
}
