//! GGUF files with a sentencepiece vocabulary, as llama.cpp's converter writes every real Gemma 3,
//! Llama 2 and Phi-3 file (`tokenizer.ggml.model` `llama`: tokens, scores, token types, byte pieces,
//! no merges): tiny vocabularies trained with `sentencepiece` (BPE, byte fallback, digits split;
//! Gemma's `<start_of_turn>` / `<end_of_turn>` and no dummy prefix, Llama 2's dummy prefix, Phi-3's
//! `<|user|>`…) beside the family fixtures' weights, converted by llama.cpp's own
//! `convert_hf_to_gguf.py`. Each file tokenizes and renders its chats as llama.cpp itself does
//! (llama-cpp-python's C library of the same sdist), as sentencepiece does and as transformers does
//! where it agrees (below), decodes to its texts, and holds the folder's model (transformers' and
//! llama.cpp's logits); llama.cpp's own Llama 2 and Phi-3 vocabularies give the ids of its own
//! tokenizer test.
//!
//!     ~/.cache/holo-peers/venv/bin/python scripts/gguf_spm.py --llama-cpp
//!     cargo test -p holo-runtime --test model gguf_spm

use crate::common::json::ids;
use crate::gguf_converted::{
    converted, difference_to_transformers, folder_config, rewrite, Rewrite,
};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use holo_runtime::chat::RenderOptions;
use holo_runtime::local::files::{load_model, load_template, load_tokenizer};
use holo_runtime::local::{LocalModel, LocalOptions, ModelConfig};
use holo_runtime::{ChatMessage, Role};
use serde_json::Value;

