//! [`Client`]: one Tinker service, reached as the `tinker` SDK 0.25.0 reaches it.
//!
//! - **Authentication**: every request carries `X-API-Key`, the key from `TINKER_API_KEY`, which must
//!   start with `tml-` (as the SDK requires; [`api_key_from_env`]).
//! - **Futures**: every operation answers `{request_id}`; its result is asked for with `POST
//!   /api/v1/retrieve_future`, which the server holds until the result is ready or its own timeout
//!   passes (SkyRL: 300 s, then HTTP 408). The client asks again after a 408, a JSON `try_again` (the
//!   hosted service's) or its own poll timeout ([`Waits::poll`]), until [`Waits::result`] has passed in
//!   all. A failed request (SkyRL: HTTP 400 with the error; the hosted service: a JSON `error`) is
//!   [`TinkerError::Failed`].
//! - **Sequence numbers**: the training operations of a model carry increasing `seq_id`s; the server
//!   answers a repeated `(model_id, seq_id)` with the first request's future, so a request tried again
//!   after a lost connection is not applied twice.
//! - **Transient failures** are retried as the SDK retries them (its `_base_client.py` and
//!   `InternalClientHolder.execute_with_retries`): a refused, reset or timed-out connection, and HTTP
//!   408, 409, 429 and 5xx (unless the answer's `x-should-retry` says `false`), up to [`Waits::retries`]
//!   times, 0.5, 1, 2… s apart up to 10 s (a `Retry-After` of at most 60 s is waited instead), and
//!   none after [`Waits::retry_deadline`] since the call's first failure; then the call fails naming the
//!   request, the tries and the time ([`TinkerError::GaveUp`]). A retried operation carries the same
//!   `seq_id`, so the service applies it once. Heartbeats are not retried (the SDK sends them with
//!   `max_retries=0`; the next one follows 10 s later). The SDK's jitter (up to a quarter of each
//!   wait) is left out: it spreads many clients' retries, and a run is one client. A server that
//!   restarted has forgotten the session, the model and its futures (SkyRL keeps them in its
//!   database; started on a fresh one, it answers 404): that is an error, never retried and never a
//!   silent new model. What was checkpointed stays at its `tinker://` path.
//!
//! Every error names the service's URL and the operation ([`TinkerError`]).

use std::fmt;
use std::time::{Duration, Instant};

use reqwest::header::{ACCEPT, CONTENT_TYPE};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::super::{chain, shortened};
use super::wire::{self, Datum, ForwardBackwardResult, LossFn, SampledSequence};

/// The environment variable that holds the API key.
pub const API_KEY_VARIABLE: &str = "TINKER_API_KEY";

/// The environment variable that sets [`Waits::retry_deadline`], in seconds.
pub const RETRY_DEADLINE_VARIABLE: &str = "HOLO_TINKER_RETRY_DEADLINE";

const PROTOBUF: &str = "application/x-protobuf";

/// The API key from `TINKER_API_KEY`: present and starting with `tml-`.
pub fn api_key_from_env() -> Result<String, String> {
    match std::env::var(API_KEY_VARIABLE) {
        Ok(key) => check_api_key(&key).map(|()| key),
        Err(_) => Err(format!(
            "{API_KEY_VARIABLE} is not set: the Tinker service takes an API key that starts with `tml-`"
        )),
    }
}

/// A Tinker API key starts with `tml-`.
pub fn check_api_key(key: &str) -> Result<(), String> {
    if key.starts_with("tml-") && key.len() > 4 {
        Ok(())
    } else {
        Err(format!(
            "{API_KEY_VARIABLE} does not start with `tml-`: it is not a Tinker API key"
        ))
    }
}

/// How long the client waits, and how often it tries again.
#[derive(Debug, Clone, PartialEq)]
pub struct Waits {
    /// One `retrieve_future` request (asked again after it).
    pub poll: Duration,
    /// A future's result, in all.
    pub result: Duration,
    /// Any other request.
    pub request: Duration,
    /// Tries again after a transient failure (the SDK's `DEFAULT_MAX_RETRIES`).
    pub retries: u32,
    /// The wait before the first of them (the SDK's `INITIAL_RETRY_DELAY`); doubles with each, up to
    /// `retry_delay_max` (its `MAX_RETRY_DELAY`).
    pub retry_delay: Duration,
    pub retry_delay_max: Duration,
    /// No retry starts this long after a call's first failure (the SDK's `execute_with_retries`
    /// stops 5 minutes after its first try); `HOLO_TINKER_RETRY_DEADLINE` sets it ([`Waits::from_env`]).
    pub retry_deadline: Duration,
}

