//! A GGUF file's tokenizer and chat template, as transformers builds them from its metadata (a
//! sentencepiece vocabulary's merges and spacing in `sentencepiece.rs`).

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::sentencepiece::{self, Spacing};
use super::Gguf;
use crate::error::LoadError;
use holo_core::chat::folder::FolderError;
use holo_core::chat::ChatTemplate;

/// Pre-tokenizer split regexes by `tokenizer.ggml.pre`, as transformers' `GGUF_PRE_TOKENIZER_SPLITS`.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

/// GPT-2's byte-to-character table: printable bytes stand for themselves, the others for 256 + n.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for byte in 0..=255u8 {
        let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[byte as usize] = if printable {
            char::from(byte)
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('\0')
        };
    }
    table
}

impl Gguf {
    /// The tokenizer of `tokenizer.ggml.*`, as transformers builds it from a GGUF file (a sentencepiece
    /// vocabulary's spaces prefixed as llama.cpp prefixes them, `sentencepiece.rs`).
    /// About the bytes of the `tokenizer.json` that [`Gguf::tokenizer`] builds from the file, read
    /// from the metadata without building it (a memory plan's tokenizer term): each token and merge
    /// as the JSON spells it, quoted with its id or pair; a vocabulary without merges gets about one
    /// recovered merge per piece.
    pub fn tokenizer_json_bytes(&self) -> Result<u64, LoadError> {
        let tokens = self.strings("tokenizer.ggml.tokens")?.unwrap_or_default();
        let spelled = |texts: &[&str], overhead: u64| -> u64 {
            texts.iter().map(|text| text.len() as u64 + overhead).sum()
        };
        // `"token": 12345,` and `["left", "right"],` in pretty-printed JSON.
        let merges = match self.strings("tokenizer.ggml.merges")? {
            Some(merges) => spelled(&merges, 16),
            None => spelled(&tokens, 16),
        };
        Ok(spelled(&tokens, 20) + merges)
    }

