//! A NeMo Gym row (the body of `POST /run`) as the holoware's data row and the sampling parameters of
//! its rollout; see "Rows" in the [module documentation](super).

use holo_core::json::kind_of;
use serde_json::{Map, Value};

use holo_core::interpreter::{Holoware, MissingInput, Row};
use holo_core::sampler::Imposed;

/// Fields of a NeMo Gym row that are the protocol's, never data columns.
const PROTOCOL_FIELDS: [&str; 5] = [
    "responses_create_params",
    "verifier_metadata",
    "agent_ref",
    "response",
    "reward",
];

/// Which columns the text of a row's messages goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Columns {
    /// The column of the last user message's text (`holo gym --input-column`, default `question`).
    pub input: String,
    /// The column of the instructions and system messages (`system`).
    pub system: String,
}

impl Default for Columns {
    fn default() -> Self {
        Columns {
            input: "question".into(),
            system: "system".into(),
        }
    }
}

/// A row that does not fit: where (`loc`, FastAPI's path into the body, starting with `"body"`) and why.
#[derive(Debug, Clone, PartialEq)]
pub struct RowError {
    pub loc: Vec<Value>,
    pub message: String,
}

impl RowError {
    fn at(path: &[&str], message: impl Into<String>) -> Self {
        RowError {
            loc: std::iter::once("body")
                .chain(path.iter().copied())
                .map(Value::from)
                .collect(),
            message: message.into(),
        }
    }

    fn index(mut self, position: usize, index: usize) -> Self {
        self.loc.insert(position, Value::from(index));
        self
    }

    /// The field as a dotted path (`responses_create_params.input[2].content`), for messages.
    pub fn field(&self) -> String {
        let mut field = String::new();
        for step in self.loc.iter().skip(1) {
            match step {
                Value::Number(index) => field.push_str(&format!("[{index}]")),
                Value::String(name) if field.is_empty() => field.push_str(name),
                Value::String(name) => {
                    field.push('.');
                    field.push_str(name);
                }
                other => field.push_str(&other.to_string()),
            }
        }
        field
    }
}

impl std::fmt::Display for RowError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field(), self.message)
    }
}

/// What a NeMo Gym row gives a rollout.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapped {
    /// The holoware's data row.
    pub row: Row,
    /// `temperature`, `top_p` and `max_output_tokens` of `responses_create_params`.
    pub imposed: Imposed,
    /// `_ng_task_index` and `_ng_rollout_index`, when the row has them (they seed the rollout).
    pub task_index: Option<u64>,
    pub rollout_index: Option<u64>,
}

