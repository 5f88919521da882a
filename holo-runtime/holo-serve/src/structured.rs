//! Structured output: `response_format` (OpenAI) and `guided_json`, `guided_regex`, `guided_choice`,
//! `guided_grammar`, `structured_outputs` (vLLM) read into one [`Constraint`], checked against the served
//! model's grammars before any sampling.

use super::*;
use holo_core::json::json_layout;
use holo_core::Constraint;

/// The request keys that ask for a constraint, in the order they are read.
const KEYS: [&str; 6] = [
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
];

/// The request's constraint and the key it came from; `None` when it asks for none (or for plain
/// text). Two keys that ask for one are refused: which would win is a guess.
pub(super) fn constraint(fields: &Fields) -> Result<Option<(&'static str, Constraint)>, ApiError> {
    let mut found: Option<(&'static str, Constraint)> = None;
    for key in KEYS {
        let Some(value) = fields.get(key) else {
            continue;
        };
        let Some(constraint) = read(key, value)? else {
            continue;
        };
        if let Some((first, _)) = &found {
            return Err(ApiError::invalid(
                key,
                format!("`{first}` and `{key}` both constrain the reply: give one of them"),
            ));
        }
        found = Some((key, constraint));
    }
    Ok(found)
}

/// `constraint` held only after a reasoning that ends with `end` (`</think>`), as vLLM starts a
/// structured reply's grammar once the reasoning has ended: a Lark grammar whose sentences are any
/// text up to and with `end` (llguidance's lazy lexeme), up to four whitespace characters (Qwen3
/// writes two newlines; unbounded, a model that keeps choosing whitespace never answers), then a
/// sentence of `constraint`. `None` for a Lark grammar of the client's, which cannot be nested in
/// another.
pub(super) fn after_reasoning(constraint: &Constraint, end: &str) -> Option<Constraint> {
    let body = lark_body(constraint)?;
    let end = Value::String(end.to_string());
    Some(Constraint::Lark(format!(
        "start: reasoning body | reasoning SPACE body\n\
         reasoning[suffix={end}]: /(?s:.*)/\n\
         SPACE: /[ \\t\\r\\n]{{1,4}}/\n\
         body: {body}\n"
    )))
}

/// `constraint` held to a gpt-oss reply's `final` message, after any `analysis` messages, as vLLM
/// starts a structured reply's grammar once `<|channel|>final<|message|>` is written (see
/// [`harmony::after_analysis`](holo_core::tools::harmony::after_analysis)); `token_id` finds
/// harmony's markers. `None` for a Lark grammar of the client's, which cannot be nested in another;
/// an error when the tokenizer lacks a marker.
pub(super) fn after_analysis(
    constraint: &Constraint,
    token_id: impl Fn(&str) -> Option<u32>,
) -> Option<Result<Constraint, String>> {
    let body = lark_body(constraint)?;
    Some(holo_core::tools::harmony::after_analysis(&body, token_id).map(Constraint::Lark))
}

/// `constraint` as a Lark expression to nest in a grammar; `None` for a Lark grammar, which is a
/// whole grammar of its own.
fn lark_body(constraint: &Constraint) -> Option<String> {
    Some(match constraint {
        Constraint::JsonObject => format!("%json {}", json_layout(json!({"type": "object"}))),
        Constraint::JsonSchema(schema) => format!("%json {}", json_layout(schema.clone())),
        Constraint::Regex(regex) => format!("/{}/", slashes_escaped(regex)),
        Constraint::Choice(choices) => choices
            .iter()
            .map(|choice| Value::String(choice.clone()).to_string())
            .collect::<Vec<_>>()
            .join(" | "),
        Constraint::Lark(_) => return None,
    })
}

/// A regular expression as a Lark `/…/` literal's body: its unescaped slashes escaped.
fn slashes_escaped(regex: &str) -> String {
    let mut escaped = String::with_capacity(regex.len());
    let mut escaping = false;
    for c in regex.chars() {
        if c == '/' && !escaping {
            escaped.push('\\');
        }
        escaping = c == '\\' && !escaping;
        escaped.push(c);
    }
    escaped
}

fn read(key: &'static str, value: &Value) -> Result<Option<Constraint>, ApiError> {
    match key {
        "response_format" => response_format(value),
        "guided_json" => json_schema(key, value).map(Some),
        "guided_regex" => text(key, value).map(|regex| Some(Constraint::Regex(regex))),
        "guided_choice" => choices(key, value).map(|choices| Some(Constraint::Choice(choices))),
        "guided_grammar" => text(key, value).map(|grammar| Some(Constraint::Lark(grammar))),
        _ => structured_outputs(value),
    }
}

/// OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}`, or
/// `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`.
fn response_format(value: &Value) -> Result<Option<Constraint>, ApiError> {
    let key = "response_format";
    let Value::Object(format) = value else {
        return Err(ApiError::invalid(
            key,
            format!("`{key}` must be an object, got {}", describe(value)),
        ));
    };
    let kind = match format.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        other => {
            return Err(ApiError::invalid(
                key,
                format!(
                    "`{key}.type` must be \"text\", \"json_object\" or \"json_schema\", got {}",
                    other.map_or("nothing".to_string(), describe)
                ),
            ))
        }
    };
    let allowed: &[&str] = match kind {
        "text" | "json_object" => &["type"],
        "json_schema" => &["type", "json_schema"],
        other => {
            return Err(ApiError::invalid(
                key,
                format!(
                    "`{key}.type` must be \"text\", \"json_object\" or \"json_schema\", got \"{other}\""
                ),
            )
            .code("unsupported_parameter"))
        }
    };
    unknown_keys(key, format, allowed)?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Constraint::JsonObject)),
        _ => {
            let inner = "response_format.json_schema";
            let Some(Value::Object(schema)) = format.get("json_schema") else {
                return Err(ApiError::invalid(
                    key,
                    format!("`{inner}` must be an object with the `schema`"),
                ));
            };
            unknown_keys(inner, schema, &["name", "schema", "strict", "description"])?;
            match schema.get("name") {
                None | Some(Value::Null | Value::String(_)) => {}
                Some(other) => {
                    return Err(ApiError::invalid(
                        key,
                        format!("`{inner}.name` must be a string, got {}", describe(other)),
                    ))
                }
            }
            match schema.get("strict") {
                None | Some(Value::Null | Value::Bool(_)) => {}
                Some(other) => {
                    return Err(ApiError::invalid(
                        key,
                        format!(
                            "`{inner}.strict` must be true or false, got {}",
                            describe(other)
                        ),
                    ))
                }
            }
            match schema.get("schema") {
                None | Some(Value::Null) => Err(ApiError::invalid(
                    key,
                    format!("`{inner}.schema` is required"),
                )
                .code("missing_field")),
                Some(schema) => json_schema(key, schema).map(Some),
            }
        }
    }
}

