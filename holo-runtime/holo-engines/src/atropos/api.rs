//! Atropos's wire: the request and reply bodies of `atroposlib` 0.4.0's `run-api`
//! (`atroposlib/api/server.py`), field for field, and [`Api`], an HTTP client that sends them as
//! `atroposlib`'s own clients do.
//!
//! What [`Api`] copies from `BaseEnv` (`atroposlib/envs/base.py`):
//! - **gzip**: a body of at least [`GZIP_MINIMUM`] bytes is sent gzip-compressed
//!   (`Content-Encoding: gzip`) when that makes it smaller, as is (`_post_json_with_compression`);
//! - **retries**: a request is tried [`Retry::attempts`] times (tenacity's `stop_after_attempt(3)`), again
//!   after a connection failure or an HTTP 5xx, never after a 4xx (which `BaseEnv` logs as a client
//!   error); the wait before try `k` is drawn uniformly from `[0, min(max_delay, base_delay · 2^k)]`
//!   (`wait_random_exponential(multiplier=1, max=10)`);
//! - **`GET /status-env` with a JSON body** (`{"env_id": N}`), which is how the server reads it.
//!
//! Every error names the API's URL ([`ApiError`]).

use holo_core::json::kind_of;
use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{CONTENT_ENCODING, CONTENT_TYPE};
use reqwest::Method;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::super::{chain, shortened};

/// A JSON object.
pub type Object = Map<String, Value>;

/// `POST /register`: the trainer's registration (`Registration`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    pub wandb_group: String,
    pub wandb_project: String,
    /// Sequences per batch.
    pub batch_size: i64,
    /// The longest sequence the trainer takes.
    pub max_token_len: i64,
    pub checkpoint_dir: String,
    pub save_checkpoint_interval: i64,
    pub starting_step: i64,
    pub num_steps: i64,
}

/// `POST /register-env`: an environment's registration (`RegisterEnv`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisterEnv {
    pub max_token_length: i64,
    pub desired_name: String,
    pub weight: f64,
    pub group_size: i64,
    /// The share of every batch this environment is guaranteed (0–1), or none.
    pub min_batch_allocation: Option<f64>,
}

/// The reply to `POST /register-env` once the trainer has started (`"status": "success"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvRegistered {
    pub env_id: i64,
    pub wandb_name: String,
    pub checkpoint_dir: String,
    pub starting_step: i64,
    pub checkpoint_interval: i64,
    pub num_steps: i64,
}

/// `GET /info`: `-1` for both until a trainer registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Info {
    pub batch_size: i64,
    pub max_token_len: i64,
}

/// `GET /status-env`: the queue as one environment sees it. `queue_size` and `self_queue_size` count
/// groups of this environment's size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvStatus {
    pub current_step: i64,
    pub queue_size: i64,
    #[serde(default)]
    pub self_queue_size: i64,
    #[serde(default)]
    pub max_group_size: i64,
    /// This environment's share of the inference servers: its `max_token_length · weight` over all
    /// connected environments' (at least 0.01). `BaseEnv` hands it to its server manager; batches are
    /// not composed by it.
    #[serde(default)]
    pub env_weight: f64,
    /// The share of a batch no environment's `min_batch_allocation` claims (1 when none has one).
    #[serde(default = "whole")]
    pub unallocated_fraction: f64,
}

fn whole() -> f64 {
    1.0
}

/// One scored group (`ScoredData`): `POST /scored_data`'s body and an item of `GET /batch`. Every
/// per-sequence list has one entry per sequence of the group; the per-token lists are aligned with
/// `tokens`. Serialized with all fourteen keys, `null` where absent, as `/batch` returns them.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ScoredData {
    /// Each sequence's token ids, prompt and completion.
    pub tokens: Vec<Vec<i64>>,
    /// `-100` where a position is not trained, its token id where it is.
    pub masks: Vec<Vec<i64>>,
    /// One score (reward) per sequence.
    pub scores: Vec<f64>,
    /// Advantages per token, given by the environment instead of computed from the scores.
    pub advantages: Option<Vec<Vec<f64>>>,
    pub ref_logprobs: Option<Vec<Vec<f64>>>,
    /// Each sequence's chat messages; every message has `role` and `content`.
    pub messages: Option<Vec<Vec<Object>>>,
    pub generation_params: Option<Object>,
    /// The sampler's log-probability of each token, `1.0` on the positions that are not trained.
    pub inference_logprobs: Option<Vec<Vec<f64>>>,
    /// Per sequence, e.g. `{"set_advantage_to_zero": true}`.
    pub overrides: Option<Vec<Object>>,
    pub group_overrides: Option<Object>,
    pub images: Option<Value>,
    /// The environment that scored the group (its `/register-env` id).
    pub env_id: Option<i64>,
    pub distill_token_ids: Option<Vec<Vec<Vec<i64>>>>,
    pub distill_logprobs: Option<Vec<Vec<Vec<f64>>>>,
}

