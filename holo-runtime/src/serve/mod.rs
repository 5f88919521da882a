//! An OpenAI-compatible HTTP server for any [`Sampler`]: `holo serve`.
//!
//! ```no_run
//! use holo_runtime::local::{LocalModel, LocalOptions};
//! use holo_runtime::serve::{ServeConfig, ServedModel, Server};
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let model = LocalModel::load("models/Qwen2.5-0.5B-Instruct", LocalOptions::default())?;
//! let served = ServedModel::local("qwen", model);
//! let server = Server::bind("127.0.0.1:8000", served, ServeConfig::default()).await?;
//! println!("serving on http://{}", server.local_addr());
//! server.run().await?;
//! # Ok(())
//! # }
//! ```
//!
//! Any other sampler is served with [`ServedModel::new`] (a tokenizer and chat template of your choice) or
//! [`ServedModel::from_dir`] (those of a Hugging Face model folder).
//!
//! [`Server::bind`] binds a [`tokio::net::TcpListener`] (port 0 picks a free port; [`Server::local_addr`]
//! says which); [`Server::run`] serves until the process ends, [`Server::run_until`] until a future
//! completes (graceful: requests in flight are answered), and [`Server::spawn`] runs it as a task whose
//! [`ServerHandle::shutdown`] stops it.
//!
//! # Endpoints
//!
//! | route | answer |
//! |---|---|
//! | `GET /health` | `200 {"status": "ok"}` |
//! | `GET /v1/models` | `{"object": "list", "data": [{"id", "object": "model", "created", "owned_by": "holo", "root", "parent": null, "max_model_len"}]}` |
//! | `GET /v1/models/{id}` | that model object, or 404 |
//! | `POST /v1/completions` | a `text_completion` (below) |
//! | `POST /v1/chat/completions` | a `chat.completion` (below) |
//! | anything else | 404 (unknown route) or 405 (wrong method), as an OpenAI error |
//!
//! Every prompt reaches the sampler as [`Prompt::Tokens`]: the server tokenizes, the sampler never sees text.
//!
//! # Request fields
//!
//! A field set to `null` is the same as a field left out. Fields this list does not name are ignored (as vLLM
//! does); fields whose effect the server cannot honour are refused unless they hold their neutral value (see
//! *Refused fields*).
//!
//! Both endpoints:
//! - `model`: must be the served id ([`ServedModel::id`]) when given; another id is a 404 `model_not_found`
//!   (OpenAI's and vLLM's status for an unknown model). Omitted: the served model.
//! - `max_tokens` (≥ 1); chat also `max_completion_tokens`, which wins over `max_tokens`. Default: 16 on
//!   completions (OpenAI's and vLLM's default); on chat, the rest of the context
//!   (`max_model_len - prompt tokens`) when [`ServedModel::max_model_len`] is known, else the sampler's
//!   default. With a known `max_model_len`, a prompt plus `max_tokens` longer than it is a 400.
//! - `temperature` (finite, ≥ 0), `top_p` (in (0, 1]), `top_k` (vLLM: an integer ≥ 1; `-1` or `0` turn it
//!   off).
//! - `stop`: a string or a list of strings (none empty). The text of a choice ends *before* the stop string
//!   that ended it (OpenAI's behaviour) unless `include_stop_str_in_output` (vLLM) is true; the choice's
//!   `stop_reason` (vLLM) is that string, or `null` when the model ended its turn or ran out of tokens.
//! - `seed`: any integer that fits 64 bits (a negative one is read as its two's complement). With `n`
//!   samples per prompt, sample 0 uses `seed` itself and sample `j > 0` a seed derived from `(seed, j)`
//!   (splitmix64, 63 bits), so `n` samples differ, the same request always gives the same choices, and
//!   every prompt of a request gets the same seeds. Without `seed`, each sample gets a fresh seed from the
//!   server's own generator (so `n` samples differ whatever the sampler does with an unseeded request).
//! - `n` (1 to 128): samples per prompt; each is one request of the batch.
//! - `return_tokens_as_token_ids` (vLLM): logprob tokens are written `"token_id:N"` instead of their text.
//! - `return_token_ids` (vLLM): each choice carries `token_ids` (the sampled ids); completions choices also
//!   carry `prompt_token_ids`, chat answers carry a top-level `prompt_token_ids`.
//! - `add_special_tokens` (vLLM): whether tokenizing the prompt adds the tokenizer's special tokens (its
//!   post-processor's BOS/EOS). Default `true` for completions, `false` for chat (the template writes them),
//!   as in vLLM.
//! - `stream`: `true` streams the answer (see *Streaming*); `stream_options` (only with `stream`):
//!   `include_usage`, and vLLM's `continuous_usage_stats`.
//!
//! `POST /v1/completions`:
//! - `prompt` (required): a string, a list of strings, a list of token ids, or a list of token-id lists.
//!   Strings are tokenized with the tokenizer; token ids must be below the tokenizer's vocabulary size. An
//!   empty prompt (no tokens) is a 400, and so is a request for more than 4096 samples (prompts × `n`).
//! - `logprobs`: an integer 0 to 20. The choice's `logprobs` is then
//!   `{"tokens", "token_logprobs", "text_offset", "top_logprobs": null}`: one entry per sampled token, its
//!   text (or `token_id:N`), its log-probability as the sampler reported it, and the character offset (in
//!   Unicode code points, as Python counts them) where the token's text starts in the choice's text.
//!   **`top_logprobs` is always `null`**: [`Completion`] carries the sampled token's log-probability only,
//!   no alternatives.
//! - `echo` must be false (the server returns the completion only).
//!
//! `POST /v1/chat/completions`:
//! - `messages` (required, not empty): objects with a string `role` and a `content` that is a string,
//!   `null`, or a list of `{"type": "text", "text": ...}` parts (joined with newlines, as vLLM does for
//!   string templates). Other fields of a message (`name`, `tool_calls`, ...) are passed to the template
//!   as they are, in their order.
//! - They are rendered with [`ServedModel::template`] exactly as transformers' `apply_chat_template` renders
//!   them, with `add_generation_prompt` (default `true`), `continue_final_message` (vLLM; default `false`)
//!   and `chat_template_kwargs` (vLLM; extra template variables such as `enable_thinking`). A template that
//!   raises, or an invalid combination, is a 400 naming the reason.
//! - `logprobs: true` gives the choice a `logprobs: {"content": [{"token", "logprob", "bytes",
//!   "top_logprobs": []}]}`; `top_logprobs` (0 to 20) is accepted and **its list is always empty** (no
//!   alternatives, as above). `bytes` are the token's own bytes (a byte-level BPE token that holds part of
//!   a UTF-8 character has its raw bytes here, while `token` shows the replacement character).
//! - The answer's `choices[i].message` is `{"role": "assistant", "content": text}`.
//!
//! Both answers carry `id`, `object`, `created`, `model`, `choices` (prompt-major: prompt `p`, sample `j`
//! is choice `p * n + j`) with `index`, `finish_reason` (`"length"` when `max_tokens` ran out, else
//! `"stop"`) and `stop_reason`, and `usage {prompt_tokens, completion_tokens, total_tokens}` (each
//! prompt's tokens counted once, every choice's sampled tokens).
//!
//! A choice's `logprobs` is `null` when not asked for, or when the sampler reported no token ids or no
//! log-probabilities for it. A log-probability of `-inf` is written as `-9999.0` (vLLM's convention; JSON
//! has no infinity).
//!
//! ## Streaming
//!
//! With `"stream": true` the answer is a `text/event-stream` of `data: {chunk}` events ending with
//! `data: [DONE]`, as OpenAI's and vLLM's are. Every chunk carries the answer's `id`, `object`
//! (`text_completion`, or `chat.completion.chunk`), `created`, `model` and one choice:
//! - completions: `{"index", "text", "logprobs", "finish_reason", "stop_reason"}`, `text` and `logprobs`
//!   holding what is new since the choice's last chunk (`text_offset` counts from the start of the
//!   choice's text);
//! - chat: first `{"index", "delta": {"role": "assistant", "content": ""}}` for every choice, then
//!   `{"index", "delta": {"content"}, "logprobs": {"content": [...]}, "finish_reason", "stop_reason"}`.
//!
//! A choice's last chunk has its `finish_reason` (`null` before). With `return_token_ids`, each chunk has
//! the choice's new `token_ids`; the prompt's ids come with a choice's first chunk (completions) or the
//! answer's first chunk (chat). With `stream_options.include_usage` every chunk has `"usage": null` and a
//! last chunk with no choices has the request's usage; with `continuous_usage_stats` as well, each chunk's
//! `usage` is its choice's so far. Joined, a choice's chunks are the choice of the same request not
//! streamed (the test suite checks this).
//!
//! Tokens stream as the sampler samples them when it reports them
//! ([`Sampler::sample_streaming`]: the local model does), otherwise all at once when the choice is done.
//! Text is decoded incrementally: a token that holds part of a character waits for the rest, and with
//! stop strings the last (longest stop − 1) bytes wait until no stop string can start there, so a stop
//! string never shows. An error once the stream has started (the sampler failed) is a last
//! `data: {"error": {...}}` event before `[DONE]`; anything wrong with the request is an ordinary error
//! response. A client that disconnects tells the sampler, which stops sampling for it (the local model
//! drops the row at its next step).
//!
//! ## Refused fields
//!
//! Refused with a 400 `unsupported_parameter` unless absent, `null` or neutral: `echo` (`false`), `suffix`
//! (`""`), `best_of` (equal to `n`), `logit_bias` (`{}`), `presence_penalty`, `frequency_penalty`, `min_p`
//! (`0`), `repetition_penalty` (`1`), `min_tokens` (`0`), `ignore_eos` (`false`), `stop_token_ids`,
//! `bad_words`, `tools` (`[]`), `tool_choice` (`"none"`), `response_format` (`{"type": "text"}`),
//! `prompt_logprobs`, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
//! `structured_outputs`, `logits_processors`, `prompt_embeds` (anything but `null`).
//!
//! # Sampling
//!
//! Each request's samples (a prompt × `n`) go to the sampler in one [`Sampler::sample_streaming`] call, on a
//! blocking thread (so a sampler that computes inside `poll` does not stall the HTTP side), as soon as the
//! request is parsed: calls of different requests run at once, and the sampler decides how to batch them.
//! The local model schedules every sequence of every call in one continuously batched engine
//! ([`crate::local::schedule`]): a request joins the running batch at the next decoding step, whatever
//! else runs. The server passes the tokens the sampler reports to streamed requests and sends each result
//! back. A request whose client has gone is not sampled, and the sampler hears of one that goes while it
//! samples ([`TokenSink::wanted`], [`TokenSink::token`]). A panicking sampler fails that request with a
//! 500 and the server goes on. A sampler whose queue is full ([`SamplerError::Overloaded`]) answers 429
//! with `Retry-After`.
//!
//! # Errors
//!
//! Every error is `{"error": {"message", "type", "param", "code"}}`:
//!
//! | case | status | `type` | `code` |
//! |---|---|---|---|
//! | body not JSON (the message has serde's line and column), not an object, a field of the wrong type or range (`param` names it) | 400 | `invalid_request_error` | `invalid_json`, `invalid_value`, `missing_field` |
//! | a refused field, `echo: true` | 400 | `invalid_request_error` | `unsupported_parameter` |
//! | the prompt does not fit `max_model_len` | 400 | `invalid_request_error` | `context_length_exceeded` |
//! | the chat template fails | 400 | `invalid_request_error` | `chat_template_error` |
//! | unknown `model` | 404 | `invalid_request_error` | `model_not_found` |
//! | unknown route / wrong method | 404 / 405 | `invalid_request_error` | `not_found` / `method_not_allowed` |
//! | body over [`ServeConfig::max_body_bytes`] | 413 | `invalid_request_error` | `body_too_large` |
//! | [`SamplerError::Rejected`] | 400 | `invalid_request_error` | `sampler_rejected` |
//! | [`SamplerError::Unavailable`], or the server shutting down | 503 | `server_error` | `sampler_unavailable` |
//! | [`SamplerError::Malformed`], a sampler panic, a result missing | 500 | `server_error` | `sampler_error` |
//! | [`SamplerError::Overloaded`] (with `Retry-After: 1`) | 429 | `invalid_request_error` | `server_overloaded` |
//!
//! When several samples of one request fail, the first failure (in choice order) is reported.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokenizers::Tokenizer;
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::chat::{ChatTemplate, RenderOptions};
use crate::machine::{Completion, Finish};
use crate::sampler::{Prompt, Request, SampleParams, Sampler, SamplerError, TokenSink};

