//! The candle model: gradients reach every weight and match finite differences, the fast and the
//! differentiable paths agree, the KV cache and left padding change nothing, sampling follows its
//! parameters. Parity with transformers is in `local_parity.rs`.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use holo_runtime::local::generate::{generate, generate_streaming, GenerationParams, Stopping};
use holo_runtime::local::init::parameter_specs;
use holo_runtime::local::model::{
    checkpoint_tensors, positions_from_mask, KvCache, LoraConfig, Segment, Targets, PROJECTIONS,
};
use holo_runtime::local::testing::random_model_seeded;
use holo_runtime::local::{
    Arch, ClampedSwiGlu, Experts, LayerSpec, LinearAttention, Model, ModelConfig, Ops, RopeScaling,
    Variant,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Every family, each with what sets it apart: Qwen2's q/k/v biases, Qwen3's q/k norms over heads wider
/// than hidden / heads, Llama 3's rope scaling and untied head, Mistral's window (3 positions, shorter
/// than the tests' rows) on every layer and Ministral's on one of two, SmolLM3's layer without RoPE,
/// OLMo 2's norms after attention and the MLP, OLMo 3's window, Gemma 3's offset norms, GeGLU, query
/// scale and windowed layer with its own RoPE, Gemma 2's soft-caps (attention 1, logits 2: small
/// enough to bend these scores and logits) and windowed layer, Phi-3's fused projections and half-rotated heads,
/// Qwen3.5's linear attention, its mixture's experts and shared expert (on both layers), Qwen3-MoE's
/// experts (on the second layer; a dense MLP on the first),
/// gpt-oss's sinks, biases, YaRN, window on the first layer and clamped experts with biases on both
/// (the clamp at 2, which some of these activations reach).
const ARCHS: [Arch; 15] = holo_runtime::local::init::ARCHS;

fn config(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 37,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: match arch {
            Arch::Qwen3 | Arch::Gemma2 | Arch::Gemma3 | Arch::Qwen3Moe => 6,
            Arch::Qwen3_5 | Arch::Qwen3_5Moe => 8,
            _ => 4,
        },
        max_position_embeddings: 256,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: match arch {
            Arch::Llama => RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16,
            },
            Arch::GptOss => RopeScaling::Yarn {
                factor: 4.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position_embeddings: 16,
                truncate: false,
                attention_factor: 1.1,
            },
            _ => RopeScaling::None,
        },
        tie_word_embeddings: arch == Arch::Qwen2,
        qkv_bias: matches!(arch, Arch::Qwen2 | Arch::GptOss),
        o_bias: arch == Arch::GptOss,
        mlp_bias: false,
        variant: Variant {
            rotary_dim: (arch == Arch::Phi3 || arch.is_qwen3_5()).then_some(2),
            attention_softcap: (arch == Arch::Gemma2).then_some(1.0),
            final_softcap: (arch == Arch::Gemma2).then_some(2.0),
            ..Variant::of(arch)
        },
        layers: (0..2)
            .map(|layer| LayerSpec {
                window: match arch {
                    Arch::Mistral => Some(3),
                    Arch::Ministral | Arch::Olmo3 | Arch::Gemma2 | Arch::Gemma3 | Arch::GptOss
                        if layer == 0 =>
                    {
                        Some(3)
                    }
                    _ => None,
                },
                rope: arch != Arch::SmolLm3 || layer == 0,
                linear: arch.is_qwen3_5() && layer == 0,
                experts: (arch == Arch::Qwen3Moe && layer == 1)
                    || matches!(arch, Arch::GptOss | Arch::Qwen3_5Moe),
            })
            .collect(),
        linear_attention: arch.is_qwen3_5().then_some(LinearAttention {
            key_heads: 2,
            value_heads: 4,
            key_head_dim: 4,
            value_head_dim: 3,
            conv_kernel: 4,
        }),
        experts: matches!(arch, Arch::Qwen3Moe | Arch::Qwen3_5Moe | Arch::GptOss).then(|| {
            Experts {
                count: 5,
                per_token: 2,
                intermediate_size: 7,
                normalize: arch == Arch::Qwen3_5Moe,
                aux_loss_coef: 0.001,
                aux_loss: false,
                softmax_over_chosen: arch == Arch::GptOss,
                clamped: (arch == Arch::GptOss).then_some(ClampedSwiGlu {
                    alpha: 1.702,
                    limit: 2.0,
                }),
                shared: (arch == Arch::Qwen3_5Moe).then_some(5),
            }
        }),
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

/// The gradient of `var`, or zeros for an expert no token was routed to (autograd leaves none: the
/// loss does not depend on it).
fn gradient_or_unrouted(
    grads: &candle_core::backprop::GradStore,
    var: &candle_core::Var,
    name: &str,
) -> Tensor {
    match grads.get(var.as_tensor()) {
        Some(grad) => grad.clone(),
        None if name.contains(".mlp.experts.") => var.as_tensor().zeros_like().unwrap(),
        None => panic!("no gradient for {name}"),
    }
}

fn ids(rows: &[&[u32]]) -> (Tensor, Tensor) {
    let width = rows.iter().map(|row| row.len()).max().unwrap();
    let mut flat = Vec::new();
    let mut mask = Vec::new();
    for row in rows {
        // Right padding with token 0.
        flat.extend_from_slice(row);
        flat.extend(std::iter::repeat_n(0u32, width - row.len()));
        mask.extend(std::iter::repeat_n(1u8, row.len()));
        mask.extend(std::iter::repeat_n(0u8, width - row.len()));
    }
    (
        Tensor::from_vec(flat, (rows.len(), width), &Device::Cpu).unwrap(),
        Tensor::from_vec(mask, (rows.len(), width), &Device::Cpu).unwrap(),
    )
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
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

/// Every Var got a finite, non-zero gradient; an expert may get none, or zeros, when no real token
/// went to it (its padding tokens' outputs do not reach the loss), but in each mixture layer some
/// expert gets one.
fn assert_every_var_has_a_gradient(
    vars: &[(String, candle_core::Var)],
    grads: &candle_core::backprop::GradStore,
    label: &str,
) {
    let mut trained_experts = std::collections::BTreeMap::<&str, bool>::new();
    for (name, var) in vars {
        if let Some((layer, _)) = name.split_once(".mlp.experts.") {
            let trained = grads.get(var.as_tensor()).is_some_and(|grad| {
                let norm = grad.sqr().unwrap().sum_all().unwrap();
                norm.to_dtype(DType::F64)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
                    > 0.0
            });
            *trained_experts.entry(layer).or_default() |= trained;
            continue;
        }
        let grad = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{label}: no gradient for {name}"));
        let norm = grad
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            norm.is_finite() && norm > 0.0,
            "{label}: {name} gradient norm {norm}"
        );
    }
    for (layer, trained) in trained_experts {
        assert!(trained, "{label}: no expert of {layer} got a gradient");
    }
}

#[test]
fn every_weight_receives_a_gradient() {
    for arch in ARCHS {
        let config = config(arch);
        let (model, vars) = random_model_seeded(&config, 1, DType::F32)
            .trainable()
            .unwrap();
        let (input, mask) = ids(&[&[1, 5, 9, 14, 3, 30], &[1, 7, 7, 22]]);
        let logprobs = model
            .token_logprobs(&input, &mask, Ops::Differentiable)
            .unwrap();
        let loss = logprobs.sum_all().unwrap();
        let grads = loss.backward().unwrap();
        // One Var per weight: gpt-oss's experts, held one by one, stack into the checkpoint's.
        let trained = vars
            .iter()
            .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
            .collect();
        let mut stacked: Vec<String> = checkpoint_tensors(&config, trained)
            .unwrap()
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        let mut specs: Vec<String> = parameter_specs(&config)
            .into_iter()
            .map(|spec| spec.name)
            .collect();
        stacked.sort();
        specs.sort();
        assert_eq!(stacked, specs, "{arch}: one Var per weight");
        assert_every_var_has_a_gradient(&vars, &grads, &arch.to_string());
    }
}

#[test]
fn gradients_match_finite_differences() {
    for arch in ARCHS {
        let config = config(arch);
        let base = random_model_seeded(&config, 2, DType::F64);
        let (model, vars) = base.trainable().unwrap();
        let (input, mask) = ids(&[&[1, 5, 9, 14, 3], &[1, 7, 22]]);
        let loss = |model: &Model| {
            model
                .token_logprobs(&input, &mask, Ops::Differentiable)
                .unwrap()
                .sum_all()
                .unwrap()
        };
        let grads = loss(&model).backward().unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let step = 1e-5;
        for (name, var) in &vars {
            let analytic = gradient_or_unrouted(&grads, var, name)
                .flatten_all()
                .unwrap();
            let count = analytic.dim(0).unwrap();
            let original = var
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            for _ in 0..2 {
                let at = rng.random_range(0..count);
                let probe = |delta: f64| {
                    let mut values = original.clone();
                    values[at] += delta;
                    var.set(
                        &Tensor::from_vec(values, var.as_tensor().shape(), &Device::Cpu).unwrap(),
                    )
                    .unwrap();
                    loss(&model).to_scalar::<f64>().unwrap()
                };
                let numeric = (probe(step) - probe(-step)) / (2.0 * step);
                probe(0.0);
                let analytic = analytic.get(at).unwrap().to_scalar::<f64>().unwrap();
                let tolerance = 1e-6 + 1e-4 * analytic.abs().max(numeric.abs());
                assert!(
                    (analytic - numeric).abs() < tolerance,
                    "{arch}: {name}[{at}] analytic {analytic} numeric {numeric}"
                );
            }
        }
    }
}

#[test]
fn fast_and_differentiable_paths_agree() {
    for arch in ARCHS {
        let model = random_model_seeded(&config(arch), 3, DType::F32);
        let (input, mask) = ids(&[&[1, 5, 9, 14, 3, 30, 8], &[1, 7, 7, 22]]);
        let fast = model.token_logprobs(&input, &mask, Ops::Fast).unwrap();
        let slow = model
            .token_logprobs(&input, &mask, Ops::Differentiable)
            .unwrap();
        assert!(max_abs_diff(&fast, &slow) < 1e-5, "{arch}");
    }
}

/// A prompt longer than the fast prefill's blocks of queries (32 positions) and tiles of keys (256):
/// its log-probabilities through the fast forward are the differentiable forward's (which forms every
/// score at once) beside a shorter right-padded row, and its last logits are the same prefilled whole
/// or in two chunks through the cache, in every family (windows of 3 positions and sinks included).
#[test]
fn a_long_prompt_gets_the_same_attention_in_blocks_whole_or_in_chunks() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let long: Vec<u32> = (0..300).map(|_| rng.random_range(3..37)).collect();
    let (input, mask) = ids(&[&long, &long[..250]]);
    let (first, rest) = (170, long.len() - 170);
    let logits_after =
        |model: &Model, cache: Option<&mut KvCache>, tokens: &[u32], cached: usize| {
            let input = Tensor::new(tokens, &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let positions: Vec<u32> = (cached as u32..(cached + tokens.len()) as u32).collect();
            let positions = Tensor::new(positions, &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let mask = Tensor::ones((1, cached + tokens.len()), DType::U8, &Device::Cpu).unwrap();
            let hidden = model
                .forward_hidden(&input, &positions, &mask, cache, Ops::Fast)
                .unwrap();
            model
                .logits(&hidden.narrow(1, tokens.len() - 1, 1).unwrap(), Ops::Fast)
                .unwrap()
        };
    for arch in ARCHS {
        let config = ModelConfig {
            max_position_embeddings: 512,
            ..config(arch)
        };
        let model = random_model_seeded(&config, 6, DType::F32);
        let fast = model.token_logprobs(&input, &mask, Ops::Fast).unwrap();
        let slow = model
            .token_logprobs(&input, &mask, Ops::Differentiable)
            .unwrap();
        assert!(max_abs_diff(&fast, &slow) < 1e-4, "{arch}");

        let whole = logits_after(&model, None, &long, 0);
        let mut cache = KvCache::new(&model.config);
        logits_after(&model, Some(&mut cache), &long[..first], 0);
        let chunked = logits_after(&model, Some(&mut cache), &long[first..first + rest], first);
        assert!(max_abs_diff(&whole, &chunked) < 1e-4, "{arch} in chunks");
    }
}

#[test]
fn the_kv_cache_and_left_padding_change_nothing() {
    for arch in ARCHS {
        let model = random_model_seeded(&config(arch), 4, DType::F32);
        let sequence = [1u32, 5, 9, 14, 3, 30, 8, 11];
        let full_input = Tensor::new(&sequence[..], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let full_mask = Tensor::ones((1, sequence.len()), DType::U8, &Device::Cpu).unwrap();
        let full = model
            .logits(
                &model
                    .forward_hidden(
                        &full_input,
                        &positions_from_mask(&full_mask).unwrap(),
                        &full_mask,
                        None,
                        Ops::Fast,
                    )
                    .unwrap(),
                Ops::Fast,
            )
            .unwrap();

        // Left-padded by 3 columns, prefilled with 5 tokens, then one token at a time.
        let pad = 3;
        let mut cache = KvCache::new(&model.config);
        let mut key_mask = vec![0u8; pad];
        key_mask.extend([1u8; 5]);
        let mut prefill_ids = vec![0u32; pad];
        prefill_ids.extend_from_slice(&sequence[..5]);
        let prefill = Tensor::new(prefill_ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let mask = Tensor::new(key_mask.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let hidden = model
            .forward_hidden(
                &prefill,
                &positions_from_mask(&mask).unwrap(),
                &mask,
                Some(&mut cache),
                Ops::Fast,
            )
            .unwrap();
        let prefix = model
            .logits(&hidden.narrow(1, pad, 5).unwrap(), Ops::Fast)
            .unwrap();
        assert!(
            max_abs_diff(&prefix, &full.narrow(1, 0, 5).unwrap()) < 1e-5,
            "{arch} prefill"
        );
        for (offset, &token) in sequence[5..].iter().enumerate() {
            key_mask.push(1);
            let position = Tensor::new(&[[(5 + offset) as u32]], &Device::Cpu).unwrap();
            let input = Tensor::new(&[[token]], &Device::Cpu).unwrap();
            let mask = Tensor::new(key_mask.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let hidden = model
                .forward_hidden(&input, &position, &mask, Some(&mut cache), Ops::Fast)
                .unwrap();
            let logits = model.logits(&hidden, Ops::Fast).unwrap();
            let expected = full.narrow(1, 5 + offset, 1).unwrap();
            assert!(
                max_abs_diff(&logits, &expected) < 1e-5,
                "{arch} step {offset}"
            );
        }
    }
}

#[test]
fn batches_sharing_a_pass_get_what_they_get_alone() {
    for arch in ARCHS {
        let model = random_model_seeded(&config(arch), 6, DType::F32);
        let (first, first_mask) = ids(&[&[3, 8, 1, 9], &[4, 4, 2]]);
        let (second, second_mask) = ids(&[&[7, 5, 6, 2, 9, 1, 3]]);
        // Each batch alone, with a cache.
        let alone = |input: &Tensor, mask: &Tensor| {
            let mut cache = KvCache::new(&model.config);
            let positions = positions_from_mask(mask).unwrap();
            let hidden = model
                .forward_hidden(input, &positions, mask, Some(&mut cache), Ops::Fast)
                .unwrap();
            (hidden, cache)
        };
        let (first_alone, first_cache_alone) = alone(&first, &first_mask);
        let (second_alone, _) = alone(&second, &second_mask);
        // Both in one pass, twice: from empty caches, then one more token each on the caches filled.
        let mut first_cache = KvCache::new(&model.config);
        let mut second_cache = KvCache::new(&model.config);
        let mut segments = [
            Segment {
                input_ids: first.clone(),
                positions: positions_from_mask(&first_mask).unwrap(),
                key_mask: first_mask.clone(),
                cache: &mut first_cache,
                lengths: None,
            },
            Segment {
                input_ids: second.clone(),
                positions: positions_from_mask(&second_mask).unwrap(),
                key_mask: second_mask.clone(),
                cache: &mut second_cache,
                lengths: None,
            },
        ];
        let together = model.forward_segments(&mut segments, Ops::Fast).unwrap();
        assert!(max_abs_diff(&together[0], &first_alone) < 1e-5, "{arch}");
        assert!(max_abs_diff(&together[1], &second_alone) < 1e-5, "{arch}");
        assert_eq!(first_cache.len(), first_cache_alone.len());
        // The caches the shared pass filled serve the next step as the lone pass's do.
        let next = Tensor::new(&[[11u32], [12]], &Device::Cpu).unwrap();
        let next_positions = Tensor::new(&[[4u32], [3]], &Device::Cpu).unwrap();
        let next_mask = Tensor::cat(
            &[
                &first_mask,
                &Tensor::ones((2, 1), DType::U8, &Device::Cpu).unwrap(),
            ],
            1,
        )
        .unwrap();
        let mut lone_cache = first_cache_alone;
        let expected = model
            .forward_hidden(
                &next,
                &next_positions,
                &next_mask,
                Some(&mut lone_cache),
                Ops::Fast,
            )
            .unwrap();
        let got = model
            .forward_segments(
                &mut [Segment {
                    input_ids: next,
                    positions: next_positions,
                    key_mask: next_mask,
                    cache: &mut first_cache,
                    lengths: None,
                }],
                Ops::Fast,
            )
            .unwrap();
        assert!(max_abs_diff(&got[0], &expected) < 1e-5, "{arch} next step");
    }
}

/// Batch-invariant passes: each sequence's hidden states are the same bits alone (a batch of one, no
/// padding) as beside others, right-padded in a batch of two and with a third batch in the pass, at
/// prefill and at the next decoding step, whose keys then hold padding in the middle.
#[test]
fn batch_invariant_passes_give_a_sequence_the_same_bits_alone_or_beside_others() {
    let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for arch in ARCHS {
        let model = random_model_seeded(&config(arch), 6, DType::F32);
        let sequences: [&[u32]; 3] = [&[3, 8, 1, 9], &[4, 4, 2], &[7, 5, 6, 2, 9, 1, 3]];
        let next_tokens = [11u32, 12, 13];
        // (prefill states, next step's state) of each sequence alone.
        let alone: Vec<(Tensor, Tensor)> = sequences
            .iter()
            .zip(next_tokens)
            .map(|(sequence, next)| {
                let (input, mask) = ids(&[sequence]);
                let mut cache = KvCache::new(&model.config);
                let mut segment = [Segment {
                    input_ids: input,
                    positions: positions_from_mask(&mask).unwrap(),
                    key_mask: mask.clone(),
                    cache: &mut cache,
                    lengths: None,
                }];
                let prefill = model
                    .forward_segments(&mut segment, Ops::Invariant)
                    .unwrap();
                let len = sequence.len();
                let mut step = [Segment {
                    input_ids: Tensor::new(&[[next]], &Device::Cpu).unwrap(),
                    positions: Tensor::new(&[[len as u32]], &Device::Cpu).unwrap(),
                    key_mask: Tensor::ones((1, len + 1), DType::U8, &Device::Cpu).unwrap(),
                    cache: &mut cache,
                    lengths: None,
                }];
                let next = model.forward_segments(&mut step, Ops::Invariant).unwrap();
                (prefill[0].clone(), next[0].clone())
            })
            .collect();

        let (pair, pair_mask) = ids(&sequences[..2]);
        let (third, third_mask) = ids(&sequences[2..]);
        let (mut pair_cache, mut third_cache) =
            (KvCache::new(&model.config), KvCache::new(&model.config));
        let prefill = model
            .forward_segments(
                &mut [
                    Segment {
                        input_ids: pair,
                        positions: positions_from_mask(&pair_mask).unwrap(),
                        key_mask: pair_mask.clone(),
                        cache: &mut pair_cache,
                        lengths: None,
                    },
                    Segment {
                        input_ids: third,
                        positions: positions_from_mask(&third_mask).unwrap(),
                        key_mask: third_mask.clone(),
                        cache: &mut third_cache,
                        lengths: None,
                    },
                ],
                Ops::Invariant,
            )
            .unwrap();
        let ones = |rows| Tensor::ones((rows, 1), DType::U8, &Device::Cpu).unwrap();
        let next = model
            .forward_segments(
                &mut [
                    Segment {
                        input_ids: Tensor::new(&[[11u32], [12]], &Device::Cpu).unwrap(),
                        positions: Tensor::new(&[[4u32], [3]], &Device::Cpu).unwrap(),
                        key_mask: Tensor::cat(&[&pair_mask, &ones(2)], 1).unwrap(),
                        cache: &mut pair_cache,
                        lengths: None,
                    },
                    Segment {
                        input_ids: Tensor::new(&[[13u32]], &Device::Cpu).unwrap(),
                        positions: Tensor::new(&[[7u32]], &Device::Cpu).unwrap(),
                        key_mask: Tensor::cat(&[&third_mask, &ones(1)], 1).unwrap(),
                        cache: &mut third_cache,
                        lengths: None,
                    },
                ],
                Ops::Invariant,
            )
            .unwrap();
        for (i, sequence) in sequences.iter().enumerate() {
            let (segment, row) = if i < 2 { (0, i) } else { (1, 0) };
            let together = prefill[segment]
                .narrow(0, row, 1)
                .unwrap()
                .narrow(1, 0, sequence.len())
                .unwrap();
            assert_eq!(bits(&together), bits(&alone[i].0), "{arch} prefill {i}");
            let step = next[segment].narrow(0, row, 1).unwrap();
            assert_eq!(bits(&step), bits(&alone[i].1), "{arch} next step {i}");
        }
    }
}

fn tokenizer() -> tokenizers::Tokenizer {
    holo_runtime::local::init::build_tokenizer().unwrap()
}

#[test]
fn batched_generation_equals_one_row_at_a_time() {
    let tokenizer = tokenizer();
    for arch in ARCHS {
        let model = random_model_seeded(&config(arch), 5, DType::F32);
        let stopping = Stopping {
            eos: &[2],
            tokenizer: &tokenizer,
        };
        let prompts: Vec<Vec<u32>> =
            vec![vec![1, 5, 9, 14, 3, 30, 8], vec![1, 7], vec![4, 4, 4, 4]];
        let params: Vec<GenerationParams> = [(0.0, 5), (1.0, 9), (0.7, 12)]
            .iter()
            .enumerate()
            .map(|(i, &(temperature, max_tokens))| GenerationParams {
                temperature,
                max_tokens,
                seed: i as u64 + 40,
                ..Default::default()
            })
            .collect();
        let batched = generate(&model, &stopping, &prompts, &params, None).unwrap();
        for (i, prompt) in prompts.iter().enumerate() {
            let alone = generate(
                &model,
                &stopping,
                std::slice::from_ref(prompt),
                std::slice::from_ref(&params[i]),
                None,
            )
            .unwrap();
            assert_eq!(alone[0].tokens, batched[i].tokens, "{arch} row {i}");
            for (a, b) in alone[0].logprobs.iter().zip(&batched[i].logprobs) {
                assert!((a - b).abs() < 1e-4, "{arch} row {i}: {a} vs {b}");
            }
            assert!(batched[i].tokens.len() <= params[i].max_tokens);
        }
    }
}

/// With matrices large enough for the sampling path's own kernels (`local/skinny.rs`: f32 weights from
/// 2¹⁸ elements, at most 16 rows), the fast forward gives the differentiable one's logits.
#[test]
fn decoding_through_the_skinny_kernels_equals_the_differentiable_forward() {
    let config = ModelConfig {
        vocab_size: 1024,
        hidden_size: 512,
        intermediate_size: 1024,
        num_attention_heads: 8,
        num_key_value_heads: 2,
        head_dim: 64,
        ..config(Arch::Qwen2)
    };
    let model = random_model_seeded(&config, 3, DType::F32);
    let (input, mask) = ids(&[&[1, 5, 9, 14], &[3, 3, 7], &[8, 1, 1, 4]]);
    let positions = positions_from_mask(&mask).unwrap();
    let logits = |ops: Ops| {
        let hidden = model
            .forward_hidden(&input, &positions, &mask, None, ops)
            .unwrap();
        model.logits(&hidden, ops).unwrap()
    };
    let (fast, exact) = (logits(Ops::Fast), logits(Ops::Differentiable));
    let scale = exact
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64;
    let diff = max_abs_diff(&fast, &exact);
    assert!(diff <= 1e-5 * scale, "{diff} (logits up to {scale})");
}

/// A stop string ends the row at the token that completes it, and the text ends with it: for stop
/// strings cut from an unstopped sample (across token boundaries, several bytes long), the stopped
/// sample with the same seed is the unstopped one cut there.
#[test]
fn stop_strings_cut_the_sample_where_they_first_end() {
    let tokenizer = tokenizer();
    let model = random_model_seeded(&config(Arch::Llama), 9, DType::F32);
    let stopping = Stopping {
        eos: &[],
        tokenizer: &tokenizer,
    };
    let prompt = vec![vec![1u32, 5, 9]];
    let params = |stop: Vec<String>| GenerationParams {
        temperature: 1.0,
        max_tokens: 40,
        seed: 21,
        stop,
        ..Default::default()
    };
    let free = generate(&model, &stopping, &prompt, &[params(Vec::new())], None)
        .unwrap()
        .remove(0);
    let text = &free.text;
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    assert!(chars.len() > 12, "{text:?}");
    for (start, len) in [(3, 2), (chars.len() / 2, 3), (chars.len() - 4, 4), (1, 1)] {
        let from = chars[start].0;
        let to = chars.get(start + len).map_or(text.len(), |&(at, _)| at);
        let stop = text[from..to].to_string();
        let first_end = text.find(&stop).unwrap() + stop.len();
        let stopped = generate(
            &model,
            &stopping,
            &prompt,
            &[params(vec![stop.clone(), "\u{1}never".into()])],
            None,
        )
        .unwrap()
        .remove(0);
        assert_eq!(
            stopped.finish,
            holo_runtime::Finish::Stop(stop.clone()),
            "{stop:?}"
        );
        assert_eq!(stopped.text, text[..first_end], "{stop:?}");
        assert_eq!(
            stopped.tokens,
            free.tokens[..stopped.tokens.len()],
            "{stop:?}"
        );
        let before = tokenizer
            .decode(&stopped.tokens[..stopped.tokens.len() - 1], true)
            .unwrap();
        assert!(!before.contains(&stop), "{stop:?} ended a token late");
    }
}

#[test]
fn streamed_tokens_are_the_generation_and_a_refused_row_ends() {
    let tokenizer = tokenizer();
    let model = random_model_seeded(&config(Arch::Qwen2), 5, DType::F32);
    let stopping = Stopping {
        eos: &[2],
        tokenizer: &tokenizer,
    };
    let prompts: Vec<Vec<u32>> = vec![vec![1, 5, 9, 14], vec![1, 7], vec![4, 4, 4]];
    let params: Vec<GenerationParams> = (0..3)
        .map(|i| GenerationParams {
            temperature: 1.0,
            max_tokens: 10,
            seed: i + 7,
            ..Default::default()
        })
        .collect();
    let whole = generate(&model, &stopping, &prompts, &params, None).unwrap();
    // Row 1 is refused after its third token; the others run as before.
    let mut heard: Vec<Vec<(u32, f32)>> = vec![Vec::new(); 3];
    let streamed = generate_streaming(
        &model,
        &stopping,
        &prompts,
        &params,
        None,
        &mut |row, token, logprob| {
            heard[row].push((token, logprob));
            !(row == 1 && heard[row].len() == 3)
        },
    )
    .unwrap();
    for row in 0..3 {
        let tokens: Vec<u32> = heard[row].iter().map(|&(token, _)| token).collect();
        let logprobs: Vec<f32> = heard[row].iter().map(|&(_, logprob)| logprob).collect();
        assert_eq!(tokens, streamed[row].tokens, "row {row}");
        assert_eq!(logprobs, streamed[row].logprobs, "row {row}");
        if row == 1 {
            assert_eq!(tokens, whole[row].tokens[..3], "row {row}");
            assert_eq!(streamed[row].finish, holo_runtime::Finish::Length);
        } else {
            assert_eq!(tokens, whole[row].tokens, "row {row}");
        }
    }
    assert!(whole[1].tokens.len() > 3, "the refusal must cut the row");
}

#[test]
fn greedy_logprobs_are_the_policy_and_sampling_logprobs_are_zero() {
    let tokenizer = tokenizer();
    let model = random_model_seeded(&config(Arch::Qwen2), 6, DType::F32);
    let stopping = Stopping {
        eos: &[],
        tokenizer: &tokenizer,
    };
    let prompt = vec![1u32, 5, 9];
    let params = GenerationParams {
        temperature: 0.0,
        max_tokens: 6,
        ..Default::default()
    };
    let out = generate(
        &model,
        &stopping,
        std::slice::from_ref(&prompt),
        &[params],
        None,
    )
    .unwrap()
    .remove(0);
    assert_eq!(out.tokens.len(), 6);
    assert!(out.sampling_logprobs.iter().all(|&l| l == 0.0));
    // Recompute with the differentiable forward over prompt + completion.
    let mut sequence = prompt.clone();
    sequence.extend(&out.tokens);
    let (input, mask) = ids(&[&sequence]);
    let all = model
        .token_logprobs(&input, &mask, Ops::Differentiable)
        .unwrap();
    let tail = all
        .narrow(1, prompt.len() - 1, out.tokens.len())
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for (a, b) in tail.iter().zip(&out.logprobs) {
        assert!((a - b).abs() < 1e-4, "{tail:?} vs {:?}", out.logprobs);
    }
}

#[test]
fn top_logprobs_are_the_most_likely_tokens_of_the_policy() {
    let tokenizer = tokenizer();
    let vocab = config(Arch::Qwen2).vocab_size;
    let model = random_model_seeded(&config(Arch::Qwen2), 6, DType::F32);
    let stopping = Stopping {
        eos: &[],
        tokenizer: &tokenizer,
    };
    let prompt = vec![1u32, 5, 9];
    // Greedy, sampled at temperature 1, and sampled under a temperature and top-k: the alternatives are
    // always those of the policy at temperature 1, the distribution `logprobs` reports.
    let all = |temperature: f64, top_k: usize| GenerationParams {
        temperature,
        top_k,
        max_tokens: 8,
        seed: 3,
        top_logprobs: vocab,
        ..Default::default()
    };
    let params = [all(0.0, 0), all(1.0, 0), all(0.7, 5)];
    let prompts = vec![prompt; params.len()];
    let outs = generate(&model, &stopping, &prompts, &params, None).unwrap();
    for (out, params) in outs.iter().zip(&params) {
        assert_eq!(out.top_logprobs.len(), out.tokens.len());
        for ((&token, &logprob), top) in out.tokens.iter().zip(&out.logprobs).zip(&out.top_logprobs)
        {
            assert_eq!(top.len(), vocab);
            assert!(top.windows(2).all(|pair| pair[0].1 >= pair[1].1), "{top:?}");
            let total: f64 = top.iter().map(|(_, lp)| f64::from(*lp).exp()).sum();
            assert!((total - 1.0).abs() < 1e-4, "{total}");
            let entry = top.iter().find(|(id, _)| *id == token).unwrap();
            assert!((entry.1 - logprob).abs() < 1e-5, "{entry:?} vs {logprob}");
            if params.temperature == 0.0 {
                assert_eq!(top[0].0, token);
            }
        }
    }
    // Asked for k, the first k of the whole list.
    let three = GenerationParams {
        top_logprobs: 3,
        ..params[1].clone()
    };
    let out = generate(&model, &stopping, &prompts[..1], &[three], None)
        .unwrap()
        .remove(0);
    assert_eq!(out.tokens, outs[1].tokens);
    for (top, whole) in out.top_logprobs.iter().zip(&outs[1].top_logprobs) {
        assert_eq!(top[..], whole[..3]);
    }
}

#[test]
fn lora_adapters_start_as_the_base_model_and_alone_receive_gradients() {
    use holo_runtime::local::model::LoraConfig;

    let config = config(Arch::Qwen2);
    let base = random_model_seeded(&config, 7, DType::F32);
    let lora = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: Targets::names(&["q_proj", "v_proj", "down_proj"]),
        seed: 1,
        dropout: 0.0,
        parameters: Vec::new(),
        ..Default::default()
    };
    let (adapted, vars) = base.with_lora(&lora).unwrap();
    assert_eq!(vars.len(), 2 * 3 * config.num_hidden_layers);
    assert!(vars[0]
        .0
        .starts_with("base_model.model.model.layers.0.self_attn.q_proj.lora_A"));
    let (input, mask) = ids(&[&[1, 5, 9, 14, 3, 30], &[1, 7, 7, 22]]);
    let before = base.token_logprobs(&input, &mask, Ops::Fast).unwrap();
    let after = adapted.token_logprobs(&input, &mask, Ops::Fast).unwrap();
    assert_eq!(
        max_abs_diff(&before, &after),
        0.0,
        "B = 0: the adapted model is the base model"
    );

    // B = 0 makes A's gradient zero (as in PEFT); move B first so both get one.
    move_lora_b(&vars);
    let loss = adapted
        .token_logprobs(&input, &mask, Ops::Differentiable)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    assert_every_var_has_a_gradient(&vars, &grads, "lora");
    for (name, weight) in adapted.named_weights() {
        assert!(grads.get(&weight).is_none(), "frozen {name} got a gradient");
    }
    // The sampling path sees the adapters too.
    let moved = adapted
        .detached()
        .token_logprobs(&input, &mask, Ops::Fast)
        .unwrap();
    assert!(max_abs_diff(&before, &moved) > 1e-4);

    let unknown = LoraConfig {
        targets: Targets::names(&["qkv"]),
        ..LoraConfig::default()
    };
    let error = base.with_lora(&unknown).unwrap_err().to_string();
    assert!(error.contains("unknown LoRA target \"qkv\""), "{error}");
}

/// Random `B` matrices for the adapters: with `B = 0` (PEFT's start) `A` gets no gradient.
fn move_lora_b(vars: &[(String, candle_core::Var)]) {
    for (name, var) in vars {
        if name.contains("lora_B") {
            let shape = var.as_tensor().shape().clone();
            var.set(&Tensor::randn(0f32, 0.1, shape, &Device::Cpu).unwrap())
                .unwrap();
        }
    }
}

/// Qwen3.5's linear-attention projections take adapters under PEFT's names (`in_proj_qkv`, …,
/// `out_proj`), beside the attention layers' `q_proj`; every adapter gets a gradient through the delta
/// rule's written-out backward, and sampling sees them.
#[test]
fn lora_adapts_the_linear_attention_projections() {
    use holo_runtime::local::model::LoraConfig;

    let config = config(Arch::Qwen3_5);
    let base = random_model_seeded(&config, 7, DType::F32);
    let targets = [
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "out_proj",
        "q_proj",
    ];
    let lora = LoraConfig {
        rank: 2,
        alpha: 4.0,
        targets: Targets::names(&targets),
        seed: 1,
        dropout: 0.0,
        parameters: Vec::new(),
        ..Default::default()
    };
    let (adapted, vars) = base.with_lora(&lora).unwrap();
    // Layer 0 is linear attention (five projections), layer 1 attention (q_proj).
    assert_eq!(vars.len(), 2 * 6);
    assert!(vars[0]
        .0
        .starts_with("base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A"));
    move_lora_b(&vars);
    let (input, mask) = ids(&[&[1, 5, 9, 14, 3, 30], &[1, 7, 7, 22]]);
    let before = base.token_logprobs(&input, &mask, Ops::Fast).unwrap();
    let loss = adapted
        .token_logprobs(&input, &mask, Ops::Differentiable)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    assert_every_var_has_a_gradient(&vars, &grads, "qwen3_5 lora");
    let moved = adapted
        .detached()
        .token_logprobs(&input, &mask, Ops::Fast)
        .unwrap();
    assert!(max_abs_diff(&before, &moved) > 1e-4);
}

/// Over a half-precision base (bf16 on CUDA; f16 here, the half type the CPU trains in) the adapters are
/// f32, as PEFT casts them, and the low-rank path runs in f32 beside the base's half-precision product.
#[test]
fn lora_adapters_over_a_half_precision_base_are_f32_and_get_f32_gradients() {
    let config = config(Arch::Qwen2);
    let base = random_model_seeded(&config, 7, DType::F16);
    assert_eq!(base.dtype(), DType::F16);
    let lora = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: Targets::names(&["q_proj", "down_proj"]),
        seed: 1,
        dropout: 0.1,
        parameters: Vec::new(),
        ..Default::default()
    };
    let (adapted, vars) = base.with_lora(&lora).unwrap();
    for (name, var) in &vars {
        assert_eq!(var.dtype(), DType::F32, "{name}");
    }
    for (name, weight) in adapted.named_weights() {
        assert_eq!(weight.dtype(), DType::F16, "base {name}");
    }
    move_lora_b(&vars);
    adapted.set_dropout_seed(3);
    let (input, mask) = ids(&[&[1, 5, 9, 14, 3, 30], &[1, 7, 7, 22]]);
    let logprobs = adapted
        .token_logprobs(&input, &mask, Ops::Differentiable)
        .unwrap();
    assert_eq!(logprobs.dtype(), DType::F32);
    let grads = logprobs.sum_all().unwrap().backward().unwrap();
    assert_every_var_has_a_gradient(&vars, &grads, "lora over f16");
    for (_, var) in &vars {
        assert_eq!(grads.get(var.as_tensor()).unwrap().dtype(), DType::F32);
    }
}

#[test]
fn recomputed_gradients_equal_the_whole_graph_backward() {
    use holo_runtime::local::model::LoraConfig;

    // A loss that weighs every position differently, some negatively, as advantages do.
    let weighted = |logprobs: &Tensor| {
        let (rows, columns) = logprobs.dims2()?;
        let weights: Vec<f64> = (0..rows * columns)
            .map(|i| (i as f64 * 0.7).sin())
            .collect();
        let weights = Tensor::from_vec(weights, (rows, columns), &Device::Cpu)?;
        (logprobs * weights)?.sum_all()
    };
    let (input, mask) = ids(&[&[1, 5, 9, 14, 3, 30], &[1, 7, 7, 22]]);
    for arch in ARCHS {
        let base = random_model_seeded(&config(arch), 11, DType::F64);
        let all = LoraConfig {
            targets: Targets::names(&PROJECTIONS),
            ..LoraConfig::default()
        };
        // A mixture of experts takes module targets on its attention only: PEFT turns Qwen3-MoE's
        // MLP names into its expert stacks' target parameters, and finds no module by them on
        // gpt-oss. Dropout below needs the attention's alone.
        let lora = match arch {
            Arch::Qwen3Moe | Arch::GptOss => {
                match (arch, base.with_lora(&all)) {
                    (Arch::Qwen3Moe, Ok((_, vars))) => assert!(
                        vars.iter().any(|(name, _)| name.contains(".mlp.experts.")),
                        "the MLP's names adapt the expert stacks"
                    ),
                    (_, Err(error)) => {
                        assert!(error.to_string().contains("stacked parameters"), "{error}")
                    }
                    (arch, Ok(_)) => panic!("{arch:?}: MLP module names adapted"),
                }
                LoraConfig {
                    targets: Targets::names(&PROJECTIONS[..4]),
                    ..all
                }
            }
            _ => all,
        };
        let (adapted, adapters) = base.with_lora(&lora).unwrap();
        for (name, var) in &adapters {
            if name.contains("lora_B") {
                let shape = var.as_tensor().shape().clone();
                var.set(&Tensor::randn(0f64, 0.1, shape, &Device::Cpu).unwrap())
                    .unwrap();
            }
        }
        // With dropout, both passes of each layer must drop the same inputs.
        let (dropped, dropped_adapters) = base
            .with_lora(&LoraConfig {
                dropout: 0.3,
                ..lora.clone()
            })
            .unwrap();
        for ((_, var), (_, trained)) in dropped_adapters.iter().zip(&adapters) {
            var.set(trained.as_tensor()).unwrap();
        }
        dropped.set_dropout_seed(42);
        for (label, (model, vars)) in [
            ("full", base.trainable().unwrap()),
            ("lora", (adapted, adapters)),
            ("lora dropout", (dropped, dropped_adapters)),
        ] {
            let whole_loss = weighted(
                &model
                    .token_logprobs(&input, &mask, Ops::Differentiable)
                    .unwrap(),
            )
            .unwrap();
            let whole = whole_loss.backward().unwrap();
            let (loss, recomputed) = model.backward_recomputed(&input, &mask, weighted).unwrap();
            let (a, b) = (
                whole_loss.to_scalar::<f64>().unwrap(),
                loss.to_scalar::<f64>().unwrap(),
            );
            assert!((a - b).abs() < 1e-12, "{arch} {label}: loss {a} vs {b}");
            for (name, var) in &vars {
                if whole.get(var.as_tensor()).is_none() {
                    // An expert no token went to: no gradient either way.
                    assert!(name.contains(".mlp.experts."), "no gradient for {name}");
                    assert!(recomputed.get(var.as_tensor()).is_none(), "{name}");
                    continue;
                }
                let expected = gradient_or_unrouted(&whole, var, name);
                let got = gradient_or_unrouted(&recomputed, var, name);
                let scale = expected
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                // An expert may see only tokens the loss does not weigh (padding).
                assert!(
                    scale > 0.0 || name.contains(".mlp.experts."),
                    "{arch} {label}: {name} has a zero gradient"
                );
                let diff = max_abs_diff(&expected, &got);
                assert!(
                    diff <= 1e-10 * scale.max(1.0),
                    "{arch} {label}: {name} differs by {diff} (scale {scale})"
                );
            }
            assert_eq!(
                recomputed.get_ids().count(),
                whole
                    .get_ids()
                    .filter(|id| vars.iter().any(|(_, var)| var.id() == **id))
                    .count(),
                "{arch} {label}: gradients only for the Vars"
            );
        }
    }
    let model = random_model_seeded(&config(Arch::Qwen2), 11, DType::F64);
    let (one, one_mask) = ids(&[&[1]]);
    let error = model
        .backward_recomputed(&one, &one_mask, weighted)
        .unwrap_err()
        .to_string();
    assert!(error.contains("no next token"), "{error}");
}

#[test]
fn lora_dropout_drops_inputs_of_training_passes_only_and_repeats_by_seed() {
    let (input, mask) = ids(&[&[1, 5, 9, 14, 3, 30], &[1, 7, 7, 22]]);
    let base = random_model_seeded(&config(Arch::Qwen2), 3, DType::F32);
    let config = |dropout| LoraConfig {
        targets: Targets::names(&PROJECTIONS),
        dropout,
        ..LoraConfig::default()
    };
    let (plain, plain_vars) = base.with_lora(&config(0.0)).unwrap();
    let (dropped, dropped_vars) = base.with_lora(&config(0.5)).unwrap();
    for ((_, plain), (_, dropped)) in plain_vars.iter().zip(&dropped_vars) {
        let shape = plain.as_tensor().shape().clone();
        let value = Tensor::randn(0f32, 0.5, shape, &Device::Cpu).unwrap();
        plain.set(&value).unwrap();
        dropped.set(&value).unwrap();
    }
    let logprobs = |model: &Model, ops| {
        model
            .token_logprobs(&input, &mask, ops)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let reference = logprobs(&plain, Ops::Differentiable);
    // Seed 0 (the default): no dropout.
    assert_eq!(logprobs(&dropped, Ops::Differentiable), reference);
    dropped.set_dropout_seed(7);
    let first = logprobs(&dropped, Ops::Differentiable);
    assert_ne!(first, reference);
    assert_eq!(
        logprobs(&dropped, Ops::Differentiable),
        first,
        "same seed, same masks"
    );
    // Sampling never drops, and detached copies share the seed.
    let fast = logprobs(&dropped, Ops::Fast);
    let plain_fast = logprobs(&plain, Ops::Fast);
    assert!(fast
        .iter()
        .zip(&plain_fast)
        .all(|(a, b)| (a - b).abs() < 1e-4));
    assert_eq!(logprobs(&dropped.detached(), Ops::Differentiable), first);
    dropped.set_dropout_seed(8);
    assert_ne!(logprobs(&dropped, Ops::Differentiable), first);
    let error = base.with_lora(&config(1.0)).unwrap_err().to_string();
    assert!(error.contains("dropout"), "{error}");
}

#[test]
fn bf16_weights_compute_in_f32_on_the_cpu() {
    let tokenizer = tokenizer();
    let stopping = Stopping {
        eos: &[2],
        tokenizer: &tokenizer,
    };
    let (input, mask) = ids(&[&[1, 5, 9, 14, 3, 30], &[1, 7, 7, 22]]);
    for arch in ARCHS {
        let config = config(arch);
        let model = random_model_seeded(&config, 5, DType::BF16);
        assert_eq!(model.dtype(), DType::F32, "{arch}: f32 arithmetic");
        assert_eq!(model.embed_tokens.dtype(), DType::BF16);
        let (_, down_proj) = Model::linears(&model.layers[0])
            .into_iter()
            .find(|(name, _)| name.ends_with("down_proj"))
            .unwrap();
        assert_eq!(
            down_proj.weight.dense().unwrap().dtype(),
            DType::BF16,
            "{arch}"
        );
        assert_eq!(model.norm.weight.dtype(), DType::F32);

        // The same rounded weights held in f32 are the exact reference.
        let rounded: HashMap<String, Tensor> = checkpoint_tensors(&config, model.named_weights())
            .unwrap()
            .into_iter()
            .map(|(name, tensor)| (name, tensor.to_dtype(DType::F32).unwrap()))
            .collect();
        let reference = Model::load(
            VarBuilder::from_tensors(rounded, DType::F32, &Device::Cpu),
            &config,
        )
        .unwrap();
        for ops in [Ops::Fast, Ops::Differentiable] {
            let got = model.token_logprobs(&input, &mask, ops).unwrap();
            let expected = reference.token_logprobs(&input, &mask, ops).unwrap();
            let diff = max_abs_diff(&got, &expected);
            assert!(diff < 1e-4, "{arch} {ops:?}: {diff}");
        }

        let prompts: Vec<Vec<u32>> = vec![vec![1, 5, 9, 14, 3, 30, 8], vec![1, 7]];
        let params = vec![
            GenerationParams {
                temperature: 0.0,
                max_tokens: 8,
                ..Default::default()
            };
            2
        ];
        let got = generate(&model, &stopping, &prompts, &params, None).unwrap();
        let expected = generate(&reference, &stopping, &prompts, &params, None).unwrap();
        for (got, expected) in got.iter().zip(&expected) {
            assert_eq!(got.tokens, expected.tokens, "{arch}: greedy tokens");
        }

        for error in [
            model.trainable().map(|_| ()).unwrap_err(),
            model
                .with_lora(&Default::default())
                .map(|_| ())
                .unwrap_err(),
        ] {
            assert!(
                error.to_string().contains("load it in f32 to train"),
                "{error}"
            );
        }
    }
}

/// candle's f32 products run on gemm's AVX-512 kernels where the CPU has them (a non-default gemm
/// feature we turn on): on shapes that exercise their tiles, edges and thread splits, and with the
/// transposed operands the forward and the backward pass, they equal a plain sum to f32 rounding.
#[test]
fn products_equal_a_plain_sum_on_the_shapes_the_kernels_split() {
    let device = Device::Cpu;
    for m in [1usize, 7, 17, 130, 300] {
        for k in [8usize, 33, 96] {
            for n in [5usize, 48, 129, 512] {
                let a = Tensor::randn(0f32, 1.0, (m, k), &device).unwrap();
                let b = Tensor::randn(0f32, 1.0, (k, n), &device).unwrap();
                let transposed = |t: &Tensor| t.t().unwrap().contiguous().unwrap().t().unwrap();
                let (av, bv) = (a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
                for (label, lhs, rhs) in [
                    ("a·b", a.clone(), b.clone()),
                    ("a·(bᵀ)ᵀ", a.clone(), transposed(&b)),
                    ("(aᵀ)ᵀ·b", transposed(&a), b.clone()),
                    ("(aᵀ)ᵀ·(bᵀ)ᵀ", transposed(&a), transposed(&b)),
                ] {
                    let got = lhs.matmul(&rhs).unwrap().to_vec2::<f32>().unwrap();
                    for i in 0..m {
                        for j in 0..n {
                            let want: f64 = (0..k).map(|l| av[i][l] as f64 * bv[l][j] as f64).sum();
                            let error = (got[i][j] as f64 - want).abs();
                            assert!(
                                error <= 1e-5 * (k as f64).sqrt() * 4.0,
                                "[{m}, {k}] × [{k}, {n}] {label} at ({i}, {j}): {} vs {want}",
                                got[i][j]
                            );
                        }
                    }
                }
            }
        }
    }
}
