//! A holoware as a NeMo Gym agent server (`holo gym`): NeMo Gym's rollout collection
//! (`ng_collect_rollouts`), NeMo RL, and the trainers that consume NeMo Gym (verl, prime-rl) roll the
//! holoware out by `POST /run`, one rollout per call, sampled from their own OpenAI-compatible policy
//! server.
//!
//! ```text
//!  ng_collect_rollouts / NeMo RL ──GET /global_config_dict_yaml──▶ head server (nemo_gym)
//!        │                                                              ▲
//!        └──POST /run, POST /aggregate_metrics──▶ holo gym ─────────────┘ (policy_base_url, when not given)
//!                                                    │
//!                                                    └──POST /v1/completions (token ids)──▶ policy (vLLM, holo serve)
//! ```
//!
//! NeMo Gym 0.7.0 registers such a server by address only: a configuration entry with `host` and `port`
//! and no `entrypoint`, once under `responses_api_agents` and once under `environment_servers`
//! fronting it (`docs/scale-out.md` has the YAML).
//!
//! # Endpoints
//!
//! | route | answer |
//! |---|---|
//! | `GET /` | `{"status": "ok"}` |
//! | `POST /run` | the row with `response`, `reward` and `reward_components` (below) |
//! | `POST /aggregate_metrics` | `AggregateMetrics` of the verify responses it gets ([`metrics`]) |
//!
//! Errors are FastAPI's shapes, as NeMo Gym's Python servers answer them: a row that does not fit is a
//! 422 `{"detail": [{"loc": ["body", "responses_create_params", "input"], "msg": ..., "type":
//! "value_error"}]}` naming the field, and every other failure `{"detail": message}`:
//!
//! | case | status |
//! |---|---|
//! | body not JSON, a row that does not fit ([`row`]), a malformed `/aggregate_metrics` body | 422 |
//! | body over [`GymConfig::max_body_bytes`] | 413 |
//! | the policy failed or refused (its URL and message in the detail) | 502 |
//! | the rollout failed (a holotype's error), or its tokens are not exactly what was sampled | 500 |
//! | the rollout took longer than [`GymConfig::rollout_timeout`] | 504 |
//!
//! `ng_collect_rollouts` ends its run on an error reply, or with `+route_failures_to_sidecar=true`
//! records it (status and body) in its failures file and goes on; a 502 or 504 is classed as a
//! request that did not run, the others as a rollout that ran and failed.
//!
//! # Rows
//!
//! A row's fields become the holoware's data row ([`row::map`]):
//! - the text of the last user message of `responses_create_params.input` (or `input` itself when it is
//!   a string) goes to the input column ([`Columns::input`], `--input-column`, default `question`);
//!   `input_text` parts of one message are joined by newlines; earlier messages are not replayed: the
//!   holoware writes its own conversation;
//! - `responses_create_params.instructions` and the system and developer messages of `input`, joined
//!   by blank lines, go to the `system` column;
//! - every key of `verifier_metadata` is a column (`expected`, ...), and so is every other field of the
//!   row that is not NeMo Gym's own (`responses_create_params`, `verifier_metadata`, `agent_ref`,
//!   `response`, `reward`, `_ng_*`), as NeMo Gym's datasets put `expected_answer` beside the params; a
//!   column given twice with different values is refused;
//! - `temperature` and `top_p` replace, and `max_output_tokens` caps, the parameters of every sample
//!   of the rollout ([`Imposed`]); the other params (`tools`, ...) are the holoware's business.
//!
//! The row must then pass the holoware's own check ([`Holoware::check_row`]): a missing input is a 422
//! naming the column and where the row would give it. Each rollout is seeded from `--seed`,
//! `_ng_task_index` and `_ng_rollout_index` ([`rollout_seed`]), so repeats of one task sample
//! differently and a rerun samples the same; a row without them is seeded by its arrival order.
//!
//! # Responses
//!
//! The rollout runs through the [`Loom`] with the policy's [`Holophore`]: prompts go to the policy as
//! token ids and the record holds the tokens and log-probabilities exactly as sampled. The trained
//! context becomes `response.output` ([`response::items`]): one assistant `message` item per sampled
//! turn, with its text and `prompt_token_ids` (every token of the context before the turn, chat
//! frames included), `generation_token_ids` and `generation_log_probs`; between two turns, the
//! messages the holoware wrote (a tool's result, a follow-up question) as `message` items of their
//! role with `input_text` content. Each turn's prompt starts with the previous turn's prompt and
//! generation, the contiguity NeMo RL checks. Tool calls are text the model writes in its turn and
//! tool results text the holoware writes: they stay messages, not `function_call` items. A rollout
//! with several trained contexts (ERL) is refused, and so is one whose policy gave no token ids.
//!
//! `reward` is the rollout's weighted total and `reward_components` each component's value (the
//! field `BaseMultiRewardVerifyResponse` declares; NeMo Gym's `BaseVerifyResponse` ignores it).
//! `response.status` is `incomplete` (with `incomplete_details.reason: max_output_tokens`) when a
//! sample ran out of tokens; `usage` sums the turns' prompts and generations.
//!
//! # Metrics
//!
//! `POST /aggregate_metrics` gets `{"verify_responses": [...]}` (the `/run` answers, without
//! `response` and `responses_create_params`) and answers `agent_metrics` (`mean/`, `max/`, `min/`,
//! `median/`, `std/` of `reward` and of each component by its name, and `num_repeats`),
//! `key_metrics` (the means), `group_level_metrics` per `_ng_task_index` and `repeat_level_metrics`
//! per `_ng_rollout_index`, the keys NeMo Gym's `RewardProfiler` writes.

