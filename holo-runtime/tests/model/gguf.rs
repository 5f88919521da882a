//! GGUF files as models (`holo_runtime::local::gguf`).
//!
//! Always run: the committed tiny Qwen2 and Llama fixtures written as GGUF files here (candle's writer,
//! llama.cpp's tensor names, the Llama q/k rows permuted as llama.cpp's converter does, the tokenizer
//! and chat template as metadata), loaded back through the same path as `--model file.gguf`, and
//! compared with the safetensors folders; and the errors of bad files.
//!
//! Skipped visibly without its files: parity with transformers' GGUF loading on SmolLM2-135M-Instruct
//! (Q4_1 / Q8_0), whose file and reference `scripts/gguf_fixtures.py` writes outside the repository
//! (`$HOLO_GGUF_DIR`, else `$HOME/.cache/holo-peers/smollm2-gguf`):
//!
//!     ~/.cache/holo-peers/venv/bin/python scripts/gguf_fixtures.py
//!     cargo test -p holo-runtime --test model gguf:: -- --nocapture

use std::path::{Path, PathBuf};

use crate::common::json::{floats, ids, max_diff};
use crate::common::logits::sequence_logits;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use holo_runtime::chat::RenderOptions;
use holo_runtime::local::files::{self, load_model};
use holo_runtime::local::gguf::load_quantized;
use holo_runtime::local::model::Weight;
use holo_runtime::local::testing::max_difference;
use holo_runtime::local::{
    Arch, LocalModel, LocalOptions, Model, ModelConfig, QkNorm, RopeScaling,
};
use holo_runtime::train::Policy;
use holo_runtime::{ChatMessage, Role};
use serde_json::Value as Json;

pub(super) fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

pub(super) fn scratch(name: &str) -> crate::common::tempdir::Dir {
    crate::common::tempdir::Dir::new(&format!("gguf-{name}"))
}

fn max_logit_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| max_diff(x, y))
        .fold(0.0, f32::max)
}

/// llama.cpp's q / k row permutation (`convert_hf_to_gguf.py`'s `permute`), which the loader undoes.
fn permute(tensor: &Tensor, heads: usize) -> Tensor {
    let dims = tensor.dims().to_vec();
    let mut shape = vec![heads, 2, dims[0] / heads / 2];
    shape.extend_from_slice(&dims[1..]);
    tensor
        .reshape(shape)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape(dims)
        .unwrap()
}

/// llama.cpp's name of a Hugging Face tensor of an `arch` model.
fn gguf_name(arch: Arch, name: &str) -> String {
    match name {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    let (module, kind) = rest.rsplit_once('.').unwrap();
    // Where a family normalises attention's output, llama.cpp calls that norm `post_attention_norm`
    // and keeps `ffn_norm` for the MLP's input (gguf-py's tensor_mapping.py).
    let post_norms = matches!(arch, Arch::Gemma2 | Arch::Gemma3 | Arch::Olmo2);
    let module = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" if post_norms => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        // gguf-py's `MODEL_TENSOR.ATTN_Q_NORM` / `ATTN_K_NORM` (Qwen3, OLMo 2, Gemma 3).
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        // A mixture's router; its experts are stacked by `write_gguf`.
        "mlp.gate" => "ffn_gate_inp",
        other => panic!("unexpected module {other}"),
    };
    format!("blk.{layer}.{module}.{kind}")
}

type Metadata = Vec<(String, Value)>;

