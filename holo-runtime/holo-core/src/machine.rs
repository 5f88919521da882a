//! The state machine interface that generated code implements, and the [`Recorder`] it writes to.
//!
//! A driver (a test, `holo dry`, the Loom) loops: [`Rollout::step`] runs the holoware until it needs the
//! model ([`Step::Sample`]) or ends ([`Step::Done`]); the driver has the request completed by a sampler
//! and hands the result back with [`Rollout::resume`]. A rollout never calls a model itself.

use std::fmt;

use crate::constraint::Constraint;
use crate::error::HolotypeError;
use crate::resources::Resources;
use crate::tools::{ToolFormat, ToolReply};
use crate::Role;

/// One rollout in progress: the interface a driver steps, whether the holoware was compiled to Rust
/// ([`Machine`]) or is interpreted at run time ([`crate::interpreter::Interpreter`]).
pub trait Rollout {
    /// Runs until the next sample request or the end.
    fn step(&mut self, recorder: &mut dyn Recorder) -> Result<Step, RolloutError>;

    /// Hands back the completion of the request the last `step` returned.
    fn resume(
        &mut self,
        completion: Completion,
        recorder: &mut dyn Recorder,
    ) -> Result<(), RolloutError>;
}

/// A holoware compiled to a typed state machine by `include_holoware!`, one instance per rollout.
pub trait Machine: Rollout + Sized {
    /// The data row: one field per input variable.
    type Input;

    /// Builds the machine for one rollout, constructing every holotype instance with `resources`.
    fn with_resources(input: Self::Input, resources: &Resources) -> Result<Self, RolloutError>;

    /// Builds the machine for one rollout without resources.
    fn new(input: Self::Input) -> Result<Self, RolloutError> {
        Self::with_resources(input, &Resources::default())
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Complete the current assistant message, then call [`Rollout::resume`].
    Sample(SampleRequest),
    /// The rollout ended; every holotype's `end` hook has run.
    Done,
}

/// What to sample. Generation arguments left `None` take the sampler's defaults.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SampleRequest {
    /// The variable that receives the text, if any.
    pub binding: Option<&'static str>,
    /// For `<>think`: `think`. The machine has already written `<think>`; `</think>` is the first stop
    /// string.
    pub fence: Option<&'static str>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u32>,
    /// Stop strings: the fence's closing tag first, then the tag's `stop=` arguments.
    pub stop: Vec<String>,
    /// What the sampled text must match: the tag's `json`, `json_schema`, `regex`, `choice` or
    /// `grammar` argument.
    pub constraint: Option<Constraint>,
    /// `file.hol:line:col` of the sampler tag.
    pub location: &'static str,
}

/// A sampler's answer to a [`SampleRequest`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Completion {
    /// The generated text, including the stop string that ended it, if one did.
    pub text: String,
    /// The sampled token ids, when the sampler works in token space.
    pub tokens: Vec<u32>,
    /// Log-probability of each sampled token, when the sampler reports them.
    pub logprobs: Vec<f32>,
    /// For each sampled token, when asked for ([`SampleParams::top_logprobs`](crate::SampleParams)) and
    /// the sampler reports them: the most likely tokens at its position and their log-probabilities (of
    /// the same distribution as `logprobs`), most likely first. Empty otherwise.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish: Finish,
    /// A mixture-of-experts sampler that records routing: for each token it read (the prompt's, then
    /// every sampled token but the last), the experts its mixture layers routed it to, empty where it
    /// did not compute the token. Empty otherwise. A trainer with routing replay computes the sampled
    /// tokens' log-probabilities through the same experts.
    pub routes: Vec<Vec<u32>>,
    /// The version of the weights that sampled it, when the sampler says: a server's `weight_version`
    /// (`holo serve`'s, SGLang's), or a trainer's in-process sampler's count of optimizer steps taken.
    pub weight_version: Option<u64>,
    /// The constraint the tokens were drawn under, which the Loom sets from the request: the trainer
    /// replays the tokens through it to train them under the masked distribution they were drawn from.
    pub constraint: Option<Constraint>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Finish {
    /// The model ended its turn.
    #[default]
    EndOfTurn,
    /// A stop string matched; it ends `text`.
    Stop(String),
    /// `max_tokens` was reached.
    Length,
}