/// vLLM's `structured_outputs`: one of `json`, `regex`, `choice`, `grammar`, or `json_object: true`.
fn structured_outputs(value: &Value) -> Result<Option<Constraint>, ApiError> {
    let key = "structured_outputs";
    let Value::Object(options) = value else {
        return Err(ApiError::invalid(
            key,
            format!("`{key}` must be an object, got {}", describe(value)),
        ));
    };
    unknown_keys(
        key,
        options,
        &["json", "regex", "choice", "grammar", "json_object"],
    )?;
    let mut found = Vec::new();
    for (name, value) in options {
        if value.is_null() {
            continue;
        }
        let constraint = match name.as_str() {
            "json" => json_schema(key, value)?,
            "regex" => Constraint::Regex(text(key, value)?),
            "choice" => Constraint::Choice(choices(key, value)?),
            "grammar" => Constraint::Lark(text(key, value)?),
            _ => match value {
                Value::Bool(true) => Constraint::JsonObject,
                Value::Bool(false) => continue,
                other => {
                    return Err(ApiError::invalid(
                        key,
                        format!(
                            "`{key}.json_object` must be true or false, got {}",
                            describe(other)
                        ),
                    ))
                }
            },
        };
        found.push((name.as_str(), constraint));
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop().map(|(_, constraint)| constraint)),
        _ => Err(ApiError::invalid(
            key,
            format!(
                "`{key}` gives {}: give one of them",
                found
                    .iter()
                    .map(|(name, _)| format!("`{name}`"))
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
        )),
    }
}