/// The value of a masked position in `masks` (PyTorch's `ignore_index`).
pub const MASKED: i64 = -100;

/// The placeholder of `inference_logprobs` on positions that are not trained.
pub const MASKED_LOGPROB: f64 = 1.0;

impl ScoredData {
    /// Reads a scored group field by field, so that a bad one is named: `tokens`, `masks` and
    /// `scores` are required, the others may be missing or `null`.
    pub fn from_json(value: &Value) -> Result<ScoredData, String> {
        let object = value
            .as_object()
            .ok_or_else(|| format!("not a JSON object but {}", kind_of(value)))?;
        fn required<T: DeserializeOwned>(object: &Object, key: &str) -> Result<T, String> {
            let value = object
                .get(key)
                .ok_or_else(|| format!("`{key}` is missing"))?;
            serde_json::from_value(value.clone()).map_err(|error| format!("`{key}`: {error}"))
        }
        fn optional<T: DeserializeOwned>(object: &Object, key: &str) -> Result<Option<T>, String> {
            match object.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(value) => serde_json::from_value(value.clone())
                    .map(Some)
                    .map_err(|error| format!("`{key}`: {error}")),
            }
        }
        Ok(ScoredData {
            tokens: required(object, "tokens")?,
            masks: required(object, "masks")?,
            scores: required(object, "scores")?,
            advantages: optional(object, "advantages")?,
            ref_logprobs: optional(object, "ref_logprobs")?,
            messages: optional(object, "messages")?,
            generation_params: optional(object, "generation_params")?,
            inference_logprobs: optional(object, "inference_logprobs")?,
            overrides: optional(object, "overrides")?,
            group_overrides: optional(object, "group_overrides")?,
            images: optional(object, "images")?,
            env_id: optional(object, "env_id")?,
            distill_token_ids: optional(object, "distill_token_ids")?,
            distill_logprobs: optional(object, "distill_logprobs")?,
        })
    }

    /// Sequences in the group.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// Bodies this long or longer are sent gzip-compressed when that makes them smaller.
pub const GZIP_MINIMUM: usize = 1024;

/// A JSON body as `BaseEnv` sends it: the bytes, and whether they are gzip-compressed.
pub fn encode(body: &Value) -> (Vec<u8>, bool) {
    gzip_if_smaller(serde_json::to_vec(body).expect("a JSON value serializes"))
}

/// `plain` gzip-compressed when it is at least [`GZIP_MINIMUM`] bytes and compression shrinks it;
/// otherwise `plain`.
fn gzip_if_smaller(plain: Vec<u8>) -> (Vec<u8>, bool) {
    if plain.len() < GZIP_MINIMUM {
        return (plain, false);
    }
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let compressed = encoder
        .write_all(&plain)
        .and_then(|()| encoder.finish())
        .expect("writing into memory cannot fail");
    if compressed.len() < plain.len() {
        (compressed, true)
    } else {
        (plain, false)
    }
}

/// How hard a request is tried; see the [module documentation](self).
#[derive(Debug, Clone, PartialEq)]
pub struct Retry {
    /// Tries in all (at least 1; default 3).
    pub attempts: u32,
    /// The cap of the first wait; doubles with each try (default 1 s).
    pub base_delay: Duration,
    /// The cap of any wait (default 10 s).
    pub max_delay: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Retry {
            attempts: 3,
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(10),
        }
    }
}

