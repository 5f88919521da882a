//! Rotary position embeddings on the CPU as one operation with a backward.
//!
//! candle's fused `rope` has no backward, so the differentiable forward wrote the rotation out of tensor
//! operations (two concatenations of the tables, a negation, two narrowings and a concatenation, two
//! products, a sum): at a small model's shapes these were an eighth of a training step's backward pass.
//! The rotation is orthogonal: its backward is the rotation by the opposite angle, the same kernel with
//! the sines negated.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use super::kernel::{contiguous, for_each_chunk, Real};
use super::kernel::{Ops, Result};

/// `xs` `[B, heads, T, head_dim]` rotated by per-row tables `cos`, `sin` `[B, T, head_dim / 2]`
/// (rotate-half layout): `(x1, x2) ↦ (x1·cos − x2·sin, x2·cos + x1·sin)`, f32 or f64 on the CPU.
/// Differentiable in `xs` with [`Ops::Differentiable`].
pub fn rope(xs: &Tensor, cos: &Tensor, sin: &Tensor, ops: Ops) -> Result<Tensor> {
    let rotation = Rotation { inverse: false };
    let (xs, cos, sin) = (xs.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    match ops {
        Ops::Fast | Ops::Invariant => xs.apply_op3_no_bwd(&cos, &sin, &rotation),
        Ops::Differentiable => xs.apply_op3(&cos, &sin, rotation),
    }
}

/// The rotation's transpose (its inverse) applied to `dy`: the gradient at the input of [`rope`].
pub fn rope_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    dy.contiguous()?.apply_op3_no_bwd(
        &cos.contiguous()?,
        &sin.contiguous()?,
        &Rotation { inverse: true },
    )
}

struct Rotation {
    /// Rotate by the opposite angles.
    inverse: bool,
}

impl CustomOp3 for Rotation {
    fn name(&self) -> &'static str {
        "rotary-embedding"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xs_layout: &Layout,
        cos: &CpuStorage,
        cos_layout: &Layout,
        sin: &CpuStorage,
        sin_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (batch, heads, len, dim) = xs_layout.shape().dims4()?;
        let (table_batch, table_len, half) = cos_layout.shape().dims3()?;
        if table_batch != batch
            || table_len != len
            || half * 2 != dim
            || sin_layout.shape() != cos_layout.shape()
        {
            candle_core::bail!(
                "rotary embedding of {:?} with tables {:?} and {:?}",
                xs_layout.shape(),
                cos_layout.shape(),
                sin_layout.shape()
            );
        }
        let shape = Shape::from((batch, heads, len, dim));
        if cos.dtype() != xs.dtype() || sin.dtype() != xs.dtype() {
            candle_core::bail!(
                "rotary embedding of {:?} with {:?} tables",
                xs.dtype(),
                cos.dtype()
            );
        }
        const WHAT: &str = "rotary embedding";
        let rotated = match xs.dtype() {
            DType::F32 => CpuStorage::F32(rotate::<f32>(
                contiguous(xs, xs_layout, WHAT)?,
                contiguous(cos, cos_layout, WHAT)?,
                contiguous(sin, sin_layout, WHAT)?,
                (heads, len, half),
                self.inverse,
            )),
            DType::F64 => CpuStorage::F64(rotate::<f64>(
                contiguous(xs, xs_layout, WHAT)?,
                contiguous(cos, cos_layout, WHAT)?,
                contiguous(sin, sin_layout, WHAT)?,
                (heads, len, half),
                self.inverse,
            )),
            other => candle_core::bail!("{WHAT} of {other:?}"),
        };
        Ok((rotated, shape))
    }

    fn bwd(
        &self,
        _xs: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad_res.contiguous()?.apply_op3_no_bwd(
            cos,
            sin,
            &Rotation {
                inverse: !self.inverse,
            },
        )?;
        Ok((Some(grad), None, None))
    }
}

