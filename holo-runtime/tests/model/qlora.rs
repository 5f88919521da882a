//! LoRA over a frozen base kept as a GGUF file's quantized blocks (QLoRA): the Qwen2 fixture written in
//! Q8_0 and Q4_0, llama.cpp's own Q8_0 files of Llama, Qwen3 and Phi-3, and a 256-wide Qwen2 written
//! in the k-quants (Q4_K, Q5_K, Q6_K and a Q4_K_M-like mixture), loaded with their projections in their
//! blocks, train the same adapters as the same files dequantized, its sampler samples from the blocks,
//! `holo train --quantized` trains over the k-quants, and full fine-tuning is refused.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor, Var};
use holo_runtime::holotypes;
use holo_runtime::interpreter::{Holoware, Row};
use holo_runtime::local::files::load_model;
use holo_runtime::local::gguf::{load_quantized, Gguf};
use holo_runtime::local::init::{parameter_specs, Init};
use holo_runtime::local::model::{LoraConfig, Model, Ops, Targets, Weight};
use holo_runtime::local::testing::{max_abs, max_difference};
use holo_runtime::local::ModelConfig;
use holo_runtime::train::{GrpoConfig, Policy, RunOptions, TrainError, Trainer, TrainingArguments};
use holo_runtime::{Resources, Rollout};

use super::gguf::{fixture, scratch, write_gguf, write_gguf_mixed};

/// Two sequences of the fixture's vocabulary, the second right-padded.
fn batch() -> (Tensor, Tensor) {
    let ids: Vec<u32> = vec![
        509, 100, 200, 300, 7, 8, 9, 10, 509, 42, 17, 3, 250, 61, 0, 0,
    ];
    let mask: Vec<u8> = vec![1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0];
    (
        Tensor::from_vec(ids, (2, 8), &Device::Cpu).unwrap(),
        Tensor::from_vec(mask, (2, 8), &Device::Cpu).unwrap(),
    )
}

/// The same `B` for every adapter of both models (PEFT starts `B` at zero, which gives `A` no gradient).
fn move_b(vars: &[(String, Var)]) {
    for (i, (name, var)) in vars.iter().enumerate() {
        if name.contains("lora_B") {
            let shape = var.as_tensor().shape().clone();
            let values = Tensor::arange(0f32, shape.elem_count() as f32, &Device::Cpu)
                .unwrap()
                .affine(0.37, i as f64)
                .unwrap()
                .sin()
                .unwrap()
                .affine(0.05, 0.0)
                .unwrap()
                .reshape(shape)
                .unwrap();
            var.set(&values).unwrap();
        }
    }
}

/// The gradient of `Σ log p` for every adapter, through `backward_recomputed` (each layer's
/// written-out backward, `∂x = ∂y · W` with `W` expanded from its blocks) and through autograd (the
/// blocks' own backward, `kernels/blocks.rs`).
fn gradients(model: &Model, vars: &[(String, Var)]) -> (Tensor, Vec<Tensor>, Vec<Tensor>) {
    let (ids, mask) = batch();
    let logprobs = model
        .token_logprobs(&ids, &mask, Ops::Differentiable)
        .unwrap();
    let autograd = logprobs.sum_all().unwrap().backward().unwrap();
    let (_, recomputed) = model
        .backward_recomputed(&ids, &mask, |logprobs| logprobs.sum_all())
        .unwrap();
    let of = |grads: &candle_core::backprop::GradStore| -> Vec<Tensor> {
        vars.iter()
            .map(|(name, var)| match grads.get(var.as_tensor()) {
                Some(grad) => grad.clone(),
                None => panic!("no gradient for {name}"),
            })
            .collect()
    };
    (logprobs, of(&recomputed), of(&autograd))
}