impl Default for Waits {
    fn default() -> Self {
        Waits {
            poll: Duration::from_secs(60),
            result: Duration::from_secs(3600),
            request: Duration::from_secs(120),
            retries: 10,
            retry_delay: Duration::from_millis(500),
            retry_delay_max: Duration::from_secs(10),
            retry_deadline: Duration::from_secs(300),
        }
    }
}

impl Waits {
    /// The defaults, with the retry deadline `HOLO_TINKER_RETRY_DEADLINE` names in seconds, if set.
    pub fn from_env() -> Result<Waits, String> {
        let mut waits = Waits::default();
        if let Some(value) = std::env::var_os(RETRY_DEADLINE_VARIABLE) {
            let text = value.to_string_lossy();
            let seconds: f64 = text
                .trim()
                .parse()
                .ok()
                .filter(|seconds: &f64| seconds.is_finite() && *seconds >= 0.0)
                .ok_or_else(|| {
                    format!("{RETRY_DEADLINE_VARIABLE} is `{text}`, not a number of seconds")
                })?;
            waits.retry_deadline = Duration::from_secs_f64(seconds);
        }
        Ok(waits)
    }

    /// The wait before retry `retry` (0 for the first), as the SDK's `_calculate_retry_timeout`
    /// computes it: the server's `Retry-After` when it names at most 60 s, else `retry_delay` doubled
    /// per retry up to `retry_delay_max`.
    fn backoff(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        if let Some(asked) =
            retry_after.filter(|asked| !asked.is_zero() && *asked <= Duration::from_secs(60))
        {
            return asked;
        }
        self.retry_delay
            .saturating_mul(2u32.saturating_pow(retry.min(31)))
            .min(self.retry_delay_max)
    }
}

/// Why an operation on the service failed; every one names the service and the operation.
#[derive(Debug, Clone, PartialEq)]
pub enum TinkerError {
    /// No answer after the reconnections: the connection was refused, reset or timed out.
    Unreachable {
        url: String,
        operation: String,
        message: String,
    },
    /// An HTTP error status, with what the server said.
    Status {
        url: String,
        operation: String,
        status: u16,
        message: String,
    },
    /// The request was accepted and then failed on the service.
    Failed {
        url: String,
        operation: String,
        message: String,
    },
    /// A success whose body is not what the protocol says.
    Malformed {
        url: String,
        operation: String,
        message: String,
    },
    /// The result did not come within [`Waits::result`].
    TimedOut {
        url: String,
        operation: String,
        waited: Duration,
    },
    /// Every try of `request` (`POST /api/v1/…`) failed transiently, until the retries
    /// ([`Waits::retries`]) or their deadline ([`Waits::retry_deadline`]) ran out; `last` is the last
    /// failure ([`TinkerError::Status`] or [`TinkerError::Unreachable`]).
    GaveUp {
        request: String,
        tries: u32,
        waited: Duration,
        /// Which ran out, in words.
        limit: String,
        last: Box<TinkerError>,
    },
}

impl fmt::Display for TinkerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TinkerError::Unreachable {
                url,
                operation,
                message,
            } => write!(
                f,
                "cannot reach the Tinker service at {url} ({operation}): {message}"
            ),
            TinkerError::Status {
                url,
                operation,
                status,
                message,
            } => {
                write!(
                    f,
                    "the Tinker service at {url} answered {operation} with HTTP {status}: {message}"
                )?;
                match status {
                    401 | 403 => write!(f, " (is {API_KEY_VARIABLE} a key this service accepts?)"),
                    404 => write!(
                        f,
                        " (a restarted service has forgotten the session, the model and its requests; `--resume` continues from the run's last checkpoint)"
                    ),
                    _ => Ok(()),
                }
            }
            TinkerError::Failed {
                url,
                operation,
                message,
            } => write!(
                f,
                "{operation} failed on the Tinker service at {url}: {message}"
            ),
            TinkerError::Malformed {
                url,
                operation,
                message,
            } => write!(
                f,
                "the Tinker service at {url} answered {operation} with {message}"
            ),
            TinkerError::TimedOut {
                url,
                operation,
                waited,
            } => write!(
                f,
                "the Tinker service at {url} gave no result for {operation} in {} s",
                waited.as_secs()
            ),
            TinkerError::GaveUp {
                request,
                tries,
                waited,
                limit,
                last,
            } => write!(
                f,
                "{last} ({tries} tries over {:.1} s at {request}, each a transient failure; gave up after {limit})",
                waited.as_secs_f64()
            ),
        }
    }
}