mod stream;

/// A model as the server exposes it: the sampler that completes token prompts, and the tokenizer and chat
/// template that turn requests into token prompts and sampled tokens into logprob entries.
pub struct ServedModel {
    /// The id clients name in `model` and `/v1/models` lists.
    pub id: String,
    pub sampler: Arc<dyn Sampler>,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    /// The context length (prompt + completion), when known; used to refuse prompts that do not fit and
    /// to default chat `max_tokens`.
    pub max_model_len: Option<u32>,
}

impl fmt::Debug for ServedModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServedModel")
            .field("id", &self.id)
            .field("template", &self.template)
            .field("max_model_len", &self.max_model_len)
            .finish_non_exhaustive()
    }
}

/// Why a model folder could not be prepared for serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError(pub String);

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LoadError {}

impl ServedModel {
    /// A served model with no known context length.
    pub fn new(
        id: impl Into<String>,
        sampler: Arc<dyn Sampler>,
        tokenizer: Tokenizer,
        template: ChatTemplate,
    ) -> Self {
        ServedModel {
            id: id.into(),
            sampler,
            tokenizer,
            template,
            max_model_len: None,
        }
    }

    /// A [`LocalModel`](crate::local::LocalModel) with its own tokenizer, chat template and context length
    /// (`max_position_embeddings`).
    pub fn local(id: impl Into<String>, model: crate::local::LocalModel) -> Self {
        ServedModel {
            id: id.into(),
            tokenizer: model.tokenizer().clone(),
            template: model.template().clone(),
            max_model_len: u32::try_from(model.config().max_position_embeddings).ok(),
            sampler: Arc::new(model),
        }
    }

