//! SFT data: a JSONL file in one of TRL's dataset formats, tokenized as TRL 1.16's `SFTTrainer` prepares
//! it (`_prepare_dataset`), into token ids and the positions trained (TRL's labels that are not -100).
//!
//! A row is one JSON object, every row of a file in the same format:
//! - `{"messages": [...]}` (conversational language modeling): the conversation rendered by the model's
//!   chat template and tokenized without special tokens; every token is trained, or with
//!   `assistant_only_loss` only those the template's `{% generation %}` blocks wrote (transformers'
//!   `return_assistant_tokens_mask`: the tokens from the one holding a block's first character to the one
//!   holding its last).
//! - `{"prompt": [...], "completion": [...]}` (conversational prompt-completion): the prompt rendered with
//!   the generation prompt and the whole conversation rendered, both tokenized; the completion starts
//!   where their ids first differ. With `completion_only_loss` (unset: on for this format) only the
//!   completion is trained; with `assistant_only_loss` only the assistant blocks (both: their overlap).
//! - `{"text": "..."}` and `{"prompt": "...", "completion": "..."}` (standard): the text (or the
//!   completion) gets `eos_token` appended when it does not end with it, and is tokenized with the
//!   tokenizer's special tokens (a BOS where its post-processor adds one); the prompt-completion split is
//!   the same as above.
//! - `{"input_ids": [...]}` (pre-tokenized, as `holo export-data --tokens` writes): the ids as they are;
//!   `assistant_masks` (0/1 per id) always applies, `completion_mask` with `completion_only_loss`.
//!
//! A row may carry `tools` (a list of JSON schemas, or their JSON text) for the template. Rows longer than
//! `max_length` are cut (`truncation_mode`), and an example left with nothing trained is then dropped, as
//! TRL drops it. A row TRL would refuse (a `labels` column, assistant masks of nothing) is an error naming
//! its line and key.

use std::path::Path;

use minijinja::Value;
use serde_json::{Map, Value as Json};
use tokenizers::{Encoding, Tokenizer};

use super::config::{SftConfig, TruncationMode};
use crate::batch::Sequence;
use holo_core::chat::{ChatTemplate, RenderOptions};

/// A tokenized example: its token ids and which are trained.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// The 1-based line of the file it came from.
    pub line: usize,
    pub ids: Vec<u32>,
    /// 1 where the token is trained (TRL's label is the id), 0 where it is not (-100).
    pub mask: Vec<u8>,
}

impl Example {
    /// The example as the scorer takes it: trained positions from 1 on (the first token predicts nothing).
    pub fn sequence(&self) -> Sequence {
        let trained: Vec<usize> = self
            .mask
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, &bit)| bit != 0)
            .map(|(position, _)| position)
            .collect();
        Sequence {
            sampling_logprobs: vec![f32::NAN; trained.len()],
            ids: self.ids.clone(),
            trained,
            routes: None,
            constraints: Default::default(),
        }
    }

    /// Tokens whose loss is taken (TRL counts `labels[..., 1:] != -100`).
    pub fn trained_tokens(&self) -> usize {
        self.mask.iter().skip(1).filter(|&&bit| bit != 0).count()
    }
}

/// A file's examples and what was left out.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    pub examples: Vec<Example>,
    /// Lines of examples dropped because truncation left nothing trained.
    pub dropped: Vec<usize>,
    /// Whether the completion-only loss applied (the option, or the format's default).
    pub completion_only_loss: bool,
}

/// The format of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Messages,
    ConversationalPromptCompletion,
    Text,
    PromptCompletion,
    Tokens,
}

