//! OpenAI's harmony format (gpt-oss): a reply is a run of messages, each a header (`<|channel|>` and
//! its name, a recipient `to=…`, a content type) then `<|message|>` and its content, ended by `<|end|>`
//! (more messages follow, each after `<|start|>` and its role), `<|call|>` (a tool call: the turn ends)
//! or `<|return|>` (the turn ends). Tool calls are messages to `functions.NAME`, usually on the
//! `commentary` channel, their content the arguments' JSON. The markers are special tokens, so a reply
//! is read from its decoding with special tokens.
//!
//! [`messages`] reads a reply as openai-harmony's `StreamableParser` reads its tokens (for the
//! assistant, whose `<|start|>assistant` the prompt wrote), and as vLLM reads it after the last token:
//! a reply cut inside a message's content ends that message there; one cut inside a header has no
//! message there. Where harmony's strict parser raises (text between a message's end and the next
//! `<|start|>`, words left over in a header), the reply is read up to there.

use std::ops::Range;

use serde_json::Value;

use super::{Function, Malformed, ToolCall, ToolReply};
use crate::json::json_layout;

pub(super) const START: &str = "<|start|>";
pub(super) const CHANNEL: &str = "<|channel|>";
pub(super) const MESSAGE: &str = "<|message|>";
pub(super) const CONSTRAIN: &str = "<|constrain|>";
pub(super) const CALL: &str = "<|call|>";
const END: &str = "<|end|>";
const RETURN: &str = "<|return|>";
/// The markers that end a message's content (harmony's stop tokens).
const ENDS: [&str; 3] = [END, RETURN, CALL];
/// Every marker of harmony's format: special tokens of gpt-oss's tokenizer.
pub const MARKERS: [&str; 7] = [START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL];
/// What recipients that are functions start with.
pub(super) const FUNCTIONS: &str = "functions.";

/// One message of a harmony reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Its author's role (`assistant` for the first, whose role the prompt wrote).
    pub role: String,
    pub channel: Option<String>,
    pub recipient: Option<String>,
    /// The content type after the recipient (`<|constrain|>json`, `json`).
    pub content_type: Option<String>,
    /// Its content's bytes in the reply, from the end of its `<|message|>`.
    pub content: Range<usize>,
    /// Whether an end marker closed it (else the reply ends inside it).
    pub ended: bool,
}

impl Message {
    /// The function a message calls: its recipient after `functions.`.
    pub fn function(&self) -> Option<&str> {
        self.recipient.as_deref()?.strip_prefix(FUNCTIONS)
    }
}

/// The messages of `reply`, the text an assistant wrote after its prompt's `<|start|>assistant`,
/// decoded with special tokens.
pub fn messages(reply: &str) -> Vec<Message> {
    let mut messages = Vec::new();
    let mut at = 0;
    // The prompt wrote the first message's role; each later one names its own after `<|start|>`.
    let mut role = Some("assistant");
    loop {
        let Some(header_len) = reply[at..].find(MESSAGE) else {
            return messages;
        };
        let Some(header) = header(&reply[at..at + header_len], role) else {
            return messages;
        };
        let start = at + header_len + MESSAGE.len();
        let end = ENDS
            .iter()
            .filter_map(|marker| {
                reply[start..]
                    .find(marker)
                    .map(|len| (start + len, marker.len()))
            })
            .min();
        let Some((end, marker)) = end else {
            messages.push(Message {
                content: start..reply.len(),
                ended: false,
                ..header
            });
            return messages;
        };
        messages.push(Message {
            content: start..end,
            ended: true,
            ..header
        });
        at = end + marker;
        if at == reply.len() {
            return messages;
        }
        let Some(rest) = reply[at..].strip_prefix(START) else {
            return messages;
        };
        at = reply.len() - rest.len();
        role = None;
    }
}

