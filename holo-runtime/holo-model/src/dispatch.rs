//! What runs where: which implementation computes a projection's `x · wᵀ`, and the precision a device
//! samples and trains in.
//!
//! Our own products (`kernels/skinny.rs`, `local/product.rs`) are CPU code (candle custom ops with a CPU
//! kernel only); on a GPU every product is candle's, which runs on cuBLAS. The decisions take a
//! description of the operands ([`Operands`]) rather than tensors, so that the CUDA side of each is tested
//! on machines without a GPU.

use candle_core::{DType, DeviceLocation, Tensor};

pub use crate::kernels::kernel::Operands;
use crate::kernels::kernel::Ops;

impl Operands {
    /// `x` `[rows, in]` and `weight` `[out, in]`.
    pub fn of(x: &Tensor, weight: &Tensor) -> Operands {
        Operands {
            location: x.device().location(),
            x: x.dtype(),
            weight: weight.dtype(),
            rows: x.dims().first().copied().unwrap_or(0),
            inputs: x.dims().last().copied().unwrap_or(0),
            weight_elements: weight.elem_count(),
            // A variable, and any tensor computed from one, tracks its op.
            trained: weight.track_op(),
        }
    }

    pub fn on_cpu(&self) -> bool {
        self.location == DeviceLocation::Cpu
    }
}

/// The implementation of one projection's matrix product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Product {
    /// `skinny::matmul`: a few rows of f32 activations against bf16 or f32
    /// weights, on the CPU, no backward.
    Skinny,
    /// `product::matmul`: activations and a weight of one float type on the CPU, in gemm's faster
    /// orientation, the weight's gradient computed only when it is trained.
    Weight,
    /// candle's `matmul` (cuBLAS on CUDA).
    Candle,
}

/// The product `x · wᵀ` runs as, in a pass with `ops`.
pub fn product(ops: Ops, operands: &Operands) -> Product {
    let skinny = match ops {
        Ops::Fast => crate::kernels::skinny::suits(operands),
        Ops::Invariant => crate::kernels::skinny::takes(operands),
        // bf16 weights with f32 activations are the CPU's sampling-only models, which only these
        // kernels multiply (candle refuses mixed types); their differentiable passes score sequences.
        Ops::Differentiable => {
            operands.on_cpu() && operands.weight == DType::BF16 && operands.x == DType::F32
        }
    };
    if skinny {
        Product::Skinny
    } else if crate::kernels::product::suits(operands) {
        Product::Weight
    } else {
        Product::Candle
    }
}

/// Where a batch's tokens are drawn from its logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Draws {
    /// Every row's logits are read back and drawn from there ([`sample`](super::sample)): on the
    /// CPU, where reading them back moves nothing.
    Host,
    /// On the device, which reads back a chunk of each row (`local/draw.rs`): on a GPU, where a step's
    /// logits are tens of megabytes. Rows with top-k, top-p or top log-probabilities are still drawn
    /// on the host, from their own rows of logits.
    Device,
}

/// Where a model on `location` draws its tokens.
pub fn draws(location: DeviceLocation) -> Draws {
    match location {
        DeviceLocation::Cpu => Draws::Host,
        DeviceLocation::Cuda { .. } | DeviceLocation::Metal { .. } => Draws::Device,
    }
}

/// The weight precision a model samples in when none is asked for: f32 on the CPU (where candle has no
/// fast half-precision arithmetic; bf16 there is a memory saving, asked for with `--dtype bf16`), bf16 on
/// a GPU (half the memory and bandwidth of f32, tensor cores; what transformers runs Qwen2.5 in).
pub fn sampling_dtype(location: DeviceLocation) -> DType {
    match location {
        DeviceLocation::Cuda { .. } => DType::BF16,
        DeviceLocation::Cpu | DeviceLocation::Metal { .. } => DType::F32,
    }
}