/// The metadata of a fixture folder as llama.cpp writes it: config keys, the byte-level BPE tokenizer
/// (`tokenizer.ggml.*`, control tokens for the added ones) and the chat template.
fn metadata(dir: &Path, config: &ModelConfig) -> Metadata {
    let arch = match config.arch {
        Arch::Gemma3 => "gemma3",
        Arch::Qwen3Moe => "qwen3moe",
        other => other.model_type(),
    };
    let tokenizer: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    let tokenizer_config: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    let mut tokens = vec![(String::new(), 0); config.vocab_size];
    for (token, id) in tokenizer["model"]["vocab"].as_object().unwrap() {
        tokens[id.as_u64().unwrap() as usize] = (token.clone(), 1);
    }
    for added in tokenizer["added_tokens"].as_array().unwrap() {
        tokens[added["id"].as_u64().unwrap() as usize] =
            (added["content"].as_str().unwrap().to_string(), 3);
    }
    let merges: Vec<Value> = tokenizer["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|merge| match merge {
            Json::String(merge) => Value::String(merge.clone()),
            pair => Value::String(format!(
                "{} {}",
                pair[0].as_str().unwrap(),
                pair[1].as_str().unwrap()
            )),
        })
        .collect();
    let id_of = |name: &str| {
        let token = tokenizer_config[name].as_str().unwrap();
        tokens.iter().position(|(t, _)| t == token).unwrap() as u32
    };
    let u32_value = |v: usize| Value::U32(v as u32);
    let mut heads = Vec::new();
    if let Some(window) = config.layers.iter().find_map(|layer| layer.window) {
        heads.push((
            format!("{arch}.attention.sliding_window"),
            u32_value(window),
        ));
    }
    if let Some(experts) = config.experts {
        for (key, value) in [
            ("expert_count", experts.count),
            ("expert_used_count", experts.per_token),
            ("expert_feed_forward_length", experts.intermediate_size),
        ] {
            heads.push((format!("{arch}.{key}"), u32_value(value)));
        }
    }
    if let RopeScaling::Linear { factor } = config.rope_scaling {
        heads.push((
            format!("{arch}.rope.scaling.type"),
            Value::String("linear".into()),
        ));
        heads.push((
            format!("{arch}.rope.scaling.factor"),
            Value::F32(factor as f32),
        ));
    }
    if config.head_dim * config.num_attention_heads != config.hidden_size {
        // As convert_hf_to_gguf.py writes an explicit `head_dim`.
        for key in ["key_length", "value_length"] {
            heads.push((
                format!("{arch}.attention.{key}"),
                u32_value(config.head_dim),
            ));
        }
    }
    heads
        .into_iter()
        .chain([
            ("general.architecture".into(), Value::String(arch.into())),
            (
                format!("{arch}.context_length"),
                u32_value(config.max_position_embeddings),
            ),
            (
                format!("{arch}.embedding_length"),
                u32_value(config.hidden_size),
            ),
            (
                format!("{arch}.block_count"),
                u32_value(config.num_hidden_layers),
            ),
            (
                format!("{arch}.feed_forward_length"),
                u32_value(config.intermediate_size),
            ),
            (
                format!("{arch}.attention.head_count"),
                u32_value(config.num_attention_heads),
            ),
            (
                format!("{arch}.attention.head_count_kv"),
                u32_value(config.num_key_value_heads),
            ),
            (
                format!("{arch}.rope.freq_base"),
                Value::F32(config.rope_theta as f32),
            ),
            (
                format!("{arch}.attention.layer_norm_rms_epsilon"),
                Value::F32(config.rms_norm_eps as f32),
            ),
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(
                    tokens
                        .iter()
                        .map(|(t, _)| Value::String(t.clone()))
                        .collect(),
                ),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(tokens.iter().map(|(_, kind)| Value::I32(*kind)).collect()),
            ),
            ("tokenizer.ggml.merges".into(), Value::Array(merges)),
            (
                "tokenizer.ggml.eos_token_id".into(),
                Value::U32(id_of("eos_token")),
            ),
            (
                "tokenizer.ggml.padding_token_id".into(),
                Value::U32(id_of("pad_token")),
            ),
            ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
            (
                "tokenizer.chat_template".into(),
                Value::String(
                    tokenizer_config["chat_template"]
                        .as_str()
                        .unwrap()
                        .to_string(),
                ),
            ),
        ])
        .collect()
}

/// The fixture folder `dir` as a GGUF file: norms in F32, matrices in `matrices`.
pub(super) fn write_gguf(dir: &Path, matrices: GgmlDType, out: &Path) {
    write_gguf_mixed(dir, &|_| matrices, out)
}

