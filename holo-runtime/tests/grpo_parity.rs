//! The GRPO trainer's formulas against TRL's own `GRPOTrainer`: advantages and reward metrics, the
//! importance-sampling correction, the policy's log-probabilities and entropies, every loss type's loss
//! and logged metrics, and the gradients of several weights, on the committed tiny Qwen2 model; one
//! step on every other family's tiny model. Fixtures: `tests/fixtures/grpo/` (made by
//! `scripts/grpo_fixtures.py` and `scripts/grpo_family_fixtures.py`; its README says how each number
//! was computed).
#![cfg(feature = "local")]

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Tensor, Var};
use holo_runtime::local::files::load_model;
use holo_runtime::local::model::checkpoint_tensors;
use holo_runtime::local::peft::LoraConfig;
use holo_runtime::local::update::adapter_config;
use holo_runtime::local::Model;
use holo_runtime::train::advantages::{advantages, Rewards};
use holo_runtime::train::batch::{Completion, Sequence};
use holo_runtime::train::config::{
    ImportanceSamplingLevel, ImportanceSamplingMode, LossType, MultiObjectiveAggregation,
    ScaleRewards,
};
use holo_runtime::train::{importance_sampling, loss, score, GrpoConfig, TrainingArguments};
use serde_json::Value;

mod common;

use common::parity::{fuse_experts, gradient_matches_within};

fn fixtures() -> Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/grpo/cases.json");
    serde_json::from_str(&std::fs::read_to_string(root).expect("cases.json")).expect("JSON")
}

fn floats(value: &Value) -> Vec<f64> {
    value
        .as_array()
        .expect("an array")
        .iter()
        .map(|v| v.as_f64().unwrap_or(f64::NAN))
        .collect()
}

fn f32s(value: &Value) -> Vec<f32> {
    floats(value).into_iter().map(|v| v as f32).collect()
}

fn enumerated<T: serde::de::DeserializeOwned>(value: &Value) -> T {
    serde_json::from_value(value.clone()).expect("a known value")
}

/// The case's options under our names (TRL's).
fn config(case: &Value) -> GrpoConfig {
    let c = &case["config"];
    let number = |key: &str| c[key].as_f64();
    let count = |key: &str| c[key].as_u64().expect(key) as usize;
    GrpoConfig {
        training: TrainingArguments {
            per_device_train_batch_size: count("per_device_train_batch_size"),
            gradient_accumulation_steps: count("gradient_accumulation_steps"),
            ..GrpoConfig::default().training
        },
        loss_type: enumerated::<LossType>(&c["loss_type"]),
        importance_sampling_level: enumerated::<ImportanceSamplingLevel>(
            &c["importance_sampling_level"],
        ),
        scale_rewards: enumerated::<ScaleRewards>(&c["scale_rewards"]),
        multi_objective_aggregation: enumerated::<MultiObjectiveAggregation>(
            &c["multi_objective_aggregation"],
        ),
        num_generations: count("num_generations"),
        max_completion_length: count("max_completion_length"),
        steps_per_generation: Some(count("steps_per_generation")),
        num_iterations: count("num_iterations"),
        temperature: number("temperature").unwrap(),
        beta: number("beta").unwrap(),
        use_bias_correction_kl: c["use_bias_correction_kl"].as_bool().unwrap(),
        epsilon: number("epsilon").unwrap(),
        epsilon_high: number("epsilon_high"),
        delta: number("delta"),
        sapo_temperature_pos: number("sapo_temperature_pos").unwrap(),
        sapo_temperature_neg: number("sapo_temperature_neg").unwrap(),
        vespo_k_pos: number("vespo_k_pos").unwrap(),
        vespo_lambda_pos: number("vespo_lambda_pos").unwrap(),
        vespo_k_neg: number("vespo_k_neg").unwrap(),
        vespo_lambda_neg: number("vespo_lambda_neg").unwrap(),
        mask_truncated_completions: c["mask_truncated_completions"].as_bool().unwrap(),
        top_entropy_quantile: number("top_entropy_quantile").unwrap(),
        off_policy_mask_threshold: number("off_policy_mask_threshold"),
        entropy_coef: number("entropy_coef").unwrap(),
        vllm_importance_sampling_correction: c["vllm_importance_sampling_correction"]
            .as_bool()
            .unwrap(),
        vllm_importance_sampling_mode: enumerated::<ImportanceSamplingMode>(
            &c["vllm_importance_sampling_mode"],
        ),
        vllm_importance_sampling_clip_min: number("vllm_importance_sampling_clip_min"),
        vllm_importance_sampling_clip_max: number("vllm_importance_sampling_clip_max"),
        ..GrpoConfig::default()
    }
}

