//! GGUF files with a sentencepiece vocabulary, as llama.cpp's converter writes every real Gemma 3,
//! Llama 2 and Phi-3 file (`tokenizer.ggml.model` `llama`: tokens, scores, token types, byte pieces,
//! no merges): tiny vocabularies trained with `sentencepiece` (BPE, byte fallback, digits split;
//! Gemma's `<start_of_turn>` / `<end_of_turn>` and no dummy prefix, Llama 2's dummy prefix, Phi-3's
//! `<|user|>`…) beside the family fixtures' weights, converted by llama.cpp's own
//! `convert_hf_to_gguf.py`. Each file tokenizes, renders its chats and decodes as transformers' own
//! GGUF tokenizer does, and as the folder's tokenizer and sentencepiece itself do where they agree with
//! it (below), and holds the folder's model.
//!
//!     ~/.cache/holo-peers/venv/bin/python scripts/gguf_spm.py
//!     cargo test -p holo-runtime --test model gguf_spm

use std::path::{Path, PathBuf};

use crate::common::json::ids;
use crate::gguf_converted::{difference_to_transformers, folder_config, rewrite, Rewrite};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use holo_runtime::chat::RenderOptions;
use holo_runtime::local::files::{load_model, load_template, load_tokenizer};
use holo_runtime::local::{LocalModel, LocalOptions, ModelConfig};
use holo_runtime::{ChatMessage, Role};
use serde_json::Value;

fn converted(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/gguf/converted")
        .join(name)
}