/// Maps a row, checking every field it reads.
pub fn map(body: &Map<String, Value>, columns: &Columns) -> Result<Mapped, RowError> {
    let params = match body.get("responses_create_params") {
        Some(Value::Object(params)) => params,
        Some(other) => {
            return Err(RowError::at(
                &["responses_create_params"],
                format!("must be an object, not {}", kind_of(other)),
            ))
        }
        None => return Err(RowError::at(&["responses_create_params"], "missing")),
    };
    let (input, system) = messages(params)?;
    let instructions = match params.get("instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text.clone()),
        Some(other) => {
            return Err(RowError::at(
                &["responses_create_params", "instructions"],
                format!("must be a string, not {}", kind_of(other)),
            ))
        }
    };
    let system: Vec<String> = instructions.into_iter().chain(system).collect();

    // Columns from the row's own fields, then verifier_metadata, then the messages: a column given
    // twice must have one value.
    let mut row = Row::new();
    let mut sources: Vec<(String, String)> = Vec::new();
    let mut put = |name: &str, value: Value, source: String| -> Result<(), RowError> {
        if let Some(previous) = row.get(name) {
            if *previous != value {
                let at = sources
                    .iter()
                    .find(|(column, _)| column == name)
                    .map_or(String::new(), |(_, source)| source.clone());
                return Err(RowError {
                    loc: loc_of(&source),
                    message: format!(
                        "column `{name}` is also given by {at}, with another value (say it once)"
                    ),
                });
            }
            return Ok(());
        }
        row.insert(name.to_string(), value);
        sources.push((name.to_string(), source));
        Ok(())
    };
    for (name, value) in body {
        if PROTOCOL_FIELDS.contains(&name.as_str()) || name.starts_with("_ng_") {
            continue;
        }
        put(name, value.clone(), name.clone())?;
    }
    match body.get("verifier_metadata") {
        None | Some(Value::Null) => {}
        Some(Value::Object(metadata)) => {
            for (name, value) in metadata {
                put(name, value.clone(), format!("verifier_metadata.{name}"))?;
            }
        }
        Some(other) => {
            return Err(RowError::at(
                &["verifier_metadata"],
                format!("must be an object, not {}", kind_of(other)),
            ))
        }
    }
    put(
        &columns.input,
        Value::String(input),
        "responses_create_params.input".into(),
    )?;
    if !system.is_empty() {
        put(
            &columns.system,
            Value::String(system.join("\n\n")),
            "responses_create_params.instructions".into(),
        )?;
    }

    let number = |name: &str| -> Result<Option<f64>, RowError> {
        match params.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(number)) => Ok(number.as_f64()),
            Some(other) => Err(RowError::at(
                &["responses_create_params", name],
                format!("must be a number, not {}", kind_of(other)),
            )),
        }
    };
    let temperature = number("temperature")?;
    if temperature.is_some_and(|t| !(t.is_finite() && t >= 0.0)) {
        return Err(RowError::at(
            &["responses_create_params", "temperature"],
            "must be a number >= 0",
        ));
    }
    let top_p = number("top_p")?;
    if top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        return Err(RowError::at(
            &["responses_create_params", "top_p"],
            "must be a number in (0, 1]",
        ));
    }
    let max_tokens = match params.get("max_output_tokens") {
        None | Some(Value::Null) => None,
        Some(value) => Some(
            value
                .as_u64()
                .filter(|&n| n >= 1)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    RowError::at(
                        &["responses_create_params", "max_output_tokens"],
                        format!("must be an integer >= 1, not {}", kind_of(value)),
                    )
                })?,
        ),
    };
    let index = |name: &str| -> Result<Option<u64>, RowError> {
        match body.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => value.as_u64().map(Some).ok_or_else(|| {
                RowError::at(
                    &[name],
                    format!("must be an integer >= 0, not {}", kind_of(value)),
                )
            }),
        }
    };
    Ok(Mapped {
        row,
        imposed: Imposed {
            temperature,
            top_p,
            max_tokens,
        },
        task_index: index("_ng_task_index")?,
        rollout_index: index("_ng_rollout_index")?,
    })
}

/// The holoware's own row check ([`Holoware::check_row`]), its error naming where the row gives (or
/// would give) the missing column.
pub fn check(holoware: &Holoware, mapped: &Mapped, columns: &Columns) -> Result<(), RowError> {
    holoware.check_row(&mapped.row).map_err(|missing| {
        let MissingInput {
            columns: needed, ..
        } = &missing;
        let source = if needed.contains(&columns.input) {
            "responses_create_params.input".to_string()
        } else if needed.contains(&columns.system) {
            "responses_create_params.instructions".to_string()
        } else {
            format!("verifier_metadata.{}", needed[0])
        };
        RowError {
            loc: loc_of(&source),
            message: format!(
                "{missing}: give it in verifier_metadata (or as a field of the row); the last user \
                 message goes to `{}`, the instructions to `{}`",
                columns.input, columns.system
            ),
        }
    })
}

/// The text of the last user message of `input` (or `input` itself, a string), and the texts of its
/// system and developer messages.
fn messages(params: &Map<String, Value>) -> Result<(String, Vec<String>), RowError> {
    const INPUT: [&str; 2] = ["responses_create_params", "input"];
    let items = match params.get("input") {
        Some(Value::String(text)) => return Ok((text.clone(), Vec::new())),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(RowError::at(
                &INPUT,
                format!(
                    "must be a string or a list of messages, not {}",
                    kind_of(other)
                ),
            ))
        }
        None => return Err(RowError::at(&INPUT, "missing")),
    };
    let mut user = None;
    let mut system = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let Some(item) = item.as_object() else {
            return Err(RowError::at(&INPUT, "must be a list of objects").index(3, index));
        };
        let is_message = matches!(item.get("type"), None | Some(Value::Null))
            || item.get("type").and_then(Value::as_str) == Some("message");
        if !is_message {
            continue;
        }
        let role = item.get("role").and_then(Value::as_str);
        if !matches!(role, Some("user" | "system" | "developer")) {
            continue;
        }
        let text = content_text(item.get("content")).map_err(|error| error.index(3, index))?;
        if role == Some("user") {
            user = Some(text);
        } else {
            system.push(text);
        }
    }
    let user = user.ok_or_else(|| {
        RowError::at(
            &INPUT,
            "has no user message (its text is the holoware's input)",
        )
    })?;
    Ok((user, system))
}