/// A JSON schema given as an object (or `true`/`false`), or as the text of one (vLLM accepts both).
fn json_schema(key: &str, value: &Value) -> Result<Constraint, ApiError> {
    let schema = match value {
        Value::String(text) => serde_json::from_str::<Value>(text).map_err(|error| {
            ApiError::invalid(
                key,
                format!("`{key}` is a string that is not a JSON schema: {error}"),
            )
        })?,
        other => other.clone(),
    };
    match schema {
        Value::Object(_) | Value::Bool(_) => Ok(Constraint::JsonSchema(schema)),
        other => Err(ApiError::invalid(
            key,
            format!(
                "the JSON schema of `{key}` must be an object, got {}",
                describe(&other)
            ),
        )),
    }
}

fn text(key: &str, value: &Value) -> Result<String, ApiError> {
    match value {
        Value::String(text) if !text.is_empty() => Ok(text.clone()),
        other => Err(ApiError::invalid(
            key,
            format!(
                "`{key}` must be a non-empty string, got {}",
                describe(other)
            ),
        )),
    }
}

fn choices(key: &str, value: &Value) -> Result<Vec<String>, ApiError> {
    let choices = value.as_array().and_then(|items| {
        items
            .iter()
            .map(|item| item.as_str().map(str::to_string))
            .collect::<Option<Vec<String>>>()
    });
    match choices {
        Some(choices) if !choices.is_empty() => Ok(choices),
        _ => Err(ApiError::invalid(
            key,
            format!(
                "`{key}` must be a non-empty list of strings, got {}",
                describe(value)
            ),
        )),
    }
}

