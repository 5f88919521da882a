//! Streamed answers (`"stream": true`): server-sent events in OpenAI's chunk format, as the sampler
//! reports tokens (see [`Sampler::sample_streaming`](holo_core::Sampler::sample_streaming)).
//!
//! Text is decoded incrementally (tokenizers' stream decoder, special tokens skipped), so a token that
//! holds part of a character waits for the rest. With stop strings, the last `longest stop - 1` bytes are
//! held back until it is clear that no stop string starts there, so a choice never streams text its
//! complete answer would cut. When the sampler's completion arrives, its own text (cut as in a
//! non-streamed answer) ends the choice: the concatenated deltas equal the non-streamed text.

use std::borrow::Cow;
use std::collections::{BTreeSet, VecDeque};
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::weights::Target;
use super::{
    call_id, calls_json, chat_logprobs, completion_logprobs, echo_logprobs, reasoning_tokens,
    unix_time, usage, ApiError, AppState, Choice, Common, Event, Harmony, PromptLogprobs, Reading,
    StreamOptions, Tally,
};
use holo_core::machine::Completion;
use holo_core::sampler::SamplerError;
use holo_core::stop::{first_stop, floor_char_boundary, StopMatcher, StreamedText};
use holo_core::tools::{harmony, ToolCall, ToolFormat};

/// Which endpoint's chunks to write, and whether they carry logprobs.
pub(super) enum Endpoint {
    Completions { logprobs: bool },
    Chat { logprobs: bool },
}