    /// The tokenizer (`tokenizer.json`), chat template ([`ChatTemplate::from_dir`], ChatML when the folder
    /// has none) and context length (`max_position_embeddings` of `config.json`, when present) of a Hugging
    /// Face model folder, served with `sampler`.
    pub fn from_dir(
        dir: &Path,
        id: impl Into<String>,
        sampler: Arc<dyn Sampler>,
    ) -> Result<Self, LoadError> {
        let tokenizer_file = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tokenizer_file).map_err(|error| {
            LoadError(format!(
                "{}: cannot load: {error}",
                tokenizer_file.display()
            ))
        })?;
        let template = ChatTemplate::from_dir_or(dir, ChatTemplate::chatml())
            .map_err(|error| LoadError(error.to_string()))?;
        let config_file = dir.join("config.json");
        let max_model_len = match std::fs::read_to_string(&config_file) {
            Ok(text) => {
                let config: Value = serde_json::from_str(&text).map_err(|error| {
                    LoadError(format!("{}: invalid JSON: {error}", config_file.display()))
                })?;
                config
                    .get("max_position_embeddings")
                    .and_then(Value::as_u64)
                    .and_then(|len| u32::try_from(len).ok())
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => None,
            Err(error) => {
                return Err(LoadError(format!(
                    "{}: cannot read: {error}",
                    config_file.display()
                )))
            }
        };
        Ok(ServedModel {
            max_model_len,
            ..ServedModel::new(id, sampler, tokenizer, template)
        })
    }
}

/// What the server accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeConfig {
    /// The largest request body (default 64 MiB).
    pub max_body_bytes: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            max_body_bytes: 64 << 20,
        }
    }
}

/// A bound server, not yet serving; see the [module documentation](self).
pub struct Server {
    listener: TcpListener,
    addr: SocketAddr,
    state: Arc<AppState>,
    jobs: mpsc::UnboundedReceiver<Job>,
    sampler: Arc<dyn Sampler>,
    config: ServeConfig,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .field("model", &self.state.id)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Binds `addr` (`"127.0.0.1:0"` for a free port) for `model`.
    pub async fn bind(
        addr: impl ToSocketAddrs,
        model: ServedModel,
        config: ServeConfig,
    ) -> io::Result<Server> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let ServedModel {
            id,
            sampler,
            mut tokenizer,
            template,
            max_model_len,
        } = model;
        // Prompts are sent whole: a tokenizer.json that pads or truncates must not do it here.
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .map_err(|error| io::Error::other(format!("tokenizer: {error}")))?;
        let (sender, jobs) = mpsc::unbounded_channel();
        let vocab = Vocab::new(&tokenizer);
        let state = Arc::new(AppState {
            max_prompt_bytes: max_model_len.map(|len| {
                let longest = (0..vocab.size)
                    .map(|id| vocab.bytes(id).len())
                    .max()
                    .unwrap_or(1);
                // A token stands for at most `longest` bytes of normalised text, and normalisation
                // (NFKC and the like) shrinks text by at most 4 bytes to 1.
                (len as usize)
                    .saturating_mul(longest.max(1))
                    .saturating_mul(4)
            }),
            vocab,
            id,
            tokenizer,
            template,
            max_model_len,
            created: unix_time(),
            jobs: sender,
            seeds: AtomicU64::new(clock_nonce()),
            ids: AtomicU64::new(0),
            nonce: clock_nonce() as u32,
        });
        Ok(Server {
            listener,
            addr,
            state,
            jobs,
            sampler,
            config,
        })
    }

    /// The bound address (the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until the process ends (or the listener fails).
    pub async fn run(self) -> io::Result<()> {
        self.run_until(std::future::pending()).await
    }

    /// Serves until `shutdown` completes, then stops accepting connections and returns once the requests
    /// in flight are answered.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> io::Result<()> {
        let Server {
            listener,
            state,
            jobs,
            sampler,
            config,
            ..
        } = self;
        let dispatcher = tokio::spawn(dispatch(jobs, sampler));
        let app = router(state, config.max_body_bytes);
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await;
        // The router (and with it every job sender) is gone: the dispatcher waits for the samples in
        // flight and ends.
        let _ = dispatcher.await;
        result
    }

    /// Serves on a new task; [`ServerHandle::shutdown`] stops it.
    pub fn spawn(self) -> ServerHandle {
        let addr = self.addr;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(self.run_until(async move {
            let _ = stopped.await;
        }));
        ServerHandle {
            addr,
            stop: Some(stop),
            task,
        }
    }
}

/// A server running on a task (from [`Server::spawn`]). Dropping the handle stops the server too.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<io::Result<()>>,
}

impl ServerHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, the base URL clients use (add `/v1` for the OpenAI SDKs).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting connections, answers the requests in flight, and returns how serving ended.
    pub async fn shutdown(mut self) -> io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(result) => result,
            Err(error) => Err(io::Error::other(format!("the server task failed: {error}"))),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Sampling

/// One request's samples on their way to the sampler: sample `i` is choice `i`.
struct Job {
    requests: Vec<Request>,
    outlet: Outlet,
}

/// Where a request's events go.
#[derive(Clone)]
struct Outlet {
    events: mpsc::UnboundedSender<Event>,
    /// Whether the request wants tokens as they are sampled.
    stream: bool,
}

/// What a request hears of its samples: tokens as they are sampled (streamed requests only), then each
/// sample's result.
enum Event {
    Token {
        choice: usize,
        token: u32,
        logprob: f32,
    },
    Done {
        choice: usize,
        result: Result<Completion, SamplerError>,
    },
}

/// A request's outlet as the sampler's [`TokenSink`]: a request whose client has gone (its receiver
/// dropped) wants no more tokens.
impl TokenSink for Outlet {
    fn token(&self, choice: usize, token: u32, logprob: f32) -> bool {
        if self.stream {
            self.events
                .send(Event::Token {
                    choice,
                    token,
                    logprob,
                })
                .is_ok()
        } else {
            !self.events.is_closed()
        }
    }

    fn wanted(&self, _choice: usize) -> bool {
        !self.events.is_closed()
    }
}

/// Starts a sampler call for every job as it arrives; ends when the job senders are gone and every call
/// has answered.
async fn dispatch(mut jobs: mpsc::UnboundedReceiver<Job>, sampler: Arc<dyn Sampler>) {
    let mut calls = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            job = jobs.recv() => match job {
                Some(job) if job.outlet.events.is_closed() => {}
                Some(job) => {
                    calls.spawn(sample(job, Arc::clone(&sampler)));
                }
                None => break,
            },
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
        }
    }
    while calls.join_next().await.is_some() {}
}

/// One job's sampler call; every choice hears of its result.
async fn sample(job: Job, sampler: Arc<dyn Sampler>) {
    let Job { requests, outlet } = job;
    let count = requests.len();
    let sink: Arc<dyn TokenSink> = Arc::new(outlet.clone());
    let runtime = tokio::runtime::Handle::current();
    let outcome = tokio::task::spawn_blocking(move || {
        runtime.block_on(async move { sampler.sample_streaming(&requests, sink).await })
    })
    .await;
    let mut results = match outcome {
        Ok(results) => results.into_iter(),
        Err(error) => {
            let message = if error.is_panic() {
                "the sampler panicked".to_string()
            } else {
                format!("the sampler task failed: {error}")
            };
            vec![Err(SamplerError::Malformed(message)); count].into_iter()
        }
    };
    let returned = results.len();
    for choice in 0..count {
        let result = results.next().unwrap_or_else(|| {
            Err(SamplerError::Malformed(format!(
                "the sampler returned {returned} results for a request of {count}"
            )))
        });
        let _ = outlet.events.send(Event::Done { choice, result });
    }
}

// ---------------------------------------------------------------------------------------------------
// State and routes

