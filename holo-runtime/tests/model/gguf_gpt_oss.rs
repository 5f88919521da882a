//! gpt-oss GGUF files as llama.cpp's converter writes them — experts in MXFP4 (ggml type 39), which
//! candle's own reader refuses — loaded to transformers' model of the same weights: `gguf/converted/
//! gpt_oss.gguf` written by llama.cpp's own `convert_hf_to_gguf.py` (`scripts/gguf_converted.py`), and
//! `gguf/gpt_oss.gguf` and `gguf/gpt_oss-fused.gguf` by `scripts/gguf_families.py`'s reproduction of it
//! (the fused gate/up layout, `--fuse-gate-up-exps`, is one llama.cpp's converter does not write for
//! gpt-oss), all from `gpt_oss/mxfp4/` with llama.cpp's clamp of 7 and the gate/up weights four times
//! larger; `gguf/gpt_oss.json` holds transformers' logits and greedy tokens of that model.
//!
//!     ~/.cache/holo-peers/venv/bin/python scripts/gguf_families.py gpt_oss
//!     ~/.cache/holo-peers/venv/bin/python scripts/gguf_converted.py gpt_oss
//!     cargo test -p holo-runtime --test model gguf_gpt_oss

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::common::json::ids;
use crate::common::logits::{greedy_request, sequence_logits};
use candle_core::{DType, Device, Tensor};
use holo_runtime::local::files::load_model;
use holo_runtime::local::gguf::load_quantized;
use holo_runtime::local::model::Weight;
use holo_runtime::local::{
    ClampedSwiGlu, LocalModel, LocalOptions, Model, ModelConfig, RopeScaling,
};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixture("gguf/gpt_oss.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn a_gpt_oss_gguf_with_mxfp4_experts_is_transformers_model() {
    let expected = expected();
    let model = load_model(
        &fixture("gguf/converted/gpt_oss.gguf"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let config = &model.config;
    // What llama.cpp's keys and constants say, read as transformers' config would have it.
    let folder = ModelConfig::from_file(&fixture("gpt_oss/mxfp4/config.json")).unwrap();
    assert_eq!(
        config.layers, folder.layers,
        "windowed, full, windowed; experts"
    );
    assert_eq!(config.variant, folder.variant, "attention sinks");
    assert_eq!(
        config.rope_scaling, folder.rope_scaling,
        "YaRN, truncate false"
    );
    assert_eq!(
        (
            config.head_dim,
            config.num_key_value_heads,
            config.qkv_bias,
            config.o_bias
        ),
        (folder.head_dim, folder.num_key_value_heads, true, true)
    );
    let experts = config.experts.unwrap();
    assert_eq!(
        experts,
        holo_runtime::local::Experts {
            clamped: Some(ClampedSwiGlu {
                alpha: 1.702,
                limit: expected["swiglu_limit"].as_f64().unwrap()
            }),
            ..folder.experts.unwrap()
        }
    );
    assert!(matches!(
        config.rope_scaling,
        RopeScaling::Yarn {
            truncate: false,
            ..
        }
    ));

    for sequence in expected["sequences"].as_array().unwrap() {
        let name = sequence["name"].as_str().unwrap();
        let ours = sequence_logits(&model, &ids(&sequence["ids"]));
        // The clamp at 7 changes these logits (checked by the script): it is applied.
        assert!(sequence["clamp_effect"].as_f64().unwrap() > 1e-2);
        let mut worst = 0f32;
        for (position, theirs) in ids(&sequence["positions"])
            .into_iter()
            .zip(sequence["logits"].as_array().unwrap())
        {
            for (a, b) in ours[position as usize]
                .iter()
                .zip(theirs.as_array().unwrap())
            {
                worst = worst.max((a - b.as_f64().unwrap() as f32).abs());
            }
        }
        println!("gpt_oss.gguf {name}: max |Δlogit| {worst:e}");
        assert!(worst <= 1e-4, "{name}: max |Δlogit| {worst}");
    }
}

/// Every weight of the file, the experts dequantized from ggml's MXFP4 blocks, is bit for bit the one
/// a folder of OpenAI's MXFP4 layout loads to (the gate/up weights four times the fixture's, as the
/// scripts wrote them: a power of two, so exactly); the reproduction and its fused gate/up file are the
/// converter's model.
#[test]
fn gpt_oss_ggufs_hold_the_mxfp4_folders_weights_bit_for_bit() {
    let weights =
        |model: &Model| -> HashMap<String, Tensor> { model.named_weights().into_iter().collect() };
    let folder = load_model(&fixture("gpt_oss/mxfp4"), DType::F32, &Device::Cpu).unwrap();
    let folder = weights(&folder);
    let bits = |tensor: &Tensor| -> Vec<u32> {
        let values: Vec<f32> = tensor.flatten_all().unwrap().to_vec1().unwrap();
        values.iter().map(|value| value.to_bits()).collect()
    };
    let files = [
        "gguf/converted/gpt_oss.gguf",
        "gguf/gpt_oss.gguf",
        "gguf/gpt_oss-fused.gguf",
    ];
    for file in files {
        let model = load_model(&fixture(file), DType::F32, &Device::Cpu).unwrap();
        let ours = weights(&model);
        assert_eq!(ours.len(), folder.len(), "{file}");
        let mut scaled = 0;
        for (name, tensor) in &ours {
            let theirs = &folder[name];
            let theirs = match name.contains(".experts.")
                && (name.ends_with("gate_proj.weight") || name.ends_with("up_proj.weight"))
            {
                // A product, not `* 4.0` (candle's affine adds 0, which turns -0 into +0).
                true => {
                    scaled += 1;
                    theirs
                        .broadcast_mul(&Tensor::new(4f32, &Device::Cpu).unwrap())
                        .unwrap()
                }
                false => theirs.clone(),
            };
            assert_eq!(tensor.dims(), theirs.dims(), "{file}: {name}");
            assert!(bits(tensor) == bits(&theirs), "{file}: {name} differs");
        }
        // Three layers of four experts, gate and up each.
        assert_eq!(scaled, 3 * 4 * 2, "{file}");
    }
}

/// The sampler loads the file as `--model file.gguf` does, and greedy decoding (past the window of 4
/// positions, through the KV cache) gives transformers' tokens.
#[test]
fn a_gpt_oss_gguf_samples_transformers_greedy_tokens() {
    let expected = expected();
    let greedy = &expected["greedy"];
    let model = LocalModel::load(
        fixture("gguf/converted/gpt_oss.gguf"),
        LocalOptions::default(),
    )
    .unwrap();
    let tokens = ids(&greedy["tokens"]);
    let request = greedy_request(ids(&greedy["prompt"]), tokens.len());
    let completion = model
        .sample_blocking(std::slice::from_ref(&request))
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(completion.tokens, tokens);
}

/// `--quantized` keeps every expert matrix as its MXFP4 blocks and multiplies them as they are: the
/// logits are the dequantized model's to rounding (the same values, summed in another order), and
/// greedy decoding gives transformers' tokens.
#[test]
fn a_gpt_oss_gguf_samples_from_its_mxfp4_blocks() {
    let file = fixture("gguf/converted/gpt_oss.gguf");
    let packed = load_quantized(&file, DType::F32, &Device::Cpu).unwrap();
    let dense = load_model(&file, DType::F32, &Device::Cpu).unwrap();
    let mut kept = 0;
    for layer in &packed.layers {
        for (name, linear) in Model::linears(layer) {
            let expert = name.contains(".experts.");
            assert_eq!(matches!(linear.weight, Weight::Mxfp4(_)), expert, "{name}");
            kept += usize::from(expert);
        }
    }
    assert_eq!(
        kept,
        3 * 4 * 3,
        "three layers of four experts: gate, up and down"
    );
    let expected = expected();
    for sequence in expected["sequences"].as_array().unwrap() {
        let sequence = ids(&sequence["ids"]);
        let (ours, theirs) = (
            sequence_logits(&packed, &sequence),
            sequence_logits(&dense, &sequence),
        );
        let worst = ours
            .iter()
            .flatten()
            .zip(theirs.iter().flatten())
            .fold(0f32, |worst, (a, b)| worst.max((a - b).abs()));
        assert!(
            worst <= 1e-4,
            "{} tokens: max |Δlogit| {worst}",
            sequence.len()
        );
    }
    let greedy = &expected["greedy"];
    let model = LocalModel::load(
        &file,
        LocalOptions {
            quantized: true,
            ..LocalOptions::default()
        },
    )
    .unwrap();
    let tokens = ids(&greedy["tokens"]);
    let request = greedy_request(ids(&greedy["prompt"]), tokens.len());
    let completion = model
        .sample_blocking(std::slice::from_ref(&request))
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(completion.tokens, tokens);
}
