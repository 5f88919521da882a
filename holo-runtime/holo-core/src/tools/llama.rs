//! Llama 3.1 to 3.3's JSON format: the reply is `{"name": …, "parameters": {…}}`, calls separated by
//! `;` (after `<|python_tag|>`, which decoding without special tokens drops).

use serde_json::Value;

use super::{call_from, ToolReply};

pub(super) const PYTHON_TAG: &str = "<|python_tag|>";

/// The calls when the whole reply is JSON calls; a reply that is anything else holds none.
pub(super) fn parse(text: &str) -> Option<ToolReply> {
    let mut rest = text.trim_start();
    rest = rest.strip_prefix(PYTHON_TAG).unwrap_or(rest).trim_start();
    if !rest.starts_with('{') {
        return None;
    }
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        calls.push(call_from(&value, &["parameters", "arguments"])?);
        rest = rest[values.byte_offset()..].trim_start();
        if let Some(after) = rest.strip_prefix(';') {
            rest = after.trim_start();
        } else if !rest.is_empty() {
            return None;
        }
    }
    Some(ToolReply {
        content: None,
        calls,
        reasoning: None,
    })
}
