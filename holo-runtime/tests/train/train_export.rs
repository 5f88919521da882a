//! `holo export`: the folders it writes hold the trained weights (for a LoRA run, the base weights with the
//! adapters merged, checked against `W + (alpha / r) · B A` computed here), our model loaded from them gives
//! the trained model's logits, and (when the peer venv is installed) Hugging Face transformers and PEFT load
//! them and give the same logits (`scripts/export_check.py`).
//!
//! Each fixture model (Qwen2: q/k/v biases, tied embeddings; Llama: untied LM head; Qwen3: q/k norms,
//! heads wider than hidden / heads; Mistral and Ministral: sliding windows; SmolLM3: a layer without
//! RoPE; OLMo 2 and 3: norms after attention and the MLP; Gemma 3: offset norms, GeGLU, scaled
//! embeddings; Qwen3-MoE and gpt-oss: experts, gpt-oss's stacked in the export) is trained for two steps by the real `holo train`, with full fine-tuning and with LoRA. Every row gets the same reward, so
//! the advantages are zero; `--entropy-coef` gives the weights a gradient all the same.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::{holo_command, qa_rows, qa_train};
use candle_core::{DType, Device, Tensor};
use holo_runtime::local::files::load_model;
use holo_runtime::local::model::{checkpoint_tensors, LoraConfig, Targets};
use holo_runtime::local::{Model, ModelConfig};
use serde_json::{json, Value};

/// What our model loaded from an export may differ from the trained one by (the merged matrix product
/// rounds differently from the adapter's two), and what transformers and PEFT may differ from ours by.
const TOLERANCE: f32 = 1e-4;
const LORA_R: usize = 4;
const LORA_ALPHA: f64 = 8.0;
const LORA_TARGETS: [&str; 3] = ["q_proj", "v_proj", "down_proj"];

