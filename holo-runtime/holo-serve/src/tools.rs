//! Tools on `/v1/chat/completions`: `tools`, `tool_choice` and `parallel_tool_calls` read and checked,
//! the tools handed to the chat template, `required` and named calls held to the family's call format
//! by a grammar, assistant `tool_calls` in the history made ready for the template, and replies read
//! back into OpenAI's `tool_calls`.

use super::*;
use holo_core::tools::{Function, ToolCall, ToolFormat};
use holo_core::Constraint;

/// What a chat request asks of tools.
pub(super) struct ToolRequest {
    /// The `tools` as the template takes them (OpenAI's objects, in their order).
    pub(super) tools: Vec<minijinja::Value>,
    /// The format replies are read in; `None` with `tool_choice: "none"`.
    pub(super) format: Option<ToolFormat>,
    /// The grammar of `required` or of a named function.
    pub(super) constraint: Option<Constraint>,
}

/// `tools`, `tool_choice` and `parallel_tool_calls`; `None` when the request has no tools.
pub(super) fn tool_request(
    state: &AppState,
    fields: &Fields,
) -> Result<Option<ToolRequest>, ApiError> {
    let parallel = fields.bool("parallel_tool_calls", true)?;
    let tools = match fields.get("tools") {
        None => Vec::new(),
        Some(Value::Array(tools)) => tools.clone(),
        Some(other) => {
            return Err(ApiError::invalid(
                "tools",
                format!("`tools` must be a list of tools, got {}", describe(other)),
            ))
        }
    };
    let functions = functions(&tools)?;
    let choice = fields.get("tool_choice");
    if functions.is_empty() {
        return match choice {
            None => Ok(None),
            Some(Value::String(none)) if none == "none" => Ok(None),
            Some(other) => Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` {} needs `tools`", describe(other)),
            )),
        };
    }
    if !state.template_takes_tools {
        return Err(ApiError::invalid(
            "tools",
            "the model's chat template does not render `tools`: its tools would never reach the model",
        )
        .code("unsupported_parameter"));
    }
    let forced = match choice {
        None => None,
        Some(Value::String(choice)) => match choice.as_str() {
            "none" => {
                return Ok(Some(ToolRequest {
                    tools: template_values(&tools)?,
                    format: None,
                    constraint: None,
                }))
            }
            "auto" => None,
            "required" => Some(functions.clone()),
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \
                         \"function\": {{\"name\": …}}}}, got \"{other}\""
                    ),
                ))
            }
        },
        Some(Value::Object(named)) => {
            let name = named
                .get("function")
                .and_then(|function| function.get("name"))
                .and_then(Value::as_str);
            let (Some(Value::String(kind)), Some(name)) = (named.get("type"), name) else {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": …}}",
                ));
            };
            if kind != "function" {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice.type` must be \"function\", got \"{kind}\""),
                ));
            }
            let Some(function) = functions.iter().find(|function| function.name == name) else {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not one of `tools`"),
                ));
            };
            Some(vec![function.clone()])
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "`tool_choice` must be a string or an object, got {}",
                    describe(other)
                ),
            ))
        }
    };
    let Some(format) = state.tool_format else {
        return Err(ApiError::invalid(
            "tools",
            format!(
                "the chat template does not say how the model writes tool calls: start `holo serve` with \
                 `--tool-call-parser` ({})",
                parser_names()
            ),
        )
        .code("unsupported_parameter"));
    };
    let constraint = match forced {
        None => None,
        Some(forced) => {
            // A named function is one call; `required` is one or more unless parallel calls are off.
            let parallel = parallel && forced.len() == functions.len();
            let grammar = format
                .grammar(&forced, parallel, |token| {
                    state.tokenizer.token_to_id(token)
                })
                .map_err(|error| {
                    ApiError::invalid("tool_choice", format!("cannot force a tool call: {error}"))
                })?;
            Some(Constraint::Lark(grammar))
        }
    };
    Ok(Some(ToolRequest {
        tools: template_values(&tools)?,
        format: Some(format),
        constraint,
    }))
}