impl std::error::Error for TinkerError {}

/// A body sent: JSON, or protobuf bytes.
enum Body {
    Json(Vec<u8>),
    Protobuf(Vec<u8>),
}

/// Whether a request is tried again after a transient failure.
#[derive(Clone, Copy, PartialEq)]
enum Tries {
    /// As the SDK retries its operations ([`Waits::retries`], [`Waits::retry_deadline`]).
    Retried,
    /// Once: what the SDK sends with `max_retries=0` and no retrying around it.
    Once,
}

/// A request's answer.
struct Reply {
    status: reqwest::StatusCode,
    content_type: String,
    body: Vec<u8>,
    /// The server's `x-should-retry`, which overrules the status (the SDK obeys it).
    should_retry: Option<bool>,
    /// The server's `retry-after-ms` or `retry-after` (in seconds).
    retry_after: Option<Duration>,
}

impl Reply {
    /// A failure worth trying again: the SDK's `_should_retry`.
    fn transient(&self) -> bool {
        !self.status.is_success()
            && self.should_retry.unwrap_or(
                matches!(self.status.as_u16(), 408 | 409 | 429) || self.status.is_server_error(),
            )
    }
}

/// A call's run of transient failures: when the first came, and how many retries followed it.
struct Retrying {
    started: Instant,
    retries: u32,
}

/// What a future's result is read as.
#[derive(Clone, Copy, PartialEq)]
enum Expect {
    Json,
    Protobuf,
}

/// A client of one Tinker service; cheap to clone.
#[derive(Clone)]
pub struct Client {
    base: String,
    key: String,
    http: reqwest::Client,
    waits: Waits,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client").field("url", &self.base).finish()
    }
}

