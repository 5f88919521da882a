//! Qwen's and Hermes' format: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` per call.

use super::{call_from, content, ToolReply};

pub(super) const OPEN: &str = "<tool_call>";
pub(super) const CLOSE: &str = "</tool_call>";

/// Every `<tool_call>` block of `text` (the last may lack its `</tool_call>`: a reply cut at a stop
/// token), each a JSON call; the text before the first block is the content.
pub(super) fn parse(text: &str) -> Option<ToolReply> {
    let first = text.find(OPEN)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(start) = rest.find(OPEN) {
        let body = &rest[start + OPEN.len()..];
        let (inside, after) = match body.find(CLOSE) {
            Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
            None => (body, ""),
        };
        let value = serde_json::from_str(inside.trim()).ok()?;
        calls.push(call_from(&value, &["arguments", "parameters"])?);
        rest = after;
    }
    Some(ToolReply {
        content: content(&text[..first]),
        calls,
        reasoning: None,
    })
}