/// [`write_gguf`] with each matrix in the type `matrices` gives its llama.cpp name (`blk.0.ffn_down.weight`,
/// `token_embd.weight`, …), as llama.cpp's mixtures (`Q4_K_M`: some tensors in Q6_K) store them.
pub(super) fn write_gguf_mixed(dir: &Path, matrices: &dyn Fn(&str) -> GgmlDType, out: &Path) {
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut quantized = Vec::new();
    // A mixture's experts as llama.cpp stores them: each projection of every expert of a layer in one
    // `[experts, out, in]` tensor (`blk.N.ffn_gate_exps`, …), the experts in order.
    let mut stacked: std::collections::BTreeMap<(String, &str), Vec<(usize, Tensor)>> =
        Default::default();
    for name in names.iter().filter(|name| name.contains(".mlp.experts.")) {
        let (layer, rest) = name
            .strip_prefix("model.layers.")
            .unwrap()
            .split_once(".mlp.experts.")
            .unwrap();
        let (expert, projection) = rest.split_once('.').unwrap();
        let kind = match projection {
            "gate_proj.weight" => "ffn_gate_exps",
            "up_proj.weight" => "ffn_up_exps",
            "down_proj.weight" => "ffn_down_exps",
            other => panic!("unexpected expert tensor {other}"),
        };
        stacked
            .entry((layer.to_string(), kind))
            .or_default()
            .push((expert.parse().unwrap(), tensors[*name].clone()));
    }
    for ((layer, kind), mut experts) in stacked {
        experts.sort_by_key(|(expert, _)| *expert);
        let experts: Vec<Tensor> = experts.into_iter().map(|(_, tensor)| tensor).collect();
        let tensor = Tensor::stack(&experts, 0).unwrap();
        let name = format!("blk.{layer}.{kind}.weight");
        let dtype = matrices(&name);
        quantized.push((name, QTensor::quantize(&tensor, dtype).unwrap()));
    }
    for name in names
        .into_iter()
        .filter(|name| !name.contains(".mlp.experts."))
    {
        let mut tensor = tensors[name].clone();
        if config.arch.model_type() == "llama" {
            if name.contains("q_proj") {
                tensor = permute(&tensor, config.num_attention_heads);
            } else if name.contains("k_proj") {
                tensor = permute(&tensor, config.num_key_value_heads);
            }
        }
        if config.variant.norm_offset && name.ends_with("norm.weight") {
            // llama.cpp's converter stores Gemma's norms as `1 + w`.
            tensor = tensor.affine(1.0, 1.0).unwrap();
        }
        let name = gguf_name(config.arch, name);
        let dtype = if tensor.rank() == 2 {
            matrices(&name)
        } else {
            GgmlDType::F32
        };
        quantized.push((name, QTensor::quantize(&tensor, dtype).unwrap()));
    }
    write_file(&metadata(dir, &config), &quantized, out);
}

fn write_file(metadata: &Metadata, tensors: &[(String, QTensor)], out: &Path) {
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(out).unwrap();
    gguf_file::write(&mut file, &metadata, &tensors).unwrap();
}

const TEXTS: [&str; 4] = [
    "The cat sat on the mat.",
    "Is a dog  an animal?\n\nYes, 42 times!",
    "<|im_start|>user\nhello<|im_end|>",
    "   spaces\tand tabs",
];

fn chats() -> Vec<Vec<ChatMessage>> {
    vec![
        vec![ChatMessage {
            role: Role::User,
            content: "What is the cat?".into(),
        }],
        vec![
            ChatMessage {
                role: Role::System,
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: Role::User,
                content: "Is a dog an animal?".into(),
            },
            ChatMessage {
                role: Role::Assistant,
                content: "Yes.".into(),
            },
            ChatMessage {
                role: Role::User,
                content: "And a cat?".into(),
            },
        ],
    ]
}

/// The GGUF file's model against the folder's: the greatest logit difference over a few sequences.
fn compare_models(folder: &Model, file: &Model) -> f32 {
    let sequences: [&[u32]; 3] = [&[1, 2, 3, 4, 5], &[509, 100, 200, 300, 7, 8, 9, 10], &[42]];
    sequences
        .iter()
        .map(|ids| max_logit_diff(&sequence_logits(folder, ids), &sequence_logits(file, ids)))
        .fold(0.0, f32::max)
}