impl Client {
    /// A client of the service at `url` (`http(s)://host:port`, the SDK's `base_url`) with API key
    /// `key` ([`check_api_key`]). The service is reached directly, never through the environment's
    /// proxies.
    pub fn new(url: &str, key: &str, waits: Waits) -> Result<Client, String> {
        let parsed =
            reqwest::Url::parse(url).map_err(|error| format!("`{url}` is not a URL: {error}"))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(format!("`{url}` is not an http(s)://host:port URL"));
        }
        check_api_key(key)?;
        let http = reqwest::Client::builder()
            .user_agent(concat!("holo-runtime/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(10))
            .no_proxy()
            .build()
            .map_err(|error| format!("cannot build the HTTP client: {error}"))?;
        Ok(Client {
            base: url.trim_end_matches('/').to_string(),
            key: key.to_string(),
            http,
            waits,
        })
    }

    /// The service's URL, as given.
    pub fn url(&self) -> &str {
        &self.base
    }

    /// `create_session`: the session every model of the run belongs to, and how many bits of a
    /// sampling seed the service draws with (31 unless it says: SkyRL's JAX seeds are 32-bit).
    pub async fn create_session(&self) -> Result<(String, u32), TinkerError> {
        let operation = "create_session";
        let reply: wire::CreateSessionResponse = self
            .call(
                operation,
                "create_session",
                &wire::CreateSessionRequest {
                    tags: vec!["holo".into()],
                    user_metadata: Default::default(),
                    sdk_version: wire::SDK_VERSION.into(),
                    kind: "create_session".into(),
                },
            )
            .await?;
        if let Some(message) = reply.error_message {
            return Err(self.failed(operation, message));
        }
        Ok((reply.session_id, reply.sampling_seed_bits.unwrap_or(31)))
    }

    /// `session_heartbeat`: keeps the session alive (the SDK sends one every 10 s).
    /// Sent once: a failed heartbeat is not retried (the next comes 10 s later).
    pub async fn heartbeat(&self, session_id: &str) -> Result<(), TinkerError> {
        let operation = "session_heartbeat";
        let body = serde_json::to_vec(&wire::SessionHeartbeatRequest {
            session_id: session_id.into(),
            kind: "session_heartbeat".into(),
        })
        .expect("the request types serialize");
        let reply = self
            .post(
                operation,
                "session_heartbeat",
                Body::Json(body),
                Tries::Once,
            )
            .await?;
        let _: serde_json::Value = self.json(operation, &reply)?;
        Ok(())
    }

    /// `create_model`: a LoRA of `rank` on `base_model`, the session's `model_seq_id`-th model.
    /// Returns its id.
    pub async fn create_model(
        &self,
        session_id: &str,
        model_seq_id: u64,
        base_model: &str,
        lora: wire::LoraConfig,
    ) -> Result<String, TinkerError> {
        let operation = format!("create_model of `{base_model}`");
        let future: wire::FutureResponse = self
            .call(
                &operation,
                "create_model",
                &wire::CreateModelRequest {
                    session_id: session_id.into(),
                    model_seq_id,
                    base_model: base_model.into(),
                    lora_config: lora,
                    kind: "create_model".into(),
                },
            )
            .await?;
        let created: wire::CreateModelResult = self.result(&operation, &future).await?;
        Ok(created.model_id)
    }

    /// `forward_backward` of `data` under `loss`: gradients accumulated on the service until the next
    /// `optim_step`.
    pub async fn forward_backward(
        &self,
        model_id: &str,
        seq_id: u64,
        data: &[Datum],
        loss: LossFn,
    ) -> Result<ForwardBackwardResult, TinkerError> {
        let operation = format!("forward_backward ({} datums, {})", data.len(), loss.name());
        let body = wire::forward_backward_body(model_id, seq_id, data, loss);
        let reply = self
            .send(&operation, "forward_backward", Body::Protobuf(body))
            .await?;
        let future: wire::FutureResponse = self.json(&operation, &reply)?;
        let bytes = self.retrieve(&operation, &future, Expect::Protobuf).await?;
        wire::forward_backward_result(&bytes).map_err(|message| self.malformed(&operation, message))
    }

    /// `optim_step`: one AdamW step with the accumulated gradients.
    pub async fn optim_step(
        &self,
        model_id: &str,
        seq_id: u64,
        adam: wire::AdamParams,
    ) -> Result<wire::OptimStepResult, TinkerError> {
        let operation = "optim_step";
        let future: wire::FutureResponse = self
            .call(
                operation,
                "optim_step",
                &wire::OptimStepRequest {
                    adam_params: adam,
                    model_id: model_id.into(),
                    seq_id,
                    kind: "optim_step".into(),
                },
            )
            .await?;
        self.result(operation, &future).await
    }

    /// `save_weights` (`for_sampler`: `save_weights_for_sampler`) under `name`; returns the
    /// checkpoint's `tinker://` path.
    pub async fn save_weights(
        &self,
        model_id: &str,
        seq_id: u64,
        name: &str,
        for_sampler: bool,
    ) -> Result<String, TinkerError> {
        let endpoint = if for_sampler {
            "save_weights_for_sampler"
        } else {
            "save_weights"
        };
        let operation = format!("{endpoint} `{name}`");
        let future: wire::FutureResponse = self
            .call(
                &operation,
                endpoint,
                &wire::SaveWeightsRequest {
                    model_id: model_id.into(),
                    path: name.into(),
                    seq_id,
                    kind: endpoint.into(),
                },
            )
            .await?;
        let saved: wire::SaveWeightsResult = self.result(&operation, &future).await?;
        saved
            .path
            .ok_or_else(|| self.malformed(&operation, "no `path` for the saved weights".into()))
    }

    /// `load_weights`: the training checkpoint at `path` (weights and optimizer state) into `model_id`,
    /// which must be new (the service takes it only as a model's first request).
    pub async fn load_weights(
        &self,
        model_id: &str,
        seq_id: u64,
        path: &str,
    ) -> Result<(), TinkerError> {
        let operation = format!("load_weights `{path}`");
        let future: wire::FutureResponse = self
            .call(
                &operation,
                "load_weights",
                &wire::LoadWeightsRequest {
                    model_id: model_id.into(),
                    path: path.into(),
                    optimizer: true,
                    seq_id,
                    kind: "load_weights".into(),
                },
            )
            .await?;
        let _: serde_json::Value = self.result(&operation, &future).await?;
        Ok(())
    }

    /// `unload_model`: frees `model_id` and its adapter on the service.
    pub async fn unload_model(&self, model_id: &str) -> Result<(), TinkerError> {
        let operation = format!("unload_model `{model_id}`");
        let future: wire::FutureResponse = self
            .call(
                &operation,
                "unload_model",
                &wire::UnloadModelRequest {
                    model_id: model_id.into(),
                    kind: "unload_model".into(),
                },
            )
            .await?;
        let _: serde_json::Value = self.result(&operation, &future).await?;
        Ok(())
    }

    /// Deletes the checkpoint at `path` (a `tinker://RUN/…/NAME` path that `save_weights` answered, or
    /// with `sampler` `save_weights_for_sampler`) from the service's storage: `DELETE
    /// /api/v1/training_runs/RUN/checkpoints/{weights|sampler_weights}/NAME`, as the SDK's
    /// `delete_checkpoint`. One already gone (404) is not an error.
    pub async fn delete_checkpoint(&self, path: &str, sampler: bool) -> Result<(), TinkerError> {
        let operation = format!("deleting `{path}`");
        let (run, name) = checkpoint_parts(path)
            .ok_or_else(|| self.malformed(&operation, "not a tinker://RUN/…/NAME path".into()))?;
        let kind = if sampler {
            "sampler_weights"
        } else {
            "weights"
        };
        let url = format!(
            "{}/api/v1/training_runs/{run}/checkpoints/{kind}/{name}",
            self.base
        );
        let reply = self
            .request(&operation, "DELETE", &url, Tries::Retried, || {
                self.http.delete(&url)
            })
            .await?;
        // Gone already, or by a try whose answer was lost.
        if !reply.status.is_success() && reply.status != reqwest::StatusCode::NOT_FOUND {
            return Err(self.status(&operation, reply.status.as_u16(), &reply.body));
        }
        Ok(())
    }

    /// `asample`: `num_samples` completions of `prompt` by the sampler weights at `model_path`.
    pub async fn sample(
        &self,
        model_path: &str,
        prompt: Vec<u32>,
        params: wire::SamplingParams,
        num_samples: u32,
    ) -> Result<Vec<SampledSequence>, TinkerError> {
        let operation = format!("asample ({} prompt tokens)", prompt.len());
        let future: wire::FutureResponse = self
            .call(
                &operation,
                "asample",
                &wire::SampleRequest {
                    num_samples,
                    prompt: wire::ModelInput::tokens(prompt),
                    sampling_params: params,
                    model_path: model_path.into(),
                    prompt_logprobs: false,
                    kind: "sample".into(),
                },
            )
            .await?;
        let bytes = self.retrieve(&operation, &future, Expect::Protobuf).await?;
        wire::sample_result(&bytes).map_err(|message| self.malformed(&operation, message))
    }

    /// A JSON request to `/api/v1/<endpoint>` and its JSON reply.
    async fn call<T: DeserializeOwned>(
        &self,
        operation: &str,
        endpoint: &str,
        body: &impl Serialize,
    ) -> Result<T, TinkerError> {
        let bytes = serde_json::to_vec(body).expect("the request types serialize");
        let reply = self.send(operation, endpoint, Body::Json(bytes)).await?;
        self.json(operation, &reply)
    }

    fn json<T: DeserializeOwned>(&self, operation: &str, bytes: &[u8]) -> Result<T, TinkerError> {
        serde_json::from_slice(bytes).map_err(|error| {
            self.malformed(
                operation,
                format!("{} ({error})", shortened(&String::from_utf8_lossy(bytes))),
            )
        })
    }

    /// The JSON result of `future`.
    async fn result<T: DeserializeOwned>(
        &self,
        operation: &str,
        future: &wire::FutureResponse,
    ) -> Result<T, TinkerError> {
        let bytes = self.retrieve(operation, future, Expect::Json).await?;
        self.json(operation, &bytes)
    }

    /// POSTs `body` to `/api/v1/<endpoint>`, retried ([`Tries::Retried`]). Returns the body of a
    /// success.
    async fn send(
        &self,
        operation: &str,
        endpoint: &str,
        body: Body,
    ) -> Result<Vec<u8>, TinkerError> {
        self.post(operation, endpoint, body, Tries::Retried).await
    }

    /// POSTs `body` to `/api/v1/<endpoint>`, tried as `tries` says. Returns the body of a success.
    async fn post(
        &self,
        operation: &str,
        endpoint: &str,
        body: Body,
        tries: Tries,
    ) -> Result<Vec<u8>, TinkerError> {
        let url = format!("{}/api/v1/{endpoint}", self.base);
        let (content_type, bytes) = match body {
            Body::Json(bytes) => ("application/json", bytes),
            Body::Protobuf(bytes) => (PROTOBUF, bytes),
        };
        let reply = self
            .request(operation, "POST", &url, tries, || {
                self.http
                    .post(&url)
                    .header(CONTENT_TYPE, content_type)
                    .body(bytes.clone())
            })
            .await?;
        if !reply.status.is_success() {
            return Err(self.status(operation, reply.status.as_u16(), &reply.body));
        }
        Ok(reply.body)
    }

    /// Sends the `method` request to `url` that `build` makes, with the key, asking for JSON; with
    /// [`Tries::Retried`], builds and sends it again after each transient failure until
    /// [`Client::next_try`] says no more ([`TinkerError::GaveUp`]).
    async fn request(
        &self,
        operation: &str,
        method: &str,
        url: &str,
        tries: Tries,
        build: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<Reply, TinkerError> {
        let mut retrying: Option<Retrying> = None;
        loop {
            let sent = build()
                .header("X-API-Key", &self.key)
                .header(ACCEPT, "application/json")
                .timeout(self.waits.request)
                .send()
                .await;
            let (failure, retry_after) = match self.answer(operation, sent).await {
                Ok(reply) if tries == Tries::Retried && reply.transient() => (
                    self.status(operation, reply.status.as_u16(), &reply.body),
                    reply.retry_after,
                ),
                Err(error @ TinkerError::Unreachable { .. }) if tries == Tries::Retried => {
                    (error, None)
                }
                other => return other,
            };
            let request = format!("{method} {}", url.strip_prefix(&self.base).unwrap_or(url));
            let wait = self.next_try(&mut retrying, failure, &request, retry_after)?;
            tokio::time::sleep(wait).await;
        }
    }

    /// After a transient `failure` of `request`: how long to wait before trying again, or
    /// [`TinkerError::GaveUp`] when the retries or their deadline have run out (`retrying` counts
    /// them from the call's first failure).
    fn next_try(
        &self,
        retrying: &mut Option<Retrying>,
        failure: TinkerError,
        request: &str,
        retry_after: Option<Duration>,
    ) -> Result<Duration, TinkerError> {
        // From the first failure, not the first try: a slow first answer (a long forward_backward
        // upload) leaves the retries their whole deadline.
        let state = retrying.get_or_insert_with(|| Retrying {
            started: Instant::now(),
            retries: 0,
        });
        let waited = state.started.elapsed();
        let limit = if state.retries >= self.waits.retries {
            Some(format!("the SDK's {} retries", self.waits.retries))
        } else if waited >= self.waits.retry_deadline {
            Some(format!(
                "the retry deadline of {} s ({RETRY_DEADLINE_VARIABLE} sets it)",
                self.waits.retry_deadline.as_secs_f64()
            ))
        } else {
            None
        };
        if let Some(limit) = limit {
            return Err(TinkerError::GaveUp {
                request: request.to_string(),
                tries: state.retries + 1,
                waited,
                limit,
                last: Box::new(failure),
            });
        }
        let wait = self
            .waits
            .backoff(state.retries, retry_after)
            .min(self.waits.retry_deadline - waited);
        state.retries += 1;
        Ok(wait)
    }

    /// The answer to a sent request.
    async fn answer(
        &self,
        operation: &str,
        sent: reqwest::Result<reqwest::Response>,
    ) -> Result<Reply, TinkerError> {
        let unreachable = |error: reqwest::Error| TinkerError::Unreachable {
            url: self.base.clone(),
            operation: operation.to_string(),
            message: chain(&error),
        };
        let response = sent.map_err(unreachable)?;
        let status = response.status();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_string)
        };
        let content_type = header(CONTENT_TYPE.as_str()).unwrap_or_default();
        let should_retry = match header("x-should-retry").as_deref() {
            Some("true") => Some(true),
            Some("false") => Some(false),
            _ => None,
        };
        let seconds = |text: String, scale: f64| {
            text.trim()
                .parse::<f64>()
                .ok()
                .filter(|value| value.is_finite() && *value >= 0.0)
                .map(|value| Duration::from_secs_f64(value * scale))
        };
        let retry_after = header("retry-after-ms")
            .and_then(|ms| seconds(ms, 1e-3))
            .or_else(|| header("retry-after").and_then(|s| seconds(s, 1.0)));
        let body = response.bytes().await.map_err(unreachable)?;
        Ok(Reply {
            status,
            content_type,
            body: body.to_vec(),
            should_retry,
            retry_after,
        })
    }