/// LoRA over the blocks is LoRA over the same file dequantized: the base's values are identical (each
/// product expands the blocks to the dequantized model's very numbers), so the log-probabilities and
/// every adapter's gradient differ only by the order of the f32 sums. A sum of n terms moves by at most
/// about n · 2⁻²⁴ of the sum of their magnitudes; the products here have 64–128 terms and the pass
/// chains a dozen of them, so differences of 1e-5 relative are the scale of rounding, and 1e-4 (of the
/// largest log-probability's or gradient's magnitude) is the limit, which a wrong base value (Q8_0
/// moves the weights by 3% of their scale) misses by orders of magnitude. Measured: identical (the
/// expanded matrix goes through the same product kernel as the dequantized one at these shapes). The sampler's products round
/// the activations (8 bits per block): its log-probabilities are near but not equal.
#[test]
fn lora_over_quantized_blocks_is_lora_over_the_dequantized_base() {
    let dir = scratch("qlora-parity");
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let file = dir.join(format!("qwen2-{dtype:?}.gguf"));
        write_gguf(&fixture("qwen2"), dtype, &file);
        assert_lora_over_blocks_is_lora_over_dense(&format!("qwen2 {dtype:?}"), &file);
    }
    // llama.cpp's converter's own Q8_0 files (Phi-3's fused qkv and gate/up among them).
    for name in ["llama-q8_0", "qwen3-q8_0", "phi3-q8_0"] {
        let file = fixture(&format!("gguf/converted/{name}.gguf"));
        assert_lora_over_blocks_is_lora_over_dense(name, &file);
    }
}

/// The k-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 values, which the 64-wide fixtures cannot hold)
/// and a mixture as llama.cpp's Q4_K_M makes it (values and the MLP's down projection, and the tied
/// embeddings, in Q6_K; the rest in Q4_K), of a Qwen2 of 256-wide projections ([`k_quant_folder`]):
/// LoRA over their blocks is LoRA over the files dequantized, to the tolerance and by the reasoning of
/// [`lora_over_quantized_blocks_is_lora_over_the_dequantized_base`] (the sums here have 256–512
/// terms, still far below 1e-4's reach). That tolerance sees a wrong base: each file's dequantized
/// log-probabilities stand further from the f32 model's (the quantization's own error) than it allows.
/// Measured: identical, log-probabilities and gradients; the quantization moves log-probabilities by
/// 0.06 (Q6_K) to 0.27 (Q4_K), 80 to 340 times the tolerance; the sampler's, by 0.015–0.031.
#[test]
fn lora_over_k_quant_blocks_is_lora_over_the_dequantized_base() {
    let dir = scratch("qlora-k-quants");
    let folder = k_quant_folder(&dir.join("model"));
    let f32_model = load_model(&folder, DType::F32, &Device::Cpu).unwrap();
    let (ids, mask) = batch();
    let exact = f32_model
        .token_logprobs(&ids, &mask, Ops::Differentiable)
        .unwrap();
    let mut files = Vec::new();
    for (name, dtype) in [
        ("Q4_K", GgmlDType::Q4K),
        ("Q5_K", GgmlDType::Q5K),
        ("Q6_K", GgmlDType::Q6K),
    ] {
        let file = dir.join(format!("{name}.gguf"));
        write_gguf(&folder, dtype, &file);
        files.push((name, file));
    }
    let file = dir.join("Q4_K_M.gguf");
    write_gguf_mixed(&folder, &q4_k_m, &file);
    files.push(("Q4_K_M", file));
    for (name, file) in files {
        let dequantized = load_model(&file, DType::F32, &Device::Cpu).unwrap();
        let logprobs = dequantized
            .token_logprobs(&ids, &mask, Ops::Differentiable)
            .unwrap();
        let error = max_difference(&logprobs, &exact);
        let limit = 1e-4 * max_abs(&exact);
        eprintln!("{name}: the quantization moves log-probabilities by {error:e}");
        assert!(error > 10.0 * limit, "{name}: {error} against {limit}");
        let kept = load_quantized(&file, DType::F32, &Device::Cpu).unwrap();
        for layer in &kept.layers {
            for (projection, linear) in Model::linears(layer) {
                assert!(
                    matches!(linear.weight, Weight::Quantized(_)),
                    "{name}: {projection} stays in its blocks"
                );
            }
        }
        assert_lora_over_blocks_is_lora_over_dense(name, &file);
    }
}

