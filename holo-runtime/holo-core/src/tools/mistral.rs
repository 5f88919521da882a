//! Mistral's format: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (v3 tokenizers), or
//! `[TOOL_CALLS]name[ARGS]{…}` per call (v11).

use serde_json::Value;

use super::{call_from, content, ToolCall, ToolReply};

pub(super) const MARKER: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";

/// The calls after the first `[TOOL_CALLS]`; the text before it is the content.
pub(super) fn parse(text: &str) -> Option<ToolReply> {
    let first = text.find(MARKER)?;
    let after = text[first + MARKER.len()..].trim_start();
    let calls = if after.starts_with('[') {
        let mut values = serde_json::Deserializer::from_str(after).into_iter::<Value>();
        let list = values.next()?.ok()?;
        if !after[values.byte_offset()..].trim().is_empty() {
            return None;
        }
        list.as_array()?
            .iter()
            .map(|call| call_from(call, &["arguments"]))
            .collect::<Option<Vec<ToolCall>>>()?
    } else {
        after
            .split(MARKER)
            .map(|call| {
                let (name, arguments) = call.split_once(ARGS)?;
                let arguments: Value = serde_json::from_str(arguments.trim()).ok()?;
                let name = name.trim();
                (!name.is_empty() && arguments.is_object()).then(|| ToolCall {
                    name: name.to_string(),
                    arguments,
                })
            })
            .collect::<Option<Vec<ToolCall>>>()?
    };
    Some(ToolReply {
        content: content(&text[..first]),
        calls,
    })
}
