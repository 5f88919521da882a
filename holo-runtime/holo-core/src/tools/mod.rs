//! Native tool calls: the formats in which models trained to call tools write their calls, read back
//! into OpenAI's `tool_calls`, and the grammars that hold a reply to one call or more (constrained
//! decoding, for `tool_choice: "required"` or a named function).
//!
//! A model sees its tools through its chat template's `tools` argument
//! ([`RenderOptions::tools`](crate::chat::RenderOptions::tools)) and answers in its family's format:
//! [`ToolFormat::Hermes`] (Qwen 2.5 and 3, Hermes: `<tool_call>{json}</tool_call>`),
//! [`ToolFormat::Llama3Json`] (Llama 3.1 to 3.3: a bare `{"name", "parameters"}` object), or
//! [`ToolFormat::Mistral`] (`[TOOL_CALLS][{"name", "arguments"}, …]`), or [`ToolFormat::Harmony`]
//! (gpt-oss: messages to `functions.NAME` on harmony's channels). The names are vLLM's
//! `--tool-call-parser` names.

pub mod harmony;
mod hermes;
mod llama;
mod mistral;

use serde_json::{json, Value};

use crate::json::json_layout;

/// One call a model made: the function's name, its arguments (a JSON object; for a call that was not
/// well-formed, the text the model wrote for them, as a JSON string) and its id: the one the model wrote
/// with it (Mistral's), or the one a tool loop gave it, which its result names (`tool_call_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Value,
    pub id: Option<String>,
}

/// What a message is to native tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolTurn {
    /// An assistant message that made calls: the template renders it with the reply's content (the
    /// text before the calls) and its calls as `tool_calls`.
    Calls(ToolReply),
    /// A `tool` message: the result of a call of the function `name`, whose id is `id` (none when no
    /// call was read).
    Result { name: String, id: Option<String> },
    /// An assistant message that made no call, in a format that writes its content and reasoning apart
    /// (harmony's `final` and `analysis` messages): the template renders it from them.
    Answer {
        content: Option<String>,
        reasoning: Option<String>,
    },
}

impl From<&ToolReply> for ToolTurn {
    /// A reply with calls makes calls; one without is an answer.
    fn from(reply: &ToolReply) -> Self {
        match reply.calls.is_empty() {
            true => ToolTurn::Answer {
                content: reply.content.clone(),
                reasoning: reply.reasoning.clone(),
            },
            false => ToolTurn::Calls(reply.clone()),
        }
    }
}

/// A reply read in a tool-call format: the text before the calls (`None` when there is none but
/// whitespace; harmony's: its `final` messages and preambles), the calls, and the reasoning a format
/// writes apart from the content (harmony's `analysis` messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolReply {
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
    pub reasoning: Option<String>,
}

/// A turn that starts a call but holds no well-formed one ([`ToolFormat::read`]): what is wrong, for
/// the model to read, and the call as far as it could be read, for the formats whose templates show a
/// result only after a call ([`ToolFormat::results_follow_calls`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    pub message: String,
    /// The function's name where it was read (else the format's name), and the text the model wrote
    /// for the call's arguments, as a JSON string.
    pub call: ToolCall,
    /// The text before the call, and the reasoning written apart from it (harmony's).
    pub content: Option<String>,
    pub reasoning: Option<String>,
}

/// A function the model may call: its name and the JSON schema of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    pub parameters: Value,
}

/// How a family writes its tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one block per call (Qwen 2.5 and 3,
    /// Hermes 2 and 3); text before the first block is the reply's content.
    Hermes,
    /// `{"name": …, "parameters": {…}}`, calls separated by `; `, the whole reply (Llama 3.1 to 3.3,
    /// after the `<|python_tag|>` the tokenizer's decoding drops).
    Llama3Json,
    /// `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (Mistral's v3 tokenizers; v11's
    /// `[TOOL_CALLS]name[ARGS]{…}` is read too). `[TOOL_CALLS]` is a special token: the reply is read
    /// from its decoding with special tokens.
    Mistral,
    /// OpenAI's harmony format (gpt-oss, vLLM's `openai` parser): a call is a message to
    /// `functions.NAME` (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}
    /// <|call|>`), its content the arguments; the reply's content is its `final` messages and
    /// preambles (see [`harmony`]). The markers are special tokens: the reply is read from its
    /// decoding with special tokens.
    Harmony,
}