/// Why a request to the API failed; every one names the API.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// No answer: the connection was refused, reset or timed out.
    Unreachable { url: String, message: String },
    /// An HTTP error status, with what the server said.
    Status {
        url: String,
        status: u16,
        message: String,
    },
    /// A success whose body is not what the protocol says.
    Malformed { url: String, message: String },
}

impl ApiError {
    /// A failure that may pass: the API is down or restarting (no answer, or an HTTP 5xx).
    pub fn is_transient(&self) -> bool {
        match self {
            ApiError::Unreachable { .. } => true,
            ApiError::Status { status, .. } => *status >= 500,
            ApiError::Malformed { .. } => false,
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Unreachable { url, message } => write!(
                f,
                "cannot reach the Atropos API at {url}: {message} (is `run-api` running there?)"
            ),
            ApiError::Status {
                url,
                status,
                message,
            } => write!(
                f,
                "the Atropos API at {url} answered HTTP {status}: {message}"
            ),
            ApiError::Malformed { url, message } => {
                write!(f, "the Atropos API at {url} answered {message}")
            }
        }
    }
}

impl std::error::Error for ApiError {}

/// An HTTP client of one Atropos API; cheap to clone.
#[derive(Clone)]
pub struct Api {
    base: String,
    client: reqwest::Client,
    retry: Retry,
    jitter: Arc<AtomicU64>,
}

impl fmt::Debug for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Api").field("url", &self.base).finish()
    }
}

impl Api {
    /// A client of the API at `url` (`http(s)://host:port`). The API is reached directly, never
    /// through the environment's proxies.
    pub fn new(url: &str, retry: Retry) -> Result<Api, String> {
        let parsed =
            reqwest::Url::parse(url).map_err(|error| format!("`{url}` is not a URL: {error}"))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(format!("`{url}` is not an http(s)://host:port URL"));
        }
        if retry.attempts == 0 {
            return Err("an Atropos request needs at least one attempt".into());
        }
        let client = reqwest::Client::builder()
            .user_agent(concat!("holo-runtime/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(300))
            .no_proxy()
            .build()
            .map_err(|error| format!("cannot build the HTTP client: {error}"))?;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos() as u64)
            ^ u64::from(std::process::id());
        Ok(Api {
            base: url.trim_end_matches('/').to_string(),
            client,
            retry,
            jitter: Arc::new(AtomicU64::new(seed)),
        })
    }

    /// The API's URL, as given.
    pub fn url(&self) -> &str {
        &self.base
    }

    pub async fn get(&self, path: &str) -> Result<Value, ApiError> {
        self.request(Method::GET, path, None, true).await
    }