/// What the memory plan reads off a GGUF header as kept in blocks (`Gguf::kept_blocks`) is what
/// `load_quantized` keeps: the projections' elements and bytes in blocks (a fused `attn_qkv` split by rows
/// or kept whole as Phi-3's, a Qwen3 file whose converter left some matrices unquantized, the k-quant
/// mixture), the head's blocks (the decoding bytes' share that is not the projections'; none where the
/// loader holds the head dense only), and at least the largest projection it expands.
#[test]
fn the_plan_reads_the_blocks_the_loader_keeps() {
    let dir = scratch("qlora-kept");
    let mixture = dir.join("q4_k_m.gguf");
    write_gguf_mixed(&k_quant_folder(&dir.join("model")), &q4_k_m, &mixture);
    let converted = ["llama-q8_0", "llama-qkv-q8_0", "phi3-q8_0", "qwen3-q8_0"]
        .map(|name| fixture(&format!("gguf/converted/{name}.gguf")));
    for file in converted.iter().chain([&mixture]) {
        let kept = Gguf::open(file).unwrap().kept_blocks().unwrap();
        let model = load_quantized(file, DType::F32, &Device::Cpu).unwrap();
        let (mut elements, mut bytes, mut largest, mut every) = (0, 0, 0, 0);
        for layer in &model.layers {
            for (_, linear) in Model::linears(layer) {
                every += linear.weight.bytes();
                if let Weight::Quantized(blocks) = &linear.weight {
                    elements += blocks.shape().elem_count();
                    bytes += blocks.storage_size_in_bytes();
                    largest = largest.max(blocks.shape().elem_count());
                }
            }
        }
        let name = file.display();
        assert!(elements > 0, "{name}");
        assert_eq!(kept.projections, elements as u64, "{name}");
        assert_eq!(kept.projection_bytes, bytes as u64, "{name}");
        assert!(kept.largest >= largest as u64, "{name}");
        let config = &model.config;
        let dense_head = config.vocab_size * config.hidden_size * 4;
        let head = model.decoding_bytes() - every;
        let expected = if head == dense_head { 0 } else { head };
        assert_eq!(kept.head_bytes, expected as u64, "{name}");
    }
}

/// A Qwen2 folder whose projections' inputs are multiples of the k-quants' 256-value super-blocks:
/// hidden 256, intermediate 512, 2 layers of 4 heads of 64 over 2 key/value heads, the tiny fixture's
/// 512-token tokenizer and template; the weights `init-model`'s (`parameter_specs`) drawn from ChaCha8,
/// matrices uniform with a standard deviation of 0.05, biases zero, norms one.
fn k_quant_folder(dir: &Path) -> PathBuf {
    use rand::{Rng, SeedableRng};
    std::fs::create_dir_all(dir).unwrap();
    let tiny = fixture("qwen2");
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(tiny.join(name), dir.join(name)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny.join("config.json")).unwrap()).unwrap();
    config["hidden_size"] = 256.into();
    config["intermediate_size"] = 512.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!((config.head_dim, config.num_hidden_layers), (64, 2));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let bound = 0.05 * 3f64.sqrt();
    let tensors: std::collections::HashMap<String, Tensor> = parameter_specs(&config)
        .into_iter()
        .map(|spec| {
            let values: Vec<f32> = (0..spec.numel())
                .map(|_| match spec.init {
                    Init::Ones => 1.0,
                    Init::Zeros => 0.0,
                    _ => (rng.random::<f64>() * 2.0 - 1.0) as f32 * bound as f32,
                })
                .collect();
            let tensor = Tensor::from_vec(values, spec.shape.clone(), &Device::Cpu).unwrap();
            (spec.name, tensor)
        })
        .collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    dir.to_path_buf()
}

