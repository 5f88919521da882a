//! The logits of one sequence under a local model, as the parity tests compare them.

use candle_core::{DType, Device, Tensor};
use holo_runtime::local::model::positions_from_mask;
use holo_runtime::local::{Model, Ops};

/// The logits `[T, vocab]` (f32, on the CPU) of one unpadded sequence.
pub fn sequence_logits(model: &Model, sequence: &[u32]) -> Vec<Vec<f32>> {
    logits(model, sequence, Ops::Fast)
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec2()
        .unwrap()
}

/// [`sequence_logits`] of an f64 model, in f64 (through the differentiable ops: candle's fused RMSNorm
/// has no f64).
pub fn sequence_logits_f64(model: &Model, sequence: &[u32]) -> Vec<Vec<f64>> {
    logits(model, sequence, Ops::Differentiable)
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec2()
        .unwrap()
}

/// The logits `[T, vocab]` of one unpadded sequence, on the CPU.
fn logits(model: &Model, sequence: &[u32], ops: Ops) -> Tensor {
    let device = model.device();
    let input = Tensor::new(sequence, device).unwrap().unsqueeze(0).unwrap();
    let mask = Tensor::ones((1, sequence.len()), DType::U8, device).unwrap();
    let hidden = model
        .forward_hidden(
            &input,
            &positions_from_mask(&mask).unwrap(),
            &mask,
            None,
            ops,
        )
        .unwrap();
    model
        .logits(&hidden.squeeze(0).unwrap(), ops)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
}

/// How far a model that samples from quantized blocks (`kept`) strays from the same weights
/// dequantized (`dense`): the largest |Δlogit| over a fixed 20-token sequence, and the largest
/// |logit| of the dequantized model, which the tests bound it by.
pub fn blocks_against_dequantized(dense: &Model, kept: &Model) -> (f32, f32) {
    let sequence: Vec<u32> = (0..20).map(|i| (i * 29 % 500) as u32).collect();
    let (a, b) = (
        sequence_logits(dense, &sequence),
        sequence_logits(kept, &sequence),
    );
    let largest = a.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let difference = a
        .iter()
        .zip(&b)
        .map(|(a, b)| super::json::max_diff(a, b))
        .fold(0.0, f32::max);
    (difference, largest)
}

/// A request for `max_tokens` greedy tokens after `prompt` (temperature 0), as the parity tests
/// compare a sampler's tokens with transformers' greedy ones.
pub fn greedy_request(prompt: Vec<u32>, max_tokens: usize) -> holo_runtime::sampler::Request {
    use holo_runtime::sampler::{Prompt, Request, SampleParams};
    Request {
        prompt: Prompt::Tokens(prompt),
        params: SampleParams {
            max_tokens: Some(max_tokens as u32),
            temperature: Some(0.0),
            ..SampleParams::default()
        },
    }
}