/// The streamed answer to a request whose jobs report on `events`; choice `i` samples `prompts[i / n]`,
/// and with `echo` (completions) first sends `echoed[i / n]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn respond(
    state: Arc<AppState>,
    tally: &Tally,
    target: &Target,
    endpoint: Endpoint,
    common: Common,
    options: StreamOptions,
    prompts: Vec<Vec<u32>>,
    echoed: Vec<String>,
    events: mpsc::UnboundedReceiver<Event>,
) -> Response {
    let streamer = Streamer::new(
        state, tally, target, endpoint, common, options, prompts, echoed, events,
    );
    let stream = futures_util::stream::unfold(streamer, |mut streamer| async move {
        let payload = streamer.next().await?;
        Some((Ok::<_, Infallible>(Sse::default().data(payload)), streamer))
    });
    axum::response::Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

impl Streamer {
    /// The state of a streamed answer whose choices are described as for [`respond`].
    #[allow(clippy::too_many_arguments)]
    fn new(
        state: Arc<AppState>,
        tally: &Tally,
        target: &Target,
        endpoint: Endpoint,
        common: Common,
        options: StreamOptions,
        prompts: Vec<Vec<u32>>,
        echoed: Vec<String>,
        events: mpsc::UnboundedReceiver<Event>,
    ) -> Self {
        let id = state.response_id(
            match endpoint {
                Endpoint::Completions { .. } => "cmpl",
                Endpoint::Chat { .. } => "chatcmpl",
            },
            tally,
        );
        let count = prompts.len() * common.n as usize;
        Streamer {
            id,
            created: unix_time(),
            choices: {
                // One automaton for the request's stop strings; each choice carries its own state in it.
                let matcher = StopMatcher::new(&common.params.stop);
                (0..count)
                    .map(|_| ChoiceStream {
                        matcher: matcher.clone(),
                        reading: common.reading,
                        harmony: common.harmony,
                        // Stop strings cut the reply's text, which harmony's channels do not show.
                        harmony_waits: !common.params.stop.is_empty(),
                        ..ChoiceStream::default()
                    })
                    .collect()
            },
            model: target.name.clone(),
            weight_version: target.version,
            queue: VecDeque::new(),
            opened: false,
            ended: false,
            state,
            endpoint,
            common,
            options,
            prompts,
            echoed,
            events,
        }
    }
}

/// The state of one streamed answer. Dropping it (the client went away) drops the event receiver, which
/// tells the sampler that its jobs are no longer wanted.
struct Streamer {
    id: String,
    created: u64,
    choices: Vec<ChoiceStream>,
    /// The weights the request named, and their version.
    model: String,
    weight_version: u64,
    /// Events written but not yet sent (their `data`).
    queue: VecDeque<String>,
    opened: bool,
    /// `[DONE]` is queued: nothing follows.
    ended: bool,
    state: Arc<AppState>,
    endpoint: Endpoint,
    common: Common,
    options: StreamOptions,
    prompts: Vec<Vec<u32>>,
    /// Per prompt, with `echo`, the text its choices start with.
    echoed: Vec<String>,
    events: mpsc::UnboundedReceiver<Event>,
}

/// What one choice has heard and sent.
#[derive(Default)]
struct ChoiceStream {
    /// Every token reported so far (the completion's, once it has arrived), their logprobs, and their
    /// most likely alternatives (when asked for and reported).
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    top: Vec<Vec<(u32, f32)>>,
    /// The text decoded so far.
    decoded: StreamedText,
    /// The completion's text (its content, with a reasoning parser), once it has arrived.
    completed: Option<String>,
    /// With a reasoning parser: how the reply splits, and its reasoning once the completion has
    /// arrived.
    reading: Option<Reading>,
    completed_reasoning: Option<String>,
    /// With harmony's reading: how the reply splits, and the reply so far decoded with special
    /// tokens (its bytes: a token may end inside a character).
    harmony: Option<Harmony>,
    special: Vec<u8>,
    /// With harmony's reading and stop strings: nothing is sent before the completion.
    harmony_waits: bool,
    /// Bytes of the reasoning sent.
    sent_reasoning: usize,
    /// Bytes of `text` searched for stop strings.
    searched: usize,
    /// The stop strings' automaton, fed the decoded text as it grows, so that a piece costs its own
    /// length; `None` without stop strings (or where the automaton cannot be built: then each piece is
    /// searched for every stop string).
    matcher: Option<StopMatcher>,
    /// Bytes of `text` that may be sent.
    releasable: usize,
    /// The streamed text is final until the completion arrives (a stop string matched, or the decoder
    /// failed).
    held: bool,
    sent_text: usize,
    sent_tokens: usize,
    /// A chunk of this choice has been sent (`prompt_token_ids` go with the first).
    opened: bool,
    /// The character where the completion starts in the choice's text: after its echoed prompt.
    start: usize,
    /// The echoed prompt has been sent.
    echo_sent: bool,
    /// `finish_reason`, `stop_reason`, the token count and (with a reasoning parser) the reasoning
    /// tokens, once the completion has arrived.
    finish: Option<(&'static str, Value, usize, Option<usize>)>,
    /// The tool calls read from the completion, sent after its text and before its finish.
    tool_calls: Vec<ToolCall>,
    calls_sent: bool,
    /// Harmony's calls streamed as they are written: each one's id and the bytes of its arguments sent.
    written_calls: Vec<(String, usize)>,
    finish_sent: bool,
}

impl Streamer {
    /// The next event's `data` to send; `None` after `[DONE]`.
    async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Some(event);
            }
            if self.ended {
                return None;
            }
            self.advance().await;
        }
    }

    /// Waits for what the jobs report, takes everything already queued behind it, and writes one chunk
    /// per choice that has something to send.
    async fn advance(&mut self) {
        if !self.opened {
            self.opened = true;
            self.open();
            return;
        }
        let Some(mut event) = self.events.recv().await else {
            self.fail(ApiError::from_sampler(SamplerError::Unavailable(
                "the batcher stopped before answering".into(),
            )));
            return;
        };
        let mut touched = BTreeSet::new();
        loop {
            match event {
                Event::Token {
                    choice,
                    token,
                    logprob,
                    top,
                } => {
                    self.choices[choice].push(&self.state, &self.common, token, logprob, top);
                    touched.insert(choice);
                }
                Event::Prompt { choice, scored } => {
                    let chunk = self.echo_chunk(choice, Some(&scored));
                    self.queue.push_back(data(&chunk));
                }
                Event::Done { choice, result } => {
                    let unscored = self.common.echo && !self.choices[choice].echo_sent;
                    let finished = result
                        .and_then(|completion| match unscored {
                            true => Err(SamplerError::Malformed(
                                "the sampler reported no prompt log-probabilities".into(),
                            )),
                            false => Ok(completion),
                        })
                        .map_err(ApiError::from_sampler)
                        .and_then(|completion| {
                            self.choices[choice].finish(&self.state, &self.common, completion)
                        });
                    if let Err(error) = finished {
                        self.fail(error);
                        return;
                    }
                    touched.insert(choice);
                }
            }
            match self.events.try_recv() {
                Ok(next) => event = next,
                Err(_) => break,
            }
        }
        for choice in touched {
            if let Some(chunk) = self.chunk(choice) {
                self.queue.push_back(data(&chunk));
            }
            let streams_calls = self.streams_calls(choice);
            if streams_calls && self.choices[choice].finish.is_none() {
                for chunk in self.written_call_chunks(choice, true) {
                    self.queue.push_back(data(&chunk));
                }
            }
            if self.choices[choice].finish.is_some() && self.calls_pending(choice) {
                let chunks = match streams_calls {
                    true => self.written_call_chunks(choice, false),
                    false => self.call_chunks(choice),
                };
                for chunk in chunks {
                    self.queue.push_back(data(&chunk));
                }
                self.choices[choice].calls_sent = true;
                if let Some(chunk) = self.chunk(choice) {
                    self.queue.push_back(data(&chunk));
                }
            }
        }
        if self.choices.iter().all(|choice| choice.finish_sent) {
            if self.options.include_usage {
                let prompt_tokens = self.prompts.iter().map(Vec::len).sum();
                let finished = self
                    .choices
                    .iter()
                    .filter_map(|choice| choice.finish.as_ref());
                let completion_tokens = finished.clone().map(|finish| finish.2).sum();
                let reasoning_tokens = self
                    .state
                    .reasoning_parser
                    .map(|_| finished.filter_map(|finish| finish.3).sum());
                let mut chunk = self.envelope(Vec::new());
                chunk["usage"] = usage(prompt_tokens, completion_tokens, reasoning_tokens);
                self.queue.push_back(data(&chunk));
            }
            self.end();
        }
    }

    /// Chat answers open every choice with the assistant's role, as OpenAI's do; completions that echo
    /// their prompt without its log-probabilities open with the prompt (with them, it waits for them).
    fn open(&mut self) {
        if self.common.echo && self.common.params.prompt_logprobs.is_none() {
            for index in 0..self.choices.len() {
                let chunk = self.echo_chunk(index, None);
                self.queue.push_back(data(&chunk));
            }
        }
        if let Endpoint::Chat { .. } = self.endpoint {
            for index in 0..self.choices.len() {
                let mut choice = json!({
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                });
                if self.common.return_token_ids {
                    choice["token_ids"] = json!([]);
                }
                let mut chunk = self.envelope(vec![choice]);
                if index == 0 && self.common.return_token_ids {
                    chunk["prompt_token_ids"] = json!(self.prompts[0]);
                }
                self.usage_so_far(&mut chunk, index);
                self.queue.push_back(data(&chunk));
                self.choices[index].opened = true;
            }
        }
    }

    /// Choice `index`'s echoed prompt, its first chunk: the prompt's text and, when the sampler scored
    /// it, its `logprobs` (see [`echo_logprobs`]).
    fn echo_chunk(&mut self, index: usize, scored: Option<&PromptLogprobs>) -> Value {
        let common = &self.common;
        let prompt = &self.prompts[index / common.n as usize];
        let logprobs = match scored {
            Some(scored) => echo_logprobs(&self.state, common, (prompt, scored), &[], &[], &[]),
            None => Value::Null,
        };
        let mut out = json!({
            "index": index,
            "text": self.echoed[index / common.n as usize],
            "logprobs": logprobs,
            "finish_reason": null,
            "stop_reason": null,
        });
        if common.return_token_ids {
            out["token_ids"] = json!([]);
            out["prompt_token_ids"] = json!(prompt);
        }
        let bytes: Vec<u8> = prompt
            .iter()
            .flat_map(|&id| self.state.vocab.bytes(id))
            .collect();
        let choice = &mut self.choices[index];
        choice.start = String::from_utf8_lossy(&bytes).chars().count();
        choice.opened = true;
        choice.echo_sent = true;
        let mut chunk = self.envelope(vec![out]);
        self.usage_so_far(&mut chunk, index);
        chunk
    }

    /// The chunk that sends what choice `index` has not sent yet, if it has anything.
    fn chunk(&mut self, index: usize) -> Option<Value> {
        let common = &self.common;
        let choice = &self.choices[index];
        let (reasoning, text) = choice.available();
        let reasoning = &reasoning[choice.sent_reasoning.min(reasoning.len())..];
        let text = &text[choice.sent_text.min(text.len())..];
        // As vLLM: with the reasoning left out, so are the per-token details that would show it.
        let hidden = self.state.reasoning_parser.is_some() && !common.include_reasoning;
        let shown_reasoning = if hidden { "" } else { reasoning };
        let tokens = choice.sent_tokens..choice.tokens.len();
        let wants_logprobs = match self.endpoint {
            Endpoint::Completions { logprobs } | Endpoint::Chat { logprobs } => logprobs && !hidden,
        };
        let return_token_ids = common.return_token_ids && !hidden;
        let has_logprobs = choice.logprobs.len() >= tokens.end;
        // A choice with tool calls sends its text, then its calls, then its finish.
        let finishing =
            choice.finish.is_some() && !choice.finish_sent && !self.calls_pending(index);
        let per_token = (wants_logprobs || return_token_ids) && !tokens.is_empty();
        if text.is_empty() && shown_reasoning.is_empty() && !per_token && !finishing {
            return None;
        }
        let logprobs = if wants_logprobs && has_logprobs && !tokens.is_empty() {
            match self.endpoint {
                Endpoint::Completions { .. } => completion_logprobs(
                    &self.state,
                    common,
                    &choice.tokens[..tokens.end],
                    &choice.logprobs[..tokens.end],
                    choice.top.get(..tokens.end).unwrap_or(&[]),
                    (tokens.start, choice.start),
                ),
                Endpoint::Chat { .. } => chat_logprobs(
                    &self.state,
                    common,
                    &choice.tokens[tokens.clone()],
                    &choice.logprobs[tokens.clone()],
                    choice.top.get(tokens.clone()).unwrap_or(&[]),
                ),
            }
        } else {
            Value::Null
        };
        let (finish_reason, stop_reason) = match (&choice.finish, finishing) {
            (Some((finish_reason, stop_reason, ..)), true) => {
                (json!(finish_reason), stop_reason.clone())
            }
            _ => (Value::Null, Value::Null),
        };
        let mut out = match self.endpoint {
            Endpoint::Completions { .. } => json!({
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }),
            Endpoint::Chat { .. } => {
                // vLLM's deltas: the reasoning, then the content, each when there is some.
                let mut delta = Map::new();
                if !shown_reasoning.is_empty() {
                    delta.insert("reasoning".into(), json!(shown_reasoning));
                }
                if !text.is_empty() || (delta.is_empty() && !finishing) {
                    delta.insert("content".into(), json!(text));
                }
                json!({
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                })
            }
        };
        if return_token_ids {
            out["token_ids"] = json!(choice.tokens[tokens.clone()]);
            if !choice.opened {
                out["prompt_token_ids"] = json!(self.prompts[index / common.n as usize]);
            }
        }
        let sent_text = choice.sent_text + text.len();
        let sent_reasoning = choice.sent_reasoning + reasoning.len();
        let choice = &mut self.choices[index];
        choice.sent_text = sent_text;
        choice.sent_reasoning = sent_reasoning;
        choice.sent_tokens = tokens.end;
        choice.opened = true;
        choice.finish_sent |= finishing;
        let mut chunk = self.envelope(vec![out]);
        self.usage_so_far(&mut chunk, index);
        Some(chunk)
    }

    /// Choice `index`'s tool calls as OpenAI streams them: per call, a chunk that opens it (`index`,
    /// `id`, `type`, `function.name`, empty `function.arguments`), then one with its arguments.
    fn call_chunks(&self, index: usize) -> Vec<Value> {
        let calls = calls_json(&self.state, &self.choices[index].tool_calls);
        let mut chunks = Vec::with_capacity(2 * calls.len());
        for (number, call) in calls.into_iter().enumerate() {
            let opening = call_opening(number, &call["id"], &call["function"]["name"]);
            let arguments = call_arguments(number, &call["function"]["arguments"]);
            for delta in [opening, arguments] {
                chunks.push(self.call_chunk(index, delta));
            }
        }
        chunks
    }

    /// A chunk of choice `index` carrying one tool call's `delta`.
    fn call_chunk(&self, index: usize, delta: Value) -> Value {
        let choice = json!({
            "index": index,
            "delta": {"tool_calls": [delta]},
            "logprobs": null,
            "finish_reason": null,
        });
        let mut chunk = self.envelope(vec![choice]);
        self.usage_so_far(&mut chunk, index);
        chunk
    }

    /// Whether choice `index` has calls still to send before its finish: its answer's calls, or, where
    /// calls stream as they are written, whatever of them the last tokens wrote (those may arrive with
    /// the finish, and a call whose arguments are not JSON is streamed although the answer has none).
    fn calls_pending(&self, index: usize) -> bool {
        let choice = &self.choices[index];
        !choice.calls_sent && (!choice.tool_calls.is_empty() || self.streams_calls(index))
    }

    /// Whether choice `index` streams harmony's calls as they are written (vLLM streams their
    /// arguments): with tools read in harmony's format, and unless stop strings hold the reply back.
    fn streams_calls(&self, index: usize) -> bool {
        let choice = &self.choices[index];
        self.common.tool_format == Some(ToolFormat::Harmony)
            && choice.harmony.is_some()
            && !choice.harmony_waits
    }

    /// Choice `index`'s harmony calls written since the last chunks: per call whose header is written,
    /// a chunk that opens it (`index`, `id`, `type`, `function.name`, empty `function.arguments`), then
    /// its arguments as they settle (`streaming`: less a tail that may still grow into an end marker),
    /// as the model wrote them.
    fn written_call_chunks(&mut self, index: usize, streaming: bool) -> Vec<Value> {
        let written = self.choices[index].written(streaming);
        let mut deltas = Vec::new();
        for (number, (name, arguments)) in written.into_iter().enumerate() {
            if number == self.choices[index].written_calls.len() {
                let id = call_id(&self.state);
                deltas.push(call_opening(number, &json!(id), &json!(name)));
                self.choices[index].written_calls.push((id, 0));
            }
            let sent = &mut self.choices[index].written_calls[number].1;
            if arguments.len() > *sent {
                deltas.push(call_arguments(number, &json!(&arguments[*sent..])));
                *sent = arguments.len();
            }
        }
        deltas
            .into_iter()
            .map(|delta| self.call_chunk(index, delta))
            .collect()
    }

    /// A chunk of this answer holding `choices`.
    fn envelope(&self, choices: Vec<Value>) -> Value {
        let object = match self.endpoint {
            Endpoint::Completions { .. } => "text_completion",
            Endpoint::Chat { .. } => "chat.completion.chunk",
        };
        let mut chunk = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "weight_version": self.weight_version,
            "choices": choices,
        });
        if self.options.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// With `continuous_usage_stats` (and `include_usage`, as vLLM asks), choice `index`'s usage so far.
    fn usage_so_far(&self, chunk: &mut Value, index: usize) {
        if self.options.include_usage && self.options.continuous_usage_stats {
            let prompt = &self.prompts[index / self.common.n as usize];
            let tokens = &self.choices[index].tokens;
            let reasoning = self
                .state
                .reasoning_parser
                .map(|_| reasoning_tokens(&self.state, &self.common, tokens));
            chunk["usage"] = usage(prompt.len(), tokens.len(), reasoning);
        }
    }

    /// Ends the stream with `error` (OpenAI's clients raise it).
    fn fail(&mut self, error: ApiError) {
        self.queue.push_back(data(&error.body()));
        self.end();
    }

    fn end(&mut self) {
        self.queue.push_back("[DONE]".into());
        self.ended = true;
    }
}

