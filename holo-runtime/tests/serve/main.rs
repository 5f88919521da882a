//! `holo serve`'s HTTP server (`holo_runtime::serve`) on 127.0.0.1 (ephemeral ports), with a deterministic
//! test sampler: raw JSON for every field and error, the runtime's own `openai` sampler as a client (token
//! ids and logprobs round-trip exactly), concurrent requests side by side, and the official `openai` Python
//! client when the peers' venv has it.
#![cfg(feature = "local")]

mod cli;
#[path = "../common/mod.rs"]
mod common;
mod concurrency;
mod connections;
mod echo;
mod harmony;
mod lm_eval;
mod openai_sampler;
mod prompt_logprobs;
mod python_client;
mod raw_json;
mod reasoning;
mod streaming;
mod structured;
mod tools;
mod weights;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::json::{floats, ids};
use holo_runtime::chat::{ChatTemplate, RenderOptions};
use holo_runtime::openai::{OpenAi, OpenAiConfig};
use holo_runtime::sampler::SampleFuture;
use holo_runtime::serve::{ServeConfig, ServedModel, Server, ServerHandle};
use holo_runtime::{
    ChatMessage, Completion, Finish, Prompt, Request, Role, SampleParams, Sampler, SamplerError,
    TokenSink,
};
use serde_json::{json, Map, Value};
use tokenizers::Tokenizer;

const MODEL: &str = "test-model";

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/holophore")
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(fixture_dir().join("tokenizer.json")).unwrap()
}

fn template() -> ChatTemplate {
    ChatTemplate::from_dir(fixture_dir()).unwrap()
}

// ---------------------------------------------------------------------------------------------------
// The test sampler

/// How many of the prompt's last tokens the test sampler echoes.
const WINDOW: usize = 32;

/// The tokens the test sampler echoes for a prompt (before `max_tokens` and stop strings cut them).
fn echo_window(prompt: &[u32]) -> &[u32] {
    &prompt[prompt.len().saturating_sub(WINDOW)..]
}

/// Answers each token prompt with its last (up to) [`WINDOW`] tokens, cut by `max_tokens` (finish `Length`) or by
/// the first stop string the decoded text contains (finish `Stop`, the text ending with it). Logprobs are
/// exact binary fractions that depend on the position and the seed; asked for `top_logprobs` = k, each
/// position's alternatives are the echoed token and then token ids 1, 2, … (skipping it), each `1`
/// less likely than the one before. Prompts whose text contains
/// `UNAVAILABLE`, `OVERLOADED`, `MALFORMED` or `PANIC` fail that way. Records every batch.
///
/// A streaming echo reports each token to the sink as it goes (sleeping `token_delay` after each), ends a
/// request the sink no longer wants (counting it in `cancelled`), and decodes without special tokens, as
/// the local model does.
struct Echo {
    tokenizer: Tokenizer,
    batches: Mutex<Vec<Vec<Request>>>,
    delay: Duration,
    streams: bool,
    token_delay: Duration,
    cancelled: AtomicUsize,
    /// Notified by a test when a prompt containing `HOLD` may be answered.
    released: tokio::sync::Notify,
}

impl Echo {
    fn new(delay: Duration) -> Self {
        Echo {
            tokenizer: tokenizer(),
            batches: Mutex::new(Vec::new()),
            delay,
            streams: false,
            token_delay: Duration::ZERO,
            cancelled: AtomicUsize::new(0),
            released: tokio::sync::Notify::new(),
        }
    }

