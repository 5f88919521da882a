//! `holo init-model`: the folder it writes (names, shapes, config, tokenizer), reproducibility, usage
//! errors, and — when the Python peers' venv exists — that transformers loads and runs it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{DType, Device, Tensor};
use holo_runtime::chat::{ChatTemplate, RenderOptions};
use holo_runtime::local::{Arch, ModelConfig, QkNorm, RopeScaling};
use holo_runtime::{ChatMessage, Role};
use tokenizers::Tokenizer;

const FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];

fn holo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_holo"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("holo runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A fresh (absent) folder path for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join(format!("holo-init-model-{}", std::process::id()))
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.parent().unwrap()).unwrap();
    dir
}

fn init(arch: &str, dir: &Path, extra: &[&str]) -> Output {
    let dir = dir.to_str().unwrap();
    let mut args = vec!["init-model", "--arch", arch, "--preset", "tiny", dir];
    args.extend_from_slice(extra);
    let output = holo(&args);
    assert_eq!(
        output.status.code(),
        Some(0),
        "holo init-model failed:\n{}",
        text(&output.stderr)
    );
    output
}

/// The tensors a tiny checkpoint must hold, written out independently of the code under test.
fn expected_tensors(arch: Arch) -> BTreeMap<String, Vec<usize>> {
    let mut expected = BTreeMap::new();
    expected.insert("model.embed_tokens.weight".to_string(), vec![512, 64]);
    expected.insert("model.norm.weight".to_string(), vec![64]);
    for layer in 0..2 {
        let p = format!("model.layers.{layer}");
        let mut add = |name: &str, shape: &[usize]| {
            expected.insert(format!("{p}.{name}"), shape.to_vec());
        };
        // Qwen3's heads are 32 wide (4 × 32 = 128 query columns), the others' 64 / 4 = 16.
        let (q, kv) = if arch == Arch::Qwen3 {
            (128, 64)
        } else {
            (64, 32)
        };
        add("self_attn.q_proj.weight", &[q, 64]);
        add("self_attn.k_proj.weight", &[kv, 64]);
        add("self_attn.v_proj.weight", &[kv, 64]);
        add("self_attn.o_proj.weight", &[64, q]);
        if arch == Arch::Qwen3 {
            add("self_attn.q_norm.weight", &[32]);
            add("self_attn.k_norm.weight", &[32]);
        }
        if arch == Arch::Qwen2 {
            add("self_attn.q_proj.bias", &[64]);
            add("self_attn.k_proj.bias", &[32]);
            add("self_attn.v_proj.bias", &[32]);
        }
        add("mlp.gate_proj.weight", &[128, 64]);
        add("mlp.up_proj.weight", &[128, 64]);
        add("mlp.down_proj.weight", &[64, 128]);
        add("input_layernorm.weight", &[64]);
        add("post_attention_layernorm.weight", &[64]);
    }
    if arch == Arch::Llama {
        expected.insert("lm_head.weight".to_string(), vec![512, 64]);
    }
    expected
}