impl Format {
    fn of(row: &Map<String, Json>) -> Result<Self, String> {
        if row.contains_key("labels") {
            return Err(
                "has `labels`: give `input_ids` with `assistant_masks` (or `completion_mask`) instead"
                    .into(),
            );
        }
        if row.contains_key("input_ids") {
            return Ok(Format::Tokens);
        }
        if row.contains_key("messages") {
            return Ok(Format::Messages);
        }
        match (row.get("prompt"), row.get("completion")) {
            (Some(Json::Array(_)), Some(Json::Array(_))) => {
                return Ok(Format::ConversationalPromptCompletion)
            }
            (Some(Json::String(_)), Some(Json::String(_))) => return Ok(Format::PromptCompletion),
            (Some(_), Some(_)) => {
                return Err(
                    "`prompt` and `completion` must both be lists of messages or both be strings"
                        .into(),
                )
            }
            (Some(_), None) => return Err("has `prompt` but no `completion`".into()),
            (None, Some(_)) => return Err("has `completion` but no `prompt`".into()),
            (None, None) => {}
        }
        if row.contains_key("text") {
            return Ok(Format::Text);
        }
        let keys: Vec<&str> = row.keys().map(String::as_str).collect();
        Err(format!(
            "expected `messages`, `prompt` and `completion`, `text`, or `input_ids`; found keys {keys:?}"
        ))
    }

    fn name(self) -> &'static str {
        match self {
            Format::Messages => "`messages`",
            Format::ConversationalPromptCompletion => "`prompt`/`completion` messages",
            Format::Text => "`text`",
            Format::PromptCompletion => "`prompt`/`completion` strings",
            Format::Tokens => "`input_ids`",
        }
    }
}

/// What tokenizing needs: the model's tokenizer and chat template, and the options.
pub struct Tokenizing<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: &'a ChatTemplate,
    /// The model's vocabulary size (pre-tokenized ids must be below it).
    pub vocab_size: usize,
    pub config: &'a SftConfig,
}