/// llama.cpp's `Q4_K_M` in the large: the values' projections, the MLP's down projections and the
/// embeddings in Q6_K, every other matrix in Q4_K.
fn q4_k_m(name: &str) -> GgmlDType {
    if name.contains("attn_v") || name.contains("ffn_down") || name == "token_embd.weight" {
        GgmlDType::Q6K
    } else {
        GgmlDType::Q4K
    }
}

/// The GGUF file loaded dequantized and with its projections in their blocks, each under LoRA on every
/// projection (the same `B` for both): the blocks refuse full fine-tuning, the base stays in its blocks,
/// every projection is adapted, and the log-probabilities and every adapter's gradient (through the
/// written-out backward and through autograd) are the dequantized model's to 1e-4 of their largest
/// magnitude; the sampler's log-probabilities (ggml's products, activations rounded) are near them.
fn assert_lora_over_blocks_is_lora_over_dense(label: &str, file: &Path) {
    let lora = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: Targets::names(&["all-linear"]),
        seed: 3,
        dropout: 0.0,
        ..LoraConfig::default()
    };
    let dense = load_model(file, DType::F32, &Device::Cpu).unwrap();
    let kept = load_quantized(file, DType::F32, &Device::Cpu).unwrap();

    let refusal = kept.trainable().unwrap_err().to_string();
    assert!(
        refusal.contains("full fine-tuning") && refusal.contains("use_peft"),
        "{refusal}"
    );

    let (dense, dense_vars) = dense.with_lora(&lora).unwrap();
    let (kept, kept_vars) = kept.with_lora(&lora).unwrap();
    let adapted: Vec<&String> = kept_vars.iter().map(|(name, _)| name).collect();
    let expected: Vec<&String> = dense_vars.iter().map(|(name, _)| name).collect();
    assert_eq!(adapted, expected, "{label}");
    let projections: usize = kept
        .layers
        .iter()
        .map(|layer| Model::linears(layer).len())
        .sum();
    assert_eq!(
        kept_vars.len(),
        2 * projections,
        "{label}: every projection adapted"
    );
    let down = &kept.layers[0].mlp.dense().unwrap().down_proj;
    assert!(
        matches!(down.weight, Weight::Quantized(_)),
        "{label}: the base stays in its blocks"
    );
    move_b(&dense_vars);
    move_b(&kept_vars);
    let (dense_logprobs, dense_recomputed, dense_autograd) = gradients(&dense, &dense_vars);
    let (kept_logprobs, kept_recomputed, kept_autograd) = gradients(&kept, &kept_vars);

    let difference = max_difference(&kept_logprobs, &dense_logprobs);
    let limit = 1e-4 * max_abs(&dense_logprobs);
    eprintln!("{label}: log-probabilities max |Δ| {difference:e} (limit {limit:e})");
    assert!(difference <= limit, "{label}: {difference} > {limit}");
    let mut worst = 0.0f64;
    let paths = [
        ("recomputed", &kept_recomputed, &dense_recomputed),
        ("autograd", &kept_autograd, &dense_autograd),
    ];
    for (path, kept_grads, dense_grads) in paths {
        for (((name, _), got), expected) in dense_vars.iter().zip(kept_grads).zip(dense_grads) {
            let scale = max_abs(expected);
            assert!(scale > 0.0, "{name} has a gradient");
            let relative = max_difference(got, expected) / scale;
            worst = worst.max(relative);
            assert!(
                relative <= 1e-4,
                "{label} {name} ({path}): {relative:e} of {scale:e}"
            );
        }
    }
    eprintln!("{label}: adapter gradients, worst max |Δ| {worst:e} of the gradient's largest");

    // The sampler multiplies the blocks as ggml does; its log-probabilities are the trainer's to the
    // rounding of the activations.
    let (ids, mask) = batch();
    let sampled = kept
        .detached()
        .token_logprobs(&ids, &mask, Ops::Fast)
        .unwrap();
    let rounding = max_difference(&sampled, &kept_logprobs);
    eprintln!("{label}: sampler against trainer, max |Δ log p| {rounding:e}");
    assert!(
        rounding > 0.0 && rounding < 0.05 * max_abs(&kept_logprobs),
        "{rounding}"
    );
}