    /// Asks for `future`'s result until it comes, fails, or [`Waits::result`] passes.
    async fn retrieve(
        &self,
        operation: &str,
        future: &wire::FutureResponse,
        expect: Expect,
    ) -> Result<Vec<u8>, TinkerError> {
        let url = format!("{}/api/v1/retrieve_future", self.base);
        let body = serde_json::to_vec(&wire::RetrieveFutureRequest {
            request_id: future.request_id.clone(),
        })
        .expect("serializes");
        let accept = match expect {
            Expect::Json => "application/json",
            Expect::Protobuf => PROTOBUF,
        };
        let started = Instant::now();
        // Transient failures in a row; any answer that is not one ends the run of them, as in the SDK.
        let mut retrying: Option<Retrying> = None;
        let request = "POST /api/v1/retrieve_future";
        loop {
            let left = self.waits.result.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(TinkerError::TimedOut {
                    url: self.base.clone(),
                    operation: operation.to_string(),
                    waited: started.elapsed(),
                });
            }
            let sent = self
                .http
                .post(&url)
                .header("X-API-Key", &self.key)
                .header(CONTENT_TYPE, "application/json")
                .header(ACCEPT, accept)
                .timeout(self.waits.poll.min(left))
                .body(body.clone())
                .send()
                .await;
            let reply = match sent {
                // The server held the request longer than one poll: ask again.
                Err(error) if error.is_timeout() => continue,
                sent => match self.answer(operation, sent).await {
                    Ok(reply) => reply,
                    Err(error @ TinkerError::Unreachable { .. }) => {
                        let wait = self.next_try(&mut retrying, error, request, None)?;
                        tokio::time::sleep(wait.min(left)).await;
                        continue;
                    }
                    Err(error) => return Err(error),
                },
            };
            let (status, content_type, bytes) = (reply.status, &reply.content_type, &reply.body);
            match status.as_u16() {
                // SkyRL's answer when the result is not ready within its own wait.
                408 => {
                    retrying = None;
                    continue;
                }
                // SkyRL's answer for a request that failed on the service.
                400 => return Err(self.failed(operation, detail(bytes))),
                code if reply.transient() => {
                    let failure = self.status(operation, code, bytes);
                    let wait = self.next_try(&mut retrying, failure, request, reply.retry_after)?;
                    tokio::time::sleep(wait.min(left)).await;
                    continue;
                }
                code if !status.is_success() => return Err(self.status(operation, code, bytes)),
                _ => retrying = None,
            }
            if content_type.starts_with(PROTOBUF) {
                if expect == Expect::Protobuf {
                    return Ok(reply.body);
                }
                return Err(self.malformed(
                    operation,
                    "a protobuf result where JSON was asked for".into(),
                ));
            }
            // The hosted service's JSON statuses.
            if let Ok(status) = serde_json::from_slice::<wire::FutureStatus>(bytes) {
                if status.kind.as_deref() == Some("try_again") {
                    continue;
                }
                if let Some(error) = status.error {
                    let category = status
                        .category
                        .map_or(String::new(), |category| format!(" ({category})"));
                    return Err(self.failed(operation, format!("{error}{category}")));
                }
            }
            if expect == Expect::Protobuf {
                return Err(self.malformed(
                    operation,
                    format!(
                        "JSON where a protobuf result was asked for: {}",
                        shortened(&String::from_utf8_lossy(bytes))
                    ),
                ));
            }
            return Ok(reply.body);
        }
    }

    fn status(&self, operation: &str, status: u16, body: &[u8]) -> TinkerError {
        TinkerError::Status {
            url: self.base.clone(),
            operation: operation.to_string(),
            status,
            message: detail(body),
        }
    }

    fn failed(&self, operation: &str, message: String) -> TinkerError {
        TinkerError::Failed {
            url: self.base.clone(),
            operation: operation.to_string(),
            message,
        }
    }

    fn malformed(&self, operation: &str, message: String) -> TinkerError {
        TinkerError::Malformed {
            url: self.base.clone(),
            operation: operation.to_string(),
            message,
        }
    }
}

