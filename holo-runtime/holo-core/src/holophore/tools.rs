//! Native tool calls in the Holophore: the tools offered to the chat template, assistant turns
//! rendered with their `tool_calls`, and `tool` messages (see "Native tool calls" in the
//! [module documentation](super)).

use std::sync::Arc;

use serde_json::json;

use super::{Holophore, Message, Rendering};
use crate::tools::{ToolFormat, ToolReply, ToolTurn};
use crate::Role;

/// A message as chat templates take it: `role` and `content`, with `tool_calls` for an assistant
/// turn that made calls (each with its `id`, its `arguments` an object, which templates write with
/// `tojson`, as vLLM hands them; the reasoning a format writes apart as `thinking`, gpt-oss's
/// template's name for it) and role `tool` for a call's result (with the call's `tool_call_id`).
pub(super) fn message_value(message: &Message) -> minijinja::Value {
    let value = match &message.tool {
        None => json!({"role": message.role.name(), "content": message.content}),
        Some(ToolTurn::Calls(reply)) => {
            // No text before the calls is an empty content, not `None`: templates such as Qwen3's
            // look for `</think>` in it.
            let mut value = json!({
                "role": "assistant",
                "content": reply.content.as_deref().unwrap_or_default(),
                "tool_calls": reply.calls.iter().map(|call| {
                    let mut value = json!({
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    });
                    if let Some(id) = &call.id {
                        value["id"] = json!(id);
                    }
                    value
                }).collect::<Vec<_>>(),
            });
            // gpt-oss's template refuses a calling turn with both: a preamble joins the reasoning,
            // which it renders as one `analysis` message.
            match (&reply.reasoning, &reply.content) {
                (Some(reasoning), Some(content)) => {
                    value["thinking"] = json!(format!("{reasoning}\n{content}"));
                    value["content"] = json!("");
                }
                (Some(reasoning), None) => value["thinking"] = json!(reasoning),
                (None, _) => {}
            }
            value
        }
        Some(ToolTurn::Answer { content, reasoning }) => {
            let mut value = json!({
                "role": "assistant",
                "content": content.as_deref().unwrap_or_default(),
            });
            if let Some(reasoning) = reasoning {
                value["thinking"] = json!(reasoning);
            }
            value
        }
        Some(ToolTurn::Result { name, id }) => {
            let mut value = json!({"role": "tool", "name": name, "content": message.content});
            if let Some(id) = id {
                value["tool_call_id"] = json!(id);
            }
            value
        }
    };
    template_value(&value)
}

/// A JSON value as a template value, keeping the key order of objects (as Python dicts do).
pub(super) fn template_value(value: &serde_json::Value) -> minijinja::Value {
    use serde::Deserialize;
    minijinja::Value::deserialize(value).expect("every JSON value is a template value")
}

impl Rendering {
    /// The same rendering with `tools` handed to the template, and `header` as the assistant header.
    fn with_tools(&self, tools: Vec<minijinja::Value>, header: Vec<u32>) -> Rendering {
        let with = |options: &crate::chat::RenderOptions| crate::chat::RenderOptions {
            tools: Some(tools.clone()),
            ..options.clone()
        };
        self.changed(with, header)
    }
}

impl Holophore {
    /// [`Recorder::offer_tools`](crate::Recorder::offer_tools): every rendering from now on hands
    /// `tools` to the template. The tools change the rendering of the conversation from its start
    /// (templates list them in the system turn), so contexts are rendered whole from now on, as for
    /// templates without frames; the current context, which has no completion yet, is rendered again
    /// at its first sample request.
    pub(super) fn offer_native_tools(
        &mut self,
        tools: &[serde_json::Value],
        format: Option<ToolFormat>,
    ) -> Result<ToolFormat, String> {
        let template = &self.rendering.template;
        let sources: String = template
            .template_names()
            .iter()
            .filter_map(|name| template.source(name))
            .collect();
        if !sources.contains("tools") {
            return Err(
                "the model's chat template does not render `tools`: the model would never see its \
                 tools; use text tools (no `parser=`)"
                    .into(),
            );
        }
        let Some(format) = format
            .or(self.default_tool_format)
            .or_else(|| ToolFormat::detect(&sources))
        else {
            let names: Vec<&str> = ToolFormat::NAMES.iter().map(|(name, _)| *name).collect();
            return Err(format!(
                "the model's chat template does not say how the model writes tool calls: name the \
                 format with `parser=` ({})",
                names.join(", ")
            ));
        };
        let open = self.contexts.last().filter(|context| !context.closed);
        if open.is_some_and(|context| !context.sampled_ids().is_empty()) {
            return Err(
                "native tools must be offered before the model's first turn of the context: the \
                 turns it already took were rendered without them"
                    .into(),
            );
        }
        let header = self.assistant_header();
        let tools: Vec<minijinja::Value> = tools.iter().map(template_value).collect();
        // Tools stay from now on: a context with template arguments of its own goes back to the run's
        // rendering with them too.
        if let Some((rendering, frames)) = &mut self.restore {
            *rendering = Arc::new(rendering.with_tools(tools.clone(), header.clone()));
            *frames = None;
        }
        self.rendering = Arc::new(self.rendering.with_tools(tools, header));
        self.frames = None;
        if let Some(context) = self.contexts.last_mut().filter(|context| !context.closed) {
            context.fragments.clear();
            context.pending_text.clear();
            context.rendered.clear();
        }
        self.tool_format = Some(format);
        Ok(format)
    }

    /// [`Recorder::tool_calls`](crate::Recorder::tool_calls): the last assistant message of the
    /// current context is rendered with the reply's calls from now on.
    pub(super) fn mark_tool_calls(&mut self, reply: &ToolReply) {
        if self.tool_format.is_none() {
            self.errors
                .push("tool calls recorded, but no native tools were offered".into());
            return;
        }
        let assistant = self
            .contexts
            .last_mut()
            .filter(|context| !context.closed)
            .and_then(|context| {
                context
                    .messages
                    .iter_mut()
                    .rev()
                    .find(|message| message.role == Role::Assistant)
            });
        match assistant {
            Some(message) => message.tool = Some(ToolTurn::from(reply)),
            None => self
                .errors
                .push("tool calls recorded, but the context has no assistant message".into()),
        }
    }

    /// [`Recorder::tool_result`](crate::Recorder::tool_result): a `tool` message, tokenized as the
    /// template renders it at the next sample request (never trained: it is prompt).
    pub(super) fn push_tool_result(&mut self, name: &str, id: Option<&str>, content: &str) {
        if self.tool_format.is_none() {
            self.errors.push(format!(
                "a result of tool `{name}` recorded, but no native tools were offered"
            ));
            return;
        }
        let Some(context) = self.contexts.last_mut().filter(|context| !context.closed) else {
            self.errors.push(format!(
                "a result of tool `{name}` recorded outside a context"
            ));
            return;
        };
        self.pending = None;
        context.messages.push(Message {
            role: Role::User,
            content: content.to_string(),
            tool: Some(ToolTurn::Result {
                name: name.to_string(),
                id: id.map(str::to_string),
            }),
        });
    }
}