impl ToolFormat {
    /// Every format by its vLLM `--tool-call-parser` name.
    pub const NAMES: [(&'static str, ToolFormat); 4] = [
        ("hermes", ToolFormat::Hermes),
        ("llama3_json", ToolFormat::Llama3Json),
        ("mistral", ToolFormat::Mistral),
        ("openai", ToolFormat::Harmony),
    ];

    /// The format named `name` (vLLM's names).
    pub fn from_name(name: &str) -> Option<ToolFormat> {
        Self::NAMES
            .iter()
            .find(|(known, _)| *known == name)
            .map(|&(_, format)| format)
    }

    pub fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, format)| *format == self)
            .map(|&(name, _)| name)
            .expect("every format is named")
    }

    /// The format a chat template's source writes its tool calls in, when it says: the markers its
    /// assistant turns are rendered with.
    pub fn detect(source: &str) -> Option<ToolFormat> {
        if source.contains(harmony::CHANNEL) && source.contains(harmony::FUNCTIONS) {
            Some(ToolFormat::Harmony)
        } else if source.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if source.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if source.contains("<|python_tag|>")
            || (source.contains("<|eot_id|>") && source.contains("\"parameters\""))
        {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// Whether replies are read from their decoding with special tokens (the format's marker is one).
    pub fn reads_special_tokens(self) -> bool {
        matches!(self, ToolFormat::Mistral | ToolFormat::Harmony)
    }

    /// The calls in `text`, or `None` when it holds none: no call starts there, or what starts one is
    /// not a well-formed call (then the whole text is the reply's content, as vLLM's parsers do).
    pub fn parse(self, text: &str) -> Option<ToolReply> {
        let reply = match self {
            ToolFormat::Hermes => hermes::parse(text),
            ToolFormat::Llama3Json => llama::parse(text),
            ToolFormat::Mistral => mistral::parse(text),
            ToolFormat::Harmony => harmony::parse(text),
        }?;
        (!reply.calls.is_empty()).then_some(reply)
    }

    /// The calls in `text` as a tool loop reads a turn: `Ok(None)` when no call starts there (the model
    /// answered), `Err` saying what is wrong when one starts but is not a well-formed call (bad JSON, no
    /// `name`, arguments that are not an object), for the model to read.
    pub fn read(self, text: &str) -> Result<Option<ToolReply>, Box<Malformed>> {
        if let Some(reply) = self.parse(text) {
            return Ok(Some(reply));
        }
        // Per format: where the call starts, what the model wrote for it, and its function's name
        // where it can be read without the JSON.
        let (at, payload, name) = match self {
            ToolFormat::Hermes => match text.find(hermes::OPEN) {
                Some(at) => {
                    let body = &text[at + hermes::OPEN.len()..];
                    (
                        at,
                        body.find(hermes::CLOSE).map_or(body, |end| &body[..end]),
                        None,
                    )
                }
                None => return Ok(None),
            },
            ToolFormat::Llama3Json => {
                let rest = text.trim_start();
                let rest = rest.strip_prefix(llama::PYTHON_TAG).unwrap_or(rest);
                if !rest.trim_start().starts_with('{') {
                    return Ok(None);
                }
                (0, rest, None)
            }
            ToolFormat::Mistral => match text.find(mistral::MARKER) {
                Some(at) => {
                    let payload = &text[at + mistral::MARKER.len()..];
                    match mistral::named(payload) {
                        Some((name, arguments)) => (at, arguments, Some(name)),
                        None => (at, payload, None),
                    }
                }
                None => return Ok(None),
            },
            // A call is a message of its own: its arguments are what may be wrong.
            ToolFormat::Harmony => {
                return match harmony::malformed(text) {
                    None => Ok(None),
                    Some(malformed) => Err(Box::new(malformed)),
                }
            }
        };
        let arguments = match self {
            ToolFormat::Llama3Json => "parameters",
            ToolFormat::Hermes | ToolFormat::Mistral | ToolFormat::Harmony => "arguments",
        };
        let mut values = serde_json::Deserializer::from_str(payload.trim()).into_iter::<Value>();
        let message = match values.next() {
            Some(Err(error)) => format!("the tool call is not valid JSON: {error}"),
            _ => format!(
                "a tool call in the {} format is a JSON object with a \"name\" string and an \"{arguments}\" object",
                self.name()
            ),
        };
        Err(Box::new(Malformed {
            message,
            call: ToolCall {
                name: name.unwrap_or_else(|| self.name().to_string()),
                arguments: Value::String(payload.trim().to_string()),
                id: None,
            },
            content: content(&text[..at]),
            reasoning: None,
        }))
    }

    /// An answer (a turn without calls) as the format writes it apart from its text: harmony's `final`
    /// messages as its content and `analysis` messages as its reasoning (the text a sampler hands back
    /// runs the channels' names into them); `None` for the other formats, whose answer is its text, and
    /// for a text that holds no harmony message (a sampler's text without its markers).
    pub fn answer(self, text: &str) -> Option<ToolReply> {
        if self != ToolFormat::Harmony {
            return None;
        }
        let messages = harmony::messages(text);
        if messages.is_empty() {
            return None;
        }
        Some(ToolReply {
            content: harmony::content(text, &messages),
            calls: Vec::new(),
            reasoning: harmony::reasoning(text, &messages),
        })
    }

    /// Whether the format's templates render a `tool` message only after the call it answers (Mistral's
    /// by the call's id, harmony's by the last call's function): a tool loop records a malformed call
    /// as a call ([`Malformed::call`]) so that the template can render what answers it.
    pub fn results_follow_calls(self) -> bool {
        matches!(self, ToolFormat::Mistral | ToolFormat::Harmony)
    }

    /// Where a streamed reply must stop being sent as content: the byte where a call starts or may
    /// start in `text` (`text.len()` when none can). For [`ToolFormat::Mistral`], `text` must be
    /// decoded with special tokens, since its marker is one.
    pub fn held_from(self, text: &str) -> usize {
        match self {
            ToolFormat::Hermes => marker_from(text, hermes::OPEN),
            ToolFormat::Llama3Json => whole_reply_from(text, '{'),
            ToolFormat::Mistral => {
                marker_from(text, mistral::MARKER).min(whole_reply_from(text, '['))
            }
            // A call is a message of its own, never in the content's text.
            ToolFormat::Harmony => text.len(),
        }
    }

    /// A Lark grammar (llguidance's) whose sentences are calls of `functions` in this format: one
    /// call, or with `parallel` one or more (harmony's `<|call|>` ends the turn: one call). `token_id`
    /// finds a special token's id (Mistral's `[TOOL_CALLS]`, harmony's markers); `None` when the
    /// format needs one the tokenizer lacks.
    pub fn grammar(
        self,
        functions: &[Function],
        parallel: bool,
        token_id: impl Fn(&str) -> Option<u32>,
    ) -> Result<String, String> {
        if functions.is_empty() {
            return Err("no function to call".into());
        }
        // Per format: the arguments' key, what opens the calls, separates them and closes them.
        let (arguments_key, open, separator, close) = match self {
            ToolFormat::Hermes => ("arguments", String::new(), "\"\\n\"", String::new()),
            ToolFormat::Llama3Json => ("parameters", String::new(), "\"; \"", String::new()),
            ToolFormat::Mistral => {
                let id = token_id(mistral::MARKER).ok_or_else(|| {
                    format!(
                        "the tokenizer has no `{}` token for Mistral's tool calls",
                        mistral::MARKER
                    )
                })?;
                (
                    "arguments",
                    format!("<[{id}]> \"[\" "),
                    "\", \"",
                    " \"]\"".to_string(),
                )
            }
            ToolFormat::Harmony => return harmony::grammar(functions, token_id),
        };
        let alternatives: Vec<Value> = functions
            .iter()
            .map(|function| {
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": function.name},
                        arguments_key: function.parameters,
                    },
                    "required": ["name", arguments_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = match alternatives.len() {
            1 => alternatives.into_iter().next().expect("one"),
            _ => json!({"anyOf": alternatives}),
        };
        let call = format!("%json {}", json_layout(schema));
        let call = match self {
            ToolFormat::Hermes => {
                format!("\"{}\\n\" {call} \"\\n{}\"", hermes::OPEN, hermes::CLOSE)
            }
            _ => call,
        };
        let repeat = if parallel {
            format!(" ({separator} call)*")
        } else {
            String::new()
        };
        Ok(format!("start: {open}call{repeat}{close}\ncall: {call}\n"))
    }
}

/// Where `marker` starts in `text`, or where a suffix of `text` that could begin it starts
/// (`text.len()` when neither).
fn marker_from(text: &str, marker: &str) -> usize {
    if let Some(at) = text.find(marker) {
        return at;
    }
    (1..marker.len())
        .rev()
        .filter(|&len| len <= text.len())
        .find(|&len| {
            text.is_char_boundary(text.len() - len) && marker.starts_with(&text[text.len() - len..])
        })
        .map_or(text.len(), |len| text.len() - len)
}

/// 0 while `text` is blank or starts (after whitespace) with `first`: a format whose call is the whole
/// reply holds it all until the reply is done; `text.len()` otherwise.
fn whole_reply_from(text: &str, first: char) -> usize {
    match text.trim_start().chars().next() {
        None => 0,
        Some(c) if c == first => 0,
        Some(_) => text.len(),
    }
}

/// A call read from a JSON object with `name` (a string) and its arguments under one of
/// `argument_keys` (an object, or a string that holds one, as some models write them).
fn call_from(value: &Value, argument_keys: &[&str]) -> Option<ToolCall> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?.to_string();
    let arguments = argument_keys
        .iter()
        .find_map(|key| object.get(*key))
        .cloned()
        .unwrap_or_else(|| json!({}));
    let arguments = match arguments {
        Value::String(text) => serde_json::from_str::<Value>(&text).ok()?,
        other => other,
    };
    let id = object.get("id").and_then(Value::as_str).map(str::to_string);
    arguments.is_object().then_some(ToolCall {
        name,
        arguments,
        id,
    })
}

/// `text` unless it is only whitespace.
fn content(text: &str) -> Option<String> {
    (!text.trim().is_empty()).then(|| text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tests/fixtures/chat/tool_calls.json`: replies as transformers renders them with the models' own
    /// templates (`scripts/tool_call_fixtures.py`).
    fn rendered(model: &str) -> (String, Vec<ToolCall>) {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/chat/tool_calls.json"
        );
        let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let case = &fixture[model];
        let calls = case["calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|call| ToolCall {
                name: call["name"].as_str().unwrap().to_string(),
                arguments: call["arguments"].clone(),
                id: None,
            })
            .collect();
        (case["reply"].as_str().unwrap().to_string(), calls)
    }

    #[test]
    fn templates_are_told_apart_by_their_markers() {
        let source = |relative: &str| {
            let path = format!(
                "{}/../tests/fixtures/chat/models/{relative}",
                env!("CARGO_MANIFEST_DIR")
            );
            let template = crate::chat::ChatTemplate::from_dir(path).unwrap();
            template
                .template_names()
                .iter()
                .filter_map(|name| template.source(name))
                .collect::<String>()
        };
        assert_eq!(
            ToolFormat::detect(&source("qwen3")),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::detect(&source("qwen2.5")),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::detect(&source("llama3.2")),
            Some(ToolFormat::Llama3Json)
        );
        assert_eq!(ToolFormat::detect(&source("gemma3")), None);
        for (name, format) in ToolFormat::NAMES {
            assert_eq!(ToolFormat::from_name(name), Some(format));
            assert_eq!(format.name(), name);
        }
        assert_eq!(ToolFormat::from_name("pythonic"), None);
    }

    #[test]
    fn qwen_replies_as_their_templates_render_them_parse_back() {
        let (reply, calls) = rendered("qwen2.5");
        let parsed = ToolFormat::Hermes.parse(&reply).unwrap();
        assert_eq!(parsed.calls, calls);
        assert_eq!(parsed.content, None);
        // Qwen3 writes its (empty) thinking first: the text before the calls is the content.
        let (reply, calls) = rendered("qwen3");
        let parsed = ToolFormat::Hermes.parse(&reply).unwrap();
        assert_eq!(parsed.calls, calls);
        assert_eq!(parsed.content.as_deref(), Some("<think>\n\n</think>\n\n"));
    }

    #[test]
    fn llama_replies_as_its_template_renders_them_parse_back() {
        let (reply, calls) = rendered("llama3.2");
        let parsed = ToolFormat::Llama3Json.parse(&reply).unwrap();
        assert_eq!(
            parsed,
            ToolReply {
                content: None,
                calls: calls.clone(),
                reasoning: None,
            }
        );
        let two = format!("<|python_tag|>{reply}; {{\"name\": \"get_time\", \"parameters\": {{\"zone\": \"UTC\"}}}}");
        let parsed = ToolFormat::Llama3Json.parse(&two).unwrap();
        assert_eq!(parsed.calls.len(), 2);
        assert_eq!(parsed.calls[1].arguments, json!({"zone": "UTC"}));
    }

    /// The two forms vLLM's `mistral` parser reads (v3 tokenizers' JSON list, with or without ids,
    /// v11's `name[ARGS]`), and `name[CALL_ID]id[ARGS]` as Mistral Small 3's templates render history;
    /// Mistral Nemo's template rendering the list is in `tests/core/tool_loops.rs`.
    #[test]
    fn mistral_replies_parse_in_both_forms() {
        let list = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}, \"id\": \"a1b2c3d4e\"}]";
        let parsed = ToolFormat::Mistral.parse(list).unwrap();
        assert_eq!(parsed.content, None);
        assert_eq!(
            parsed.calls,
            [
                ToolCall {
                    name: "get_weather".into(),
                    arguments: json!({"city": "Paris"}),
                    id: None,
                },
                ToolCall {
                    name: "get_time".into(),
                    arguments: json!({"zone": "UTC"}),
                    id: Some("a1b2c3d4e".into()),
                },
            ]
        );
        let named = "Let me look.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[CALL_ID]x1y2z3w4v[ARGS]{\"zone\": \"UTC\"}";
        let parsed = ToolFormat::Mistral.parse(named).unwrap();
        assert_eq!(parsed.content.as_deref(), Some("Let me look."));
        assert_eq!(parsed.calls.len(), 2);
        assert_eq!(parsed.calls[0].name, "get_weather");
        assert_eq!(
            (parsed.calls[1].name.as_str(), parsed.calls[1].id.as_deref()),
            ("get_time", Some("x1y2z3w4v"))
        );
    }

    #[test]
    fn text_that_is_not_a_well_formed_call_holds_no_calls() {
        for (format, text) in [
            (ToolFormat::Hermes, "Just an answer."),
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {\n</tool_call>",
            ),
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
            ),
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>",
            ),
            (ToolFormat::Llama3Json, "The answer is {x}."),
            (
                ToolFormat::Llama3Json,
                "{\"name\": \"f\", \"parameters\": {}} and more",
            ),
            (ToolFormat::Mistral, "[TOOL_CALLS][{\"name\": \"f\"]"),
            (ToolFormat::Mistral, "no calls"),
        ] {
            assert_eq!(format.parse(text), None, "{format:?}: {text}");
        }
        // Arguments written as a JSON string are read as the object they hold.
        let parsed = ToolFormat::Hermes
            .parse("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>")
            .unwrap();
        assert_eq!(parsed.calls[0].arguments, json!({"a": 1}));
        // A last block cut before its closing tag is still a call.
        let parsed = ToolFormat::Hermes
            .parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n")
            .unwrap();
        assert_eq!(parsed.calls[0].name, "f");
    }

    #[test]
    fn a_tool_loop_tells_an_answer_from_a_malformed_call() {
        // No call starts: the model answered.
        assert_eq!(ToolFormat::Hermes.read("The answer is 4."), Ok(None));
        assert_eq!(ToolFormat::Llama3Json.read("It is {x}."), Ok(None));
        assert_eq!(ToolFormat::Mistral.read("No calls."), Ok(None));
        let (reply, calls) = rendered("qwen3");
        assert_eq!(
            ToolFormat::Hermes.read(&reply).unwrap().unwrap().calls,
            calls
        );
        // A call starts but is not one: what is wrong, for the model.
        for (format, text, said) in [
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {\n</tool_call>",
                "not valid JSON: EOF while parsing an object",
            ),
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
                "in the hermes format is a JSON object with a \"name\" string and an \"arguments\" object",
            ),
            (
                ToolFormat::Llama3Json,
                "{\"name\": \"f\", \"parameters\": [1]}",
                "\"parameters\" object",
            ),
            (
                ToolFormat::Mistral,
                "[TOOL_CALLS][{\"name\": \"f\"]",
                "not valid JSON",
            ),
        ] {
            let error = format.read(text).unwrap_err().message;
            assert!(error.contains(said), "{format:?} {text}: {error}");
        }
        // What could be read of a malformed call: its function where the format names it apart from
        // the JSON, the text of its arguments, the text before it.
        let malformed = ToolFormat::Mistral
            .read("Let me see.[TOOL_CALLS]get_weather[ARGS]{\"city\": ")
            .unwrap_err();
        assert_eq!(malformed.call.name, "get_weather");
        assert_eq!(malformed.call.arguments, json!("{\"city\":"));
        assert_eq!(malformed.content.as_deref(), Some("Let me see."));
        let malformed = ToolFormat::Harmony
            .read("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": <|call|>")
            .unwrap_err();
        assert_eq!(
            (malformed.call.name.as_str(), &malformed.call.arguments),
            ("f", &json!("{\"a\": "))
        );
        assert_eq!(malformed.reasoning.as_deref(), Some("Hm."));
        assert!(
            malformed.message.contains("not valid JSON"),
            "{malformed:?}"
        );
    }

    #[test]
    fn harmony_answers_are_read_apart_from_their_text() {
        let reply = "<|channel|>analysis<|message|>Sum.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>";
        assert_eq!(
            ToolFormat::Harmony.answer(reply),
            Some(ToolReply {
                content: Some("4".into()),
                calls: Vec::new(),
                reasoning: Some("Sum.".into()),
            })
        );
        // Text without harmony's markers, and the other formats, are answered by their text.
        assert_eq!(
            ToolFormat::Harmony.answer("analysisSum.assistantfinal4"),
            None
        );
        assert_eq!(ToolFormat::Mistral.answer(reply), None);
    }

    #[test]
    fn streams_hold_back_what_may_start_a_call() {
        let hermes = ToolFormat::Hermes;
        assert_eq!(hermes.held_from("Sure.\n<tool_call>\n{"), 6);
        assert_eq!(hermes.held_from("Sure.\n<tool_c"), 6);
        assert_eq!(hermes.held_from("Sure. 3 < 4"), 11);
        assert_eq!(hermes.held_from("a <"), 2);
        assert_eq!(ToolFormat::Llama3Json.held_from("  {\"na"), 0);
        assert_eq!(ToolFormat::Llama3Json.held_from(""), 0);
        assert_eq!(ToolFormat::Llama3Json.held_from("Hello {"), 7);
        assert_eq!(ToolFormat::Mistral.held_from("ok [TOOL_"), 3);
    }

    #[test]
    fn grammars_write_calls_in_each_format() {
        let functions = [
            Function {
                name: "f".into(),
                parameters: json!({"type": "object"}),
            },
            Function {
                name: "g".into(),
                parameters: json!({"type": "object"}),
            },
        ];
        let hermes = ToolFormat::Hermes
            .grammar(&functions, true, |_| None)
            .unwrap();
        assert!(
            hermes.starts_with("start: call (\"\\n\" call)*\ncall: \"<tool_call>\\n\" %json {"),
            "{hermes}"
        );
        assert!(hermes.contains("\"anyOf\""), "{hermes}");
        assert!(hermes.ends_with("} \"\\n</tool_call>\"\n"), "{hermes}");
        let llama = ToolFormat::Llama3Json
            .grammar(&functions[..1], false, |_| None)
            .unwrap();
        assert!(llama.starts_with("start: call\ncall: %json {"), "{llama}");
        assert!(llama.contains("\"parameters\""), "{llama}");
        assert!(ToolFormat::Mistral
            .grammar(&functions, true, |_| None)
            .is_err());
        let mistral = ToolFormat::Mistral
            .grammar(&functions, true, |name| {
                (name == "[TOOL_CALLS]").then_some(5)
            })
            .unwrap();
        assert!(
            mistral.starts_with("start: <[5]> \"[\" call (\", \" call)* \"]\"\n"),
            "{mistral}"
        );
        assert!(ToolFormat::Hermes.grammar(&[], true, |_| None).is_err());
        // Harmony: one call (`<|call|>` ends the turn), its markers by id, one alternative per function.
        let missing = ToolFormat::Harmony.grammar(&functions, true, |_| None);
        assert!(missing.unwrap_err().contains("<|channel|>"));
        let ids = ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"];
        let harmony = ToolFormat::Harmony
            .grammar(&functions, true, |name| {
                ids.iter()
                    .position(|id| *id == name)
                    .map(|at| at as u32 + 1)
            })
            .unwrap();
        assert!(
            harmony.starts_with(
                "start: <[1]> \"commentary to=functions.f \" <[2]> \"json\" <[3]> %json {"
            ),
            "{harmony}"
        );
        assert!(
            harmony.contains("} <[4]>\n     | <[1]> \"commentary to=functions.g \""),
            "{harmony}"
        );
    }
}
