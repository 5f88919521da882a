//! PPO's formulas against TRL's own `PPOTrainer` code (TRL 1.12.0, the last release that shipped it): the
//! per-token KL and rewards, GAE, returns and whitened advantages, and the micro-batch losses, clip
//! fractions and gradients of the policy and the value model, on the committed tiny Qwen2.
//! Fixtures: `tests/fixtures/ppo/cases.json` (made by `scripts/ppo_fixtures.py`; its docstring says how).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use holo_runtime::local::files::load_model;
use holo_runtime::train::batch::Sequence;
use holo_runtime::train::config::Algorithm;
use holo_runtime::train::config::KlEstimator;
use holo_runtime::train::ppo::critic::{Critic, HEAD};
use holo_runtime::train::ppo::{gae, micro_step, MicroBatch};
use holo_runtime::train::{GrpoConfig, TrainingArguments};
use serde_json::Value;

use crate::common::parity::{close, gradient_matches};

fn fixtures() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ppo/cases.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("cases.json")).expect("JSON")
}

fn rows(value: &Value) -> Vec<Vec<f32>> {
    value
        .as_array()
        .expect("rows")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("a row")
                .iter()
                .map(|v| v.as_f64().expect("a number") as f32)
                .collect()
        })
        .collect()
}

fn config(case: &Value, fixtures: &Value) -> GrpoConfig {
    let c = &case["config"];
    let number = |key: &str| c[key].as_f64().expect(key);
    GrpoConfig {
        training: TrainingArguments {
            gradient_accumulation_steps: fixtures["gradient_accumulation_steps"].as_u64().unwrap()
                as usize,
            ..GrpoConfig::default().training
        },
        algorithm: Algorithm::Ppo,
        kl_estimator: serde_json::from_value::<KlEstimator>(c["kl_estimator"].clone()).unwrap(),
        whiten_rewards: c["whiten_rewards"].as_bool().unwrap(),
        kl_coef: number("kl_coef"),
        gamma: number("gamma"),
        lam: number("lam"),
        cliprange: number("cliprange"),
        cliprange_value: number("cliprange_value"),
        vf_coef: number("vf_coef"),
        temperature: fixtures["temperature"].as_f64().unwrap(),
        ..GrpoConfig::default()
    }
}

fn assert_rows_close(what: &str, ours: &[Vec<f32>], theirs: &[Vec<f32>], floor: f64) {
    assert_eq!(ours.len(), theirs.len(), "{what}: rows");
    for (i, (ours, theirs)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(ours.len(), theirs.len(), "{what}[{i}]: tokens");
        for (t, (&a, &b)) in ours.iter().zip(theirs).enumerate() {
            close(
                &format!("{what}[{i}][{t}]"),
                a as f64,
                b as f64,
                1e-5,
                floor,
            );
        }
    }
}

/// Steps 4–6 of TRL's update: KL, per-token rewards (whitened or not), GAE, returns, whitened
/// advantages.
#[test]
fn rewards_gae_and_whitening_match_trl() {
    let fixtures = fixtures();
    let logprobs = rows(&fixtures["logprobs"]);
    let reference = rows(&fixtures["ref_logprobs"]);
    let values = rows(&fixtures["values"]);
    let scores: Vec<f32> = fixtures["scores"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_f64().unwrap() as f32)
        .collect();
    let valid = vec![true; scores.len()];
    for case in fixtures["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let config = config(case, &fixtures);
        let kls: Vec<Vec<f32>> = logprobs
            .iter()
            .zip(&reference)
            .map(|(logprobs, reference)| gae::kl(logprobs, reference, config.kl_estimator))
            .collect();
        assert_rows_close(&format!("{name}: kl"), &kls, &rows(&case["kl"]), 1e-3);
        let mut rewards: Vec<Vec<f32>> = kls
            .iter()
            .zip(&scores)
            .map(|(kl, &score)| {
                gae::token_rewards(score, Some(kl), config.kl_coef as f32, kl.len()).0
            })
            .collect();
        if config.whiten_rewards {
            gae::whiten(&mut rewards, &valid, false);
        }
        assert_rows_close(
            &format!("{name}: rewards"),
            &rewards,
            &rows(&case["rewards"]),
            1e-2,
        );
        let (mut advantages, returns): (Vec<_>, Vec<_>) = rewards
            .iter()
            .zip(&values)
            .map(|(rewards, values)| gae::gae(rewards, values, config.gamma, config.lam))
            .unzip();
        assert_rows_close(
            &format!("{name}: returns"),
            &returns,
            &rows(&case["returns"]),
            1e-2,
        );
        gae::whiten(&mut advantages, &valid, true);
        assert_rows_close(
            &format!("{name}: advantages"),
            &advantages,
            &rows(&case["advantages"]),
            1e-2,
        );
    }
}

