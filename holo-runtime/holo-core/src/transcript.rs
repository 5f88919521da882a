//! [`Transcript`]: a [`Recorder`] that keeps a rollout as readable text.

use std::fmt;

use crate::machine::{feedback_of, reward_of, set_feedback, set_reward, Completion, Recorder};
use crate::tools::{ToolFormat, ToolReply, ToolTurn};
use crate::Role;

#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    /// The message's text with each sampled part marked.
    pub parts: Vec<Part>,
    /// What the message is to native tool calls: the calls an assistant message made, or the
    /// function a tool's result answers (a `user` message here, the side of the conversation it is on).
    pub tool: Option<ToolTurn>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Prompt(String),
    /// What the model wrote, and the version of the weights that wrote it when the sampler said
    /// ([`Completion::weight_version`]).
    Sampled(String, Option<u64>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Context {
    pub trained: bool,
    pub messages: Vec<Message>,
    /// The tools offered to the model's chat template in this context (OpenAI's `tools` entries).
    pub tools: Vec<serde_json::Value>,
}

/// Everything one rollout produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Transcript {
    pub contexts: Vec<Context>,
    /// Reward components in the order they were first recorded: name, value, weight.
    pub rewards: Vec<(String, f64, f64)>,
    /// Feedback on reward components, in the order it was first recorded: name, text.
    pub feedback: Vec<(String, String)>,
    /// The role of the message that starts with the next content.
    pending: Option<Role>,
    /// The format of the native tool calls offered, if any.
    tool_format: Option<ToolFormat>,
    /// The tools offered last: the contexts begun after the offer have them too.
    tools: Vec<serde_json::Value>,
}

impl Transcript {
    /// The message content goes to: the pending one (created now), the current one, or an implicit
    /// system message at the start of a context.
    fn message(&mut self) -> &mut Message {
        if self.contexts.is_empty() {
            self.contexts.push(Context {
                trained: true,
                messages: Vec::new(),
                tools: self.tools.clone(),
            });
        }
        let context = self.contexts.last_mut().expect("a context exists");
        let role = match self.pending.take() {
            Some(role) => Some(role),
            None if context.messages.is_empty() => Some(Role::System),
            None => None,
        };
        if let Some(role) = role {
            context.messages.push(Message {
                role,
                parts: Vec::new(),
                tool: None,
            });
        }
        context.messages.last_mut().expect("a message exists")
    }
}

impl Recorder for Transcript {
    fn begin_context(&mut self, trained: bool) {
        self.pending = None;
        self.contexts.push(Context {
            trained,
            messages: Vec::new(),
            tools: self.tools.clone(),
        });
    }

    fn begin_message(&mut self, role: Role) {
        self.pending = Some(role);
    }

    fn text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let message = self.message();
        match message.parts.last_mut() {
            Some(Part::Prompt(previous)) => previous.push_str(text),
            _ => message.parts.push(Part::Prompt(text.to_string())),
        }
    }

    fn completion(&mut self, completion: &Completion) {
        // A completion always belongs to an assistant message (as in the Holophore): after a `tool`
        // message, which the machine did not open, it starts one.
        let current = self
            .contexts
            .last()
            .and_then(|context| context.messages.last())
            .map(|message| message.role);
        if self.pending.is_some() || current != Some(Role::Assistant) {
            self.pending = Some(Role::Assistant);
        }
        let message = self.message();
        message.parts.push(Part::Sampled(
            completion.text.clone(),
            completion.weight_version,
        ));
    }

    /// Text keeps no chat template: the format must be named, and the tools are not shown.
    fn offer_tools(
        &mut self,
        tools: &[serde_json::Value],
        format: Option<ToolFormat>,
    ) -> Result<ToolFormat, String> {
        let format = format.ok_or(
            "no chat template to read the tool-call format from: name it with `parser=` \
             (hermes, llama3_json, mistral or openai), or give the model",
        )?;
        self.tool_format = Some(format);
        self.tools = tools.to_vec();
        if let Some(context) = self.contexts.last_mut() {
            context.tools = self.tools.clone();
        }
        Ok(format)
    }

    fn tool_format(&self) -> Option<ToolFormat> {
        self.tool_format
    }

    /// The text keeps the reply as it was sampled, calls included; the message is marked with them.
    fn tool_calls(&mut self, reply: &ToolReply) {
        let assistant = self.contexts.last_mut().and_then(|context| {
            context
                .messages
                .iter_mut()
                .rev()
                .find(|message| message.role == Role::Assistant)
        });
        if let Some(message) = assistant {
            message.tool = Some(ToolTurn::from(reply));
        }
    }

    /// The text shows a tool message as a user message (it has no tool role), marked with the
    /// function it answers.
    fn tool_result(&mut self, name: &str, id: Option<&str>, content: &str) {
        self.begin_message(Role::User);
        let message = self.message();
        message.parts.push(Part::Prompt(content.to_string()));
        message.tool = Some(ToolTurn::Result {
            name: name.to_string(),
            id: id.map(str::to_string),
        });
    }

    fn reward(&mut self, name: &str, value: f64, weight: f64) {
        set_reward(&mut self.rewards, name, value, weight);
    }

    fn feedback(&mut self, name: &str, text: &str) {
        set_feedback(&mut self.feedback, name, text);
    }

    fn recorded_reward(&self, name: &str) -> Option<f64> {
        reward_of(&self.rewards, name)
    }

    fn recorded_feedback(&self, name: &str) -> Option<&str> {
        feedback_of(&self.feedback, name)
    }
}

