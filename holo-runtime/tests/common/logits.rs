//! The logits of one sequence under a local model, as the parity tests compare them.

use candle_core::{DType, Device, Tensor};
use holo_runtime::local::model::positions_from_mask;
use holo_runtime::local::{Model, Ops};

/// The logits `[T, vocab]` (f32, on the CPU) of one unpadded sequence.
pub fn sequence_logits(model: &Model, sequence: &[u32]) -> Vec<Vec<f32>> {
    let device = model.device();
    let input = Tensor::new(sequence, device).unwrap().unsqueeze(0).unwrap();
    let mask = Tensor::ones((1, sequence.len()), DType::U8, device).unwrap();
    let hidden = model
        .forward_hidden(
            &input,
            &positions_from_mask(&mask).unwrap(),
            &mask,
            None,
            Ops::Fast,
        )
        .unwrap();
    model
        .logits(&hidden.squeeze(0).unwrap(), Ops::Fast)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
        .to_vec2()
        .unwrap()
}