impl Tokenizing<'_> {
    /// Reads and tokenizes the JSONL file at `path` (see the [module documentation](self)). Every bad row
    /// is an error naming the file, its line and the key (or column) at fault.
    pub fn read(&self, path: &Path) -> Result<Dataset, String> {
        let name = path.display();
        let text = std::fs::read_to_string(path)
            .map_err(|error| format!("cannot read `{name}`: {error}"))?;
        self.parse(&text)
            .map_err(|message| format!("`{name}` {message}"))
    }

    /// [`Tokenizing::read`] on the file's text; errors start with `line N`.
    pub fn parse(&self, text: &str) -> Result<Dataset, String> {
        let config = self.config;
        let mut first: Option<(usize, Format)> = None;
        let mut completion_only = config.completion_only_loss.unwrap_or(false);
        let mut examples = Vec::new();
        let mut dropped = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let number = index + 1;
            if line.trim().is_empty() {
                continue;
            }
            let at = |message: String| format!("line {number}: {message}");
            let row: Map<String, Json> = serde_json::from_str(line).map_err(|error| {
                format!(
                    "line {number}, column {}: not a JSON object: {error}",
                    error.column()
                )
            })?;
            let format = Format::of(&row).map_err(at)?;
            match first {
                None => {
                    first = Some((number, format));
                    // TRL decides from the first example: on for prompt/completion data.
                    completion_only = config
                        .completion_only_loss
                        .unwrap_or(row.contains_key("prompt") && row.contains_key("completion"));
                    if config.assistant_only_loss
                        && matches!(format, Format::Text | Format::PromptCompletion)
                    {
                        return Err(at(format!(
                            "`assistant_only_loss` needs conversations (`messages`, or `prompt` and `completion` as messages), not {}",
                            format.name()
                        )));
                    }
                }
                Some((line, expected)) if expected != format => {
                    return Err(at(format!(
                        "is {} but line {line} is {}: every row of a file has the same format",
                        format.name(),
                        expected.name()
                    )));
                }
                Some(_) => {}
            }
            let (ids, mask) = self.tokenize(&row, format, completion_only).map_err(at)?;
            let (ids, mask) = match config.max_length {
                Some(max) if ids.len() > max => match config.truncation_mode {
                    TruncationMode::KeepStart => (ids[..max].to_vec(), mask[..max].to_vec()),
                    TruncationMode::KeepEnd => {
                        let from = ids.len() - max;
                        (ids[from..].to_vec(), mask[from..].to_vec())
                    }
                },
                _ => (ids, mask),
            };
            if config.max_length.is_some() && !mask.contains(&1) {
                dropped.push(number);
                continue;
            }
            examples.push(Example {
                line: number,
                ids,
                mask,
            });
        }
        if first.is_none() {
            return Err("has no rows".into());
        }
        Ok(Dataset {
            examples,
            dropped,
            completion_only_loss: completion_only,
        })
    }

    /// One row's ids and trained mask, before truncation.
    fn tokenize(
        &self,
        row: &Map<String, Json>,
        format: Format,
        completion_only: bool,
    ) -> Result<(Vec<u32>, Vec<u8>), String> {
        let assistant_only = self.config.assistant_only_loss;
        let (ids, masks) = match format {
            Format::Tokens => return self.pretokenized(row, completion_only),
            Format::Messages => {
                let messages = messages(row, "messages")?;
                let (ids, assistant) = self.conversation(messages, row, assistant_only)?;
                (ids, assistant.into_iter().collect::<Vec<_>>())
            }
            Format::ConversationalPromptCompletion => {
                let prompt = messages(row, "prompt")?;
                let completion = messages(row, "completion")?;
                let options = self.options(row)?;
                let prompt_ids = self.encode(
                    &self.render(
                        prompt.clone(),
                        &RenderOptions {
                            add_generation_prompt: true,
                            ..options
                        },
                    )?,
                    false,
                )?;
                let mut whole = prompt;
                whole.extend(completion);
                let (ids, assistant) = self.conversation(whole, row, assistant_only)?;
                let completion = completion_only.then(|| split_mask(&prompt_ids, &ids));
                (ids, completion.into_iter().chain(assistant).collect())
            }
            Format::Text => {
                let text = string(row, "text")?;
                let ids = self.encode(&format!("{text}{}", self.eos_suffix(text)?), true)?;
                (ids, Vec::new())
            }
            Format::PromptCompletion => {
                let prompt = string(row, "prompt")?;
                let completion = string(row, "completion")?;
                let completion = format!("{completion}{}", self.eos_suffix(completion)?);
                let prompt_ids = self.encode(prompt, true)?;
                let ids = self.encode(&format!("{prompt}{completion}"), true)?;
                let masks = if completion_only {
                    vec![split_mask(&prompt_ids, &ids)]
                } else {
                    Vec::new()
                };
                (ids, masks)
            }
        };
        let mask = (0..ids.len())
            .map(|position| masks.iter().all(|mask| mask[position] != 0) as u8)
            .collect();
        Ok((ids, mask))
    }

    /// A pre-tokenized row: `input_ids`, `assistant_masks` (always applied) and `completion_mask` (applied
    /// with the completion-only loss).
    fn pretokenized(
        &self,
        row: &Map<String, Json>,
        completion_only: bool,
    ) -> Result<(Vec<u32>, Vec<u8>), String> {
        let ids: Vec<u32> = numbers(row, "input_ids")?
            .into_iter()
            .enumerate()
            .map(|(index, id)| {
                if (id as usize) < self.vocab_size {
                    Ok(id as u32)
                } else {
                    Err(format!(
                        "`input_ids`[{index}]: {id} is not below the model's vocabulary size {}",
                        self.vocab_size
                    ))
                }
            })
            .collect::<Result<_, _>>()?;
        if ids.is_empty() {
            return Err("`input_ids` is empty".into());
        }
        let mut mask = vec![1u8; ids.len()];
        let mut apply = |key: &str| -> Result<(), String> {
            if !row.contains_key(key) {
                return Ok(());
            }
            let bits = numbers(row, key)?;
            if bits.len() != ids.len() {
                return Err(format!(
                    "`{key}` has {} values for {} `input_ids`",
                    bits.len(),
                    ids.len()
                ));
            }
            for (index, (&bit, slot)) in bits.iter().zip(mask.iter_mut()).enumerate() {
                if bit > 1 {
                    return Err(format!("`{key}`[{index}]: {bit} is not 0 or 1"));
                }
                *slot &= bit as u8;
            }
            Ok(())
        };
        apply("assistant_masks")?;
        if completion_only {
            apply("completion_mask")?;
        }
        Ok((ids, mask))
    }

    /// A conversation's ids, and, with `assistant_only`, its assistant mask (an error when it is all 0, as
    /// in TRL).
    fn conversation(
        &self,
        messages: Vec<Value>,
        row: &Map<String, Json>,
        assistant_only: bool,
    ) -> Result<(Vec<u32>, Option<Vec<u8>>), String> {
        let options = self.options(row)?;
        if !assistant_only {
            let ids = self.encode(&self.render(messages, &options)?, false)?;
            return Ok((ids, None));
        }
        if !self.template.has_generation_blocks(&options) {
            return Err(
                "`assistant_only_loss` needs a chat template with `{% generation %}` blocks around the \
                 assistant's turns, and the model's has none (TRL swaps in its own training template for \
                 some models; add the blocks to the model's chat template)"
                    .into(),
            );
        }
        let rendered = self
            .template
            .render_tracked(messages, &options)
            .map_err(|error| format!("the chat template: {error}"))?;
        let encoding = self.encoding(&rendered.text, false)?;
        let mask = assistant_mask(&encoding, &rendered.text, &rendered.generation);
        if !mask.contains(&1) {
            return Err(
                "`assistant_only_loss`: the chat template marks no assistant tokens in this row"
                    .into(),
            );
        }
        Ok((encoding.get_ids().to_vec(), Some(mask)))
    }

    fn options(&self, row: &Map<String, Json>) -> Result<RenderOptions, String> {
        let tools = match row.get("tools") {
            None | Some(Json::Null) => None,
            Some(Json::String(text)) => Some(
                serde_json::from_str::<Json>(text)
                    .map_err(|error| format!("`tools` is not JSON: {error}"))?,
            ),
            Some(tools) => Some(tools.clone()),
        };
        let tools = match tools {
            None => None,
            Some(Json::Array(tools)) => Some(tools.iter().map(template_value).collect()),
            Some(_) => return Err("`tools` is not a list".into()),
        };
        Ok(RenderOptions {
            tools,
            ..RenderOptions::default()
        })
    }

    fn render(&self, messages: Vec<Value>, options: &RenderOptions) -> Result<String, String> {
        self.template
            .render_values(messages, options)
            .map_err(|error| format!("the chat template: {error}"))
    }

    fn encoding(&self, text: &str, special_tokens: bool) -> Result<Encoding, String> {
        self.tokenizer
            .encode_char_offsets(text, special_tokens)
            .map_err(|error| format!("the tokenizer: {error}"))
    }

    fn encode(&self, text: &str, special_tokens: bool) -> Result<Vec<u32>, String> {
        Ok(self.encoding(text, special_tokens)?.get_ids().to_vec())
    }

    /// What a standard row's text is missing of the end-of-sequence token.
    fn eos_suffix(&self, text: &str) -> Result<String, String> {
        let eos = match &self.config.eos_token {
            Some(eos) => eos.as_str(),
            None => self.template.special_token("eos_token").ok_or(
                "the model has no `eos_token` to end the text with; set the `eos_token` option",
            )?,
        };
        Ok(if text.ends_with(eos) {
            String::new()
        } else {
            eos.to_string()
        })
    }
}