/// The training run and the name of a `tinker://RUN/…/NAME` path (SkyRL answers
/// `tinker://RUN/NAME` for sampler weights, the hosted service `tinker://RUN/sampler_weights/NAME`).
fn checkpoint_parts(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("tinker://")?;
    let (run, tail) = rest.split_once('/')?;
    let name = tail.rsplit('/').next()?;
    (!run.is_empty() && !name.is_empty()).then_some((run, name))
}

/// What an error body says: FastAPI's `detail`, or the text.
fn detail(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(object)) => match object.get("detail") {
            Some(serde_json::Value::String(detail)) => shortened(detail),
            Some(detail) => shortened(&detail.to_string()),
            None => shortened(&text),
        },
        _ => shortened(&text),
    }
}

#[cfg(test)]
mod tests {
    use super::{checkpoint_parts, Reply, Waits};
    use std::time::Duration;

    #[test]
    fn retries_wait_as_the_sdk_waits() {
        let waits = Waits::default();
        let seconds: Vec<f64> = (0..8)
            .map(|retry| waits.backoff(retry, None).as_secs_f64())
            .collect();
        assert_eq!(seconds, [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]);
        let asked = Duration::from_secs(3);
        assert_eq!(waits.backoff(5, Some(asked)), asked);
        // A Retry-After of nothing or of more than a minute is not what the SDK waits.
        for ignored in [Duration::ZERO, Duration::from_secs(61)] {
            assert_eq!(waits.backoff(0, Some(ignored)), waits.retry_delay);
        }
    }