    fn streaming(token_delay: Duration) -> Self {
        Echo {
            streams: true,
            token_delay,
            ..Echo::new(Duration::ZERO)
        }
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, self.streams).unwrap()
    }

    fn answer(
        &self,
        request: &Request,
        sink: Option<(&dyn TokenSink, usize)>,
    ) -> Result<Completion, SamplerError> {
        let Prompt::Tokens(ids) = &request.prompt else {
            return Err(SamplerError::Rejected("token prompts only".into()));
        };
        let prompt = self.decode(ids);
        if prompt.contains("UNAVAILABLE") {
            return Err(SamplerError::Unavailable("the test says so".into()));
        }
        if prompt.contains("OVERLOADED") {
            return Err(SamplerError::Overloaded("the test says so".into()));
        }
        if prompt.contains("MALFORMED") {
            return Err(SamplerError::Malformed("the test says so".into()));
        }
        if prompt.contains("PANIC") {
            panic!("the test sampler panics on purpose");
        }
        let params = &request.params;
        if let Some(parameter) = params.beyond_sampling() {
            return Err(SamplerError::Rejected(format!(
                "the echo sampler cannot honour {parameter}"
            )));
        }
        let seed = params.seed.unwrap_or(0);
        let window = echo_window(ids);
        let max = params.max_tokens.map_or(usize::MAX, |max| max as usize);
        let mut tokens = Vec::new();
        let mut logprobs = Vec::new();
        let mut top_logprobs = Vec::new();
        let mut text = String::new();
        let mut finish = Finish::EndOfTurn;
        for &id in window {
            if tokens.len() == max {
                finish = Finish::Length;
                break;
            }
            let logprob = -0.25 * (tokens.len() as f32 + 1.0) - 0.0625 * (seed % 4) as f32;
            let top = echo_alternatives(id, logprob, params.top_logprobs as usize);
            tokens.push(id);
            logprobs.push(logprob);
            if params.top_logprobs > 0 {
                top_logprobs.push(top.clone());
            }
            text = self.decode(&tokens);
            let first_stop = params
                .stop
                .iter()
                .filter_map(|stop| text.find(stop.as_str()).map(|at| (at, stop)))
                .min();
            if let Some((at, stop)) = first_stop {
                text.truncate(at + stop.len());
                finish = Finish::Stop(stop.clone());
            }
            if let Some((sink, index)) = sink {
                if !sink.token_with_top(index, id, logprob, &top) {
                    self.cancelled.fetch_add(1, Ordering::SeqCst);
                    finish = Finish::Length;
                    break;
                }
                std::thread::sleep(self.token_delay);
            }
            if matches!(finish, Finish::Stop(_)) {
                break;
            }
        }
        Ok(Completion {
            text,
            tokens,
            logprobs,
            top_logprobs,
            finish,
            routes: Vec::new(),
            weight_version: None,
            constraint: None,
        })
    }

    /// Whether the request's prompt says HOLD.
    fn holds(&self, request: &Request) -> bool {
        matches!(&request.prompt, Prompt::Tokens(ids) if self.decode(ids).contains("HOLD"))
    }

    fn batches(&self) -> Vec<Vec<Request>> {
        self.batches.lock().unwrap().clone()
    }

    fn requests(&self) -> Vec<Request> {
        self.batches().into_iter().flatten().collect()
    }

    fn clear(&self) {
        self.batches.lock().unwrap().clear();
    }
}

impl Sampler for Echo {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        Box::pin(async move {
            self.batches.lock().unwrap().push(batch.to_vec());
            if batch.iter().any(|request| self.holds(request)) {
                tokio::time::timeout(Duration::from_secs(60), self.released.notified())
                    .await
                    .expect("the HOLD request was released");
            }
            if !self.delay.is_zero() {
                tokio::time::sleep(self.delay).await;
            }
            batch
                .iter()
                .map(|request| self.answer(request, None))
                .collect()
        })
    }

    fn sample_streaming<'a>(
        &'a self,
        batch: &'a [Request],
        sink: Arc<dyn TokenSink>,
    ) -> SampleFuture<'a> {
        if !self.streams {
            return self.sample(batch);
        }
        Box::pin(async move {
            self.batches.lock().unwrap().push(batch.to_vec());
            batch
                .iter()
                .enumerate()
                .map(|(index, request)| self.answer(request, Some((&*sink, index))))
                .collect()
        })
    }
}

/// The test sampler's `k` most likely tokens where it sampled `id` with `logprob` (see [`Echo`]).
fn echo_alternatives(id: u32, logprob: f32, k: usize) -> Vec<(u32, f32)> {
    std::iter::once(id)
        .chain((1..).filter(|&other| other != id))
        .take(k)
        .enumerate()
        .map(|(rank, token)| (token, logprob - rank as f32))
        .collect()
}