struct AppState {
    id: String,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    max_model_len: Option<u32>,
    vocab: Vocab,
    /// Texts longer than this many bytes cannot fit `max_model_len` (see [`AppState::tokenize`]).
    max_prompt_bytes: Option<usize>,
    created: u64,
    jobs: mpsc::UnboundedSender<Job>,
    /// splitmix64 state for the seeds of unseeded samples.
    seeds: AtomicU64,
    /// Counter for response ids.
    ids: AtomicU64,
    nonce: u32,
}

impl AppState {
    fn response_id(&self, prefix: &str) -> String {
        let count = self.ids.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:08x}{count:016x}", self.nonce)
    }

    fn fresh_seed(&self) -> u64 {
        let state = self
            .seeds
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        splitmix64(state) & (i64::MAX as u64)
    }

    /// The seed of sample `j` of a request (see the module documentation).
    fn sample_seed(&self, seed: Option<u64>, j: u32) -> u64 {
        match seed {
            Some(seed) if j == 0 => seed,
            Some(seed) => splitmix64(seed ^ splitmix64(u64::from(j))) & (i64::MAX as u64),
            None => self.fresh_seed(),
        }
    }

    fn model_object(&self) -> Value {
        json!({
            "id": self.id,
            "object": "model",
            "created": self.created,
            "owned_by": "holo",
            "root": self.id,
            "parent": null,
            "max_model_len": self.max_model_len,
        })
    }

    fn check_model(&self, fields: &Fields) -> Result<(), ApiError> {
        match fields.get("model") {
            None => Ok(()),
            Some(Value::String(model)) if *model == self.id => Ok(()),
            Some(Value::String(model)) => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "The model `{model}` does not exist; this server serves `{}`.",
                    self.id
                ),
            )
            .param("model")
            .code("model_not_found")),
            Some(other) => Err(ApiError::invalid(
                "model",
                format!("`model` must be a string, got {}", describe(other)),
            )),
        }
    }

    /// The ids of `text`; a text too long to fit the context in any tokenization is refused before
    /// tokenizing (which costs time and memory in proportion to its length).
    fn tokenize(
        &self,
        text: &str,
        add_special_tokens: bool,
        param: &str,
    ) -> Result<Vec<u32>, ApiError> {
        if let (Some(limit), Some(len)) = (self.max_prompt_bytes, self.max_model_len) {
            if text.len() > limit {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "This model's maximum context length is {len} tokens. However, `{param}` has {} \
                         bytes, more than any {len} tokens can spell ({limit} bytes). Please reduce it.",
                        text.len()
                    ),
                )
                .code("context_length_exceeded"));
            }
        }
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|error| {
                ApiError::invalid(param, format!("cannot tokenize `{param}`: {error}"))
            })
    }

    /// Sends the request's samples to the sampler; sample `i` is choice `i` of the events.
    fn submit(
        &self,
        requests: Vec<Request>,
        stream: bool,
    ) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
        let (events, receiver) = mpsc::unbounded_channel();
        let outlet = Outlet { events, stream };
        self.jobs.send(Job { requests, outlet }).map_err(|_| {
            ApiError::from_sampler(SamplerError::Unavailable(
                "the server is shutting down".into(),
            ))
        })?;
        Ok(receiver)
    }

    /// Sends the request's samples to the sampler, then waits for all of them.
    async fn generate(&self, requests: Vec<Request>) -> Result<Vec<Completion>, ApiError> {
        let count = requests.len();
        let mut events = self.submit(requests, false)?;
        let mut results: Vec<Option<Result<Completion, SamplerError>>> =
            (0..count).map(|_| None).collect();
        let mut missing = count;
        while missing > 0 {
            match events.recv().await {
                Some(Event::Done { choice, result }) => {
                    if results[choice].replace(result).is_none() {
                        missing -= 1;
                    }
                }
                Some(Event::Token { .. }) => {}
                None => break,
            }
        }
        results
            .into_iter()
            .map(|result| match result {
                Some(result) => result.map_err(ApiError::from_sampler),
                None => Err(ApiError::from_sampler(SamplerError::Unavailable(
                    "the sampler stopped before answering".into(),
                ))),
            })
            .collect()
    }

    /// The prompt length and the `max_tokens` to sample with, checked against `max_model_len`.
    fn budget(
        &self,
        prompt_len: usize,
        requested: Option<u32>,
        default: Option<u32>,
        which: &str,
    ) -> Result<Option<u32>, ApiError> {
        let Some(limit) = self.max_model_len else {
            return Ok(requested.or(default));
        };
        let limit = limit as usize;
        let too_long = |completion: usize| {
            ApiError::invalid(
                which,
                format!(
                    "This model's maximum context length is {limit} tokens. However, you requested {} tokens \
                     ({prompt_len} in the prompt, {completion} for the completion). Please reduce the prompt \
                     or `max_tokens`.",
                    prompt_len + completion
                ),
            )
            .code("context_length_exceeded")
        };
        if prompt_len >= limit {
            return Err(too_long(requested.or(default).unwrap_or(1) as usize));
        }
        let room = (limit - prompt_len) as u32;
        match requested.or(default) {
            Some(max_tokens) if max_tokens > room => Err(too_long(max_tokens as usize)),
            Some(max_tokens) => Ok(Some(max_tokens)),
            None => Ok(Some(room)),
        }
    }
}

fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(one_model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn list_models(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [state.model_object()]})).into_response()
}

async fn one_model(State(state): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> Response {
    if id == state.id {
        Json(state.model_object()).into_response()
    } else {
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "The model `{id}` does not exist; this server serves `{}`.",
                state.id
            ),
        )
        .code("model_not_found")
        .into_response()
    }
}

async fn not_found(method: Method, uri: Uri) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "no route {method} {}; routes: GET /health, GET /v1/models, POST /v1/completions, \
             POST /v1/chat/completions",
            uri.path()
        ),
    )
    .code("not_found")
    .into_response()
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}", uri.path()),
    )
    .code("method_not_allowed")
    .into_response()
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    complete(&state, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    chat(&state, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

// ---------------------------------------------------------------------------------------------------
// Errors

#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind: if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            },
            param: None,
            code: None,
        }
    }

    /// A 400 about one field.
    fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, message)
            .param(param)
            .code("invalid_value")
    }

    fn param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    fn from_sampler(error: SamplerError) -> Self {
        match error {
            SamplerError::Rejected(message) => ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("the sampler rejected the request: {message}"),
            )
            .code("sampler_rejected"),
            SamplerError::Unavailable(message) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the sampler is unavailable: {message}"),
            )
            .code("sampler_unavailable"),
            SamplerError::Malformed(message) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the sampler failed: {message}"),
            )
            .code("sampler_error"),
            SamplerError::Overloaded(message) => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the server is busy, retry later: {message}"),
            )
            .code("server_overloaded"),
        }
    }
}

impl ApiError {
    /// `{"error": {"message", "type", "param", "code"}}`, the body of an error response or chunk.
    fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // A full queue drains in about a second at the speeds this server runs at.
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}

/// A JSON value in an error message: short values as they are, others by kind.
fn describe(value: &Value) -> String {
    let text = value.to_string();
    if text.chars().count() <= 40 {
        return text;
    }
    match value {
        Value::String(_) => "a long string".into(),
        Value::Array(items) => format!("a list of {} items", items.len()),
        Value::Object(_) => "an object".into(),
        _ => text.chars().take(40).collect(),
    }
}

// ---------------------------------------------------------------------------------------------------
// Request fields

