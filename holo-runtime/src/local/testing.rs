//! What the unit tests of this module's kernels share.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

/// The largest absolute difference between two tensors of one shape, in f64.
pub(super) fn max_difference(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// The gradients of `Σ y · weights` (an upstream gradient of `weights` at `y`).
pub(super) fn weighted_sum_gradients(y: &Tensor, weights: &Tensor) -> GradStore {
    (y * weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap()
}