/// A header as harmony parses one (its `parse_header_from_string`): the channel is the word after
/// `<|channel|>` (up to whitespace or `<`); of the words left, the role (when `role` is not known)
/// comes first, the last is a recipient `to=…` or the content type (a lone word not starting with
/// `<|constrain|>` is a recipient), and a word before a content type is the recipient. `None` where
/// harmony refuses the header (no channel after its marker, no role, words left over).
fn header(text: &str, role: Option<&str>) -> Option<Message> {
    let mut text = text.to_string();
    let mut channel = None;
    if let Some(at) = text.find(CHANNEL) {
        let after = &text[at + CHANNEL.len()..];
        let len = after
            .find(|c: char| c.is_whitespace() || c == '<')
            .unwrap_or(after.len());
        if len == 0 {
            return None;
        }
        channel = Some(after[..len].to_string());
        text = format!("{}{}", &text[..at], &after[len..]);
    }
    let text = text.replace(CONSTRAIN, &format!(" {CONSTRAIN}"));
    let mut words: Vec<&str> = text.split_ascii_whitespace().collect();
    let role = match role {
        Some(role) => role.to_string(),
        None => {
            let first = *words.first()?;
            // A word that is no role, followed by more, is a tool's name (harmony's `Role::Tool`).
            const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];
            if ROLES.contains(&first) {
                first.to_string()
            } else if words.len() > 1 || first.starts_with("to=") {
                words.remove(0);
                "tool".to_string()
            } else {
                return None;
            }
        }
    };
    if words.first() == Some(&role.as_str()) {
        words.remove(0);
    }
    let mut recipient = None;
    let mut content_type = None;
    if let Some(last) = words.pop() {
        if let Some(name) = last.strip_prefix("to=") {
            recipient = Some(name.to_string());
        } else if words.is_empty() && !last.starts_with(CONSTRAIN) {
            recipient = Some(last.to_string());
        } else {
            content_type = Some(last.to_string());
            recipient = words
                .pop()
                .map(|word| word.strip_prefix("to=").unwrap_or(word).to_string());
        }
    }
    if !words.is_empty() {
        return None;
    }
    Some(Message {
        role,
        channel,
        recipient,
        content_type,
        content: 0..0,
        ended: false,
    })
}

/// Whether a message is the assistant's reasoning, as vLLM sorts them: on `analysis` and to no
/// function.
fn reasons(message: &Message) -> bool {
    message.role == "assistant"
        && message.function().is_none()
        && message.channel.as_deref() == Some("analysis")
}

/// Whether a message is content shown to the user, as vLLM sorts them: on `final`, or a preamble
/// (`commentary` to no one), and to no function.
fn shows(message: &Message) -> bool {
    message.role == "assistant"
        && message.function().is_none()
        && match message.channel.as_deref() {
            Some("final") => true,
            Some("commentary") => message.recipient.is_none(),
            _ => false,
        }
}

/// The non-empty contents of the messages `which` picks, joined with newlines (vLLM's joining);
/// `None` when there are none.
fn joined(reply: &str, messages: &[Message], which: fn(&Message) -> bool) -> Option<String> {
    let parts: Vec<&str> = messages
        .iter()
        .filter(|message| which(message))
        .map(|message| &reply[message.content.clone()])
        .filter(|text| !text.is_empty())
        .collect();
    (!parts.is_empty()).then(|| parts.join("\n"))
}

/// A reply's reasoning: its `analysis` messages.
pub fn reasoning(reply: &str, messages: &[Message]) -> Option<String> {
    joined(reply, messages, reasons)
}

/// A reply's content: its `final` messages and preambles.
pub fn content(reply: &str, messages: &[Message]) -> Option<String> {
    joined(reply, messages, shows)
}

/// The calls of a reply (its assistant's messages to `functions.NAME`, whatever their channel), and
/// its content; `None` when a call's content is not the JSON of an object.
pub(super) fn parse(reply: &str) -> Option<ToolReply> {
    let messages = messages(reply);
    let calls = messages
        .iter()
        .filter(|message| message.role == "assistant")
        .filter_map(|message| Some((message.function()?, &reply[message.content.clone()])))
        .map(|(name, arguments)| {
            let arguments: Value = serde_json::from_str(arguments).ok()?;
            arguments.is_object().then(|| ToolCall {
                name: name.to_string(),
                arguments,
                id: None,
            })
        })
        .collect::<Option<Vec<ToolCall>>>()?;
    Some(ToolReply {
        content: content(reply, &messages),
        calls,
        reasoning: reasoning(reply, &messages),
    })
}