/// The parsers `--tool-call-parser` takes, for messages.
pub(super) fn parser_names() -> String {
    ToolFormat::NAMES
        .iter()
        .map(|(name, _)| format!("`{name}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The functions of `tools`, each checked: `{"type": "function", "function": {"name", "description",
/// "parameters", "strict"}}`, names unique.
fn functions(tools: &[Value]) -> Result<Vec<Function>, ApiError> {
    let mut functions: Vec<Function> = Vec::with_capacity(tools.len());
    for (index, tool) in tools.iter().enumerate() {
        let at = format!("tools[{index}]");
        let invalid = |message: String| ApiError::invalid("tools", message);
        let Value::Object(tool) = tool else {
            return Err(invalid(format!(
                "`{at}` must be an object, got {}",
                describe(tool)
            )));
        };
        if let Some(key) = tool
            .keys()
            .find(|key| !["type", "function"].contains(&key.as_str()))
        {
            return Err(invalid(format!(
                "`{at}.{key}` is not supported; a tool has `type` and `function`"
            ))
            .code("unsupported_parameter"));
        }
        match tool.get("type") {
            Some(Value::String(kind)) if kind == "function" => {}
            other => {
                return Err(invalid(format!(
                    "`{at}.type` must be \"function\", got {}",
                    other.map_or("nothing".to_string(), describe)
                ))
                .code("unsupported_parameter"))
            }
        }
        let Some(Value::Object(function)) = tool.get("function") else {
            return Err(invalid(format!("`{at}.function` must be an object")));
        };
        let known = ["name", "description", "parameters", "strict"];
        if let Some(key) = function.keys().find(|key| !known.contains(&key.as_str())) {
            return Err(invalid(format!(
                "`{at}.function.{key}` is not supported; a function has `name`, `description`, \
                 `parameters` and `strict`"
            ))
            .code("unsupported_parameter"));
        }
        let name = match function.get("name") {
            Some(Value::String(name)) if !name.is_empty() => name.clone(),
            other => {
                return Err(invalid(format!(
                    "`{at}.function.name` must be a non-empty string, got {}",
                    other.map_or("nothing".to_string(), describe)
                )))
            }
        };
        if functions.iter().any(|function| function.name == name) {
            return Err(invalid(format!(
                "`{at}.function.name` `{name}` is already the name of an earlier tool"
            )));
        }
        match function.get("description") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(other) => {
                return Err(invalid(format!(
                    "`{at}.function.description` must be a string, got {}",
                    describe(other)
                )))
            }
        }
        match function.get("strict") {
            None | Some(Value::Null | Value::Bool(_)) => {}
            Some(other) => {
                return Err(invalid(format!(
                    "`{at}.function.strict` must be true or false, got {}",
                    describe(other)
                )))
            }
        }
        // No parameters: the function takes none (an empty object), as OpenAI reads it.
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => {
                json!({"type": "object", "properties": {}, "additionalProperties": false})
            }
            Some(Value::Object(parameters)) => Value::Object(parameters.clone()),
            Some(other) => {
                return Err(invalid(format!(
                    "`{at}.function.parameters` must be a JSON schema object, got {}",
                    describe(other)
                )))
            }
        };
        functions.push(Function { name, parameters });
    }
    Ok(functions)
}

/// JSON as a template value, keys in their order (as Python dicts keep them); `key` names it in the
/// request.
fn template_value(value: &Value, key: &str) -> Result<minijinja::Value, ApiError> {
    minijinja::Value::deserialize(value).map_err(|error| {
        ApiError::invalid(
            key,
            format!("`{key}` cannot be given to the template: {error}"),
        )
    })
}

fn template_values(tools: &[Value]) -> Result<Vec<minijinja::Value>, ApiError> {
    tools
        .iter()
        .map(|tool| template_value(tool, "tools"))
        .collect()
}

/// An assistant message's `tool_calls` as templates take them: each call's `arguments` (OpenAI sends
/// the JSON text) as the object it holds, since templates write it with `tojson` (vLLM does the same).
pub(super) fn history_calls(calls: &Value, index: usize) -> Result<minijinja::Value, ApiError> {
    let at = format!("messages[{index}].tool_calls");
    let invalid = |message: String| ApiError::invalid("messages", message);
    let Value::Array(calls) = calls else {
        return Err(invalid(format!(
            "`{at}` must be a list, got {}",
            describe(calls)
        )));
    };
    let mut ready = Vec::with_capacity(calls.len());
    for (number, call) in calls.iter().enumerate() {
        let at = format!("{at}[{number}]");
        let mut call = call.clone();
        let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) else {
            return Err(invalid(format!("`{at}.function` must be an object")));
        };
        if !function.get("name").is_some_and(Value::is_string) {
            return Err(invalid(format!("`{at}.function.name` must be a string")));
        }
        match function.get("arguments") {
            Some(Value::String(text)) => {
                let arguments: Value = serde_json::from_str(text).map_err(|error| {
                    invalid(format!("`{at}.function.arguments` is not JSON: {error}"))
                })?;
                if !arguments.is_object() {
                    return Err(invalid(format!(
                        "`{at}.function.arguments` must hold a JSON object, got {}",
                        describe(&arguments)
                    )));
                }
                function.insert("arguments".into(), arguments);
            }
            Some(Value::Object(_)) => {}
            other => {
                return Err(invalid(format!(
                    "`{at}.function.arguments` must be a JSON object or its text, got {}",
                    other.map_or("nothing".to_string(), describe)
                )))
            }
        }
        ready.push(call);
    }
    template_value(&Value::Array(ready), "messages")
}

/// The tool calls of a reply, read in `format` from the completion: its text (its content, with a
/// reasoning parser), or for a format whose marker is a special token its decoding with special tokens
/// (less the end-of-turn token; its content part with a reasoning parser).
pub(super) fn read_reply(
    state: &AppState,
    format: ToolFormat,
    reading: Option<Reading>,
    completion: &Completion,
    text: &str,
) -> Option<holo_core::tools::ToolReply> {
    if !format.reads_special_tokens() || completion.tokens.is_empty() {
        return format.parse(text);
    }
    let mut tokens = completion.tokens.as_slice();
    if completion.finish == Finish::EndOfTurn {
        if let Some((last, before)) = tokens.split_last() {
            let special = state
                .tokenizer
                .decode(&[*last], true)
                .is_ok_and(|text| text.is_empty());
            if special {
                tokens = before;
            }
        }
    }
    let decoded = state.tokenizer.decode(tokens, false).ok()?;
    match reading {
        Some(reading) => format.parse(&reading.parts(&decoded).of(&decoded).1?),
        None => format.parse(&decoded),
    }
}

/// A fresh id for a call, as OpenAI writes them (`call_…`).
pub(super) fn call_id(state: &AppState) -> String {
    format!(
        "call_{:016x}{:08x}",
        state.fresh_seed(),
        state.fresh_seed() as u32
    )
}

/// Calls as OpenAI's `tool_calls`, each with a fresh id.
pub(super) fn calls_json(state: &AppState, calls: &[ToolCall]) -> Vec<Value> {
    calls
        .iter()
        .map(|call| {
            json!({
                "id": call_id(state),
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": call.arguments.to_string(),
                },
            })
        })
        .collect()
}
