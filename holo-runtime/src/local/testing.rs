//! What the unit tests of this module's kernels share.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor};

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

/// A CPU tensor of `shape` in `dtype` holding `sin(i · scale)` at flat index `i`: signed values of every
/// magnitude up to 1, which the tests tell apart by their scale.
pub(super) fn sines(shape: impl Into<Shape>, scale: f64, dtype: DType) -> Tensor {
    let shape = shape.into();
    let values: Vec<f64> = (0..shape.elem_count())
        .map(|i| (i as f64 * scale).sin())
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}
