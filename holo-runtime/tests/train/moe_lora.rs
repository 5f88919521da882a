//! LoRA on the experts of mixture-of-experts models against PEFT 0.21's `target_parameters`
//! (`scripts/moe_lora_fixtures.py`): the committed Qwen3-MoE and gpt-oss fixtures in f64 with PEFT's own
//! adapter folder (both expert stacks and `q_proj`, every A and B nonzero), Qwen3-MoE's
//! `target_modules="all-linear"` (the router and both stacks as PEFT converts them, the fused stack at
//! twice the rank through `rank_pattern`), a dense Qwen3 with `rank_pattern` and `alpha_pattern`, a dense
//! Qwen3 whose `target_modules` is a regular expression, and LoRA on the output head (`lm_head`) of Qwen3
//! and of SmolLM3, whose head is tied to its embeddings.
//! The trainer's adapters take PEFT's tensor names and shapes, one for one; the logits match PEFT's in
//! the trainer's model, through the served adapter folder, with the experts merged and on the f32
//! sampling path, and the loss and every LoRA weight's gradient match with the whole graph kept and with
//! layers recomputed. What PEFT wraps for other `target_modules` (`peft_targets.json`) is what
//! `Model::with_lora` wraps. A `holo train` run with `--lora-target-parameters`, or `all-linear` and a
//! rank pattern, writes a checkpoint PEFT loads to the trained model's logits, and `holo export` merges
//! the adapters into the weights transformers loads.

use std::collections::HashMap;
use std::fs;
use std::process::Command;

use candle_core::{DType, Device, Tensor};
use holo_runtime::local::files::load_model;
use holo_runtime::local::model::{positions_from_mask, LoraConfig, Model, Ops, Targets};
use holo_runtime::local::update::{adapter_config, with_adapter};
use holo_runtime::train::batch::Sequence;
use holo_runtime::train::score::{self, Pass};
use serde_json::{json, Value};

use crate::common::{holo_command, holo_output, qa_rows, qa_train};

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

/// The fixture model `name` with PEFT's adapter folder `adapter` beside it, whose `target_parameters`
/// are `parameters`.
fn check(name: &str, adapter: &str, parameters: &[&str]) {
    let folder = crate::common::fixtures().join("models").join(name);
    let adapter = folder.join(adapter);
    let load = |file: &str| candle_core::safetensors::load(adapter.join(file), &Device::Cpu);
    let expected: HashMap<String, Tensor> = load("expected.safetensors").unwrap();
    let peft: HashMap<String, Tensor> = load("adapter_model.safetensors").unwrap();
    let lora = adapter_config(&adapter.join("adapter_config.json")).unwrap();
    // PEFT keeps them as a set: their order in the file varies.
    let mut read = lora.parameters.clone();
    read.sort();
    assert_eq!(read, parameters, "{name}: target_parameters read");
    let base = load_model(&folder, DType::F64, &Device::Cpu).expect("fixture model");
    let (model, vars) = base.with_lora(&lora).unwrap();

    // The adapters are PEFT's tensors, under PEFT's names and shapes, every one.
    let mut ours: Vec<(&str, &[usize])> = vars
        .iter()
        .map(|(name, var)| (name.as_str(), var.dims()))
        .collect();
    // PEFT saves an adapted head's base weight beside its adapter; it is no adapter tensor.
    let mut theirs: Vec<(&str, &[usize])> = peft
        .iter()
        .filter(|(name, _)| !name.ends_with(".base_layer.weight"))
        .map(|(name, tensor)| (name.as_str(), tensor.dims()))
        .collect();
    ours.sort();
    theirs.sort();
    assert_eq!(ours, theirs, "{name}: adapter tensor names and shapes");
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
    let mut largest_logits = 0.0f64;
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
        largest_logits = largest_logits.max(difference);
    }
    assert!(
        relative(&logits(&base, &ids[0], Ops::Differentiable), want) > 1e-2,
        "{name}: the adapters change the logits"
    );
    // The sampler's path: f32 weights and kernels, the adapter folder served as it is.
    let base32 = load_model(&folder, DType::F32, &Device::Cpu).expect("fixture model");
    let served32 = with_adapter(&base32, &adapter).unwrap();
    let sampled = relative(&logits(&served32, &ids[0], Ops::Fast), want);
    assert!(
        sampled < 1e-4,
        "{name}: f32 sampled logits differ from PEFT's by {sampled:e} of the largest"
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
            constraints: Default::default(),
        })
        .collect();
    let refs: Vec<&Sequence> = sequences.iter().collect();
    let expected_loss = expected["loss"].to_vec1::<f64>().unwrap()[0];
    let mut largest_gradient = 0.0f64;
    // The training head in blocks of rows and columns (its chunked backward) as well as whole.
    let vocab = base.config.vocab_size;
    let chunked = model.clone().with_head_budget(3 * vocab + 5);
    for (recompute, model) in [(false, &model), (true, &model), (false, &chunked)] {
        let pass = Pass {
            recompute,
            entropy_gradient: false,
            balance: 0.0,
        };
        let (value, grads) = score::backward_sequences(model, &refs, 1.0, pass, |head| {
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
            largest_gradient = largest_gradient.max(difference);
        }
    }
    println!(
        "{name}/{}: relative to the largest, logits {largest_logits:.1e} (f64), {sampled:.1e} (f32 \
         sampled), {} LoRA gradients {largest_gradient:.1e}",
        adapter.file_name().unwrap().to_string_lossy(),
        vars.len()
    );
}