    pub fn tokenizer(&self) -> Result<Tokenizer, LoadError> {
        let fail = |message: String| {
            LoadError::Folder(FolderError::Tokenizer {
                file: self.path.clone(),
                message,
            })
        };
        let model = self
            .str_key("tokenizer.ggml.model")?
            .ok_or_else(|| fail("missing metadata `tokenizer.ggml.model`".into()))?;
        let byte_level = match model {
            "gpt2" => true,
            "llama" => false,
            other => {
                return Err(fail(format!(
                    "unsupported tokenizer {other:?} (`tokenizer.ggml.model`); supported: gpt2 \
                     (byte-level BPE), llama (sentencepiece BPE)"
                )))
            }
        };
        let tokens = self
            .strings("tokenizer.ggml.tokens")?
            .ok_or_else(|| fail("missing metadata `tokenizer.ggml.tokens`".into()))?;
        let token_types = self.token_types()?;
        if !token_types.is_empty() && token_types.len() != tokens.len() {
            return Err(fail(format!(
                "`tokenizer.ggml.token_type` has {} types for the {} tokens of \
                 `tokenizer.ggml.tokens`",
                token_types.len(),
                tokens.len()
            )));
        }
        let spacing = match byte_level {
            true => None,
            false => Some(Spacing::of(
                self.str_key("general.architecture")?.unwrap_or_default(),
                self.bool_key("tokenizer.ggml.add_space_prefix")?,
            )),
        };

        let spelling = bytes_to_unicode();
        let alphabet: std::collections::HashSet<char> = spelling.iter().copied().collect();
        let in_alphabet = |token: &str| token.chars().all(|c| alphabet.contains(&c));
        let spelled: Vec<Cow<str>> = tokens
            .iter()
            .map(|token| match spacing {
                None if !in_alphabet(token) => Cow::Owned(
                    token
                        .bytes()
                        .map(|byte| spelling[byte as usize])
                        .collect::<String>(),
                ),
                None => Cow::Borrowed(*token),
                Some(spacing) => spacing.spelling(token),
            })
            .collect();
        let merges: Vec<(String, String)> = match self.strings("tokenizer.ggml.merges")? {
            Some(merges) => merges
                .iter()
                .map(|merge| {
                    merge
                        .split_once(' ')
                        .map(|(left, right)| (left.to_string(), right.to_string()))
                        .ok_or_else(|| fail(format!("merge {merge:?} is not two tokens")))
                })
                .collect::<Result<_, _>>()?,
            None if byte_level => {
                return Err(fail("missing metadata `tokenizer.ggml.merges`".into()));
            }
            // Gemma's scores do not follow its merge order, its pieces' positions do (transformers'
            // `gemma_tokenizer`); the other families' scores do. A file without its scores is
            // refused either way: llama.cpp would merge by scores of 0, leftmost first.
            None => {
                let scores = self.scores(tokens.len())?;
                let priority = match spacing {
                    Some(Spacing::Gemma) => (0..tokens.len()).map(|id| -(id as f64)).collect(),
                    _ => scores,
                };
                sentencepiece::merges(&spelled, &priority)
            }
        };
        let mut vocab = serde_json::Map::new();
        for (id, token) in spelled.iter().enumerate() {
            vocab.insert(token.to_string(), id.into());
        }
        let mut added = Vec::new();
        let rstrip = match spacing {
            Some(_) => sentencepiece::phi3_rstrip(self.str_key("general.name")?),
            None => |_: &str| false,
        };
        let added_token = |id: usize, token: &str, special: bool| {
            json!({"id": id, "content": token, "single_word": false, "lstrip": false,
                   "rstrip": rstrip(token), "normalized": false, "special": special})
        };
        for (id, (token, kind)) in tokens.iter().zip(&token_types).enumerate() {
            // 3: CONTROL; a byte-level vocabulary spells every real token in its alphabet, so a
            // control token outside it is a mislabel (transformers skips those too).
            if *kind == 3 && (!byte_level || in_alphabet(token)) {
                added.push(added_token(id, token, true));
            }
        }
        for (id, (token, kind)) in tokens.iter().zip(&token_types).enumerate() {
            // 4: USER_DEFINED, matched whole in the text but not special.
            if *kind == 4 && vocab.contains_key(*token) {
                added.push(added_token(id, token, false));
            }
        }

        let add_bos = self
            .bool_key("tokenizer.ggml.add_bos_token")?
            .unwrap_or(!byte_level);
        let add_eos = self
            .bool_key("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false);
        let special = |key: &str| -> Result<Option<(String, u32)>, LoadError> {
            match self.token_id(key)? {
                None => Ok(None),
                Some(id) => tokens
                    .get(id as usize)
                    .map(|token| Some((token.to_string(), id)))
                    .ok_or_else(|| {
                        fail(format!(
                            "`tokenizer.ggml.{key}` is {id}, outside the {} tokens",
                            tokens.len()
                        ))
                    }),
            }
        };
        let bos = if add_bos {
            special("bos_token_id")?
        } else {
            None
        };
        let eos = if add_eos {
            special("eos_token_id")?
        } else {
            None
        };
        let post_processor = template_processing(bos.as_ref(), eos.as_ref());

        let (normalizer, pre_tokenizer, decoder, model) = match spacing {
            None => {
                let pre = self.str_key("tokenizer.ggml.pre")?.unwrap_or("default");
                let pre_tokenizer = match split_regex(pre) {
                    Some(regex) => json!({"type": "Sequence", "pretokenizers": [
                        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
                         "invert": false},
                        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                         "use_regex": false},
                    ]}),
                    None => json!({"type": "ByteLevel", "add_prefix_space": false,
                                   "trim_offsets": true, "use_regex": true}),
                };
                let decoder = json!({"type": "ByteLevel", "add_prefix_space": true,
                                     "trim_offsets": true, "use_regex": true});
                let model = json!({"type": "BPE", "dropout": null, "unk_token": null,
                                   "continuing_subword_prefix": "", "end_of_word_suffix": "",
                                   "fuse_unk": false, "byte_fallback": false,
                                   "ignore_merges": false, "vocab": vocab, "merges": merges});
                (Value::Null, pre_tokenizer, decoder, model)
            }
            Some(spacing) => {
                let (normalizer, pre_tokenizer, decoder) = spacing.parts();
                let model = json!({"type": "BPE", "dropout": null,
                                   "unk_token": spacing.unknown(),
                                   "continuing_subword_prefix": null, "end_of_word_suffix": null,
                                   "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                                   "vocab": vocab, "merges": merges});
                (normalizer, pre_tokenizer, decoder, model)
            }
        };
        let json = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor,
            "decoder": decoder,
            "model": model,
        });
        json.to_string()
            .parse::<Tokenizer>()
            .map_err(|error| fail(format!("cannot build the tokenizer: {error}")))
    }

    /// `bos_token`, `eos_token`, `unk_token` and `pad_token` as the chat template sees them.
    fn special_tokens(&self) -> Result<BTreeMap<String, String>, LoadError> {
        let tokens = self.strings("tokenizer.ggml.tokens")?.unwrap_or_default();
        let mut special = BTreeMap::new();
        for (name, key) in [
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        ] {
            if let Some(token) = self.token_id(key)?.and_then(|id| tokens.get(id as usize)) {
                special.insert(name.to_string(), token.to_string());
            }
        }
        Ok(special)
    }

    /// The chat template of `tokenizer.chat_template`, or ChatML when the file has none.
    pub fn template(&self) -> Result<ChatTemplate, LoadError> {
        let special = self.special_tokens()?;
        match self.str_key("tokenizer.chat_template")? {
            Some(source) => ChatTemplate::from_source(
                source,
                format!("{} (tokenizer.chat_template)", self.path.display()),
                special,
            ),
            None => {
                let chatml = ChatTemplate::chatml();
                let mut tokens = BTreeMap::new();
                if let Some(eos) = chatml.special_token("eos_token") {
                    tokens.insert("eos_token".to_string(), eos.to_string());
                }
                tokens.extend(special);
                chatml.with_special_tokens(tokens)
            }
        }
        .map_err(|error| LoadError::Folder(FolderError::Template(error)))
    }
}

/// transformers' `TemplateProcessing`: `[bos] $A [eos]`, `[bos] $A [eos] [bos] $B [eos]`.
fn template_processing(
    bos: Option<&(String, u32)>,
    eos: Option<&(String, u32)>,
) -> serde_json::Value {
    let special = |token: &(String, u32), type_id: u32| json!({"SpecialToken": {"id": token.0, "type_id": type_id}});
    let sequence = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    for (id, type_id) in [("A", 0), ("B", 1)] {
        let mut part = Vec::new();
        part.extend(bos.map(|token| special(token, type_id)));
        part.push(sequence(id, type_id));
        part.extend(eos.map(|token| special(token, type_id)));
        if id == "A" {
            single = part.clone();
        }
        pair.extend(part);
    }
    let mut special_tokens = serde_json::Map::new();
    for (token, id) in bos.into_iter().chain(eos) {
        special_tokens.insert(
            token.clone(),
            json!({"id": token, "ids": [id], "tokens": [token]}),
        );
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair,
           "special_tokens": special_tokens})
}