#[test]
fn an_f32_gguf_of_the_qwen2_fixture_is_the_same_model_tokenizer_and_template() {
    let dir = fixture("qwen2");
    let scratch_dir = scratch("qwen2-f32");
    let file = scratch_dir.join("qwen2.gguf");
    write_gguf(&dir, GgmlDType::F32, &file);

    let folder_model = load_model(&dir, DType::F32, &Device::Cpu).unwrap();
    let gguf_model = load_model(&file, DType::F32, &Device::Cpu).unwrap();
    let mut expected_config = folder_model.config.clone();
    expected_config.bos_token_id = None;
    // Stored as f32 in the metadata.
    expected_config.rms_norm_eps = 1e-6f32 as f64;
    assert_eq!(gguf_model.config, expected_config);
    assert_eq!(compare_models(&folder_model, &gguf_model), 0.0);

    let folder_tokenizer = files::load_tokenizer(&dir).unwrap();
    let gguf_tokenizer = files::load_tokenizer(&file).unwrap();
    for text in TEXTS {
        let expected = folder_tokenizer.encode(text, true).unwrap();
        let got = gguf_tokenizer.encode(text, true).unwrap();
        assert_eq!(got.get_ids(), expected.get_ids(), "{text:?}");
        assert_eq!(
            gguf_tokenizer.decode(got.get_ids(), false).unwrap(),
            text,
            "decoding {text:?}"
        );
    }

    let folder_template = files::load_template(&dir).unwrap();
    let gguf_template = files::load_template(&file).unwrap();
    assert!(!gguf_template.is_builtin());
    for chat in chats() {
        assert_eq!(
            gguf_template
                .render(&chat, &RenderOptions::generation())
                .unwrap(),
            folder_template
                .render(&chat, &RenderOptions::generation())
                .unwrap()
        );
    }

    // The whole sampler, as `--model file.gguf` loads it.
    let sampler = LocalModel::load(&file, LocalOptions::default()).unwrap();
    let eos = folder_tokenizer.token_to_id("<|im_end|>").unwrap();
    assert_eq!(sampler.end_of_turn(), [eos]);
    // And the trainer's policy, as `holo train --model file.gguf` loads it.
    let policy = Policy::load(&file, &Device::Cpu).unwrap();
    assert_eq!(compare_models(&folder_model, &policy.model), 0.0);
    assert_eq!(policy.end_of_turn, [eos]);
    std::fs::remove_file(&file).unwrap();
}

/// Qwen3's per-head q/k norms under llama.cpp's names (`blk.N.attn_q_norm`), and heads wider than
/// hidden / heads from `qwen3.attention.key_length`: the same model as the folder's.
#[test]
fn an_f32_gguf_of_the_qwen3_fixture_is_the_same_model() {
    let model = f32_gguf_is_the_folders_model("qwen3");
    assert!(model.config.variant.qk_norm == QkNorm::Head && model.config.head_dim == 24);
}

/// Writes the fixture `name` as an f32 GGUF and checks that it loads as the folder's model: the same
/// config (but what GGUF metadata cannot say: no BOS, an f32 epsilon) and the same logits, exactly.
fn f32_gguf_is_the_folders_model(name: &str) -> Model {
    let dir = fixture(name);
    let scratch_dir = scratch(&format!("{name}-f32"));
    let file = scratch_dir.join(format!("{name}.gguf"));
    write_gguf(&dir, GgmlDType::F32, &file);
    let folder_model = load_model(&dir, DType::F32, &Device::Cpu).unwrap();
    let gguf_model = load_model(&file, DType::F32, &Device::Cpu).unwrap();
    let mut expected_config = folder_model.config.clone();
    expected_config.bos_token_id = None;
    expected_config.rms_norm_eps = 1e-6f32 as f64;
    assert_eq!(gguf_model.config, expected_config, "{name}");
    assert_eq!(compare_models(&folder_model, &gguf_model), 0.0, "{name}");
    std::fs::remove_file(&file).unwrap();
    gguf_model
}

/// Qwen3-MoE as llama.cpp stores it (`qwen3moe`: a router per layer, each projection of the experts
/// stacked in one tensor, the expert sizes in the metadata, renormalised weights): the folder's model,
/// its dense layer (`mlp_only_layers`) found by its lack of a router.
#[test]
fn a_qwen3moe_gguf_is_the_folders_model() {
    let model = f32_gguf_is_the_folders_model("qwen3_moe");
    assert_eq!(
        model
            .config
            .layers
            .iter()
            .map(|l| l.experts)
            .collect::<Vec<_>>(),
        [true, false, true]
    );
}

/// OLMo 2 (norms after attention and the MLP, none before) and Gemma 3 (four norms stored by llama.cpp
/// as `1 + w`, `ffn_norm` before the MLP, windows from `gemma3.attention.sliding_window` over llama.cpp's
/// pattern, 1/√head_dim query scale) as llama.cpp names and stores them: the folder's model, with the
/// config llama.cpp's format can say.
#[test]
fn olmo2_and_gemma3_ggufs_are_the_folders_models() {
    for name in ["olmo2", "gemma3"] {
        let dir = fixture(name);
        let scratch_dir = scratch(&format!("{name}-f32"));
        let file = scratch_dir.join(format!("{name}.gguf"));
        write_gguf(&dir, GgmlDType::F32, &file);
        let mut config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        if config.arch == Arch::Gemma3 {
            // Every layer but each sixth is windowed; the queries are scaled by the head size.
            let window = config.layers[0].window;
            for layer in &mut config.layers {
                layer.window = window;
            }
            config.variant.query_pre_attn_scalar = Some(config.head_dim as f64);
        }
        let tensors =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        let folder_model = Model::load(
            VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu),
            &config,
        )
        .unwrap();
        let gguf_model = load_model(&file, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(gguf_model.config.variant, config.variant, "{name}");
        assert_eq!(gguf_model.config.layers, config.layers, "{name}");
        assert!(
            compare_models(&folder_model, &gguf_model) < 1e-4,
            "{name}: {}",
            compare_models(&folder_model, &gguf_model)
        );
        std::fs::remove_file(&file).unwrap();
    }
}