const STACKS: [&str; 2] = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"];

#[test]
fn qwen3_moe_expert_lora_is_peft_s() {
    check("qwen3_moe", "moe_lora", &STACKS);
}

#[test]
fn gpt_oss_expert_lora_is_peft_s() {
    check("gpt_oss", "moe_lora", &STACKS);
}

/// `target_modules="all-linear"` on Qwen3-MoE: PEFT adapts the attention as modules, and the router
/// (`gate.weight`) and both expert stacks as parameters, `gate_up_proj` at rank `2r` and alpha `2α`.
#[test]
fn qwen3_moe_all_linear_lora_is_peft_s() {
    check(
        "qwen3_moe",
        "moe_lora_all_linear",
        &["down_proj", "gate.weight", "gate_up_proj"],
    );
}

/// PEFT's `rank_pattern` and `alpha_pattern` on a dense model: a rank for every `q_proj`, another for
/// one layer's `down_proj`, alphas by module name.
#[test]
fn rank_and_alpha_patterns_are_peft_s() {
    check("qwen3", "lora_pattern", &[]);
}

/// `target_modules` as a regular expression (layer 1's `q_proj` and `k_proj`, every `down_proj`), read
/// from PEFT's `adapter_config.json`, where PEFT writes the string as it is.
#[test]
fn regex_target_modules_are_peft_s() {
    check("qwen3", "lora_regex", &[]);
}

/// LoRA on the output head (`lm_head` among the target modules) of an untied Qwen3.
#[test]
fn head_lora_is_peft_s() {
    check("qwen3", "lora_head", &[]);
}

/// LoRA on the output head of SmolLM3, whose head is tied to the embeddings: PEFT adapts the head's
/// product only, the input embeddings stay the base ones.
#[test]
fn tied_head_lora_is_peft_s() {
    check("smollm3", "lora_head", &[]);
}

