//! Sentencepiece vocabularies (`tokenizer.ggml.model` `llama`), as llama.cpp's converter writes every
//! Gemma, Llama 2, Mistral 7B v0.1 and Phi-3 file: tokens, scores and token types, the 256 `<0xXX>`
//! byte pieces, and no merges. transformers' GGUF loader (`gguf_tokenizer_mapping.py`) recovers the
//! merges from the vocabulary (`generate_merges`: every split of a piece into two pieces, best piece
//! first) and builds each family's tokenizer class around them; this is the same, spaces prefixed as
//! llama.cpp prefixes them (where transformers' Llama class does not, [`Spacing`]). Its BPE merges
//! the adjacent pair whose piece ranks best, as llama.cpp's `llm_tokenizer_spm` merges the pair whose
//! piece has the highest score, and falls back to byte pieces as it does.

use std::borrow::Cow;
use std::collections::HashMap;

use serde_json::{json, Value};

use super::Gguf;
use crate::error::LoadError;

/// How a family's text becomes `▁`-spelled pieces and back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Spacing {
    /// Gemma (`GemmaTokenizer`): every space is `▁`, nothing is prefixed (llama.cpp's converter writes
    /// `add_space_prefix` false for every Gemma), and merges rank by position, not score, as
    /// transformers ranks them (llama.cpp ranks by score: the two agree where the scores follow the
    /// positions, as a sentencepiece BPE model's do; Gemma 4's vocabulary has every score -1000).
    Gemma,
    /// The others (Llama 2, Mistral, Phi-3): every space is `▁`, and, when `prefix`, one `▁` before
    /// each stretch of text between added tokens, so `" hi"` is `▁▁hi`: llama.cpp's
    /// `llm_tokenizer_spm` session (`add_space_prefix`, a space before the text and after each special
    /// token), sentencepiece's dummy prefix, and Llama 2's and Phi-3's own `tokenizer.json`
    /// (`Prepend` then `Replace`). transformers builds Phi-3 files so, but Llama files with
    /// `Metaspace`, which prefixes nothing to a text that starts with a space nor after a special
    /// token: there it departs from llama.cpp's ids (15 of the 47 texts of llama.cpp's own test of
    /// Llama 2's vocabulary, all starting with a space).
    Prefixed { prefix: bool },
}

impl Spacing {
    /// The spacing of `architecture`'s files: a space prefixed unless `tokenizer.ggml.add_space_prefix`
    /// is false (llama.cpp's default for a sentencepiece vocabulary is true).
    pub(super) fn of(architecture: &str, add_space_prefix: Option<bool>) -> Self {
        match architecture {
            "gemma" | "gemma2" | "gemma3" => Spacing::Gemma,
            _ => Spacing::Prefixed {
                prefix: add_space_prefix.unwrap_or(true),
            },
        }
    }

    /// How the vocabulary spells `token`: Gemma files store the pieces of two or more spaces with real
    /// spaces, which its tokenizer looks up as `▁▁` (transformers' `gemma_tokenizer` respells them).
    pub(super) fn spelling(self, token: &str) -> Cow<'_, str> {
        // Python's `str.strip()`, whose whitespace has the separators U+001C–U+001F too.
        let blank = |c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c);
        match self {
            Spacing::Gemma if token.contains(' ') && token.chars().all(blank) => {
                Cow::Owned("\u{2581}".repeat(token.chars().count()))
            }
            _ => Cow::Borrowed(token),
        }
    }

    /// The tokenizer's normalizer, pre-tokenizer and decoder (`tokenizers`' JSON).
    pub(super) fn parts(self) -> (Value, Value, Value) {
        let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        // The space the prefix added is dropped from the decoded text's start.
        let strip = json!({"type": "Strip", "content": " ", "start": 1, "stop": 0});
        match self {
            Spacing::Gemma => {
                let split = json!({"type": "Split", "pattern": {"String": " "},
                                   "behavior": "MergedWithPrevious", "invert": false});
                (
                    replace,
                    split,
                    json!({"type": "Sequence", "decoders": decoders}),
                )
            }
            Spacing::Prefixed { prefix } => {
                let mut normalizers = vec![replace];
                if prefix {
                    normalizers.insert(0, json!({"type": "Prepend", "prepend": "\u{2581}"}));
                    decoders.push(strip);
                }
                (
                    json!({"type": "Sequence", "normalizers": normalizers}),
                    Value::Null,
                    json!({"type": "Sequence", "decoders": decoders}),
                )
            }
        }
    }

    /// The BPE model's unknown token: transformers' `GemmaTokenizer` names `<unk>`, its `LlamaTokenizer`
    /// none (every byte has its piece).
    pub(super) fn unknown(self) -> Option<&'static str> {
        match self {
            Spacing::Gemma => Some("<unk>"),
            _ => None,
        }
    }
}