/// The first call of `reply` that is not well formed: what is wrong, for the model to read, and the
/// call with the text of its arguments.
pub(super) fn malformed(reply: &str) -> Option<Malformed> {
    let messages = messages(reply);
    let (name, arguments, message) = messages.iter().find_map(|message| {
        let name = message.function()?;
        let arguments = &reply[message.content.clone()];
        let wrong = match serde_json::from_str::<Value>(arguments) {
            Err(error) => {
                format!("the arguments of the call of `{name}` are not valid JSON: {error}")
            }
            Ok(value) if !value.is_object() => {
                format!("the arguments of the call of `{name}` must be a JSON object")
            }
            Ok(_) => return None,
        };
        Some((name, arguments, wrong))
    })?;
    Some(Malformed {
        message,
        call: ToolCall {
            name: name.to_string(),
            arguments: Value::String(arguments.to_string()),
            id: None,
        },
        content: content(reply, &messages),
        reasoning: reasoning(reply, &messages),
    })
}

/// A Lark grammar whose sentences are one call of one of `functions`, as gpt-oss writes them:
/// `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>`.
/// `token_id` finds the markers' ids.
pub(super) fn grammar(
    functions: &[Function],
    token_id: impl Fn(&str) -> Option<u32>,
) -> Result<String, String> {
    let marker = |marker: &str| {
        token_id(marker)
            .map(|id| format!("<[{id}]>"))
            .ok_or_else(|| {
                format!("the tokenizer has no `{marker}` token for harmony's tool calls")
            })
    };
    let (channel, constrain, message, call) = (
        marker(CHANNEL)?,
        marker(CONSTRAIN)?,
        marker(MESSAGE)?,
        marker(CALL)?,
    );
    let alternatives: Vec<String> = functions
        .iter()
        .map(|function| {
            let header = Value::String(format!("commentary to={FUNCTIONS}{} ", function.name));
            format!(
                "{channel} {header} {constrain} \"json\" {message} %json {} {call}",
                json_layout(function.parameters.clone())
            )
        })
        .collect();
    Ok(format!("start: {}\n", alternatives.join("\n     | ")))
}

/// A Lark grammar whose sentences are a reply whose `final` message is a sentence of `body` (a Lark
/// expression), as vLLM holds a gpt-oss reply to a structured output once `<|channel|>final<|message|>`
/// is written: any number of `analysis` messages as gpt-oss writes them
/// (`<|channel|>analysis<|message|>…<|end|><|start|>assistant`), then
/// `<|channel|>final<|message|>`, a sentence of `body`, and `<|return|>`. `token_id` finds the
/// markers' ids.
///
/// Where vLLM leaves the model free before the `final` header, this grammar admits `analysis`
/// messages only, so that every reply is one openai-harmony's parser reads and its content is the
/// body alone: a preamble (`commentary` to no one) would be content too, and a call no answer. The
/// final message ends with `<|return|>`, the marker that ends an answer (after `<|end|>` the model
/// could write on; `<|call|>` ends a call). The analysis' text never holds `<|`, so that a tokenizer
/// that spells the markers with ordinary tokens cannot write one inside it (harmony's reading, of the
/// text, would end the message there).
pub fn after_analysis(
    body: &str,
    token_id: impl Fn(&str) -> Option<u32>,
) -> Result<String, String> {
    let marker = |marker: &str| {
        token_id(marker)
            .map(|id| format!("<[{id}]>"))
            .ok_or_else(|| format!("the tokenizer has no `{marker}` token for harmony's channels"))
    };
    let (start, channel, message, end, ret) = (
        marker(START)?,
        marker(CHANNEL)?,
        marker(MESSAGE)?,
        marker(END)?,
        marker(RETURN)?,
    );
    Ok(format!(
        "start: analysis* final\n\
         analysis: {channel} \"analysis\" {message} TEXT? {end} {start} \"assistant\"\n\
         TEXT: /(?s:[^<]|<+[^<|])+/\n\
         final: {channel} \"final\" {message} body {ret}\n\
         body: {body}\n"
    ))
}