/// What PEFT 0.21 wraps for each case of `peft_targets.json` (`target_modules` as a list, a suffix or
/// `"all-linear"`, target parameters, patterns beside the conversion's, `lm_head` named,
/// `"all-linear"` leaving a tied head out, and regular expressions: over the whole name, selecting
/// layers, naming the head, on gpt-oss, and on Qwen3-MoE turned into names first) is what
/// `Model::with_lora` wraps: the resolved configuration, and every adapter tensor by name and shape;
/// PEFT's refusal is ours (a regular expression that matches nothing, a bare `q_proj` among them, in
/// PEFT's words).
#[test]
fn target_modules_wrap_what_peft_wraps() {
    let cases: Vec<Value> = serde_json::from_str(
        &fs::read_to_string(crate::common::fixtures().join("train/peft_targets.json")).unwrap(),
    )
    .unwrap();
    let strings = |value: &Value| -> Vec<String> {
        match value {
            Value::String(one) => vec![one.clone()],
            Value::Null => Vec::new(),
            many => serde_json::from_value(many.clone()).unwrap(),
        }
    };
    for case in &cases {
        let name = case["model"].as_str().unwrap();
        let folder = crate::common::fixtures().join("models").join(name);
        let base = load_model(&folder, DType::F32, &Device::Cpu).expect("fixture model");
        let lora = LoraConfig {
            rank: 2,
            alpha: 3.0,
            targets: serde_json::from_value(case["target_modules"].clone()).unwrap(),
            parameters: strings(&case["target_parameters"]),
            rank_pattern: serde_json::from_value(case["rank_pattern"].clone()).unwrap_or_default(),
            alpha_pattern: serde_json::from_value(case["alpha_pattern"].clone())
                .unwrap_or_default(),
            ..LoraConfig::default()
        };
        let label = format!("{name} {}", case["target_modules"]);
        if let Some(error) = case["error"].as_str() {
            let ours = base.with_lora(&lora).map(drop).unwrap_err().to_string();
            println!("{label}: PEFT: {error}\n  ours: {ours}");
            let said = [
                "gate_proj without also targeting up_proj",
                "not found in the base model",
            ];
            assert!(
                said.iter()
                    .any(|says| error.contains(says) && ours.contains(says)),
                "{label}: {ours}"
            );
            continue;
        }
        let resolved = base.resolved_lora(&lora).unwrap();
        let want = &case["resolved"];
        // PEFT names `"all-linear"`'s modules in full where it converts nothing; the short names
        // match the same modules.
        let short = |names: Vec<String>| -> Vec<String> {
            let mut names: Vec<String> = names
                .iter()
                .map(|name| match name.strip_prefix("model.layers.") {
                    Some(rest) => rest.rsplit('.').next().unwrap().to_string(),
                    None => name.clone(),
                })
                .collect();
            names.sort();
            names.dedup();
            names
        };
        let theirs: Targets = serde_json::from_value(want["target_modules"].clone()).unwrap();
        match (&resolved.targets, theirs) {
            (Targets::Names(ours), Targets::Names(theirs)) => {
                assert_eq!(
                    short(ours.clone()),
                    short(theirs),
                    "{label}: target_modules"
                )
            }
            (ours, theirs) => assert_eq!(*ours, theirs, "{label}: target_modules"),
        }
        let mut parameters = resolved.parameters.clone();
        parameters.sort();
        assert_eq!(
            parameters,
            strings(&want["target_parameters"]),
            "{label}: target_parameters"
        );
        // In order: PEFT appends the conversion's key after the user's.
        assert_eq!(
            resolved.rank_pattern,
            serde_json::from_value(want["rank_pattern"].clone()).unwrap(),
            "{label}: rank_pattern"
        );
        assert_eq!(
            resolved.alpha_pattern,
            serde_json::from_value(want["alpha_pattern"].clone()).unwrap(),
            "{label}: alpha_pattern"
        );
        let (_, vars) = base.with_lora(&lora).unwrap();
        let ours: std::collections::BTreeMap<&str, Vec<usize>> = vars
            .iter()
            .map(|(name, var)| (name.as_str(), var.dims().to_vec()))
            .collect();
        let theirs: std::collections::BTreeMap<&str, Vec<usize>> = want_adapters(case);
        assert_eq!(ours, theirs, "{label}: adapters");
        // The configuration PEFT resolved, as its `adapter_config.json` holds it (gpt-oss's
        // `all-linear` as full module names), wraps the same again.
        let written = LoraConfig {
            targets: serde_json::from_value(want["target_modules"].clone()).unwrap(),
            parameters: strings(&want["target_parameters"]),
            rank_pattern: serde_json::from_value(want["rank_pattern"].clone()).unwrap(),
            alpha_pattern: serde_json::from_value(want["alpha_pattern"].clone()).unwrap(),
            ..lora
        };
        let (_, vars) = base.with_lora(&written).unwrap();
        let again: std::collections::BTreeMap<&str, Vec<usize>> = vars
            .iter()
            .map(|(name, var)| (name.as_str(), var.dims().to_vec()))
            .collect();
        assert_eq!(
            again, theirs,
            "{label}: adapters from PEFT's resolved configuration"
        );
    }
}

/// A case's adapter tensors, by name, with their shapes.
fn want_adapters(case: &Value) -> std::collections::BTreeMap<&str, Vec<usize>> {
    case["adapters"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, shape)| {
            (
                name.as_str(),
                serde_json::from_value(shape.clone()).unwrap(),
            )
        })
        .collect()
}