impl ChoiceStream {
    /// The text so far: decoded, then the completion's once it has arrived.
    fn text(&self) -> &str {
        self.completed
            .as_deref()
            .unwrap_or_else(|| self.decoded.text())
    }

    /// The reasoning and the content that may be sent by now (each grows as a prefix of itself): the
    /// releasable text split by the reasoning parser (its settled parts while the reply is written),
    /// the channels of the reply so far with harmony's reading, or without either all of it as
    /// content.
    fn available(&self) -> (Cow<'_, str>, Cow<'_, str>) {
        if let (Some(harmony), None) = (self.harmony, &self.completed) {
            if self.harmony_waits {
                return (Cow::Borrowed(""), Cow::Borrowed(""));
            }
            // A token that ends inside a character waits for the rest of it.
            let valid = match std::str::from_utf8(&self.special) {
                Ok(reply) => reply,
                Err(error) => std::str::from_utf8(&self.special[..error.valid_up_to()])
                    .expect("valid up to there"),
            };
            let (reasoning, content) = harmony.parts(valid, true);
            return (
                Cow::Owned(reasoning.unwrap_or_default()),
                Cow::Owned(content.unwrap_or_default()),
            );
        }
        let text = &self.text()[..self.releasable.max(self.sent_text)];
        let split = self.reading.is_some() || self.harmony.is_some();
        match (self.reading, &self.completed) {
            (Some(reading), None) => {
                let parts = reading.settled(text);
                let part = |range: Option<std::ops::Range<usize>>| range.map_or("", |r| &text[r]);
                (
                    Cow::Borrowed(part(parts.reasoning)),
                    Cow::Borrowed(part(parts.content)),
                )
            }
            (_, Some(_)) if split => (
                Cow::Borrowed(self.completed_reasoning.as_deref().unwrap_or("")),
                Cow::Borrowed(text),
            ),
            _ => (Cow::Borrowed(""), Cow::Borrowed(text)),
        }
    }