/// The LoRA targets of a fixture: the attention's alone for a mixture of experts, whose MLP projection
/// names PEFT takes to mean the experts (adapted here only as target parameters, see `moe_lora.rs`).
fn lora_targets(model: &str) -> &'static [&'static str] {
    match model {
        "qwen3_moe" | "gpt_oss" => &LORA_TARGETS[..2],
        _ => &LORA_TARGETS,
    }
}
/// The trainer's default seed (it only draws the adapters' initial `A`, which the checkpoint replaces).
const SEED: u64 = 42;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn run(mut command: Command) -> Output {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{command:?} exited with {}\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// `holo train hol/qa.hol` for two steps, saving both.
fn train(base: &Path, data: &Path, out: &Path, lora: Option<&[&str]>) {
    let targets = serde_json::to_string(&lora.unwrap_or_default()).unwrap();
    let (r, alpha) = (LORA_R.to_string(), LORA_ALPHA.to_string());
    let mut args = qa_train(base, data, out, 2);
    args.extend(
        [
            "--learning-rate",
            "0.01",
            "--entropy-coef",
            "0.1",
            "--save-steps",
            "1",
        ]
        .map(String::from),
    );
    if lora.is_some() {
        args.extend(
            [
                "--use-peft",
                "--lora-r",
                &r,
                "--lora-alpha",
                &alpha,
                "--lora-dropout",
                "0",
                "--lora-target-modules",
                &targets,
            ]
            .map(String::from),
        );
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(holo_command(&args));
}

fn export(run_dir: &Path, out: &Path, step: Option<u64>) -> Output {
    let mut args = vec![
        "export".to_string(),
        run_dir.display().to_string(),
        "--out".to_string(),
        out.display().to_string(),
    ];
    if let Some(step) = step {
        args.extend(["--step".to_string(), step.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    holo_command(&args).output().unwrap()
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

fn values(tensor: &Tensor) -> Vec<f32> {
    assert_eq!(tensor.dtype(), DType::F32);
    tensor.flatten_all().unwrap().to_vec1().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn keys<V>(map: &HashMap<String, V>) -> BTreeSet<&str> {
    map.keys().map(String::as_str).collect()
}

/// Token-id sequences of lengths 1, 6 and 17, spread over the vocabulary.
fn sequences(vocab: usize) -> Vec<Vec<u32>> {
    [(1, 7), (6, 101), (17, 389)]
        .into_iter()
        .map(|(len, start)| {
            (0..len)
                .map(|i| ((start + 37 * i * i + 11 * i) % vocab) as u32)
                .collect()
        })
        .collect()
}

/// Logits `[T][vocab]` of each sequence, alone and unpadded.
fn logits(model: &Model, sequences: &[Vec<u32>]) -> Vec<Vec<Vec<f32>>> {
    sequences
        .iter()
        .map(|sequence| crate::common::logits::sequence_logits(model, sequence))
        .collect()
}

fn max_logit_diff(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| max_diff(x, y))
        .fold(0.0, f32::max)
}

fn load(dir: &Path) -> Model {
    load_model(dir, DType::F32, &Device::Cpu)
        .unwrap_or_else(|error| panic!("{}: {error}", dir.display()))
}

/// The trained model as the run holds it: the base with the checkpoint's weights, or with LoRA adapters
/// set to the checkpoint's (not merged).
fn trained(base: &Model, checkpoint: &Path, lora: Option<&[&str]>) -> Model {
    let (model, vars, file) = if let Some(targets) = lora {
        let config = LoraConfig {
            rank: LORA_R,
            alpha: LORA_ALPHA,
            targets: Targets::names(targets),
            seed: SEED,
            dropout: 0.0,
            parameters: Vec::new(),
            ..Default::default()
        };
        let (model, vars) = base.with_lora(&config).unwrap();
        (model, vars, "adapter_model.safetensors")
    } else {
        let (model, vars) = base.trainable().unwrap();
        (model, vars, "model.safetensors")
    };
    let saved = tensors(&checkpoint.join(file));
    let names: BTreeSet<&str> = vars.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, keys(&saved), "{}", checkpoint.display());
    for (name, var) in &vars {
        var.set(&saved[name]).unwrap();
    }
    model
}

/// The logits file `scripts/export_check.py` compares with.
fn write_logits(path: &Path, sequences: &[Vec<u32>], logits: &[Vec<Vec<f32>>]) {
    let text = serde_json::to_string(&json!({"sequences": sequences, "logits": logits})).unwrap();
    fs::write(path, text).unwrap();
}

/// (i) A full fine-tuning export holds exactly the checkpoint's weights, under the base's names (the
/// checkpoint's, as the trainer holds them, laid out as the family's checkpoints: gpt-oss's experts
/// stacked).
fn check_full_weights(base_dir: &Path, checkpoint: &Path, out: &Path) {
    let base = tensors(&base_dir.join("model.safetensors"));
    let config = ModelConfig::from_file(&base_dir.join("config.json")).unwrap();
    let saved = tensors(&checkpoint.join("model.safetensors"));
    let saved: HashMap<String, Tensor> = checkpoint_tensors(&config, saved.into_iter().collect())
        .unwrap()
        .into_iter()
        .collect();
    let exported = tensors(&out.join("model.safetensors"));
    assert_eq!(keys(&exported), keys(&base), "{}", out.display());
    assert_eq!(keys(&saved), keys(&base), "every weight is trained");
    let mut moved = 0.0f32;
    for (name, tensor) in &exported {
        assert_eq!(tensor.dims(), base[name].dims(), "{name}");
        let (ours, trained) = (values(tensor), values(&saved[name]));
        assert!(
            ours.iter()
                .zip(&trained)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: the export differs from the checkpoint"
        );
        moved = moved.max(max_diff(&ours, &values(&base[name])));
    }
    assert!(
        moved > 1e-3,
        "training moved no weight (max |Δ| {moved}), so the check proves little"
    );
}

/// (ii) A LoRA export holds `W + (alpha / r) · B A` for each adapted projection, the base weight for every
/// other, and the checkpoint's adapter files; returns the largest |Δ| of the merged weights.
fn check_merged_weights(
    base_dir: &Path,
    checkpoint: &Path,
    out: &Path,
    layers: usize,
    targets: &[&str],
) -> f32 {
    for file in ["adapter_model.safetensors", "adapter_config.json"] {
        assert_eq!(
            fs::read(out.join("adapter").join(file)).unwrap(),
            fs::read(checkpoint.join(file)).unwrap(),
            "adapter/{file} is the checkpoint's"
        );
    }
    let config: Value =
        serde_json::from_str(&fs::read_to_string(out.join("adapter/adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], LORA_R);
    assert_eq!(config["lora_alpha"], LORA_ALPHA);
    // A fused model's adapted modules are the fused ones its targets name (Phi-3's `qkv_proj`).
    let base = tensors(&base_dir.join("model.safetensors"));
    let targets = Targets::names(targets);
    // A mixture's experts take no module targets (this run names none of its stacks).
    let adapted = |module: &str| {
        let short = module.rsplit('.').next().unwrap_or(module);
        !module.contains(".mlp.experts.") && holo_runtime::local::model::targets(&targets, short)
    };
    // In order of first appearance, layer by layer (Qwen3.5's first layer has no attention projections;
    // its mixture's `down_proj` is its shared expert's).
    let mut modules: Vec<&str> = Vec::new();
    for i in 0..layers {
        for layer in [
            "self_attn.q_proj",
            "self_attn.qkv_proj",
            "self_attn.v_proj",
            "mlp.down_proj",
            "mlp.shared_expert.down_proj",
        ] {
            let short = layer.rsplit('.').next().unwrap();
            if base.contains_key(&format!("model.layers.{i}.{layer}.weight"))
                && adapted(layer)
                && !modules.contains(&short)
            {
                modules.push(short);
            }
        }
    }
    assert_eq!(config["target_modules"], json!(modules));
    let scale = config["lora_alpha"].as_f64().unwrap() / config["r"].as_f64().unwrap();

    let adapters = tensors(&checkpoint.join("adapter_model.safetensors"));
    let exported = tensors(&out.join("model.safetensors"));
    assert_eq!(keys(&exported), keys(&base), "{}", out.display());
    let mut expected_adapters = BTreeSet::new();
    let mut largest_b = 0.0f32;
    let mut worst = 0.0f32;
    for (name, weight) in &base {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let target = module.starts_with("model.layers.") && adapted(module);
        if !target {
            assert!(
                values(&exported[name])
                    .iter()
                    .zip(values(weight))
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name} is not adapted, so the export keeps the base weight"
            );
            continue;
        }
        let prefix = format!("base_model.model.{module}");
        let (a_name, b_name) = (
            format!("{prefix}.lora_A.weight"),
            format!("{prefix}.lora_B.weight"),
        );
        let (a, b) = (&adapters[&a_name], &adapters[&b_name]);
        expected_adapters.extend([a_name, b_name]);
        let (out_dim, in_dim) = weight.dims2().unwrap();
        assert_eq!(a.dims(), [LORA_R, in_dim], "{name}");
        assert_eq!(b.dims(), [out_dim, LORA_R], "{name}");
        let (w, a, b) = (values(weight), values(a), values(b));
        largest_b = b.iter().fold(largest_b, |m, x| m.max(x.abs()));
        let merged: Vec<f32> = (0..out_dim * in_dim)
            .map(|index| {
                let (o, i) = (index / in_dim, index % in_dim);
                let product: f64 = (0..LORA_R)
                    .map(|k| f64::from(b[o * LORA_R + k]) * f64::from(a[k * in_dim + i]))
                    .sum();
                (f64::from(w[index]) + scale * product) as f32
            })
            .collect();
        worst = worst.max(max_diff(&values(&exported[name]), &merged));
    }
    let adapted_weights = base
        .keys()
        .filter(|name| {
            let module = name.strip_suffix(".weight").unwrap_or(name);
            module.starts_with("model.layers.") && adapted(module)
        })
        .count();
    assert!(
        adapted_weights >= layers,
        "every layer has an adapted module"
    );
    assert_eq!(
        expected_adapters.len(),
        adapted_weights * 2,
        "every adapted module of every layer has an adapter"
    );
    assert_eq!(
        keys(&adapters),
        expected_adapters.iter().map(String::as_str).collect(),
        "the adapters are exactly the targets' lora_A and lora_B, under PEFT's names"
    );
    assert!(
        largest_b > 1e-3,
        "training left B at {largest_b}, so the merge is the base weight and the check proves little"
    );
    assert!(worst <= 1e-6, "merged weights differ by {worst}");
    worst
}

/// One export checked here, and what the Python check needs.
struct Case {
    label: String,
    out: PathBuf,
    base: PathBuf,
    logits: PathBuf,
}

fn check_run(work: &Path, model: &str, lora: bool, data: &Path) -> Case {
    let mode = if lora { "lora" } else { "full" };
    let label = format!("{model}-{mode}");
    let base_dir = fixture(model);
    let run_dir = work.join(format!("run-{label}"));
    let targets = lora.then(|| lora_targets(model));
    train(&base_dir, data, &run_dir, targets);

    // LoRA exports the older checkpoint by `--step`, full fine-tuning the newest by default.
    let step = if lora { 1 } else { 2 };
    let out = work.join(format!("export-{label}"));
    let exported = export(&run_dir, &out, lora.then_some(step));
    let stdout = String::from_utf8_lossy(&exported.stdout);
    assert!(exported.status.success(), "{stdout}");
    assert!(
        stdout.contains(&format!("checkpoint-{step} of")),
        "{stdout}"
    );
    assert_eq!(stdout.contains("LoRA adapters (PEFT)"), lora, "{stdout}");
    let checkpoint = run_dir.join(format!("checkpoint-{step}"));
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            fs::read(out.join(file)).unwrap(),
            fs::read(base_dir.join(file)).unwrap(),
            "{file} is the base's"
        );
    }

    let base = load(&base_dir);
    let merge_diff = if lora {
        check_merged_weights(
            &base_dir,
            &checkpoint,
            &out,
            base.config.num_hidden_layers,
            lora_targets(model),
        )
    } else {
        check_full_weights(&base_dir, &checkpoint, &out);
        0.0
    };

    // (iii) Our model loaded from the export gives the trained model's logits.
    let sequences = sequences(base.config.vocab_size);
    let expected = logits(&trained(&base, &checkpoint, targets), &sequences);
    let ours = logits(&load(&out), &sequences);
    let diff = max_logit_diff(&ours, &expected);
    let moved = max_logit_diff(&logits(&base, &sequences), &expected);
    println!(
        "{label}: checkpoint-{step}, merged weights max |Δ| {merge_diff:e}, logits of the export vs the trained model max |Δ| {diff:e} (training moved them by {moved:e})"
    );
    if lora {
        assert!(diff <= TOLERANCE, "{label}: logits differ by {diff}");
    } else {
        assert_eq!(diff, 0.0, "{label}: the same weights give the same logits");
    }
    assert!(moved > 1e-3, "{label}: training did not change the logits");

    let logits_file = work.join(format!("logits-{label}.json"));
    write_logits(&logits_file, &sequences, &expected);
    Case {
        label,
        out,
        base: base_dir,
        logits: logits_file,
    }
}

/// (iv) `scripts/export_check.py` on every export, in one Python process.
fn python_check(cases: &[Case]) {
    let Some(python) =
        crate::common::components::peers(&["torch", "transformers", "peft", "safetensors"])
    else {
        return;
    };
    let mut command = Command::new(&python);
    command
        .arg(crate::common::repo().join("scripts/export_check.py"))
        .args(["--tolerance", &TOLERANCE.to_string()])
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1");
    for case in cases {
        command.args([&case.out, &case.base, &case.logits]);
    }
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let results: Vec<Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("{line}\n{stderr}")))
        .collect();
    assert_eq!(results.len(), cases.len(), "{stdout}\n{stderr}");
    for (case, result) in cases.iter().zip(&results) {
        println!("{}: transformers/PEFT {result}", case.label);
        assert_eq!(result["ok"], true, "{}: {result}\n{stderr}", case.label);
        // Our float32 logits against transformers in float64: the tolerance, and as much again as
        // transformers' own float32 logits differ from its float64 ones (Qwen3.5's delta rule).
        let allowed = f64::from(TOLERANCE) + result["transformers_float32_drift"].as_f64().unwrap();
        assert!(result["merged_max_abs_diff"].as_f64().unwrap() <= allowed);
        if case.label.ends_with("lora") {
            assert_eq!(result["lora"], true);
            assert!(result["peft_max_abs_diff"].as_f64().unwrap() <= allowed);
        }
    }
    assert!(output.status.success(), "{stdout}\n{stderr}");
}

#[test]
fn exports_load_with_the_trained_weights_and_logits() {
    let work = crate::common::tempdir::Dir::new("runs");
    let data = qa_rows(work.path(), 16);

    let mut cases = Vec::new();
    for model in crate::common::MODEL_FAMILIES {
        for lora in [false, true] {
            cases.push(check_run(work.path(), model, lora, &data));
        }
    }

    // A step without a checkpoint is an error naming it.
    let missing = export(
        &work.path().join("run-qwen2-full"),
        &work.path().join("export-none"),
        Some(7),
    );
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(stderr.contains("no checkpoint-7"), "{stderr}");

    python_check(&cases);
}

/// A gpt-oss base with MXFP4 experts (`gpt_oss/mxfp4`) exports them dequantized, in transformers' stacks:
/// its config without `quantization_config`, no blocks or scales, the trained model's logits, which
/// transformers gives too.
#[test]
fn an_mxfp4_base_exports_its_experts_dequantized() {
    let work = crate::common::tempdir::Dir::new("runs-mxfp4");
    let data = qa_rows(work.path(), 16);
    let base_dir = fixture("gpt_oss").join("mxfp4");
    let run_dir = work.path().join("run");
    train(&base_dir, &data, &run_dir, None);
    let out = work.path().join("export");
    let exported = export(&run_dir, &out, None);
    assert!(exported.status.success(), "{exported:?}");

    let config: Value =
        serde_json::from_str(&fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert!(config.get("quantization_config").is_none(), "{config}");
    let names = keys(&tensors(&out.join("model.safetensors")))
        .into_iter()
        .map(str::to_string)
        .collect::<Vec<_>>();
    assert!(names.contains(&"model.layers.0.mlp.experts.gate_up_proj".to_string()));
    assert!(!names
        .iter()
        .any(|name| name.ends_with("_blocks") || name.ends_with("_scales")));

    let base = load(&base_dir);
    let sequences = sequences(base.config.vocab_size);
    let expected = logits(
        &trained(&base, &run_dir.join("checkpoint-2"), None),
        &sequences,
    );
    let diff = max_logit_diff(&logits(&load(&out), &sequences), &expected);
    assert_eq!(diff, 0.0, "the export's logits are the trained model's");
    assert!(max_logit_diff(&logits(&base, &sequences), &expected) > 1e-3);
    let logits_file = work.path().join("logits.json");
    write_logits(&logits_file, &sequences, &expected);
    python_check(&[Case {
        label: "gpt_oss-mxfp4-full".into(),
        out,
        base: base_dir,
        logits: logits_file,
    }]);
}