/// `holo train` on a mixture-of-experts fixture with the LoRA options `lora` (dropout 0, rank 2, alpha
/// 4 beside them): the checkpoint's `adapter_config.json` holds `expected`'s keys as PEFT resolves them
/// (expert stacks and routers as `target_parameters`, not modules), its expert adapters have moved; the
/// adapter folder served here and `holo export`'s merged folder give the same logits, and PEFT
/// (`PeftModel.from_pretrained`) and transformers give them too (`scripts/export_check.py`).
fn train_and_export(name: &str, lora: &[&str], expected: Value) {
    train_and_export_moving(name, lora, expected, ".mlp.experts.")
}

/// [`train_and_export`], checking that training moved the `B` of the adapters whose name contains
/// `part`.
fn train_and_export_moving(name: &str, lora: &[&str], expected: Value, part: &str) {
    let work = crate::common::tempdir::Dir::new(&format!("moe-lora-{name}"));
    let data = qa_rows(work.path(), 8);
    let base_dir = crate::common::fixtures().join("models").join(name);
    let run_dir = work.path().join("run");
    let mut args = qa_train(&base_dir, &data, &run_dir, 2);
    args.extend(
        [
            "--learning-rate",
            "0.01",
            "--entropy-coef",
            "0.1",
            "--use-peft",
            "true",
            "--lora-r",
            "2",
            "--lora-alpha",
            "4",
            "--lora-dropout",
            "0",
        ]
        .into_iter()
        .chain(lora.iter().copied())
        .map(String::from),
    );
    let output = holo_output(&args);
    assert!(output.status.success(), "{name}: {output:?}");

    let checkpoint = run_dir.join("checkpoint-2");
    let config: Value =
        serde_json::from_str(&fs::read_to_string(checkpoint.join("adapter_config.json")).unwrap())
            .unwrap();
    for (key, value) in expected.as_object().unwrap() {
        assert_eq!(&config[key], value, "{name}: {key} in {config}");
    }
    let adapters =
        candle_core::safetensors::load(checkpoint.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    let moved = adapters
        .iter()
        .filter(|(name, _)| name.contains(part) && name.contains("lora_B"))
        .map(|(_, b)| {
            b.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .fold(0.0f32, f32::max);
    assert!(
        moved > 1e-4,
        "{name}: training left the B of {part:?} at {moved}"
    );

    let export_dir = work.path().join("export");
    let exported = holo_command(&[
        "export",
        run_dir.to_str().unwrap(),
        "--out",
        export_dir.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert!(exported.status.success(), "{name}: {exported:?}");

    let base = load_model(&base_dir, DType::F32, &Device::Cpu).unwrap();
    let adapted = with_adapter(&base, &checkpoint).unwrap();
    let merged = load_model(&export_dir, DType::F32, &Device::Cpu).unwrap();
    let sequences: Vec<Vec<u32>> = vec![
        vec![7],
        vec![5, 17, 33, 2, 90, 41],
        vec![400, 3, 58, 121, 9, 260, 12, 8],
    ];
    let logits: Vec<_> = sequences
        .iter()
        .map(|ids| crate::common::logits::sequence_logits(&adapted, ids))
        .collect();
    let largest_difference = |model: &Model| {
        sequences
            .iter()
            .zip(&logits)
            .flat_map(|(ids, ours)| {
                let theirs = crate::common::logits::sequence_logits(model, ids);
                ours.iter()
                    .flatten()
                    .zip(theirs.into_iter().flatten())
                    .map(|(a, b)| (a - b).abs())
                    .collect::<Vec<_>>()
            })
            .fold(0.0f32, f32::max)
    };
    let difference = largest_difference(&merged);
    assert!(
        difference < 1e-4,
        "{name}: the export's logits differ by {difference}"
    );
    assert!(
        largest_difference(&base) > 1e-3,
        "{name}: the adapters change the logits"
    );

    let Some(python) =
        crate::common::components::peers(&["torch", "transformers", "peft", "safetensors"])
    else {
        return;
    };
    let logits_file = work.path().join("logits.json");
    fs::write(
        &logits_file,
        json!({"sequences": sequences, "logits": logits}).to_string(),
    )
    .unwrap();
    let output = Command::new(python)
        .arg(crate::common::repo().join("scripts/export_check.py"))
        .args([&export_dir, &base_dir, &logits_file])
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let result: Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|_| panic!("{output:?}"));
    println!("{name}: transformers/PEFT {result}");
    assert_eq!(result["ok"], true, "{name}: {result}");
    assert_eq!(result["lora"], true, "{name}: {result}");
}

const STACK_OPTIONS: [&str; 4] = [
    "--lora-target-modules",
    "[\"q_proj\"]",
    "--lora-target-parameters",
    "[\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]",
];

fn stacks_config() -> Value {
    json!({
        "target_modules": ["q_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    })
}

#[test]
fn qwen3_moe_trains_expert_adapters_peft_loads() {
    train_and_export("qwen3_moe", &STACK_OPTIONS, stacks_config());
}

#[test]
fn gpt_oss_trains_expert_adapters_peft_loads() {
    train_and_export("gpt_oss", &STACK_OPTIONS, stacks_config());
}

/// `--lora-target-modules all-linear` on Qwen3-MoE with a rank pattern from the command line: the
/// checkpoint says what PEFT's conversion says (the router and both stacks as parameters, the fused
/// stack's rank and alpha doubled after the user's pattern), and PEFT loads it to our logits.
#[test]
fn qwen3_moe_all_linear_trains_as_peft_converts_it() {
    train_and_export(
        "qwen3_moe",
        &[
            "--lora-target-modules",
            "[\"all-linear\"]",
            "--lora-rank-pattern",
            "{\"self_attn.o_proj\" = 3}",
        ],
        json!({
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "target_parameters": ["gate_up_proj", "down_proj", "gate.weight"],
            "rank_pattern": {"self_attn.o_proj": 3, ".*\\.gate_up_proj": 4},
            "alpha_pattern": {".*\\.gate_up_proj": 8.0},
        }),
    );
}

/// `--lora-target-modules` given PEFT's regular expression as bare text on a dense Qwen3 (layer 1's
/// `q_proj` and `k_proj`, every `down_proj`): the checkpoint's `adapter_config.json` holds the string as
/// PEFT writes it, and PEFT, which adapts what the expression matches, loads it to our logits (an
/// adapter trained on layer 0's attention would be missing from PEFT's model and change them).
#[test]
fn regex_target_modules_train_as_peft_reads_them() {
    let regex = r"model\.layers\.1\.self_attn\.(q|k)_proj|.*\.down_proj";
    train_and_export_moving(
        "qwen3",
        &["--lora-target-modules", regex],
        json!({"target_modules": regex}),
        "layers.1.self_attn.k_proj",
    );
}

/// `lora_target_parameters` refused by key: a name that is no expert stack, LoRA dropout beside it
/// (PEFT's `ParamWrapper` takes none), and a model without experts.
#[test]
fn bad_target_parameters_are_refused_by_name() {
    let work = crate::common::tempdir::Dir::new("moe-lora-refused");
    let data = qa_rows(work.path(), 1);
    let models = crate::common::fixtures().join("models");
    let refusal = |model: &str, parameters: &str, dropout: &str| {
        let mut args = qa_train(&models.join(model), &data, &work.path().join("run"), 1);
        args.extend(
            [
                "--use-peft",
                "true",
                "--lora-dropout",
                dropout,
                "--lora-target-parameters",
                parameters,
            ]
            .map(String::from),
        );
        let output = holo_output(&args);
        assert!(!output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stderr).to_string()
    };
    let stderr = refusal("qwen3_moe", "[\"mlp.experts.up_proj\"]", "0");
    assert!(
        stderr.contains("lora_target_parameters") && stderr.contains("mlp.experts.gate_up_proj"),
        "{stderr}"
    );
    let stderr = refusal("qwen3_moe", "[\"mlp.experts.down_proj\"]", "0.05");
    assert!(stderr.contains("lora_dropout"), "{stderr}");
    let stderr = refusal("qwen2", "[\"mlp.experts.down_proj\"]", "0");
    assert!(stderr.contains("has no experts"), "{stderr}");
}

/// `holo train` with `lm_head` among the target modules on Qwen2, whose head is tied to its embeddings:
/// the checkpoint names it as PEFT does and its head adapter moved; `holo export` merges it into a head
/// of its own (the config untied, the input embeddings as they were), and PEFT loads the checkpoint to
/// the trained model's logits.
#[test]
fn tied_head_adapter_trains_and_exports_as_peft_loads_it() {
    train_and_export_moving(
        "qwen2",
        &["--lora-target-modules", "[\"q_proj\", \"lm_head\"]"],
        json!({"target_modules": ["q_proj", "lm_head"]}),
        "base_model.model.lm_head.",
    );
}