/// Q8_0 matrices: the model is the folder's with each matrix rounded through Q8_0 (exactly), and its logits
/// stay close to the f32 model's.
#[test]
fn a_q8_0_gguf_is_the_model_with_q8_0_rounded_matrices() {
    let dir = fixture("qwen2");
    let scratch_dir = scratch("qwen2-q8");
    let file = scratch_dir.join("qwen2-q8_0.gguf");
    write_gguf(&dir, GgmlDType::Q8_0, &file);
    let gguf_model = load_model(&file, DType::F32, &Device::Cpu).unwrap();

    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let rounded = tensors
        .iter()
        .map(|(name, tensor)| {
            let tensor = if tensor.rank() == 2 {
                QTensor::quantize(tensor, GgmlDType::Q8_0)
                    .unwrap()
                    .dequantize(&Device::Cpu)
                    .unwrap()
            } else {
                tensor.clone()
            };
            (name.clone(), tensor)
        })
        .collect();
    let rounded_model = Model::load(
        VarBuilder::from_tensors(rounded, DType::F32, &Device::Cpu),
        &config,
    )
    .unwrap();
    assert_eq!(compare_models(&rounded_model, &gguf_model), 0.0);

    let folder_model = load_model(&dir, DType::F32, &Device::Cpu).unwrap();
    let diff = compare_models(&folder_model, &gguf_model);
    let scale = sequence_logits(&folder_model, &[509, 100, 200, 300, 7, 8, 9, 10])
        .iter()
        .flatten()
        .fold(0.0f32, |max, x| max.max(x.abs()));
    eprintln!("Q8_0 against f32: max |Δlogit| {diff:e} (max |logit| {scale})");
    assert!(diff > 0.0 && diff < 0.05 * scale, "max |Δlogit| {diff}");
    std::fs::remove_file(&file).unwrap();
}

/// The Llama fixture with its q / k rows permuted as llama.cpp stores them comes back as the same model
/// (rope scaling off on both sides: llama.cpp keeps Llama 3 scaling as a `rope_freqs` tensor, which
/// this writer leaves out; `gguf_converted` reads the converter's).
#[test]
fn a_llama_gguf_has_its_q_and_k_rows_put_back_in_order() {
    let dir = fixture("llama");
    let scratch_dir = scratch("llama");
    let file = scratch_dir.join("llama.gguf");
    write_gguf(&dir, GgmlDType::F32, &file);
    let mut config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    config.rope_scaling = RopeScaling::None;
    let tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let folder_model = Model::load(
        VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu),
        &config,
    )
    .unwrap();
    let gguf_model = load_model(&file, DType::F32, &Device::Cpu).unwrap();
    assert!(!gguf_model.config.tie_word_embeddings);
    assert_eq!(compare_models(&folder_model, &gguf_model), 0.0);
    std::fs::remove_file(&file).unwrap();
}

