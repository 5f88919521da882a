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

/// `schema` with Python's `json.dumps` layout (`", "` between items, `": "` after keys, no other
/// whitespace) unless it sets its own (llguidance's `x-guidance`): the JSON a constrained reply is held
/// to. llguidance's default lets whitespace run between any two tokens, and a model that keeps choosing
/// it never closes its object.
pub fn json_layout(mut schema: Value) -> Value {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "item_separator": ", ",
                "key_separator": ": ",
                "whitespace_flexible": false,
            })
        });
    }
    schema
}
