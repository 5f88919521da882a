//! [`OpenAi`]: a [`Sampler`] for any OpenAI-compatible HTTP server (vLLM, SGLang, llama.cpp, OpenAI).
//!
//! ```no_run
//! use holo_core::openai::{OpenAi, OpenAiConfig};
//! use holo_core::{Prompt, Request, SampleParams, Sampler};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let sampler = OpenAi::new(OpenAiConfig::new("http://127.0.0.1:8000", "Qwen/Qwen2.5-0.5B-Instruct"))?;
//! let batch = [Request {
//!     prompt: Prompt::Text("The capital of France is".into()),
//!     params: SampleParams { max_tokens: Some(8), stop: vec![".".into()], ..SampleParams::default() },
//! }];
//! for result in sampler.sample(&batch).await {
//!     println!("{:?}", result?);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! The returned future must be polled inside a tokio runtime (it spawns one task per request).
//!
//! # Endpoints
//!
//! | prompt | endpoint | body |
//! |---|---|---|
//! | [`Prompt::Tokens`] | `POST {base}/v1/completions` | `"prompt": [token ids]` (no re-tokenization) |
//! | [`Prompt::Text`] | `POST {base}/v1/completions` | `"prompt": "text"` |
//! | [`Prompt::Chat`] | `POST {base}/v1/chat/completions` | `"messages": [{"role", "content"}]` |
//!
//! `base` is [`OpenAiConfig::base_url`]; a base that already ends in `/v1` (the convention of the OpenAI
//! SDKs) is not given a second one, so `http://host:8000` and `http://host:8000/v1` are the same server.
//!
//! A chat whose last message is an assistant message is *continued*: with the vLLM extensions on, the body
//! carries `"continue_final_message": true, "add_generation_prompt": false` (vLLM and SGLang), so the
//! completion is the rest of that message. With the extensions off, the messages are sent as they are
//! (llama.cpp continues a trailing assistant message by itself; other servers start a new turn).
//!
//! # Fields
//!
//! Every request has `"model"`, `"n": 1` and `"stream": false`. [`SampleParams`] maps one to one:
//! `max_tokens`, `temperature`, `top_p`, `top_k` (a vLLM/SGLang/llama.cpp extension), `stop` (omitted when
//! empty; a fence's closing tag held back, below) and `seed`; a `None` field is left out so the server's default applies. A
//! [`Constraint`] goes as OpenAI's `response_format` (JSON) or vLLM's `guided_regex`,
//! `guided_choice`, `guided_grammar`; a server that has none of them refuses. `logit_bias` goes as
//! OpenAI's; `min_tokens`, `stop_token_ids` and `ignore_eos` (vLLM's) only when set;
//! `prompt_logprobs` is refused. Log-probabilities are always requested: `"logprobs": 1` on completions, `"logprobs": true` on chat.
//!
//! With [`OpenAiConfig::vllm_extensions`] (on by default) the body also carries
//! `"return_tokens_as_token_ids": true` (sampled tokens come back as `"token_id:1234"` strings, parsed
//! into ids) and `"include_stop_str_in_output": true` (the text keeps the stop string). Servers that
//! refuse unknown fields (OpenAI's own API) need the extensions off.
//!
//! The answer's first choice becomes a [`Completion`]:
//! - `text`: the choice's `text` (completions) or `message.content` (chat; `null` reads as empty);
//! - `tokens`: the choice's `token_ids` when the server gives them (vLLM's `return_token_ids`), otherwise
//!   the `"token_id:N"` strings of the logprobs (`logprobs.tokens` on completions, `logprobs.content[].token`
//!   on chat). When the tokens are ordinary strings (the server ignored `return_tokens_as_token_ids`) or
//!   the server sent no logprobs, `tokens` is empty: not an error;
//! - `logprobs`: `logprobs.token_logprobs` (completions) or `logprobs.content[].logprob` (chat), empty
//!   when absent or when an entry is `null`. When both `tokens` and `logprobs` are given they must have
//!   the same length, or the answer is malformed;
//! - `finish`: from `finish_reason` and the matched stop, below.
//!
//! # Stop strings
//!
//! [`Completion::text`] *includes* the stop string that ended it, while OpenAI servers strip it by
//! default. The sampler therefore asks vLLM to keep it (`include_stop_str_in_output`) and reads which stop
//! matched from vLLM's `stop_reason` or SGLang's `matched_stop`:
//!
//! | `finish_reason` | matched stop | [`Finish`] | `text` |
//! |---|---|---|---|
//! | `"length"` | — | [`Finish::Length`] | as returned |
//! | `"stop"` | a string `s` | [`Finish::Stop(s)`](Finish::Stop) | ends with `s`: `s` is appended unless the server already kept it |
//! | `"stop"` | a token id (a stop token such as `<\|im_end\|>`), or `null` (end of sequence) | [`Finish::EndOfTurn`] | as returned |
//! | `"stop"` | field absent, no stop strings requested | [`Finish::EndOfTurn`] | as returned |
//! | `"stop"` | field absent, the text ends with a requested stop `s` | [`Finish::Stop(s)`](Finish::Stop) | as returned |
//! | `"stop"` | field absent, otherwise | [`Finish::Stop(String::new())`](Finish::Stop) | as returned |
//! | `"abort"` | — | retried, then [`SamplerError::Unavailable`] | — |
//! | anything else (`"tool_calls"`, `"content_filter"`, ...) | — | [`Finish::EndOfTurn`] | as returned |
//!
//! "Appended unless already kept": when the sampler asked for `include_stop_str_in_output` and the text
//! ends with `s`, it is kept as is; when it did not ask (extensions off), the server stripped `s` and `s`
//! is appended. The last `"stop"` row is the ambiguous case of a server that reports neither which stop
//! matched nor keeps it: the model stopped on one of the requested stops *or* at its end of sequence, and
//! the text cannot tell which. The empty stop string says "a stop, unknown which" without inventing text
//! (an empty string trivially ends `text`, so the [`Finish::Stop`] contract holds). Token ids and
//! logprobs are not adjusted: vLLM reports every sampled token, including those of the stop string.
//!
//! A fence's closing tag is not sent when the request's constraint is the fence's grammar (holoc's
//! `fenced`, which ends every sentence with the tag): vLLM checks stop strings on the text whatever the
//! grammar, so `</answer>` sent as one would cut a JSON string that holds it, while its structured output
//! (llguidance's `fill_next_token_bitmask` gives only the end of sequence once the matcher has stopped)
//! ends the reply where the grammar is complete, as the local model does. A reply that then ends with the
//! tag, unless another stop string ended it, is read as [`Finish::Stop`] of the tag, and the end-of-sequence
//! token the server lists after it (vLLM and `holo serve` keep it in the ids) is dropped with its logprob,
//! so that the completion is the local model's: the text through the tag. A regex or grammar that can go
//! on after the tag (`regex='.*'`) may run past its first `</answer>` there, where the local model stops.
//!
//! # Errors, retries and timeouts
//!
//! Each attempt has a deadline ([`OpenAiConfig::request_timeout`], from connecting to the end of the body;
//! [`OpenAiConfig::connect_timeout`] for the connection alone). A failed attempt is classified:
//!
//! | failure | retried | final error |
//! |---|---|---|
//! | connection refused/reset/dropped, timeout, body cut short | yes | [`SamplerError::Unavailable`] |
//! | HTTP 5xx, 429, 408 (`Retry-After` seconds honoured, capped at `max_delay`) | yes | [`SamplerError::Unavailable`] with the server's message |
//! | `finish_reason: "abort"` | yes | [`SamplerError::Unavailable`] |
//! | other HTTP 4xx (and unexpected 1xx/3xx) | no | [`SamplerError::Rejected`] with the status and the server's message |
//! | a 2xx whose body is not JSON or lacks a required field | at most [`OpenAiConfig::max_malformed_retries`] times | [`SamplerError::Malformed`] |
//!
//! A malformed body is retried a bounded number of times (1 by default) because a proxy or an overloaded
//! server can truncate or garble one answer, while a server that always answers in another format should
//! not be hammered. All retries of a request count against [`OpenAiConfig::max_retries`] (so a request
//! makes at most `max_retries + 1` attempts). The server's message is taken from `error.message`,
//! `message` or `detail` of a JSON error body, or from the body's text.
//!
//! Backoff before retry `k` (0-based) is `min(max_delay, base_delay · 2^k)`, with "equal jitter": a
//! uniformly drawn point of its upper half. The jitter comes from a splitmix64 sequence seeded by
//! [`OpenAiConfig::jitter_seed`] (time and process id when `None`), so that many clients do not retry in
//! lockstep.
//!
//! # Concurrency
//!
//! At most [`OpenAiConfig::max_concurrency`] requests are in flight at once, across every batch sent
//! through one [`OpenAi`] (a semaphore; a request waiting out its backoff holds no slot). The result has
//! one entry per request, in order: a request that fails permanently loses nothing of the others.
//!
//! # Authentication
//!
//! The API key is read once, by [`OpenAi::new`], from the environment variable named by
//! [`OpenAiConfig::api_key_env`] (`OPENAI_API_KEY` by default) and sent as `Authorization: Bearer KEY`.
//! When the variable is unset or empty, no `Authorization` header is sent (a local vLLM needs none).
//!
//! # TLS
//!
//! `https` URLs use rustls (aws-lc-rs crypto, the platform's root certificates); no system OpenSSL is
//! needed.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, RETRY_AFTER};
use reqwest::{StatusCode, Url};
use serde_json::{json, Map, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::machine::{Completion, Finish};
use crate::sampler::{
    ChatMessage, Constraint, Prompt, Request, SampleFuture, SampleParams, Sampler, SamplerError,
};
use crate::Role;

/// The environment variable the API key is read from unless configured otherwise.
pub const DEFAULT_API_KEY_ENV: &str = "OPENAI_API_KEY";

/// How to reach the server and how hard to try. Build with [`OpenAiConfig::new`] and adjust the public
/// fields.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenAiConfig {
    /// The server, `http(s)://host:port` with or without a trailing `/v1`.
    pub base_url: String,
    /// The `"model"` of every request.
    pub model: String,
    /// The environment variable holding the API key (default [`DEFAULT_API_KEY_ENV`]).
    pub api_key_env: String,
    /// Deadline of one attempt, from connecting to the end of the response body (default 10 min: long
    /// generations on a busy server are slow).
    pub request_timeout: Duration,
    /// Deadline of establishing a connection (default 10 s).
    pub connect_timeout: Duration,
    /// Retries after the first attempt, for every retryable failure together (default 6).
    pub max_retries: u32,
    /// How many of those retries may follow a malformed 2xx answer (default 1).
    pub max_malformed_retries: u32,
    /// Backoff before the first retry; doubles with each retry (default 500 ms).
    pub base_delay: Duration,
    /// Cap of one backoff, and of a server's `Retry-After` (default 30 s).
    pub max_delay: Duration,
    /// Requests in flight at once, across all batches of this sampler (default 16; at least 1).
    pub max_concurrency: usize,
    /// Send vLLM's extension fields: `return_tokens_as_token_ids`, `include_stop_str_in_output` and, to
    /// continue a final assistant message, `continue_final_message` / `add_generation_prompt` (default
    /// on; turn off for servers that reject unknown fields).
    pub vllm_extensions: bool,
    /// Use the proxies of the environment (`HTTP_PROXY`, `HTTPS_PROXY`, `NO_PROXY`; default on).
    pub proxy_from_env: bool,
    /// Seed of the backoff jitter; `None` seeds from the clock and the process id.
    pub jitter_seed: Option<u64>,
    /// Chat-template arguments sent with chat requests as `chat_template_kwargs` (vLLM's and `holo
    /// serve`'s field, e.g. `{"enable_thinking": false}`); none by default. Token prompts are rendered
    /// here already (by a [`crate::holophore::Holophore`] with the same arguments).
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

impl OpenAiConfig {
    /// The defaults for a server and model.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        OpenAiConfig {
            base_url: base_url.into(),
            model: model.into(),
            api_key_env: DEFAULT_API_KEY_ENV.to_string(),
            request_timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(10),
            max_retries: 6,
            max_malformed_retries: 1,
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(30),
            max_concurrency: 16,
            vllm_extensions: true,
            proxy_from_env: true,
            jitter_seed: None,
            chat_template_kwargs: None,
        }
    }
}