/// Refuses keys of `object` (at `path` in the request) that are not `allowed`: an option the server
/// does not know would be silently ignored.
fn unknown_keys(path: &str, object: &Map<String, Value>, allowed: &[&str]) -> Result<(), ApiError> {
    let param = path.split('.').next().unwrap_or(path);
    match object.keys().find(|key| !allowed.contains(&key.as_str())) {
        Some(unknown) => Err(ApiError::invalid(
            param,
            format!(
                "`{path}.{unknown}` is not supported; `{path}` takes {}",
                allowed
                    .iter()
                    .map(|key| format!("`{key}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .code("unsupported_parameter")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every constraint but a client's Lark grammar nests after the reasoning in a grammar
    /// llguidance compiles; a regex's slashes, escaped or not, keep their meaning.
    #[test]
    fn constraints_nest_after_the_reasoning() {
        let tokenizer = Tokenizer::from_file(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/holophore/tokenizer.json"
        ))
        .unwrap();
        let size = tokenizer.get_vocab_size(true);
        let grammars = holo_model::Grammars::new(tokenizer, size, vec![0]);
        for constraint in [
            Constraint::JsonObject,
            Constraint::JsonSchema(
                json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
            ),
            Constraint::Regex(r"(yes|no)/[0-9]+\/x".into()),
            Constraint::Choice(vec!["red".into(), "a \"blue\" one".into()]),
        ] {
            let nested = after_reasoning(&constraint, "</think>").unwrap();
            if let Err(error) = grammars.compile(&nested) {
                panic!("{constraint:?}: {error}\n{nested:?}");
            }
        }
        assert_eq!(slashes_escaped(r"a/b\/c\\/d"), r"a\/b\/c\\\/d");
        assert_eq!(
            after_reasoning(&Constraint::Lark("start: \"x\"".into()), "</think>"),
            None
        );
    }

    /// The random gpt-oss fixture's tokenizer with harmony's markers as special tokens, and its
    /// grammars ended as gpt-oss's generation config ends a turn (`<|return|>`, `<|call|>`).
    fn harmony_grammars() -> (Tokenizer, holo_model::Grammars) {
        let mut tokenizer = Tokenizer::from_file(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/models/gpt_oss/tokenizer.json"
        ))
        .unwrap();
        let markers = holo_core::tools::harmony::MARKERS
            .map(|marker| tokenizers::AddedToken::from(marker, true));
        assert_eq!(
            tokenizer.add_special_tokens(markers).unwrap(),
            holo_core::tools::harmony::MARKERS.len()
        );
        let size = tokenizer.get_vocab_size(true);
        let ends = ["<|return|>", "<|call|>"].map(|end| tokenizer.token_to_id(end).unwrap());
        let grammars = holo_model::Grammars::new(tokenizer.clone(), size, ends.to_vec());
        (tokenizer, grammars)
    }

    /// A structured reply with harmony's reading is any number of `analysis` messages, then a `final`
    /// message that is a sentence of the constraint, ended by `<|return|>`: llguidance's matcher over
    /// the gpt-oss fixture's tokens lets every token of such a reply through, and refuses a final
    /// message that breaks the schema, a message on another channel, text outside the messages, and a
    /// final message ended otherwise. What it lets through reads as the analysis and the JSON.
    #[test]
    fn harmony_replies_are_held_in_their_final_message() {
        let (tokenizer, grammars) = harmony_grammars();
        let schema = json!({
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": false,
        });
        let token_id = |marker: &str| tokenizer.token_to_id(marker);
        let constraint = after_analysis(&Constraint::JsonSchema(schema), token_id)
            .unwrap()
            .unwrap();
        let grammar = grammars.compile(&constraint).unwrap();
        let holds = |reply: &str| {
            let ids = tokenizer.encode(reply, false).unwrap().get_ids().to_vec();
            grammar.replay(&ids).is_ok()
        };
        let answer = r#"{"city": "Paris", "days": 3}"#;
        let analysis =
            "<|channel|>analysis<|message|>Paris, 3 days <maybe> < 4.<|end|><|start|>assistant";
        let last = format!("<|channel|>final<|message|>{answer}<|return|>");
        let thought = "Paris, 3 days <maybe> < 4.";
        for (reply, reasoning) in [
            (format!("{analysis}{last}"), Some(thought.to_string())),
            (last.clone(), None),
            (
                format!("{analysis}{analysis}{last}"),
                Some(format!("{thought}\n{thought}")),
            ),
            (
                format!("<|channel|>analysis<|message|><|end|><|start|>assistant{last}"),
                None,
            ),
        ] {
            assert!(holds(&reply), "{reply}");
            let read = Harmony { reasoning: true }.parts(&reply, false);
            assert_eq!(read, (reasoning, Some(answer.to_string())), "{reply}");
        }
        for refused in [
            // The schema's: a city it does not list, too many days, a key it does not know.
            r#"{"city": "Rome", "days": 3}"#,
            r#"{"city": "Paris", "days": 9}"#,
            r#"{"city": "Paris", "days": 3, "x": 1}"#,
        ] {
            let reply = format!("{analysis}<|channel|>final<|message|>{refused}<|return|>");
            assert!(!holds(&reply), "{reply}");
        }
        for outside in [
            format!("Sure. {last}"),
            format!("<|channel|>commentary<|message|>Hi.<|end|><|start|>assistant{last}"),
            format!("<|channel|>final <|constrain|>json<|message|>{answer}<|return|>"),
            format!("<|channel|>final<|message|>{answer}<|end|>"),
            format!("<|channel|>final<|message|>{answer}<|call|>"),
            format!("<|channel|>analysis<|message|>a <|channel|> b<|end|><|start|>assistant{last}"),
            format!("<|channel|>analysis<|message|>a<|end|>{last}"),
        ] {
            assert!(!holds(&outside), "{outside}");
        }
    }

    /// Every constraint but a client's Lark grammar nests in a harmony reply's final message in a
    /// grammar llguidance compiles; a tokenizer without harmony's markers cannot hold one.
    #[test]
    fn constraints_nest_in_the_final_message() {
        let (tokenizer, grammars) = harmony_grammars();
        let token_id = |marker: &str| tokenizer.token_to_id(marker);
        for constraint in [
            Constraint::JsonObject,
            Constraint::Regex(r"(yes|no)/[0-9]+".into()),
            Constraint::Choice(vec!["red".into(), "a \"blue\" one".into()]),
        ] {
            let nested = after_analysis(&constraint, token_id).unwrap().unwrap();
            if let Err(error) = grammars.compile(&nested) {
                panic!("{constraint:?}: {error}\n{nested:?}");
            }
        }
        let lark = Constraint::Lark("start: \"x\"".into());
        assert!(after_analysis(&lark, token_id).is_none());
        let error = after_analysis(&Constraint::JsonObject, |_| None)
            .unwrap()
            .unwrap_err();
        assert!(error.contains("<|start|>"), "{error}");
    }
}