    /// With harmony's reading: the calls written so far (the assistant's messages to `functions.NAME`),
    /// each its function's name and the text of its arguments; with `streaming`, less a tail of the
    /// last message that may still grow into an end marker.
    fn written(&self, streaming: bool) -> Vec<(String, String)> {
        let reply = match std::str::from_utf8(&self.special) {
            Ok(reply) => reply,
            Err(error) => std::str::from_utf8(&self.special[..error.valid_up_to()])
                .expect("valid up to there"),
        };
        let mut messages = harmony::messages(reply);
        if streaming {
            let unsettled = harmony::unsettled(reply, &messages);
            if let Some(last) = messages.last_mut() {
                last.content.end -= unsettled;
            }
        }
        messages
            .iter()
            .filter(|message| message.role == "assistant")
            .filter_map(|message| {
                let name = message.function()?;
                Some((name.to_string(), reply[message.content.clone()].to_string()))
            })
            .collect()
    }

    fn push(
        &mut self,
        state: &AppState,
        common: &Common,
        token: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
    ) {
        self.tokens.push(token);
        self.logprobs.push(logprob);
        if !top.is_empty() {
            self.top.push(top);
        }
        if self.harmony.is_some() {
            self.special.extend(state.vocab.bytes(token));
        }
        if self.held || self.finish.is_some() {
            return;
        }
        match self.decoded.push(&state.tokenizer, token) {
            Ok(Some(_)) => {}
            Ok(None) => return,
            // The completion's text will say what the decoder could not.
            Err(_) => {
                self.held = true;
                return;
            }
        }
        self.release(common);
    }