impl Transcript {
    /// The rollout's reward: the weighted sum of its components.
    pub fn reward(&self) -> f64 {
        // `+ 0.0`: the empty sum of floats is -0.
        self.rewards
            .iter()
            .map(|(_, value, weight)| value * weight)
            .sum::<f64>()
            + 0.0
    }

    /// The transcript for a terminal: sampled text in trained contexts in bold green (what training
    /// learns from), in untrained contexts in yellow; with `color` false, as [`fmt::Display`] writes it.
    pub fn render(&self, color: bool) -> String {
        if !color {
            return self.to_string();
        }
        let mut out = String::new();
        for (index, context) in self.contexts.iter().enumerate() {
            let kind = if context.trained {
                "trained"
            } else {
                "untrained"
            };
            out.push_str(&format!("\x1b[2m=== context {index} ({kind})\x1b[0m\n"));
            let highlight = if context.trained {
                "\x1b[1;32m"
            } else {
                "\x1b[33m"
            };
            for message in &context.messages {
                out.push_str(&format!("\x1b[36m--- {}\x1b[0m\n", message.role.name()));
                for part in &message.parts {
                    match part {
                        Part::Prompt(text) => out.push_str(text),
                        Part::Sampled(text, _) => {
                            out.push_str(&format!("{highlight}{text}\x1b[0m"))
                        }
                    }
                }
                out.push('\n');
            }
        }
        for (name, value, weight) in &self.rewards {
            out.push_str(&format!(
                "\x1b[35mreward {name} = {value} (weight {weight})\x1b[0m\n"
            ));
        }
        for (name, text) in &self.feedback {
            out.push_str(&format!("\x1b[35mfeedback {name}: {text}\x1b[0m\n"));
        }
        out
    }
}

/// Plain text: one block per message, sampled text between `⟦` and `⟧`.
impl fmt::Display for Transcript {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, context) in self.contexts.iter().enumerate() {
            let kind = if context.trained {
                "trained"
            } else {
                "untrained"
            };
            writeln!(f, "=== context {index} ({kind})")?;
            for message in &context.messages {
                writeln!(f, "--- {}", message.role.name())?;
                for part in &message.parts {
                    match part {
                        Part::Prompt(text) => f.write_str(text)?,
                        Part::Sampled(text, _) => write!(f, "⟦{text}⟧")?,
                    }
                }
                writeln!(f)?;
            }
        }
        for (name, value, weight) in &self.rewards {
            if *weight == 1.0 {
                writeln!(f, "reward {name} = {value}")?;
            } else {
                writeln!(f, "reward {name} = {value} (weight {weight})")?;
            }
        }
        for (name, text) in &self.feedback {
            writeln!(f, "feedback {name}: {text}")?;
        }
        Ok(())
    }
}