/// A chat template argument's value, as a context marker gives it (`<|+++ enable_thinking=false|>`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TemplateArg<'a> {
    Bool(bool),
    Number(f64),
    Text(&'a str),
}

impl TemplateArg<'_> {
    /// The value as JSON, as Python would pass it to a template: a whole number as an integer (`2`,
    /// not `2.0`).
    pub fn json(self) -> serde_json::Value {
        match self {
            TemplateArg::Bool(value) => value.into(),
            TemplateArg::Number(value)
                if value.fract() == 0.0 && value.abs() < 9_007_199_254_740_992.0 =>
            {
                (value as i64).into()
            }
            TemplateArg::Number(value) => value.into(),
            TemplateArg::Text(text) => text.into(),
        }
    }
}

/// Receives what a rollout produces, in order. The runtime's holophore implements it in token space;
/// [`crate::Transcript`] keeps it as text.
pub trait Recorder {
    /// A new context starts; `trained` contexts contribute their sampled tokens to the loss.
    fn begin_context(&mut self, trained: bool);
    /// The chat template's arguments for the context just begun (its marker's, `enable_thinking=false`),
    /// over the run's own (`chat_template_kwargs`): called right after [`Recorder::begin_context`] when
    /// the marker has some. An error says why they cannot be applied (a sampler of chat messages, which
    /// this recorder renders no template for), and fails the rollout. A recorder that renders no
    /// template and sends none (a transcript) has nothing to apply them to.
    fn template_arguments(&mut self, arguments: &[(&str, TemplateArg<'_>)]) -> Result<(), String> {
        let _ = arguments;
        Ok(())
    }
    /// Content from now on goes to a new message of `role`. A message that receives no content before
    /// the next `begin_message` or `begin_context` is not part of the rollout (for example the user turn
    /// a tool loop opens after the model has answered), so a recorder creates it on its first content.
    fn begin_message(&mut self, role: Role);
    /// Text of the prompt (from the `.hol` file, the data, or a holotype) appended to the current message.
    fn text(&mut self, text: &str);
    /// The model's completion appended to the current (assistant) message.
    fn completion(&mut self, completion: &Completion);
    /// Native tool calls from now on: `tools` (OpenAI's tool objects) go to the chat template as its
    /// `tools`, and replies are read in `format`, or in the format the template writes calls in when
    /// `None`. Returns the format; an error says why the tools cannot be offered (no template, one that
    /// does not render tools or says no format, a context that already has a completion).
    fn offer_tools(
        &mut self,
        tools: &[serde_json::Value],
        format: Option<ToolFormat>,
    ) -> Result<ToolFormat, String>;
    /// The format of the native tool calls offered, if any.
    fn tool_format(&self) -> Option<ToolFormat>;
    /// The last assistant message, read in the tool format: the template renders it as `reply`'s
    /// content and `tool_calls`, or, without calls, as its content and reasoning (harmony's answer:
    /// [`ToolTurn::Answer`](crate::tools::ToolTurn::Answer)); the sampled tokens stay as they were
    /// sampled.
    fn tool_calls(&mut self, reply: &ToolReply);
    /// A `tool` message: the result of the call of function `name` whose id is `id` (or what was wrong
    /// with the call; `id` is `None` when no call was read).
    fn tool_result(&mut self, name: &str, id: Option<&str>, content: &str);
    /// The model's last completion as it wrote it, when its text is `text` and the recorder holds its
    /// tokens: the tokens decoded with their special tokens (Mistral's `[TOOL_CALLS]`, harmony's
    /// channels, which a sampler's text lacks), less a special end-of-turn token. `None` otherwise.
    fn written(&self, text: &str) -> Option<String> {
        let _ = text;
        None
    }
    /// A named reward component of the rollout and its weight in the rollout's reward. Recording a
    /// component again replaces its value and weight.
    fn reward(&mut self, name: &str, value: f64, weight: f64);
    /// Why reward component `name` got its value, in words a model can read (`<|Feedback name|>` writes
    /// it into a later prompt). Recording it again replaces it.
    fn feedback(&mut self, name: &str, text: &str);
    /// The value recorded so far for reward component `name`.
    fn recorded_reward(&self, name: &str) -> Option<f64>;
    /// The feedback recorded so far for reward component `name`.
    fn recorded_feedback(&self, name: &str) -> Option<&str>;
}

/// Records reward component `name` in `rewards` (name, value, weight), replacing an earlier value of it:
/// the [`Recorder::reward`] of the runtime's recorders.
pub(crate) fn set_reward(
    rewards: &mut Vec<(String, f64, f64)>,
    name: &str,
    value: f64,
    weight: f64,
) {
    match rewards.iter_mut().find(|(known, _, _)| known == name) {
        Some(entry) => *entry = (name.to_string(), value, weight),
        None => rewards.push((name.to_string(), value, weight)),
    }
}

/// Records the feedback on reward component `name`, replacing an earlier one: the
/// [`Recorder::feedback`] of the runtime's recorders.
pub(crate) fn set_feedback(feedback: &mut Vec<(String, String)>, name: &str, text: &str) {
    match feedback.iter_mut().find(|(known, _)| known == name) {
        Some(entry) => entry.1 = text.to_string(),
        None => feedback.push((name.to_string(), text.to_string())),
    }
}

/// The value of reward component `name` in `rewards`.
pub(crate) fn reward_of(rewards: &[(String, f64, f64)], name: &str) -> Option<f64> {
    rewards
        .iter()
        .find(|(known, _, _)| known == name)
        .map(|(_, value, _)| *value)
}

/// The feedback on reward component `name` in `feedback`.
pub(crate) fn feedback_of<'f>(feedback: &'f [(String, String)], name: &str) -> Option<&'f str> {
    feedback
        .iter()
        .find(|(known, _)| known == name)
        .map(|(_, text)| text.as_str())
}

