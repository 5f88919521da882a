//! Tool arguments against their JSON schema: the part of JSON Schema that tool definitions use
//! (`type`, `properties`, `required`, `additionalProperties`, `enum`, `items`), checked before a
//! native call runs so that a model that writes a wrong type is told so. Other keywords are not
//! checked.

use serde_json::{json, Map, Value};

/// `parameters` as a JSON schema: itself, or for the shorthand `{"argument": "type", …}` (every value
/// a type name, no `type` key) an object schema with each argument required and of that type.
pub(super) fn json_schema(parameters: &Value) -> Value {
    let Some(object) = parameters.as_object() else {
        return parameters.clone();
    };
    let shorthand = !object.contains_key("type")
        && !object.is_empty()
        && object
            .values()
            .all(|value| value.as_str().is_some_and(|name| TYPES.contains(&name)));
    if !shorthand {
        return parameters.clone();
    }
    let properties: Map<String, Value> = object
        .iter()
        .map(|(name, kind)| (name.clone(), json!({"type": kind})))
        .collect();
    let required: Vec<&String> = object.keys().collect();
    json!({"type": "object", "properties": properties, "required": required})
}

const TYPES: [&str; 7] = [
    "string", "number", "integer", "boolean", "object", "array", "null",
];

/// Whether `value` satisfies `schema`; the error names where it does not (`at` is the path so far,
/// such as `arguments.expression`).
pub(super) fn check(schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    let Some(schema) = schema.as_object() else {
        return Ok(());
    };
    if let Some(kind) = schema.get("type") {
        let kinds: Vec<&str> = match kind {
            Value::String(kind) => vec![kind.as_str()],
            Value::Array(kinds) => kinds.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        if !kinds.is_empty() && !kinds.iter().any(|kind| is_type(value, kind)) {
            return Err(format!(
                "`{at}` must be {}, got {}",
                kinds
                    .iter()
                    .map(|kind| article(kind))
                    .collect::<Vec<_>>()
                    .join(" or "),
                describe(value)
            ));
        }
    }
    if let Some(Value::Array(allowed)) = schema.get("enum") {
        if !allowed.contains(value) {
            let allowed: Vec<String> = allowed.iter().map(Value::to_string).collect();
            return Err(format!(
                "`{at}` must be one of {}, got {value}",
                allowed.join(", ")
            ));
        }
    }
    if let Value::Object(object) = value {
        if let Some(Value::Array(required)) = schema.get("required") {
            for name in required.iter().filter_map(Value::as_str) {
                if !object.contains_key(name) {
                    return Err(format!("`{at}.{name}` is required"));
                }
            }
        }
        let properties = schema.get("properties").and_then(Value::as_object);
        for (name, item) in object {
            match properties.and_then(|properties| properties.get(name)) {
                Some(property) => check(property, item, &format!("{at}.{name}"))?,
                None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    return Err(format!("`{at}.{name}` is not an argument of this tool"));
                }
                None => {}
            }
        }
    }
    if let (Value::Array(items), Some(item_schema)) = (value, schema.get("items")) {
        for (index, item) in items.iter().enumerate() {
            check(item_schema, item, &format!("{at}[{index}]"))?;
        }
    }
    Ok(())
}

fn is_type(value: &Value, kind: &str) -> bool {
    match kind {
        "string" => value.is_string(),
        "number" => value.is_number(),
        "integer" => {
            value.is_i64() || value.is_u64() || value.as_f64().is_some_and(|x| x.fract() == 0.0)
        }
        "boolean" => value.is_boolean(),
        "object" => value.is_object(),
        "array" => value.is_array(),
        "null" => value.is_null(),
        // A type this check does not know is not held against the call.
        _ => true,
    }
}

fn article(kind: &str) -> String {
    match kind {
        "integer" | "object" | "array" => format!("an {kind}"),
        "null" => "null".into(),
        _ => format!("a {kind}"),
    }
}

fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(_) => format!("the boolean {value}"),
        Value::Number(_) => format!("the number {value}"),
        Value::String(_) => format!("the string {value}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shorthand_reads_as_an_object_schema() {
        assert_eq!(
            json_schema(&json!({"expression": "string"})),
            json!({
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            })
        );
        let full = json!({"type": "object", "properties": {}});
        assert_eq!(json_schema(&full), full);
        // A property named like a schema keyword with a value that is not a type name is a schema.
        let other = json!({"description": "free text"});
        assert_eq!(json_schema(&other), other);
    }

    #[test]
    fn arguments_are_checked_against_the_schema() {
        let schema = json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"enum": ["c", "f"]},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city"],
            "additionalProperties": false,
        });
        let ok = json!({"city": "Paris", "days": 3, "unit": "c", "tags": ["a"]});
        assert_eq!(check(&schema, &ok, "arguments"), Ok(()));
        for (arguments, error) in [
            (json!({"days": 3}), "`arguments.city` is required"),
            (
                json!({"city": 7}),
                "`arguments.city` must be a string, got the number 7",
            ),
            (
                json!({"city": "P", "days": 1.5}),
                "`arguments.days` must be an integer, got the number 1.5",
            ),
            (
                json!({"city": "P", "unit": "k"}),
                "`arguments.unit` must be one of \"c\", \"f\", got \"k\"",
            ),
            (
                json!({"city": "P", "tags": ["a", 2]}),
                "`arguments.tags[1]` must be a string, got the number 2",
            ),
            (
                json!({"city": "P", "when": "now"}),
                "`arguments.when` is not an argument of this tool",
            ),
        ] {
            assert_eq!(check(&schema, &arguments, "arguments"), Err(error.into()));
        }
    }
}