    /// Moves `releasable` as far as the stop strings allow (the sampler's rule: the match that ends
    /// first wins).
    fn release(&mut self, common: &Common) {
        let stops = &common.params.stop;
        let text = self.decoded.text();
        // What may start a tool call waits for the completion, which says whether it is one. A format
        // whose marker is a special token (Mistral's `[TOOL_CALLS]`) has it nowhere in this text, which
        // is decoded without them: all of it waits.
        // With a reasoning parser only the content is read for calls: the reasoning never waits.
        let content = match self.reading {
            None => 0,
            Some(reading) => reading
                .settled(text)
                .content
                .map_or(text.len(), |content| content.start),
        };
        let callable = match common.tool_format {
            None => text.len(),
            Some(format) if format.reads_special_tokens() => content,
            Some(format) => content + format.held_from(&text[content..]),
        };
        let Some(longest) = stops.iter().map(String::len).max() else {
            self.releasable = self.releasable.max(callable);
            return;
        };
        // Only a piece in which a stop string ends is searched for which one (once per choice).
        let ends_here = self
            .matcher
            .as_mut()
            .is_none_or(|matcher| matcher.feed(&text[self.searched..]));
        let found = if ends_here {
            first_stop(text, self.searched, stops)
        } else {
            None
        };
        let releasable = match found {
            Some((at, stop)) => {
                self.held = true;
                if common.include_stop {
                    at + stop.len()
                } else {
                    at
                }
            }
            None if common.include_stop => text.len(),
            None => floor_char_boundary(text, text.len().saturating_sub(longest - 1)),
        };
        self.searched = text.len();
        self.releasable = self.releasable.max(releasable.min(callable));
    }