/// Why a rollout could not go on. Carries the `.hol` location where it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RolloutError {
    /// A holotype hook or constructor failed.
    Holotype {
        location: &'static str,
        error: HolotypeError,
    },
    /// None of the alternatives of `<|a|b|>` was present.
    MissingVariable {
        location: &'static str,
        alternatives: &'static [&'static str],
    },
    /// `step` was called while a completion was awaited, or `resume` without a pending request.
    Protocol(&'static str),
    /// A context's chat template arguments could not be applied ([`Recorder::template_arguments`]).
    Template {
        location: &'static str,
        error: String,
    },
    /// A sampler's `json_schema=name`, `regex=name` or `grammar=name` found no schema, regular
    /// expression or grammar in its variable.
    Constraint {
        location: &'static str,
        error: String,
    },
}

impl fmt::Display for RolloutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RolloutError::Holotype { location, error } => write!(f, "{location}: {error}"),
            RolloutError::MissingVariable {
                location,
                alternatives,
            } => write!(
                f,
                "{location}: no value for `{}`: the data row lacks it and no sampler bound it",
                alternatives.join("|")
            ),
            RolloutError::Protocol(message) => write!(f, "machine protocol: {message}"),
            RolloutError::Constraint { location, error } => write!(f, "{location}: {error}"),
            RolloutError::Template { location, error } => {
                write!(
                    f,
                    "{location}: the context's chat template arguments: {error}"
                )
            }
        }
    }
}

impl std::error::Error for RolloutError {}

impl Completion {
    /// The text a binding receives: the completion without the fence's closing tag.
    pub fn bound_text(&self, fence: Option<&str>) -> &str {
        match fence {
            Some(fence) => {
                let close = format!("</{fence}>");
                self.text.strip_suffix(close.as_str()).unwrap_or(&self.text)
            }
            None => &self.text,
        }
    }

    /// Whether the completion closed the fence itself.
    pub fn closes_fence(&self, fence: &str) -> bool {
        self.text.ends_with(&format!("</{fence}>"))
    }
}
