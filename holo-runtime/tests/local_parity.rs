//! Parity with Hugging Face transformers: the fixture folders under `tests/fixtures/models/` were saved by
//! `save_pretrained` and their logits, greedy continuations and log-probabilities computed by transformers
//! (`scripts/model_fixtures.py`). Also: loading errors name the file and the tensor.
#![cfg(feature = "local")]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::json::{floats, ids, max_diff};
use common::logits::{sequence_logits, sequence_logits_f64};
use common::MODEL_FAMILIES as FAMILIES;
use holo_runtime::local::generate::{generate, GenerationParams, Stopping};
use holo_runtime::local::model::{checkpoint_tensors, positions_from_mask, PROJECTIONS};
use holo_runtime::local::{files, LocalModel, LocalOptions, Ops};
use holo_runtime::{Finish, Prompt, Request, SampleParams, Sampler};
use serde_json::Value;

const TOLERANCE: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn expected(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The fixture in f32 on the test device (see `common::test_device`).
fn load(name: &str) -> LocalModel {
    LocalModel::load(fixture(name), on_test_device())
        .unwrap_or_else(|error| panic!("{name}: {error}"))
}

/// The default options, on the test device.
fn on_test_device() -> LocalOptions {
    LocalOptions {
        device: common::test_device(),
        ..LocalOptions::default()
    }
}

#[test]
fn logits_match_transformers() {
    for name in FAMILIES {
        let model = load(name);
        let expected = expected(name);
        for prompt in expected["prompts"].as_array().unwrap() {
            let sequence = ids(&prompt["ids"]);
            let ours = sequence_logits(model.model(), &sequence);
            for (position, theirs) in prompt["positions"]
                .as_array()
                .unwrap()
                .iter()
                .zip(prompt["logits"].as_array().unwrap())
            {
                let position = position.as_u64().unwrap() as usize;
                let diff = max_diff(&ours[position], &floats(theirs));
                assert!(
                    diff <= TOLERANCE,
                    "{name} {}: position {position}: max |Δlogit| = {diff}",
                    prompt["name"]
                );
            }
        }
    }
}

#[test]
fn greedy_continuations_match_transformers() {
    for name in FAMILIES {
        let model = load(name);
        let expected = expected(name);
        let stopping = Stopping {
            eos: &[],
            tokenizer: model.tokenizer(),
        };
        let greedy = GenerationParams {
            max_tokens: 12,
            temperature: 0.0,
            ..Default::default()
        };
        let prompts: Vec<Vec<u32>> = expected["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|prompt| ids(&prompt["ids"]))
            .collect();
        for (prompt, fixture) in prompts.iter().zip(expected["prompts"].as_array().unwrap()) {
            let out = generate(
                model.model(),
                &stopping,
                std::slice::from_ref(prompt),
                std::slice::from_ref(&greedy),
                None,
            )
            .unwrap();
            assert_eq!(
                out[0].tokens,
                ids(&fixture["greedy"]),
                "{name} {}",
                fixture["name"]
            );
        }
        // All three at once, left-padded, as transformers' batched generate.
        let params = vec![greedy.clone(); prompts.len()];
        let batched = generate(model.model(), &stopping, &prompts, &params, None).unwrap();
        for (i, theirs) in expected["batch"]["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            assert_eq!(batched[i].tokens, ids(theirs), "{name} batched row {i}");
        }
    }
}

#[test]
fn left_padded_batch_logits_match_transformers() {
    for name in FAMILIES {
        let model = load(name);
        let batch = &expected(name)["batch"];
        let rows: Vec<Vec<u32>> = batch["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(ids)
            .collect();
        let masks: Vec<Vec<u32>> = batch["attention_mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(ids)
            .collect();
        let (count, width) = (rows.len(), rows[0].len());
        let device = model.model().device();
        let input = Tensor::new(rows.concat(), device)
            .unwrap()
            .reshape((count, width))
            .unwrap();
        let mask: Vec<u8> = masks.concat().iter().map(|&m| m as u8).collect();
        let mask = Tensor::new(mask, device)
            .unwrap()
            .reshape((count, width))
            .unwrap();
        let inner = model.model();
        let hidden = inner
            .forward_hidden(
                &input,
                &positions_from_mask(&mask).unwrap(),
                &mask,
                None,
                Ops::Fast,
            )
            .unwrap();
        let last: Vec<Vec<f32>> = inner
            .logits(
                &hidden.narrow(1, width - 1, 1).unwrap().squeeze(1).unwrap(),
                Ops::Fast,
            )
            .unwrap()
            .to_vec2()
            .unwrap();
        for (i, theirs) in batch["last_logits"].as_array().unwrap().iter().enumerate() {
            let diff = max_diff(&last[i], &floats(theirs));
            assert!(diff <= TOLERANCE, "{name} row {i}: max |Δlogit| = {diff}");
        }
    }
}

#[test]
fn completion_logprobs_match_transformers() {
    for name in FAMILIES {
        let model = load(name);
        let fixture = &expected(name)["logprobs"];
        let (prompt, completion) = (ids(&fixture["prompt"]), ids(&fixture["completion"]));
        let sequence = [prompt.clone(), completion.clone()].concat();
        let device = model.model().device();
        let input = Tensor::new(sequence.as_slice(), device)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let mask = Tensor::ones((1, sequence.len()), DType::U8, device).unwrap();
        for ops in [Ops::Fast, Ops::Differentiable] {
            let all: Vec<f32> = model
                .model()
                .token_logprobs(&input, &mask, ops)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec1()
                .unwrap();
            let ours = &all[prompt.len() - 1..];
            let diff = max_diff(ours, &floats(&fixture["logprobs"]));
            assert!(diff <= TOLERANCE, "{name} {ops:?}: max |Δlogprob| = {diff}");
        }
    }
}

#[tokio::test]
async fn the_sampler_trait_gives_the_same_greedy_tokens() {
    for name in FAMILIES {
        let model = load(name);
        let expected = expected(name);
        let requests: Vec<Request> = expected["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|prompt| Request {
                prompt: Prompt::Tokens(ids(&prompt["ids"])),
                params: SampleParams {
                    max_tokens: Some(12),
                    temperature: Some(0.0),
                    ..Default::default()
                },
            })
            .collect();
        let results = model.sample(&requests).await;
        for (result, fixture) in results.iter().zip(expected["prompts"].as_array().unwrap()) {
            let completion = result.as_ref().unwrap();
            let greedy = ids(&fixture["greedy"]);
            // The fixture ran with EOS disabled; the sampler stops at the model's end of turn.
            match completion.finish {
                Finish::EndOfTurn => {
                    let end = completion.tokens.len();
                    assert_eq!(completion.tokens, greedy[..end], "{name}");
                    assert!(model.end_of_turn().contains(&greedy[end - 1]));
                }
                Finish::Length => assert_eq!(completion.tokens, greedy, "{name}"),
                ref other => panic!("{name}: unexpected finish {other:?}"),
            }
            assert_eq!(completion.logprobs.len(), completion.tokens.len());
            assert_eq!(
                completion.text,
                model.tokenizer().decode(&completion.tokens, true).unwrap()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Loading errors

fn copy_fixture(name: &str) -> common::tempdir::Dir {
    common::tempdir::Dir::with_files_of(name, &fixture(name))
}

fn tensors(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

fn load_error(dir: &Path) -> String {
    LocalModel::load(dir, LocalOptions::default())
        .map(|_| ())
        .unwrap_err()
        .to_string()
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = copy_fixture("qwen2");
    let mut weights = tensors(dir.path());
    weights.remove("model.layers.1.mlp.up_proj.weight");
    candle_core::safetensors::save(&weights, dir.path().join("model.safetensors")).unwrap();
    let error = load_error(dir.path());
    assert!(error.contains("model.safetensors"), "{error}");
    assert!(
        error.contains("model.layers.1.mlp.up_proj.weight"),
        "{error}"
    );
}

#[test]
fn a_shape_mismatch_names_the_tensor_and_both_shapes() {
    let dir = copy_fixture("llama");
    let mut weights = tensors(dir.path());
    let narrow = weights["model.layers.0.self_attn.k_proj.weight"]
        .narrow(0, 0, 8)
        .unwrap();
    weights.insert("model.layers.0.self_attn.k_proj.weight".into(), narrow);
    candle_core::safetensors::save(&weights, dir.path().join("model.safetensors")).unwrap();
    let error = load_error(dir.path());
    assert!(
        error.contains("model.layers.0.self_attn.k_proj.weight"),
        "{error}"
    );
    assert!(
        error.contains("[32, 64]") && error.contains("[8, 64]"),
        "{error}"
    );
}

#[test]
fn an_unsupported_architecture_is_refused_by_name() {
    let dir = copy_fixture("qwen2");
    let path = dir.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["model_type"] = "gpt2".into();
    config["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    std::fs::write(&path, config.to_string()).unwrap();
    let error = load_error(dir.path());
    assert!(error.contains("config.json"), "{error}");
    assert!(
        error.contains("unsupported architecture") && error.contains("GPT2LMHeadModel"),
        "{error}"
    );
}

#[test]
fn a_folder_without_safetensors_says_what_it_found() {
    let dir = copy_fixture("qwen2");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    std::fs::write(dir.path().join("pytorch_model.bin"), b"").unwrap();
    let error = load_error(dir.path());
    assert!(error.contains("no model.safetensors"), "{error}");
    assert!(
        error.contains("pytorch_model.bin") && error.contains("safe_serialization"),
        "{error}"
    );
}

/// A Gemma 3 multimodal checkpoint (`gemma3`, `Gemma3ForConditionalGeneration`: the text model's config
/// under `text_config`, its tensors under `language_model.model.*` as transformers 4 saved them or
/// `model.language_model.*` as transformers 5 does, beside a vision tower) loads as its text tower: the
/// same logits as the text model's folder.
#[test]
fn a_gemma3_multimodal_checkpoint_loads_as_its_text_tower() {
    let wrapper = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8},
        "eos_token_id": [511, 509],
        "mm_tokens_per_image": 4,
    });
    for tower in ["language_model.model.", "model.language_model."] {
        loads_as_its_text_tower(
            "gemma3",
            &wrapper,
            &[("model.", tower), ("lm_head.", "language_model.lm_head.")],
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
        );
    }
}

/// Qwen3.5's checkpoints are multimodal (`Qwen3_5ForConditionalGeneration`): the text model under
/// `model.language_model.`, the untied head beside it, the vision tower and the multi-token-prediction
/// weights, which are not loaded.
#[test]
fn a_qwen3_5_multimodal_checkpoint_loads_as_its_text_tower() {
    let wrapper = serde_json::json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "vision_config": {"model_type": "qwen3_5_vision", "hidden_size": 8},
        "eos_token_id": [511, 509],
        "image_token_id": 500,
    });
    loads_as_its_text_tower(
        "qwen3_5",
        &wrapper,
        &[("model.", "model.language_model.")],
        "mtp.fc.weight",
    );
}

/// Qwen3.5's mixtures are multimodal too (`Qwen3_5MoeForConditionalGeneration`, `qwen3_5_moe`), laid out
/// as the dense ones.
#[test]
fn a_qwen3_5_moe_multimodal_checkpoint_loads_as_its_text_tower() {
    let wrapper = serde_json::json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "vision_config": {"model_type": "qwen3_5_moe_vision", "hidden_size": 8},
        "eos_token_id": [511, 509],
        "image_token_id": 500,
    });
    loads_as_its_text_tower(
        "qwen3_5_moe",
        &wrapper,
        &[("model.", "model.language_model.")],
        "mtp.fc.weight",
    );
}

/// The fixture `family` saved as a multimodal checkpoint: `wrapper` with the fixture's config as its
/// `text_config`, each tensor renamed by the first of `renames` whose prefix it has, and `extra` (a tensor
/// of another tower) beside them, loads as the text model with the text config's EOS.
fn loads_as_its_text_tower(family: &str, wrapper: &Value, renames: &[(&str, &str)], extra: &str) {
    let text_model = files::load_model(&fixture(family), DType::F32, &Device::Cpu).unwrap();
    let sequence = [509u32, 100, 200, 300, 7, 8, 9, 10];
    let expected = sequence_logits(&text_model, &sequence);
    let dir = copy_fixture(family);
    let text_config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    let mut wrapper = wrapper.clone();
    wrapper["text_config"] = text_config;
    std::fs::write(dir.path().join("config.json"), wrapper.to_string()).unwrap();
    let mut weights: HashMap<String, Tensor> = tensors(dir.path())
        .into_iter()
        .map(|(name, tensor)| {
            let renamed = renames
                .iter()
                .find(|(from, _)| name.starts_with(from))
                .map_or(name.clone(), |(from, to)| name.replacen(from, to, 1));
            (renamed, tensor)
        })
        .collect();
    weights.insert(
        extra.into(),
        Tensor::zeros((8, 3, 2, 2), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&weights, dir.path().join("model.safetensors")).unwrap();
    let model = files::load_model(dir.path(), DType::F32, &Device::Cpu)
        .unwrap_or_else(|error| panic!("{family} {renames:?}: {error}"));
    assert_eq!(
        model.config.eos_token_ids,
        [511],
        "{family} {renames:?}: the text config's own"
    );
    let diff = sequence_logits(&model, &sequence)
        .iter()
        .zip(&expected)
        .map(|(a, b)| max_diff(a, b))
        .fold(0.0, f32::max);
    assert_eq!(diff, 0.0, "{family} {renames:?}");
}

#[test]
fn sharded_checkpoints_load_like_single_files() {
    let dir = copy_fixture("llama");
    let weights = tensors(dir.path());
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (shard, names) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        let part: HashMap<String, Tensor> = names
            .iter()
            .map(|&name| (name.clone(), weights[name].clone()))
            .collect();
        candle_core::safetensors::save(&part, dir.path().join(shard)).unwrap();
        for name in names {
            weight_map.insert((*name).clone(), shard.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    // Both on one device: the GPU's sums need not agree with the CPU's to the last bit.
    let sharded = LocalModel::load(dir.path(), on_test_device()).unwrap();
    let single = load("llama");
    let sequence = [3u32, 17, 99, 250];
    let (a, b) = (
        sequence_logits(sharded.model(), &sequence),
        sequence_logits(single.model(), &sequence),
    );
    for (a, b) in a.iter().zip(&b) {
        assert_eq!(a, b);
    }

    // A shard the index names but the folder lacks.
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let error = load_error(dir.path());
    assert!(
        error.contains("model.safetensors.index.json") && error.contains("model-00002-of-00002"),
        "{error}"
    );
}

/// The gradients of every weight for the mean negative log-likelihood of the left-padded batch's next
/// tokens (where input and target are both real) match transformers', through autograd over the
/// differentiable forward and through the recomputed, hand-written backward the trainers run. Qwen3.5's
/// mixture to 1e-4 of each gradient's norm, the others to 1e-5: both float32 forwards round its last
/// linear layer's small gradients (`dt_bias`'s norm is 0.006) that far from the float64 values
/// (transformers' `dt_bias` sum by 6.2e-5 of the norm, this runtime's by 0.9e-5; its convolution's sum
/// by 1.1e-6 and 1.8e-5), which this runtime in float64 gives to 1e-7 of transformers' float64 forward.
#[test]
fn gradients_match_transformers() {
    for name in FAMILIES {
        let model = files::load_model(&fixture(name), DType::F32, &Device::Cpu).unwrap();
        let expected = expected(name);
        let batch = &expected["batch"];
        let rows: Vec<Vec<u32>> = batch["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(ids)
            .collect();
        let mask: Vec<Vec<u8>> = batch["attention_mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| ids(row).into_iter().map(|bit| bit as u8).collect())
            .collect();
        let input_ids = Tensor::new(rows, &Device::Cpu).unwrap();
        let key_mask = Tensor::new(mask, &Device::Cpu).unwrap();
        let width = input_ids.dim(1).unwrap();
        let real = (key_mask
            .narrow(1, 0, width - 1)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            * key_mask
                .narrow(1, 1, width - 1)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap())
        .unwrap();
        let tokens = real.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
        let gradients = &expected["gradients"];
        assert_eq!(tokens, gradients["tokens"].as_f64().unwrap(), "{name}");
        let loss_of = |logprobs: &Tensor| -> candle_core::Result<Tensor> {
            (logprobs * &real)?.sum_all()?.affine(-1.0 / tokens, 0.0)
        };
        let (trainable, vars) = model.trainable().unwrap();
        let logprobs = trainable
            .token_logprobs(&input_ids, &key_mask, Ops::Differentiable)
            .unwrap();
        let loss = loss_of(&logprobs).unwrap();
        let autograd = loss.backward().unwrap();
        let recomputed = trainable
            .backward_recomputed(&input_ids, &key_mask, loss_of)
            .unwrap();
        let weights = gradients["weights"].as_object().unwrap();
        for (path, loss, grads) in [
            ("autograd", loss, autograd),
            ("recomputed", recomputed.0, recomputed.1),
        ] {
            let what = format!("{name} ({path})");
            common::parity::close(
                &format!("{what}: loss"),
                loss.to_scalar::<f32>().unwrap() as f64,
                gradients["loss"].as_f64().unwrap(),
                1e-5,
                1.0,
            );
            let ours: Vec<(String, Tensor)> = vars
                .iter()
                .map(|(param, var)| {
                    let grad = grads
                        .get(var.as_tensor())
                        .unwrap_or_else(|| panic!("{what}: no gradient for {param}"));
                    (param.clone(), grad.clone())
                })
                .collect();
            // gpt-oss's per-expert gradients stacked as transformers holds its experts.
            let ours: Vec<(String, Vec<f32>)> = checkpoint_tensors(&model.config, ours)
                .unwrap()
                .into_iter()
                .map(|(param, grad)| (param, grad.flatten_all().unwrap().to_vec1().unwrap()))
                .collect();
            let ours = common::parity::fuse_experts(ours);
            assert_eq!(ours.len(), weights.len(), "{what}: the weights trained");
            let tolerance = if name == "qwen3_5_moe" { 1e-4 } else { 1e-5 };
            for (param, grad) in &ours {
                let theirs = weights
                    .get(param.as_str())
                    .unwrap_or_else(|| panic!("{what}: transformers has no weight {param}"));
                common::parity::gradient_matches_within(
                    &what, param, grad, theirs, 1e-6, tolerance,
                );
            }
        }
    }
}

#[test]
fn fixture_configs_parse_with_transformers_5_keys() {
    let llama = files::load_model(&fixture("llama"), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        llama.config.rope_scaling,
        holo_runtime::local::RopeScaling::Llama3 { factor, .. } if factor == 8.0
    ));
    assert!(!llama.config.tie_word_embeddings && llama.lm_head.is_some());
    let qwen = files::load_model(&fixture("qwen2"), DType::F32, &Device::Cpu).unwrap();
    assert!(qwen.config.tie_word_embeddings && qwen.lm_head.is_none());
    assert_eq!(qwen.config.rope_theta, 1e6);
    let qwen3 = files::load_model(&fixture("qwen3"), DType::F32, &Device::Cpu).unwrap();
    let attention = qwen3.layers[1].mixer.attention().unwrap();
    assert_eq!(
        qwen3.config.variant.qk_norm,
        holo_runtime::local::QkNorm::Head
    );
    assert!(!qwen3.config.qkv_bias && qwen3.lm_head.is_some());
    assert_eq!(
        (
            qwen3.config.head_dim,
            attention.qkv.part("q_proj").unwrap().weight.dims()
        ),
        (24, &[144, 64][..])
    );
    assert_eq!(attention.k_norm.as_ref().unwrap().weight.dims(), &[24]);
    let windows = |name: &str| -> Vec<(Option<usize>, bool)> {
        let model = files::load_model(&fixture(name), DType::F32, &Device::Cpu).unwrap();
        let layers = model.config.layers.iter();
        layers.map(|layer| (layer.window, layer.rope)).collect()
    };
    assert_eq!(windows("mistral"), [(Some(4), true), (Some(4), true)]);
    assert_eq!(windows("ministral"), [(Some(4), true), (None, true)]);
    assert_eq!(windows("smollm3"), [(None, true), (None, false)]);
}

#[test]
fn a_truncated_safetensors_file_is_an_error_not_a_panic() {
    let dir = copy_fixture("qwen2");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let error = load_error(dir.path());
    assert!(
        error.contains("model.safetensors") && error.contains("outside the file"),
        "{error}"
    );
    std::fs::write(&path, b"garbage").unwrap();
    let error = load_error(dir.path());
    assert!(error.contains("not a safetensors file"), "{error}");
}

/// A few AdamW steps on the differentiable forward teach the fixture model a sequence; the sampling path
/// (detached weights sharing the Vars' storage) sees the update without reloading anything.
#[test]
fn training_through_the_differentiable_forward_changes_what_is_sampled() {
    use candle_nn::{AdamW, Optimizer, ParamsAdamW};

    for lora in [false, true] {
        let local = load("qwen2");
        let (model, vars) = if lora {
            local
                .model()
                .with_lora(&holo_runtime::local::model::LoraConfig {
                    rank: 8,
                    alpha: 16.0,
                    targets: holo_runtime::local::model::Targets::names(&PROJECTIONS),
                    seed: 0,
                    dropout: 0.0,
                    parameters: Vec::new(),
                    ..Default::default()
                })
                .unwrap()
        } else {
            local.model().trainable().unwrap()
        };
        let sampler = model.detached();
        let prompt = [3u32, 17, 99];
        let target = [250u32, 7, 42, 88, 120];
        let sequence: Vec<u32> = prompt.iter().chain(&target).copied().collect();
        let device = model.device();
        let input = Tensor::new(sequence.as_slice(), device)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let mask = Tensor::ones((1, sequence.len()), DType::U8, device).unwrap();
        let nll = |model: &holo_runtime::local::Model| {
            model
                .token_logprobs(&input, &mask, Ops::Differentiable)
                .unwrap()
                .narrow(1, prompt.len() - 1, target.len())
                .unwrap()
                .sum_all()
                .unwrap()
                .neg()
                .unwrap()
        };
        let greedy = |model: &holo_runtime::local::Model| {
            let stopping = Stopping {
                eos: &[],
                tokenizer: local.tokenizer(),
            };
            let params = GenerationParams {
                max_tokens: target.len(),
                temperature: 0.0,
                ..Default::default()
            };
            generate(model, &stopping, &[prompt.to_vec()], &[params], None)
                .unwrap()
                .remove(0)
                .tokens
        };
        assert_ne!(
            greedy(&sampler),
            target,
            "the fixture does not know the target yet"
        );
        let before = nll(&model).to_scalar::<f32>().unwrap();
        let params = ParamsAdamW {
            // At 5e-2 the LoRA run oscillated and stalled near a tenth of its loss, passing or failing
            // with the last bits of the arithmetic; at 1e-2 it falls to 1e-4 of it.
            lr: 1e-2,
            weight_decay: 0.0,
            ..Default::default()
        };
        let mut optimizer =
            AdamW::new(vars.iter().map(|(_, var)| var.clone()).collect(), params).unwrap();
        // LoRA moves fewer weights: it needs more steps.
        for _ in 0..if lora { 80 } else { 30 } {
            optimizer.backward_step(&nll(&model)).unwrap();
        }
        let after = nll(&model).to_scalar::<f32>().unwrap();
        assert!(after < 0.1 * before, "lora={lora}: NLL {before} → {after}");
        // The sampling copy computes what the trained model computes.
        let trained = model
            .token_logprobs(&input, &mask, Ops::Differentiable)
            .unwrap();
        let sampled = sampler.token_logprobs(&input, &mask, Ops::Fast).unwrap();
        let diff = (trained - sampled)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            diff < 1e-4,
            "lora={lora}: the sampler lags the trained weights by {diff}"
        );
        if !lora {
            assert_eq!(
                greedy(&sampler),
                target,
                "the sampler now continues with the target"
            );
        }
    }
}

/// The next turn of a conversation (earlier prompt + completion + new tokens) reuses the cached keys and
/// values and samples what a model without the cache samples, alone or batched with other prompts.
#[tokio::test]
async fn the_prefix_cache_changes_nothing_but_the_work() {
    let cached = LocalModel::load(fixture("qwen2"), on_test_device()).unwrap();
    let plain = LocalModel::load(
        fixture("qwen2"),
        LocalOptions {
            prefix_cache_tokens: 0,
            ..on_test_device()
        },
    )
    .unwrap();
    // Turn 1 of two conversations, with different prompt lengths.
    let first = vec![
        request_seeded(vec![3, 17, 99, 250, 7], 1),
        request_seeded(vec![5, 6, 7, 8, 9, 10, 11, 12, 13], 2),
    ];
    let turn1 = cached.sample(&first).await;
    assert!(cached.prefix_cache().tokens() > 0);
    // Turn 2: each conversation continues with its completion and new tokens; a third prompt is new.
    let mut second = Vec::new();
    for (request, completion) in first.iter().zip(&turn1) {
        let Prompt::Tokens(prompt) = &request.prompt else {
            unreachable!()
        };
        let mut next = prompt.clone();
        next.extend(&completion.as_ref().unwrap().tokens);
        next.extend([42, 43, 44]);
        second.push(request_seeded(next, 3));
    }
    second.push(request_seeded(vec![100, 101], 4));
    fn request_seeded(prompt: Vec<u32>, seed: u64) -> Request {
        Request {
            prompt: Prompt::Tokens(prompt),
            params: SampleParams {
                max_tokens: Some(8),
                temperature: Some(1.0),
                seed: Some(seed),
                ..Default::default()
            },
        }
    }
    let before = cached.prefix_cache().reused_tokens();
    let with_cache = cached.sample(&second).await;
    let reused = cached.prefix_cache().reused_tokens() - before;
    assert!(
        reused >= 5 + 9,
        "the earlier turns were reused ({reused} tokens)"
    );
    let without = plain.sample(&second).await;
    assert_eq!(plain.prefix_cache().reused_tokens(), 0);
    for (a, b) in with_cache.iter().zip(&without) {
        let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
        assert_eq!(a.tokens, b.tokens);
        assert!(max_diff(&a.logprobs, &b.logprobs) < TOLERANCE);
    }

    // The cache keeps to its capacity.
    let small = LocalModel::load(
        fixture("qwen2"),
        LocalOptions {
            prefix_cache_tokens: 20,
            ..on_test_device()
        },
    )
    .unwrap();
    small.sample(&second).await;
    assert!(small.prefix_cache().tokens() <= 20);
    small.prefix_cache().clear();
    assert_eq!(small.prefix_cache().tokens(), 0);
}

/// Qwen3.5, dense and the mixture, in float64 against transformers with its own float32 casts in Gated
/// DeltaNet (and the mixture's router softmax) made float64 (`expected.json`'s `exact`): the float32
/// fixtures above allow 1e-4, which is also how far transformers' float32 delta rule drifts from its
/// float64 result on these prompts; in float64 the two forwards agree to the rotary tables' float32
/// rounding (both build them in float32).
#[test]
fn qwen3_5_in_float64_matches_transformers_in_float64() {
    for family in ["qwen3_5", "qwen3_5_moe"] {
        let exact = &expected(family)["exact"];
        let sequence = ids(&exact["ids"]);
        let model = files::load_model(&fixture(family), DType::F64, &Device::Cpu).unwrap();
        let ours = sequence_logits_f64(&model, &sequence);
        let theirs = exact["logits"].as_array().unwrap();
        assert_eq!(ours.len(), theirs.len());
        let mut worst = 0.0f64;
        for (ours, theirs) in ours.iter().zip(theirs) {
            for (a, b) in ours.iter().zip(theirs.as_array().unwrap()) {
                worst = worst.max((a - b.as_f64().unwrap()).abs());
            }
        }
        println!("{family} float64 logits: max |Δ| {worst:e}");
        assert!(worst < 1e-6, "{family}: float64 logits differ by {worst}");
    }
}

/// gpt-oss's MXFP4 experts (`gpt_oss/mxfp4/`, the fixture's quantized by `quantize_mxfp4`) load as
/// exactly the values transformers' `convert_moe_packed_tensors` dequantizes them to, in transformers'
/// layout; every other weight is the unquantized fixture's.
#[test]
fn gpt_oss_mxfp4_experts_are_transformers_dequantized_values() {
    let folder = fixture("gpt_oss").join("mxfp4");
    let stacked = |dir: &Path| -> HashMap<String, Tensor> {
        let model = files::load_model(dir, DType::F32, &Device::Cpu).unwrap();
        checkpoint_tensors(&model.config, model.named_weights())
            .unwrap()
            .into_iter()
            .collect()
    };
    let (quantized, plain) = (stacked(&folder), stacked(&fixture("gpt_oss")));
    let dequantized =
        candle_core::safetensors::load(folder.join("dequantized.safetensors"), &Device::Cpu)
            .unwrap();
    assert_eq!(dequantized.len(), 6, "two stacks in each of three layers");
    assert_eq!(quantized.len(), plain.len());
    let bits = |tensor: &Tensor| -> Vec<u32> {
        let values: Vec<f32> = tensor.flatten_all().unwrap().to_vec1().unwrap();
        values.iter().map(|value| value.to_bits()).collect()
    };
    for (name, tensor) in &quantized {
        let expected = dequantized.get(name).unwrap_or(&plain[name]);
        assert_eq!(tensor.dims(), expected.dims(), "{name}");
        assert!(bits(tensor) == bits(expected), "{name} differs");
    }
    for name in dequantized.keys() {
        assert!(
            max_diff(
                &quantized[name].flatten_all().unwrap().to_vec1().unwrap(),
                &plain[name].flatten_all().unwrap().to_vec1().unwrap()
            ) > 0.0,
            "{name}: quantization left the weights as they were"
        );
    }
}

/// gpt-oss's `config.json`: the fixture's values read, `GptOssConfig`'s defaults where keys are absent,
/// the config written back read the same, and bad values refused naming their key.
#[test]
fn gpt_oss_config_reads_its_keys_and_refuses_bad_values_by_name() {
    use holo_runtime::local::{ClampedSwiGlu, ModelConfig, RopeScaling};

    let text = std::fs::read_to_string(fixture("gpt_oss").join("config.json")).unwrap();
    let json: Value = serde_json::from_str(&text).unwrap();
    let config = ModelConfig::from_json(&json).unwrap();
    let experts = config.experts.unwrap();
    assert_eq!(
        (experts.count, experts.per_token, experts.intermediate_size),
        (4, 2, 32)
    );
    assert!(experts.softmax_over_chosen && !experts.normalize);
    assert_eq!(
        experts.clamped,
        Some(ClampedSwiGlu {
            alpha: 1.702,
            limit: 1.5
        })
    );
    let windows: Vec<Option<usize>> = config.layers.iter().map(|layer| layer.window).collect();
    assert_eq!(windows, [Some(4), None, Some(4)]);
    assert!(config.layers.iter().all(|layer| layer.experts));
    assert!(config.qkv_bias && config.o_bias && config.variant.attention_sinks);
    assert_eq!(
        config.rope_scaling,
        RopeScaling::Yarn {
            factor: 8.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 64,
            truncate: false,
            attention_factor: 0.1 * 8f64.ln() + 1.0,
        }
    );
    assert_eq!(config.rope_theta, 150_000.0);
    assert_eq!(ModelConfig::from_json(&config.to_json()).unwrap(), config);

    // `GptOssConfig`'s defaults.
    let mut bare = json.clone();
    for key in [
        "rope_parameters",
        "sliding_window",
        "layer_types",
        "num_local_experts",
        "num_experts_per_tok",
        "swiglu_limit",
        "swiglu_alpha",
        "head_dim",
        "attention_bias",
        "rms_norm_eps",
    ] {
        bare.as_object_mut().unwrap().remove(key);
    }
    let defaults = ModelConfig::from_json(&bare).unwrap();
    let experts = defaults.experts.unwrap();
    assert_eq!((experts.count, experts.per_token), (128, 4));
    assert_eq!(experts.clamped.unwrap().limit, 7.0);
    let windows: Vec<Option<usize>> = defaults.layers.iter().map(|layer| layer.window).collect();
    assert_eq!(windows, [Some(128), None, Some(128)]);
    assert_eq!((defaults.head_dim, defaults.rms_norm_eps), (64, 1e-5));
    assert!(defaults.qkv_bias && defaults.o_bias);
    assert_eq!(
        defaults.rope_scaling,
        RopeScaling::Yarn {
            factor: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 4096,
            truncate: false,
            attention_factor: 0.1 * 32f64.ln() + 1.0,
        }
    );

    let refused = |edit: &dyn Fn(&mut Value), says: &str| {
        let mut edited = json.clone();
        edit(&mut edited);
        let error = ModelConfig::from_json(&edited).unwrap_err().to_string();
        assert!(error.contains(says), "{says}: {error}");
    };
    refused(
        &|json| json["swiglu_limit"] = (-1.0).into(),
        "`swiglu_limit`",
    );
    refused(&|json| json["swiglu_alpha"] = "x".into(), "`swiglu_alpha`");
    refused(
        &|json| json["num_experts_per_tok"] = 5.into(),
        "`num_experts_per_tok`",
    );
    refused(
        &|json| json["num_local_experts"] = 0.into(),
        "`num_local_experts`",
    );
    refused(
        &|json| json["layer_types"][1] = "linear_attention".into(),
        "`layer_types[1]`",
    );
    refused(
        &|json| {
            json["rope_parameters"]
                .as_object_mut()
                .unwrap()
                .remove("factor");
        },
        "`factor`",
    );
    refused(
        &|json| json["rope_parameters"]["truncate"] = 1.into(),
        "`truncate`",
    );
    refused(
        &|json| json["quantization_config"] = serde_json::json!({"quant_method": "gptq"}),
        "`quantization_config` (gptq)",
    );
    // MXFP4 is gpt-oss's own: another family's config with it is refused.
    let qwen: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3_moe").join("config.json")).unwrap(),
    )
    .unwrap();
    let mut quantized = qwen.clone();
    quantized["quantization_config"] = serde_json::json!({"quant_method": "mxfp4"});
    let error = ModelConfig::from_json(&quantized).unwrap_err().to_string();
    assert!(error.contains("`quantization_config` (mxfp4)"), "{error}");
}