/// Why an [`OpenAi`] sampler could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "openai sampler: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

/// A sampler for an OpenAI-compatible server; see the [module documentation](self). Cheap to clone
/// (clones share the connection pool, the concurrency limit and the jitter sequence).
#[derive(Clone)]
pub struct OpenAi {
    inner: Arc<Inner>,
}

struct Inner {
    config: OpenAiConfig,
    client: reqwest::Client,
    completions_url: Url,
    chat_url: Url,
    /// `Bearer KEY`, marked sensitive.
    authorization: Option<HeaderValue>,
    slots: Semaphore,
    jitter: AtomicU64,
}

impl fmt::Debug for OpenAi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAi")
            .field("config", &self.inner.config)
            .field(
                "api_key",
                &self.inner.authorization.as_ref().map(|_| "<set>"),
            )
            .finish()
    }
}

impl OpenAi {
    /// Checks the configuration, reads the API key from the environment and builds the HTTP client.
    pub fn new(config: OpenAiConfig) -> Result<Self, ConfigError> {
        let (completions_url, chat_url) = endpoints(&config.base_url)?;
        if config.max_concurrency == 0 {
            return Err(ConfigError("max_concurrency must be at least 1".into()));
        }
        if config.max_concurrency > Semaphore::MAX_PERMITS {
            return Err(ConfigError(format!(
                "max_concurrency must be at most {}",
                Semaphore::MAX_PERMITS
            )));
        }
        let authorization = match std::env::var(&config.api_key_env) {
            Ok(key) if !key.trim().is_empty() => {
                let mut value =
                    HeaderValue::from_str(&format!("Bearer {}", key.trim())).map_err(|_| {
                        ConfigError(format!(
                            "the API key in ${} is not a valid HTTP header value",
                            config.api_key_env
                        ))
                    })?;
                value.set_sensitive(true);
                Some(value)
            }
            _ => None,
        };
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("holo-runtime/", env!("CARGO_PKG_VERSION")))
            .timeout(config.request_timeout)
            .connect_timeout(config.connect_timeout)
            .pool_max_idle_per_host(config.max_concurrency);
        if !config.proxy_from_env {
            builder = builder.no_proxy();
        }
        let client = builder
            .build()
            .map_err(|error| ConfigError(format!("cannot build the HTTP client: {error}")))?;
        let seed = config.jitter_seed.unwrap_or_else(clock_seed);
        Ok(OpenAi {
            inner: Arc::new(Inner {
                slots: Semaphore::new(config.max_concurrency),
                jitter: AtomicU64::new(seed),
                config,
                client,
                completions_url,
                chat_url,
                authorization,
            }),
        })
    }

    pub fn config(&self) -> &OpenAiConfig {
        &self.inner.config
    }

    /// Completes one request, with the retries and the concurrency limit of a batch.
    pub async fn complete(&self, request: &Request) -> Result<Completion, SamplerError> {
        self.inner.complete(request).await
    }

    /// The URL and JSON body the request is sent as (for logs and tests).
    pub fn request_body(&self, request: &Request) -> (Url, Value) {
        self.inner.body(request)
    }
}