/// The micro-batch losses and clip fractions, and the gradients of both models summed over the
/// micro-batches, with the whole graph and recomputed layer by layer.
#[test]
fn losses_and_gradients_match_trl() {
    let fixtures = fixtures();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(
        fixtures["model"]
            .as_str()
            .unwrap()
            .trim_start_matches("holo-runtime/"),
    );
    let base = load_model(&root, DType::F32, &Device::Cpu).expect("fixture model");
    let hidden = base.config.hidden_size;
    let head_values: Vec<f32> = rows(&Value::Array(vec![fixtures["value_head"].clone()])).remove(0);
    let head = Tensor::from_vec(head_values, (1, hidden), &Device::Cpu).unwrap();
    let prompts = rows(&fixtures["prompts"]);
    let responses = rows(&fixtures["responses"]);
    let sequences: Vec<Sequence> = prompts
        .iter()
        .zip(&responses)
        .map(|(prompt, response)| {
            let ids: Vec<u32> = prompt.iter().chain(response).map(|&id| id as u32).collect();
            Sequence {
                trained: (prompt.len()..ids.len()).collect(),
                sampling_logprobs: vec![f32::NAN; response.len()],
                ids,
                routes: None,
                constraints: Default::default(),
            }
        })
        .collect();
    let logprobs = rows(&fixtures["logprobs"]);
    let values = rows(&fixtures["values"]);
    for case in fixtures["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let advantages = rows(&case["advantages"]);
        let returns = rows(&case["returns"]);
        for recompute in [false, true] {
            let config = GrpoConfig {
                gradient_checkpointing: recompute,
                ..config(case, &fixtures)
            };
            let what = format!("{name} (recompute {recompute})");
            let (model, policy_vars) = base.trainable().unwrap();
            let critic = Critic::new(&base, Some(head.clone()), None, 0).unwrap();
            let mut sums: BTreeMap<String, Tensor> = BTreeMap::new();
            for micro in case["micro_batches"].as_array().unwrap() {
                let picked: Vec<usize> = micro["rows"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i.as_u64().unwrap() as usize)
                    .collect();
                let gather = |rows: &[Vec<f32>]| -> Vec<f32> {
                    picked
                        .iter()
                        .flat_map(|&i| rows[i].iter().copied())
                        .collect()
                };
                let batch = MicroBatch {
                    sequences: picked.iter().map(|&i| &sequences[i]).collect(),
                    old_logprobs: gather(&logprobs),
                    values: gather(&values),
                    advantages: gather(&advantages),
                    returns: gather(&returns),
                    mask: vec![1.0; picked.iter().map(|&i| responses[i].len()).sum()],
                };
                let step = micro_step(&model, &critic, &config, 0.0, &batch).unwrap();
                let stats: BTreeMap<&str, f64> = step.stats.iter().copied().collect();
                let at = format!("{what}, rows {picked:?}");
                // The policy loss averages `−A · ratio` over whitened advantages, whose terms cancel
                // (0.02 from terms near 1): its rounding is relative to the terms, |A|, not to the
                // mean, and a different summation order in the matrix products shows at 1e-5 of it.
                let terms = batch.advantages.iter().map(|a| a.abs() as f64).sum::<f64>()
                    / batch.advantages.len() as f64;
                for (ours, value, theirs, floor) in [
                    ("loss", step.loss, "loss", terms),
                    (
                        "loss/policy_avg",
                        stats["loss/policy_avg"],
                        "pg_loss",
                        terms,
                    ),
                    ("loss/value_avg", stats["loss/value_avg"], "vf_loss", 1e-6),
                    (
                        "policy/clipfrac_avg",
                        stats["policy/clipfrac_avg"],
                        "pg_clipfrac",
                        1e-6,
                    ),
                    (
                        "val/clipfrac_avg",
                        stats["val/clipfrac_avg"],
                        "vf_clipfrac",
                        1e-6,
                    ),
                ] {
                    close(
                        &format!("{at}: {ours}"),
                        value,
                        micro[theirs].as_f64().unwrap(),
                        1e-5,
                        floor,
                    );
                }
                let named = policy_vars
                    .iter()
                    .map(|(name, var)| (format!("policy.{name}"), var, &step.policy_grads))
                    .chain(
                        critic
                            .vars
                            .iter()
                            .map(|(name, var)| (format!("value.{name}"), var, &step.value_grads)),
                    );
                for (name, var, store) in named {
                    if let Some(grad) = store.get(var.as_tensor()) {
                        let sum = match sums.remove(&name) {
                            Some(sum) => (sum + grad).unwrap(),
                            None => grad.clone(),
                        };
                        sums.insert(name, sum);
                    }
                }
            }
            for (prefix, key) in [("policy", "policy_gradients"), ("value", "value_gradients")] {
                for (param, expected) in case[key].as_object().unwrap() {
                    let grad = sums
                        .get(&format!("{prefix}.{param}"))
                        .unwrap_or_else(|| panic!("{what}: no gradient for {prefix}.{param}"));
                    let grad = grad.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    gradient_matches(&what, &format!("{prefix}.{param}"), &grad, expected, 1e-6);
                }
            }
            assert!(sums.contains_key(&format!("value.{HEAD}")));
        }
    }
}