/// A message's content as text: a string, or its `input_text` parts joined by newlines.
fn content_text(content: Option<&Value>) -> Result<String, RowError> {
    const CONTENT: [&str; 3] = ["responses_create_params", "input", "content"];
    match content {
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (index, part) in parts.iter().enumerate() {
                let text = part
                    .get("type")
                    .and_then(Value::as_str)
                    .filter(|kind| matches!(*kind, "input_text" | "output_text" | "text"))
                    .and_then(|_| part.get("text"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        RowError::at(
                            &CONTENT,
                            "only text parts ({\"type\": \"input_text\", \"text\": ...}) are supported",
                        )
                        .index(4, index)
                    })?;
                texts.push(text);
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(RowError::at(
            &CONTENT,
            format!(
                "must be a string or a list of parts, not {}",
                kind_of(other)
            ),
        )),
        None => Err(RowError::at(&CONTENT, "missing")),
    }
}

/// `["body", ...]` of a dotted source (`verifier_metadata.expected`).
fn loc_of(source: &str) -> Vec<Value> {
    std::iter::once("body")
        .chain(source.split('.'))
        .map(Value::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(value: Value) -> Map<String, Value> {
        value.as_object().unwrap().clone()
    }

    #[test]
    fn the_last_user_message_instructions_and_metadata_become_columns() {
        let mapped = map(
            &body(json!({
                "responses_create_params": {
                    "input": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "first"},
                        {"role": "assistant", "content": "ok"},
                        {"type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": "What is"}, {"type": "input_text", "text": "2+2?"}]}
                    ],
                    "instructions": "You add.",
                    "temperature": 0.5, "top_p": 0.9, "max_output_tokens": 7
                },
                "verifier_metadata": {"expected": "4", "level": 2},
                "agent_ref": {"type": "responses_api_agents", "name": "holo_agent"},
                "_ng_task_index": 3, "_ng_rollout_index": 1,
                "source": "unit"
            })),
            &Columns::default(),
        )
        .unwrap();
        assert_eq!(
            Value::Object(mapped.row),
            json!({"question": "What is\n2+2?", "system": "You add.\n\nBe brief.", "expected": "4",
                   "level": 2, "source": "unit"})
        );
        assert_eq!(
            mapped.imposed,
            Imposed {
                temperature: Some(0.5),
                top_p: Some(0.9),
                max_tokens: Some(7)
            }
        );
        assert_eq!(
            (mapped.task_index, mapped.rollout_index),
            (Some(3), Some(1))
        );
    }

    #[test]
    fn a_string_input_is_the_input_column() {
        let columns = Columns {
            input: "query".into(),
            ..Columns::default()
        };
        let mapped = map(
            &body(json!({"responses_create_params": {"input": "hi"}})),
            &columns,
        )
        .unwrap();
        assert_eq!(Value::Object(mapped.row), json!({"query": "hi"}));
        assert_eq!(mapped.imposed, Imposed::default());
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (json!({}), "responses_create_params: missing"),
            (
                json!({"responses_create_params": []}),
                "responses_create_params: must be an object, not a list",
            ),
            (
                json!({"responses_create_params": {"input": 3}}),
                "responses_create_params.input: must be a string or a list of messages, not a number",
            ),
            (
                json!({"responses_create_params": {"input": [{"role": "assistant", "content": "x"}]}}),
                "responses_create_params.input: has no user message",
            ),
            (
                json!({"responses_create_params": {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}}),
                "responses_create_params.input[0].content[0]: only text parts",
            ),
            (
                json!({"responses_create_params": {"input": "x", "temperature": "hot"}}),
                "responses_create_params.temperature: must be a number, not a string",
            ),
            (
                json!({"responses_create_params": {"input": "x", "max_output_tokens": 0}}),
                "responses_create_params.max_output_tokens: must be an integer >= 1",
            ),
            (
                json!({"responses_create_params": {"input": "x"}, "verifier_metadata": "4"}),
                "verifier_metadata: must be an object, not a string",
            ),
            (
                json!({"responses_create_params": {"input": "x"}, "verifier_metadata": {"question": "y"}}),
                "responses_create_params.input: column `question` is also given by verifier_metadata.question",
            ),
            (
                json!({"responses_create_params": {"input": "x"}, "_ng_task_index": -1}),
                "_ng_task_index: must be an integer >= 0",
            ),
        ];
        for (row, expected) in cases {
            let error = map(&body(row.clone()), &Columns::default()).unwrap_err();
            assert!(
                error.to_string().starts_with(expected),
                "{row}: {error} (expected {expected})"
            );
        }
    }
}
