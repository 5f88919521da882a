//! [`Transcript`]: a [`Recorder`] that keeps a rollout as readable text.

use std::fmt;

use crate::machine::{Completion, Recorder};
use crate::Role;

#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    /// The message's text with each sampled part marked.
    pub parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Prompt(String),
    Sampled(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Context {
    pub trained: bool,
    pub messages: Vec<Message>,
}

/// Everything one rollout produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Transcript {
    pub contexts: Vec<Context>,
    /// Reward components in the order they were recorded: name, value, weight.
    pub rewards: Vec<(String, f64, f64)>,
    /// The role of the message that starts with the next content.
    pending: Option<Role>,
}

impl Transcript {
    /// The message content goes to: the pending one (created now), the current one, or an implicit
    /// system message at the start of a context.
    fn message(&mut self) -> &mut Message {
        if self.contexts.is_empty() {
            self.contexts.push(Context {
                trained: true,
                messages: Vec::new(),
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
        let message = self.message();
        message.parts.push(Part::Sampled(completion.text.clone()));
    }

    fn reward(&mut self, name: &str, value: f64, weight: f64) {
        self.rewards.push((name.to_string(), value, weight));
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
                        Part::Sampled(text) => write!(f, "⟦{text}⟧")?,
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
        Ok(())
    }
}