/// The body's bytes, or why they could not be read (too large, cut short).
fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        let status = rejection.status();
        let error = ApiError::new(
            status,
            format!("cannot read the request body: {}", rejection.body_text()),
        );
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            error.code("body_too_large")
        } else {
            error
        }
    })
}

/// The body as a JSON object.
fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "the request body must be a JSON object, got {}",
                kind_of(&other)
            ),
        )
        .code("invalid_json")),
        Err(error) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the request body is not valid JSON: {error}"),
        )
        .code("invalid_json")),
    }
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    /// A field that is present and not `null`.
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|value| !value.is_null())
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool, ApiError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(value)) => Ok(*value),
            Some(other) => Err(ApiError::invalid(
                key,
                format!("`{key}` must be true or false, got {}", describe(other)),
            )),
        }
    }

    /// An integer in `min..=max`.
    fn integer(&self, key: &str, min: u64, max: u64) -> Result<Option<u64>, ApiError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        match value.as_u64() {
            Some(number) if (min..=max).contains(&number) => Ok(Some(number)),
            _ => {
                let range = if max == u64::from(u32::MAX) {
                    format!("an integer ≥ {min}")
                } else {
                    format!("an integer from {min} to {max}")
                };
                Err(ApiError::invalid(
                    key,
                    format!("`{key}` must be {range}, got {}", describe(value)),
                ))
            }
        }
    }

    fn number(&self, key: &str) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => match value.as_f64() {
                Some(number) if number.is_finite() => Ok(Some(number)),
                _ => Err(ApiError::invalid(
                    key,
                    format!("`{key}` must be a number, got {}", describe(value)),
                )),
            },
        }
    }
}

/// What both endpoints share.
struct Common {
    /// `Some` when the answer is streamed.
    stream: Option<StreamOptions>,
    n: u32,
    seed: Option<u64>,
    params: SampleParams,
    include_stop: bool,
    token_ids_as_tokens: bool,
    return_token_ids: bool,
    add_special_tokens: bool,
}

fn common(fields: &Fields, chat: bool) -> Result<Common, ApiError> {
    let stream = stream_options(fields)?;
    refuse_unsupported(fields)?;
    let n = fields.integer("n", 1, 128)?.unwrap_or(1) as u32;
    if let Some(best_of) = fields.get("best_of") {
        if best_of.as_u64() != Some(u64::from(n)) {
            return Err(ApiError::invalid(
                "best_of",
                format!(
                    "`best_of` other than `n` is not supported (got {}, n = {n})",
                    describe(best_of)
                ),
            )
            .code("unsupported_parameter"));
        }
    }
    let max_tokens = fields.integer("max_tokens", 1, u64::from(u32::MAX))?;
    let max_tokens = if chat {
        fields
            .integer("max_completion_tokens", 1, u64::from(u32::MAX))?
            .or(max_tokens)
    } else {
        max_tokens
    };
    let temperature = fields.number("temperature")?;
    if let Some(temperature) = temperature {
        if temperature < 0.0 {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be ≥ 0, got {temperature}"),
            ));
        }
    }
    let top_p = fields.number("top_p")?;
    if let Some(top_p) = top_p {
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], got {top_p}"),
            ));
        }
    }
    let top_k = match fields.get("top_k") {
        None => None,
        Some(value) => match value.as_i64() {
            Some(-1 | 0) => None,
            Some(k) if k >= 1 && k <= i64::from(u32::MAX) => Some(k as u32),
            _ => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!(
                        "`top_k` must be an integer ≥ 1 (or -1 or 0 to turn it off), got {}",
                        describe(value)
                    ),
                ))
            }
        },
    };
    let stop = match fields.get("stop") {
        None => Vec::new(),
        Some(Value::String(stop)) => vec![stop.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| item.as_str().map(str::to_string))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| {
                ApiError::invalid("stop", "`stop` must be a string or a list of strings")
            })?,
        Some(other) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "`stop` must be a string or a list of strings, got {}",
                    describe(other)
                ),
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "`stop` strings must not be empty",
        ));
    }
    let seed = match fields.get("seed") {
        None => None,
        Some(value) => match (value.as_u64(), value.as_i64()) {
            (Some(seed), _) => Some(seed),
            (None, Some(seed)) => Some(seed as u64),
            _ => {
                return Err(ApiError::invalid(
                    "seed",
                    format!("`seed` must be a 64-bit integer, got {}", describe(value)),
                ))
            }
        },
    };
    Ok(Common {
        stream,
        n,
        seed,
        params: SampleParams {
            max_tokens: max_tokens.map(|max_tokens| max_tokens as u32),
            temperature,
            top_p,
            top_k,
            stop,
            seed: None,
        },
        include_stop: fields.bool("include_stop_str_in_output", false)?,
        token_ids_as_tokens: fields.bool("return_tokens_as_token_ids", false)?,
        return_token_ids: fields.bool("return_token_ids", false)?,
        add_special_tokens: fields.bool("add_special_tokens", !chat)?,
    })
}

/// `stream_options` of a streamed request.
#[derive(Debug, Clone, Copy, Default)]
struct StreamOptions {
    /// A last chunk with the usage of the whole request (and `"usage": null` in the others).
    include_usage: bool,
    /// (vLLM) Every chunk carries the usage of its choice so far.
    continuous_usage_stats: bool,
}