fn values(tensor: &Tensor) -> Vec<f32> {
    tensor.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn check_folder(arch: Arch) {
    let name = arch.model_type();
    let dir = scratch(name);
    let output = init(name, &dir, &["--seed", "3"]);
    let stdout = text(&output.stdout);
    assert!(
        stdout.contains(&format!("random {name} tiny model")),
        "{stdout}"
    );
    for file in FILES {
        assert!(dir.join(file).is_file(), "{file} missing");
    }
    let leftovers: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|file| !FILES.contains(&file.as_str()))
        .collect();
    assert!(leftovers.is_empty(), "unexpected files: {leftovers:?}");

    // config.json
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!(config.arch, arch);
    assert_eq!(
        (
            config.vocab_size,
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers
        ),
        (512, 64, 128, 2)
    );
    assert_eq!(
        (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim
        ),
        (4, 2, if arch == Arch::Qwen3 { 32 } else { 16 })
    );
    assert_eq!(config.max_position_embeddings, 2048);
    assert_eq!(config.rope_scaling, RopeScaling::None);
    assert_eq!(config.tie_word_embeddings, arch != Arch::Llama);
    assert_eq!(config.qkv_bias, arch == Arch::Qwen2);
    assert_eq!(config.variant.qk_norm == QkNorm::Head, arch == Arch::Qwen3);
    assert!(!config.o_bias && !config.mlp_bias);
    assert_eq!(config.bos_token_id, Some(509));
    assert_eq!(config.eos_token_ids, vec![511]);
    assert_eq!(ModelConfig::from_json(&config.to_json()).unwrap(), config);

    let generation: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(generation["eos_token_id"], serde_json::json!([511, 509]));
    assert_eq!(generation["pad_token_id"], 509);

    // model.safetensors
    let tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let shapes: BTreeMap<String, Vec<usize>> = tensors
        .iter()
        .map(|(name, tensor)| (name.clone(), tensor.dims().to_vec()))
        .collect();
    assert_eq!(shapes, expected_tensors(arch));
    for (name, tensor) in &tensors {
        assert_eq!(tensor.dtype(), DType::F32, "{name}");
        let values = values(tensor);
        if name.ends_with(".bias") {
            assert!(values.iter().all(|&v| v == 0.0), "{name} is not zero");
        } else if name.ends_with("norm.weight") {
            assert!(values.iter().all(|&v| v == 1.0), "{name} is not one");
        } else {
            let n = values.len() as f64;
            let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
            let std = (values
                .iter()
                .map(|&v| (v as f64 - mean).powi(2))
                .sum::<f64>()
                / n)
                .sqrt();
            assert!(mean.abs() < 0.003, "{name}: mean {mean}");
            assert!((std - 0.02).abs() < 0.002, "{name}: std {std}");
        }
    }
    if arch == Arch::Llama {
        let embed = values(&tensors["model.embed_tokens.weight"]);
        assert_ne!(
            embed,
            values(&tensors["lm_head.weight"]),
            "untied weights drawn apart"
        );
    }

    // tokenizer.json
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    assert_eq!(tokenizer.get_vocab_size(true), 512);
    for (token, id) in [
        ("<|endoftext|>", 509),
        ("<|im_start|>", 510),
        ("<|im_end|>", 511),
    ] {
        assert_eq!(tokenizer.token_to_id(token), Some(id), "{token}");
    }
    let chat = "<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n19<|im_end|>\n";
    let encoding = tokenizer.encode(chat, false).unwrap();
    let ids = encoding.get_ids();
    assert_eq!(ids.iter().filter(|&&id| id == 510).count(), 2, "{ids:?}");
    assert_eq!(ids.iter().filter(|&&id| id == 511).count(), 2, "{ids:?}");
    assert!(ids.iter().all(|&id| id < 512));
    assert!(ids.len() < chat.len() / 2, "BPE merges: {} ids", ids.len());
    assert_eq!(tokenizer.decode(ids, false).unwrap(), chat);
    let unicode = "Héllo wörld — 你好，世界! 🦀 tabs\tand\r\nnewlines  spaces";
    let ids = tokenizer.encode(unicode, false).unwrap().get_ids().to_vec();
    assert_eq!(tokenizer.decode(&ids, false).unwrap(), unicode);
    // Skipping special tokens drops the ChatML markers only.
    let ids = tokenizer
        .encode("<|im_start|>x<|im_end|>", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(tokenizer.decode(&ids, true).unwrap(), "x");

    // tokenizer_config.json: the runtime's chat templating reads it.
    let template = ChatTemplate::from_dir(&dir).unwrap();
    assert_eq!(template.special_token("eos_token"), Some("<|im_end|>"));
    assert_eq!(template.special_token("pad_token"), Some("<|endoftext|>"));
    let rendered = template
        .render(
            &[ChatMessage {
                role: Role::User,
                content: "What is 12+7?".into(),
            }],
            &RenderOptions::generation(),
        )
        .unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn qwen2_tiny_folder() {
    check_folder(Arch::Qwen2);
}

#[test]
fn qwen3_tiny_folder() {
    check_folder(Arch::Qwen3);
}

#[test]
fn llama_tiny_folder() {
    check_folder(Arch::Llama);
}

#[test]
fn same_seed_same_bytes_other_seed_other_weights() {
    let read = |dir: &Path, file: &str| std::fs::read(dir.join(file)).unwrap();
    let (a, b, c) = (scratch("seed-a"), scratch("seed-b"), scratch("seed-c"));
    init("llama", &a, &["--seed", "7"]);
    init("llama", &b, &["--seed", "7"]);
    init("llama", &c, &["--seed", "8"]);
    for file in FILES {
        assert!(
            read(&a, file) == read(&b, file),
            "{file} differs with the same seed"
        );
    }
    for file in FILES.iter().filter(|&&file| file != "model.safetensors") {
        assert!(
            read(&a, file) == read(&c, file),
            "{file} depends on the seed"
        );
    }
    let load = |dir: &Path| {
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
    };
    let (first, other) = (load(&a), load(&c));
    for (name, tensor) in &first {
        let same = values(tensor) == values(&other[name]);
        let random = !name.ends_with("norm.weight") && !name.ends_with(".bias");
        assert_eq!(same, !random, "{name}");
    }
    for dir in [a, b, c] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn refuses_a_non_empty_folder_without_force() {
    let dir = scratch("non-empty");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "keep me").unwrap();
    let path = dir.to_str().unwrap();
    let output = holo(&["init-model", path]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("is not empty") && stderr.contains("--force"),
        "{stderr}"
    );
    assert!(!dir.join("config.json").exists());

    let output = holo(&["init-model", "--force", path]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    assert!(dir.join("model.safetensors").is_file());
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "keep me"
    );
    // Writing again over a model folder.
    let output = holo(&["init-model", "--force", "--arch", "llama", path]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!(config.arch, Arch::Llama);

    let file = dir.join("notes.txt");
    let output = holo(&["init-model", file.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text(&output.stderr).contains("not a directory"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_are_usage_errors() {
    let dir = scratch("bad-arguments");
    let path = dir.to_str().unwrap();
    let output = holo(&["init-model", "--preset", "huge", path]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("huge") && stderr.contains("tiny or small"),
        "{stderr}"
    );
    let output = holo(&["init-model", "--arch", "gpt2", path]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("gpt2")
            && stderr.contains("qwen2, qwen3, llama, mistral, ministral, smollm3"),
        "{stderr}"
    );
    let output = holo(&["init-model"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(!dir.exists());
}

/// `--layers N` writes N decoder layers in the preset's pattern: Gemma 3's windowed and global
/// layers, SmolLM3's layers without RoPE and Qwen3.5's linear-attention layers continue past the
/// preset's two, the checkpoint holds exactly the N layers' weights, and 0 is a usage error.
#[test]
fn layers_sets_the_decoder_count_in_the_preset_pattern() {
    for (arch, layers) in [
        ("gemma3_text", 5),
        ("smollm3", 3),
        ("qwen3_5_text", 4),
        ("qwen2", 1),
    ] {
        let dir = scratch(&format!("layers-{arch}"));
        init(arch, &dir, &["--layers", &layers.to_string()]);
        let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        assert_eq!(config.num_hidden_layers, layers, "{arch}");
        assert_eq!(config.layers.len(), layers, "{arch}");
        for (layer, spec) in config.layers.iter().enumerate() {
            // The tiny preset's patterns, from the first layer on: every other layer windowed
            // (Gemma 3), with RoPE (SmolLM3: the others go without), linear attention (Qwen3.5).
            match arch {
                "gemma3_text" => assert_eq!(spec.window.is_some(), layer % 2 == 0, "{layer}"),
                "smollm3" => assert_eq!(spec.rope, layer % 2 == 0, "{layer}"),
                "qwen3_5_text" => assert_eq!(spec.linear, layer % 2 == 0, "{layer}"),
                _ => assert!(spec.window.is_none() && spec.rope && !spec.linear),
            }
        }
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let names: Vec<String> = safetensors::SafeTensors::deserialize(&bytes)
            .unwrap()
            .names()
            .into_iter()
            .map(str::to_string)
            .collect();
        let last = format!("model.layers.{}.", layers - 1);
        let past = format!("model.layers.{layers}.");
        assert!(
            names.iter().any(|name| name.starts_with(&last)),
            "{arch}: {names:?}"
        );
        assert!(
            !names.iter().any(|name| name.starts_with(&past)),
            "{arch}: {names:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
    let dir = scratch("layers-zero");
    let output = holo(&["init-model", "--layers", "0", dir.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        text(&output.stderr).contains("--layers 0"),
        "{}",
        text(&output.stderr)
    );
    assert!(!dir.exists());
}

/// Loads a folder with transformers and reports what it found, as JSON.
const TRANSFORMERS_CHECK: &str = r#"
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, rust_ids = sys.argv[1], json.loads(sys.argv[2])
tok = AutoTokenizer.from_pretrained(folder)
model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
model.eval()
text = tok.apply_chat_template([{"role": "user", "content": "What is 12+7?"}], tokenize=False,
                               add_generation_prompt=True)
ids = tok(text, return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(ids).logits
    out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         pad_token_id=tok.pad_token_id)
from safetensors.torch import load_file
stored = load_file(folder + "/model.safetensors")
state = model.state_dict()
def loaded(key):
    # transformers 5 holds a mixture's experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I].
    if key in state or ".mlp.experts." not in key:
        return state[key]
    layer, rest = key.split(".mlp.experts.")
    expert, projection = rest.split(".")[:2]
    expert = int(expert)
    if projection == "down_proj":
        return state[layer + ".mlp.experts.down_proj"][expert]
    fused = state[layer + ".mlp.experts.gate_up_proj"][expert]
    half = fused.shape[0] // 2
    return fused[:half] if projection == "gate_proj" else fused[half:]
print(json.dumps({
    "class": type(model).__name__,
    "missing": list(info["missing_keys"]),
    "unexpected": list(info["unexpected_keys"]),
    "mismatched": [str(m) for m in info["mismatched_keys"]],
    "weights_equal": all(torch.equal(stored[k], loaded(k)) for k in stored),
    "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
    "text": text,
    "ids": ids[0].tolist(),
    "rust_ids_match": tok.encode(text, add_special_tokens=False) == rust_ids,
    "decoded": tok.decode(ids[0]),
    "logits_shape": list(logits.shape),
    "finite": bool(torch.isfinite(logits).all()),
    "generated": out.shape[1] - ids.shape[1],
    "eos_token": tok.eos_token, "pad_token": tok.pad_token, "bos_token": tok.bos_token,
    "eos_ids": model.generation_config.eos_token_id,
}))
"#;

#[test]
fn transformers_loads_the_folder() {
    let Some(python) = crate::common::components::peers(&["torch", "transformers"]) else {
        return;
    };
    for arch in holo_runtime::local::init::ARCHS {
        let dir = scratch(&format!("transformers-{arch}"));
        init(arch.model_type(), &dir, &[]);
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let chat = "<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n";
        let rust_ids = tokenizer.encode(chat, false).unwrap().get_ids().to_vec();
        let output = Command::new(&python)
            .args(["-c", TRANSFORMERS_CHECK, dir.to_str().unwrap()])
            .arg(serde_json::to_string(&rust_ids).unwrap())
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("TOKENIZERS_PARALLELISM", "false")
            .output()
            .expect("python runs");
        assert!(
            output.status.success(),
            "{arch}: transformers failed:\n{}",
            text(&output.stderr)
        );
        let stdout = text(&output.stdout);
        let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
            .unwrap_or_else(|error| panic!("{arch}: {error}: {stdout}"));
        assert_eq!(report["class"], arch.architecture(), "{report}");
        assert_eq!(report["missing"], serde_json::json!([]), "{report}");
        assert_eq!(report["unexpected"], serde_json::json!([]), "{report}");
        assert_eq!(report["mismatched"], serde_json::json!([]), "{report}");
        assert_eq!(report["weights_equal"], true, "{report}");
        let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        assert_eq!(report["tied"], config.tie_word_embeddings, "{report}");
        assert_eq!(report["text"], chat, "{report}");
        assert_eq!(report["ids"], serde_json::json!(rust_ids), "{report}");
        assert_eq!(report["rust_ids_match"], true, "{report}");
        assert_eq!(report["decoded"], chat, "{report}");
        assert_eq!(
            report["logits_shape"],
            serde_json::json!([1, rust_ids.len(), 512]),
            "{report}"
        );
        assert_eq!(report["finite"], true, "{report}");
        assert_eq!(report["generated"], 4, "{report}");
        assert_eq!(report["eos_token"], "<|im_end|>", "{report}");
        assert_eq!(report["pad_token"], "<|endoftext|>", "{report}");
        assert_eq!(report["bos_token"], serde_json::Value::Null, "{report}");
        assert_eq!(report["eos_ids"], serde_json::json!([511, 509]), "{report}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
