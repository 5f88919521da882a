//! LoRA on the experts of mixture-of-experts models against PEFT 0.21's `target_parameters`
//! (`scripts/moe_lora_fixtures.py`): the committed Qwen3-MoE and gpt-oss fixtures in f64 with PEFT's own
//! adapter folder (both expert stacks and `q_proj`, every A and B nonzero). The trainer's adapters take
//! PEFT's tensor names, one for one; the logits match PEFT's in the trainer's model, through the served
//! adapter folder, with the experts merged and on the f32 sampling path, and the loss and every LoRA weight's gradient match with
//! the whole graph kept and with layers recomputed.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use holo_runtime::local::files::load_model;
use holo_runtime::local::model::{positions_from_mask, Model, Ops};
use holo_runtime::local::update::{adapter_config, with_adapter};
use holo_runtime::train::batch::Sequence;
use holo_runtime::train::score::{self, Pass};

/// The loss's weight on `Σ log p(trained tokens)`, as the script's.
const LOGPROB_WEIGHT: f64 = 0.1;

/// The largest `|a - b|` over the largest `|b|`.
fn relative(a: &Tensor, b: &Tensor) -> f64 {
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let difference = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    difference.to_scalar::<f64>().unwrap() / scale
}

/// The logits `[T, vocab]` of `ids` (f64 for f64 models).
fn logits(model: &Model, ids: &[u32], ops: Ops) -> Tensor {
    let input = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mask = Tensor::ones((1, ids.len()), DType::U8, &Device::Cpu).unwrap();
    let positions = positions_from_mask(&mask).unwrap();
    let hidden = model
        .forward_hidden(&input, &positions, &mask, None, ops)
        .unwrap();
    let logits = model.logits(&hidden, ops).unwrap().squeeze(0).unwrap();
    logits.to_dtype(DType::F64).unwrap()
}

fn check(name: &str) {
    let folder = crate::common::fixtures().join("models").join(name);
    let adapter = folder.join("moe_lora");
    let load = |file: &str| candle_core::safetensors::load(adapter.join(file), &Device::Cpu);
    let expected: HashMap<String, Tensor> = load("expected.safetensors").unwrap();
    let peft: HashMap<String, Tensor> = load("adapter_model.safetensors").unwrap();
    let lora = adapter_config(&adapter.join("adapter_config.json")).unwrap();
    // PEFT keeps them as a set: their order in the file varies.
    let mut parameters = lora.parameters.clone();
    parameters.sort();
    assert_eq!(
        parameters,
        ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"],
        "{name}: target_parameters read"
    );
    let base = load_model(&folder, DType::F64, &Device::Cpu).expect("fixture model");
    let (model, vars) = base.with_lora(&lora).unwrap();

    // The adapters are PEFT's tensors, under PEFT's names and shapes, every one.
    let mut ours: Vec<&str> = vars.iter().map(|(name, _)| name.as_str()).collect();
    let mut theirs: Vec<&str> = peft.keys().map(String::as_str).collect();
    ours.sort();
    theirs.sort();
    assert_eq!(ours, theirs, "{name}: adapter tensor names");
    for (weight, var) in &vars {
        var.set(&peft[weight]).unwrap();
    }

    let ids: Vec<Vec<u32>> = {
        let rows: Vec<Vec<i64>> = expected["input_ids"].to_vec2().unwrap();
        let lengths: Vec<i64> = expected["lengths"].to_vec1().unwrap();
        rows.iter()
            .zip(&lengths)
            .map(|(row, &length)| row[..length as usize].iter().map(|&id| id as u32).collect())
            .collect()
    };
    let want = &expected["logits"];
    let served = with_adapter(&base, &adapter).unwrap();
    let merged = model.with_experts_merged().unwrap();
    for (path, adapted) in [
        ("trained", &model),
        ("served", &served),
        ("experts merged", &merged),
    ] {
        let difference = relative(&logits(adapted, &ids[0], Ops::Differentiable), want);
        assert!(
            difference < 1e-5,
            "{name}, {path}: logits differ from PEFT's by {difference:e} of the largest"
        );
    }
    assert!(
        relative(&logits(&base, &ids[0], Ops::Differentiable), want) > 1e-2,
        "{name}: the adapters change the logits"
    );
    // The sampler's path: f32 weights and kernels, the adapter folder served as it is.
    let base32 = load_model(&folder, DType::F32, &Device::Cpu).expect("fixture model");
    let served32 = with_adapter(&base32, &adapter).unwrap();
    let difference = relative(&logits(&served32, &ids[0], Ops::Fast), want);
    assert!(
        difference < 1e-4,
        "{name}: f32 sampled logits differ from PEFT's by {difference:e} of the largest"
    );

    let firsts: Vec<i64> = expected["first_trained"].to_vec1().unwrap();
    let sequences: Vec<Sequence> = ids
        .iter()
        .zip(&firsts)
        .map(|(ids, &first)| Sequence {
            trained: (first as usize..ids.len()).collect(),
            sampling_logprobs: vec![f32::NAN; ids.len() - first as usize],
            ids: ids.clone(),
            routes: None,
        })
        .collect();
    let refs: Vec<&Sequence> = sequences.iter().collect();
    let expected_loss = expected["loss"].to_vec1::<f64>().unwrap()[0];
    for recompute in [false, true] {
        let pass = Pass {
            recompute,
            entropy_gradient: false,
            balance: 0.0,
        };
        let (value, grads) = score::backward_sequences(&model, &refs, 1.0, pass, |head| {
            head.logprobs.sum_all()? * LOGPROB_WEIGHT
        })
        .unwrap();
        let value = value.to_scalar::<f64>().unwrap();
        assert!(
            (value - expected_loss).abs() < 1e-6 * expected_loss.abs(),
            "{name}, recompute {recompute}: loss {value}, PEFT {expected_loss}"
        );
        for (weight, var) in &vars {
            let grad = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient of {weight}"));
            let difference = relative(grad, &expected[&format!("grad.{weight}")]);
            assert!(
                difference < 1e-5,
                "{name}, recompute {recompute}: ∇{weight} differs from PEFT's by {difference:e} of \
                 the largest"
            );
        }
    }
}

#[test]
fn qwen3_moe_expert_lora_is_peft_s() {
    check("qwen3_moe");
}

#[test]
fn gpt_oss_expert_lora_is_peft_s() {
    check("gpt_oss");
}