/// `converted/spm.json`: the texts and chats, and per file transformers' logits and the ids of the
/// folder's tokenizer, of transformers' tokenizer of the file and of sentencepiece.
fn expected() -> Value {
    let text = std::fs::read_to_string(converted("spm.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

const FILES: [&str; 3] = ["gemma3-spm.gguf", "llama-spm.gguf", "phi3-spm.gguf"];

/// The tokenizers each file's ids must equal besides transformers' own tokenizer of the file
/// (`gguf`, every file). The folder's: but Phi-3's, which transformers builds from a `phi3`
/// folder's `tokenizer.model` with no prefix at all (Phi-3's own `tokenizer.json` prefixes a space,
/// as transformers' tokenizer of the file and llama.cpp do). sentencepiece's (on the texts without
/// added pieces): but Llama's, whose `Metaspace` prefixes no space to a text that starts with one
/// (`" leading space"` is `▁leading` in transformers, `▁▁leading` in sentencepiece and in llama.cpp,
/// which prefixes a space to each stretch of text after BOS or a special token: so it differs too
/// on Llama's chats, where `[INST]` follows `<s>`).
fn references(file: &str) -> &'static [&'static str] {
    match file {
        "gemma3-spm.gguf" => &["gguf", "folder", "spm"],
        "llama-spm.gguf" => &["gguf", "folder"],
        _ => &["gguf", "spm"],
    }
}

fn messages(chat: &Value) -> Vec<ChatMessage> {
    chat.as_array()
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
        .collect()
}

/// Texts with leading, doubled and trailing spaces, newlines, tabs, digits, characters outside the
/// vocabulary (byte pieces), the families' control tokens inside text, and chats through the file's
/// template: the ids of every reference, BOS added as the file says.
#[test]
fn spm_ggufs_tokenize_and_template_as_transformers() {
    let expected = expected();
    let texts = expected["texts"].as_array().unwrap();
    let chats = expected["chats"].as_array().unwrap();
    for file in FILES {
        let recorded = &expected["files"][file];
        let tokenizer = load_tokenizer(&converted(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let template = load_template(&converted(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(!template.is_builtin(), "{file}: the file's own template");
        for (i, text) in texts.iter().enumerate() {
            let text = text.as_str().unwrap();
            let ours = tokenizer.encode(text, true).unwrap().get_ids().to_vec();
            for reference in references(file) {
                let theirs = match reference {
                    &"spm" => &recorded["spm"][i],
                    other => &recorded[other]["texts"][i],
                };
                if !theirs.is_null() {
                    assert_eq!(ours, ids(theirs), "{file} {reference}: {text:?}");
                }
            }
        }
        for (i, chat) in chats.iter().enumerate() {
            let rendered = template
                .render(&messages(chat), &RenderOptions::generation())
                .unwrap();
            let ours = tokenizer
                .encode(rendered, false)
                .unwrap()
                .get_ids()
                .to_vec();
            for reference in references(file).iter().filter(|r| **r != "spm") {
                let theirs = ids(&recorded[reference]["chats"][i]);
                assert_eq!(ours, theirs, "{file} {reference}: {chat}");
            }
        }
    }
}

/// Decoding gives transformers' text back: byte pieces joined into UTF-8, the prefixed space dropped.
/// That is the text itself for Gemma (no prefix) and for the texts without special tokens of Phi-3
/// (a space prefixed to every stretch of text); Llama's `Metaspace` loses a leading space of the
/// text, which it did not prefix but the decoder drops, as transformers' and llama.cpp's do.
#[test]
fn spm_ggufs_decode_as_transformers() {
    let expected = expected();
    let texts = expected["texts"].as_array().unwrap();
    for file in FILES {
        let tokenizer = load_tokenizer(&converted(file)).unwrap();
        let decoded = expected["files"][file]["gguf"]["decoded"]
            .as_array()
            .unwrap();
        for (text, theirs) in texts.iter().zip(decoded) {
            let text = text.as_str().unwrap();
            let encoded = tokenizer.encode(text, false).unwrap();
            let ours = tokenizer.decode(encoded.get_ids(), false).unwrap();
            assert_eq!(ours, theirs.as_str().unwrap(), "{file}: {text:?}");
            let special = ["<start_of_turn>", "<s>", "<|user|>"];
            let plain = !special.iter().any(|token| text.contains(token));
            let whole = match file {
                "gemma3-spm.gguf" => true,
                "phi3-spm.gguf" => plain,
                _ => plain && !text.starts_with(' '),
            };
            if whole {
                assert_eq!(ours, text, "{file}");
            }
        }
    }
}

/// Each file is its folder's model (the family fixture's weights): its config and transformers'
/// logits, and the sampler loads it.
#[test]
fn spm_ggufs_are_their_folders_models_with_transformers_logits() {
    let expected = expected();
    for file in FILES {
        let recorded = &expected["files"][file];
        let path = converted(file);
        let model = load_model(&path, DType::F32, &Device::Cpu).unwrap();
        let theirs: ModelConfig = folder_config(&recorded["config"], &model.config);
        assert_eq!(model.config, theirs, "{file}: config");
        let difference = difference_to_transformers(&model, &recorded["logits"]);
        eprintln!("{file}: max |Δlogit| {difference:e} against transformers");
        assert!(difference <= 1e-4, "{file}: max |Δlogit| {difference}");
        LocalModel::load(&path, LocalOptions::default()).unwrap();
    }
}

/// A sentencepiece vocabulary without merges whose scores are missing or not one per token, or whose
/// token types are not one per token, is refused naming the key.
#[test]
fn spm_ggufs_with_malformed_vocabularies_are_refused_by_key() {
    let scratch = crate::common::tempdir::Dir::new("gguf-spm-malformed");
    let file = scratch.join("llama-spm.gguf");
    let source = converted("llama-spm.gguf");
    let mut reader = std::fs::File::open(&source).unwrap();
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let shortened = |key: &str| {
        let gguf_file::Value::Array(items) = &content.metadata[key] else {
            panic!("{key}");
        };
        Some(gguf_file::Value::Array(items[1..].to_vec()))
    };
    let edits = [
        ("tokenizer.ggml.scores", None),
        ("tokenizer.ggml.scores", shortened("tokenizer.ggml.scores")),
        (
            "tokenizer.ggml.token_type",
            shortened("tokenizer.ggml.token_type"),
        ),
    ];
    for (key, value) in edits {
        let edit = Rewrite {
            metadata: vec![(key, value)],
            ..Rewrite::default()
        };
        rewrite(&source, &file, edit);
        let Err(error) = load_tokenizer(&file) else {
            panic!("{key}: the tokenizer loaded");
        };
        let error = error.to_string();
        assert!(error.contains(key), "{error}");
    }
}
