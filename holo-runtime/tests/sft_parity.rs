//! `holo sft` against TRL's own `SFTTrainer`: the tokenization of each dataset format (ids and trained
//! tokens), every micro-batch's loss and logged metrics (`entropy`, `mean_token_accuracy`), and the
//! accumulated gradients of several weights, on the committed tiny Qwen2 model. Fixtures:
//! `tests/fixtures/sft/cases.json` (made by `scripts/sft_fixtures.py`, whose docstring says how each number
//! was computed).
#![cfg(feature = "local")]

use holo_runtime::train::TrainingArguments;
use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Tensor};
use holo_runtime::chat::ChatTemplate;
use holo_runtime::local::files::{load_model, load_template, load_tokenizer};
use holo_runtime::train::batch::Sequence;
use holo_runtime::train::score;
use holo_runtime::train::sft::{loss, SftConfig, SftLossType, Tokenizing};
use serde_json::Value;

mod common;

use common::parity::{close, gradient_matches};

fn fixtures() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sft/cases.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("cases.json")).expect("JSON")
}

fn numbers(value: &Value) -> Vec<f64> {
    value
        .as_array()
        .expect("an array")
        .iter()
        .map(|v| v.as_f64().expect("a number"))
        .collect()
}

/// `|ours − theirs| ≤ tolerance · max(|theirs|, floor)`, with a message naming what differs.
/// The case's options under our names (TRL's).
fn config(case: &Value) -> SftConfig {
    let c = &case["config"];
    SftConfig {
        training: TrainingArguments {
            per_device_train_batch_size: c["per_device_train_batch_size"].as_u64().unwrap()
                as usize,
            gradient_accumulation_steps: c["gradient_accumulation_steps"].as_u64().unwrap()
                as usize,
            ..SftConfig::default().training
        },
        assistant_only_loss: c["assistant_only_loss"].as_bool().unwrap(),
        completion_only_loss: c["completion_only_loss"].as_bool(),
        loss_type: serde_json::from_value::<SftLossType>(c["loss_type"].clone()).unwrap(),
        max_length: c["max_length"].as_u64().map(|max| max as usize),
        ..SftConfig::default()
    }
}

#[test]
fn tokenization_losses_metrics_and_gradients_match_trl() {
    let fixtures = fixtures();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen2");
    let base = load_model(&root, DType::F32, &common::test_device()).expect("fixture model");
    let tokenizer = load_tokenizer(&root).expect("tokenizer");
    let model_template = load_template(&root).expect("chat template");
    let gradient_params: Vec<String> = fixtures["gradient_params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    let cases = fixtures["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 6);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let config = config(case);
        let template = match case["chat_template"].as_str() {
            Some(source) => ChatTemplate::from_source(
                source,
                "fixture",
                model_template.special_tokens().clone(),
            )
            .unwrap(),
            None => model_template.clone(),
        };
        let jsonl: String = case["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| format!("{row}\n"))
            .collect();
        let dataset = Tokenizing {
            tokenizer: &tokenizer,
            template: &template,
            vocab_size: base.config.vocab_size,
            config: &config,
        }
        .parse(&jsonl)
        .unwrap_or_else(|error| panic!("{name}: {error}"));
        assert_eq!(
            dataset.completion_only_loss,
            case["config"]["completion_only_loss"].as_bool().unwrap(),
            "{name}: completion_only_loss"
        );

        // Tokenization: TRL's input_ids, and its labels' -100 exactly where we train nothing.
        let prepared = case["prepared"].as_array().unwrap();
        assert_eq!(dataset.examples.len(), prepared.len(), "{name}: examples");
        for (i, (ours, theirs)) in dataset.examples.iter().zip(prepared).enumerate() {
            let ids: Vec<u32> = numbers(&theirs["input_ids"])
                .iter()
                .map(|&id| id as u32)
                .collect();
            assert_eq!(ours.ids, ids, "{name}: example {i}'s ids");
            let mask: Vec<u8> = numbers(&theirs["labels"])
                .iter()
                .map(|&label| (label != -100.0) as u8)
                .collect();
            assert_eq!(ours.mask, mask, "{name}: example {i}'s trained tokens");
        }
        let sequences: Vec<Sequence> = dataset.examples.iter().map(|e| e.sequence()).collect();
        let num_items: usize = sequences.iter().map(|s| s.trained.len()).sum();
        assert_eq!(
            num_items as u64,
            case["num_items_in_batch"].as_u64().unwrap(),
            "{name}: num_items_in_batch"
        );

        // The loss, its metrics and gradients, with and without recomputation.
        for recompute in [false, true] {
            let (model, vars) = base.trainable().unwrap();
            let mut grads: BTreeMap<String, Tensor> = BTreeMap::new();
            for micro in case["micro_batches"].as_array().unwrap() {
                let batch: Vec<&Sequence> = numbers(&micro["examples"])
                    .iter()
                    .map(|&i| &sequences[i as usize])
                    .collect();
                let computed = loss::micro_batch(
                    &model,
                    &batch,
                    num_items,
                    config.loss_type,
                    score::Pass {
                        recompute,
                        ..Default::default()
                    },
                )
                .unwrap();
                let what = format!("{name} (recompute {recompute})");
                close(
                    &format!("{what}: loss"),
                    computed.loss,
                    micro["loss"].as_f64().unwrap(),
                    1e-6,
                    1e-3,
                );
                for (key, theirs) in micro["metrics"].as_object().unwrap() {
                    let ours = computed
                        .metrics
                        .get(key)
                        .unwrap_or_else(|| panic!("{name}: we log no {key}"));
                    close(
                        &format!("{what}: {key}"),
                        *ours,
                        theirs.as_f64().unwrap(),
                        1e-5,
                        1e-3,
                    );
                }
                for (param, var) in &vars {
                    if let Some(grad) = computed.grads.get(var.as_tensor()) {
                        let sum = match grads.remove(param) {
                            Some(sum) => (sum + grad).unwrap(),
                            None => grad.clone(),
                        };
                        grads.insert(param.clone(), sum);
                    }
                }
            }
            for param in &gradient_params {
                let expected = &case["gradients"][param];
                let grad = grads
                    .get(param)
                    .unwrap_or_else(|| panic!("{name}: no gradient for {param}"))
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let what = format!("{name} (recompute {recompute})");
                gradient_matches(&what, param, &grad, expected, 1e-9);
            }
        }
    }
}