/// A multi-turn rollout is one stream of its trained tokens: the prompt and tool output between turns
/// (untrained positions inside a context, and other contexts' prompts) are not GAE steps. With γ = λ = 1
/// and no KL, every trained token's return is the rollout's reward and its advantage (before whitening)
/// the reward less its value; the reward lands on the last trained token of the last context.
#[test]
fn a_multi_turn_rollout_is_one_stream_of_trained_tokens() {
    use holo_runtime::train::batch::Completion;
    use holo_runtime::train::ppo::targets;

    let fixtures = fixtures();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(
        fixtures["model"]
            .as_str()
            .unwrap()
            .trim_start_matches("holo-runtime/"),
    );
    let base = load_model(&root, DType::F32, &Device::Cpu).expect("fixture model");
    let critic = Critic::new(&base, None, None, 5).unwrap();
    // Turn 1 samples positions 4–5, a tool's output fills 6–8, turn 2 samples 9–10; then a second
    // trained context (the next prompt) samples 3–4.
    let first = Sequence {
        ids: vec![37, 201, 88, 5, 104, 77, 12, 13, 14, 311, 511],
        trained: vec![4, 5, 9, 10],
        sampling_logprobs: vec![-1.0; 4],
        routes: None,
        constraints: Default::default(),
    };
    let second = Sequence {
        ids: vec![412, 150, 299, 251, 511],
        trained: vec![3, 4],
        sampling_logprobs: vec![-1.0; 2],
        routes: None,
        constraints: Default::default(),
    };
    let completion = |sequences: Vec<Sequence>| Completion {
        old_logprobs: Some(vec![-1.0; sequences.iter().map(|s| s.trained.len()).sum()]),
        sequences,
        advantage: 0.0,
        token_advantages: None,
        mask: 1.0,
        truncated: false,
        ref_logprobs: None,
        is_ratio: None,
        second_loss: false,
    };
    let completions = vec![
        completion(vec![first.clone(), second.clone()]),
        completion(vec![second.clone()]),
    ];
    let config = GrpoConfig {
        algorithm: Algorithm::Ppo,
        gamma: 1.0,
        lam: 1.0,
        ..GrpoConfig::default()
    };
    let mut metrics = BTreeMap::new();
    let scores = [2.0, -1.0];
    let (targets, _) = targets(&critic, &config, &completions, &scores, &mut metrics).unwrap();
    let values = critic.values(&[&first, &second], 4).unwrap();
    let expected_values: Vec<f32> = values.concat();
    assert_eq!(targets[0].values.len(), 6);
    for (t, (&ours, &alone)) in targets[0].values.iter().zip(&expected_values).enumerate() {
        assert!((ours - alone).abs() < 1e-6, "value {t}: {ours} vs {alone}");
    }
    for (target, score) in targets.iter().zip(scores) {
        for &ret in &target.returns {
            assert!((ret - score).abs() < 1e-5, "return {ret}, reward {score}");
        }
    }
    // Whitened over the batch's 8 tokens: the raw advantages are reward − value.
    let raw: Vec<f64> = targets
        .iter()
        .zip(scores)
        .flat_map(|(t, s)| t.values.iter().map(move |&v| (s - v) as f64))
        .collect();
    let mean = raw.iter().sum::<f64>() / raw.len() as f64;
    let std = (raw.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (raw.len() - 1) as f64).sqrt();
    let whitened: Vec<f32> = targets
        .iter()
        .flat_map(|t| t.advantages.iter().copied())
        .collect();
    for (ours, raw) in whitened.iter().zip(&raw) {
        assert!((*ours as f64 - (raw - mean) / std).abs() < 1e-4);
    }
    assert_eq!(metrics["objective/scores"], 0.5);
}