impl Sampler for OpenAi {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        Box::pin(async move {
            let mut results: Vec<Option<Result<Completion, SamplerError>>> =
                vec![None; batch.len()];
            let mut tasks = JoinSet::new();
            let mut index_of = std::collections::HashMap::with_capacity(batch.len());
            for (index, request) in batch.iter().enumerate() {
                let inner = Arc::clone(&self.inner);
                let request = request.clone();
                let handle = tasks.spawn(async move { inner.complete(&request).await });
                index_of.insert(handle.id(), index);
            }
            while let Some(joined) = tasks.join_next_with_id().await {
                match joined {
                    Ok((id, result)) => results[index_of[&id]] = Some(result),
                    Err(error) => {
                        results[index_of[&error.id()]] = Some(Err(SamplerError::Unavailable(
                            format!("the request's task failed: {error}"),
                        )))
                    }
                }
            }
            results
                .into_iter()
                .map(|result| {
                    result.unwrap_or_else(|| {
                        Err(SamplerError::Unavailable(
                            "the request's task vanished".into(),
                        ))
                    })
                })
                .collect()
        })
    }
}

/// The outcome of one attempt.
enum Attempt {
    Done(Completion),
    /// Transient: retry after the backoff (or the server's `Retry-After`).
    Retry(String, Option<Duration>),
    /// A 2xx that is not a valid answer: retried a bounded number of times.
    Malformed(String),
    /// Retrying cannot help.
    Fatal(SamplerError),
}

