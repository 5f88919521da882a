//! `y = x · wᵀ` for a weight that is not trained (the base model under LoRA, the tied output head), with
//! a backward that gives `x` its gradient and nothing to `w`.
//!
//! candle's matrix product always computes both gradients, so under LoRA every backward pass also
//! computed `xᵀ · ∂y` for each frozen matrix — as much work as the forward product — and summed it into a
//! weight-sized buffer that nothing read, the output head's 49152 × 576 among them. Skipping it removes a
//! quarter of the matrix arithmetic of a LoRA step with activation recomputation (forward, recomputed
//! forward, ∂x, and no more ∂w).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::dispatch::Operands;
use super::model::Result;

/// Whether [`matmul`] applies: a weight that is not trained, on the CPU (the op has no GPU kernel of its
/// own; there the plain product runs).
pub fn suits(operands: &Operands) -> bool {
    !operands.trained && operands.on_cpu() && operands.x == operands.weight
}

/// `x` `[M, K]` times `weight` `[N, K]` transposed: `[M, N]`; `x` receives its gradient, `weight` none.
pub fn matmul(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, FrozenMatmul)
}

struct FrozenMatmul;

impl CustomOp2 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, n, k) = super::skinny::product_dims("frozen", x_layout, w_layout)?;
        let product = x.matmul(w, (1, m, n, k), x_layout, &w_layout.transpose(0, 1)?)?;
        Ok((product, Shape::from((m, n))))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad_res.matmul(weight)?), None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    #[test]
    fn the_product_and_the_gradient_of_x_are_candles_and_the_weight_gets_none() {
        let device = Device::Cpu;
        let x = Var::from_vec(
            (0..12).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<_>>(),
            (3, 4),
            &device,
        )
        .unwrap();
        let w = Tensor::from_vec(
            (0..20).map(|i| (i as f32 * 0.11).cos()).collect::<Vec<_>>(),
            (5, 4),
            &device,
        )
        .unwrap();
        assert!(suits(&Operands::of(x.as_tensor(), &w)));
        let ours = matmul(x.as_tensor(), &w).unwrap();
        let plain = x.as_tensor().matmul(&w.t().unwrap()).unwrap();
        let difference = (&ours - &plain).unwrap().abs().unwrap().max_all().unwrap();
        assert!(difference.to_scalar::<f32>().unwrap() < 1e-6);

        let weights = Tensor::arange(0f32, 15., &device)
            .unwrap()
            .reshape((3, 5))
            .unwrap();
        let ours = (ours * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let plain = (plain * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (ours_x, plain_x) = (ours.get(&x).unwrap(), plain.get(&x).unwrap());
        let difference = (ours_x - plain_x)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(difference.to_scalar::<f32>().unwrap() < 1e-5);
        assert!(ours.get(&w).is_none(), "the frozen weight got a gradient");
    }

    #[test]
    fn a_trained_weight_keeps_the_plain_product() {
        let device = Device::Cpu;
        let x = Tensor::ones((2, 3), candle_core::DType::F32, &device).unwrap();
        let w = Var::ones((4, 3), candle_core::DType::F32, &device).unwrap();
        assert!(!suits(&Operands::of(&x, w.as_tensor())));
    }
}