    /// The sampler's completion: its tokens, logprobs and text (cut as a non-streamed answer cuts it)
    /// replace what was decoded on the way.
    fn finish(
        &mut self,
        state: &AppState,
        common: &Common,
        completion: Completion,
    ) -> Result<(), ApiError> {
        let choice = Choice::new(state, &completion, common)?;
        if !completion.tokens.is_empty() {
            if !completion.tokens.starts_with(&self.tokens) {
                return Err(ApiError::from_sampler(SamplerError::Malformed(format!(
                    "the sampler streamed {} tokens that do not begin its completion",
                    self.tokens.len()
                ))));
            }
            self.tokens = completion.tokens.clone();
            self.logprobs = completion.logprobs.clone();
            self.top = completion.top_logprobs.clone();
            if self.harmony.is_some() {
                self.special = self
                    .tokens
                    .iter()
                    .flat_map(|&token| state.vocab.bytes(token))
                    .collect();
            }
        }
        // A sampler whose text is not the decoding of its tokens cannot take back what was sent: the
        // choice then ends with what it streamed.
        let (reasoning, content) = self.available();
        let sent_reasoning = reasoning[..self.sent_reasoning.min(reasoning.len())].to_string();
        let sent_content = content[..self.sent_text.min(content.len())].to_string();
        let final_reasoning = choice.reasoning.unwrap_or_default();
        if choice.text.starts_with(&sent_content) && final_reasoning.starts_with(&sent_reasoning) {
            self.releasable = choice.text.len();
            self.completed = Some(choice.text);
            self.completed_reasoning = Some(final_reasoning);
        } else {
            self.releasable = self.sent_text;
            self.completed = Some(sent_content);
            self.completed_reasoning = Some(sent_reasoning);
        }
        self.finish = Some((
            choice.finish_reason,
            choice.stop_reason,
            choice.token_count,
            choice.reasoning_tokens,
        ));
        self.tool_calls = choice.tool_calls;
        Ok(())
    }
}

fn data(chunk: &Value) -> String {
    chunk.to_string()
}

/// The delta that opens tool call `number`: its id, type and function name, no arguments yet.
fn call_opening(number: usize, id: &Value, name: &Value) -> Value {
    json!({
        "index": number,
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    })
}

