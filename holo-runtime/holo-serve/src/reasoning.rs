//! Reasoning output (`holo serve --reasoning-parser`): the text a model writes between its think markers
//! is its `reasoning`, split out of the chat reply's `content` as vLLM's reasoning parsers split it; a
//! gpt-oss reply's `analysis` channel is its reasoning, read by harmony's channels ([`Harmony`]). Each
//! reply's `reasoning_tokens` are counted as vLLM counts them.

use std::ops::Range;

use holo_core::tools::harmony::{self, Message};
use serde_json::Value;

const START: &str = "<think>";
pub(super) const END: &str = "</think>";

/// How a model marks its reasoning, by vLLM's `--reasoning-parser` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    /// Qwen3 (`qwen3`): `<think>…</think>`, where the chat template may write `<think>` into the prompt
    /// (so only `</think>` is in the reply); `chat_template_kwargs.enable_thinking: false` turns
    /// reasoning off (the template then writes an empty think block into the prompt).
    Qwen3,
    /// DeepSeek-R1 (`deepseek_r1`): `<think>…</think>`, the opening marker optional.
    DeepSeekR1,
    /// gpt-oss (`openai_gptoss`): harmony's `analysis` channel, the reply read by its channels (see
    /// [`holo_core::tools::harmony`]).
    GptOss,
}

impl ReasoningParser {
    /// Every parser, by its vLLM name.
    pub const NAMES: &'static [(&'static str, ReasoningParser)] = &[
        ("qwen3", ReasoningParser::Qwen3),
        ("deepseek_r1", ReasoningParser::DeepSeekR1),
        ("openai_gptoss", ReasoningParser::GptOss),
    ];

    pub fn from_name(name: &str) -> Option<Self> {
        Self::NAMES
            .iter()
            .find(|(known, _)| *known == name)
            .map(|&(_, parser)| parser)
    }

    /// How one chat request's reply is read between think markers, given its `chat_template_kwargs`;
    /// `None` for gpt-oss, whose replies are read by their channels.
    pub(super) fn reading(self, kwargs: Option<&Value>) -> Option<Reading> {
        if self == ReasoningParser::GptOss {
            return None;
        }
        // Qwen3 reads `enable_thinking` as Python does (any false value turns it off); DeepSeek-R1's
        // template has no such switch.
        let disabled = self == ReasoningParser::Qwen3
            && kwargs
                .and_then(|kwargs| kwargs.get("enable_thinking"))
                .is_some_and(|value| match value {
                    Value::Null => true,
                    Value::Bool(on) => !on,
                    Value::Number(number) => number.as_f64() == Some(0.0),
                    Value::String(text) => text.is_empty(),
                    Value::Array(items) => items.is_empty(),
                    Value::Object(map) => map.is_empty(),
                });
        Some(Reading {
            thinking: !disabled,
        })
    }
}

/// How one request's replies are split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Reading {
    /// Whether the model thinks at all; when not, every reply is content.
    pub(super) thinking: bool,
}

/// Where a reply's reasoning and content lie in its text (byte ranges).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Parts {
    pub(super) reasoning: Option<Range<usize>>,
    pub(super) content: Option<Range<usize>>,
}

impl Parts {
    /// The two parts of `text` as strings: `(reasoning, content)`.
    pub(super) fn of(self, text: &str) -> (Option<String>, Option<String>) {
        let part = |range: Option<Range<usize>>| range.map(|range| text[range].to_string());
        (part(self.reasoning), part(self.content))
    }
}

impl Reading {
    /// A whole reply's parts, as vLLM's `extract_reasoning` reads them: a `<think>` that opens the reply
    /// (after whitespace) is skipped; what comes before `</think>` is the reasoning (possibly empty) and
    /// what follows it the content (none when empty); a reply with no `</think>` was cut inside its
    /// reasoning, which is all of it (no content). A model that does not think (Qwen3 with
    /// `enable_thinking: false`) has only content.
    pub(super) fn parts(self, text: &str) -> Parts {
        if !self.thinking {
            return Parts {
                reasoning: None,
                content: Some(0..text.len()),
            };
        }
        let start = opening(text).unwrap_or(0);
        match text[start..].find(END) {
            Some(at) => {
                let end = start + at;
                let content = end + END.len();
                Parts {
                    reasoning: Some(start..end),
                    content: (content < text.len()).then_some(content..text.len()),
                }
            }
            None => Parts {
                reasoning: Some(start..text.len()),
                content: None,
            },
        }
    }

    /// The parts of a reply still being written (`text`, so far) that can be sent now: nothing while
    /// it may still open with `<think>`, then the reasoning less a tail that may begin `</think>`, and
    /// the content once `</think>` has come (all of it from there). Each part only grows as the text
    /// does, and ends as [`Reading::parts`] of the whole reply.
    pub(super) fn settled(self, text: &str) -> Parts {
        if !self.thinking {
            return self.parts(text);
        }
        let Some(start) = opening(text) else {
            return Parts {
                reasoning: Some(0..0),
                content: None,
            };
        };
        if text[start..].contains(END) {
            return self.parts(text);
        }
        Parts {
            reasoning: Some(start..text.len() - partial_marker(&text[start..], END)),
            content: None,
        }
    }
}