/// `|ours − theirs| ≤ tolerance · max(|theirs|, floor)`, with a message naming what differs.
fn close(what: &str, ours: f64, theirs: f64, tolerance: f64, floor: f64) {
    let bound = tolerance * theirs.abs().max(floor);
    let both_nan = ours.is_nan() && theirs.is_nan();
    assert!(
        both_nan || (ours - theirs).abs() <= bound,
        "{what}: ours {ours}, TRL {theirs} (|Δ| {:e} > {bound:e})",
        (ours - theirs).abs()
    );
}

/// The size of the terms a micro-batch's loss sums: the mean |advantage| of its completions (each
/// token's term is its ratio, about 1, times its advantage).
fn term_scale(completions: &[Completion]) -> f64 {
    let total: f64 = completions.iter().map(|c| c.advantage.abs() as f64).sum();
    total / completions.len().max(1) as f64
}

#[test]
fn advantages_and_reward_metrics_match_trl() {
    let fixtures = fixtures();
    for case in fixtures["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let config = config(case);
        let rewards = Rewards {
            names: case["reward_func_names"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap().to_string())
                .collect(),
            weights: floats(&case["reward_weights"]),
            values: case["rewards_per_func"]
                .as_array()
                .unwrap()
                .iter()
                .map(floats)
                .collect(),
        };
        let scored = advantages(
            &rewards,
            config.num_generations,
            config.scale_rewards,
            config.multi_objective_aggregation,
        );
        for (i, completion) in case["completions"].as_array().unwrap().iter().enumerate() {
            close(
                &format!("{name}: advantage {i}"),
                scored.advantages[i],
                completion["advantage"].as_f64().unwrap(),
                1e-5,
                1e-2,
            );
        }
        let logged = case["generation_metrics"].as_object().unwrap();
        for (key, ours) in &scored.metrics {
            let theirs = logged
                .get(key)
                .unwrap_or_else(|| panic!("{name}: TRL logs no {key}"))
                .as_f64()
                .unwrap_or(f64::NAN);
            close(&format!("{name}: {key}"), *ours, theirs, 1e-5, 1e-3);
        }
    }
}

/// The case's completions as the trainer prepares them (TRL's advantages, old/ref/sampling log-probs).
fn completions(case: &Value, config: &GrpoConfig) -> Vec<Completion> {
    let use_vllm = case["config"]["use_vllm"].as_bool().unwrap();
    let mut completions: Vec<Completion> = case["completions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let prompt: Vec<u32> = floats(&c["prompt_ids"]).iter().map(|&v| v as u32).collect();
            let completion: Vec<u32> = floats(&c["completion_ids"])
                .iter()
                .map(|&v| v as u32)
                .collect();
            let mut ids = prompt.clone();
            ids.extend(&completion);
            let sampling = if use_vllm {
                f32s(&c["sampling_logps"])
            } else {
                vec![f32::NAN; completion.len()]
            };
            let masked = floats(&c["completion_mask"]).iter().all(|&m| m == 0.0);
            Completion {
                sequences: vec![Sequence {
                    ids,
                    trained: (prompt.len()..prompt.len() + completion.len()).collect(),
                    sampling_logprobs: sampling,
                    routes: None,
                    constraints: Default::default(),
                }],
                advantage: c["advantage"].as_f64().unwrap() as f32,
                token_advantages: None,
                mask: if masked { 0.0 } else { 1.0 },
                truncated: c["truncated"].as_bool().unwrap(),
                old_logprobs: Some(f32s(&c["old_logps"])),
                ref_logprobs: (config.beta != 0.0).then(|| f32s(&c["ref_logps"])),
                is_ratio: None,
                second_loss: false,
            }
        })
        .collect();
    if use_vllm {
        let mut metrics = BTreeMap::new();
        importance_sampling(config, &mut completions, &mut metrics);
        let logged = case["generation_metrics"].as_object().unwrap();
        // Every `sampling/*` metric TRL logs (ours adds two of its own, tested in holo-train).
        for (key, theirs) in logged
            .iter()
            .filter(|(key, _)| key.starts_with("sampling/"))
        {
            let ours = metrics
                .get(key)
                .unwrap_or_else(|| panic!("{}: no {key}", case["name"]));
            let theirs = theirs.as_f64().unwrap();
            close(
                &format!("{}: {key}", case["name"]),
                *ours,
                theirs,
                1e-5,
                1e-3,
            );
        }
        for (i, (ours, c)) in completions
            .iter()
            .zip(case["completions"].as_array().unwrap())
            .enumerate()
        {
            let theirs = match &c["importance_sampling_ratio"] {
                Value::Array(_) => floats(&c["importance_sampling_ratio"]),
                value => vec![value.as_f64().unwrap()],
            };
            let ours = ours.is_ratio.as_ref().unwrap();
            assert_eq!(ours.len(), theirs.len(), "{}: ratio count", case["name"]);
            for (o, t) in ours.iter().zip(&theirs) {
                close(
                    &format!("{}: IS ratio of completion {i}", case["name"]),
                    *o as f64,
                    *t,
                    1e-5,
                    1e-3,
                );
            }
        }
    }
    completions
}

