//! Rollouts as datasets for other trainers (`holo export-data`): the JSONL shapes TRL's `SFTTrainer` and
//! `DPOTrainer` read.
//!
//! - [`read_rollouts`] reads a rollouts JSONL written by the [`Loom`](crate::loom::Loom) (`holo eval`,
//!   `holo train`), or a run folder's `rollouts.jsonl`; a line that is not a rollout record is skipped and
//!   named by its line and column.
//! - [`filter`] drops failed rollouts and groups the others by row: the `G` rollouts of one data row at one
//!   training step, best first.
//! - [`sft`] writes conversational examples (`messages`, or `prompt` / `completion`); [`dpo`] writes
//!   `prompt` / `chosen` / `rejected` preference pairs from the rollouts of one group.
//!
//! A context splits at its first sampled message: the messages before it are the prompt (what the model was
//! given), that message and every later one the completion (what it wrote, with the tool results and user
//! turns between its turns). A message's content is its parts' text joined, so a prefix the machine wrote
//! into a sampled message (a fence's opening tag) is part of the completion.

pub mod dpo;
pub mod filter;
#[doc(hidden)]
pub mod fixtures;
pub mod sft;

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::loom::{ContextRecord, MessageRecord, RolloutRecord, ToolRecord};

/// A rollout record and the 1-based line of the file it was read from (for messages).
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    pub line: usize,
    pub record: RolloutRecord,
}

/// A line of the rollouts file that is not a rollout record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    pub line: usize,
    /// serde's column within the line.
    pub column: usize,
    pub message: String,
}

impl fmt::Display for BadLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "line {}, column {}: not a rollout record: {}",
            self.line, self.column, self.message
        )
    }
}

/// What [`read_rollouts`] read.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollouts {
    /// The file read (`rollouts.jsonl` inside a run folder).
    pub path: PathBuf,
    pub rollouts: Vec<Rollout>,
    pub bad_lines: Vec<BadLine>,
}

/// The rollouts file of `path`: `path` itself, or a run folder's `rollouts.jsonl`.
pub fn rollouts_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("rollouts.jsonl")
    } else {
        path.to_path_buf()
    }
}

/// Reads the rollouts of `path` (a rollouts JSONL, or a run folder); blank lines are skipped. An
/// unreadable file is an error naming it; a line that is not a rollout record is not (see
/// [`parse_rollouts`]).
pub fn read_rollouts(path: &Path) -> Result<Rollouts, String> {
    let file = rollouts_file(path);
    let text = std::fs::read_to_string(&file)
        .map_err(|error| format!("cannot read rollouts `{}`: {error}", file.display()))?;
    let (rollouts, bad_lines) = parse_rollouts(&text);
    Ok(Rollouts {
        path: file,
        rollouts,
        bad_lines,
    })
}

/// Parses JSONL text line by line: the rollout records, and each other non-blank line as a [`BadLine`].
pub fn parse_rollouts(text: &str) -> (Vec<Rollout>, Vec<BadLine>) {
    let mut rollouts = Vec::new();
    let mut bad_lines = Vec::new();
    for (index, text) in text.lines().enumerate() {
        if text.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<RolloutRecord>(text) {
            Ok(record) => rollouts.push(Rollout {
                line: index + 1,
                record,
            }),
            Err(error) => bad_lines.push(BadLine {
                line: index + 1,
                column: error.column(),
                message: error.to_string(),
            }),
        }
    }
    (rollouts, bad_lines)
}

/// A message as TRL's conversational datasets hold it (and as chat templates take it): `role`
/// (`system`, `user`, `assistant` or `tool`) and `content`; an assistant turn that made native tool
/// calls has its text before the calls as `content`, the calls as `tool_calls` (OpenAI's shape, each
/// call's `arguments` an object, with its `id`) and the reasoning a format writes apart as `thinking`
/// (gpt-oss's template's name), as harmony's answer has (its `final` messages the content); a tool's
/// result has role `tool`, the function's `name` and the call's `tool_call_id`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatMessage {
    pub role: &'static str,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thinking: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl From<&MessageRecord> for ChatMessage {
    fn from(message: &MessageRecord) -> Self {
        let text: String = message
            .parts
            .iter()
            .map(|part| part.text.as_str())
            .collect();
        let plain = ChatMessage {
            role: message.role.name(),
            content: text,
            thinking: None,
            tool_calls: None,
            name: None,
            tool_call_id: None,
        };
        match &message.tool {
            None => plain,
            Some(ToolRecord::ToolCalls {
                content,
                calls,
                reasoning,
            }) => ChatMessage {
                role: "assistant",
                content: content.clone().unwrap_or_default(),
                thinking: reasoning.clone(),
                tool_calls: Some(
                    calls
                        .iter()
                        .map(|call| {
                            let mut value = serde_json::json!({
                                "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments},
                            });
                            if let Some(id) = &call.id {
                                value["id"] = id.clone().into();
                            }
                            value
                        })
                        .collect(),
                ),
                ..plain
            },
            Some(ToolRecord::Answer { content, reasoning }) => ChatMessage {
                role: "assistant",
                content: content.clone().unwrap_or_default(),
                thinking: reasoning.clone(),
                ..plain
            },
            Some(ToolRecord::Result { name, id }) => ChatMessage {
                role: "tool",
                name: Some(name.clone()),
                tool_call_id: id.clone(),
                ..plain
            },
        }
    }
}