/// Where the reasoning of a reply that starts with `text` begins: after the `<think>` that opens it
/// (after whitespace), else at its start; `None` while `text` may still open with one.
fn opening(text: &str) -> Option<usize> {
    let trimmed = text.trim_start();
    if let Some(rest) = trimmed.strip_prefix(START) {
        return Some(text.len() - rest.len());
    }
    (!START.starts_with(trimmed)).then_some(0)
}

impl Reading {
    /// How many of a reply's tokens are reasoning: those that end before its `</think>` (all of a
    /// reply cut inside its reasoning; none when the model does not think). `text` is the reply's
    /// decoding without special tokens and `ends` where each token's text ends in it.
    pub(super) fn reasoning_tokens(self, text: &str, ends: &[usize]) -> usize {
        match self.parts(text).reasoning {
            Some(reasoning) => ends.iter().filter(|&&end| end <= reasoning.end).count(),
            None => 0,
        }
    }
}

/// How a gpt-oss reply is read (vLLM's harmony reading, with `--reasoning-parser openai_gptoss` or
/// `--tool-call-parser openai`): by the channels of its messages, from its decoding with special
/// tokens. Its `final` messages and preambles (`commentary` to no one) are the content; its `analysis`
/// messages the reasoning, reported with the reasoning parser only (vLLM drops them otherwise); its
/// messages to `functions.NAME` the tool calls (read by [`ToolFormat::Harmony`](
/// holo_core::tools::ToolFormat::Harmony)). Several messages of a kind are joined with newlines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Harmony {
    /// Whether the `analysis` messages are reported as `reasoning`.
    pub(super) reasoning: bool,
}

impl Harmony {
    /// A reply's reasoning and content, from its decoding with special tokens (`reply`); with
    /// `streaming`, less a tail of the last message that may still grow into a marker.
    pub(super) fn parts(self, reply: &str, streaming: bool) -> (Option<String>, Option<String>) {
        let mut messages = harmony::messages(reply);
        if streaming {
            let unsettled = harmony::unsettled(reply, &messages);
            if let Some(last) = messages.last_mut() {
                last.content.end -= unsettled;
            }
        }
        let reasoning = match self.reasoning {
            true => harmony::reasoning(reply, &messages),
            false => None,
        };
        (reasoning, harmony::content(reply, &messages))
    }

    /// How many of a reply's tokens are reasoning, as vLLM counts them: those after which harmony's
    /// parser is inside the content of a message on `analysis`, or on `commentary` to a recipient
    /// (a call): from the `<|message|>` that opens it to its last token before the end marker.
    /// `reply` is its decoding with special tokens and `ends` where each token's text ends in it.
    pub(super) fn reasoning_tokens(reply: &str, ends: &[usize]) -> usize {
        let counted = |message: &Message| match message.channel.as_deref() {
            Some("analysis") => true,
            Some("commentary") => message.recipient.is_some(),
            _ => false,
        };
        let spans: Vec<Range<usize>> = harmony::messages(reply)
            .into_iter()
            .filter(counted)
            .map(|message| message.content.start..message.content.end)
            .collect();
        ends.iter()
            .filter(|&&end| {
                spans
                    .iter()
                    .any(|span| span.start <= end && end <= span.end)
            })
            .count()
    }
}