fn train_rows() -> Vec<(usize, Row)> {
    let path = fixture("../train/rows.jsonl");
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .enumerate()
        .map(|(i, line)| (i, serde_json::from_str(line).unwrap()))
        .collect()
}

fn trainer(
    policy: Policy,
    config: GrpoConfig,
    out: &std::path::Path,
) -> Result<Trainer<impl holo_runtime::loom::RolloutSource>, TrainError> {
    let holoware = Arc::new(
        Holoware::open(
            &fixture("../train/short.hol"),
            Arc::new(holotypes::registry()),
        )
        .unwrap(),
    );
    let resources = Resources::default();
    let source = move |row: &Row| -> Result<Box<dyn Rollout + Send>, String> {
        let rollout = holoware
            .start_with(row, &resources)
            .map_err(|error| error.to_string())?;
        Ok(Box::new(rollout))
    };
    let options = RunOptions {
        out: out.to_path_buf(),
        resume: false,
        progress: false,
    };
    Trainer::new(source, policy, config, options)
}

fn grpo(use_peft: bool) -> GrpoConfig {
    GrpoConfig {
        training: TrainingArguments {
            max_steps: 2,
            per_device_train_batch_size: 8,
            learning_rate: 1e-3,
            use_peft,
            lora_r: 4,
            lora_alpha: 8.0,
            lora_target_modules: Some(Targets::names(&["all-linear"])),
            ..GrpoConfig::default().training
        },
        num_generations: 4,
        max_completion_length: 8,
        ..GrpoConfig::default()
    }
}

/// Two GRPO steps of LoRA over the Q8_0 blocks, the rollouts sampled in process from the same blocks:
/// on-policy, the importance ratios between the sampler's log-probabilities (activations rounded to 8
/// bits per block) and the trainer's (the blocks' exact values) are 1 to that rounding, which TRL's
/// importance-sampling correction then corrects for as for vLLM's. Full fine-tuning of the same policy
/// is refused before any step.
#[test]
fn grpo_trains_lora_over_a_quantized_base() {
    let dir = scratch("qlora-grpo");
    let file = dir.join("qwen2.gguf");
    write_gguf(&fixture("qwen2"), GgmlDType::Q8_0, &file);

    let out = dir.join("full");
    let policy = Policy::load_quantized(&file, &Device::Cpu).unwrap();
    match trainer(policy, grpo(false), &out) {
        Err(error) => {
            let message = error.to_string();
            assert!(
                message.contains("full fine-tuning") && message.contains("use_peft"),
                "{message}"
            )
        }
        Ok(_) => panic!("full fine-tuning over quantized blocks was accepted"),
    }

    let out = dir.join("lora");
    let policy = Policy::load_quantized(&file, &Device::Cpu).unwrap();
    let summary = trainer(policy, grpo(true), &out)
        .unwrap()
        .train(&train_rows(), &[])
        .unwrap();
    assert_eq!(summary.steps, 2);
    let metrics = &summary.last;
    let (min, max) = (
        metrics["sampling/importance_sampling_ratio/min"],
        metrics["sampling/importance_sampling_ratio/max"],
    );
    let mean = metrics["sampling/importance_sampling_ratio/mean"];
    let difference = metrics["sampling/sampling_logp_difference/mean"];
    let largest = metrics["sampling/sampling_logp_difference/max"];
    eprintln!(
        "QLoRA GRPO: ratios in [{min}, {max}], mean {mean}; |Δ log p| mean {difference}, max {largest}"
    );
    // Measured: mean 1.044 in [0.85, 1.25], |Δ log p| 0.038 on average and 0.12 at most, the
    // activations' rounding on this random fixture (whose sampler moved log-probabilities by up to 0.088
    // above); a sampler on other weights (the dequantized base without the adapters, say) moves them by
    // the adapters' own effect and a trainer without the blocks' backward gets no step at all.
    assert!((mean - 1.0).abs() < 0.1, "mean ratio {mean}");
    assert!(min > 0.7 && max < 1.4, "ratios in [{min}, {max}]");
    assert!(difference > 0.0 && difference < 0.1, "{difference}");
    assert!(metrics["loss"].is_finite());
}