    #[test]
    fn transient_answers_are_the_ones_the_sdk_retries() {
        let reply = |status: u16, should_retry: Option<bool>| Reply {
            status: reqwest::StatusCode::from_u16(status).unwrap(),
            content_type: String::new(),
            body: Vec::new(),
            should_retry,
            retry_after: None,
        };
        for status in [408, 409, 429, 500, 502, 503, 504] {
            assert!(reply(status, None).transient(), "{status}");
        }
        for status in [200, 204, 400, 401, 403, 404, 410, 422] {
            assert!(!reply(status, None).transient(), "{status}");
        }
        // The server's x-should-retry overrules the status, for errors only.
        assert!(!reply(503, Some(false)).transient());
        assert!(reply(400, Some(true)).transient());
        assert!(!reply(200, Some(true)).transient());
    }

    #[test]
    fn a_checkpoint_path_names_its_run_and_its_name_in_both_services_forms() {
        assert_eq!(
            checkpoint_parts("tinker://model_9ae79be5/weights/checkpoint-2"),
            Some(("model_9ae79be5", "checkpoint-2"))
        );
        assert_eq!(
            checkpoint_parts("tinker://model_9ae79be5/sampler-step-0"),
            Some(("model_9ae79be5", "sampler-step-0"))
        );
        assert_eq!(
            checkpoint_parts("tinker://run-1:train:0/sampler_weights/000080"),
            Some(("run-1:train:0", "000080"))
        );
        for bad in [
            "model/weights/x",
            "tinker://model",
            "tinker:///x",
            "tinker://model/",
        ] {
            assert_eq!(checkpoint_parts(bad), None, "{bad}");
        }
    }
}
