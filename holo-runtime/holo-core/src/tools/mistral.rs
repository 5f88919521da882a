//! Mistral's format: `[TOOL_CALLS][{"name": …, "arguments": {…}, "id": …}, …]` (v3 tokenizers; the
//! `id` is optional), or `[TOOL_CALLS]name[ARGS]{…}` per call (v11; `name[CALL_ID]id[ARGS]{…}` as
//! templates render calls in history).

use serde_json::Value;

use super::{call_from, content, ToolCall, ToolReply};

pub(super) const MARKER: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";
const CALL_ID: &str = "[CALL_ID]";

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
                let (name, id) = match name.split_once(CALL_ID) {
                    Some((name, id)) => (name.trim(), Some(id.trim().to_string())),
                    None => (name.trim(), None),
                };
                (!name.is_empty() && arguments.is_object()).then(|| ToolCall {
                    name: name.to_string(),
                    arguments,
                    id,
                })
            })
            .collect::<Option<Vec<ToolCall>>>()?
    };
    Some(ToolReply {
        content: content(&text[..first]),
        calls,
        reasoning: None,
    })
}

/// The function a v11 call names (`name[ARGS]…`) and the text of its arguments, read from what follows
/// the marker even where the arguments are not JSON; `None` for the v3 list.
pub(super) fn named(payload: &str) -> Option<(String, &str)> {
    let (name, arguments) = payload.split_once(ARGS)?;
    let name = name.split(CALL_ID).next().unwrap_or_default().trim();
    (!name.is_empty() && !name.starts_with('[')).then(|| (name.to_string(), arguments))
}