/// TRL's completion mask: 0 on the ids the prompt alone shares with the whole (`common_prefix_length`),
/// 1 after.
fn split_mask(prompt: &[u32], whole: &[u32]) -> Vec<u8> {
    let shared = prompt.iter().zip(whole).take_while(|(a, b)| a == b).count();
    (0..whole.len()).map(|i| (i >= shared) as u8).collect()
}

/// transformers' assistant mask: for each span (bytes of `text`), the tokens from the one holding its
/// first character to the one holding its last (to the end when that one is unknown or the first token);
/// a span whose first character no token holds ends the marking.
pub fn assistant_mask(
    encoding: &Encoding,
    text: &str,
    spans: &[std::ops::Range<usize>],
) -> Vec<u8> {
    let count = encoding.get_ids().len();
    let mut mask = vec![0u8; count];
    let chars = |byte: usize| text[..byte].chars().count();
    for span in spans {
        let (start, end) = (chars(span.start), chars(span.end));
        let Some(first) = encoding.char_to_token(start, 0) else {
            break;
        };
        let last = end
            .checked_sub(1)
            .and_then(|last| encoding.char_to_token(last, 0));
        let stop = match last {
            Some(last) if last != 0 => last + 1,
            _ => count,
        };
        for slot in mask.iter_mut().take(stop).skip(first) {
            *slot = 1;
        }
    }
    mask
}