pub mod head;
pub mod metrics;
pub mod response;
pub mod row;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use tokio::net::{TcpListener, ToSocketAddrs};

use holo_core::holophore::Holophore;
use holo_core::interpreter::Holoware;
use holo_core::loom::{rollout_seed, Loom, LoomConfig, RolloutRecord, Stage};
use holo_core::resources::Resources;
use holo_core::sampler::{Imposed, Sampler, WithImposed};
pub use row::Columns;
use row::RowError;

/// What `holo gym` serves: the holoware, its resources, and the policy its rollouts sample.
pub struct Environment {
    pub holoware: Arc<Holoware>,
    pub resources: Resources,
    /// The policy's tokenizer and chat template: prompts go as token ids, records hold token ids.
    pub holophore: Holophore,
    /// The policy (an [`OpenAi`](holo_core::OpenAi) sampler of `policy_url`).
    pub policy: Arc<dyn Sampler>,
    /// Where the policy is, for error messages.
    pub policy_url: String,
    /// The model name of the policy, written as the response's `model`.
    pub model: String,
}

/// How `holo gym` maps rows and bounds its work.
#[derive(Debug, Clone, PartialEq)]
pub struct GymConfig {
    pub columns: Columns,
    /// The run seed every rollout's seed is derived from.
    pub seed: u64,
    /// The longest a `/run` may take (default 30 min); then it is answered 504.
    pub rollout_timeout: Duration,
    /// The largest request body (default 64 MiB); larger ones are answered 413.
    pub max_body_bytes: usize,
}

impl Default for GymConfig {
    fn default() -> Self {
        GymConfig {
            columns: Columns::default(),
            seed: 0,
            rollout_timeout: Duration::from_secs(1800),
            max_body_bytes: 64 << 20,
        }
    }
}

struct Gym {
    environment: Environment,
    config: GymConfig,
    /// Rows without `_ng_task_index` / `_ng_rollout_index` so far: their seeds.
    unindexed: AtomicU64,
}

/// A bound `holo gym` server; [`GymServer::run`] serves it.
pub struct GymServer {
    listener: TcpListener,
    app: Router,
}

impl GymServer {
    /// Binds `addr` (port 0 picks a free port; [`GymServer::local_addr`] says which).
    pub async fn bind(
        addr: impl ToSocketAddrs,
        environment: Environment,
        config: GymConfig,
    ) -> io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let max_body_bytes = config.max_body_bytes;
        let gym = Arc::new(Gym {
            environment,
            config,
            unindexed: AtomicU64::new(0),
        });
        let app = Router::new()
            .route("/", get(health))
            .route("/run", post(run))
            .route("/aggregate_metrics", post(aggregate_metrics))
            .fallback(not_found)
            .layer(DefaultBodyLimit::max(max_body_bytes))
            .with_state(gym);
        Ok(GymServer { listener, app })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until the process ends.
    pub async fn run(self) -> io::Result<()> {
        axum::serve(self.listener, self.app).await
    }

    /// Serves until `shutdown` completes, then answers the requests in flight and returns.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> io::Result<()> {
        axum::serve(self.listener, self.app)
            .with_graceful_shutdown(shutdown)
            .await
    }
}

/// An error reply: FastAPI's `{"detail": ...}`.
struct Failure {
    status: StatusCode,
    detail: Value,
}

