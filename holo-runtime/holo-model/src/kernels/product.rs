//! `y = x · wᵀ` for an f32 or f64 weight on the CPU (the training forward, and prefill when sampling):
//! gemm in whichever orientation runs faster, and a backward that computes only the gradients wanted.
//!
//! - **Threads.** The products run on candle's barrier pool (`matrix`), as the layer's other operations do.
//! - **Orientation.** `x` `[M, K]` times `wᵀ` makes gemm read the weight column by column; with few rows
//!   (a micro-batch of short sequences) it reached 160–190 GFLOP/s at Qwen2.5-0.5B's shapes against
//!   350–440 for the same product written `(w · xᵀ)ᵀ`, whose transposition back is a copy of the output
//!   (`benches/README.md` has the measurements). [`swapped`] says when.
//! - **Gradients.** candle's matrix product always computes both operands' gradients. For a weight that is
//!   not trained (the base model under LoRA, a frozen reference) that meant `xᵀ · ∂y` for every frozen
//!   matrix, as much work as the forward product, summed into a weight-sized buffer nothing read: a
//!   quarter of a LoRA step's arithmetic. Here the weight gets its gradient only when it is trained, as
//!   `∂yᵀ · x`, already in the weight's layout.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use super::kernel::Operands;
use super::kernel::{Ops, Result};
use super::matrix::{multiply, storage_product};

/// Whether [`matmul`] applies: activations and weight of one float type (f32 or f64) on the CPU (the op
/// has no GPU kernel; there candle's product runs).
pub fn suits(operands: &Operands) -> bool {
    operands.on_cpu()
        && operands.x == operands.weight
        && matches!(operands.x, DType::F32 | DType::F64)
}

/// `x` `[M, K]` times `weight` `[N, K]` transposed: `[M, N]`. With [`Ops::Differentiable`], `x` gets
/// its gradient and `weight` gets one when it is trained (tracks its op).
pub fn matmul(x: &Tensor, weight: &Tensor, ops: Ops) -> Result<Tensor> {
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    match ops {
        Ops::Fast | Ops::Invariant => {
            x.apply_op2_no_bwd(&weight, &WeightProduct { trained: false })
        }
        Ops::Differentiable => x.apply_op2(
            &weight,
            WeightProduct {
                trained: weight.track_op(),
            },
        ),
    }
}

/// Whether `x · wᵀ` (`[M, K]` by `[N, K]`) is computed as `(w · xᵀ)ᵀ`: few rows against a large weight.
/// Measured on 2 Zen 4 cores (AVX-512 gemm): at M = 16–120 the swapped product is 1.1–3.8× faster for
/// 896 × 896, 896 × 4864 and 4864 × 896 weights; at M = 512 and beyond the plain one is as fast or
/// faster, and on weights of 64 × 512 and smaller it is faster at every M.
fn swapped(m: usize, n: usize, k: usize) -> bool {
    n * k >= 1 << 18 && 4 * m < n.min(k)
}

struct WeightProduct {
    trained: bool,
}

impl CustomOp2 for WeightProduct {
    fn name(&self) -> &'static str {
        "weight-product"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, n, k) = super::skinny::product_dims("weight", x_layout, w_layout)?;
        let product = if swapped(m, n, k) {
            let (columns, _) = storage_product((w, w_layout, false), (x, x_layout, true))?;
            match columns {
                CpuStorage::F32(values) => CpuStorage::F32(transpose(&values, n, m)),
                CpuStorage::F64(values) => CpuStorage::F64(transpose(&values, n, m)),
                other => candle_core::bail!("weight product of {:?}", other.dtype()),
            }
        } else {
            storage_product((x, x_layout, false), (w, w_layout, true))?.0
        };
        Ok((product, Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_x = multiply(grad_res, weight)?;
        let grad_weight = if self.trained {
            Some(multiply(&grad_res.t()?, x)?)
        } else {
            None
        };
        Ok((Some(grad_x), grad_weight))
    }
}

/// `values` `[rows, columns]` transposed to `[columns, rows]`, in tiles that stay in the L1 cache.
fn transpose<T: Copy + Default>(values: &[T], rows: usize, columns: usize) -> Vec<T> {
    const TILE: usize = 32;
    let mut out = vec![T::default(); values.len()];
    for row_start in (0..rows).step_by(TILE) {
        for column_start in (0..columns).step_by(TILE) {
            for row in row_start..(row_start + TILE).min(rows) {
                for column in column_start..(column_start + TILE).min(columns) {
                    out[column * rows + row] = values[row * columns + column];
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use candle_core::Var;

    use super::*;
    use crate::testing::{max_difference, sines, weighted_sum_gradients};

    /// The product and both gradients against candle's, in both orientations, trained or not.
    #[test]
    fn the_product_and_its_gradients_are_candles() {
        // (M, K, N): swapped (few rows, a large weight), and plain (a small weight; many rows).
        for (m, k, n) in [(3, 640, 512), (5, 16, 24), (200, 640, 512)] {
            assert_eq!(swapped(m, n, k), m == 3, "{m} {k} {n}");
            for dtype in [DType::F64, DType::F32] {
                let tolerance = if dtype == DType::F64 { 1e-12 } else { 1e-4 };
                let x = Var::from_tensor(&sines((m, k), 0.37, dtype)).unwrap();
                let trained = Var::from_tensor(&sines((n, k), 0.11, dtype)).unwrap();
                let frozen = trained.as_tensor().detach();
                let upstream = sines((m, n), 0.07, dtype);
                let plain = x
                    .as_tensor()
                    .matmul(&trained.as_tensor().t().unwrap())
                    .unwrap();
                let plain_grads = weighted_sum_gradients(&plain, &upstream);
                for weight in [trained.as_tensor(), &frozen] {
                    let ours = matmul(x.as_tensor(), weight, Ops::Differentiable).unwrap();
                    assert!(
                        max_difference(&ours, &plain) < tolerance,
                        "{m} {k} {n} {dtype:?}"
                    );
                    let grads = weighted_sum_gradients(&ours, &upstream);
                    let (ours_x, plain_x) = (grads.get(&x).unwrap(), plain_grads.get(&x).unwrap());
                    assert!(max_difference(ours_x, plain_x) < tolerance);
                    match grads.get(&trained) {
                        Some(ours_w) => {
                            assert!(weight.track_op(), "the frozen weight got a gradient");
                            let plain_w = plain_grads.get(&trained).unwrap();
                            assert!(max_difference(ours_w, plain_w) < tolerance);
                        }
                        None => assert!(!weight.track_op(), "the trained weight got no gradient"),
                    }
                }
                let fast = matmul(x.as_tensor(), &frozen, Ops::Fast).unwrap();
                assert!(max_difference(&fast, &plain) < tolerance);
                assert!(!fast.track_op(), "a sampling product keeps no graph");
            }
        }
    }

    #[test]
    fn transposing_tiles_covers_ragged_edges() {
        let values: Vec<u32> = (0..35 * 70).collect();
        let out = transpose(&values, 35, 70);
        for row in 0..35 {
            for column in 0..70 {
                assert_eq!(out[column * 35 + row], values[row * 70 + column]);
            }
        }
    }
}