/// The precision a model trains in on `location`: f32 on the CPU and Metal; bf16 on CUDA, weights, the
/// gradients and AdamW's moments alike, which is what TRL does with a checkpoint stored in bf16 (it loads
/// with `torch_dtype="auto"`, and torch's AdamW keeps its moments in the weights' type). Log-probabilities,
/// the loss and RMSNorm are computed in f32 in every case, and LoRA adapters are f32 over a bf16 base, as
/// PEFT casts them (`autocast_adapter_dtype`).
pub fn training_dtype(location: DeviceLocation) -> DType {
    sampling_dtype(location)
}

/// The type LoRA adapters are kept and trained in over a base of type `base`: f32 over half-precision
/// weights (PEFT's `autocast_adapter_dtype`), the base's own otherwise.
pub fn adapter_dtype(base: DType) -> DType {
    match base {
        DType::BF16 | DType::F16 => DType::F32,
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CUDA: DeviceLocation = DeviceLocation::Cuda { gpu_id: 0 };

    fn operands(location: DeviceLocation, x: DType, weight: DType, rows: usize) -> Operands {
        Operands {
            location,
            x,
            weight,
            rows,
            inputs: 1 << 10,
            weight_elements: 1 << 20,
            trained: false,
        }
    }

    #[test]
    fn on_cuda_every_product_is_candles() {
        let types = [DType::F32, DType::BF16, DType::F16];
        for ops in [Ops::Fast, Ops::Differentiable] {
            for x in types {
                for weight in types {
                    for rows in [1, 4, 16, 64, 4096] {
                        for trained in [false, true] {
                            let operands = Operands {
                                trained,
                                ..operands(CUDA, x, weight, rows)
                            };
                            assert_eq!(
                                product(ops, &operands),
                                Product::Candle,
                                "{ops:?} {operands:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn on_the_cpu_our_kernels_take_the_products_they_were_made_for() {
        let cpu = DeviceLocation::Cpu;
        // bf16 weights with f32 activations: only the skinny kernels compute them, sampling or scoring.
        for rows in [1, 64, 4096] {
            let bf16 = operands(cpu, DType::F32, DType::BF16, rows);
            assert_eq!(product(Ops::Fast, &bf16), Product::Skinny);
            assert_eq!(product(Ops::Differentiable, &bf16), Product::Skinny);
        }
        // Activations and weights of one float type, frozen or trained, prefill or training.
        for x in [DType::F32, DType::F64] {
            let frozen = operands(cpu, x, x, 4096);
            let trained = Operands {
                trained: true,
                ..frozen
            };
            for ops in [Ops::Fast, Ops::Differentiable] {
                assert_eq!(product(ops, &frozen), Product::Weight);
                assert_eq!(product(ops, &trained), Product::Weight);
            }
        }
        // Mixed types are candle's, which refuses them with its own error.
        let mixed = operands(cpu, DType::F64, DType::F32, 4096);
        assert_eq!(product(Ops::Differentiable, &mixed), Product::Candle);
    }

    #[test]
    fn a_gpu_draws_tokens_where_the_logits_are() {
        assert_eq!(draws(CUDA), Draws::Device);
        assert_eq!(draws(DeviceLocation::Cpu), Draws::Host);
    }

    #[test]
    fn a_gpu_samples_and_trains_in_bf16_the_cpu_in_f32() {
        assert_eq!(sampling_dtype(CUDA), DType::BF16);
        assert_eq!(
            training_dtype(DeviceLocation::Cuda { gpu_id: 3 }),
            DType::BF16
        );
        assert_eq!(sampling_dtype(DeviceLocation::Cpu), DType::F32);
        assert_eq!(training_dtype(DeviceLocation::Cpu), DType::F32);
        assert_eq!(adapter_dtype(DType::BF16), DType::F32);
        assert_eq!(adapter_dtype(DType::F32), DType::F32);
        assert_eq!(adapter_dtype(DType::F64), DType::F64);
    }
}