impl Inner {
    async fn complete(&self, request: &Request) -> Result<Completion, SamplerError> {
        // The completion carries no prompt log-probabilities to read them into.
        if request.params.prompt_logprobs.is_some() {
            return Err(SamplerError::Rejected(
                "the openai sampler cannot report prompt log-probabilities".into(),
            ));
        }
        if request.params.chat_template_kwargs.is_some()
            && !matches!(request.prompt, Prompt::Chat(_))
        {
            return Err(SamplerError::Rejected(
                "chat template arguments come with chat prompts only: a token or text prompt is \
                 rendered already"
                    .into(),
            ));
        }
        let (url, body) = self.body(request);
        let body = serde_json::to_vec(&body).map_err(|error| {
            SamplerError::Rejected(format!("cannot encode the request: {error}"))
        })?;
        let mut attempts = 0u32;
        let mut malformed = 0u32;
        loop {
            attempts += 1;
            let outcome = {
                let _slot =
                    self.slots.acquire().await.map_err(|_| {
                        SamplerError::Unavailable("the sampler was shut down".into())
                    })?;
                self.attempt(&url, &body, &request.params).await
            };
            let (error, hint) = match outcome {
                Attempt::Done(completion) => return Ok(completion),
                Attempt::Fatal(error) => return Err(error),
                Attempt::Retry(message, hint) => (SamplerError::Unavailable(message), hint),
                Attempt::Malformed(message) => {
                    malformed += 1;
                    if malformed > self.config.max_malformed_retries {
                        return Err(SamplerError::Malformed(gave_up(&url, &message, attempts)));
                    }
                    (SamplerError::Malformed(message), None)
                }
            };
            if attempts > self.config.max_retries {
                return Err(match error {
                    SamplerError::Malformed(message) => {
                        SamplerError::Malformed(gave_up(&url, &message, attempts))
                    }
                    SamplerError::Unavailable(message)
                    | SamplerError::Rejected(message)
                    | SamplerError::Overloaded(message) => {
                        SamplerError::Unavailable(gave_up(&url, &message, attempts))
                    }
                });
            }
            tokio::time::sleep(self.backoff(attempts - 1, hint)).await;
        }
    }

