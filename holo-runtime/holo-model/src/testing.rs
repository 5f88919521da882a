//! What the unit tests of this module's kernels and models share (and those of `train`).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use rand::{Rng, SeedableRng};

use super::config::{Arch, LayerSpec, ModelConfig, RopeScaling, Variant};
use super::init::{parameter_specs, Init};
use super::Model;

/// The largest absolute difference between two tensors of one shape, in f64.
pub fn max_difference(a: &Tensor, b: &Tensor) -> f64 {
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

/// The largest absolute value of a tensor, in f64.
pub fn max_abs(t: &Tensor) -> f64 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// The gradients of `Σ y · weights` (an upstream gradient of `weights` at `y`).
#[cfg(test)]
pub(crate) fn weighted_sum_gradients(
    y: &Tensor,
    weights: &Tensor,
) -> candle_core::backprop::GradStore {
    (y * weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap()
}

/// A CPU tensor of `shape` in `dtype` holding `sin(i · scale)` at flat index `i`: signed values of every
/// magnitude up to 1, which the tests tell apart by their scale.
/// Additive attention mask `[B, 1, T, S]` hiding, in row `b`, the keys `hidden(b, t, s)` says.
#[cfg(test)]
pub(crate) fn mask(
    batch: usize,
    len: usize,
    keys: usize,
    hidden: impl Fn(usize, usize, usize) -> bool,
) -> Tensor {
    let values: Vec<f32> = (0..batch * len * keys)
        .map(|i| {
            let (b, t, s) = (i / (len * keys), (i / keys) % len, i % keys);
            if hidden(b, t, s) {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(values, (batch, 1, len, keys), &Device::Cpu).unwrap()
}

#[cfg(test)]
pub(crate) fn sines(shape: impl Into<candle_core::Shape>, scale: f64, dtype: DType) -> Tensor {
    let shape = shape.into();
    let values: Vec<f64> = (0..shape.elem_count())
        .map(|i| (i as f64 * scale).sin())
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A one-layer model of small shapes (4 query heads over 2 key heads), with the biases, q/k norms,
/// attention window and RoPE of `arch`.
pub fn config(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 37,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 1,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        // Qwen3's heads are wider than hidden / heads.
        head_dim: if matches!(arch, Arch::Qwen3 | Arch::Gemma3) {
            6
        } else {
            4
        },
        max_position_embeddings: 256,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        tie_word_embeddings: true,
        qkv_bias: arch == Arch::Qwen2,
        o_bias: arch == Arch::Llama,
        mlp_bias: arch == Arch::Llama,
        variant: Variant {
            // Phi-3's partial rotary embedding: half of each head.
            rotary_dim: (arch == Arch::Phi3).then_some(2),
            ..Variant::of(arch)
        },
        // A window shorter than the tests' rows; SmolLM3's layer without RoPE.
        layers: vec![LayerSpec {
            window: matches!(
                arch,
                Arch::Mistral | Arch::Ministral | Arch::Olmo3 | Arch::Gemma2 | Arch::Gemma3
            )
            .then_some(3),
            rope: arch != Arch::SmolLm3,
            linear: false,
            experts: false,
        }],
        linear_attention: None,
        experts: None,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

/// Weights far from their defaults (norms and biases too), so that every term of the backward counts.
pub fn random_model(config: &ModelConfig, dtype: DType) -> Model {
    random_model_seeded(config, 7, dtype)
}

/// [`random_model`] with weights drawn from `seed`.
pub fn random_model_seeded(config: &ModelConfig, seed: u64, dtype: DType) -> Model {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut tensors = HashMap::new();
    for spec in parameter_specs(config) {
        let values: Vec<f64> = (0..spec.numel())
            .map(|_| {
                let noise = rng.random::<f64>() * 2.0 - 1.0;
                match spec.init {
                    Init::Normal => noise * 0.4,
                    Init::Zeros => noise * 0.2,
                    Init::Ones => 1.0 + noise * 0.5,
                    // Decay rates from e^-2 to e (log decays of −0.1 to −3 per token at unit inputs).
                    Init::LogUniform => noise * 1.5 - 0.5,
                }
            })
            .collect();
        let tensor = Tensor::from_vec(values, spec.shape.clone(), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        tensors.insert(spec.name, tensor);
    }
    Model::load(
        VarBuilder::from_tensors(tensors, dtype, &Device::Cpu),
        config,
    )
    .unwrap()
}

/// A random Qwen3 over the 512-token byte-level tokenizer of `holo init-model`, ended by `<|im_end|>`,
/// as a sampler: its replies are noise, so whatever shape they have is the sampling parameters' doing.
pub fn random_local_model() -> crate::LocalModel {
    let tokenizer = crate::init::build_tokenizer().unwrap();
    let config = ModelConfig {
        vocab_size: tokenizer.get_vocab_size(true),
        ..config(Arch::Qwen3)
    };
    let end = tokenizer.token_to_id("<|im_end|>").unwrap();
    crate::LocalModel::new(
        random_model(&config, DType::F32),
        tokenizer,
        holo_core::chat::ChatTemplate::chatml(),
        vec![end],
        crate::LocalOptions::default(),
    )
}