/// Quantized matrices kept as the file's blocks (what `--model file.gguf --quantized` samples from on the
/// CPU): every projection holds exactly the blocks whose dequantization the dequantized model holds (the
/// Llama fixture's permuted q / k rows put back in order as whole rows of blocks), and the logits
/// (through the head's blocks too) are that model's up to the rounding of the activations to 8 bits per
/// block. The embeddings and norms are dequantized. Such a model samples and refuses full fine-tuning
/// (LoRA trains over it, `qlora.rs`); the trainer's policy and the sampler without `--quantized` load
/// it dense.
#[test]
fn quantized_ggufs_sample_from_their_blocks() {
    for (name, dtype) in [
        ("qwen2", GgmlDType::Q8_0),
        ("qwen2", GgmlDType::Q4_0),
        ("qwen2", GgmlDType::Q5_1),
        ("llama", GgmlDType::Q8_0),
        ("llama", GgmlDType::Q4_0),
    ] {
        let scratch_dir = scratch(&format!("{name}-{dtype:?}"));
        let file = scratch_dir.join(format!("{name}.gguf"));
        write_gguf(&fixture(name), dtype, &file);
        let dense = load_model(&file, DType::F32, &Device::Cpu).unwrap();
        let kept = load_quantized(&file, DType::F32, &Device::Cpu).unwrap();
        for (dense_layer, kept_layer) in dense.layers.iter().zip(&kept.layers) {
            let dense_linears = Model::linears(dense_layer);
            let kept_linears = Model::linears(kept_layer);
            assert_eq!(kept_linears.len(), 7, "{name}");
            for ((module, dense), (_, kept)) in dense_linears.iter().zip(&kept_linears) {
                let Weight::Quantized(blocks) = &kept.weight else {
                    panic!("{name} {dtype:?}: {module} was dequantized");
                };
                assert_eq!(blocks.dtype(), dtype);
                let dequantized = blocks.dequantize(&Device::Cpu).unwrap();
                let expected = dense.weight.dense().unwrap();
                let difference = max_difference(&dequantized, expected);
                assert_eq!(difference, 0.0, "{name} {dtype:?}: {module}");
            }
        }
        let diff = compare_models(&dense, &kept);
        let scale = sequence_logits(&dense, &[509, 100, 200, 300, 7, 8, 9, 10])
            .iter()
            .flatten()
            .fold(0.0f32, |max, x| max.max(x.abs()));
        eprintln!("{name} {dtype:?}: blocks against dequantized, max |Δlogit| {diff:e} (max |logit| {scale})");
        // Measured: 1.9% (qwen2 Q5_1) to 2.8% (qwen2 Q4_0) of the largest logit; rounding the weights
        // through Q8_0 moved them 3.0%.
        assert!(
            diff > 0.0 && diff < 0.05 * scale,
            "{name} {dtype:?}: {diff}"
        );

        assert!(kept.decoding_bytes() * 3 < dense.decoding_bytes());
        let refusal = kept.trainable().unwrap_err().to_string();
        assert!(refusal.contains("--quantized"), "{refusal}");
        let blocks = LocalOptions {
            quantized: true,
            ..LocalOptions::default()
        };
        let sampler = LocalModel::load(&file, blocks.clone()).unwrap();
        let down = &sampler.model().layers[0].mlp.dense().unwrap().down_proj;
        assert!(matches!(down.weight, Weight::Quantized(_)));
        let sampler = LocalModel::load(&file, LocalOptions::default()).unwrap();
        assert_eq!(compare_models(&dense, sampler.model()), 0.0);
        let policy = Policy::load(&file, &Device::Cpu).unwrap();
        assert_eq!(compare_models(&dense, &policy.model), 0.0);
        let mut invariant = blocks;
        invariant.limits.batch_invariant = true;
        let refusal = LocalModel::load(&file, invariant)
            .err()
            .unwrap()
            .to_string();
        assert!(refusal.contains("--quantized"), "{refusal}");
        std::fs::remove_file(&file).unwrap();
    }
}

