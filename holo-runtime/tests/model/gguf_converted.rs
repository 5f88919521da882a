//! GGUF files written by llama.cpp's own converter (`convert_hf_to_gguf.py` of llama-cpp-python 0.3.36,
//! llama.cpp 0c1e57098) from the committed family fixtures, checked against transformers: each file
//! loads to its folder's config, gives transformers' logits, and its tokenizer and chat template give
//! the folder tokenizer's ids. The q8_0 files are checked against transformers run on the file's own
//! weights dequantized, so they too must match to float rounding; `-qkv` files have q, k and v fused
//! into one `attn_qkv` (the converter's `--fuse-qkv`); Qwen3.5's files (dense and the mixture) in
//! float64 against transformers in float64; `qwen3_5_moe-fused.gguf` has both of the converter's fusions
//! (`--fuse-qkv --fuse-gate-up-exps`).
//!
//!     ~/.cache/holo-peers/venv/bin/python scripts/gguf_converted.py
//!     cargo test -p holo-runtime --test model gguf_converted

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::common::json::ids;
use crate::common::logits::{
    blocks_against_dequantized, greedy_request, sequence_logits, sequence_logits_f64,
};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use holo_runtime::chat::RenderOptions;
use holo_runtime::local::files::{load_model, load_template, load_tokenizer};
use holo_runtime::local::gguf::load_quantized;
use holo_runtime::local::model::Weight;
use holo_runtime::local::{Arch, LocalModel, LocalOptions, Model, ModelConfig, RopeScaling};
use holo_runtime::sampler::Request;
use holo_runtime::{ChatMessage, Role};
use serde_json::Value;

/// The file `name` of `tests/fixtures/models/gguf/converted/`, llama.cpp's converter's output.
pub(crate) fn converted(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/gguf/converted")
        .join(name)
}