    async fn attempt(&self, url: &Url, body: &[u8], params: &SampleParams) -> Attempt {
        let mut headers = HeaderMap::new();
        headers.insert(
            reqwest::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(authorization) = &self.authorization {
            headers.insert(reqwest::header::AUTHORIZATION, authorization.clone());
        }
        let sent = self
            .client
            .post(url.clone())
            .headers(headers)
            .body(body.to_vec())
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(error) => return transport_failure(error, &self.config),
        };
        let status = response.status();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let bytes = match response.bytes().await {
            Ok(bytes) => bytes,
            Err(error) => return transport_failure(error, &self.config),
        };
        if status.is_success() {
            return match serde_json::from_slice::<Value>(&bytes) {
                Ok(answer) => match parse_answer(&answer, params, self.config.vllm_extensions) {
                    Ok(completion) => Attempt::Done(completion),
                    Err(Parsed::Malformed(message)) => Attempt::Malformed(message),
                    Err(Parsed::Aborted(message)) => Attempt::Retry(message, None),
                },
                Err(error) => Attempt::Malformed(format!(
                    "the body is not JSON ({error}): {}",
                    excerpt(&String::from_utf8_lossy(&bytes))
                )),
            };
        }
        let message = format!("HTTP {}: {}", status.as_u16(), server_message(&bytes));
        if status.is_server_error()
            || status == StatusCode::TOO_MANY_REQUESTS
            || status == StatusCode::REQUEST_TIMEOUT
        {
            Attempt::Retry(message, retry_after)
        } else {
            Attempt::Fatal(SamplerError::Rejected(message))
        }
    }

    fn backoff(&self, retry: u32, hint: Option<Duration>) -> Duration {
        let max = self.config.max_delay;
        let exponential = self
            .config
            .base_delay
            .saturating_mul(1u32 << retry.min(30))
            .min(max);
        let nanos = exponential.as_nanos().min(u64::MAX as u128) as u64;
        let half = nanos / 2;
        let jittered = Duration::from_nanos(half + self.next_random() % (nanos - half + 1));
        match hint {
            Some(after) => jittered.max(after.min(max)),
            None => jittered,
        }
    }

    /// splitmix64: cheap, lock-free, good enough for jitter.
    fn next_random(&self) -> u64 {
        let mut z = self
            .jitter
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn body(&self, request: &Request) -> (Url, Value) {
        let extensions = self.config.vllm_extensions;
        let mut body = Map::new();
        body.insert("model".into(), json!(self.config.model));
        let url = match &request.prompt {
            Prompt::Tokens(ids) => {
                body.insert("prompt".into(), json!(ids));
                body.insert("logprobs".into(), json!(1));
                self.completions_url.clone()
            }
            Prompt::Text(text) => {
                body.insert("prompt".into(), json!(text));
                body.insert("logprobs".into(), json!(1));
                self.completions_url.clone()
            }
            Prompt::Chat(messages) => {
                body.insert(
                    "messages".into(),
                    Value::Array(messages.iter().map(chat_message).collect()),
                );
                body.insert("logprobs".into(), json!(true));
                let continues =
                    matches!(messages.last(), Some(message) if message.role == Role::Assistant);
                if extensions && continues {
                    body.insert("continue_final_message".into(), json!(true));
                    body.insert("add_generation_prompt".into(), json!(false));
                }
                // The request's own (a context's) over the sampler's.
                let mut kwargs = self.config.chat_template_kwargs.clone().unwrap_or_default();
                kwargs.extend(
                    request
                        .params
                        .chat_template_kwargs
                        .clone()
                        .unwrap_or_default(),
                );
                if !kwargs.is_empty() {
                    body.insert("chat_template_kwargs".into(), Value::Object(kwargs));
                }
                self.chat_url.clone()
            }
        };
        body.insert("n".into(), json!(1));
        body.insert("stream".into(), json!(false));
        let params = &request.params;
        if let Some(max_tokens) = params.max_tokens {
            body.insert("max_tokens".into(), json!(max_tokens));
        }
        if let Some(temperature) = params.temperature {
            body.insert("temperature".into(), json!(temperature));
        }
        if let Some(top_p) = params.top_p {
            body.insert("top_p".into(), json!(top_p));
        }
        if let Some(top_k) = params.top_k {
            body.insert("top_k".into(), json!(top_k));
        }
        let held_back = held_back_stop(params);
        let stop: Vec<&String> = params
            .stop
            .iter()
            .filter(|stop| Some(stop.as_str()) != held_back)
            .collect();
        if !stop.is_empty() {
            body.insert("stop".into(), json!(stop));
        }
        if let Some(seed) = params.seed {
            body.insert("seed".into(), json!(seed));
        }
        if let Some(constraint) = &params.constraint {
            let (key, value) = constraint_field(constraint);
            body.insert(key.into(), value);
        }
        if !params.logit_bias.is_empty() {
            let bias: Map<String, Value> = params
                .logit_bias
                .iter()
                .map(|(token, bias)| (token.to_string(), json!(bias)))
                .collect();
            body.insert("logit_bias".into(), Value::Object(bias));
        }
        if params.min_tokens > 0 {
            body.insert("min_tokens".into(), json!(params.min_tokens));
        }
        if !params.stop_token_ids.is_empty() {
            body.insert("stop_token_ids".into(), json!(params.stop_token_ids));
        }
        if params.ignore_eos {
            body.insert("ignore_eos".into(), json!(true));
        }
        if extensions {
            body.insert("return_tokens_as_token_ids".into(), json!(true));
            body.insert("include_stop_str_in_output".into(), json!(true));
        }
        (url, Value::Object(body))
    }
}

/// The stop string that a request does not send: its fence's closing tag, when its constraint is the
/// fence's grammar, which ends every sentence with the tag ([`holoc::ir::is_fenced`]). vLLM checks stop
/// strings on the text whatever the grammar, so the tag sent as one would cut a JSON string that holds
/// it; unsent, the grammar decides where the reply ends, as it does on the local model: vLLM's
/// structured output allows only the end of sequence once the grammar is complete.
fn held_back_stop(params: &SampleParams) -> Option<&str> {
    let Some(Constraint::Lark(grammar)) = &params.constraint else {
        return None;
    };
    params
        .stop
        .iter()
        .map(String::as_str)
        .find(|stop| holoc::ir::is_fenced(grammar, stop))
}

/// A constraint as the request field that asks an OpenAI-compatible server for it: OpenAI's
/// `response_format` for JSON, vLLM's `guided_*` fields for the others (a server without them refuses
/// the request, which is then [`SamplerError::Rejected`]).
fn constraint_field(constraint: &Constraint) -> (&'static str, Value) {
    match constraint {
        Constraint::JsonObject => ("response_format", json!({"type": "json_object"})),
        Constraint::JsonSchema(schema) => (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "schema", "schema": schema, "strict": true}}),
        ),
        Constraint::Regex(regex) => ("guided_regex", json!(regex)),
        Constraint::Choice(choices) => ("guided_choice", json!(choices)),
        Constraint::Lark(grammar) => ("guided_grammar", json!(grammar)),
    }
}