/// Where the content of the last message of `reply` may still grow into a marker: the length of its
/// longest tail that is a proper beginning of an end marker (0 when the reply's last message has
/// ended). A streamed reply holds it back.
pub fn unsettled(reply: &str, messages: &[Message]) -> usize {
    match messages.last() {
        Some(last) if !last.ended => {
            let content = &reply[last.content.clone()];
            ENDS.iter()
                .flat_map(|marker| (1..marker.len()).map(move |len| &marker[..len]))
                .filter(|prefix| content.ends_with(prefix))
                .map(str::len)
                .max()
                .unwrap_or(0)
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message as role, channel, recipient, content type, content and whether it ended.
    type Read = (
        String,
        Option<String>,
        Option<String>,
        Option<String>,
        String,
        bool,
    );

    fn read(reply: &str) -> Vec<Read> {
        messages(reply)
            .into_iter()
            .map(|message| {
                (
                    message.role,
                    message.channel,
                    message.recipient,
                    message.content_type,
                    reply[message.content].to_string(),
                    message.ended,
                )
            })
            .collect()
    }

    fn some(text: &str) -> Option<String> {
        Some(text.to_string())
    }

    /// `tests/fixtures/chat/harmony.json` (`scripts/harmony_fixtures.py`): replies rendered by
    /// openai-harmony and the messages its parser reads from their tokens.
    #[test]
    fn messages_are_read_as_openai_harmony_reads_them() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/chat/harmony.json"
        );
        let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = fixture["cases"].as_array().unwrap();
        assert!(cases.len() >= 10);
        for case in cases {
            let reply = case["reply"].as_str().unwrap();
            let ours: Vec<Value> = messages(reply)
                .into_iter()
                .map(|message| {
                    serde_json::json!({
                        "role": message.role,
                        "channel": message.channel,
                        "recipient": message.recipient,
                        "content_type": message.content_type,
                        "text": &reply[message.content],
                    })
                })
                .collect();
            assert_eq!(Value::Array(ours), case["messages"], "{}", case["name"]);
        }
    }

    #[test]
    fn channels_recipients_and_content_types_are_read_from_headers() {
        let reply = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary \
                     to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>";
        let a = "assistant".to_string();
        assert_eq!(
            read(reply),
            [
                (
                    a.clone(),
                    some("analysis"),
                    None,
                    None,
                    "Think.".into(),
                    true
                ),
                (
                    a.clone(),
                    some("commentary"),
                    some("functions.get_weather"),
                    some("<|constrain|>json"),
                    "{\"city\":\"Paris\"}".into(),
                    true
                ),
            ]
        );
        // The recipient before the channel, as harmony renders calls; a content type glued to it.
        let reply = " to=functions.f<|channel|>commentary<|constrain|>json<|message|>{}<|call|>";
        assert_eq!(
            read(reply),
            [(
                a.clone(),
                some("commentary"),
                some("functions.f"),
                some("<|constrain|>json"),
                "{}".into(),
                true
            )]
        );
        // A lone word that is no content type is a recipient (harmony's reading).
        assert_eq!(
            read("<|channel|>commentary json<|message|>x<|return|>"),
            [(
                a.clone(),
                some("commentary"),
                some("json"),
                None,
                "x".into(),
                true
            )]
        );
    }

    #[test]
    fn cut_replies_end_inside_a_message_or_before_one() {
        let a = "assistant".to_string();
        assert_eq!(
            read("<|channel|>analysis<|message|>Thi"),
            [(a.clone(), some("analysis"), None, None, "Thi".into(), false)]
        );
        assert_eq!(
            read("<|channel|>analysis<|message|>T<|end|><|start|>assistant<|channel|>fin"),
            [(a.clone(), some("analysis"), None, None, "T".into(), true)]
        );
        // A message's content holds any other marker as text.
        assert_eq!(
            read("<|channel|>final<|message|>a<|start|>b<|return|>"),
            [(
                a.clone(),
                some("final"),
                None,
                None,
                "a<|start|>b".into(),
                true
            )]
        );
        // What harmony refuses ends the reading: text between messages, words left in a header.
        assert_eq!(read("<|channel|>final<|message|>a<|end|>b").len(), 1);
        assert!(read("<|channel|>final x y z<|message|>a<|end|>").is_empty());
        assert!(read("<|channel|><|message|>a<|end|>").is_empty());
    }

    #[test]
    fn a_streamed_tail_that_may_begin_a_marker_is_unsettled() {
        for (reply, held) in [
            ("<|channel|>final<|message|>ab<|", 2),
            ("<|channel|>final<|message|>ab<|ret", 5),
            ("<|channel|>final<|message|>ab<", 1),
            ("<|channel|>final<|message|>ab", 0),
            ("<|channel|>final<|message|>ab<|end|>", 0),
        ] {
            assert_eq!(unsettled(reply, &messages(reply)), held, "{reply}");
        }
    }
}