    /// A GET with a JSON body, as `/status-env` takes its `env_id`.
    pub async fn get_with_body(&self, path: &str, body: &Value) -> Result<Value, ApiError> {
        self.request(Method::GET, path, Some(body), true).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Result<Value, ApiError> {
        self.request(Method::POST, path, Some(body), true).await
    }

    /// A POST only a registered client may make (`/scored_data`): tried again after an HTTP 5xx, but
    /// not after a failed connection. The API that answers next may be a restarted one, to register
    /// with again first: `atroposlib` 0.4.0 sets a trainer's state up only while the API has no queue,
    /// so a group posted to a restarted API before its trainer registers leaves it unusable.
    pub async fn post_registered(&self, path: &str, body: &Value) -> Result<Value, ApiError> {
        self.request(Method::POST, path, Some(body), false).await
    }

    /// A request and its JSON reply, with the retries of the [module documentation](self); after a
    /// failed connection only when `reconnect`.
    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        reconnect: bool,
    ) -> Result<Value, ApiError> {
        let url = format!("{}{path}", self.base);
        let encoded = body.map(encode);
        let mut attempt = 0;
        loop {
            let error = match self.attempt(&method, &url, encoded.as_ref()).await {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            attempt += 1;
            let unreachable = matches!(error, ApiError::Unreachable { .. });
            if !error.is_transient()
                || attempt >= self.retry.attempts
                || (unreachable && !reconnect)
            {
                return Err(error);
            }
            tokio::time::sleep(self.wait(attempt - 1)).await;
        }
    }

    async fn attempt(
        &self,
        method: &Method,
        url: &str,
        body: Option<&(Vec<u8>, bool)>,
    ) -> Result<Value, ApiError> {
        let mut request = self.client.request(method.clone(), url);
        if let Some((bytes, gzip)) = body {
            request = request
                .header(CONTENT_TYPE, "application/json")
                .body(bytes.clone());
            if *gzip {
                request = request.header(CONTENT_ENCODING, "gzip");
            }
        }
        let response = request
            .send()
            .await
            .map_err(|error| ApiError::Unreachable {
                url: url.to_string(),
                message: chain(&error),
            })?;
        let status = response.status();
        let text = response
            .text()
            .await
            .map_err(|error| ApiError::Unreachable {
                url: url.to_string(),
                message: format!("the answer was cut short: {}", chain(&error)),
            })?;
        if !status.is_success() {
            return Err(ApiError::Status {
                url: url.to_string(),
                status: status.as_u16(),
                message: shortened(&text),
            });
        }
        serde_json::from_str(&text).map_err(|error| ApiError::Malformed {
            url: url.to_string(),
            message: format!("a body that is not JSON ({error}): {}", shortened(&text)),
        })
    }

    /// The wait before try `k + 1`: uniform in `[0, min(max_delay, base_delay · 2^k)]`.
    fn wait(&self, k: u32) -> Duration {
        let cap = self
            .retry
            .base_delay
            .saturating_mul(1u32 << k.min(20))
            .min(self.retry.max_delay);
        let draw = holo_core::loom::mix(
            self.jitter
                .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed),
        );
        cap.mul_f64((draw >> 11) as f64 / (1u64 << 53) as f64)
    }
}

/// Decodes a reply into `T`, naming the endpoint when it does not fit.
pub fn reply<T: DeserializeOwned>(api: &Api, path: &str, value: Value) -> Result<T, ApiError> {
    serde_json::from_value(value.clone()).map_err(|error| ApiError::Malformed {
        url: format!("{}{path}", api.url()),
        message: format!("{} ({error})", shortened(&value.to_string())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn scored_data_has_the_pydantic_field_names_in_order() {
        let value = serde_json::to_value(ScoredData::default()).unwrap();
        let keys: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        // serde_json's maps sort keys unless `preserve_order`; compare as sets.
        let mut expected = vec![
            "tokens",
            "masks",
            "scores",
            "advantages",
            "ref_logprobs",
            "messages",
            "generation_params",
            "inference_logprobs",
            "overrides",
            "group_overrides",
            "images",
            "env_id",
            "distill_token_ids",
            "distill_logprobs",
        ];
        expected.sort_unstable();
        let mut keys = keys;
        keys.sort_unstable();
        assert_eq!(keys, expected);
    }

    #[test]
    fn a_bad_field_is_named() {
        let missing = ScoredData::from_json(&json!({"tokens": [[1]], "masks": [[1]]}));
        assert_eq!(missing.unwrap_err(), "`scores` is missing");
        let wrong =
            ScoredData::from_json(&json!({"tokens": [[1]], "masks": [["x"]], "scores": [1.0]}))
                .unwrap_err();
        assert!(wrong.starts_with("`masks`: invalid type"), "{wrong}");
        let null = ScoredData::from_json(
            &json!({"tokens": [[1]], "masks": [[1]], "scores": [1.0], "advantages": null}),
        )
        .unwrap();
        assert_eq!(null.advantages, None);
    }

    #[test]
    fn small_bodies_are_sent_plain_and_large_ones_gzipped_when_smaller() {
        let small = json!({"tokens": [[1, 2, 3]]});
        assert!(!encode(&small).1);
        let repetitive = json!({"tokens": [vec![7; 600]]});
        let (bytes, gzip) = encode(&repetitive);
        assert!(gzip);
        let mut plain = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut plain)
            .unwrap();
        assert_eq!(plain, serde_json::to_vec(&repetitive).unwrap());
        // Bytes that gzip cannot shrink go as they are, however long.
        let noise: Vec<u8> = (0..4096u64)
            .map(|i| holo_core::loom::mix(i) as u8)
            .collect();
        assert_eq!(gzip_if_smaller(noise.clone()), (noise, false));
    }
}