/// `value_model` names a folder: a Hugging Face sequence classifier's `score` head is kept (a causal LM
/// gets a new one), and a folder whose vocabulary is not the policy's is refused.
#[test]
fn a_value_model_folder_keeps_its_score_head() {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen2");
    let base = load_model(&source, DType::F32, &Device::Cpu).expect("fixture model");
    let folder = crate::common::tempdir::Dir::with_files_of("value-model", &source);
    let weights = folder.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &Device::Cpu).unwrap();
    let hidden = base.config.hidden_size;
    let head: Vec<f32> = (0..hidden).map(|i| i as f32 / 100.0).collect();
    tensors.insert(
        HEAD.to_string(),
        Tensor::from_vec(head.clone(), (1, hidden), &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &weights).unwrap();

    let config = GrpoConfig {
        algorithm: Algorithm::Ppo,
        value_model: Some(folder.path().display().to_string()),
        ..GrpoConfig::default()
    };
    let critic = holo_runtime::train::ppo::critic(&base, &config).unwrap();
    let kept = critic
        .head
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(kept, head);
    let fresh = holo_runtime::train::ppo::critic(
        &base,
        &GrpoConfig {
            value_model: None,
            ..config.clone()
        },
    )
    .unwrap();
    assert_ne!(
        fresh
            .head
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        head
    );

    // Another vocabulary: refused, naming the key.
    let mut json: Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap())
            .unwrap();
    json["vocab_size"] = 256.into();
    std::fs::write(folder.join("config.json"), json.to_string()).unwrap();
    tensors.insert(
        "model.embed_tokens.weight".into(),
        Tensor::zeros((256, hidden), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let error = holo_runtime::train::ppo::critic(&base, &config)
        .err()
        .expect("a vocabulary of 256 is refused")
        .to_string();
    assert!(
        error.contains("`value_model`") && error.contains("256"),
        "{error}"
    );
}
