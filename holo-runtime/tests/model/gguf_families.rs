//! GGUF files that llama.cpp's converter cannot write but its reader can, written with llama.cpp's
//! tensor names and keys by gguf-py's writer (`scripts/gguf_families.py`): Mistral and Ministral with
//! their windows (the converter writes Mistral as a Llama without a window, and refuses
//! `MinistralForCausalLM`), and Gemma 2 with its soft-caps (the converter reads Gemma 2's vocabulary
//! from sentencepiece's file only, which the fixture has not), each loaded to its folder's config and
//! to transformers' logits; and edits
//! of the converter's own files (`gguf/converted/`, `scripts/gguf_converted.py`): a key taken out, the
//! matrices quantized.
//!
//!     ~/.cache/holo-peers/venv/bin/python scripts/gguf_families.py
//!     cargo test -p holo-runtime --test model gguf_families

use std::path::{Path, PathBuf};

use crate::common::json::{floats, ids, max_diff};
use crate::common::logits::{blocks_against_dequantized, sequence_logits};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device};
use holo_runtime::local::files::load_model;
use holo_runtime::local::gguf::load_quantized;
use holo_runtime::local::model::Weight;
use holo_runtime::local::{Arch, LayerSpec, LocalModel, LocalOptions, Model, ModelConfig};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// `gguf/expected.json`: the script's sequences, and transformers' logits of each file's folder.
fn expected() -> Value {
    let text = std::fs::read_to_string(fixture("gguf/expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The largest |Δlogit| between `model`'s logits of the expected sequences and transformers' logits of
/// `file`'s folder, at the positions recorded.
fn difference_to_transformers(model: &Model, expected: &Value, file: &str) -> f32 {
    let sequences = expected["sequences"].as_array().unwrap();
    let recorded = expected["files"][file]["logits"].as_array().unwrap();
    assert_eq!(sequences.len(), recorded.len(), "{file}");
    let mut largest = 0f32;
    for (sequence, recorded) in sequences.iter().zip(recorded) {
        let ours = sequence_logits(model, &ids(sequence));
        let positions = recorded["positions"].as_array().unwrap();
        let theirs = recorded["logits"].as_array().unwrap();
        assert_eq!(positions.len(), theirs.len(), "{file}");
        for (position, theirs) in positions.iter().zip(theirs) {
            let position = position.as_u64().unwrap() as usize;
            largest = largest.max(max_diff(&ours[position], &floats(theirs)));
        }
    }
    largest
}

/// Each file and the folder it was written from.
const FILES: [(&str, &str); 3] = [
    ("mistral.gguf", "mistral"),
    ("ministral.gguf", "ministral"),
    ("gemma2.gguf", "gemma2"),
];

#[test]
fn gguf_files_are_their_folders_models_with_transformers_logits() {
    let expected = expected();
    for (file, folder) in FILES {
        let path = fixture(&format!("gguf/{file}"));
        assert_eq!(
            expected["files"][file]["folder"], folder,
            "{file}: gguf/expected.json"
        );
        let from_folder = load_model(&fixture(folder), DType::F32, &Device::Cpu).unwrap();
        let from_file = load_model(&path, DType::F32, &Device::Cpu)
            .unwrap_or_else(|error| panic!("{file}: {error}"));
        let (ours, theirs) = (&from_file.config, &from_folder.config);
        assert_eq!(ours.arch, theirs.arch, "{file}");
        assert_eq!(
            ours.layers, theirs.layers,
            "{file}: windows and RoPE per layer"
        );
        // Gemma 2's soft-caps among them, from `gemma2.attn_logit_softcapping` and
        // `gemma2.final_logit_softcapping`.
        assert_eq!(ours.variant, theirs.variant, "{file}");
        assert_eq!(ours.rope_scaling, theirs.rope_scaling, "{file}");
        // Past the windows (4 positions).
        let difference = difference_to_transformers(&from_file, &expected, file);
        assert!(
            difference <= 1e-4,
            "{file}: max |Δlogit| {difference} against transformers"
        );
        // What sets each apart came through the file's keys.
        let windows: Vec<Option<usize>> = ours.layers.iter().map(|l| l.window).collect();
        match folder {
            "ministral" | "gemma2" => assert_eq!(windows, [Some(4), None], "{file}"),
            _ => assert_eq!(windows, [Some(4), Some(4)], "{file}"),
        }
        // `holo export` writes the file's config as the family's `config.json`: the same layers again.
        let exported = ModelConfig::from_json(&ours.to_json()).unwrap();
        assert_eq!(
            (exported.arch, &exported.layers),
            (ours.arch, &ours.layers),
            "{file}: exported config"
        );
        // The whole sampler loads the file as `--model file.gguf` does.
        LocalModel::load(&path, LocalOptions::default())
            .unwrap_or_else(|error| panic!("{file}: {error}"));
    }
}

/// A Mistral file without `llama.attention.sliding_window`, as llama.cpp's converter writes every Mistral
/// checkpoint, is a Llama model that attends fully, as llama.cpp runs it: the windowed model's logits
/// while the sequence fits the window, not transformers' past it.
#[test]
fn a_mistral_gguf_without_its_window_attends_fully() {
    let scratch = crate::common::tempdir::Dir::new("gguf-mistral-window");
    let file = scratch.join("mistral.gguf");
    rewrite(
        &fixture("gguf/mistral.gguf"),
        &file,
        "llama.attention.sliding_window",
        GgmlDType::F32,
    );
    let full = load_model(&file, DType::F32, &Device::Cpu).unwrap();
    let windowed = load_model(&fixture("gguf/mistral.gguf"), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(full.config.arch, Arch::Llama);
    assert!(full
        .config
        .layers
        .iter()
        .all(|layer| *layer == LayerSpec::FULL));
    let sequence = [1, 2, 3, 4, 5, 6, 7, 8, 9];
    let (a, b) = (
        sequence_logits(&full, &sequence),
        sequence_logits(&windowed, &sequence),
    );
    for position in 0..4 {
        let difference = max_diff(&a[position], &b[position]);
        assert!(difference <= 1e-5, "position {position}: {difference}");
    }
    let past = difference_to_transformers(&full, &expected(), "mistral.gguf");
    assert!(
        past > 1e-2,
        "full attention past the window should differ from transformers' windowed logits: {past}"
    );
}

/// `source` written again into `out` with the metadata `dropped` left out and the two-dimensional
/// tensors in `matrices`.
fn rewrite(source: &Path, out: &Path, dropped: &str, matrices: GgmlDType) {
    let mut reader = std::fs::File::open(source).unwrap();
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .filter(|(key, _)| *key != dropped)
        .map(|(key, value)| (key.as_str(), value))
        .collect();
    let tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            let tensor = content.tensor(&mut reader, name, &Device::Cpu).unwrap();
            let tensor = match tensor.shape().rank() {
                2 => {
                    QTensor::quantize(&tensor.dequantize(&Device::Cpu).unwrap(), matrices).unwrap()
                }
                _ => tensor,
            };
            (name.clone(), tensor)
        })
        .collect();
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

#[test]
fn an_olmo3_gguf_without_its_window_pattern_is_refused_by_key() {
    let scratch = crate::common::tempdir::Dir::new("gguf-olmo3-pattern");
    let file = scratch.join("olmo3.gguf");
    let key = "olmo2.attention.sliding_window_pattern";
    rewrite(
        &fixture("gguf/converted/olmo3.gguf"),
        &file,
        key,
        GgmlDType::F32,
    );
    let error = load_model(&file, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(error.contains(key), "{error}");
}

/// Phi-3's fused `attn_qkv` and `ffn_up` in Q8_0 stay in their blocks for sampling
/// (`--quantized`), as the other projections do, and give the dequantized file's logits but for the
/// activations' rounding to 8 bits.
#[test]
fn a_q8_0_phi3_gguf_keeps_its_fused_projections_in_blocks() {
    let scratch = crate::common::tempdir::Dir::new("gguf-phi3-q8_0");
    let file = scratch.join("phi3.gguf");
    rewrite(
        &fixture("gguf/converted/phi3.gguf"),
        &file,
        "",
        GgmlDType::Q8_0,
    );
    let dense = load_model(&file, DType::F32, &Device::Cpu).unwrap();
    let kept = load_quantized(&file, DType::F32, &Device::Cpu).unwrap();
    for layer in &kept.layers {
        let linears = Model::linears(layer);
        let names: Vec<&str> = linears.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(
            names,
            [
                "self_attn.qkv_proj",
                "self_attn.o_proj",
                "mlp.gate_up_proj",
                "mlp.down_proj"
            ]
        );
        for (name, linear) in linears {
            assert!(
                matches!(linear.weight, Weight::Quantized(_)),
                "{name} was dequantized"
            );
        }
    }
    let (difference, largest) = blocks_against_dequantized(&dense, &kept);
    assert!(
        difference <= 0.05 * largest,
        "max |Δlogit| {difference} of {largest}"
    );
}