// ---------------------------------------------------------------------------------------------------
// Server and client helpers

struct Fixture {
    echo: Arc<Echo>,
    server: ServerHandle,
    base: String,
    client: reqwest::Client,
}

async fn start_with(config: ServeConfig, max_model_len: Option<u32>, delay: Duration) -> Fixture {
    start_echo(Echo::new(delay), config, max_model_len).await
}

async fn start_echo(echo: Echo, config: ServeConfig, max_model_len: Option<u32>) -> Fixture {
    let echo = Arc::new(echo);
    let mut model = ServedModel::new(MODEL, echo.clone(), tokenizer(), template());
    model.max_model_len = max_model_len;
    let server = Server::bind("127.0.0.1:0", model, config).await.unwrap();
    assert_ne!(server.local_addr().port(), 0);
    let server = server.spawn();
    let base = server.base_url();
    Fixture {
        echo,
        server,
        base,
        client: reqwest::Client::builder().no_proxy().build().unwrap(),
    }
}

async fn start() -> Fixture {
    start_with(ServeConfig::default(), None, Duration::ZERO).await
}

/// A request to the server at `base` (a JSON `body` when given): the status and the JSON answer.
async fn send_json(
    client: &reqwest::Client,
    base: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<String>,
) -> (u16, Value) {
    let mut request = client.request(method, format!("{base}{path}"));
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let value = serde_json::from_str(&text)
        .unwrap_or_else(|error| panic!("{path}: not JSON ({error}): {text:?}"));
    (status, value)
}

/// A client of one spawned server (tests add their own requests in `impl Client` blocks).
struct Client {
    base: String,
    http: reqwest::Client,
}

impl Client {
    fn new(server: &ServerHandle) -> Self {
        Client::at(server.base_url())
    }

    /// A client of the server at `base` (a `holo serve` process's address).
    fn at(base: String) -> Self {
        Client {
            base,
            http: reqwest::Client::builder().no_proxy().build().unwrap(),
        }
    }

    /// A JSON `body` posted to `path`: the status and the JSON answer.
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        send_json(
            &self.http,
            &self.base,
            reqwest::Method::POST,
            path,
            Some(body.to_string()),
        )
        .await
    }

    /// A JSON `body` posted to `path`: the status and the answer's text (a stream's events).
    async fn post_text(&self, path: &str, body: Value) -> (u16, String) {
        let response = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    }
}

impl Fixture {
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<String>,
    ) -> (u16, Value) {
        send_json(&self.client, &self.base, method, path, body).await
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.send(reqwest::Method::GET, path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.send(reqwest::Method::POST, path, Some(body.to_string()))
            .await
    }

    async fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        self.send(reqwest::Method::POST, path, Some(body.to_string()))
            .await
    }

    /// A request that must succeed.
    async fn ok(&self, path: &str, body: Value) -> Value {
        let (status, answer) = self.post(path, body).await;
        assert_eq!(status, 200, "{answer:#}");
        answer
    }

    /// A request that must fail with `status`; returns the `error` object.
    async fn fails(&self, path: &str, body: Value, status: u16) -> Value {
        let (got, answer) = self.post(path, body.clone()).await;
        assert_eq!(got, status, "{body} → {answer:#}");
        check_error_shape(&answer)
    }
}

fn check_error_shape(answer: &Value) -> Value {
    let error = answer["error"].clone();
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{answer}"
    );
    assert!(error["type"].is_string(), "{answer}");
    assert!(
        error.get("param").is_some() && error.get("code").is_some(),
        "{answer}"
    );
    error
}

fn encode(text: &str) -> Vec<u32> {
    tokenizer().encode(text, true).unwrap().get_ids().to_vec()
}

fn prompt_ids(request: &Request) -> Vec<u32> {
    match &request.prompt {
        Prompt::Tokens(ids) => ids.clone(),
        other => panic!("the server sent {other:?}"),
    }
}