/// A context split at its first sampled message (see the [module documentation](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    pub prompt: Vec<ChatMessage>,
    pub completion: Vec<ChatMessage>,
    /// The tools offered to the model in the context (TRL's `tools` column), empty when none were.
    pub tools: Vec<serde_json::Value>,
    /// The context's token ids and loss mask, when it was recorded with a tokenizer.
    pub tokens: Option<Tokens>,
}

/// A context in token space, split as its messages are: the prompt is every token before the first
/// trained one (so it ends with the assistant header the chat template writes, as TRL's
/// `add_generation_prompt=True` does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokens {
    pub ids: Vec<u32>,
    /// 1 on the tokens the model sampled (what training learns), 0 elsewhere.
    pub loss_mask: Vec<u8>,
    /// Where the completion starts in `ids`.
    pub prompt_len: usize,
}

impl Tokens {
    pub fn prompt_ids(&self) -> &[u32] {
        &self.ids[..self.prompt_len]
    }

    pub fn completion_ids(&self) -> &[u32] {
        &self.ids[self.prompt_len..]
    }

    pub fn completion_loss_mask(&self) -> &[u8] {
        &self.loss_mask[self.prompt_len..]
    }
}

/// The trained contexts of a rollout that have a sampled message, split; the others are not examples of
/// anything the model learned.
pub fn conversations(record: &RolloutRecord) -> Vec<Conversation> {
    record
        .contexts
        .iter()
        .filter(|context| context.trained)
        .filter_map(conversation)
        .collect()
}

/// `context` split at its first sampled message; `None` when the model wrote nothing in it.
pub fn conversation(context: &ContextRecord) -> Option<Conversation> {
    let first_sampled = context
        .messages
        .iter()
        .position(|message| message.parts.iter().any(|part| part.sampled))?;
    let messages: Vec<ChatMessage> = context.messages.iter().map(ChatMessage::from).collect();
    let tokens = context.tokens.as_ref().map(|tokens| Tokens {
        ids: tokens.ids.clone(),
        loss_mask: tokens.loss_mask.clone(),
        prompt_len: tokens
            .loss_mask
            .iter()
            .position(|&bit| bit != 0)
            .unwrap_or(tokens.ids.len()),
    });
    let mut prompt = messages;
    let completion = prompt.split_off(first_sampled);
    Some(Conversation {
        prompt,
        completion,
        tools: context.tools.clone(),
        tokens,
    })
}