/// A JSON value as the template sees it (an object's keys in sorted order, as serde_json keeps them; a
/// template that iterates over a message's fields sees them in that order).
fn template_value(json: &Json) -> Value {
    serde::Deserialize::deserialize(json.clone()).unwrap_or_default()
}

fn string<'r>(row: &'r Map<String, Json>, key: &str) -> Result<&'r str, String> {
    row.get(key)
        .and_then(Json::as_str)
        .ok_or_else(|| format!("`{key}` is not a string"))
}

fn numbers(row: &Map<String, Json>, key: &str) -> Result<Vec<u64>, String> {
    let Some(Json::Array(values)) = row.get(key) else {
        return Err(format!("`{key}` is not a list of whole numbers"));
    };
    values
        .iter()
        .enumerate()
        .map(|(index, value)| {
            value
                .as_u64()
                .ok_or_else(|| format!("`{key}`[{index}]: {value} is not a whole number ≥ 0"))
        })
        .collect()
}

/// A list of messages: objects with a string `role` (every field reaches the template).
fn messages(row: &Map<String, Json>, key: &str) -> Result<Vec<Value>, String> {
    let Some(Json::Array(list)) = row.get(key) else {
        return Err(format!("`{key}` is not a list of messages"));
    };
    if list.is_empty() {
        return Err(format!("`{key}` is empty"));
    }
    list.iter()
        .enumerate()
        .map(|(index, message)| {
            let Json::Object(fields) = message else {
                return Err(format!("`{key}`[{index}] is not an object"));
            };
            if !fields.get("role").is_some_and(Json::is_string) {
                return Err(format!("`{key}`[{index}] has no string `role`"));
            }
            Ok(template_value(message))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use holo_model::init::build_tokenizer;

    fn config(assistant_only_loss: bool) -> SftConfig {
        SftConfig {
            assistant_only_loss,
            ..SftConfig::default()
        }
    }

    fn parse(config: &SftConfig, template: &ChatTemplate, text: &str) -> Result<Dataset, String> {
        let tokenizer = build_tokenizer().unwrap();
        Tokenizing {
            tokenizer: &tokenizer,
            template,
            vocab_size: 512,
            config,
        }
        .parse(text)
    }

    fn trained_text(example: &Example) -> String {
        let tokenizer = build_tokenizer().unwrap();
        let ids: Vec<u32> = example
            .ids
            .iter()
            .zip(&example.mask)
            .filter(|(_, &bit)| bit == 1)
            .map(|(&id, _)| id)
            .collect();
        tokenizer.decode(&ids, false).unwrap()
    }

    const MARKED: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n\
        {% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\
        {% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn prompt_completion_trains_the_completion_and_messages_everything() {
        let template = ChatTemplate::chatml();
        let prompt = r#"{"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}"#;
        let data = parse(&config(false), &template, prompt).unwrap();
        assert!(data.completion_only_loss);
        assert_eq!(trained_text(&data.examples[0]), "4<|im_end|>\n");
        let all = SftConfig {
            completion_only_loss: Some(false),
            ..config(false)
        };
        let data = parse(&all, &template, prompt).unwrap();
        assert_eq!(data.examples[0].mask.iter().filter(|&&b| b == 0).count(), 0);
        let messages = r#"{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}"#;
        let data = parse(&config(false), &template, messages).unwrap();
        assert!(!data.completion_only_loss);
        assert!(data.examples[0].mask.iter().all(|&b| b == 1));
    }

    #[test]
    fn assistant_only_loss_trains_the_generation_blocks() {
        let template = ChatTemplate::from_source(MARKED, "t.jinja", Default::default()).unwrap();
        let row = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "and?"}, {"role": "assistant", "content": "ok"}]}"#;
        let data = parse(&config(true), &template, row).unwrap();
        assert_eq!(trained_text(&data.examples[0]), "yo<|im_end|>ok<|im_end|>");
        let error = parse(&config(true), &ChatTemplate::chatml(), row).unwrap_err();
        assert!(
            error.starts_with("line 1: `assistant_only_loss` needs a chat template"),
            "{error}"
        );
        let error = parse(&config(true), &template, r#"{"text": "hello"}"#).unwrap_err();
        assert!(error.contains("needs conversations"), "{error}");
    }

    #[test]
    fn text_rows_end_with_the_eos_token_and_long_rows_are_cut() {
        let template = ChatTemplate::chatml();
        let data = parse(&config(false), &template, r#"{"text": "hello"}"#).unwrap();
        assert_eq!(trained_text(&data.examples[0]), "hello<|im_end|>");
        let short = SftConfig {
            max_length: Some(2),
            truncation_mode: TruncationMode::KeepEnd,
            ..config(false)
        };
        let data = parse(&short, &template, r#"{"text": "hello there"}"#).unwrap();
        assert_eq!(data.examples[0].ids.len(), 2);
        assert_eq!(
            *data.examples[0].ids.last().unwrap(),
            build_tokenizer()
                .unwrap()
                .token_to_id("<|im_end|>")
                .unwrap()
        );
        // A prompt filling max_length leaves nothing trained: the example is dropped.
        let tiny = SftConfig {
            max_length: Some(1),
            ..config(false)
        };
        let data = parse(
            &tiny,
            &template,
            r#"{"prompt": "a long prompt", "completion": "x"}"#,
        )
        .unwrap();
        assert_eq!((data.examples.len(), data.dropped.clone()), (0, vec![1]));
    }

    #[test]
    fn pretokenized_rows_keep_their_ids_and_masks() {
        let template = ChatTemplate::chatml();
        let row = r#"{"messages": [], "input_ids": [5, 6, 7, 8], "assistant_masks": [0, 1, 1, 0], "completion_mask": [0, 0, 1, 1]}"#;
        let data = parse(&config(false), &template, row).unwrap();
        assert_eq!(data.examples[0].ids, [5, 6, 7, 8]);
        assert_eq!(data.examples[0].mask, [0, 1, 1, 0]);
        let both = SftConfig {
            completion_only_loss: Some(true),
            ..config(false)
        };
        let data = parse(&both, &template, row).unwrap();
        assert_eq!(data.examples[0].mask, [0, 0, 1, 0]);
        assert_eq!(data.examples[0].sequence().trained, [2]);
    }

    #[test]
    fn bad_rows_are_named_by_line_and_key() {
        let template = ChatTemplate::chatml();
        let error = |text: &str| parse(&config(false), &template, text).unwrap_err();
        let good = r#"{"text": "a"}"#;
        assert_eq!(
            error(&format!("{good}\n\n{{\"text\": 1}}")),
            "line 3: `text` is not a string"
        );
        assert!(error(&format!("{good}\n{{\"text\": ")).starts_with("line 2, column"));
        assert!(error(r#"{"question": "a"}"#).starts_with("line 1: expected `messages`"));
        assert_eq!(
            error(&format!(
                "{good}\n{{\"messages\": [{{\"role\": \"user\", \"content\": \"a\"}}]}}"
            )),
            "line 2: is `messages` but line 1 is `text`: every row of a file has the same format"
        );
        assert_eq!(
            error(r#"{"messages": [{"content": "a"}]}"#),
            "line 1: `messages`[0] has no string `role`"
        );
        assert_eq!(
            error(r#"{"input_ids": [1, 900]}"#),
            "line 1: `input_ids`[1]: 900 is not below the model's vocabulary size 512"
        );
        assert_eq!(
            error(r#"{"input_ids": [1, 2], "assistant_masks": [1]}"#),
            "line 1: `assistant_masks` has 1 values for 2 `input_ids`"
        );
        assert!(error(r#"{"input_ids": [1], "labels": [1]}"#).starts_with("line 1: has `labels`"));
        assert_eq!(error(""), "has no rows");
    }
}