fn rendered_chat(messages: &[ChatMessage], options: &RenderOptions) -> Vec<u32> {
    let text = template().render(messages, options).unwrap();
    tokenizer().encode(text, false).unwrap().get_ids().to_vec()
}

fn user(content: &str) -> ChatMessage {
    ChatMessage {
        role: Role::User,
        content: content.into(),
    }
}

/// Polls the futures concurrently (tokio has no join_all without the futures crate).
async fn futures_join_all<F, T>(futures: impl IntoIterator<Item = F>) -> Vec<T>
where
    F: std::future::Future<Output = T>,
{
    let mut pinned: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut results: Vec<Option<T>> = pinned.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, slot) in pinned.iter_mut().zip(results.iter_mut()) {
            if slot.is_none() {
                match future.as_mut().poll(cx) {
                    std::task::Poll::Ready(value) => *slot = Some(value),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    results.into_iter().map(Option::unwrap).collect()
}

/// Every `data:` payload of a server-sent event stream before its `[DONE]`, as JSON.
fn sse_payloads(body: &str) -> Vec<Value> {
    let mut payloads = Vec::new();
    let mut done = false;
    for event in body.split("\n\n").filter(|event| !event.trim().is_empty()) {
        let data: Vec<&str> = event
            .lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .map(|data| data.strip_prefix(' ').unwrap_or(data))
            .collect();
        if data.is_empty() {
            continue;
        }
        assert!(!done, "an event after [DONE]: {body}");
        let data = data.join("\n");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        payloads
            .push(serde_json::from_str(&data).unwrap_or_else(|error| panic!("{error}: {data:?}")));
    }
    assert!(done, "the stream has no [DONE]: {body}");
    payloads
}

/// Concatenates a choice's chunks into the choice of a whole answer (completions or chat): text or
/// content, logprobs, token ids; the finish and stop reasons of its one finishing chunk, its last.
fn join_choice(chunks: &[Value], index: usize, chat: bool) -> Value {
    let mine: Vec<&Value> = chunks
        .iter()
        .flat_map(|chunk| chunk["choices"].as_array().unwrap())
        .filter(|choice| choice["index"] == index)
        .collect();
    assert!(!mine.is_empty(), "no chunk for choice {index}");
    let finishing: Vec<usize> = (0..mine.len())
        .filter(|&i| !mine[i]["finish_reason"].is_null())
        .collect();
    assert_eq!(finishing, [mine.len() - 1], "{mine:#?}");
    let last = mine[mine.len() - 1];
    let mut text = String::new();
    let mut logprobs: Option<Map<String, Value>> = None;
    let mut token_ids: Option<Vec<Value>> = None;
    for choice in &mine {
        let piece = if chat {
            &choice["delta"]["content"]
        } else {
            &choice["text"]
        };
        text.push_str(piece.as_str().unwrap_or(""));
        if let Value::Object(block) = &choice["logprobs"] {
            let joined = logprobs.get_or_insert_with(Map::new);
            for (key, value) in block {
                match value {
                    Value::Array(items) => joined
                        .entry(key.clone())
                        .or_insert_with(|| json!([]))
                        .as_array_mut()
                        .unwrap()
                        .extend(items.iter().cloned()),
                    other => {
                        joined.insert(key.clone(), other.clone());
                    }
                }
            }
        }
        if let Some(ids) = choice["token_ids"].as_array() {
            token_ids
                .get_or_insert_with(Vec::new)
                .extend(ids.iter().cloned());
        }
    }
    let mut joined = if chat {
        assert_eq!(mine[0]["delta"]["role"], "assistant", "{mine:#?}");
        json!({"index": index, "message": {"role": "assistant", "content": text}})
    } else {
        json!({"index": index, "text": text})
    };
    joined["logprobs"] = logprobs.map_or(Value::Null, Value::Object);
    joined["finish_reason"] = last["finish_reason"].clone();
    joined["stop_reason"] = last["stop_reason"].clone();
    if let Some(ids) = token_ids {
        joined["token_ids"] = Value::Array(ids);
    }
    if let Some(prompt) = mine[0].get("prompt_token_ids") {
        joined["prompt_token_ids"] = prompt.clone();
    }
    joined
}