#[test]
fn bad_gguf_files_are_errors_that_name_the_file_and_the_key() {
    let dir = scratch("bad");
    let error = |path: &Path| {
        LocalModel::load(path, LocalOptions::default())
            .unwrap_err()
            .to_string()
    };

    let missing = dir.join("missing.gguf");
    let message = error(&missing);
    assert!(
        message.contains("missing.gguf") && message.contains("no such file"),
        "{message}"
    );

    let text = dir.join("text.gguf");
    std::fs::write(&text, "not a gguf file").unwrap();
    let message = error(&text);
    assert!(
        message.contains("text.gguf") && message.contains("not a readable GGUF file"),
        "{message}"
    );

    let config = ModelConfig::from_file(&fixture("qwen2").join("config.json")).unwrap();
    let base = metadata(&fixture("qwen2"), &config);
    let zeros = |shape: &[usize]| {
        QTensor::quantize(
            &Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap(),
            GgmlDType::F32,
        )
        .unwrap()
    };
    let with = |name: &str, edit: &dyn Fn(&mut Metadata), extra: &[&str]| {
        let mut metadata = base.clone();
        edit(&mut metadata);
        let mut tensors = vec![(
            "token_embd.weight".to_string(),
            zeros(&[config.vocab_size, config.hidden_size]),
        )];
        for name in extra {
            tensors.push((name.to_string(), zeros(&[config.hidden_size])));
        }
        let path = dir.join(name);
        write_file(&metadata, &tensors, &path);
        path
    };
    let set = |key: &'static str, value: Value| {
        move |metadata: &mut Metadata| {
            metadata.retain(|(k, _)| k != key);
            metadata.push((key.to_string(), value.clone()));
        }
    };

    let gpt2 = with(
        "gpt2.gguf",
        &set("general.architecture", Value::String("gpt2".into())),
        &[],
    );
    let message = error(&gpt2);
    assert!(
        message.contains("gpt2.gguf")
            && message.contains("unsupported architecture \"gpt2\" (`general.architecture`)"),
        "{message}"
    );

    let no_width = with(
        "no-width.gguf",
        &|metadata| metadata.retain(|(k, _)| k != "qwen2.embedding_length"),
        &[],
    );
    let message = error(&no_width);
    assert!(
        message.contains("no-width.gguf")
            && message.contains("missing metadata `qwen2.embedding_length`"),
        "{message}"
    );

    let wrong_type = with(
        "wrong-type.gguf",
        &set("qwen2.block_count", Value::String("two".into())),
        &[],
    );
    let message = error(&wrong_type);
    assert!(
        message.contains("metadata `qwen2.block_count` must be a non-negative integer"),
        "{message}"
    );

    let unknown = with("unknown.gguf", &|_| {}, &["blk.0.ssm_conv1d.weight"]);
    let message = error(&unknown);
    assert!(
        message.contains("unknown.gguf")
            && message.contains("tensor blk.0.ssm_conv1d.weight: not a tensor of a qwen2 model"),
        "{message}"
    );

    // A fused q, k and v (the converter's `--fuse-qkv`) of the wrong height.
    let short = with("short-qkv.gguf", &|_| {}, &["blk.0.attn_qkv.weight"]);
    let message = error(&short);
    assert!(
        message.contains(
            "tensor blk.0.attn_qkv.weight has shape [64]: q, k and v fused take 128 rows"
        ),
        "{message}"
    );

    let incomplete = with("incomplete.gguf", &|_| {}, &["output_norm.weight"]);
    let message = error(&incomplete);
    assert!(
        message.contains("incomplete.gguf") && message.contains("model.layers.0"),
        "{message}"
    );

    let tokenizer = with(
        "tokenizer.gguf",
        &set("tokenizer.ggml.model", Value::String("bert".into())),
        &[],
    );
    let message = files::load_tokenizer(&tokenizer).unwrap_err().to_string();
    assert!(
        message.contains("tokenizer.gguf")
            && message.contains("unsupported tokenizer \"bert\" (`tokenizer.ggml.model`)"),
        "{message}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// transformers' logits on the same tokens, within this bound (f32 on both sides over 30 layers).
const SMOLLM_LOGIT_TOLERANCE: f32 = 1e-3;

/// transformers' tokens and logits on SmolLM2's GGUF file (`scripts/gguf_fixtures.py` writes it).
fn smollm_reference() -> Json {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/smollm2-gguf/reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn smollm2_gguf_matches_transformers() {
    let reference = smollm_reference();
    let name = reference["source"]["gguf_file"].as_str().unwrap();
    let Some(file) = crate::common::components::smollm2_gguf(name) else {
        return;
    };
    let hashed = holo_runtime::train::provenance::Provenance::collect(
        &[("gguf", &file)],
        holo_runtime::build(),
    )
    .unwrap();
    assert_eq!(
        hashed.inputs[0].sha256,
        reference["source"]["gguf_sha256"].as_str().unwrap(),
        "{} is not the file the reference was made from ({})",
        file.display(),
        reference["source"]["wheel"]
    );
    // Dequantized, as transformers computes (`smollm2_blocks_against_dequantized` has the blocks).
    let model = LocalModel::load(&file, LocalOptions::default()).unwrap();
    assert_eq!(
        model.config().vocab_size as u64,
        reference["vocab_size"].as_u64().unwrap()
    );

    let tokenizer = model.tokenizer();
    for entry in reference["texts"].as_array().unwrap() {
        let text = entry["text"].as_str().unwrap();
        let with_special = tokenizer.encode(text, true).unwrap();
        assert_eq!(with_special.get_ids(), ids(&entry["ids"]), "{text:?}");
        let plain = tokenizer.encode(text, false).unwrap();
        assert_eq!(plain.get_ids(), ids(&entry["ids_plain"]), "{text:?}");
    }
    for entry in reference["chats"].as_array().unwrap() {
        let messages: Vec<ChatMessage> = entry["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage {
                role: match m["role"].as_str().unwrap() {
                    "system" => Role::System,
                    "user" => Role::User,
                    _ => Role::Assistant,
                },
                content: m["content"].as_str().unwrap().to_string(),
            })
            .collect();
        let text = model
            .template()
            .render(&messages, &RenderOptions::generation())
            .unwrap();
        assert_eq!(text, entry["text"].as_str().unwrap());
        assert_eq!(
            tokenizer.encode(text.as_str(), false).unwrap().get_ids(),
            ids(&entry["ids"])
        );
    }

    // One forward pass over the prompt and transformers' greedy continuation: the continuation is ours
    // too when each of its tokens is the argmax at the position before it.
    let mut worst = 0.0f32;
    for prompt in reference["prompts"].as_array().unwrap() {
        let name = &prompt["name"];
        let prompt_ids = ids(&prompt["ids"]);
        let expected_greedy = ids(&prompt["greedy"]);
        let sequence: Vec<u32> = prompt_ids.iter().chain(&expected_greedy).copied().collect();
        let all = sequence_logits(model.model(), &sequence);
        let last = &all[prompt_ids.len() - 1];
        let kept: Vec<f32> = ids(&prompt["logit_ids"])
            .iter()
            .map(|&id| last[id as usize])
            .collect();
        let diff = max_diff(&kept, &floats(&prompt["last_logits"]));
        eprintln!("{name}: max |Δlogit| {diff:e}");
        worst = worst.max(diff);
        let greedy: Vec<u32> = all[prompt_ids.len() - 1..sequence.len() - 1]
            .iter()
            .map(|row| {
                row.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map_or(0, |(id, _)| id as u32)
            })
            .collect();
        assert_eq!(greedy, expected_greedy, "{name}");
    }
    assert!(worst <= SMOLLM_LOGIT_TOLERANCE, "max |Δlogit| {worst}");
}

/// SmolLM2's real file sampled from its blocks (its Q4_1 projections and the tied head's Q8_0) against
/// the same file dequantized: the greatest and mean logit differences at the reference prompts'
/// positions, and the greedy tokens.
#[test]
fn smollm2_blocks_against_dequantized() {
    let reference = smollm_reference();
    let name = reference["source"]["gguf_file"].as_str().unwrap();
    let Some(file) = crate::common::components::smollm2_gguf(name) else {
        return;
    };
    let dense = load_model(&file, DType::F32, &Device::Cpu).unwrap();
    let kept = load_quantized(&file, DType::F32, &Device::Cpu).unwrap();
    let (mut worst, mut sum, mut count, mut agreed, mut greedy_total) =
        (0.0f32, 0.0f64, 0usize, 0, 0);
    for prompt in reference["prompts"].as_array().unwrap() {
        let sequence: Vec<u32> = ids(&prompt["ids"])
            .iter()
            .chain(&ids(&prompt["greedy"]))
            .copied()
            .collect();
        let (expected, got) = (
            sequence_logits(&dense, &sequence),
            sequence_logits(&kept, &sequence),
        );
        let argmax = |row: &Vec<f32>| {
            row.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(id, _)| id)
        };
        for (expected, got) in expected.iter().zip(&got) {
            for (x, y) in expected.iter().zip(got) {
                let difference = (x - y).abs();
                worst = worst.max(difference);
                sum += difference as f64;
                count += 1;
            }
            agreed += usize::from(argmax(expected) == argmax(got));
            greedy_total += 1;
        }
    }
    let mean = sum / count as f64;
    eprintln!(
        "SmolLM2 blocks against dequantized: max |Δlogit| {worst:e}, mean {mean:e}, argmax agrees at \
         {agreed} of {greedy_total} positions"
    );
    // Measured: max 1.9, mean 0.20 on logits of magnitude 10–20, the argmax the same at 187 of 197
    // positions (with only the head in blocks, the projections dequantized: max 0.48, mean 0.045, 194 of
    // 197): every projection's activations are rounded to 8 bits per block, as llama.cpp rounds them.
    assert!(worst < 3.0 && mean < 0.3, "max {worst}, mean {mean}");
    assert!(
        agreed * 10 >= greedy_total * 9,
        "{agreed} of {greedy_total}"
    );
}