fn rotate<T: Real>(
    xs: &[T],
    cos: &[T],
    sin: &[T],
    (heads, len, half): (usize, usize, usize),
    inverse: bool,
) -> Vec<T> {
    let dim = 2 * half;
    let mut out = vec![T::ZERO; xs.len()];
    for_each_chunk(&mut out, len * dim, len * dim, |sequence_head, out| {
        let xs = &xs[sequence_head * len * dim..][..len * dim];
        let tables = (sequence_head / heads) * len * half;
        for t in 0..len {
            let cos = &cos[tables + t * half..][..half];
            let sin = &sin[tables + t * half..][..half];
            let (x1, x2) = xs[t * dim..][..dim].split_at(half);
            let (out1, out2) = out[t * dim..][..dim].split_at_mut(half);
            for i in 0..half {
                let sin = if inverse { -sin[i] } else { sin[i] };
                out1[i] = x1[i] * cos[i] - x2[i] * sin;
                out2[i] = x2[i] * cos[i] + x1[i] * sin;
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Var, D};

    use super::*;
    use crate::testing::{max_difference, sines, weighted_sum_gradients};

    /// The rotation written with tensor operations, as the differentiable forward did before.
    fn written_out(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let cos = Tensor::cat(&[cos, cos], D::Minus1)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let sin = Tensor::cat(&[sin, sin], D::Minus1)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let half = xs.dim(D::Minus1).unwrap() / 2;
        let rotated = Tensor::cat(
            &[
                &xs.narrow(D::Minus1, half, half).unwrap().neg().unwrap(),
                &xs.narrow(D::Minus1, 0, half).unwrap(),
            ],
            D::Minus1,
        )
        .unwrap();
        (xs.broadcast_mul(&cos).unwrap() + rotated.broadcast_mul(&sin).unwrap()).unwrap()
    }

    #[test]
    fn the_rotation_and_its_gradient_match_the_written_out_rotation() {
        let (batch, heads, len, half) = (2, 3, 5, 4);
        for dtype in [DType::F64, DType::F32] {
            let xs = Var::from_tensor(&sines((batch, heads, len, 2 * half), 0.31, dtype)).unwrap();
            let cos = sines((batch, len, half), 0.7, dtype);
            let sin = sines((batch, len, half), 1.3, dtype);
            let upstream = sines(xs.dims(), 0.19, dtype);
            let ours = rope(xs.as_tensor(), &cos, &sin, Ops::Differentiable).unwrap();
            let plain = written_out(xs.as_tensor(), &cos, &sin);
            let bits = |t: &Tensor| -> Vec<f64> {
                t.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            assert_eq!(bits(&ours), bits(&plain), "{dtype:?}: the same arithmetic");
            let fast = rope(xs.as_tensor(), &cos, &sin, Ops::Fast).unwrap();
            assert_eq!(bits(&fast), bits(&plain));
            let (ours, plain) = (
                weighted_sum_gradients(&ours, &upstream),
                weighted_sum_gradients(&plain, &upstream),
            );
            let difference = max_difference(ours.get(&xs).unwrap(), plain.get(&xs).unwrap());
            assert!(difference < 1e-6, "{dtype:?}: {difference}");
            // The backward is the inverse rotation: rotating back gives the input.
            let back = rope_backward(
                &rope(xs.as_tensor(), &cos, &sin, Ops::Fast).unwrap(),
                &cos,
                &sin,
            )
            .unwrap();
            let cos_sin_one = (cos.sqr().unwrap() + sin.sqr().unwrap()).unwrap();
            // Tables of a real rotation have cos² + sin² = 1; these do not, so compare to x · (cos² + sin²).
            let expected = xs
                .as_tensor()
                .broadcast_mul(
                    &Tensor::cat(&[&cos_sin_one, &cos_sin_one], D::Minus1)
                        .unwrap()
                        .unsqueeze(1)
                        .unwrap(),
                )
                .unwrap();
            let difference = max_difference(&back, &expected);
            assert!(difference < 1e-6, "{dtype:?}: {difference}");
        }
    }
}