/// The length of the longest tail of `text` that is a proper beginning of `marker`.
fn partial_marker(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&len| text.ends_with(&marker[..len]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const THINKING: Reading = Reading { thinking: true };

    fn split(text: &str) -> (Option<String>, Option<String>) {
        THINKING.parts(text).of(text)
    }

    fn some(text: &str) -> Option<String> {
        Some(text.to_string())
    }

    #[test]
    fn a_whole_reply_splits_at_the_end_marker() {
        assert_eq!(
            split("<think>\nAdd them.\n</think>\n\nFour."),
            (some("\nAdd them.\n"), some("\n\nFour."))
        );
        // The template wrote `<think>` into the prompt: only `</think>` is in the reply.
        assert_eq!(
            split("Add them.</think>Four."),
            (some("Add them."), some("Four."))
        );
        // Cut inside the reasoning: all of it is reasoning, no content.
        assert_eq!(split("<think>Add th"), (some("Add th"), None));
        assert_eq!(split("Add th"), (some("Add th"), None));
        // Nothing after the reasoning: no content; nothing in it: empty reasoning.
        assert_eq!(split("Add them.</think>"), (some("Add them."), None));
        assert_eq!(split("</think>Four."), (some(""), some("Four.")));
        // Only a `<think>` that opens the reply is a marker; a second `</think>` is content.
        assert_eq!(
            split(" \n<think>a</think>b</think>c"),
            (some("a"), some("b</think>c"))
        );
        assert_eq!(split("x<think>a</think>b"), (some("x<think>a"), some("b")));
        // A reply that is only the start of `<think>` is reasoning.
        assert_eq!(split("<thi"), (some("<thi"), None));
    }

    #[test]
    fn qwen3_without_thinking_has_only_content() {
        let off = ReasoningParser::Qwen3
            .reading(Some(&json!({"enable_thinking": false})))
            .unwrap();
        assert_eq!(off, Reading { thinking: false });
        assert_eq!(off.parts("Four.").of("Four."), (None, some("Four.")));
        for on in [
            None,
            Some(json!({})),
            Some(json!({"enable_thinking": true})),
        ] {
            assert_eq!(ReasoningParser::Qwen3.reading(on.as_ref()), Some(THINKING));
        }
        // DeepSeek-R1's template has no switch.
        let kwargs = json!({"enable_thinking": false});
        assert_eq!(
            ReasoningParser::DeepSeekR1.reading(Some(&kwargs)),
            Some(THINKING)
        );
        assert_eq!(ReasoningParser::GptOss.reading(Some(&kwargs)), None);
    }

    #[test]
    fn names_are_vllm_s() {
        assert_eq!(
            ReasoningParser::from_name("qwen3"),
            Some(ReasoningParser::Qwen3)
        );
        assert_eq!(
            ReasoningParser::from_name("deepseek_r1"),
            Some(ReasoningParser::DeepSeekR1)
        );
        assert_eq!(
            ReasoningParser::from_name("openai_gptoss"),
            Some(ReasoningParser::GptOss)
        );
        assert_eq!(ReasoningParser::from_name("qwen"), None);
    }

    /// Streamed a piece at a time (cut at every byte boundary, so `</think>` and `<think>` are split
    /// every way), the settled parts only grow, never show a marker, and end as the whole reply's.
    #[test]
    fn settled_parts_grow_into_the_whole_reply_s() {
        for reply in [
            "<think>\nAdd them.\n</think>\n\nFour.",
            "Add them.</think>Four.",
            "Add <them>.</think></thin",
            "\n<think>a <think> b</think>",
            "x<think>a</think>b",
            "Add th",
            "</think>",
            "<think></think>",
        ] {
            for cut in 0..=reply.len() {
                let mut reasoning = String::new();
                let mut content = String::new();
                let cut_text = &reply[..cut];
                let stages = [
                    (cut_text, THINKING.settled(cut_text)),
                    (reply, THINKING.parts(reply)),
                ];
                for (text, parts) in stages {
                    let (r, c) = parts.of(text);
                    let r = r.unwrap_or_default();
                    let c = c.unwrap_or_default();
                    assert!(r.starts_with(&reasoning), "{reply:?} at {cut}: {r:?}");
                    assert!(c.starts_with(&content), "{reply:?} at {cut}: {c:?}");
                    assert!(!r.contains(END), "{reply:?} at {cut}: {r:?}");
                    reasoning = r;
                    content = c;
                }
                let whole = split(reply);
                assert_eq!(reasoning, whole.0.unwrap_or_default(), "{reply:?}");
                assert_eq!(content, whole.1.unwrap_or_default(), "{reply:?}");
            }
        }
    }

    /// Token ends of a reply cut into `pieces`.
    fn ends(pieces: &[&str]) -> (String, Vec<usize>) {
        let mut text = String::new();
        let ends = pieces
            .iter()
            .map(|piece| {
                text.push_str(piece);
                text.len()
            })
            .collect();
        (text, ends)
    }

    #[test]
    fn reasoning_tokens_are_those_before_the_end_of_reasoning() {
        let (text, at) = ends(&["<think>", "Add", " them", "</", "think>", "Four", "."]);
        assert_eq!(THINKING.reasoning_tokens(&text, &at), 3);
        let (text, at) = ends(&["Add", " th"]);
        assert_eq!(THINKING.reasoning_tokens(&text, &at), 2);
        assert_eq!(Reading { thinking: false }.reasoning_tokens(&text, &at), 0);
    }

    #[test]
    fn harmony_counts_analysis_and_calls_from_their_message_marker() {
        let (reply, at) = ends(&[
            "<|channel|>",
            "analysis",
            "<|message|>",
            "Think",
            " hard",
            "<|end|>",
            "<|start|>",
            "assistant",
            "<|channel|>",
            "commentary",
            " to=functions.f",
            "<|message|>",
            "{}",
            "<|call|>",
        ]);
        // `<|message|>`, `Think`, ` hard`; `<|message|>`, `{}`.
        assert_eq!(Harmony::reasoning_tokens(&reply, &at), 5);
        let (reply, at) = ends(&["<|channel|>", "final", "<|message|>", "Hi", "<|return|>"]);
        assert_eq!(Harmony::reasoning_tokens(&reply, &at), 0);
    }

    #[test]
    fn harmony_parts_are_the_channels_joined() {
        let reply = "<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>analysis\
                     <|message|>B<|end|><|start|>assistant<|channel|>final<|message|>C<|ret";
        let on = Harmony { reasoning: true };
        assert_eq!(on.parts(reply, false), (some("A\nB"), some("C<|ret")));
        assert_eq!(on.parts(reply, true), (some("A\nB"), some("C")));
        assert_eq!(
            Harmony { reasoning: false }.parts(reply, true),
            (None, some("C"))
        );
    }
}