#[test]
fn losses_metrics_and_gradients_match_trl() {
    let fixtures = fixtures();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen2");
    let base = load_model(&root, DType::F32, &common::test_device()).expect("fixture model");
    let gradient_params: Vec<String> = fixtures["gradient_params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    let mut checked = 0;
    for case in fixtures["cases"].as_array().unwrap() {
        let (model, vars) = base.trainable().unwrap();
        step_matches_trl(case, &model, &vars, &gradient_params, 0.0, 1.0);
        checked += 1;
    }
    assert_eq!(checked, fixtures["cases"].as_array().unwrap().len());
}

/// One case's optimizer step against TRL's (`cases.json` and `families.json` share the layout):
/// each micro-batch's loss, log-probabilities, entropies and logged metrics, then the gradients of
/// `gradient_params` accumulated over the micro-batches, entry by entry; losses and gradients both
/// with the graph kept and with layers recomputed. `router_aux_loss_coef` is what TRL adds a
/// mixture-of-experts model's load-balancing loss with (0: none); every tolerance is multiplied by
/// `noise` (1 but for a family whose float32 forward is noisier). Returns every accumulated gradient
/// (flattened) under the name and layout transformers trains the weight as, with the graph kept and
/// with layers recomputed.
fn step_matches_trl(
    case: &Value,
    model: &Model,
    vars: &[(String, Var)],
    gradient_params: &[String],
    router_aux_loss_coef: f64,
    noise: f64,
) -> [BTreeMap<String, Vec<f32>>; 2] {
    let name = case["name"].as_str().unwrap();
    let config = config(case);
    let all = completions(case, &config);
    // Accumulated over the micro-batches: with the graph kept, and with layers recomputed.
    let mut grads: [BTreeMap<String, Tensor>; 2] = Default::default();
    for micro in case["micro_batches"].as_array().unwrap() {
        let indices: Vec<usize> = floats(&micro["completions"])
            .iter()
            .map(|&i| i as usize)
            .collect();
        let chosen: Vec<Completion> = indices.iter().map(|&i| all[i].clone()).collect();
        let inputs = loss::Inputs {
            completions: &chosen,
            num_items_in_batch: case["num_items_in_batch"].as_f64().unwrap(),
            sampler_correction: case["config"]["use_vllm"].as_bool().unwrap(),
        };
        let mut metrics = BTreeMap::new();
        let mut scored = None;
        for recompute in [false, true] {
            let (value, store) = score::backward(
                model,
                &chosen,
                config.temperature,
                score::Pass {
                    recompute,
                    entropy_gradient: config.entropy_coef != 0.0,
                    // TRL divides the load-balancing loss by the accumulation steps, as the trainer does.
                    balance: router_aux_loss_coef
                        / config.training.gradient_accumulation_steps as f64,
                },
                |head| {
                    let (logprobs, entropies) = (&head.logprobs, &head.entropies);
                    scored = Some((logprobs.to_vec1::<f32>()?, entropies.to_vec1::<f32>()?));
                    let computed = loss::compute(&config, &inputs, logprobs, entropies)?;
                    metrics = computed.metrics;
                    if let Some(balance) = head.balance {
                        metrics.insert("aux_loss".into(), balance);
                    }
                    Ok(computed.loss)
                },
            )
            .unwrap();
            close(
                &format!("{name}: loss (recompute {recompute})"),
                value.to_scalar::<f32>().unwrap() as f64,
                micro["loss"].as_f64().unwrap(),
                // Losses are sums of terms (ratio × advantage, × log-probability for cispo and vespo)
                // that partly cancel, so their f32 rounding is relative to the terms, not to the total
                // (as small as 8e-4 here): the bound is relative to the larger of the loss and its
                // terms' size. The f32 forward already differs from torch's by ~1e-6 relative per
                // log-probability, which VESPO's gamma weights (exponentials of summed log-ratios)
                // magnify to ~8e-6. Every other loss type agrees within 2e-6.
                noise
                    * if config.loss_type == LossType::Vespo {
                        1e-5
                    } else {
                        2e-6
                    },
                term_scale(&chosen),
            );
            let grads = &mut grads[usize::from(recompute)];
            for (param, var) in vars {
                if let Some(grad) = store.get(var.as_tensor()) {
                    let sum = match grads.remove(param) {
                        Some(sum) => (sum + grad).unwrap(),
                        None => grad.clone(),
                    };
                    grads.insert(param.clone(), sum);
                }
            }
        }
        // The forward: TRL's log-probabilities and entropies of every trained token.
        let (logprobs, entropies) = scored.unwrap();
        let mut offset = 0;
        for &i in &indices {
            let c = &case["completions"][i];
            if all[i].mask == 0.0 {
                offset += all[i].len();
                continue;
            }
            for (t, (lp, ent)) in floats(&c["logps"])
                .iter()
                .zip(floats(&c["entropies"]))
                .enumerate()
            {
                close(
                    &format!("{name}: logprob {i}/{t}"),
                    logprobs[offset + t] as f64,
                    *lp,
                    1e-5 * noise,
                    1.0,
                );
                close(
                    &format!("{name}: entropy {i}/{t}"),
                    entropies[offset + t] as f64,
                    ent,
                    1e-5 * noise,
                    1.0,
                );
            }
            offset += all[i].len();
        }
        for (key, theirs) in micro["metrics"].as_object().unwrap() {
            let ours = metrics
                .get(key)
                .unwrap_or_else(|| panic!("{name}: we log no {key}"));
            // The KL term's mean moves with the log-probabilities' float32 rounding, about 1e-5
            // (gemma3_lora_all_linear's differs from TRL's by 1.6e-5 of itself, where both sides'
            // log-probabilities lie within 1.1e-5 of float64 transformers'): it is held to 1e-5 of
            // the larger of itself and how far it moves per unit of that rounding.
            let floor = if key == "kl" {
                kl_scale(case, &indices)
            } else {
                1e-3
            };
            close(
                &format!("{name}: {key}"),
                *ours,
                theirs.as_f64().unwrap_or(f64::NAN),
                1e-5 * noise,
                floor,
            );
        }
    }
    let [kept, recomputed] = grads.map(|grads| as_transformers_trains(model, vars, grads));
    for (path, grads) in [("", &kept), (" (recomputed)", &recomputed)] {
        for param in gradient_params {
            let expected = &case["gradients"][param];
            let grad = grads
                .get(param)
                .unwrap_or_else(|| panic!("{name}{path}: no gradient for {param}"));
            gradient_matches_within(
                &format!("{name}{path}"),
                param,
                grad,
                expected,
                1e-6,
                1e-5 * noise,
            );
        }
    }
    [kept, recomputed]
}

/// How far the `kl` metric of the micro-batch of `indices` moves per unit of error in every
/// log-probability: the mean over its tokens of |∂KL/∂ℓ|, where KL = w·k, k = e^{r−ℓ} − (r − ℓ) − 1
/// with r the reference log-probability and w the token's ratio e^{ℓ−ℓ_old} (TRL's bias correction;
/// 1 without it), so ∂KL/∂ℓ = w·(k + 1 − e^{r−ℓ}) (at the sequence level the ratio's share spreads
/// over the sequence, of the same size). About 0.3 with the fixtures' perturbations of ℓ_old and r.
fn kl_scale(case: &Value, indices: &[usize]) -> f64 {
    let corrected = case["config"]["use_bias_correction_kl"].as_bool().unwrap();
    let (mut total, mut tokens) = (0.0, 0.0);
    for &i in indices {
        let c = &case["completions"][i];
        let old = floats(&c["old_logps"]);
        let reference = floats(&c["ref_logps"]);
        let mask = floats(&c["completion_mask"]);
        for (t, logp) in floats(&c["logps"]).into_iter().enumerate() {
            let ratio = if corrected {
                (logp - old[t]).exp()
            } else {
                1.0
            };
            let log_ratio = reference[t] - logp;
            let kl = log_ratio.exp() - log_ratio - 1.0;
            total += mask[t] * (ratio * (kl + 1.0 - log_ratio.exp())).abs();
            tokens += mask[t];
        }
    }
    total / tokens.max(1.0)
}

/// Gradients by our weights' names (a weight no token reached, such as an expert no token was routed
/// to, has none) as transformers holds them: zero where there is none, as torch's gradient of a
/// stacked expert tensor is; gpt-oss's experts stacked and interleaved
/// ([`checkpoint_tensors`]), Qwen3-MoE's stacked ([`fuse_experts`]); flattened.
fn as_transformers_trains(
    model: &Model,
    vars: &[(String, Var)],
    mut grads: BTreeMap<String, Tensor>,
) -> BTreeMap<String, Vec<f32>> {
    let ours: Vec<(String, Tensor)> = vars
        .iter()
        .map(|(param, var)| {
            let grad = grads
                .remove(param)
                .unwrap_or_else(|| var.as_tensor().zeros_like().unwrap());
            (param.clone(), grad)
        })
        .collect();
    let flat = checkpoint_tensors(&model.config, ours)
        .unwrap()
        .into_iter()
        .map(|(param, grad)| (param, grad.flatten_all().unwrap().to_vec1().unwrap()))
        .collect();
    fuse_experts(flat).into_iter().collect()
}

/// One GRPO step on every other family the local runtime trains, against TRL's on the same family
/// (`tests/fixtures/grpo/families.json`, made by `scripts/grpo_family_fixtures.py`): the family's
/// committed tiny model, `grpo` with a KL term at temperature 0.7, two micro-batches each holding a
/// left-padded prompt, sequences longer than the fixtures' sliding windows, and for the
/// mixture-of-experts families the load-balancing loss TRL adds. Log-probabilities, entropies,
/// losses and metrics as [`step_matches_trl`] checks them; every parameter's gradient by its shape,
/// norm and sum, and the family's own parameters (q/k norms, post-norms, fused projections, routers,
/// experts, sinks, linear attention) entry by entry. The LoRA cases train PEFT's adapters over the
/// frozen base: every family's `target_modules="all-linear"` (its resolution by our rules must wrap
/// what PEFT's did), and `q_proj` with both expert stacks as target parameters on Qwen3-MoE and
/// Qwen3.5-MoE (with its router too). Every case runs; the failures are reported together.
#[test]
fn every_family_s_grpo_step_matches_trl() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/grpo/families.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    // The families with a step training every weight, and those with one training PEFT's all-linear
    // adapters.
    let covered = |trains: &dyn Fn(&Value) -> bool| -> Vec<&str> {
        cases
            .iter()
            .filter(|c| trains(c))
            .map(|c| c["model"].as_str().unwrap().rsplit('/').next().unwrap())
            .collect()
    };
    let full = covered(&|c| c["adapter"].is_null());
    let all_linear = covered(&|c| c["lora_targets"]["target_modules"] == "all-linear");
    for family in common::MODEL_FAMILIES {
        // Qwen2's full fine-tuning steps are `cases.json`'s, every option included.
        assert!(
            family == "qwen2" || full.contains(&family),
            "families.json has no {family}: run scripts/grpo_family_fixtures.py"
        );
        assert!(
            all_linear.contains(&family),
            "families.json has no all-linear LoRA step on {family}: run \
             scripts/lora_family_fixtures.py, then scripts/grpo_family_fixtures.py"
        );
    }
    let mut failed = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            family_step_matches_trl(case)
        }));
        if let Err(panic) = outcome {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|m| m.to_string()))
                .unwrap_or_default();
            // The assertions of the step name the case; a panic elsewhere may not.
            failed.push(if message.starts_with(name) {
                message
            } else {
                format!("{name}: {message}")
            });
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// [`step_matches_trl`] on a `families.json` case, then every parameter's accumulated gradient (with
/// the graph kept and with layers recomputed) by its size, L2 norm and sum.
fn family_step_matches_trl(case: &Value) {
    let name = case["name"].as_str().unwrap();
    let folder = common::repo().join(case["model"].as_str().unwrap());
    let base = load_model(&folder, DType::F32, &common::test_device()).expect("fixture model");
    let (model, vars) = match case["adapter"].as_str() {
        None => base.trainable().unwrap(),
        // PEFT's adapters (its saved names are ours) trained over the frozen base, from the values
        // TRL's step started from.
        Some(adapter) => {
            let adapter = folder.join(adapter);
            let saved_config = adapter_config(&adapter.join("adapter_config.json")).unwrap();
            let (model, vars) = base.with_lora(&requested(case, &saved_config)).unwrap();
            let saved = candle_core::safetensors::load(
                adapter.join("adapter_model.safetensors"),
                model.device(),
            )
            .unwrap();
            // What the request resolves to is what PEFT wrapped and saved, and what its saved
            // configuration (the request as PEFT resolved it) loads as.
            let mut ours: Vec<&String> = vars.iter().map(|(weight, _)| weight).collect();
            ours.sort();
            let mut theirs: Vec<&String> = saved.keys().collect();
            theirs.sort();
            assert_eq!(
                ours, theirs,
                "{name}: the adapters of {}",
                case["lora_targets"]
            );
            let (_, loaded) = base.with_lora(&saved_config).unwrap();
            let mut loaded: Vec<&String> = loaded.iter().map(|(weight, _)| weight).collect();
            loaded.sort();
            assert_eq!(
                loaded, theirs,
                "{name}: the adapters of adapter_config.json"
            );
            for (weight, var) in &vars {
                var.set(&saved[weight].to_dtype(DType::F32).unwrap())
                    .unwrap();
            }
            (model, vars)
        }
    };
    let detailed: Vec<String> = case["gradients"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let coefficient = case["router_aux_loss_coef"].as_f64().unwrap();
    // Qwen3.5's float32 Gated DeltaNet (its mixture's too: one of its entropies is 1.3e-5 from ours):
    // transformers' chunked delta rule drifts from its own float64
    // result by up to 1e-4 in logits (local_parity.rs,
    // `qwen3_5_in_float64_matches_transformers_in_float64`, where the forwards agree in float64);
    // here its log-probabilities differ from ours by up to 5.7e-5 and its entropies by 2.3e-5
    // (8.0e-5 and 3.3e-5 with LoRA), where the other families' stay within 1.3e-5 and 8e-6 (1.4e-5
    // and 8.6e-6 with LoRA).
    let noise = if folder.ends_with("qwen3_5") || folder.ends_with("qwen3_5_moe") {
        10.0
    } else {
        1.0
    };
    let both = step_matches_trl(case, &model, &vars, &detailed, coefficient, noise);
    let expected_params = case["gradient_norms"].as_object().unwrap();
    let mut trained: Vec<&String> = expected_params.keys().collect();
    trained.sort();
    for (path, grads) in ["", " (recomputed)"].into_iter().zip(&both) {
        let name = format!("{name}{path}");
        assert_eq!(
            grads.keys().collect::<Vec<_>>(),
            trained,
            "{name}: the weights trained"
        );
        for (param, expected) in expected_params {
            let values = &grads[param];
            let size: f64 = floats(&expected["shape"]).iter().product();
            assert_eq!(values.len(), size as usize, "{name}: ∇{param}'s size");
            let norm = values
                .iter()
                .map(|g| (*g as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            let theirs = expected["l2_norm"].as_f64().unwrap();
            close(
                &format!("{name}: ‖∇{param}‖"),
                norm,
                theirs,
                1e-5 * noise,
                1e-6,
            );
            // A sum's float32 rounding is relative to the sum of its terms' sizes, not to their norm (a
            // norm weight's 64 entries, each within 2e-6 of the norm, can move the sum by 1.4e-5 of it).
            let sum: f64 = values.iter().map(|g| *g as f64).sum();
            close(
                &format!("{name}: Σ∇{param}"),
                sum,
                expected["sum"].as_f64().unwrap(),
                1e-5 * noise,
                expected["abs_sum"].as_f64().unwrap(),
            );
        }
    }
}

/// The LoRA configuration a case's adapter was made with (`lora_targets`: PEFT's `target_modules`, and
/// `target_parameters` when set), at the rank, alpha and dropout of PEFT's saved configuration: what a
/// user who asked for those targets gets, `"all-linear"` resolved by our rules, not PEFT's.
fn requested(case: &Value, saved: &LoraConfig) -> LoraConfig {
    let targets = &case["lora_targets"];
    LoraConfig {
        targets: serde_json::from_value(targets["target_modules"].clone()).unwrap(),
        parameters: match &targets["target_parameters"] {
            Value::Null => Vec::new(),
            parameters => serde_json::from_value(parameters.clone()).unwrap(),
        },
        rank: saved.rank,
        alpha: saved.alpha,
        dropout: saved.dropout,
        ..LoraConfig::default()
    }
}

/// `loss_type = "dppo"` against prime-rl's own `default_loss_fn` (through its `compute_loss`, as its
/// trainer calls it), in f64: the loss and its gradient with respect to every trained token's
/// log-probability, with prime-rl's defaults and with a trust region tight enough to leave tokens out
/// (`tests/fixtures/grpo/prime_rl.json`, made by `scripts/prime_rl_fixtures.py` from a prime-rl
/// checkout).
#[test]
fn dppo_loss_is_prime_rl_s() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/grpo/prime_rl.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut left_out = Vec::new();
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let number = |key: &str| case["config"][key].as_f64().unwrap();
        let config = GrpoConfig {
            loss_type: LossType::Dppo,
            dppo_mask_high: number("dppo_mask_high"),
            dppo_mask_low: number("dppo_mask_low"),
            adv_tau: number("adv_tau"),
            kl_tau: number("kl_tau"),
            ..GrpoConfig::default()
        };
        let samples = case["samples"].as_array().unwrap();
        let completions: Vec<Completion> = samples
            .iter()
            .map(|sample| {
                let sampler = f32s(&sample["inference_logprobs"]);
                let length = sampler.len();
                Completion {
                    sequences: vec![Sequence {
                        ids: vec![1; length + 1],
                        trained: (1..=length).collect(),
                        sampling_logprobs: sampler,
                        routes: None,
                        constraints: Default::default(),
                    }],
                    advantage: sample["advantage"].as_f64().unwrap() as f32,
                    token_advantages: None,
                    mask: if sample["mask"] == true { 1.0 } else { 0.0 },
                    truncated: false,
                    old_logprobs: None,
                    ref_logprobs: None,
                    is_ratio: None,
                    second_loss: false,
                }
            })
            .collect();
        // The sampler's log-probabilities are f32 in a completion: the policy's are those f32 values
        // moved by prime-rl's difference, so the log-ratios are the fixture's.
        let logprobs: Vec<f64> = samples
            .iter()
            .zip(&completions)
            .flat_map(|(sample, completion)| {
                let trainer = floats(&sample["trainer_logprobs"]);
                let inference = floats(&sample["inference_logprobs"]);
                let sampler = completion.sampling_logprobs();
                trainer
                    .iter()
                    .zip(inference)
                    .zip(sampler)
                    .map(|((t, i), s)| f64::from(s) + (t - i))
                    .collect::<Vec<_>>()
            })
            .collect();
        let var = candle_core::Var::new(logprobs.as_slice(), &candle_core::Device::Cpu).unwrap();
        let entropy = Tensor::zeros(logprobs.len(), DType::F64, &candle_core::Device::Cpu).unwrap();
        let inputs = loss::Inputs {
            completions: &completions,
            num_items_in_batch: case["rl_scale"].as_f64().unwrap(),
            sampler_correction: false,
        };
        let computed = loss::compute(&config, &inputs, var.as_tensor(), &entropy).unwrap();
        let ours = computed.loss.to_scalar::<f64>().unwrap();
        close(
            &format!("{name}: loss"),
            ours,
            case["loss"].as_f64().unwrap(),
            1e-9,
            1e-3,
        );
        let gradient: Vec<f64> = computed
            .loss
            .backward()
            .unwrap()
            .get(&var)
            .unwrap()
            .to_vec1()
            .unwrap();
        let theirs: Vec<f64> = case["gradients"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(floats)
            .collect();
        assert_eq!(gradient.len(), theirs.len(), "{name}");
        for (index, (ours, theirs)) in gradient.iter().zip(&theirs).enumerate() {
            close(
                &format!("{name}: gradient {index}"),
                *ours,
                *theirs,
                1e-9,
                1e-3,
            );
        }
        left_out.push(computed.metrics["dppo/is_masked"]);
    }
    // The tight trust region leaves tokens out of the policy term, prime-rl's defaults none here: both
    // branches of the mask are compared.
    assert_eq!(left_out[0], 0.0, "{left_out:?}");
    assert!(left_out[1] > 0.0, "{left_out:?}");
}