impl Failure {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Failure {
            status,
            detail: Value::String(message.into()),
        }
    }

    fn row(error: RowError) -> Self {
        Failure {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            detail: json!([{"loc": error.loc, "msg": error.to_string(), "type": "value_error"}]),
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.status, Json(json!({"detail": self.detail}))).into_response()
    }
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn not_found() -> Response {
    Failure::new(
        StatusCode::NOT_FOUND,
        "Not Found (routes: GET /, POST /run, POST /aggregate_metrics)",
    )
    .into_response()
}

/// The body as a JSON object, or the reply that says why not.
fn object(body: Result<Bytes, BytesRejection>) -> Result<Map<String, Value>, Failure> {
    let bytes =
        body.map_err(|rejection| Failure::new(rejection.status(), rejection.body_text()))?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(object)) => Ok(object),
        Ok(_) => Err(Failure::row(RowError {
            loc: vec!["body".into()],
            message: "the body must be a JSON object".into(),
        })),
        Err(error) => Err(Failure::row(RowError {
            loc: vec!["body".into()],
            message: format!(
                "not JSON (line {}, column {}): {error}",
                error.line(),
                error.column()
            ),
        })),
    }
}

async fn run(State(gym): State<Arc<Gym>>, body: Result<Bytes, BytesRejection>) -> Response {
    match rollout(&gym, body).await {
        Ok(answer) => Json(answer).into_response(),
        Err(failure) => failure.into_response(),
    }
}

async fn rollout(gym: &Gym, body: Result<Bytes, BytesRejection>) -> Result<Value, Failure> {
    let body = object(body)?;
    let columns = &gym.config.columns;
    let mapped = row::map(&body, columns).map_err(Failure::row)?;
    let environment = &gym.environment;
    row::check(&environment.holoware, &mapped, columns).map_err(Failure::row)?;
    let (task, repeat) = match (mapped.task_index, mapped.rollout_index) {
        (None, None) => (0, gym.unindexed.fetch_add(1, Ordering::Relaxed)),
        (task, repeat) => (task.unwrap_or(0), repeat.unwrap_or(0)),
    };
    let limit = gym.config.rollout_timeout;
    let record = tokio::time::timeout(
        limit,
        one_rollout(
            environment,
            &mapped.row,
            mapped.imposed,
            gym.config.seed,
            task,
            repeat,
        ),
    )
    .await
    .map_err(|_| {
        Failure::new(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "the rollout did not finish within {} s (--rollout-timeout)",
                limit.as_secs_f64()
            ),
        )
    })??;
    if let Some(error) = &record.error {
        return Err(match error.stage {
            Stage::Sampler => Failure::new(
                StatusCode::BAD_GATEWAY,
                format!(
                    "the policy at {} failed: {}",
                    environment.policy_url, error.message
                ),
            ),
            Stage::Start | Stage::Rollout => Failure::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the rollout failed: {}", error.message),
            ),
        });
    }
    let items = response::items(&record)
        .map_err(|message| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, message))?;
    let response = response::response(
        &items,
        &environment.model,
        &mapped.imposed,
        record.truncated,
    );
    Ok(response::verify_response(&body, &record, response))
}

/// One rollout of `row` through the Loom, seeded by the task and repeat.
async fn one_rollout(
    environment: &Environment,
    row: &holo_core::interpreter::Row,
    imposed: Imposed,
    seed: u64,
    task: u64,
    repeat: u64,
) -> Result<RolloutRecord, Failure> {
    let loom = Loom::interpreted(
        Arc::clone(&environment.holoware),
        environment.resources.clone(),
        LoomConfig {
            rollouts_per_row: 1,
            seed: rollout_seed(seed, task as usize, repeat as usize),
            concurrency: 1,
            progress: false,
            timing: false,
            ..LoomConfig::default()
        },
    )
    .with_holophore(environment.holophore.fork());
    let policy = WithImposed {
        inner: environment.policy.as_ref(),
        imposed,
    };
    let internal = |message: String| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, message);
    let mut records: Vec<RolloutRecord> = Vec::new();
    let summary = loom
        .run(&[(task as usize, row.clone())], &policy, &mut records)
        .await
        .map_err(|error| internal(format!("cannot record the rollout: {error}")))?;
    if let Some(failure) = summary.row_failures.first() {
        return Err(Failure::row(RowError {
            loc: vec!["body".into()],
            message: failure.message.clone(),
        }));
    }
    records
        .pop()
        .ok_or_else(|| internal("the rollout left no record".into()))
}

async fn aggregate_metrics(body: Result<Bytes, BytesRejection>) -> Response {
    match object(body).and_then(|body| metrics::aggregate(&body).map_err(Failure::row)) {
        Ok(metrics) => Json(metrics).into_response(),
        Err(failure) => failure.into_response(),
    }
}