/// `stream` and `stream_options`: `Some` when the answer is streamed.
fn stream_options(fields: &Fields) -> Result<Option<StreamOptions>, ApiError> {
    let stream = fields.bool("stream", false)?;
    let options = match fields.get("stream_options") {
        None => return Ok(stream.then(StreamOptions::default)),
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` is only allowed when `stream` is true",
            ))
        }
        Some(Value::Object(options)) => options,
        Some(other) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!(
                    "`stream_options` must be an object, got {}",
                    describe(other)
                ),
            ))
        }
    };
    let flag = |key: &str| match options.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(flag)) => Ok(*flag),
        Some(other) => Err(ApiError::invalid(
            "stream_options",
            format!(
                "`stream_options.{key}` must be a boolean, got {}",
                describe(other)
            ),
        )),
    };
    Ok(Some(StreamOptions {
        include_usage: flag("include_usage")?,
        continuous_usage_stats: flag("continuous_usage_stats")?,
    }))
}

/// Fields the server cannot honour, refused unless neutral.
fn refuse_unsupported(fields: &Fields) -> Result<(), ApiError> {
    for (key, value) in fields.0 {
        if value.is_null() {
            continue;
        }
        let neutral = match key.as_str() {
            "echo" | "ignore_eos" => *value == Value::Bool(false),
            "suffix" => value.as_str() == Some(""),
            "logit_bias" => value.as_object().is_some_and(Map::is_empty),
            "presence_penalty" | "frequency_penalty" | "min_p" => value.as_f64() == Some(0.0),
            "repetition_penalty" => value.as_f64() == Some(1.0),
            "min_tokens" => value.as_u64() == Some(0),
            "stop_token_ids" | "bad_words" | "tools" => value.as_array().is_some_and(Vec::is_empty),
            "tool_choice" => value.as_str() == Some("none"),
            "response_format" => value.get("type").and_then(Value::as_str) == Some("text"),
            "prompt_logprobs" | "guided_json" | "guided_regex" | "guided_choice"
            | "guided_grammar" | "structured_outputs" | "logits_processors" | "prompt_embeds" => {
                false
            }
            _ => true,
        };
        if !neutral {
            let message = match key.as_str() {
                "echo" => "`echo` is not supported: the server returns the completion only; set `echo` to \
                           false"
                    .to_string(),
                "tools" | "tool_choice" => {
                    format!("`{key}` is not supported: this server does not call tools")
                }
                _ => format!(
                    "`{key}` is not supported by this server (got {}); leave it out or set it to null",
                    describe(value)
                ),
            };
            return Err(ApiError::invalid(key, message).code("unsupported_parameter"));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------
// /v1/completions

async fn complete(
    state: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let map = parse_object(&body_bytes(body)?)?;
    let fields = Fields(&map);
    state.check_model(&fields)?;
    let common = common(&fields, false)?;
    let logprobs = fields.integer("logprobs", 0, 20)?;
    let Some(prompt) = fields.get("prompt") else {
        return Err(ApiError::invalid("prompt", "`prompt` is required").code("missing_field"));
    };
    let prompts = prompts(state, prompt, common.add_special_tokens)?;
    if prompts.len() * common.n as usize > MAX_SAMPLES {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "{} prompts × n = {} is {} samples; one request may ask for at most {MAX_SAMPLES}",
                prompts.len(),
                common.n,
                prompts.len() * common.n as usize
            ),
        ));
    }
    let mut requests = Vec::with_capacity(prompts.len() * common.n as usize);
    for (index, ids) in prompts.iter().enumerate() {
        if ids.is_empty() {
            let which = if prompts.len() == 1 {
                "the prompt".to_string()
            } else {
                format!("prompt {index}")
            };
            return Err(ApiError::invalid(
                "prompt",
                format!("{which} is empty (no tokens)"),
            ));
        }
        let max_tokens =
            state.budget(ids.len(), common.params.max_tokens, Some(16), "max_tokens")?;
        for j in 0..common.n {
            requests.push(Request {
                prompt: Prompt::Tokens(ids.clone()),
                params: SampleParams {
                    max_tokens,
                    seed: Some(state.sample_seed(common.seed, j)),
                    ..common.params.clone()
                },
            });
        }
    }
    if let Some(options) = common.stream {
        let events = state.submit(requests, true)?;
        let endpoint = stream::Endpoint::Completions {
            logprobs: logprobs.is_some(),
        };
        return Ok(stream::respond(
            Arc::clone(state),
            endpoint,
            common,
            options,
            prompts,
            events,
        ));
    }
    let completions = state.generate(requests).await?;
    let mut choices = Vec::with_capacity(completions.len());
    let mut completion_tokens = 0;
    for (index, completion) in completions.iter().enumerate() {
        let prompt_ids = &prompts[index / common.n as usize];
        let out = Choice::new(state, completion, &common)?;
        completion_tokens += out.token_count;
        let mut choice = json!({
            "index": index,
            "text": out.text,
            "logprobs": match logprobs {
                Some(_) => out.completion_logprobs(state, &common),
                None => Value::Null,
            },
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        });
        if common.return_token_ids {
            choice["token_ids"] = json!(completion.tokens);
            choice["prompt_token_ids"] = json!(prompt_ids);
        }
        choices.push(choice);
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    Ok(Json(json!({
        "id": state.response_id("cmpl"),
        "object": "text_completion",
        "created": unix_time(),
        "model": state.id,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }))
    .into_response())
}

/// The most samples (prompts × `n`) one completions request may ask for.
const MAX_SAMPLES: usize = 4096;

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// The prompts of a completions request as token ids.
fn prompts(
    state: &AppState,
    prompt: &Value,
    add_special_tokens: bool,
) -> Result<Vec<Vec<u32>>, ApiError> {
    const SHAPE: &str =
        "`prompt` must be a string, a list of strings, a list of token ids, or a list of token-id lists";
    let shape =
        |got: &Value| ApiError::invalid("prompt", format!("{SHAPE}, got {}", describe(got)));
    let ids = |items: &[Value], which: &str| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|item| {
                let id = item
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "prompt",
                            format!(
                                "{which}: token ids must be non-negative integers, got {}",
                                describe(item)
                            ),
                        )
                    })?;
                if id >= state.vocab.size {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!(
                            "{which}: token id {id} is out of the vocabulary (size {})",
                            state.vocab.size
                        ),
                    ));
                }
                Ok(id)
            })
            .collect()
    };
    match prompt {
        Value::String(text) => Ok(vec![state.tokenize(text, add_special_tokens, "prompt")?]),
        Value::Array(items) if items.is_empty() => Err(ApiError::invalid(
            "prompt",
            "`prompt` must not be an empty list",
        )),
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|item| match item {
                    Value::String(text) => state.tokenize(text, add_special_tokens, "prompt"),
                    other => Err(shape(other)),
                })
                .collect(),
            Value::Number(_) => Ok(vec![ids(items, "`prompt`")?]),
            Value::Array(_) => items
                .iter()
                .enumerate()
                .map(|(index, item)| match item {
                    Value::Array(list) => ids(list, &format!("`prompt[{index}]`")),
                    other => Err(shape(other)),
                })
                .collect(),
            other => Err(shape(other)),
        },
        other => Err(shape(other)),
    }
}

// ---------------------------------------------------------------------------------------------------
// /v1/chat/completions

/// The parts of a chat body that go to the template as they are, keys in their order.
#[derive(Deserialize)]
struct TemplateInputs {
    #[serde(default)]
    messages: Option<Vec<minijinja::Value>>,
    #[serde(default)]
    chat_template_kwargs: Option<minijinja::Value>,
}

async fn chat(
    state: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let raw = body_bytes(body)?;
    let map = parse_object(&raw)?;
    let fields = Fields(&map);
    state.check_model(&fields)?;
    let common = common(&fields, true)?;
    let logprobs = fields.bool("logprobs", false)?;
    let top_logprobs = fields.integer("top_logprobs", 0, 20)?;
    if top_logprobs.is_some() && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs` set to true",
        ));
    }
    let add_generation_prompt = fields.bool("add_generation_prompt", true)?;
    let continue_final_message = fields.bool("continue_final_message", false)?;
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` continues the final message and `add_generation_prompt` starts a new \
             one: set `add_generation_prompt` to false to continue",
        ));
    }
    let messages = match fields.get("messages") {
        None => {
            return Err(
                ApiError::invalid("messages", "`messages` is required").code("missing_field")
            )
        }
        Some(Value::Array(messages)) if messages.is_empty() => {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must not be empty",
            ))
        }
        Some(Value::Array(messages)) => messages,
        Some(other) => {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "`messages` must be a list of messages, got {}",
                    describe(other)
                ),
            ))
        }
    };
    let mut contents = Vec::with_capacity(messages.len());
    for (index, message) in messages.iter().enumerate() {
        let Value::Object(message) = message else {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "`messages[{index}]` must be an object, got {}",
                    describe(message)
                ),
            ));
        };
        match message.get("role") {
            Some(Value::String(_)) => {}
            Some(other) => {
                return Err(ApiError::invalid(
                    "messages",
                    format!(
                        "`messages[{index}].role` must be a string, got {}",
                        describe(other)
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    "messages",
                    format!("`messages[{index}].role` is required"),
                ))
            }
        }
        contents.push(content(message.get("content"), index)?);
    }
    if let Some(kwargs) = fields.get("chat_template_kwargs") {
        if !kwargs.is_object() {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                format!(
                    "`chat_template_kwargs` must be an object, got {}",
                    describe(kwargs)
                ),
            ));
        }
    }
    // The same JSON again, as template values that keep the keys' order.
    let inputs: TemplateInputs = serde_json::from_slice(&raw).map_err(|error| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the request body is not valid JSON: {error}"),
        )
        .code("invalid_json")
    })?;
    let values = inputs.messages.unwrap_or_default();
    let mut rendered_messages = Vec::with_capacity(values.len());
    for (value, content) in values.iter().zip(contents) {
        let keys: Vec<minijinja::Value> =
            value.try_iter().map(Iterator::collect).unwrap_or_default();
        let pairs: Vec<(minijinja::Value, minijinja::Value)> = keys
            .into_iter()
            .map(|key| {
                let item = if key.as_str() == Some("content") {
                    content.clone()
                } else {
                    value.get_item(&key).unwrap_or_default()
                };
                (key, item)
            })
            .collect();
        rendered_messages.push(minijinja::Value::from_pairs(pairs));
    }
    let mut variables = BTreeMap::new();
    if let Some(kwargs) = inputs.chat_template_kwargs {
        if let Ok(keys) = kwargs.try_iter() {
            for key in keys {
                if let Some(name) = key.as_str() {
                    variables.insert(name.to_string(), kwargs.get_item(&key).unwrap_or_default());
                }
            }
        }
    }
    let options = RenderOptions {
        add_generation_prompt,
        continue_final_message,
        variables,
        ..RenderOptions::default()
    };
    let text = state
        .template
        .render_values(rendered_messages, &options)
        .map_err(|error| {
            ApiError::invalid(
                "messages",
                format!("cannot apply the chat template: {error}"),
            )
            .code("chat_template_error")
        })?;
    let prompt_ids = state.tokenize(&text, common.add_special_tokens, "messages")?;
    if prompt_ids.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "the rendered conversation is empty (no tokens)",
        ));
    }
    let max_tokens = state.budget(
        prompt_ids.len(),
        common.params.max_tokens,
        None,
        "max_tokens",
    )?;
    let requests = (0..common.n)
        .map(|j| Request {
            prompt: Prompt::Tokens(prompt_ids.clone()),
            params: SampleParams {
                max_tokens,
                seed: Some(state.sample_seed(common.seed, j)),
                ..common.params.clone()
            },
        })
        .collect();
    if let Some(options) = common.stream {
        let events = state.submit(requests, true)?;
        let endpoint = stream::Endpoint::Chat { logprobs };
        return Ok(stream::respond(
            Arc::clone(state),
            endpoint,
            common,
            options,
            vec![prompt_ids],
            events,
        ));
    }
    let completions = state.generate(requests).await?;
    let mut choices = Vec::with_capacity(completions.len());
    let mut completion_tokens = 0;
    for (index, completion) in completions.iter().enumerate() {
        let out = Choice::new(state, completion, &common)?;
        completion_tokens += out.token_count;
        let mut choice = json!({
            "index": index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": if logprobs { out.chat_logprobs(state, &common) } else { Value::Null },
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        });
        if common.return_token_ids {
            choice["token_ids"] = json!(completion.tokens);
        }
        choices.push(choice);
    }
    let mut answer = json!({
        "id": state.response_id("chatcmpl"),
        "object": "chat.completion",
        "created": unix_time(),
        "model": state.id,
        "choices": choices,
        "usage": usage(prompt_ids.len(), completion_tokens),
    });
    if common.return_token_ids {
        answer["prompt_token_ids"] = json!(prompt_ids);
    }
    Ok(Json(answer).into_response())
}

/// A message's content as the template sees it: a string, `none`, or text parts joined with newlines.
fn content(content: Option<&Value>, index: usize) -> Result<minijinja::Value, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(minijinja::Value::from(())),
        Some(Value::String(text)) => Ok(minijinja::Value::from(text.as_str())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (part_index, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text")) {
                    (Some("text"), Some(Value::String(text))) => texts.push(text.as_str()),
                    (Some("text"), _) => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!("`messages[{index}].content[{part_index}].text` must be a string"),
                        ))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!(
                                "`messages[{index}].content[{part_index}]`: only text parts are supported, \
                                 got type `{other}`"
                            ),
                        )
                        .code("unsupported_parameter"))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!(
                                "`messages[{index}].content[{part_index}]` must be an object with `type` \
                                 \"text\" and a `text`"
                            ),
                        ))
                    }
                }
            }
            Ok(minijinja::Value::from(texts.join("\n")))
        }
        Some(other) => Err(ApiError::invalid(
            "messages",
            format!(
                "`messages[{index}].content` must be a string, null or a list of text parts, got {}",
                describe(other)
            ),
        )),
    }
}

// ---------------------------------------------------------------------------------------------------
// Choices

/// A completion as an OpenAI choice.
struct Choice<'a> {
    completion: &'a Completion,
    text: String,
    finish_reason: &'static str,
    stop_reason: Value,
    token_count: usize,
}

impl<'a> Choice<'a> {
    fn new(
        state: &AppState,
        completion: &'a Completion,
        common: &Common,
    ) -> Result<Self, ApiError> {
        if !completion.tokens.is_empty()
            && !completion.logprobs.is_empty()
            && completion.tokens.len() != completion.logprobs.len()
        {
            return Err(ApiError::from_sampler(SamplerError::Malformed(format!(
                "{} token ids but {} logprobs",
                completion.tokens.len(),
                completion.logprobs.len()
            ))));
        }
        let mut text = completion.text.clone();
        let (finish_reason, stop_reason) = match &completion.finish {
            Finish::Length => ("length", Value::Null),
            Finish::EndOfTurn => ("stop", Value::Null),
            Finish::Stop(stop) if stop.is_empty() => ("stop", Value::Null),
            Finish::Stop(stop) => {
                if !common.include_stop && text.ends_with(stop.as_str()) {
                    text.truncate(text.len() - stop.len());
                }
                ("stop", Value::String(stop.clone()))
            }
        };
        let token_count = if completion.tokens.is_empty() {
            state
                .tokenizer
                .encode(completion.text.as_str(), false)
                .map(|encoding| encoding.len())
                .unwrap_or(0)
        } else {
            completion.tokens.len()
        };
        Ok(Choice {
            completion,
            text,
            finish_reason,
            stop_reason,
            token_count,
        })
    }

    /// Whether the sampler reported what a logprobs block needs.
    fn has_logprobs(&self) -> bool {
        !self.completion.tokens.is_empty() && !self.completion.logprobs.is_empty()
    }

    fn completion_logprobs(&self, state: &AppState, common: &Common) -> Value {
        if !self.has_logprobs() {
            return Value::Null;
        }
        let completion = self.completion;
        completion_logprobs(state, common, &completion.tokens, &completion.logprobs, 0)
    }

    fn chat_logprobs(&self, state: &AppState, common: &Common) -> Value {
        if !self.has_logprobs() {
            return Value::Null;
        }
        chat_logprobs(
            state,
            common,
            &self.completion.tokens,
            &self.completion.logprobs,
        )
    }
}

fn token_name(state: &AppState, common: &Common, id: u32) -> String {
    if common.token_ids_as_tokens {
        format!("token_id:{id}")
    } else {
        String::from_utf8_lossy(&state.vocab.bytes(id)).into_owned()
    }
}

/// A completions `logprobs` block for the tokens `tokens[from..]` of a choice whose tokens so far are
/// `tokens` (`logprobs` are theirs); `text_offset` counts from the start of the choice's text.
fn completion_logprobs(
    state: &AppState,
    common: &Common,
    tokens: &[u32],
    logprobs: &[f32],
    from: usize,
) -> Value {
    let pieces: Vec<Vec<u8>> = tokens.iter().map(|&id| state.vocab.bytes(id)).collect();
    let text_offset = &text_offsets(&pieces)[from..];
    let names: Vec<String> = tokens[from..]
        .iter()
        .map(|&id| token_name(state, common, id))
        .collect();
    let token_logprobs: Vec<Value> = logprobs[from..].iter().map(|&lp| logprob(lp)).collect();
    json!({
        "tokens": names,
        "token_logprobs": token_logprobs,
        "text_offset": text_offset,
        "top_logprobs": null,
    })
}

/// A chat `logprobs` block for `tokens` (`logprobs` are theirs).
fn chat_logprobs(state: &AppState, common: &Common, tokens: &[u32], logprobs: &[f32]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .zip(logprobs)
        .map(|(&id, &lp)| {
            json!({
                "token": token_name(state, common, id),
                "logprob": logprob(lp),
                "bytes": state.vocab.bytes(id),
                "top_logprobs": [],
            })
        })
        .collect();
    json!({ "content": content })
}

/// A log-probability as JSON: `-inf` (and NaN) as vLLM's `-9999.0`.
fn logprob(value: f32) -> Value {
    if value.is_finite() {
        json!(f64::from(value))
    } else {
        json!(-9999.0)
    }
}

/// Where each piece starts in the lossy UTF-8 decoding of all pieces together, in characters (code
/// points): the index of the character that holds the piece's first byte. A piece that starts inside a
/// character another piece began starts where that character does; a piece with no bytes starts where the
/// next one would.
fn text_offsets(pieces: &[Vec<u8>]) -> Vec<usize> {
    let all: Vec<u8> = pieces.concat();
    // The character index of every byte, as `String::from_utf8_lossy` decodes them (one U+FFFD for each
    // invalid run), and the character count at the end.
    let mut char_of_byte = Vec::with_capacity(all.len() + 1);
    let mut index = 0;
    for chunk in all.utf8_chunks() {
        for c in chunk.valid().chars() {
            char_of_byte.extend(std::iter::repeat_n(index, c.len_utf8()));
            index += 1;
        }
        if !chunk.invalid().is_empty() {
            char_of_byte.extend(std::iter::repeat_n(index, chunk.invalid().len()));
            index += 1;
        }
    }
    char_of_byte.push(index);
    let mut start = 0;
    pieces
        .iter()
        .map(|piece| {
            let offset = char_of_byte[start];
            start += piece.len();
            offset
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------
// Token bytes

/// How a vocabulary entry spells its bytes.
enum Spelling {
    /// GPT-2 byte-level BPE: every byte is one printable character.
    ByteLevel(HashMap<char, u8>),
    /// SentencePiece: `▁` is a space, `<0xNN>` a raw byte.
    Metaspace,
    /// Anything else: the decoder's output for the token alone.
    Decoder,
}

struct Vocab {
    tokenizer: Tokenizer,
    spelling: Spelling,
    /// Added tokens (`<|im_end|>`, ...) are stored as their text.
    added: HashMap<u32, String>,
    /// Ids below this are in the vocabulary.
    size: u32,
}

impl Vocab {
    fn new(tokenizer: &Tokenizer) -> Self {
        let decoder = tokenizer
            .get_decoder()
            .and_then(|decoder| serde_json::to_string(decoder).ok())
            .unwrap_or_default();
        let spelling = if decoder.contains("\"ByteLevel\"") {
            Spelling::ByteLevel(byte_level_alphabet())
        } else if decoder.contains("ByteFallback")
            || decoder.contains("Metaspace")
            || decoder.contains('\u{2581}')
        {
            Spelling::Metaspace
        } else {
            Spelling::Decoder
        };
        let added: HashMap<u32, String> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, token)| (id, token.content))
            .collect();
        let largest = added
            .keys()
            .copied()
            .max()
            .map_or(0, |id| id.saturating_add(1));
        let size = (tokenizer.get_vocab_size(true) as u32).max(largest);
        Vocab {
            tokenizer: tokenizer.clone(),
            spelling,
            added,
            size,
        }
    }

    fn bytes(&self, id: u32) -> Vec<u8> {
        if let Some(content) = self.added.get(&id) {
            return content.as_bytes().to_vec();
        }
        let Some(token) = self.tokenizer.id_to_token(id) else {
            return Vec::new();
        };
        match &self.spelling {
            Spelling::ByteLevel(alphabet) => {
                let mut bytes = Vec::with_capacity(token.len());
                for c in token.chars() {
                    match alphabet.get(&c) {
                        Some(&byte) => bytes.push(byte),
                        None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                bytes
            }
            Spelling::Metaspace => {
                let hex = token
                    .strip_prefix("<0x")
                    .and_then(|rest| rest.strip_suffix('>'))
                    .filter(|hex| hex.len() == 2)
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok());
                match hex {
                    Some(byte) => vec![byte],
                    None => token.replace('\u{2581}', " ").into_bytes(),
                }
            }
            Spelling::Decoder => self
                .tokenizer
                .decode(&[id], false)
                .map(String::into_bytes)
                .unwrap_or_else(|_| token.into_bytes()),
        }
    }
}

/// GPT-2's `bytes_to_unicode`, inverted: the character that stands for each byte.
fn byte_level_alphabet() -> HashMap<char, u8> {
    let mut alphabet = HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for byte in 0..=255u8 {
        let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(byte)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
        alphabet.insert(c, byte);
    }
    alphabet
}

// ---------------------------------------------------------------------------------------------------
// Small helpers

fn splitmix64(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs())
        .unwrap_or(0)
}

fn clock_nonce() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos() as u64)
        .unwrap_or(0);
    splitmix64(nanos ^ (u64::from(std::process::id()) << 32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_is_gpt2s() {
        let alphabet = byte_level_alphabet();
        assert_eq!(alphabet.len(), 256);
        assert_eq!(alphabet[&'Ġ'], b' ');
        assert_eq!(alphabet[&'Ċ'], b'\n');
        assert_eq!(alphabet[&'a'], b'a');
        assert_eq!(alphabet[&'Ā'], 0);
    }

    #[test]
    fn text_offsets_follow_the_lossy_decoding() {
        let e_acute = "é".as_bytes();
        let pieces = [
            b"ab".to_vec(),
            e_acute[..1].to_vec(),
            e_acute[1..].to_vec(),
            b"c".to_vec(),
            vec![0xC4],
            b"J".to_vec(),
            Vec::new(),
            b"in".to_vec(),
        ];
        // "abéc�Jin": é starts at 2 (both of its pieces), c at 3, the lone 0xC4 is � at 4, J at 5.
        assert_eq!(text_offsets(&pieces), [0, 2, 2, 3, 4, 5, 6, 6]);
        assert_eq!(text_offsets(&[]), Vec::<usize>::new());
    }

    #[test]
    fn derived_seeds_are_stable_and_distinct() {
        let seeds: Vec<u64> = (1..5u64)
            .map(|j| splitmix64(42 ^ splitmix64(j)) & (i64::MAX as u64))
            .collect();
        let again: Vec<u64> = (1..5u64)
            .map(|j| splitmix64(42 ^ splitmix64(j)) & (i64::MAX as u64))
            .collect();
        assert_eq!(seeds, again);
        let mut unique = seeds.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), seeds.len());
    }
}