impl Gguf {
    /// `tokenizer.ggml.scores`, one per token, as the merges of a vocabulary without them need.
    pub(super) fn scores(&self, tokens: usize) -> Result<Vec<f64>, LoadError> {
        let key = "tokenizer.ggml.scores";
        let Some(value) = self.value(key) else {
            return Err(self.config_error(format!(
                "missing metadata `{key}` (a sentencepiece vocabulary without \
                 `tokenizer.ggml.merges` is merged by its pieces' scores)"
            )));
        };
        let invalid = || self.config_error(format!("metadata `{key}` must be a list of numbers"));
        let candle_core::quantized::gguf_file::Value::Array(items) = value else {
            return Err(invalid());
        };
        let scores: Vec<f64> = items
            .iter()
            .map(|item| item.to_f32().map(f64::from).or_else(|_| item.to_f64()))
            .collect::<Result<_, _>>()
            .map_err(|_| invalid())?;
        if scores.len() != tokens {
            return Err(self.config_error(format!(
                "metadata `{key}` has {} scores for the {tokens} tokens of `tokenizer.ggml.tokens`",
                scores.len()
            )));
        }
        Ok(scores)
    }
}

/// Which added tokens swallow the whitespace after them, as llama.cpp marks them `RSTRIP` in a model
/// whose `general.name` says Phi-3 (`phi-3` or `phi3`, in any case): every one but `<unk>`, `<s>` and
/// `<|endoftext|>`, as Phi-3's own `tokenizer.json` has them (`"rstrip": true`); none in any other
/// file. transformers' GGUF loading strips nothing.
pub(super) fn phi3_rstrip(name: Option<&str>) -> fn(&str) -> bool {
    let name = name.unwrap_or_default().to_lowercase();
    match name.contains("phi-3") || name.contains("phi3") {
        true => |token| !matches!(token, "<unk>" | "<s>" | "<|endoftext|>"),
        false => |_| false,
    }
}

/// transformers' `generate_merges`: each piece's splits into two pieces of the vocabulary (ordered by
/// the halves' ids), all of them ordered best first by the piece's `priority`, then longer left half,
/// then longer right half, ties kept in vocabulary order. `vocab` is the vocabulary as spelled, one
/// entry per id; a piece listed twice counts once, with its last id and priority (a Python dict's).
pub(super) fn merges(vocab: &[Cow<'_, str>], priority: &[f64]) -> Vec<(String, String)> {
    let ids: HashMap<&str, usize> = vocab
        .iter()
        .enumerate()
        .map(|(id, piece)| (piece.as_ref(), id))
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    for piece in vocab {
        let piece = piece.as_ref();
        if !seen.insert(piece) {
            continue;
        }
        let score = priority[ids[piece]];
        let mut splits: Vec<(&str, &str, f64)> = piece
            .char_indices()
            .skip(1)
            .map(|(at, _)| piece.split_at(at))
            .filter(|(left, right)| ids.contains_key(left) && ids.contains_key(right))
            .map(|(left, right)| (left, right, score))
            .collect();
        splits.sort_by_key(|(left, right, _)| (ids[left], ids[right]));
        merges.extend(splits);
    }
    let chars = |text: &str| text.chars().count();
    merges.sort_by(|a, b| {
        b.2.total_cmp(&a.2)
            .then_with(|| chars(b.0).cmp(&chars(a.0)))
            .then_with(|| chars(b.1).cmp(&chars(a.1)))
    });
    merges
        .into_iter()
        .map(|(left, right, _)| (left.to_string(), right.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spelled(pieces: &[&'static str]) -> Vec<Cow<'static, str>> {
        pieces.iter().map(|piece| Cow::Borrowed(*piece)).collect()
    }

    /// The best-scored piece's merge comes first, whatever its id; a piece with two splits gives both,
    /// the longer left half first at equal score.
    #[test]
    fn merges_are_ordered_by_their_pieces_score_then_the_halves_lengths() {
        let vocab = spelled(&["a", "b", "c", "ab", "bc", "abc"]);
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let pairs = |merges: Vec<(String, String)>| -> Vec<String> {
            merges
                .into_iter()
                .map(|(l, r)| format!("{l} {r}"))
                .collect()
        };
        assert_eq!(
            pairs(merges(&vocab, &scores)),
            ["b c", "a b", "ab c", "a bc"]
        );
    }

    /// Gemma's pieces of spaces, stored with real spaces, are spelled with `▁` as its tokenizer looks
    /// them up; other families keep them, and other pieces stay as they are. A file named Phi-3 strips
    /// the whitespace after its added tokens but `<s>`, `<unk>` and `<|endoftext|>`; others none.
    #[test]
    fn gemma_respells_its_pieces_of_spaces_and_phi3_strips_after_its_added_tokens() {
        assert_eq!(Spacing::Gemma.spelling("  "), "\u{2581}\u{2581}");
        assert_eq!(Spacing::Gemma.spelling(" \n"), "\u{2581}\u{2581}");
        assert_eq!(Spacing::Gemma.spelling("\n\n"), "\n\n");
        assert_eq!(Spacing::Gemma.spelling("a b"), "a b");
        let phi3 = phi3_rstrip(Some("Phi3"));
        assert!(phi3("<|end|>") && phi3("</s>") && !phi3("<s>") && !phi3("<|endoftext|>"));
        assert!(!phi3_rstrip(Some("Llama 2"))("<|end|>") && !phi3_rstrip(None)("</s>"));
        let llama = Spacing::of("llama", None);
        assert_eq!(llama, Spacing::Prefixed { prefix: true });
        assert_eq!(llama.spelling("  "), "  ");
    }
}