/// `converted/spm.json`: the texts and chats, and per file transformers' logits and the ids of the
/// folder's tokenizer, of transformers' tokenizer of the file and of sentencepiece.
fn expected() -> Value {
    let text = std::fs::read_to_string(converted("spm.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

const FILES: [&str; 3] = ["gemma3-spm.gguf", "llama-spm.gguf", "phi3-spm.gguf"];

/// The tokenizers each file's ids must equal, beside llama.cpp's own (`llama_cpp`, every file, every
/// text and chat). transformers' own tokenizer of the file (`gguf`): but Llama's, whose `Metaspace`
/// prefixes no space to a text that starts with one nor after a special token, where llama.cpp,
/// sentencepiece and Llama 2's own `tokenizer.json` do. transformers' tokenizer of the file as it
/// builds Phi-3 files, the space prefixed to each stretch of text as llama.cpp does (`prefixed`, not
/// Gemma). The folder's: Gemma's only (transformers builds a `phi3` folder's `tokenizer.model` with no
/// prefix at all, and a Llama one with `Metaspace`). sentencepiece's, on the texts without added
/// pieces. Phi-3's added tokens swallow the whitespace after them in llama.cpp (and in Phi-3's own
/// `tokenizer.json`), not in transformers' GGUF tokenizer: its texts and chats with them have
/// llama.cpp's ids only.
fn references(file: &str) -> &'static [&'static str] {
    match file {
        "gemma3-spm.gguf" => &["llama_cpp", "gguf", "folder", "spm"],
        "llama-spm.gguf" => &["llama_cpp", "prefixed", "spm"],
        _ => &["llama_cpp", "gguf", "prefixed", "spm"],
    }
}

/// Whether `text` holds a token that Phi-3's file strips the whitespace after.
fn phi3_stripped(file: &str, text: &str) -> bool {
    file == "phi3-spm.gguf" && ["</s>", "<|"].iter().any(|token| text.contains(token))
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
fn spm_ggufs_tokenize_and_template_as_llama_cpp_transformers_and_sentencepiece() {
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
                if phi3_stripped(file, text) && *reference != "llama_cpp" {
                    continue;
                }
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
            let phi3 = file == "phi3-spm.gguf";
            for reference in references(file)
                .iter()
                .filter(|r| **r != "spm" && (!phi3 || **r == "llama_cpp"))
            {
                let theirs = ids(&recorded[reference]["chats"][i]);
                assert_eq!(ours, theirs, "{file} {reference}: {chat}");
            }
        }
    }
}

/// Decoding gives the text back: byte pieces joined into UTF-8, the space prefixed to the text
/// dropped. Gemma's texts, special tokens and all, decode as transformers' tokenizer of the file
/// decodes them; the other families' texts without special tokens too (with special tokens a space
/// is prefixed after each and decoded, or Phi-3's whitespace after them swallowed, as in llama.cpp).
#[test]
fn spm_ggufs_decode_to_their_texts() {
    let expected = expected();
    let texts = expected["texts"].as_array().unwrap();
    for file in FILES {
        let tokenizer = load_tokenizer(&converted(file)).unwrap();
        let decoded = &expected["files"][file]["gguf"]["decoded"];
        for (i, text) in texts.iter().enumerate() {
            let text = text.as_str().unwrap();
            let encoded = tokenizer.encode(text, false).unwrap();
            let ours = tokenizer.decode(encoded.get_ids(), false).unwrap();
            let special = ["<start_of_turn>", "<s>", "<|user|>"];
            let plain = !special.iter().any(|token| text.contains(token));
            let gemma = file == "gemma3-spm.gguf";
            if gemma {
                assert_eq!(ours, decoded[i].as_str().unwrap(), "{file}: {text:?}");
            }
            if gemma || plain {
                assert_eq!(ours, text, "{file}");
            }
        }
    }
}

/// llama.cpp's own Llama 2 and Phi-3 vocabularies (`models/ggml-vocab-{llama-spm,phi-3}.gguf`, 32,000
/// pieces, no merges): the ids its tokenizer test holds llama.cpp to on its 47 texts (no BOS, special
/// tokens as text: emoji and scripts outside the vocabulary in byte pieces, runs of spaces, tabs and
/// newlines, digits), which transformers' tokenizer prefixed as for Phi-3 gives too, and transformers'
/// own tokenizer of the file but on Llama's texts that start with a space; decoding gives each text
/// back.
#[test]
fn llama_cpps_own_sentencepiece_vocabularies_tokenize_as_llama_cpp() {
    let expected = expected();
    for (file, recorded) in expected["vocabularies"].as_object().unwrap() {
        let path = converted("vocab").join(file);
        let inputs = std::fs::read_to_string(path.with_extension("gguf.inp")).unwrap();
        let outputs = std::fs::read_to_string(path.with_extension("gguf.out")).unwrap();
        let texts: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
        let outputs: Vec<&str> = outputs.split('\n').collect();
        assert_eq!(texts.len(), outputs.len(), "{file}");
        let tokenizer = load_tokenizer(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
        for (i, (text, output)) in texts.iter().zip(outputs).enumerate() {
            let llama_cpp: Vec<u32> = output
                .split_whitespace()
                .map(|id| id.parse().unwrap())
                .collect();
            let ours = tokenizer.encode(*text, false).unwrap().get_ids().to_vec();
            assert_eq!(ours, llama_cpp, "{file} llama.cpp: {text:?}");
            assert_eq!(
                ours,
                ids(&recorded["prefixed"][i]),
                "{file} prefixed: {text:?}"
            );
            let transformers = ids(&recorded["gguf"][i]);
            let metaspace = file.contains("llama") && text.starts_with(' ');
            assert_eq!(ours == transformers, !metaspace, "{file} gguf: {text:?}");
            let decoded = tokenizer.decode(&ours, false).unwrap();
            assert_eq!(decoded, *text, "{file}");
        }
    }
}

/// Each file is its folder's model (the family fixture's weights): its config, transformers' logits
/// and llama.cpp's, and the sampler loads it.
#[test]
fn spm_ggufs_are_their_folders_models_with_transformers_and_llama_cpp_logits() {
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
        // llama.cpp's own logits (its CPU graph, keys and values cached in f32; Gemma's GELU goes through
        // llama.cpp's f16 table, 3.7e-3: `gguf_llama_cpp` bounds each file tightly). Not Phi-3's: llama.cpp
        // takes LongRoPE's long factors at every position once its context (128) passes the original
        // 64, where transformers and this runtime take the short ones for a sequence that fits in it.
        if file != "phi3-spm.gguf" {
            let difference = difference_to_transformers(&model, &recorded["llama_cpp"]["logits"]);
            eprintln!("{file}: max |Δlogit| {difference:e} against llama.cpp");
            assert!(difference <= 1e-2, "{file}: max |Δlogit| {difference}");
        }
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