fn chat_message(message: &ChatMessage) -> Value {
    let role = match message.role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
    };
    json!({ "role": role, "content": message.content })
}

/// `{base}/v1/completions` and `{base}/v1/chat/completions`, `/v1` not doubled.
fn endpoints(base_url: &str) -> Result<(Url, Url), ConfigError> {
    let base = base_url.trim().trim_end_matches('/');
    let parsed = Url::parse(base)
        .map_err(|error| ConfigError(format!("invalid base URL `{base_url}`: {error}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(ConfigError(format!(
            "base URL `{base_url}` must be http:// or https://"
        )));
    }
    if parsed.host_str().is_none() {
        return Err(ConfigError(format!("base URL `{base_url}` has no host")));
    }
    let root = if base.ends_with("/v1") {
        base.to_string()
    } else {
        format!("{base}/v1")
    };
    let url = |path: &str| {
        Url::parse(&format!("{root}/{path}"))
            .map_err(|error| ConfigError(format!("invalid base URL `{base_url}`: {error}")))
    };
    Ok((url("completions")?, url("chat/completions")?))
}

fn transport_failure(error: reqwest::Error, config: &OpenAiConfig) -> Attempt {
    let cause = error_chain(&error);
    if error.is_builder() || error.is_redirect() {
        return Attempt::Fatal(SamplerError::Rejected(cause));
    }
    let message = if error.is_timeout() {
        format!(
            "timed out after {:?} (request_timeout) or {:?} (connect_timeout): {cause}",
            config.request_timeout, config.connect_timeout
        )
    } else if error.is_connect() {
        format!("cannot connect: {cause}")
    } else {
        format!("connection failed: {cause}")
    };
    Attempt::Retry(message, None)
}

/// An error with its sources, `a: b: c`, which is where reqwest keeps the useful part.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

fn gave_up(url: &Url, message: &str, attempts: u32) -> String {
    let plural = if attempts == 1 { "" } else { "s" };
    format!("POST {url}: {message} (gave up after {attempts} attempt{plural})")
}

