//! Small helpers for the JSON that requests, rows and engines' wire formats carry.

use serde_json::Value;

/// A JSON value's kind, for messages ("expected a string, got a number").
pub fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// The JSON a constrained reply is held to; holoc's, which lays out a fenced sampler's schema.
pub use holoc::ir::json_layout;