/// `converted/expected.json`: per file, its folder's config and transformers' logits; the folder
/// tokenizer's ids of a few texts and chats.
fn expected() -> Value {
    let text = std::fs::read_to_string(converted("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The largest |Δlogit| between `model`'s logits and the recorded ones, at the positions recorded; an
/// f64 model's in f64.
pub(crate) fn difference_to_transformers(model: &Model, recorded: &Value) -> f64 {
    let mut largest = 0f64;
    for sequence in recorded.as_array().unwrap() {
        let sequence_ids = ids(&sequence["ids"]);
        let ours = match model.dtype() {
            DType::F64 => sequence_logits_f64(model, &sequence_ids),
            _ => sequence_logits(model, &sequence_ids)
                .into_iter()
                .map(|row| row.into_iter().map(f64::from).collect())
                .collect(),
        };
        let positions = sequence["positions"].as_array().unwrap();
        let theirs = sequence["logits"].as_array().unwrap();
        assert_eq!(positions.len(), theirs.len());
        for (position, theirs) in positions.iter().zip(theirs) {
            let position = position.as_u64().unwrap() as usize;
            for (ours, theirs) in ours[position].iter().zip(theirs.as_array().unwrap()) {
                largest = largest.max((ours - theirs.as_f64().unwrap()).abs());
            }
        }
    }
    largest
}

/// The folder's config as this runtime reads `config.json`, with what a GGUF file holds differently:
/// the epsilon in f32, LongRoPE's attention factor in f32, and Llama 3's rope scaling as the factor per
/// frequency that the converter computes from it (`rope_freqs`, read as LongRoPE's factors).
pub(crate) fn folder_config(recorded: &Value, ours: &ModelConfig) -> ModelConfig {
    let mut theirs = ModelConfig::from_json(recorded).unwrap();
    theirs.rms_norm_eps = theirs.rms_norm_eps as f32 as f64;
    match (&mut theirs.rope_scaling, &ours.rope_scaling) {
        (
            RopeScaling::LongRope {
                attention_factor, ..
            },
            RopeScaling::LongRope {
                attention_factor: ours,
                ..
            },
        ) if theirs.arch == Arch::Phi3 => {
            assert!((*attention_factor - ours).abs() < 1e-6);
            *attention_factor = *ours;
        }
        (
            &mut RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            },
            file @ RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings: context,
                attention_factor: 1.0,
            },
        ) if short_factor == long_factor && *context == theirs.max_position_embeddings => {
            // `LlamaModel.generate_extra_tensors`' factors, in f32 in the file.
            let original = original_max_position_embeddings as f64;
            let (low, high) = (original / low_freq_factor, original / high_freq_factor);
            for (i, ours) in short_factor.iter().enumerate() {
                let exponent = (2 * i) as f64 / theirs.head_dim as f64;
                let wavelength = 2.0 * std::f64::consts::PI * theirs.rope_theta.powf(exponent);
                let smooth = (original / wavelength - low_freq_factor)
                    / (high_freq_factor - low_freq_factor);
                let theirs = match wavelength {
                    w if w < high => 1.0,
                    w if w > low => factor,
                    _ => 1.0 / ((1.0 - smooth) / factor + smooth),
                };
                assert!(
                    (ours - theirs).abs() < 1e-6 * theirs,
                    "factor {i}: {ours} {theirs}"
                );
            }
            theirs.rope_scaling = file.clone();
        }
        _ => {}
    }
    theirs
}

#[test]
fn converted_ggufs_are_their_folders_models_with_transformers_logits() {
    let expected = expected();
    let files = expected["files"].as_object().unwrap();
    // Every family llama.cpp converts and this runtime reads from GGUF (gpt-oss's is checked in
    // `gguf_gpt_oss`).
    let families = [
        "qwen2",
        "llama",
        "qwen3",
        "qwen3_moe",
        "gemma3",
        "olmo2",
        "olmo3",
        "phi3",
        "smollm3",
        "mistral",
        "qwen3_5",
        "qwen3_5_moe",
    ];
    for family in families {
        assert!(files.contains_key(&format!("{family}.gguf")), "{family}");
    }
    // Every file is checked before the test fails, so that one run names every family that differs.
    let mut failures = Vec::new();
    for (file, recorded) in files {
        let path = converted(file);
        // Qwen3.5's logits are transformers' in float64 (`scripts/gguf_converted.py`: its float32 delta
        // rule drifts 1.5e-4 from the float64 result over 80 tokens), which the folder's model loaded in
        // float64 gives to 1.7e-7; the file's to 2.7e-6 (`qwen3_5_equal.gguf`'s to 1.3e-5), because
        // the converter rounded `1 + w` and `-exp(A_log)` to f32: transformers' float64 forward with
        // the folder's weights rounded so is 2.7e-6 (1.4e-5) from its own too.
        let (dtype, bound) = match recorded["dtype"].as_str() {
            Some("float64") => (DType::F64, 2e-5),
            _ => (DType::F32, 1e-4),
        };
        let model = match load_model(&path, dtype, &Device::Cpu) {
            Ok(model) => model,
            Err(error) => {
                failures.push(format!("{file}: {error}"));
                continue;
            }
        };
        let ours = &model.config;
        let theirs = folder_config(&recorded["config"], ours);
        if *ours != theirs {
            failures.push(format!(
                "{file}: config {ours:?}\n  is not the folder's {theirs:?}"
            ));
        }
        let difference = difference_to_transformers(&model, &recorded["logits"]);
        eprintln!("{file}: max |Δlogit| {difference:e} against transformers ({dtype:?})");
        if difference > bound {
            failures.push(format!(
                "{file}: max |Δlogit| {difference} against transformers"
            ));
        }
        // `holo export` writes the file's config as the family's `config.json`: the same model again.
        let exported = ModelConfig::from_json(&ours.to_json()).unwrap();
        assert_eq!(exported, *ours, "{file}: exported config");
        // The whole sampler loads the file as `--model file.gguf` does.
        if let Err(error) = LocalModel::load(&path, LocalOptions::default()) {
            failures.push(format!("{file}: sampler: {error}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn converted_ggufs_tokenize_and_template_as_the_folders_tokenizer() {
    let expected = expected();
    for file in expected["files"].as_object().unwrap().keys() {
        let path = converted(file);
        let tokenizer = load_tokenizer(&path).unwrap_or_else(|error| panic!("{file}: {error}"));
        let template = load_template(&path).unwrap_or_else(|error| panic!("{file}: {error}"));
        assert!(!template.is_builtin(), "{file}: the file's own template");
        for text in expected["texts"].as_array().unwrap() {
            let ours = tokenizer
                .encode(text["text"].as_str().unwrap(), true)
                .unwrap();
            assert_eq!(ours.get_ids(), ids(&text["ids"]), "{file}: {text}");
        }
        for chat in expected["chats"].as_array().unwrap() {
            let messages: Vec<ChatMessage> = chat["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|message| ChatMessage {
                    role: match message["role"].as_str().unwrap() {
                        "system" => Role::System,
                        "user" => Role::User,
                        _ => Role::Assistant,
                    },
                    content: message["content"].as_str().unwrap().into(),
                })
                .collect();
            let text = template
                .render(&messages, &RenderOptions::generation())
                .unwrap();
            let ours = tokenizer.encode(text, true).unwrap();
            assert_eq!(ours.get_ids(), ids(&chat["ids"]), "{file}: {chat}");
        }
    }
}

/// The converter's Q8_0 files sampled from their blocks (`--quantized`): the activations are rounded to
/// 8 bits per block of 32 as llama.cpp's CPU products round them, so the logits move from the
/// dequantized model's (transformers' to 1e-4, above); within 5% of the largest logit, the bound the
/// hand-written Q8_0 files are held to (`gguf::a_q8_0_gguf_is_the_model_with_q8_0_rounded_matrices`).
#[test]
fn converted_q8_0_ggufs_sample_from_their_blocks_near_their_dequantized_logits() {
    let files = [
        "phi3-q8_0.gguf",
        "llama-q8_0.gguf",
        "llama-qkv-q8_0.gguf",
        "qwen3-q8_0.gguf",
    ];
    for file in files {
        let path = converted(file);
        let dense = load_model(&path, DType::F32, &Device::Cpu).unwrap();
        let kept = load_quantized(&path, DType::F32, &Device::Cpu).unwrap();
        // The converter's fused `attn_qkv` (`--fuse-qkv`) split into q, k and v, each kept in blocks.
        for layer in kept.layers.iter().filter(|_| file.contains("-qkv")) {
            for (name, linear) in Model::linears(layer) {
                assert!(
                    matches!(linear.weight, Weight::Quantized(_)),
                    "{file}: {name} was dequantized"
                );
            }
        }
        let (difference, largest) = blocks_against_dequantized(&dense, &kept);
        eprintln!("{file}: blocks against dequantized, max |Δlogit| {difference} of {largest}");
        assert!(
            difference > 0.0 && difference <= 0.05 * largest,
            "{file}: max |Δlogit| {difference} of {largest}"
        );
    }
}

/// The fixture folder `family`.
fn fixture(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(family)
}

/// Qwen3.5 (`qwen35`) holds the folder's weights once the converter's transformations are undone:
/// the value heads of linear attention put back in transformers' grouped order from llama.cpp's tiled
/// one (in `in_proj_qkv`'s value rows, `in_proj_z`, `in_proj_b`, `in_proj_a`, `dt_bias`, `A_log`, the
/// convolution's value channels and `out_proj`'s columns: the fixture has two value heads per key head,
/// so a missed or wrong move is a difference), the convolution's squeezed kernel reshaped, exactly;
/// `A_log` from `ssm_a = -exp(A_log)` and the norms stored as `1 + w` (all but linear attention's own
/// `norm`) to f32 rounding; in `qwen3_5-qkv.gguf` the full attention's fused `attn_qkv` split with the
/// gated queries twice the heads' width. Its mixture (`qwen35moe`) likewise, and its router, every
/// expert (from the stacks, in expert order; in `qwen3_5_moe-fused.gguf` from `ffn_gate_up_exps`, gate
/// rows then up rows), the shared expert and the shared expert's gate exactly.
#[test]
fn converted_qwen3_5_ggufs_hold_the_folders_weights() {
    let conversions = [
        ("qwen3_5", ["qwen3_5.gguf", "qwen3_5-qkv.gguf"]),
        (
            "qwen3_5_moe",
            ["qwen3_5_moe.gguf", "qwen3_5_moe-fused.gguf"],
        ),
    ];
    for (family, files) in conversions {
        let folder = load_model(&fixture(family), DType::F32, &Device::Cpu).unwrap();
        let theirs: HashMap<String, Tensor> = folder.named_weights().into_iter().collect();
        for file in files {
            let model = load_model(&converted(file), DType::F32, &Device::Cpu).unwrap();
            assert!(model.has_linear_attention());
            let ours = model.named_weights();
            assert_eq!(ours.len(), theirs.len(), "{file}");
            for (name, ours) in ours {
                assert_weight_is_the_folders(file, &name, &ours, &theirs[&name]);
            }
        }
    }
}

/// [`converted_qwen3_5_ggufs_hold_the_folders_weights`] for one weight.
fn assert_weight_is_the_folders(file: &str, name: &str, ours: &Tensor, theirs: &Tensor) {
    assert_eq!(ours.dims(), theirs.dims(), "{file} {name}");
    let difference = (ours - theirs)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    // The converter's `1 + w` and `-exp(A_log)`, rounded to f32.
    let offset = name.ends_with("norm.weight") && !name.contains(".linear_attn.");
    let bound = match offset || name.ends_with(".A_log") {
        true => 1e-6,
        false => 0.0,
    };
    assert!(difference <= bound, "{file} {name}: max |Δ| {difference}");
}

/// The sampler loads Qwen3.5's files as `--model file.gguf` does, and greedy decoding (the linear
/// layers' states and the attention layer's keys carried from step to step, the mixture's experts chosen
/// at each) gives the 12 tokens transformers generates from the folder for each of its fixture's prompts
/// (`qwen3_5/expected.json`, whose smallest top-1 margin, 0.009, is far above the file's logit
/// differences; `qwen3_5_moe/expected.json`, with its routing margin).
#[test]
fn converted_qwen3_5_ggufs_sample_the_folders_greedy_tokens() {
    for family in ["qwen3_5", "qwen3_5_moe"] {
        let text = std::fs::read_to_string(fixture(family).join("expected.json")).unwrap();
        let expected: Value = serde_json::from_str(&text).unwrap();
        let file = converted(&format!("{family}.gguf"));
        let model = LocalModel::load(file, LocalOptions::default()).unwrap();
        let prompts = expected["prompts"].as_array().unwrap();
        let requests: Vec<Request> = prompts
            .iter()
            .map(|prompt| greedy_request(ids(&prompt["ids"]), 12))
            .collect();
        let completions = model.sample_blocking(&requests);
        assert_eq!(completions.len(), prompts.len());
        for (prompt, completion) in prompts.iter().zip(completions) {
            let tokens = completion.unwrap().tokens;
            assert_eq!(
                tokens,
                ids(&prompt["greedy"]),
                "{family} {}",
                prompt["name"]
            );
        }
    }
}

/// How [`rewrite`] changes a file: metadata set (or, `None`, left out), matrices in Q8_0 where their
/// rows are whole blocks of 32 (the converter's `--outtype q8_0` keeps the others in higher precision
/// too), tensors added.
#[derive(Default)]
pub(crate) struct Rewrite<'a> {
    pub(crate) metadata: Vec<(&'a str, Option<gguf_file::Value>)>,
    pub(crate) q8_0: bool,
    pub(crate) added: Vec<(String, QTensor)>,
}

/// `source` written again into `out` as `rewrite` says.
pub(crate) fn rewrite(source: &Path, out: &Path, rewrite: Rewrite) {
    let mut reader = std::fs::File::open(source).unwrap();
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let edited = |name: &str| rewrite.metadata.iter().any(|(key, _)| *key == name);
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .filter(|(name, _)| !edited(name))
        .map(|(name, value)| (name.as_str(), value))
        .chain(
            rewrite
                .metadata
                .iter()
                .filter_map(|(key, value)| Some((*key, value.as_ref()?))),
        )
        .collect();
    let mut tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            let tensor = content.tensor(&mut reader, name, &Device::Cpu).unwrap();
            let dims = tensor.shape().dims().to_vec();
            let tensor = match dims.as_slice() {
                [_, columns] if rewrite.q8_0 && columns % 32 == 0 => {
                    QTensor::quantize(&tensor.dequantize(&Device::Cpu).unwrap(), GgmlDType::Q8_0)
                        .unwrap()
                }
                _ => tensor,
            };
            (name.clone(), tensor)
        })
        .collect();
    tensors.extend(rewrite.added);
    let tensors: Vec<(&str, &QTensor)> = tensors
        .iter()
        .map(|(name, tensor)| (name.as_str(), tensor))
        .collect();
    gguf_file::write(
        &mut std::fs::File::create(out).unwrap(),
        &metadata,
        &tensors,
    )
    .unwrap();
}

/// Qwen3.5 in Q8_0 blocks (the converter's file with its matrices quantized; the convolution's kernel
/// of 4 columns stays f32) sampled from its blocks (`--quantized`): the full attention's gated
/// `q_proj` (queries and gates, twice the heads' width), k, v and o and every MLP stay in blocks; linear
/// attention's projections are dequantized, their value heads' rows moved back; the logits stay near
/// the dequantized model's, within the bound of the converter's own Q8_0 files (above). The mixture's
/// likewise with its shared experts' gate and up projections in blocks in place of the MLPs; its
/// routers, the shared experts' gates (one row), their down projections (48 inputs, no whole blocks of
/// 32: f32 in the rewrite, as the converter keeps such matrices) and the experts (the stacks stay f32 in
/// the rewrite) are dense; its logits move by 5.7% of the largest (0.74 of 12.9; no token's experts
/// change), held within 6%.
#[test]
fn q8_0_qwen3_5_ggufs_sample_from_their_blocks_outside_linear_attention() {
    let scratch = crate::common::tempdir::Dir::new("gguf-qwen3_5-q8_0");
    for family in ["qwen3_5", "qwen3_5_moe"] {
        let file = scratch.join(format!("{family}-q8_0.gguf"));
        let q8_0 = Rewrite {
            q8_0: true,
            ..Rewrite::default()
        };
        rewrite(&converted(&format!("{family}.gguf")), &file, q8_0);
        let dense = load_model(&file, DType::F32, &Device::Cpu).unwrap();
        let kept = load_quantized(&file, DType::F32, &Device::Cpu).unwrap();
        let mut blocks = 0;
        for layer in &kept.layers {
            for (name, linear) in Model::linears(layer) {
                let kept = matches!(linear.weight, Weight::Quantized(_));
                let dense = name.starts_with("linear_attn.")
                    || name.starts_with("mlp.experts.")
                    || name == "mlp.gate"
                    || name == "mlp.shared_expert_gate"
                    || name == "mlp.shared_expert.down_proj";
                assert_eq!(kept, !dense, "{family} {name}");
                blocks += usize::from(kept);
            }
        }
        // Three MLPs (or shared experts' gate and up) and one attention's four projections.
        let per_layer = if family == "qwen3_5" { 3 } else { 2 };
        assert_eq!(blocks, 3 * per_layer + 4, "{family}");
        let (difference, largest) = blocks_against_dequantized(&dense, &kept);
        let bound = if family == "qwen3_5" { 0.05 } else { 0.06 };
        eprintln!(
            "{family} q8_0: blocks against dequantized, max |Δlogit| {difference} of {largest}"
        );
        assert!(
            difference > 0.0 && difference <= bound * largest,
            "{family}: max |Δlogit| {difference} of {largest}"
        );
    }
}

/// A `qwen35` file without a size of its linear attention, or with no block left to the model once its
/// multi-token-prediction layers are counted out, is refused naming the key.
#[test]
fn qwen3_5_ggufs_missing_a_size_or_with_only_prediction_layers_are_refused_by_key() {
    let scratch = crate::common::tempdir::Dir::new("gguf-qwen3_5-keys");
    let file = scratch.join("qwen3_5.gguf");
    let edits = [
        ("qwen35.ssm.inner_size", None),
        (
            "qwen35.nextn_predict_layers",
            Some(gguf_file::Value::U32(3)),
        ),
    ];
    for (key, value) in edits {
        let edit = Rewrite {
            metadata: vec![(key, value)],
            ..Rewrite::default()
        };
        rewrite(&converted("qwen3_5.gguf"), &file, edit);
        let Err(error) = load_model(&file, DType::F32, &Device::Cpu) else {
            panic!("{key}: the file loaded");
        };
        let error = error.to_string();
        assert!(error.contains(key), "{error}");
    }
}

/// A `qwen35moe` file without its shared expert's size, or whose keys route otherwise than Qwen3.5's
/// router (the chosen experts' weights not renormalised, scaled, or by a sigmoid in place of the
/// softmax), is refused naming the key: neither transformers nor llama.cpp's graph computes that model.
#[test]
fn qwen3_5_moe_ggufs_missing_a_size_or_routing_otherwise_are_refused_by_key() {
    let scratch = crate::common::tempdir::Dir::new("gguf-qwen3_5_moe-keys");
    let file = scratch.join("qwen3_5_moe.gguf");
    let edits = [
        ("qwen35moe.expert_shared_feed_forward_length", None),
        (
            "qwen35moe.expert_weights_norm",
            Some(gguf_file::Value::Bool(false)),
        ),
        (
            "qwen35moe.expert_weights_scale",
            Some(gguf_file::Value::F32(2.5)),
        ),
        (
            "qwen35moe.expert_gating_func",
            Some(gguf_file::Value::U32(2)),
        ),
    ];
    for (key, value) in edits {
        let edit = Rewrite {
            metadata: vec![(key, value)],
            ..Rewrite::default()
        };
        rewrite(&converted("qwen3_5_moe.gguf"), &file, edit);
        let Err(error) = load_model(&file, DType::F32, &Device::Cpu) else {
            panic!("{key}: the file loaded");
        };
        let error = error.to_string();
        assert!(error.contains(key), "{error}");
    }
}

/// Converted without `--no-mtp`, a Qwen3.5 checkpoint's multi-token-prediction layer is one more block
/// after the model's (`block_count`, `nextn_predict_layers`, a last `attention.recurrent_layers` flag
/// false): a full-attention layer with its `nextn.*` tensors (`eh_proj`, `enorm`, `hnorm`). Such a file
/// (the converted one with a copy of its attention layer and those tensors as a fourth block) is the
/// same model: three layers, the same config and the same logits, the fourth block left unread.
#[test]
fn a_qwen3_5_gguf_with_a_prediction_layer_is_the_model_without_it() {
    let scratch = crate::common::tempdir::Dir::new("gguf-qwen3_5-mtp");
    let (source, file) = (converted("qwen3_5.gguf"), scratch.join("qwen3_5-mtp.gguf"));
    let mut reader = std::fs::File::open(&source).unwrap();
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let mut added: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .filter_map(|name| Some((name, name.strip_prefix("blk.1.")?)))
        .map(|(name, module)| {
            let tensor = content.tensor(&mut reader, name, &Device::Cpu).unwrap();
            (format!("blk.3.{module}"), tensor)
        })
        .collect();
    let hidden = 64;
    for (module, dims) in [
        ("eh_proj", vec![hidden, 2 * hidden]),
        ("enorm", vec![hidden]),
        ("hnorm", vec![hidden]),
    ] {
        let tensor = Tensor::ones(dims, DType::F32, &Device::Cpu).unwrap();
        let tensor = QTensor::quantize(&tensor, GgmlDType::F32).unwrap();
        added.push((format!("blk.3.nextn.{module}.weight"), tensor));
    }
    let flags = [true, false, true, false].map(gguf_file::Value::Bool);
    let edit = Rewrite {
        metadata: vec![
            ("qwen35.block_count", Some(gguf_file::Value::U32(4))),
            (
                "qwen35.nextn_predict_layers",
                Some(gguf_file::Value::U32(1)),
            ),
            (
                "qwen35.attention.recurrent_layers",
                Some(gguf_file::Value::Array(flags.to_vec())),
            ),
        ],
        added,
        ..Rewrite::default()
    };
    rewrite(&source, &file, edit);
    let original = load_model(&source, DType::F32, &Device::Cpu).unwrap();
    let model = load_model(&file, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(model.config, original.config);
    let sequence: Vec<u32> = (0..20).map(|i| (i * 29 % 500) as u32).collect();
    assert_eq!(
        sequence_logits(&model, &sequence),
        sequence_logits(&original, &sequence)
    );
}