/// `holo train --quantized`: two LoRA steps over the Q8_0 file's blocks and the adapter exported as
/// for any LoRA run; full fine-tuning (no `--use-peft`) and a folder are refused, naming what to change.
#[test]
fn holo_train_quantized_trains_lora_and_refuses_full_fine_tuning() {
    let dir = scratch("qlora-cli");
    let file = dir.join("qwen2.gguf");
    write_gguf(&fixture("qwen2"), GgmlDType::Q8_0, &file);
    let run = |out: &str, extra: &[&str]| {
        let out = dir.join(out).display().to_string();
        let mut args = vec![
            "train",
            "holo-runtime/tests/fixtures/train/short.hol",
            "--data",
            "holo-runtime/tests/fixtures/train/rows.jsonl",
            "--quantized",
            "--max-steps",
            "2",
            "--per-device-train-batch-size",
            "8",
            "--num-generations",
            "4",
            "--max-completion-length",
            "8",
            "--out",
        ];
        args.push(&out);
        args.extend_from_slice(extra);
        let output = crate::common::holo_command(&args)
            .output()
            .expect("holo runs");
        (
            output.status,
            String::from_utf8_lossy(&output.stderr).into_owned(),
            out,
        )
    };
    let model = file.display().to_string();

    let (status, stderr, _) = run("full", &["--model", &model]);
    assert!(!status.success(), "full fine-tuning over blocks ran");
    assert!(
        stderr.contains("use_peft") && stderr.contains("--quantized"),
        "{stderr}"
    );

    let folder = fixture("qwen2").display().to_string();
    let (status, stderr, _) = run("folder", &["--model", &folder, "--use-peft"]);
    assert!(!status.success(), "a folder's --quantized ran");
    assert!(stderr.contains("not a `.gguf` file"), "{stderr}");

    let (status, stderr, out) = run("lora", &["--model", &model, "--use-peft"]);
    assert!(status.success(), "{stderr}");
    let metrics = std::fs::read_to_string(format!("{out}/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
    assert!(
        metrics.contains("sampling/importance_sampling_ratio/mean"),
        "{metrics}"
    );
    let exported = dir.join("exported").display().to_string();
    let output = crate::common::holo_command(&["export", &out, "--out", &exported])
        .output()
        .expect("holo runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(dir
        .join("exported/adapter/adapter_model.safetensors")
        .exists());
}

/// `holo train --quantized --use-peft` over the Q4_K_M-like file of [`k_quant_folder`] (Q4_K and Q6_K
/// blocks): its memory plan is printed and written (the run in blocks), and two GRPO steps train the
/// adapters on every projection (Q4_K and Q6_K alike) through the k-quant blocks' backward: each step's
/// gradient norm is above zero and every exported `lora_B` has left the zeros PEFT starts it at.
#[test]
fn holo_train_quantized_trains_lora_over_k_quant_blocks() {
    let dir = scratch("qlora-k-quant-cli");
    let file = dir.join("q4_k_m.gguf");
    write_gguf_mixed(&k_quant_folder(&dir.join("model")), &q4_k_m, &file);
    let out = dir.join("run").display().to_string();
    let model = file.display().to_string();
    let output = crate::common::holo_command(&[
        "train",
        "holo-runtime/tests/fixtures/train/short.hol",
        "--data",
        "holo-runtime/tests/fixtures/train/rows.jsonl",
        "--model",
        &model,
        "--quantized",
        "--use-peft",
        "--lora-target-modules",
        "all-linear",
        "--max-steps",
        "2",
        "--per-device-train-batch-size",
        "8",
        "--num-generations",
        "4",
        // Random replies of 16 tokens run to either side of `short.hol`'s 24 characters: rewards differ.
        "--max-completion-length",
        "16",
        "--out",
        &out,
    ])
    .output()
    .expect("holo runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("memory plan (peak resident memory, by term):"),
        "{stderr}"
    );
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run/memory_plan.json")).unwrap())
            .unwrap();
    assert_eq!(plan["inputs"]["quantized"], true, "{plan}");
    let metrics = crate::common::run_metrics(&dir.join("run"));
    assert_eq!(metrics.len(), 2, "{metrics:?}");
    for step in &metrics {
        let norm = step["grad_norm"].as_f64().unwrap();
        assert!(norm > 0.0 && norm.is_finite(), "{step}");
    }
    let exported = dir.join("exported").display().to_string();
    let output = crate::common::holo_command(&["export", &out, "--out", &exported])
        .output()
        .expect("holo runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let adapter = candle_core::safetensors::load(
        dir.join("exported/adapter/adapter_model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let moved: Vec<&String> = adapter
        .iter()
        .filter(|(name, b)| name.contains("lora_B") && max_abs(b) > 0.0)
        .map(|(name, _)| name)
        .collect();
    let trained = adapter
        .keys()
        .filter(|name| name.contains("lora_B"))
        .count();
    assert_eq!(moved.len(), trained, "{moved:?}");
    assert_eq!(trained, 2 * 7, "every projection of both layers");
}

/// A gpt-oss file's experts kept as MXFP4 blocks have no backward: LoRA over them is refused, naming the
/// flag to leave out.
#[test]
fn lora_over_mxfp4_experts_is_refused() {
    let file = fixture("gguf/converted/gpt_oss.gguf");
    let packed = load_quantized(&file, DType::F32, &Device::Cpu).unwrap();
    let lora = LoraConfig {
        targets: Targets::names(&["q_proj"]),
        dropout: 0.0,
        ..LoraConfig::default()
    };
    let refusal = packed.with_lora(&lora).unwrap_err().to_string();
    assert!(
        refusal.contains("MXFP4") && refusal.contains("--quantized"),
        "{refusal}"
    );
}

/// `holo sft --quantized --use-peft` fine-tunes LoRA adapters over a GGUF file's Q8_0 blocks, and the
/// loss goes down; without `--use-peft` it is refused as `holo train`'s is.
#[test]
fn holo_sft_quantized_trains_lora_over_the_blocks() {
    let dir = scratch("qlora-sft");
    let file = dir.join("qwen2.gguf");
    write_gguf(&fixture("qwen2"), GgmlDType::Q8_0, &file);
    let data = crate::common::fixtures().join("sft/train.jsonl");
    let run = |out: &str, extra: &[&str]| {
        let mut args = crate::common::sft_args(&data, &dir.join(out), extra);
        args[3] = file.display().to_string();
        args.push("--quantized".into());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        crate::common::holo_command(&args)
            .output()
            .expect("holo runs")
    };
    let full = run("full", &[]);
    assert!(!full.status.success(), "full fine-tuning over blocks ran");
    let stderr = String::from_utf8_lossy(&full.stderr);
    assert!(
        stderr.contains("use_peft") && stderr.contains("--quantized"),
        "{stderr}"
    );
    let lora = run("lora", &["--use-peft"]);
    let stderr = String::from_utf8_lossy(&lora.stderr);
    assert!(lora.status.success(), "{stderr}");
    assert!(
        stderr.contains("memory plan (peak resident memory, by term):"),
        "{stderr}"
    );
    let metrics = crate::common::run_metrics(&dir.join("lora"));
    let loss = |step: &serde_json::Value| step["loss"].as_f64().unwrap();
    assert_eq!(metrics.len(), 6, "3 epochs of 2 steps");
    assert!(
        loss(&metrics[5]) < loss(&metrics[0]),
        "the loss goes down: {metrics:?}"
    );
}