/// A delta of tool call `number`'s arguments.
fn call_arguments(number: usize, arguments: &Value) -> Value {
    json!({"index": number, "function": {"arguments": arguments}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fields::{common, Fields};
    use crate::reasoning::ReasoningParser;
    use crate::{ServeConfig, ServedModel, Server};
    use holo_core::chat::ChatTemplate;
    use holo_core::machine::Finish;
    use holo_core::sampler::{Request, SampleFuture, Sampler};
    use tokenizers::Tokenizer;

    /// A sampler never asked: the test reports the tokens itself.
    struct Unasked;

    impl Sampler for Unasked {
        fn sample<'a>(&'a self, _batch: &'a [Request]) -> SampleFuture<'a> {
            Box::pin(async { unreachable!("the test reports the tokens itself") })
        }
    }

    fn fixture_tokenizer() -> Tokenizer {
        Tokenizer::from_file(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/holophore/tokenizer.json"
        ))
        .unwrap()
    }

    /// A chat stream of one choice over `tokenizer` with the reasoning parser `parser`, read as
    /// `read` says, and the sender its tokens go through; its role chunk already taken.
    async fn chat_stream(
        tokenizer: Tokenizer,
        parser: ReasoningParser,
        read: impl FnOnce(&mut Common),
    ) -> (Streamer, mpsc::UnboundedSender<Event>) {
        let mut model = ServedModel::new("m", Arc::new(Unasked), tokenizer, ChatTemplate::chatml());
        model.reasoning_parser = Some(parser);
        let server = Server::bind("127.0.0.1:0", model, ServeConfig::default())
            .await
            .unwrap();
        let state = Arc::clone(&server.state);
        let tally = Tally::new(&axum::http::Request::new(()));
        let body = serde_json::Map::from_iter([("stream".to_string(), json!(true))]);
        let fields = Fields(&body);
        let target = state.target(&fields, &tally).unwrap();
        let mut asked = common(&fields, true).unwrap();
        read(&mut asked);
        let options = asked.stream.unwrap();
        let (sender, events) = mpsc::unbounded_channel();
        let mut streamer = Streamer::new(
            state,
            &tally,
            &target,
            Endpoint::Chat { logprobs: false },
            asked,
            options,
            vec![vec![1]],
            Vec::new(),
            events,
        );
        let role = streamer.next().await.unwrap();
        assert!(role.contains("\"role\":\"assistant\""), "{role}");
        (streamer, sender)
    }

    /// After each of `tokens`, the delta it released (`None`: no chunk).
    async fn deltas_token_by_token(
        streamer: &mut Streamer,
        sender: &mpsc::UnboundedSender<Event>,
        tokens: &[u32],
    ) -> Vec<Option<Value>> {
        let mut deltas = Vec::new();
        for &token in tokens {
            let event = Event::Token {
                choice: 0,
                token,
                logprob: -1.0,
                top: Vec::new(),
            };
            sender.send(event).unwrap();
            streamer.advance().await;
            let chunk: Option<Value> = streamer
                .queue
                .pop_front()
                .map(|payload| serde_json::from_str(&payload).unwrap());
            assert!(streamer.queue.is_empty());
            deltas.push(chunk.map(|chunk| chunk["choices"][0]["delta"].clone()));
        }
        deltas
    }

    /// Ends the stream with `text` and `tokens` as its completion: the last chunk's `delta` and
    /// `finish_reason`.
    async fn finished(
        streamer: &mut Streamer,
        sender: &mpsc::UnboundedSender<Event>,
        text: &str,
        tokens: &[u32],
    ) -> (Value, Value) {
        let completion = Completion {
            text: text.into(),
            tokens: tokens.to_vec(),
            logprobs: vec![-1.0; tokens.len()],
            top_logprobs: Vec::new(),
            finish: Finish::EndOfTurn,
            routes: Vec::new(),
            weight_version: None,
            constraint: None,
        };
        sender
            .send(Event::Done {
                choice: 0,
                result: Ok(completion),
            })
            .unwrap();
        streamer.advance().await;
        let last: Value = serde_json::from_str(&streamer.queue.pop_front().unwrap()).unwrap();
        assert_eq!(streamer.queue.pop_front().as_deref(), Some("[DONE]"));
        let choice = &last["choices"][0];
        (choice["delta"].clone(), choice["finish_reason"].clone())
    }

    /// The fixture tokenizer with harmony's markers as special tokens, as gpt-oss's tokenizer has them.
    fn harmony_tokenizer() -> Tokenizer {
        let mut tokenizer = fixture_tokenizer();
        let markers = [
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|call|>",
            "<|return|>",
        ];
        tokenizer
            .add_special_tokens(markers.map(|marker| tokenizers::AddedToken::from(marker, true)))
            .unwrap();
        tokenizer
    }

    /// A chat stream reading harmony's channels and tool calls (`--reasoning-parser openai_gptoss
    /// --tool-call-parser openai`).
    async fn harmony_tool_stream(
        tokenizer: &Tokenizer,
    ) -> (Streamer, mpsc::UnboundedSender<Event>) {
        chat_stream(tokenizer.clone(), ReasoningParser::GptOss, |asked| {
            asked.harmony = Some(Harmony { reasoning: true });
            asked.tool_format = Some(ToolFormat::Harmony);
        })
        .await
    }

    /// A harmony call whose tokens arrive with the finish, in one batch of events, is streamed all the
    /// same, before the finish: also when its arguments are not JSON, so that the answer has no calls
    /// (vLLM streams it too, and the finish stays `stop`).
    #[tokio::test]
    async fn harmony_calls_that_arrive_with_the_finish_are_streamed_before_it() {
        let tokenizer = harmony_tokenizer();
        for (arguments, finish) in [
            ("{\"city\": \"Paris\"}", "tool_calls"),
            ("{city: Paris}", "stop"),
        ] {
            let reply = format!(
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
                 {arguments}<|call|>"
            );
            let tokens = tokenizer
                .encode(reply.as_str(), false)
                .unwrap()
                .get_ids()
                .to_vec();
            let (mut streamer, sender) = harmony_tool_stream(&tokenizer).await;
            for &token in &tokens {
                let event = Event::Token {
                    choice: 0,
                    token,
                    logprob: -1.0,
                    top: Vec::new(),
                };
                sender.send(event).unwrap();
            }
            let text = tokenizer.decode(&tokens, true).unwrap();
            let completion = Completion {
                text,
                tokens: tokens.clone(),
                logprobs: vec![-1.0; tokens.len()],
                top_logprobs: Vec::new(),
                finish: Finish::EndOfTurn,
                routes: Vec::new(),
                weight_version: None,
                constraint: None,
            };
            let done = Event::Done {
                choice: 0,
                result: Ok(completion),
            };
            sender.send(done).unwrap();
            streamer.advance().await;
            let chunks: Vec<Value> = std::iter::from_fn(|| streamer.queue.pop_front())
                .take_while(|payload| payload != "[DONE]")
                .map(|payload| serde_json::from_str(&payload).unwrap())
                .collect();
            let choices: Vec<&Value> = chunks.iter().map(|chunk| &chunk["choices"][0]).collect();
            let calls: Vec<&Value> = choices
                .iter()
                .filter_map(|choice| choice["delta"]["tool_calls"].as_array())
                .map(|calls| &calls[0])
                .collect();
            assert_eq!(calls.len(), 2, "{arguments}: {chunks:#?}");
            assert_eq!(calls[0]["function"]["name"], "get_weather");
            assert_eq!(calls[1]["function"]["arguments"], arguments);
            let last = choices.last().unwrap();
            assert_eq!(last["finish_reason"], finish, "{arguments}: {chunks:#?}");
            assert!(last["delta"].get("tool_calls").is_none(), "{chunks:#?}");
        }
    }

    fn reasoning(text: &str) -> Option<Value> {
        Some(json!({"reasoning": text}))
    }

    fn content(text: &str) -> Option<Value> {
        Some(json!({"content": text}))
    }

    /// Streamed a token at a time, with `</think>` spelled by three tokens, each chunk sends what is
    /// settled: reasoning while the marker may still be coming, never a piece of it, then the content.
    #[tokio::test]
    async fn reasoning_streams_a_token_at_a_time() {
        let tokenizer = fixture_tokenizer();
        let reply = "Add two.</think>Four.";
        let tokens = tokenizer.encode(reply, false).unwrap().get_ids().to_vec();
        let pieces: Vec<String> = tokens
            .iter()
            .map(|&id| tokenizer.decode(&[id], false).unwrap())
            .collect();
        assert_eq!(pieces[4..7], ["</", "think", ">"], "{pieces:?}");
        let (mut streamer, sender) = chat_stream(tokenizer, ReasoningParser::Qwen3, |asked| {
            asked.reading = ReasoningParser::Qwen3.reading(None)
        })
        .await;
        let deltas = deltas_token_by_token(&mut streamer, &sender, &tokens).await;
        assert_eq!(
            deltas,
            [
                reasoning("A"),
                reasoning("dd"),
                reasoning(" two"),
                reasoning("."),
                // `</`, `think` and `>`: the marker, held until whole, then dropped.
                None,
                None,
                None,
                content("F"),
                content("our"),
                content("."),
            ]
        );
        let last = finished(&mut streamer, &sender, reply, &tokens).await;
        assert_eq!(last, (json!({}), json!("stop")));
    }

    /// A gpt-oss reply streamed a token at a time (harmony's markers special tokens, which the text
    /// lacks): its analysis as reasoning, its final message as content, vLLM's deltas, and nothing for
    /// the markers and header words.
    #[tokio::test]
    async fn harmony_streams_a_token_at_a_time() {
        let tokenizer = harmony_tokenizer();
        let reply =
            "<|channel|>analysis<|message|>Add two.<|end|><|start|>assistant<|channel|>final\
                     <|message|>Four.<|return|>";
        let tokens = tokenizer.encode(reply, false).unwrap().get_ids().to_vec();
        let pieces: Vec<String> = tokens
            .iter()
            .map(|&id| tokenizer.decode(&[id], false).unwrap())
            .collect();
        let (mut streamer, sender) =
            chat_stream(tokenizer.clone(), ReasoningParser::GptOss, |asked| {
                asked.harmony = Some(Harmony { reasoning: true })
            })
            .await;
        let deltas = deltas_token_by_token(&mut streamer, &sender, &tokens).await;
        let shown: Vec<(&str, Option<Value>)> = pieces
            .iter()
            .map(String::as_str)
            .zip(deltas)
            .filter(|(_, delta)| delta.is_some())
            .collect();
        assert_eq!(
            shown,
            [
                ("A", reasoning("A")),
                ("dd", reasoning("dd")),
                (" two", reasoning(" two")),
                (".", reasoning(".")),
                ("F", content("F")),
                ("our", content("our")),
                (".", content(".")),
            ],
            "{pieces:?}"
        );
        let text = tokenizer.decode(&tokens, true).unwrap();
        let last = finished(&mut streamer, &sender, &text, &tokens).await;
        assert_eq!(last, (json!({}), json!("stop")));
    }

    /// A gpt-oss call streamed a token at a time with harmony's tool calls: its analysis as reasoning,
    /// then, as vLLM streams them, the call opened once its header is written and its arguments as
    /// they are written, which put together are the arguments the model wrote; then the finish.
    #[tokio::test]
    async fn harmony_calls_stream_as_they_are_written() {
        let tokenizer = harmony_tokenizer();
        let arguments = "{\"city\": \"Paris\"}";
        let reply = format!(
            "<|channel|>analysis<|message|>Look.<|end|><|start|>assistant<|channel|>commentary \
             to=functions.get_weather <|constrain|>json<|message|>{arguments}<|call|>"
        );
        let tokens = tokenizer
            .encode(reply.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        let (mut streamer, sender) = harmony_tool_stream(&tokenizer).await;
        let deltas: Vec<Value> = deltas_token_by_token(&mut streamer, &sender, &tokens)
            .await
            .into_iter()
            .flatten()
            .collect();
        let reasoning: String = deltas
            .iter()
            .filter_map(|delta| delta["reasoning"].as_str())
            .collect();
        assert_eq!(reasoning, "Look.");
        let calls: Vec<&Value> = deltas
            .iter()
            .filter_map(|delta| delta["tool_calls"].as_array())
            .map(|calls| &calls[0])
            .collect();
        let opening = calls[0];
        assert_eq!(opening["index"], 0);
        assert_eq!(opening["type"], "function");
        assert_eq!(opening["function"]["name"], "get_weather");
        assert_eq!(opening["function"]["arguments"], "");
        assert!(opening["id"].as_str().unwrap().starts_with("call_"));
        // The arguments came in more than one piece, each after the call was opened.
        assert!(calls.len() > 2, "{calls:?}");
        let written: String = calls[1..]
            .iter()
            .map(|call| {
                assert_eq!(call["index"], 0);
                call["function"]["arguments"].as_str().unwrap()
            })
            .collect();
        assert_eq!(written, arguments);
        assert!(deltas.iter().all(|delta| delta.get("content").is_none()));
        let text = tokenizer.decode(&tokens, true).unwrap();
        let last = finished(&mut streamer, &sender, &text, &tokens).await;
        assert_eq!(last, (json!({}), json!("tool_calls")));
    }
}
