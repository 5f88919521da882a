//! `holo serve`'s HTTP server (`holo_runtime::serve`) on 127.0.0.1 (ephemeral ports), with a deterministic
//! test sampler: raw JSON for every field and error, the runtime's own `openai` sampler as a client (token
//! ids and logprobs round-trip exactly), batching of concurrent requests, and the official `openai` Python
//! client when the peers' venv has it.
#![cfg(feature = "local")]

mod common;

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
/// exact binary fractions that depend on the position and the seed. Prompts whose text contains
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
        let seed = params.seed.unwrap_or(0);
        let window = echo_window(ids);
        let max = params.max_tokens.map_or(usize::MAX, |max| max as usize);
        let mut tokens = Vec::new();
        let mut logprobs = Vec::new();
        let mut text = String::new();
        let mut finish = Finish::EndOfTurn;
        for &id in window {
            if tokens.len() == max {
                finish = Finish::Length;
                break;
            }
            let logprob = -0.25 * (tokens.len() as f32 + 1.0) - 0.0625 * (seed % 4) as f32;
            tokens.push(id);
            logprobs.push(logprob);
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
                if !sink.token(index, id, logprob) {
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
            finish,
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

impl Fixture {
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<String>,
    ) -> (u16, Value) {
        let mut request = self.client.request(method, format!("{}{path}", self.base));
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

// ---------------------------------------------------------------------------------------------------
// (a) Raw JSON

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_routes() {
    let f = start().await;
    let (status, health) = f.get("/health").await;
    assert_eq!((status, health), (200, json!({"status": "ok"})));

    let (status, models) = f.get("/v1/models").await;
    assert_eq!(status, 200);
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"].as_array().unwrap().len(), 1);
    let model = &models["data"][0];
    assert_eq!(model["id"], MODEL);
    assert_eq!(model["object"], "model");
    assert!(model["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(model["owned_by"], "holo");

    let (status, one) = f.get(&format!("/v1/models/{MODEL}")).await;
    assert_eq!((status, &one), (200, model));
    let (status, missing) = f.get("/v1/models/other").await;
    assert_eq!(status, 404);
    assert_eq!(check_error_shape(&missing)["code"], "model_not_found");

    let (status, unknown) = f.get("/v2/everything").await;
    assert_eq!(status, 404);
    let error = check_error_shape(&unknown);
    assert_eq!(error["code"], "not_found");
    assert!(error["message"]
        .as_str()
        .unwrap()
        .contains("/v2/everything"));

    let (status, wrong) = f.get("/v1/completions").await;
    assert_eq!(status, 405);
    assert_eq!(check_error_shape(&wrong)["code"], "method_not_allowed");
    f.server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_text_prompt() {
    let f = start().await;
    let answer = f
        .ok(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Hello world", "max_tokens": 50, "temperature": 0.5,
                   "top_p": 0.9, "top_k": 40, "seed": 11}),
        )
        .await;
    let prompt = encode("Hello world");
    assert!(prompt.len() <= WINDOW);
    assert_eq!(answer["object"], "text_completion");
    assert!(answer["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(answer["model"], MODEL);
    assert!(answer["created"].as_u64().is_some());
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 1);
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(choices[0]["text"], "Hello world");
    assert_eq!(choices[0]["finish_reason"], "stop");
    assert_eq!(choices[0]["stop_reason"], Value::Null);
    assert_eq!(choices[0]["logprobs"], Value::Null);
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": prompt.len(),
               "total_tokens": 2 * prompt.len()})
    );
    // What reached the sampler: the tokens, and every parameter.
    let requests = f.echo.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].prompt, Prompt::Tokens(prompt));
    assert_eq!(
        requests[0].params,
        SampleParams {
            max_tokens: Some(50),
            temperature: Some(0.5),
            top_p: Some(0.9),
            top_k: Some(40),
            stop: vec![],
            seed: Some(11),
        }
    );
    // Defaults: max_tokens 16 (OpenAI's), top_k -1 and 0 turn top-k off, an unseeded request still gets
    // a seed (from the server's generator).
    f.echo.clear();
    for top_k in [-1, 0] {
        f.ok(
            "/v1/completions",
            json!({"prompt": "Hi", "top_k": top_k, "temperature": null}),
        )
        .await;
    }
    for request in f.echo.requests() {
        assert_eq!(request.params.max_tokens, Some(16));
        assert_eq!(request.params.top_k, None);
        assert_eq!(request.params.temperature, None);
        assert!(request.params.seed.is_some());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_prompt_shapes_n_and_seeds() {
    let f = start().await;
    let (a, b) = (encode("one two"), encode("three"));
    let shapes = [json!(["one two", "three"]), json!([a.clone(), b.clone()])];
    for prompt in shapes {
        f.echo.clear();
        let answer = f
            .ok(
                "/v1/completions",
                json!({"prompt": prompt, "n": 2, "seed": 7, "return_token_ids": true}),
            )
            .await;
        let choices = answer["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 4);
        // Prompt-major: prompt p, sample j is choice p * n + j.
        for (index, choice) in choices.iter().enumerate() {
            assert_eq!(choice["index"], index);
            let prompt = if index < 2 { &a } else { &b };
            assert_eq!(ids(&choice["prompt_token_ids"]), *prompt);
            assert_eq!(ids(&choice["token_ids"]), *prompt);
        }
        assert_eq!(answer["usage"]["prompt_tokens"], a.len() + b.len());
        assert_eq!(
            answer["usage"]["completion_tokens"],
            2 * (a.len() + b.len())
        );
        // All four in one batch; sample 0 of each prompt uses the seed itself, sample 1 a derived one,
        // the same for every prompt.
        let batches = f.echo.batches();
        assert_eq!(batches.len(), 1, "one request's samples form one batch");
        let seeds: Vec<u64> = batches[0].iter().map(|r| r.params.seed.unwrap()).collect();
        assert_eq!(seeds[0], 7);
        assert_eq!(seeds[2], 7);
        assert_ne!(seeds[1], 7);
        assert_eq!(seeds[1], seeds[3]);
        assert!(seeds[1] <= i64::MAX as u64);
    }
    // A single token-id list is one prompt; the same seed gives the same derived seeds again.
    f.echo.clear();
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": a.clone(), "n": 3, "seed": 7}),
        )
        .await;
    assert_eq!(answer["choices"].as_array().unwrap().len(), 3);
    let seeds: Vec<u64> = f
        .echo
        .requests()
        .iter()
        .map(|r| r.params.seed.unwrap())
        .collect();
    assert_eq!(seeds.len(), 3);
    f.echo.clear();
    f.ok(
        "/v1/completions",
        json!({"prompt": a.clone(), "n": 3, "seed": 7}),
    )
    .await;
    let again: Vec<u64> = f
        .echo
        .requests()
        .iter()
        .map(|r| r.params.seed.unwrap())
        .collect();
    assert_eq!(seeds, again);
    // Without a seed the n samples still get distinct seeds.
    f.echo.clear();
    f.ok("/v1/completions", json!({"prompt": a, "n": 4})).await;
    let mut unseeded: Vec<u64> = f
        .echo
        .requests()
        .iter()
        .map(|r| r.params.seed.unwrap())
        .collect();
    unseeded.sort_unstable();
    unseeded.dedup();
    assert_eq!(unseeded.len(), 4);
    // A negative seed is read as its two's complement.
    f.echo.clear();
    f.ok("/v1/completions", json!({"prompt": "x", "seed": -1}))
        .await;
    assert_eq!(f.echo.requests()[0].params.seed, Some(u64::MAX));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_max_tokens_and_stop() {
    let f = start().await;
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": "Hello world and more", "max_tokens": 2}),
        )
        .await;
    let prompt = encode("Hello world and more");
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["stop_reason"], Value::Null);
    assert_eq!(
        choice["text"],
        tokenizer().decode(&prompt[..2], false).unwrap()
    );
    assert_eq!(answer["usage"]["completion_tokens"], 2);

    // A stop string ends the text before it (OpenAI), and is named in stop_reason (vLLM).
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": "Hello world and more", "stop": " and"}),
        )
        .await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["text"], "Hello world");
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["stop_reason"], " and");
    // The first stop that matches, in a list; include_stop_str_in_output keeps it.
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": "Hello world and more", "stop": ["more", "wor"],
                   "include_stop_str_in_output": true}),
        )
        .await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["text"], "Hello wor");
    assert_eq!(choice["stop_reason"], "wor");
    let requests = f.echo.requests();
    assert_eq!(requests.last().unwrap().params.stop, ["more", "wor"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_logprobs() {
    let f = start().await;
    let text = "Hé, 日本 ok";
    let prompt = encode(text);
    assert!(prompt.len() <= WINDOW);
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": text, "logprobs": 1, "seed": 2}),
        )
        .await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["text"], text);
    let logprobs = &choice["logprobs"];
    let expected: Vec<f32> = (0..prompt.len())
        .map(|i| -0.25 * (i as f32 + 1.0) - 0.125)
        .collect();
    assert_eq!(floats(&logprobs["token_logprobs"]), expected);
    assert_eq!(logprobs["top_logprobs"], Value::Null);
    // Each token's text, and where it starts in the choice's text (in characters).
    let tokens: Vec<String> = logprobs["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(tokens.len(), prompt.len());
    let offsets: Vec<usize> = logprobs["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    let chars: Vec<char> = text.chars().collect();
    for (token, &offset) in tokens.iter().zip(&offsets) {
        if !token.contains('\u{FFFD}') {
            let at: String = chars[offset..offset + token.chars().count()]
                .iter()
                .collect();
            assert_eq!(&at, token, "offset {offset} in {text:?}");
        }
    }
    // return_tokens_as_token_ids (vLLM).
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": text, "logprobs": 0, "return_tokens_as_token_ids": true}),
        )
        .await;
    let tokens: Vec<String> = prompt.iter().map(|id| format!("token_id:{id}")).collect();
    assert_eq!(answer["choices"][0]["logprobs"]["tokens"], json!(tokens));
    assert_eq!(
        answer["choices"][0]["logprobs"]["text_offset"],
        json!(offsets)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions() {
    let f = start().await;
    let answer = f
        .ok(
            "/v1/chat/completions",
            json!({
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                ],
                "logprobs": true,
                "top_logprobs": 3,
                "n": 2,
                "seed": 5,
                "max_tokens": 100,
                "max_completion_tokens": 6,
                "temperature": 0.7,
                "top_p": 0.95,
                "stop": ["never"],
                "return_token_ids": true,
            }),
        )
        .await;
    let messages = [
        ChatMessage {
            role: Role::System,
            content: "Be brief.".into(),
        },
        user("Hi\nthere"),
    ];
    let prompt = rendered_chat(&messages, &RenderOptions::generation());
    assert_eq!(answer["object"], "chat.completion");
    assert!(answer["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(ids(&answer["prompt_token_ids"]), prompt);
    let requests = f.echo.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(prompt_ids(&requests[0]), prompt);
    assert_eq!(requests[0].params.max_tokens, Some(6));
    assert_eq!(requests[0].params.temperature, Some(0.7));
    assert_eq!(requests[0].params.top_p, Some(0.95));
    assert_eq!(requests[0].params.stop, ["never"]);
    assert_eq!(requests[0].params.seed, Some(5));
    assert_ne!(requests[1].params.seed, Some(5));

    // The echo of the rendered prompt's last tokens, cut at 6.
    let window = &echo_window(&prompt)[..6];
    let content = tokenizer().decode(window, false).unwrap();
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (index, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], index);
        assert_eq!(
            choice["message"],
            json!({"role": "assistant", "content": content})
        );
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(ids(&choice["token_ids"]), window);
        let entries = choice["logprobs"]["content"].as_array().unwrap();
        assert_eq!(entries.len(), 6);
        let seed = requests[index].params.seed.unwrap();
        for (i, entry) in entries.iter().enumerate() {
            let expected = -0.25 * (i as f32 + 1.0) - 0.0625 * (seed % 4) as f32;
            assert_eq!(entry["logprob"].as_f64().unwrap() as f32, expected);
            assert_eq!(entry["top_logprobs"], json!([]));
            let bytes: Vec<u8> = entry["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect();
            assert_eq!(entry["token"], String::from_utf8_lossy(&bytes).as_ref());
        }
        let all: Vec<u8> = entries
            .iter()
            .flat_map(|entry| entry["bytes"].as_array().unwrap().clone())
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(String::from_utf8(all).unwrap(), content);
    }
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": 12,
               "total_tokens": prompt.len() + 12})
    );

    // Defaults: no logprobs, one choice, the generation prompt; the special tokens show as themselves.
    f.echo.clear();
    let answer = f
        .ok(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hey"}]}),
        )
        .await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(choice["finish_reason"], "stop");
    assert!(choice["message"]["content"]
        .as_str()
        .unwrap()
        .ends_with("<|im_end|>\n<|im_start|>assistant\n"));
    assert_eq!(f.echo.requests()[0].params.max_tokens, None);

    // continue_final_message (vLLM) renders the final assistant message open; chat_template_kwargs reach
    // the template; return_tokens_as_token_ids applies to chat logprobs too.
    f.echo.clear();
    let answer = f
        .ok(
            "/v1/chat/completions",
            json!({
                "messages": [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Well,"}],
                "add_generation_prompt": false,
                "continue_final_message": true,
                "chat_template_kwargs": {"enable_thinking": false},
                "logprobs": true,
                "return_tokens_as_token_ids": true,
            }),
        )
        .await;
    let continued = rendered_chat(
        &[
            user("Hey"),
            ChatMessage {
                role: Role::Assistant,
                content: "Well,".into(),
            },
        ],
        &RenderOptions::continuation(),
    );
    assert!(tokenizer()
        .decode(&continued, false)
        .unwrap()
        .ends_with("assistant\nWell,"));
    assert_eq!(prompt_ids(&f.echo.requests()[0]), continued);
    let tail = echo_window(&continued);
    let tokens: Vec<Value> = answer["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["token"].clone())
        .collect();
    let expected: Vec<Value> = tail
        .iter()
        .map(|id| json!(format!("token_id:{id}")))
        .collect();
    assert_eq!(tokens, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_errors() {
    let f = start().await;
    // Bad JSON: serde's line and column.
    let (status, answer) = f
        .post_raw("/v1/completions", "{\"prompt\": \"x\",\n  \"n\": }")
        .await;
    assert_eq!(status, 400);
    let error = check_error_shape(&answer);
    assert_eq!(error["code"], "invalid_json");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains("line 2 column"), "{message}");
    let (status, answer) = f.post_raw("/v1/chat/completions", "[1, 2]").await;
    assert_eq!(status, 400);
    assert!(check_error_shape(&answer)["message"]
        .as_str()
        .unwrap()
        .contains("must be a JSON object"));

    let cases: Vec<(&str, Value, &str, &str)> = vec![
        ("/v1/completions", json!({}), "prompt", "required"),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": "5"}),
            "max_tokens",
            "integer",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
            "integer",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": -3}),
            "max_tokens",
            "-3",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": -1}),
            "temperature",
            "≥ 0",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": "hot"}),
            "temperature",
            "number",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 0}),
            "top_p",
            "(0, 1]",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 1.5}),
            "top_p",
            "(0, 1]",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_k": -2}),
            "top_k",
            "top_k",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 0}),
            "n",
            "1 to 128",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 129}),
            "n",
            "1 to 128",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": 3}),
            "stop",
            "string",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": ["a", 1]}),
            "stop",
            "string",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": [""]}),
            "stop",
            "empty",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "seed": 1.5}),
            "seed",
            "64-bit",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": true}),
            "logprobs",
            "0 to 20",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 21}),
            "logprobs",
            "0 to 20",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "echo": true}),
            "echo",
            "echo",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream_options": {"include_usage": true}}),
            "stream_options",
            "only allowed when `stream` is true",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}}),
            "stream_options",
            "must be a boolean",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream": "yes"}),
            "stream",
            "true or false",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logit_bias": {"1": 5}}),
            "logit_bias",
            "not supported",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "best_of": 3}),
            "best_of",
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "suffix": "y"}),
            "suffix",
            "not supported",
        ),
        ("/v1/completions", json!({"prompt": []}), "prompt", "empty"),
        ("/v1/completions", json!({"prompt": ""}), "prompt", "empty"),
        (
            "/v1/completions",
            json!({"prompt": [[1, 2], []]}),
            "prompt",
            "prompt 1 is empty",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, -2]}),
            "prompt",
            "non-negative",
        ),
        (
            "/v1/completions",
            json!({"prompt": vec!["x"; 33], "n": 128}),
            "prompt",
            "at most 4096",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 100000]}),
            "prompt",
            "out of the vocabulary",
        ),
        (
            "/v1/completions",
            json!({"prompt": [[1], "x"]}),
            "prompt",
            "list of token-id lists",
        ),
        (
            "/v1/completions",
            json!({"prompt": {"text": "x"}}),
            "prompt",
            "a string, a list",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "model": 3}),
            "model",
            "string",
        ),
        ("/v1/chat/completions", json!({}), "messages", "required"),
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            "messages",
            "empty",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            "messages",
            "list of messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"content": "hi"}]}),
            "messages",
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages",
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages",
            "only text parts",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
            "top_logprobs",
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}),
            "logprobs",
            "true or false",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": true}),
            "continue_final_message",
            "add_generation_prompt",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
            "tools",
            "does not call tools",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": []}),
            "stream_options",
            "must be an object",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}),
            "max_completion_tokens",
            "integer",
        ),
    ];
    for (path, body, param, needle) in cases {
        let error = f.fails(path, body.clone(), 400).await;
        assert_eq!(error["type"], "invalid_request_error");
        assert_eq!(error["param"], param, "{body}: {error}");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains(needle),
            "{body}: {message:?} lacks {needle:?}"
        );
    }
    // A template that fails: the fixture's template concatenates `content`, so a null content fails.
    let error = f
        .fails(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": null}]}),
            400,
        )
        .await;
    assert_eq!(error["code"], "chat_template_error");

    // Unknown model: 404, as OpenAI and vLLM answer.
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let error = f
            .fails(
                path,
                json!({"model": "gpt-9", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
                404,
            )
            .await;
        assert_eq!(error["code"], "model_not_found");
        assert_eq!(error["param"], "model");
        assert!(error["message"].as_str().unwrap().contains("gpt-9"));
    }
    // Neutral values of refused fields, and unknown fields, pass.
    f.ok(
        "/v1/completions",
        json!({"prompt": "x", "echo": false, "logit_bias": {}, "presence_penalty": 0,
               "frequency_penalty": 0.0, "best_of": 1, "user": "me", "stream": false,
               "suffix": null, "whatever": [1]}),
    )
    .await;
    assert!(
        f.echo.requests().len() == 1,
        "failed requests never reach the sampler"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampler_errors_map_to_statuses() {
    let f = start().await;
    let error = f
        .fails("/v1/completions", json!({"prompt": "UNAVAILABLE"}), 503)
        .await;
    assert_eq!(error["type"], "server_error");
    assert_eq!(error["code"], "sampler_unavailable");
    assert!(error["message"]
        .as_str()
        .unwrap()
        .contains("the test says so"));
    let error = f
        .fails("/v1/completions", json!({"prompt": "MALFORMED"}), 500)
        .await;
    assert_eq!(error["code"], "sampler_error");
    // A full queue: 429, and when to come back.
    let response = f
        .client
        .post(format!("{}/v1/completions", f.base))
        .header("content-type", "application/json")
        .body(json!({"prompt": "OVERLOADED"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
    let error = check_error_shape(&body);
    assert_eq!(error["code"], "server_overloaded");
    let error = f
        .fails(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "PANIC"}]}),
            500,
        )
        .await;
    assert!(error["message"].as_str().unwrap().contains("panicked"));
    // The server goes on after a panicking batch.
    f.ok("/v1/completions", json!({"prompt": "fine"})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_length() {
    let f = start_with(ServeConfig::default(), Some(40), Duration::ZERO).await;
    let (_, models) = f.get("/v1/models").await;
    assert_eq!(models["data"][0]["max_model_len"], 40);
    let long = "word ".repeat(50);
    let error = f
        .fails("/v1/completions", json!({"prompt": long}), 400)
        .await;
    assert_eq!(error["code"], "context_length_exceeded");
    assert!(error["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length is 40"));
    // 8 MB cannot be spelled in 40 tokens of this vocabulary: refused by its length, before the
    // tokenizer spends time and memory on it, in the completion prompt as in a chat message.
    let huge = "x".repeat(8 << 20);
    for (path, body) in [
        ("/v1/completions", json!({"prompt": huge})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": huge}]}),
        ),
    ] {
        let error = f.fails(path, body, 400).await;
        assert_eq!(error["code"], "context_length_exceeded");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains("more than any 40 tokens can spell"),
            "{message}"
        );
    }
    let error = f
        .fails(
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 40}),
            400,
        )
        .await;
    assert_eq!(error["code"], "context_length_exceeded");
    // Chat without max_tokens samples the rest of the context.
    f.ok(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    let prompt = rendered_chat(&[user("hi")], &RenderOptions::generation());
    let requests = f.echo.requests();
    assert_eq!(
        requests[0].params.max_tokens,
        Some(40 - prompt.len() as u32)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_limit() {
    let f = start_with(
        ServeConfig {
            max_body_bytes: 1000,
        },
        None,
        Duration::ZERO,
    )
    .await;
    let error = f
        .fails("/v1/completions", json!({"prompt": "x".repeat(2000)}), 413)
        .await;
    assert_eq!(error["code"], "body_too_large");
}

// ---------------------------------------------------------------------------------------------------
// (b) The runtime's own openai sampler as the client

fn openai_client(base: &str) -> OpenAi {
    OpenAi::new(OpenAiConfig {
        proxy_from_env: false,
        max_retries: 0,
        api_key_env: "HOLO_SERVE_TEST_NO_SUCH_VAR".into(),
        ..OpenAiConfig::new(base, MODEL)
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_sampler_round_trips_tokens_and_logprobs() {
    let f = start().await;
    let client = openai_client(&f.base);
    let echo = Echo::new(Duration::ZERO);
    let params = |max_tokens: Option<u32>, stop: &[&str]| SampleParams {
        max_tokens,
        temperature: Some(0.8),
        top_p: Some(0.9),
        top_k: Some(20),
        stop: stop.iter().map(|s| s.to_string()).collect(),
        seed: Some(3),
    };
    let text = "Hé, 日本 ok";
    let tokens = encode(text);
    let chat = vec![
        ChatMessage {
            role: Role::System,
            content: "sys".into(),
        },
        user("Hello there"),
    ];
    let continued = vec![
        user("Hi"),
        ChatMessage {
            role: Role::Assistant,
            content: "Sure".into(),
        },
    ];
    let batch = vec![
        // End of turn, length, stop string; tokens, text and chat prompts.
        Request {
            prompt: Prompt::Tokens(tokens.clone()),
            params: params(None, &[]),
        },
        Request {
            prompt: Prompt::Tokens(tokens.clone()),
            params: params(Some(3), &[]),
        },
        Request {
            prompt: Prompt::Text("Hello world and more".into()),
            params: params(None, &[" and"]),
        },
        Request {
            prompt: Prompt::Chat(chat.clone()),
            params: params(Some(5), &[]),
        },
        Request {
            prompt: Prompt::Chat(continued.clone()),
            params: params(None, &["ure"]),
        },
    ];
    let results = client.sample(&batch).await;
    // What the test sampler answers for the same token prompts, directly.
    let token_prompts = [
        tokens.clone(),
        tokens.clone(),
        encode("Hello world and more"),
        rendered_chat(&chat, &RenderOptions::generation()),
        rendered_chat(&continued, &RenderOptions::continuation()),
    ];
    for ((request, result), prompt) in batch.iter().zip(results).zip(token_prompts) {
        let got = result.unwrap_or_else(|error| panic!("{request:?}: {error}"));
        let expected = echo
            .answer(
                &Request {
                    prompt: Prompt::Tokens(prompt),
                    params: request.params.clone(),
                },
                None,
            )
            .unwrap();
        assert_eq!(got, expected, "{request:?}");
        assert!(!got.tokens.is_empty() && got.logprobs.len() == got.tokens.len());
    }
    let finishes: Vec<Finish> = f
        .echo
        .requests()
        .iter()
        .map(|request| echo.answer(request, None).unwrap().finish)
        .collect();
    assert!(finishes.contains(&Finish::EndOfTurn));
    assert!(finishes.contains(&Finish::Length));
    assert!(finishes.contains(&Finish::Stop(" and".into())));
    assert!(finishes.contains(&Finish::Stop("ure".into())));
    // Every parameter reached the test sampler as sent.
    for request in f.echo.requests() {
        assert_eq!(request.params.seed, Some(3));
        assert_eq!(request.params.top_k, Some(20));
        assert_eq!(request.params.temperature, Some(0.8));
    }
    // Errors come back as the sampler's errors.
    let failing = [Request {
        prompt: Prompt::Text("MALFORMED".into()),
        params: SampleParams::default(),
    }];
    let result = client.sample(&failing).await.pop().unwrap();
    assert!(
        matches!(&result, Err(SamplerError::Unavailable(message)) if message.contains("500")),
        "{result:?}"
    );
    let wrong_model = OpenAi::new(OpenAiConfig {
        proxy_from_env: false,
        max_retries: 0,
        api_key_env: "HOLO_SERVE_TEST_NO_SUCH_VAR".into(),
        ..OpenAiConfig::new(format!("{}/v1", f.base), "other")
    })
    .unwrap();
    let result = wrong_model.sample(&batch[..1]).await.pop().unwrap();
    assert!(
        matches!(&result, Err(SamplerError::Rejected(message)) if message.contains("404")),
        "{result:?}"
    );
}

// ---------------------------------------------------------------------------------------------------
// (c) Batching

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_does_not_hold_up_another() {
    let f = start().await;
    // The HOLD request's sampler call waits until the RELEASE request has been answered: sampled one
    // after the other, the two would wait for each other (and the bounded wait fails the test).
    let held = f.post("/v1/completions", json!({"prompt": "HOLD me", "seed": 1}));
    let release = async {
        let answer = f
            .post(
                "/v1/completions",
                json!({"prompt": "RELEASE it", "seed": 2}),
            )
            .await;
        f.echo.released.notify_one();
        answer
    };
    let ((held_status, held), (status, released)) = tokio::join!(held, release);
    assert_eq!((held_status, status), (200, 200), "{held} {released}");
    assert_eq!(held["choices"][0]["text"], "HOLD me");
    assert_eq!(released["choices"][0]["text"], "RELEASE it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_is_one_sampler_call_with_its_n_samples() {
    let f = start().await;
    let requests = (0..4).map(|i| {
        f.post(
            "/v1/completions",
            json!({"prompt": format!("request {i}"), "n": 1 + i, "seed": 1}),
        )
    });
    for (i, (status, answer)) in futures_join_all(requests).await.into_iter().enumerate() {
        assert_eq!(status, 200);
        assert_eq!(answer["choices"].as_array().unwrap().len(), 1 + i);
    }
    let mut calls: Vec<(String, usize)> = f
        .echo
        .batches()
        .iter()
        .map(|batch| {
            let Prompt::Tokens(ids) = &batch[0].prompt else {
                panic!("token prompts")
            };
            let text = tokenizer().decode(ids, false).unwrap();
            assert!(batch
                .iter()
                .all(|request| request.prompt == batch[0].prompt));
            (text, batch.len())
        })
        .collect();
    calls.sort();
    let expected: Vec<(String, usize)> = (0..4).map(|i| (format!("request {i}"), 1 + i)).collect();
    assert_eq!(calls, expected);
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

// ---------------------------------------------------------------------------------------------------
// (e) Streaming: the chunks of a streamed answer join into the whole answer to the same request

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

impl Fixture {
    /// A streamed request: its status and its payloads.
    async fn stream(&self, path: &str, body: Value) -> (u16, Vec<Value>) {
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let content_type = response.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_string();
        let text = response.text().await.unwrap();
        if status != 200 {
            return (status, vec![serde_json::from_str(&text).unwrap()]);
        }
        assert_eq!(content_type, "text/event-stream", "{text}");
        (status, sse_payloads(&text))
    }
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

/// Streams `body` and asks it whole, and checks that the chunks join into the whole answer. Returns the
/// payloads.
async fn streams_like_whole(f: &Fixture, path: &str, mut body: Value) -> Vec<Value> {
    let chat = path.ends_with("chat/completions");
    // Unseeded samples get fresh seeds, which the test sampler's logprobs show.
    if body.get("seed").is_none() {
        body["seed"] = json!(11);
    }
    let whole = f.ok(path, body.clone()).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, payloads) = f.stream(path, streamed).await;
    assert_eq!(status, 200, "{payloads:#?}");
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    for payload in &payloads {
        assert_eq!(payload["object"], object, "{payload}");
        assert_eq!(payload["id"], payloads[0]["id"], "{payload}");
        assert_eq!(payload["model"], MODEL);
        assert!(payload.get("error").is_none(), "{payload}");
    }
    let prefix = if chat { "chatcmpl-" } else { "cmpl-" };
    assert!(payloads[0]["id"].as_str().unwrap().starts_with(prefix));
    for (index, choice) in whole["choices"].as_array().unwrap().iter().enumerate() {
        let joined = join_choice(&payloads, index, chat);
        assert_eq!(
            &joined, choice,
            "{body}: choice {index}, streamed {payloads:#?}"
        );
    }
    if chat && body["return_token_ids"] == true {
        assert_eq!(payloads[0]["prompt_token_ids"], whole["prompt_token_ids"]);
    }
    payloads
}

const STREAMED_COMPLETIONS: &[&str] = &[
    r#"{"prompt": "Hello world, héllo wörld 日本語", "max_tokens": 40, "logprobs": 1, "seed": 3}"#,
    r#"{"prompt": "Hello world, héllo wörld 日本語", "max_tokens": 40, "stop": [" wö", "zz"], "logprobs": 0}"#,
    r#"{"prompt": "Hello world, héllo wörld 日本語", "max_tokens": 40, "stop": "llo w", "include_stop_str_in_output": true}"#,
    r#"{"prompt": "Hello world, héllo wörld 日本語", "max_tokens": 40, "stop": ["日本"]}"#,
    r#"{"prompt": ["abc def", "ghi jkl"], "n": 2, "max_tokens": 3, "seed": 5, "logprobs": 2, "return_token_ids": true}"#,
    r#"{"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "stop": ["zz"], "return_tokens_as_token_ids": true, "logprobs": 1}"#,
];

const STREAMED_CHATS: &[&str] = &[
    r#"{"messages": [{"role": "user", "content": "Héllo 日本"}], "max_tokens": 12, "logprobs": true, "seed": 2}"#,
    r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}], "stop": ["brief"], "n": 3, "return_token_ids": true}"#,
    r#"{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1}"#,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_answers_join_into_the_whole_answers() {
    // A sampler that reports nothing early (every token comes with the completion), and one that reports
    // each token as it samples it.
    for echo in [
        Echo::new(Duration::ZERO),
        Echo::streaming(Duration::from_millis(3)),
    ] {
        let streams = echo.streams;
        let f = start_echo(echo, ServeConfig::default(), None).await;
        for body in STREAMED_COMPLETIONS {
            let body: Value = serde_json::from_str(body).unwrap();
            let payloads = streams_like_whole(&f, "/v1/completions", body.clone()).await;
            if streams && body["max_tokens"] == 40 {
                // Tokens arrived before the completion (events that arrive together share a chunk).
                assert!(payloads.len() > 1, "{body}: {payloads:#?}");
            }
        }
        for body in STREAMED_CHATS {
            let body: Value = serde_json::from_str(body).unwrap();
            streams_like_whole(&f, "/v1/chat/completions", body).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_usage() {
    let f = start_echo(
        Echo::streaming(Duration::ZERO),
        ServeConfig::default(),
        None,
    )
    .await;
    let body = json!({"prompt": ["Hello world", "abc"], "n": 2, "max_tokens": 5, "seed": 1});
    let whole = f.ok("/v1/completions", body.clone()).await;

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, payloads) = f.stream("/v1/completions", streamed.clone()).await;
    assert!(payloads
        .iter()
        .all(|payload| payload.get("usage").is_none()));

    streamed["stream_options"] = json!({"include_usage": true});
    let (_, payloads) = f.stream("/v1/completions", streamed.clone()).await;
    let (last, chunks) = payloads.split_last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], whole["usage"]);
    assert!(chunks.iter().all(|chunk| chunk["usage"].is_null()));

    streamed["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let (_, payloads) = f.stream("/v1/completions", streamed).await;
    let (last, chunks) = payloads.split_last().unwrap();
    assert_eq!(last["usage"], whole["usage"]);
    for chunk in chunks {
        let choice = &chunk["choices"][0];
        let prompt = if choice["index"].as_u64().unwrap() < 2 {
            "Hello world"
        } else {
            "abc"
        };
        assert_eq!(
            chunk["usage"]["prompt_tokens"],
            encode(prompt).len(),
            "{chunk}"
        );
        let sofar = chunk["usage"]["completion_tokens"].as_u64().unwrap();
        assert!((1..=5).contains(&sofar), "{chunk}");
    }

    let chat = json!({
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (_, payloads) = f.stream("/v1/chat/completions", chat.clone()).await;
    let mut whole_chat = chat.clone();
    whole_chat["stream"] = json!(false);
    whole_chat.as_object_mut().unwrap().remove("stream_options");
    let whole = f.ok("/v1/chat/completions", whole_chat).await;
    assert_eq!(payloads.last().unwrap()["usage"], whole["usage"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_errors() {
    let f = start_echo(
        Echo::streaming(Duration::ZERO),
        ServeConfig::default(),
        None,
    )
    .await;
    // Whatever is wrong with the request is a plain error response, before any event.
    let (status, payloads) = f
        .stream("/v1/completions", json!({"prompt": "", "stream": true}))
        .await;
    assert_eq!(status, 400);
    check_error_shape(&payloads[0]);
    // A sampler failure after the stream has started is its last event.
    for (prompt, code) in [
        ("UNAVAILABLE", "sampler_unavailable"),
        ("MALFORMED", "sampler_error"),
        ("PANIC", "sampler_error"),
    ] {
        let (status, payloads) = f
            .stream("/v1/completions", json!({"prompt": prompt, "stream": true}))
            .await;
        assert_eq!(status, 200);
        let error = check_error_shape(payloads.last().unwrap());
        assert_eq!(error["code"], code, "{payloads:#?}");
    }
    // The server goes on.
    streams_like_whole(
        &f,
        "/v1/completions",
        json!({"prompt": "fine", "max_tokens": 3}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_and_whole_requests_run_side_by_side() {
    let f = start_echo(
        Echo::streaming(Duration::from_millis(1)),
        ServeConfig::default(),
        None,
    )
    .await;
    let body = |i: usize| {
        json!({"prompt": format!("request number {i} é"), "seed": i, "max_tokens": 12, "logprobs": 1,
               "n": 1 + i % 2})
    };
    let streamed = (0..4).map(|i| {
        let mut request = body(i);
        request["stream"] = json!(true);
        f.stream("/v1/completions", request)
    });
    let whole = (0..4).map(|i| f.post("/v1/completions", body(i)));
    let (streamed, whole) = tokio::join!(futures_join_all(streamed), futures_join_all(whole));
    for (i, ((status, payloads), (whole_status, answer))) in streamed.iter().zip(&whole).enumerate()
    {
        assert_eq!((*status, *whole_status), (200, 200));
        let choices = answer["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 1 + i % 2);
        for (index, choice) in choices.iter().enumerate() {
            assert_eq!(&join_choice(payloads, index, false), choice, "request {i}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_stops_its_sample() {
    let f = start_echo(
        Echo::streaming(Duration::from_millis(40)),
        ServeConfig::default(),
        None,
    )
    .await;
    let prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen";
    assert!(encode(prompt).len() >= 20);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 30, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 30, "stream": true}),
        ),
        // Not streamed: the client gives up waiting.
        (
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 30}),
        ),
    ] {
        let before = f.echo.cancelled.load(Ordering::SeqCst);
        let request = f
            .client
            .post(format!("{}{path}", f.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send();
        if body["stream"] == true {
            // Two events, so that the sampler has begun (a chat answer's first is the role's).
            let mut response = request.await.unwrap();
            assert_eq!(response.status(), 200);
            let mut read = String::new();
            while read.matches("data:").count() < 2 {
                let chunk = response.chunk().await.unwrap().expect("more events");
                read.push_str(&String::from_utf8_lossy(&chunk));
            }
            drop(response);
        } else {
            assert!(tokio::time::timeout(Duration::from_millis(200), request)
                .await
                .is_err());
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while f.echo.cancelled.load(Ordering::SeqCst) == before {
            assert!(
                std::time::Instant::now() < deadline,
                "{path} {body}: the sampler was never told"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// (d) The official openai Python client

const PYTHON_CLIENT: &str = r#"
import json, sys
import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
out = {}
models = client.models.list()
out["models"] = [m.id for m in models.data]
c = client.completions.create(model=sys.argv[2], prompt="Hello world", max_tokens=20, logprobs=1, n=2, seed=7)
out["completion"] = c.model_dump()
c = client.completions.create(model=sys.argv[2], prompt=[[1, 2, 3], [4, 5]], max_tokens=2, stop=["zz"])
out["token_prompts"] = c.model_dump()
chat = client.chat.completions.create(
    model=sys.argv[2],
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    logprobs=True, top_logprobs=2, max_tokens=4, seed=1, temperature=0.5,
)
out["chat"] = chat.model_dump()
stream = client.completions.create(
    model=sys.argv[2], prompt="Hello world", max_tokens=20, logprobs=1, n=2, seed=7, stream=True
)
out["completion_stream"] = [chunk.model_dump() for chunk in stream]
stream = client.chat.completions.create(
    model=sys.argv[2],
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    logprobs=True, top_logprobs=2, max_tokens=4, seed=1, temperature=0.5,
    stream=True, stream_options={"include_usage": True},
)
out["chat_stream"] = [chunk.model_dump() for chunk in stream]
try:
    for _ in client.completions.create(model=sys.argv[2], prompt="UNAVAILABLE", stream=True):
        pass
    out["stream_error"] = None
except openai.APIError as error:
    out["stream_error"] = {"message": error.message}
try:
    client.completions.create(model=sys.argv[2], prompt="x", echo=True)
    out["echo_error"] = None
except openai.BadRequestError as error:
    out["echo_error"] = {"status": error.status_code, "body": error.body}
try:
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    out["model_error"] = None
except openai.NotFoundError as error:
    out["model_error"] = {"status": error.status_code, "body": error.body}
print(json.dumps(out))
"#;

/// Says why a test did nothing, on the real stderr (libtest captures `eprintln!` of passing tests).
fn skipped(message: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "skipped: {message}");
}

fn peers_python() -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    let python = Path::new(&home).join(".cache/holo-peers/venv/bin/python");
    python.is_file().then_some(python)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_client() {
    let Some(python) = peers_python() else {
        skipped(
            "official_python_client: no $HOME/.cache/holo-peers/venv/bin/python \
             (run ../shared/peers/setup.sh to install the openai package)",
        );
        return;
    };
    let has_openai = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .output()
        .map(|output| output.status.success())
        .unwrap_or(false);
    if !has_openai {
        skipped(&format!(
            "official_python_client: {} cannot import openai",
            python.display()
        ));
        return;
    }
    let f = start().await;
    let base = f.base.clone();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .args(["-c", PYTHON_CLIENT, &base, MODEL])
            .env("NO_PROXY", "127.0.0.1,localhost")
            .env("no_proxy", "127.0.0.1,localhost")
            .env_remove("OPENAI_BASE_URL")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the Python client failed:\n{stderr}"
    );
    let out: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "{error}: {}\n{stderr}",
            String::from_utf8_lossy(&output.stdout)
        )
    });

    assert_eq!(out["models"], json!([MODEL]));

    let completion = &out["completion"];
    let prompt = encode("Hello world");
    assert_eq!(completion["object"], "text_completion");
    let choices = completion["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (index, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], index);
        assert_eq!(choice["text"], "Hello world");
        assert_eq!(choice["finish_reason"], "stop");
        let seed = if index == 0 {
            7
        } else {
            f.echo.requests()[1].params.seed.unwrap()
        };
        let expected: Vec<f32> = (0..prompt.len())
            .map(|i| -0.25 * (i as f32 + 1.0) - 0.0625 * (seed % 4) as f32)
            .collect();
        assert_eq!(floats(&choice["logprobs"]["token_logprobs"]), expected);
        assert_eq!(
            choice["logprobs"]["tokens"].as_array().unwrap().len(),
            prompt.len()
        );
        assert_eq!(choice["logprobs"]["text_offset"][0], 0);
    }
    assert_eq!(completion["usage"]["prompt_tokens"], prompt.len());

    let token_prompts = &out["token_prompts"]["choices"];
    assert_eq!(
        token_prompts[0]["text"],
        tokenizer().decode(&[1, 2], false).unwrap()
    );
    assert_eq!(token_prompts[0]["finish_reason"], "length");
    assert_eq!(
        token_prompts[1]["text"],
        tokenizer().decode(&[4, 5], false).unwrap()
    );
    assert_eq!(token_prompts[1]["finish_reason"], "stop");

    let chat = &out["chat"];
    let rendered = rendered_chat(
        &[
            ChatMessage {
                role: Role::System,
                content: "Be brief.".into(),
            },
            user("Hi"),
        ],
        &RenderOptions::generation(),
    );
    let window = &echo_window(&rendered)[..4];
    let choice = &chat["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(
        choice["message"]["content"],
        tokenizer().decode(window, false).unwrap()
    );
    assert_eq!(choice["finish_reason"], "length");
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for (i, entry) in content.iter().enumerate() {
        assert_eq!(
            entry["logprob"].as_f64().unwrap() as f32,
            -0.25 * (i as f32 + 1.0) - 0.0625
        );
        assert_eq!(entry["top_logprobs"], json!([]));
        assert!(entry["bytes"].is_array());
    }
    assert_eq!(chat["usage"]["prompt_tokens"], rendered.len());

    // The streamed answers join into the whole ones (the client's objects carry every field it knows, null
    // where absent).
    let chunks = out["completion_stream"].as_array().unwrap();
    for (index, choice) in choices.iter().enumerate() {
        let joined = join_choice(chunks, index, false);
        assert_eq!(joined["text"], choice["text"]);
        assert_eq!(joined["finish_reason"], choice["finish_reason"]);
        for key in ["tokens", "token_logprobs", "text_offset"] {
            assert_eq!(joined["logprobs"][key], choice["logprobs"][key], "{key}");
        }
    }
    let chunks = out["chat_stream"].as_array().unwrap();
    let (usage, chunks) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"]["prompt_tokens"],
        chat["usage"]["prompt_tokens"]
    );
    assert_eq!(
        usage["usage"]["completion_tokens"],
        chat["usage"]["completion_tokens"]
    );
    let joined = join_choice(chunks, 0, true);
    assert_eq!(joined["message"]["content"], choice["message"]["content"]);
    assert_eq!(joined["finish_reason"], choice["finish_reason"]);
    assert_eq!(joined["logprobs"]["content"], choice["logprobs"]["content"]);
    assert!(
        out["stream_error"]["message"]
            .as_str()
            .is_some_and(|message| message.contains("unavailable")),
        "{}",
        out["stream_error"]
    );

    assert_eq!(out["echo_error"]["status"], 400);
    assert_eq!(out["echo_error"]["body"]["param"], "echo");
    assert_eq!(out["model_error"]["status"], 404);
    assert_eq!(out["model_error"]["body"]["code"], "model_not_found");
}

// ---------------------------------------------------------------------------------------------------
// `holo serve` end to end: a tiny random model written by `holo init-model`, served by the binary, sampled
// through the `openai` sampler, compared with the same model sampled in process.

/// The `holo serve` child process; killed when dropped.
#[cfg(feature = "cli")]
struct Child(std::process::Child);

#[cfg(feature = "cli")]
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holo_serve_cli_serves_a_local_model() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    use holo_runtime::local::{LocalModel, LocalOptions};

    let dir = std::env::temp_dir().join(format!("holo-serve-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let init = Command::new(env!("CARGO_BIN_EXE_holo"))
        .args(["init-model", "--preset", "tiny", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        init.status.success(),
        "holo init-model failed:\n{}",
        String::from_utf8_lossy(&init.stderr)
    );

    // Usage errors first: a folder that is not a model.
    let missing = Command::new(env!("CARGO_BIN_EXE_holo"))
        .args([
            "serve",
            dir.join("nothing").to_str().unwrap(),
            "--port",
            "0",
        ])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("error:"));

    let mut child = Child(
        Command::new(env!("CARGO_BIN_EXE_holo"))
            .args([
                "serve",
                dir.to_str().unwrap(),
                "--port",
                "0",
                "--served-model-name",
                "tiny",
            ])
            .args(["--max-num-seqs", "4", "--max-num-batched-tokens", "64"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stderr = child.0.stderr.take().unwrap();
    let base = tokio::task::spawn_blocking(move || {
        let mut seen = String::new();
        for line in std::io::BufReader::new(stderr).lines() {
            let line = line.unwrap();
            if let Some(at) = line.find("http://") {
                let url = line[at..].split_whitespace().next().unwrap().to_string();
                return url;
            }
            seen.push_str(&line);
            seen.push('\n');
        }
        panic!("holo serve ended without saying where it listens:\n{seen}");
    })
    .await
    .unwrap();

    let client = OpenAi::new(OpenAiConfig {
        proxy_from_env: false,
        max_retries: 0,
        api_key_env: "HOLO_SERVE_TEST_NO_SUCH_VAR".into(),
        ..OpenAiConfig::new(&base, "tiny")
    })
    .unwrap();
    let local = LocalModel::load(&dir, LocalOptions::default()).unwrap();
    let chat = vec![user("What is 2 + 2?")];
    let chat_ids = {
        let text = local
            .template()
            .render(&chat, &RenderOptions::generation())
            .unwrap();
        local
            .tokenizer()
            .encode(text, false)
            .unwrap()
            .get_ids()
            .to_vec()
    };
    let params = SampleParams {
        max_tokens: Some(6),
        temperature: Some(1.0),
        seed: Some(9),
        ..SampleParams::default()
    };
    // One request at a time, so that the server's batches are the in-process ones (a batch of 1).
    for (prompt, ids) in [
        (Prompt::Chat(chat.clone()), chat_ids.clone()),
        (Prompt::Tokens(vec![1, 2, 3, 4]), vec![1, 2, 3, 4]),
    ] {
        let served = client
            .sample(&[Request {
                prompt,
                params: params.clone(),
            }])
            .await
            .pop()
            .unwrap()
            .unwrap();
        let direct = local
            .sample(&[Request {
                prompt: Prompt::Tokens(ids),
                params: params.clone(),
            }])
            .await
            .pop()
            .unwrap()
            .unwrap();
        assert_eq!(served.tokens, direct.tokens);
        assert_eq!(served.text, direct.text);
        assert_eq!(served.finish, direct.finish);
        assert_eq!(served.logprobs.len(), direct.logprobs.len());
        for (a, b) in served.logprobs.iter().zip(&direct.logprobs) {
            assert!((a - b).abs() <= 1e-5, "{served:?} vs {direct:?}");
        }
    }

    // Streamed: the local model reports each token as it samples it, and the chunks join into the whole
    // answer to the same request.
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 3, 4], "max_tokens": 24, "seed": 4, "logprobs": 1, "stop": ["e"]}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 24,
                   "seed": 4, "logprobs": true, "n": 2}),
        ),
    ] {
        let url = format!("{base}{path}");
        let whole: Value = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap()
            .text()
            .await
            .map(|text| serde_json::from_str(&text).unwrap())
            .unwrap();
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let text = http
            .post(&url)
            .header("content-type", "application/json")
            .body(streamed.to_string())
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let payloads = sse_payloads(&text);
        let chat = path.ends_with("chat/completions");
        for (index, choice) in whole["choices"].as_array().unwrap().iter().enumerate() {
            let joined = join_choice(&payloads, index, chat);
            assert_eq!(joined["finish_reason"], choice["finish_reason"], "{text}");
            let key = if chat { "message" } else { "text" };
            assert_eq!(joined[key], choice[key], "{text}");
            let lp = |value: &Value| -> Vec<f32> {
                let entries = if chat {
                    value["logprobs"]["content"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|entry| entry["logprob"].clone())
                        .collect::<Vec<_>>()
                } else {
                    value["logprobs"]["token_logprobs"]
                        .as_array()
                        .unwrap()
                        .clone()
                };
                entries
                    .iter()
                    .map(|lp| lp.as_f64().unwrap() as f32)
                    .collect()
            };
            let (a, b) = (lp(&joined), lp(choice));
            assert_eq!(a.len(), b.len(), "{text}");
            assert!(
                a.iter().zip(&b).all(|(a, b)| (a - b).abs() <= 1e-5),
                "{a:?} vs {b:?}"
            );
        }
        // Tokens arrived before the completions: more chunks than chat's role chunks and each choice's
        // last one.
        let choices = whole["choices"].as_array().unwrap().len();
        let roles = if chat { choices } else { 0 };
        assert!(payloads.len() > roles + choices, "{text}");
    }
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
}