/// The message of an error body: `error.message`, `error`, `message` or `detail`, else the text.
fn server_message(body: &[u8]) -> String {
    if let Ok(value) = serde_json::from_slice::<Value>(body) {
        let candidates = [
            value.pointer("/error/message"),
            value.get("error"),
            value.get("message"),
            value.get("detail"),
        ];
        for candidate in candidates.into_iter().flatten() {
            match candidate {
                Value::String(message) => return excerpt(message),
                Value::Null | Value::Object(_) => {}
                other => return excerpt(&other.to_string()),
            }
        }
    }
    let text = String::from_utf8_lossy(body);
    if text.trim().is_empty() {
        "(empty body)".into()
    } else {
        excerpt(&text)
    }
}

fn excerpt(text: &str) -> String {
    const MAX: usize = 1000;
    let text = text.trim();
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

enum Parsed {
    Malformed(String),
    Aborted(String),
}

/// Reads the first choice of a completions or chat answer.
fn parse_answer(
    answer: &Value,
    params: &SampleParams,
    asked_to_keep_stop: bool,
) -> Result<Completion, Parsed> {
    let malformed = |message: &str| Parsed::Malformed(message.to_string());
    let choices = answer
        .get("choices")
        .ok_or_else(|| malformed("no `choices`"))?
        .as_array()
        .ok_or_else(|| malformed("`choices` is not an array"))?;
    let choice = choices
        .iter()
        .find(|choice| choice.get("index").and_then(Value::as_u64) == Some(0))
        .or_else(|| choices.first())
        .ok_or_else(|| malformed("`choices` is empty"))?;
    let (mut text, chat) = match (choice.get("text"), choice.get("message")) {
        (Some(Value::String(text)), _) => (text.clone(), false),
        (_, Some(message @ Value::Object(_))) => match message.get("content") {
            Some(Value::String(content)) => (content.clone(), true),
            Some(Value::Null) | None => (String::new(), true),
            Some(_) => return Err(malformed("`message.content` is not a string")),
        },
        _ => return Err(malformed("the choice has neither `text` nor `message`")),
    };
    let reason = match choice.get("finish_reason") {
        Some(Value::String(reason)) => reason.as_str(),
        Some(Value::Null) | None => return Err(malformed("the choice has no `finish_reason`")),
        Some(_) => return Err(malformed("`finish_reason` is not a string")),
    };
    let (mut tokens, mut logprobs) = parse_logprobs(choice, chat).map_err(Parsed::Malformed)?;
    let matched = choice
        .get("stop_reason")
        .or_else(|| choice.get("matched_stop"));
    let finish = match reason {
        "length" => Finish::Length,
        "abort" => {
            return Err(Parsed::Aborted(
                "the server aborted the request (finish_reason \"abort\")".into(),
            ))
        }
        "stop" | "eos" | "stop_sequence" | "end_turn" => match matched {
            Some(Value::String(stop)) if !stop.is_empty() => {
                if !(asked_to_keep_stop && text.ends_with(stop.as_str())) {
                    text.push_str(stop);
                }
                Finish::Stop(stop.clone())
            }
            // A stop token id, or the end of sequence, as reported by the server.
            Some(_) => Finish::EndOfTurn,
            None if params.stop.is_empty() => Finish::EndOfTurn,
            None => match params
                .stop
                .iter()
                .filter(|stop| !stop.is_empty() && text.ends_with(stop.as_str()))
                .max_by_key(|stop| stop.len())
            {
                Some(stop) => Finish::Stop(stop.clone()),
                None => Finish::Stop(String::new()),
            },
        },
        _ => Finish::EndOfTurn,
    };
    // A fenced reply whose closing tag was not sent as a stop string ended at the tag, where its grammar
    // was complete: the tag is its stop, as on the local model. The end of sequence that the grammar
    // then forced (the last token the server lists when it did not stop at a string) is no part of it.
    let finish = match held_back_stop(params) {
        Some(close) if text.ends_with(close) && !matches!(matched, Some(Value::String(_))) => {
            if reason != "length" {
                tokens.pop();
                logprobs.pop();
            }
            Finish::Stop(close.to_string())
        }
        _ => finish,
    };
    Ok(Completion {
        text,
        tokens,
        logprobs,
        top_logprobs: Vec::new(),
        finish,
        routes: Vec::new(),
        weight_version: answer.get("weight_version").and_then(Value::as_u64),
        constraint: None,
    })
}

/// Token ids and logprobs of a choice; empty where the server gives none.
fn parse_logprobs(choice: &Value, chat: bool) -> Result<(Vec<u32>, Vec<f32>), String> {
    let mut tokens = match choice.get("token_ids") {
        Some(Value::Array(ids)) => ids
            .iter()
            .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or("`token_ids` holds something other than token ids")?,
        Some(Value::Null) | None => Vec::new(),
        Some(_) => return Err("`token_ids` is not an array".into()),
    };
    let logprobs = match choice.get("logprobs") {
        Some(Value::Null) | None => return Ok((tokens, Vec::new())),
        Some(logprobs @ Value::Object(_)) => logprobs,
        Some(_) => return Err("`logprobs` is not an object".into()),
    };
    let (strings, values): (Vec<Option<&str>>, Vec<Option<f64>>) = if chat {
        let content = match logprobs.get("content") {
            Some(Value::Array(content)) => content,
            Some(Value::Null) | None => return Ok((tokens, Vec::new())),
            Some(_) => return Err("`logprobs.content` is not an array".into()),
        };
        content
            .iter()
            .map(|entry| {
                (
                    entry.get("token").and_then(Value::as_str),
                    entry.get("logprob").and_then(Value::as_f64),
                )
            })
            .unzip()
    } else {
        let array = |field: &str| match logprobs.get(field) {
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(Value::Null) | None => Ok(None),
            Some(_) => Err(format!("`logprobs.{field}` is not an array")),
        };
        let strings = array("tokens")?
            .map(|items| items.iter().map(Value::as_str).collect())
            .unwrap_or_default();
        let values = array("token_logprobs")?
            .map(|items| items.iter().map(Value::as_f64).collect())
            .unwrap_or_default();
        (strings, values)
    };
    if tokens.is_empty() {
        tokens = strings
            .iter()
            .map(|token| token.and_then(parse_token_id))
            .collect::<Option<Vec<u32>>>()
            .unwrap_or_default();
    }
    let logprobs: Vec<f32> = values
        .iter()
        .map(|value| value.map(|value| value as f32))
        .collect::<Option<Vec<f32>>>()
        .unwrap_or_default();
    if !tokens.is_empty() && !logprobs.is_empty() && tokens.len() != logprobs.len() {
        return Err(format!(
            "{} token ids but {} logprobs",
            tokens.len(),
            logprobs.len()
        ));
    }
    Ok((tokens, logprobs))
}

/// `"token_id:1234"` → 1234 (vLLM's `return_tokens_as_token_ids`).
pub fn parse_token_id(token: &str) -> Option<u32> {
    token.strip_prefix("token_id:")?.parse().ok()
}

fn clock_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(seed: u64) -> Inner {
        let OpenAi { inner } = OpenAi::new(OpenAiConfig {
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            jitter_seed: Some(seed),
            api_key_env: "HOLO_OPENAI_UNIT_TEST_NO_SUCH_VAR".into(),
            ..OpenAiConfig::new("http://127.0.0.1:9", "m")
        })
        .unwrap();
        Arc::into_inner(inner).unwrap()
    }

    #[test]
    fn backoff_doubles_within_equal_jitter_and_caps() {
        let inner = sampler(7);
        for retry in 0..8 {
            let full = Duration::from_millis(100 * (1 << retry)).min(Duration::from_secs(1));
            for _ in 0..50 {
                let delay = inner.backoff(retry, None);
                assert!(delay >= full / 2 && delay <= full, "{retry}: {delay:?}");
            }
        }
        // Retry-After raises the delay, capped at max_delay.
        assert_eq!(
            inner.backoff(0, Some(Duration::from_secs(60))),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn jitter_is_reproducible_from_its_seed() {
        let (a, b, c) = (sampler(1), sampler(1), sampler(2));
        let draw = |inner: &Inner| (0..5).map(|_| inner.backoff(3, None)).collect::<Vec<_>>();
        assert_eq!(draw(&a), draw(&b));
        assert_ne!(draw(&a), draw(&c));
    }

    #[test]
    fn endpoints_do_not_double_v1() {
        for base in [
            "http://h:1",
            "http://h:1/",
            "http://h:1/v1",
            "http://h:1/v1/",
        ] {
            let (completions, chat) = endpoints(base).unwrap();
            assert_eq!(completions.as_str(), "http://h:1/v1/completions");
            assert_eq!(chat.as_str(), "http://h:1/v1/chat/completions");
        }
        let (completions, _) = endpoints("https://h/proxy/openai").unwrap();
        assert_eq!(
            completions.as_str(),
            "https://h/proxy/openai/v1/completions"
        );
        assert!(endpoints("ftp://h").is_err());
        assert!(endpoints("not a url").is_err());
    }

    #[test]
    fn server_messages() {
        assert_eq!(
            server_message(br#"{"error": {"message": "bad model", "code": 404}}"#),
            "bad model"
        );
        assert_eq!(
            server_message(br#"{"object": "error", "message": "too long", "code": 400}"#),
            "too long"
        );
        assert_eq!(server_message(br#"{"detail": "Not Found"}"#), "Not Found");
        assert_eq!(server_message(b"plain text\n"), "plain text");
        assert_eq!(server_message(b""), "(empty body)");
    }

    #[test]
    fn token_ids() {
        assert_eq!(parse_token_id("token_id:1234"), Some(1234));
        assert_eq!(parse_token_id("token_id:x"), None);
        assert_eq!(parse_token_id("hello"), None);
    }
}
