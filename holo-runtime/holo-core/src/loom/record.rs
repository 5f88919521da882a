//! The records the [`Loom`](super::Loom) writes: one JSON line per rollout ([`RolloutRecord`]), its
//! contexts in text and in token space, and why a rollout or a row failed.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::constraint::Constrained;
use crate::interpreter::Row;
use crate::Role;

/// One finished rollout: a line of the JSONL; see the [module documentation](super).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutRecord {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset: Option<String>,
    pub row_index: usize,
    pub rollout_index: usize,
    pub seed: u64,
    pub row: Row,
    pub contexts: Vec<ContextRecord>,
    pub rewards: BTreeMap<String, f64>,
    pub weights: BTreeMap<String, f64>,
    /// Why reward components got their values, where the holotypes said (`Recorder::feedback`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub feedback: BTreeMap<String, String>,
    pub reward: f64,
    /// Sample requests the rollout made.
    pub samples: u32,
    /// A sample ran out of tokens (`max_tokens`, or the model's context); see "Truncation" in the
    /// [module documentation](super).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// The training step whose batch the rollout belongs to (written by the trainer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    pub error: Option<Failure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<Timing>,
}

impl RolloutRecord {
    /// The texts the model sampled, in order, over every context.
    pub fn sampled(&self) -> impl DoubleEndedIterator<Item = &str> {
        self.contexts
            .iter()
            .flat_map(|context| &context.messages)
            .flat_map(|message| &message.parts)
            .filter(|part| part.sampled)
            .map(|part| part.text.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContextRecord {
    pub trained: bool,
    pub messages: Vec<MessageRecord>,
    /// The tools offered to the model's chat template (OpenAI's `tools` entries), when the holoware
    /// offered native tools (`<|ToolSchema|>`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<serde_json::Value>,
    /// The context in token space, when the Loom records with a [`Holophore`](crate::holophore::Holophore)
    /// ([`Loom::with_holophore`](super::Loom::with_holophore)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokensRecord>,
}

/// A context as training consumes it: [`crate::holophore::Context::ids`], `loss_mask` and `logprobs`,
/// aligned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokensRecord {
    pub ids: Vec<u32>,
    /// 1 exactly on the sampled tokens of a trained context.
    pub loss_mask: Vec<u8>,
    /// The sampler's logprob of each sampled token; 0 elsewhere and where the sampler gave none.
    pub logprobs: Vec<f32>,
    /// Some completion came as text only and was tokenized by the holophore, so its ids may differ
    /// from what the model sampled.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retokenized: bool,
    /// The experts a mixture-of-experts sampler routed each token through (every mixture layer's
    /// choices in layer order; empty where not recorded), aligned with `ids`, when it recorded them
    /// ([`crate::Completion::routes`]): what routing replay trains through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routes: Option<Vec<Vec<u32>>>,
    /// The runs of sampled tokens drawn under a constraint (a sampler tag's `json_schema=`, `regex=`,
    /// …), in order: the trainer replays each through its constraint to train it under the masked
    /// distribution the sampler drew from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<Constrained>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageRecord {
    pub role: Role,
    pub parts: Vec<PartRecord>,
    /// Native tool calls: the calls an assistant message made, or the function a tool's result answers
    /// (its `role` is `user`, the side of the conversation it is on; exports write it as `tool`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<ToolRecord>,
}

/// What a message is to native tool calls, in a record: `{"tool_calls": {"content", "calls"}}` for an
/// assistant message that made calls (with `reasoning` where the format writes it apart: harmony's
/// `analysis`), `{"result": {"name", "id"}}` for a tool's result, `{"answer": {"content",
/// "reasoning"}}` for harmony's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolRecord {
    /// The calls an assistant message made, in order, and its text before them (`None` when there was
    /// none but whitespace): what the chat template renders the turn from.
    ToolCalls {
        content: Option<String>,
        calls: Vec<ToolCallRecord>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reasoning: Option<String>,
    },
    /// The result of a call of the function `name`, whose id is `id` (none when no call was read).
    Result {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
    },
    /// An answer (no call) in a format that writes its content and reasoning apart (harmony's `final`
    /// and `analysis` messages), which the message's text runs together.
    Answer {
        content: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reasoning: Option<String>,
    },
}

/// One call: the function's name, its arguments (a JSON object; the text the model wrote, as a JSON
/// string, for a call that was not well-formed) and its id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallRecord {
    pub name: String,
    pub arguments: serde_json::Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

impl From<&crate::tools::ToolTurn> for ToolRecord {
    fn from(turn: &crate::tools::ToolTurn) -> Self {
        match turn {
            crate::tools::ToolTurn::Calls(reply) => ToolRecord::ToolCalls {
                content: reply.content.clone(),
                calls: reply
                    .calls
                    .iter()
                    .map(|call| ToolCallRecord {
                        name: call.name.clone(),
                        arguments: call.arguments.clone(),
                        id: call.id.clone(),
                    })
                    .collect(),
                reasoning: reply.reasoning.clone(),
            },
            crate::tools::ToolTurn::Result { name, id } => ToolRecord::Result {
                name: name.clone(),
                id: id.clone(),
            },
            crate::tools::ToolTurn::Answer { content, reasoning } => ToolRecord::Answer {
                content: content.clone(),
                reasoning: reasoning.clone(),
            },
        }
    }
}

/// The message as a chat request sends it: its parts' text joined.
impl From<&MessageRecord> for crate::sampler::ChatMessage {
    fn from(message: &MessageRecord) -> Self {
        crate::sampler::ChatMessage {
            role: message.role,
            content: message
                .parts
                .iter()
                .map(|part| part.text.as_str())
                .collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartRecord {
    pub text: String,
    /// Written by the model (what training learns from in a trained context).
    pub sampled: bool,
    /// A sampled part: the version of the weights that sampled it, when the sampler said
    /// ([`crate::Completion::weight_version`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<u64>,
}

/// Why a rollout failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub stage: Stage,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// The rollout could not be built (a holotype's constructor failed).
    Start,
    /// The rollout failed while stepping: a [`RolloutError`](crate::RolloutError) or a panic.
    Rollout,
    /// The sampler could not complete one of its requests.
    Sampler,
}

/// Milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// When the rollout started, from the start of the run.
    pub start_ms: f64,
    /// From its start to its end.
    pub wall_ms: f64,
    /// The part of `wall_ms` spent waiting for its samples.
    pub sample_ms: f64,
}

/// A row that ran no rollout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowFailure {
    pub row_index: usize,
    pub message: String,
}

/// A rollout that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutFailure {
    pub row_index: usize,
    pub rollout_index: usize,
    pub failure: Failure,
}