/// The error for `--tokens` when a rollout was recorded without a tokenizer.
pub(crate) fn missing_tokens(rollout: &Rollout) -> String {
    format!(
        "line {} (row {}, rollout {}): no token records to export with --tokens; record the rollouts \
         with a model folder (`holo eval --model DIR`, `holo train`)",
        rollout.line, rollout.record.row_index, rollout.record.rollout_index
    )
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;
    use crate::loom::TokensRecord;
    use crate::Role;

    #[test]
    fn a_context_splits_at_its_first_sampled_message() {
        let context = ContextRecord {
            trained: true,
            messages: vec![
                message(Role::System, &[("Use tools.", false)]),
                message(Role::User, &[("17*23?", false)]),
                message(
                    Role::Assistant,
                    &[("<tool>", false), ("17*23</tool>", true)],
                ),
                message(Role::User, &[("<result>391</result>", false)]),
                message(Role::Assistant, &[("<answer>391</answer>", true)]),
            ],
            tokens: Some(TokensRecord {
                ids: vec![1, 2, 3, 4, 5, 6],
                loss_mask: vec![0, 0, 1, 0, 1, 1],
                logprobs: vec![0.0; 6],
                retokenized: false,
                routes: None,
                constraints: Vec::new(),
            }),
            tools: Vec::new(),
        };
        let split = conversation(&context).unwrap();
        let roles = |messages: &[ChatMessage]| messages.iter().map(|m| m.role).collect::<Vec<_>>();
        assert_eq!(roles(&split.prompt), ["system", "user"]);
        assert_eq!(roles(&split.completion), ["assistant", "user", "assistant"]);
        assert_eq!(split.completion[0].content, "<tool>17*23</tool>");
        let tokens = split.tokens.unwrap();
        assert_eq!(tokens.prompt_ids(), [1, 2]);
        assert_eq!(tokens.completion_ids(), [3, 4, 5, 6]);
        assert_eq!(tokens.completion_loss_mask(), [1, 0, 1, 1]);
    }

    /// Native tool calls leave the records as TRL's conversational tool format: the assistant turn's
    /// text before its calls and `tool_calls`, the result as a `tool` message naming its function, and
    /// the tools offered beside the messages.
    #[test]
    fn native_tool_calls_export_as_tool_calls_and_tool_messages() {
        let tool =
            serde_json::json!({"type": "function", "function": {"name": "add", "parameters": {}}});
        let mut calling = message(
            Role::Assistant,
            &[("Adding.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2}}\n</tool_call>", true)],
        );
        calling.tool = Some(ToolRecord::ToolCalls {
            content: Some("Adding.".into()),
            calls: vec![crate::loom::ToolCallRecord {
                name: "add".into(),
                arguments: serde_json::json!({"a": 2}),
                id: None,
            }],
            reasoning: None,
        });
        let mut result = message(Role::User, &[("4", false)]);
        result.tool = Some(ToolRecord::Result {
            name: "add".into(),
            id: None,
        });
        let context = ContextRecord {
            trained: true,
            messages: vec![
                message(Role::User, &[("2+2?", false)]),
                calling,
                result,
                message(Role::Assistant, &[("4", true)]),
            ],
            tokens: None,
            tools: vec![tool.clone()],
        };
        let split = conversation(&context).unwrap();
        assert_eq!(split.tools, [tool]);
        let completion = serde_json::to_value(&split.completion).unwrap();
        assert_eq!(
            completion,
            serde_json::json!([
                {"role": "assistant", "content": "Adding.", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
                ]},
                {"role": "tool", "content": "4", "name": "add"},
                {"role": "assistant", "content": "4"},
            ])
        );
    }

    #[test]
    fn untrained_contexts_and_contexts_without_a_sample_are_not_conversations() {
        let mut record = record(0, 0, 1.0, "42");
        let trained = record.contexts[0].clone();
        let mut untrained = trained.clone();
        untrained.trained = false;
        let mut unsampled = trained.clone();
        unsampled.messages.truncate(1);
        record.contexts = vec![untrained, unsampled, trained];
        let found = conversations(&record);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].completion[0].content, "42");
    }

    #[test]
    fn bad_lines_are_named_by_line_and_column_and_skipped() {
        let good = serde_json::to_string(&record(3, 1, 0.5, "7")).unwrap();
        let text = format!("{good}\n\nnot json\n{{\"row_index\": 1}}\n{good}\n");
        let (rollouts, bad) = parse_rollouts(&text);
        assert_eq!(rollouts.iter().map(|r| r.line).collect::<Vec<_>>(), [1, 5]);
        assert_eq!(bad.iter().map(|b| b.line).collect::<Vec<_>>(), [3, 4]);
        assert_eq!(bad[0].column, 2, "serde reads `n` as the start of `null`");
        assert!(bad[1].message.contains("missing field"), "{}", bad[1]);
        assert!(
            bad[1].to_string().starts_with("line 4, column "),
            "{}",
            bad[1]
        );
    }

    #[test]
    fn a_run_folder_is_read_through_its_rollouts_file() {
        let dir = std::env::temp_dir().join(format!("holo-export-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let line = serde_json::to_string(&record(0, 0, 1.0, "42")).unwrap();
        std::fs::write(dir.join("rollouts.jsonl"), line + "\n").unwrap();
        let read = read_rollouts(&dir).unwrap();
        assert_eq!(read.path, dir.join("rollouts.jsonl"));
        assert_eq!(read.rollouts.len(), 1);
        let missing = read_rollouts(&dir.join("nothing.jsonl")).unwrap_err();
        assert!(missing.contains("nothing.jsonl"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
