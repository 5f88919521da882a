//! `holo tinker-serve`: the Tinker training API over a local model folder, so that programs written
//! against the `tinker` SDK (tinker-cookbook's recipes, `holo train --backend tinker`) train LoRA
//! adapters on this machine.
//!
//! ```text
//!  tinker SDK ── create_session, create_model ─────────▶ TinkerServer (axum) ── Job ──▶ Worker thread
//!     │          forward_backward (protobuf), optim_step      │  request id now          │ base model
//!     │          save_weights[_for_sampler], load_weights     │                          │ LoRA runs, AdamW
//!     │          asample                                      │                          │ sampler models
//!     └───────── retrieve_future (polled) ◀───────────────────┴──── result (JSON/proto) ◀┘
//!                                                                 STORE/<run>/… (store.rs)
//! ```
//!
//! Each operation answers a request id at once and runs on the [`worker`] thread, which owns the model;
//! `retrieve_future` waits up to [`TinkerConfig::poll`] for the result ([`futures`]). What the SDK calls
//! at start (`client/config`, `create_session`, heartbeats, `get_server_capabilities`, `get_info`,
//! sampling sessions) answers directly.
//!
//! # Errors
//!
//! A request that cannot succeed is refused before any work, FastAPI's `{"detail": message}` naming the
//! field: 400 for a malformed or unsupported body (an unknown field, a loss or loss setting not served,
//! shapes that disagree, a token outside the vocabulary, a base model not served), 404 for an unknown
//! model, session, sampler, future or checkpoint, 415 for a compressed body. A failure found while
//! running (a checkpoint that will not load) fails the future: `{"error": message, "category":
//! "user"|"server"}`, which the SDK raises as `RequestFailedError`, without retrying. A device out of
//! memory during a request's work is `user`: the request is what has to shrink ([`worker`]).
//!
//! # What is not served
//!
//! Full fine-tuning (a `create_model` without `lora_config`), custom losses run on the server,
//! optimizers other than AdamW, top-k prompt and targeted log-probabilities, images. The SDK's
//! `train_unembed` (on by default) is served: an adapter on the output head (PEFT's `lm_head`; on a
//! model whose head is tied to its embeddings, on the head's use of them only), saved under PEFT's
//! `base_model.model.lm_head.lora_{A,B}.weight`.
//! There is no authentication: the server listens on loopback unless told otherwise.

pub mod futures;
pub mod losses;
pub mod requests;
pub mod store;
pub mod worker;

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::net::{TcpListener, ToSocketAddrs};

use futures::{Futures, Outcome, Promise, Retrieved};
use store::{CheckpointPath, Kind, RunInfo, Store};
use worker::{Job, Sample, Weights, Worker};

/// The bits of a sampling seed the server draws with (every seed below 2^63, as holo's samplers).
pub const SAMPLING_SEED_BITS: u32 = 63;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct TinkerConfig {
    /// The model folder served.
    pub model_dir: PathBuf,
    /// The name clients give as `base_model`.
    pub model_name: String,
    /// Where checkpoints are kept ([`store`]).
    pub store: PathBuf,
    /// How long `retrieve_future` waits for a result before answering `try_again`.
    pub poll: Duration,
    /// Request bodies beyond this are refused (413).
    pub max_body_bytes: usize,
    /// The seed of samples that name none (each draws the next).
    pub seed: u64,
    /// Where the model runs (in its training precision: f32 on the CPU, bf16 on CUDA).
    pub device: candle_core::Device,
}

/// The projections LoRA adapts for the SDK's `train_attn`, `train_mlp` and `train_unembed`.
const ATTENTION: [&str; 4] = ["q_proj", "k_proj", "v_proj", "o_proj"];
const MLP: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
const UNEMBED: [&str; 1] = ["lm_head"];

/// What the handlers know; the model itself is the worker's.
struct Service {
    model_name: String,
    arch: String,
    vocab: usize,
    context: usize,
    store: Store,
    futures: Futures,
    jobs: Mutex<mpsc::Sender<(Job, Promise)>>,
    /// The sessions opened since start.
    sessions: Mutex<HashSet<String>>,
    /// The training runs created since start, by model id.
    models: Mutex<HashMap<String, RunInfo>>,
    /// Sampling sessions: where their weights come from.
    samplers: Mutex<HashMap<String, Weights>>,
    /// The request id of each request accepted with a sequence key (its model or sampling session and
    /// `seq_id`, or the model it creates), the keys in arrival order: one sent again (after a lost
    /// connection) gets the first one's future instead of running twice. As many as futures are kept.
    sequenced: Mutex<(HashMap<String, String>, VecDeque<String>)>,
}

/// A bound server; [`TinkerServer::run`] serves it.
pub struct TinkerServer {
    listener: TcpListener,
    app: Router,
}

impl TinkerServer {
    /// Loads the model (on the worker thread, which keeps it) and binds `addr`; the error says which
    /// failed.
    pub async fn bind(addr: impl ToSocketAddrs, config: TinkerConfig) -> io::Result<Self> {
        let store = Store::open(&config.store).map_err(|error| {
            io::Error::new(
                error.kind(),
                format!("--store {}: {error}", config.store.display()),
            )
        })?;
        let (ready_sender, ready) = tokio::sync::oneshot::channel();
        let (jobs, receiver) = mpsc::channel::<(Job, Promise)>();
        let (dir, worker_store, seed) = (config.model_dir.clone(), store.clone(), config.seed);
        let device = config.device.clone();
        std::thread::Builder::new()
            .name("tinker-worker".into())
            .spawn(move || match holo_train::run::Policy::load(&dir, &device) {
                Ok(policy) => {
                    let facts = (
                        policy.model.config.arch.to_string(),
                        policy.model.config.vocab_size,
                        policy.model.config.max_position_embeddings,
                    );
                    let _ = ready_sender.send(Ok(facts));
                    Worker::new(policy, worker_store, seed).serve(receiver);
                }
                Err(error) => {
                    let _ = ready_sender.send(Err(format!("cannot load the model: {error}")));
                }
            })?;
        let (arch, vocab, context) = ready
            .await
            .map_err(|_| io::Error::other("the worker thread ended while loading the model"))?
            .map_err(io::Error::other)?;
        let service = Arc::new(Service {
            model_name: config.model_name,
            arch,
            vocab,
            context,
            store,
            futures: Futures::new(config.poll),
            jobs: Mutex::new(jobs),
            sessions: Mutex::new(HashSet::new()),
            models: Mutex::new(HashMap::new()),
            samplers: Mutex::new(HashMap::new()),
            sequenced: Mutex::new((HashMap::new(), VecDeque::new())),
        });
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|error| io::Error::new(error.kind(), format!("cannot listen: {error}")))?;
        let app = Router::new()
            .route("/api/v1/healthz", get(healthz))
            .route("/api/v1/client/config", post(client_config))
            .route("/api/v1/client/dynamic_config", post(dynamic_config))
            .route("/api/v1/telemetry", post(telemetry))
            .route("/api/v1/create_session", post(create_session))
            .route("/api/v1/session_heartbeat", post(session_heartbeat))
            .route("/api/v1/sessions/{session}/finish", post(finish_session))
            .route("/api/v1/get_server_capabilities", get(capabilities))
            .route("/api/v1/create_model", post(create_model))
            .route("/api/v1/get_info", post(get_info))
            .route("/api/v1/weights_info", post(weights_info))
            .route("/api/v1/unload_model", post(unload_model))
            .route("/api/v1/forward_backward", post(forward_backward))
            .route("/api/v1/optim_step", post(optim_step))
            .route("/api/v1/save_weights", post(save_weights))
            .route(
                "/api/v1/save_weights_for_sampler",
                post(save_weights_for_sampler),
            )
            .route("/api/v1/load_weights", post(load_weights))
            .route(
                "/api/v1/create_sampling_session",
                post(create_sampling_session),
            )
            .route("/api/v1/samplers/{sampler}", get(get_sampler))
            .route("/api/v1/asample", post(asample))
            .route("/api/v1/retrieve_future", post(retrieve_future))
            .route("/api/v1/training_runs/{run}/checkpoints", get(checkpoints))
            .route(
                "/api/v1/training_runs/{run}/checkpoints/{kind}/{name}",
                delete(delete_checkpoint),
            )
            .fallback(not_found)
            .layer(DefaultBodyLimit::max(config.max_body_bytes))
            .with_state(service);
        Ok(TinkerServer { listener, app })
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

/// An error reply: FastAPI's `{"detail": message}`.
struct Failure {
    status: StatusCode,
    detail: String,
}

fn bad(detail: impl Into<String>) -> Failure {
    Failure {
        status: StatusCode::BAD_REQUEST,
        detail: detail.into(),
    }
}

fn missing(detail: impl Into<String>) -> Failure {
    Failure {
        status: StatusCode::NOT_FOUND,
        detail: detail.into(),
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.status, Json(json!({"detail": self.detail}))).into_response()
    }
}

type Reply = Result<Response, Failure>;

/// The body as `T`, refusing unknown fields and wrong types with the field's name (serde's message
/// names it).
fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, Failure> {
    let bytes = body.map_err(|rejection| Failure {
        status: rejection.status(),
        detail: rejection.body_text(),
    })?;
    serde_json::from_slice(&bytes).map_err(|error| bad(format!("body: {error}")))
}

impl Service {
    /// Queues `job`; the reply is its future's request id (with `extra`'s fields). A job whose sequence
    /// `key` was accepted before is not queued again: the reply is the first one's.
    fn submit(&self, job: Job, extra: Value, key: Option<String>) -> Reply {
        let mut guard = self.sequenced.lock().expect("not poisoned");
        let (sequenced, order) = &mut *guard;
        if let Some(request_id) = key.as_ref().and_then(|key| sequenced.get(key)) {
            return Ok(Json(with_fields(json!({"request_id": request_id}), extra)).into_response());
        }
        let (request_id, promise) = self.futures.create();
        if let Some(key) = key {
            sequenced.insert(key.clone(), request_id.clone());
            order.push_back(key);
            if order.len() as u64 > futures::KEPT {
                let oldest = order.pop_front().expect("not empty");
                sequenced.remove(&oldest);
            }
        }
        drop(guard);
        self.jobs
            .lock()
            .expect("not poisoned")
            .send((job, promise))
            .map_err(|_| Failure {
                status: StatusCode::SERVICE_UNAVAILABLE,
                detail: "the model's worker thread has stopped".into(),
            })?;
        Ok(Json(with_fields(json!({"request_id": request_id}), extra)).into_response())
    }

    fn check_session(&self, session: &str) -> Result<(), Failure> {
        if self
            .sessions
            .lock()
            .expect("not poisoned")
            .contains(session)
        {
            Ok(())
        } else {
            Err(missing(format!(
                "session_id: no session `{session}` (sessions end with a server restart)"
            )))
        }
    }

    fn check_model(&self, model_id: &str) -> Result<RunInfo, Failure> {
        self.models
            .lock()
            .expect("not poisoned")
            .get(model_id)
            .cloned()
            .ok_or_else(|| {
                missing(format!(
                    "model_id: no model `{model_id}` (create_model or load_weights makes one; \
                     models end with unload_model or a server restart)"
                ))
            })
    }

    fn check_base(&self, base_model: &str) -> Result<(), Failure> {
        if base_model == self.model_name {
            Ok(())
        } else {
            Err(bad(format!(
                "base_model: `{base_model}` is not served here (this server serves `{}`)",
                self.model_name
            )))
        }
    }

    /// `work` on the store, on the blocking pool: file system calls do not hold an async worker.
    async fn on_store<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Store) -> T + Send + 'static,
    ) -> Result<T, Failure> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || work(&store))
            .await
            .map_err(|error| Failure {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                detail: format!("the checkpoint store's task failed: {error}"),
            })
    }

    /// A checkpoint path that exists in the store.
    async fn existing(&self, path: &str, field: &str) -> Result<CheckpointPath, Failure> {
        let parsed = CheckpointPath::parse(path, field).map_err(bad)?;
        let asked = parsed.clone();
        if !self.on_store(move |store| store.exists(&asked)).await? {
            return Err(missing(format!(
                "{field}: checkpoint `{path}` does not exist"
            )));
        }
        Ok(parsed)
    }
}

/// The sequence key of a training client's request: its model and `seq_id` (the SDK's start at 1; 0 is
/// a request without one).
fn sequence(model_id: &str, seq_id: Option<u64>) -> Option<String> {
    seq_id
        .filter(|&seq| seq > 0)
        .map(|seq| format!("{model_id}/{seq}"))
}

/// `object` with `extra`'s fields added.
fn with_fields(mut object: Value, extra: Value) -> Value {
    if let (Value::Object(object), Value::Object(extra)) = (&mut object, extra) {
        object.extend(extra);
    }
    object
}

async fn healthz() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn not_found() -> Response {
    missing("Not Found: not a route of the Tinker API served by holo tinker-serve").into_response()
}

/// The SDK's feature flags: the plain protocol (one `retrieve_future` per request, uncompressed
/// `forward_backward` chunks sent in order, custom losses run by the client).
async fn client_config(body: Result<Bytes, BytesRejection>) -> Reply {
    let _: requests::ClientConfig = parse(body)?;
    Ok(Json(json!({
        "pjwt_auth_enabled": false,
        "parallel_fwdbwd_chunks": false,
        "proto_compress_fwdbwd": false,
        "sample_use_retrieve_futures": false,
        "custom_loss_server_side": false,
        "sample_join_sampling_session": false,
    }))
    .into_response())
}

async fn dynamic_config() -> Response {
    Json(json!({"sample_cancel_enabled": false})).into_response()
}

/// The SDK's telemetry is accepted and dropped: nothing here reads it.
async fn telemetry() -> Response {
    Json(json!({"status": "accepted"})).into_response()
}

async fn create_session(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let _: requests::CreateSession = parse(body)?;
    let session_id = format!("{:016x}", futures::random_u64());
    service
        .sessions
        .lock()
        .expect("not poisoned")
        .insert(session_id.clone());
    // `sampling_seed_bits`, which the SDK ignores, tells holo's client that seeds are taken whole
    // (`worker::sample_seed`); it sends other services 31 bits.
    Ok(Json(json!({
        "type": "create_session",
        "session_id": session_id,
        "sampling_seed_bits": SAMPLING_SEED_BITS,
    }))
    .into_response())
}

async fn session_heartbeat(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::SessionRef = parse(body)?;
    service.check_session(&request.session_id)?;
    Ok(Json(json!({"type": "session_heartbeat"})).into_response())
}

async fn finish_session(
    State(service): State<Arc<Service>>,
    Path(session): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let _: requests::FinishSession = parse(body)?;
    // The session's models and samplers stay until unloaded or a restart, as its checkpoints do: the
    // SDK finishes a session when its ServiceClient closes, while clients made from it may still run.
    service.check_session(&session)?;
    Ok(Json(json!({})).into_response())
}

async fn capabilities(State(service): State<Arc<Service>>) -> Response {
    Json(json!({"supported_models": [{
        "model_name": service.model_name,
        "max_context_length": service.context,
        "trainable": true,
        "sampleable": true,
    }]}))
    .into_response()
}

async fn create_model(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::CreateModel = parse(body)?;
    service.check_session(&request.session_id)?;
    service.check_base(&request.base_model)?;
    if let Some(optimizer) = &request.optimizer_config {
        if optimizer.kind != "adamw" {
            return Err(bad(format!(
                "optimizer_config.type: `{}` is not served (only adamw)",
                optimizer.kind
            )));
        }
    }
    let lora = request
        .lora_config
        .ok_or_else(|| bad("lora_config: full fine-tuning is not served; give a LoRA rank"))?;
    if lora.rank == 0 {
        return Err(bad("lora_config.rank: must be at least 1"));
    }
    let mut targets: Vec<String> = Vec::new();
    if lora.train_attn {
        targets.extend(ATTENTION.map(String::from));
    }
    if lora.train_mlp {
        targets.extend(MLP.map(String::from));
    }
    if lora.train_unembed {
        targets.extend(UNEMBED.map(String::from));
    }
    if targets.is_empty() {
        return Err(bad(
            "lora_config: train_attn, train_mlp and train_unembed are all false: nothing to train",
        ));
    }
    let model_id = format!("{}:train:{}", request.session_id, request.model_seq_id);
    // The SDK's `seed: None` asks for a random one: the session id is random, and a retried request
    // draws the same.
    let seed = lora.seed.unwrap_or_else(|| {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        model_id.hash(&mut hasher);
        hasher.finish()
    });
    let info = RunInfo {
        base_model: request.base_model,
        rank: lora.rank,
        alpha: super::wire::LORA_ALPHA,
        seed,
        targets,
    };
    register_model(&service, &model_id, &info)?;
    service.submit(
        Job::CreateModel {
            model_id: model_id.clone(),
            info,
        },
        json!({"model_id": model_id}),
        Some(format!("create/{model_id}")),
    )
}

/// Records a model about to be created; the same request again (a retry) is accepted, another one for
/// that id refused.
fn register_model(service: &Service, model_id: &str, info: &RunInfo) -> Result<(), Failure> {
    let mut models = service.models.lock().expect("not poisoned");
    if models.get(model_id).is_some_and(|known| known != info) {
        return Err(Failure {
            status: StatusCode::CONFLICT,
            detail: format!("model `{model_id}` exists"),
        });
    }
    models.insert(model_id.to_string(), info.clone());
    Ok(())
}

async fn get_info(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::ModelRef = parse(body)?;
    let info = service.check_model(&request.model_id)?;
    Ok(Json(worker::model_info(&request.model_id, &info, &service.arch)).into_response())
}

/// `weights_info` (`RestClient.get_weights_info_by_tinker_path`, `tinker checkpoint info`): what a
/// checkpoint's adapter trains.
async fn weights_info(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::WeightsInfo = parse(body)?;
    let path = service
        .existing(&request.tinker_path, "tinker_path")
        .await?;
    let info = service
        .on_store(move |store| store.run_info(&path.run))
        .await?
        .map_err(missing)?;
    let trains = |names: &[&str]| {
        names
            .iter()
            .all(|name| info.targets.iter().any(|t| t == name))
    };
    Ok(Json(json!({
        "base_model": info.base_model,
        "is_lora": true,
        "lora_rank": info.rank,
        "train_unembed": trains(&UNEMBED),
        "train_mlp": trains(&MLP),
        "train_attn": trains(&ATTENTION),
    }))
    .into_response())
}

async fn unload_model(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::ModelRef = parse(body)?;
    service.check_model(&request.model_id)?;
    service
        .models
        .lock()
        .expect("not poisoned")
        .remove(&request.model_id);
    service.submit(
        Job::Unload {
            model_id: request.model_id,
        },
        json!({}),
        None,
    )
}

async fn forward_backward(
    State(service): State<Arc<Service>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    if let Some(encoding) = headers.get(header::CONTENT_ENCODING) {
        return Err(Failure {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            detail: format!(
                "Content-Encoding {encoding:?} is not accepted (client/config says \
                 proto_compress_fwdbwd: false)"
            ),
        });
    }
    let bytes = body.map_err(|rejection| Failure {
        status: rejection.status(),
        detail: rejection.body_text(),
    })?;
    let request =
        requests::forward_backward(&bytes, service.vocab, service.context).map_err(bad)?;
    service.check_model(&request.model_id)?;
    let key = sequence(&request.model_id, Some(request.seq_id));
    service.submit(
        Job::ForwardBackward {
            model_id: request.model_id,
            data: request.data,
            loss: request.loss,
            forward_only: request.forward_only,
        },
        json!({}),
        key,
    )
}

async fn optim_step(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::OptimStep = parse(body)?;
    request.adam_params.check().map_err(bad)?;
    service.check_model(&request.model_id)?;
    let adam = request.adam_params;
    let key = sequence(&request.model_id, request.seq_id);
    service.submit(
        Job::OptimStep {
            model_id: request.model_id,
            params: worker::AdamParams {
                learning_rate: adam.learning_rate,
                settings: holo_train::optim::AdamSettings {
                    beta1: adam.beta1,
                    beta2: adam.beta2,
                    eps: adam.eps,
                    weight_decay: adam.weight_decay,
                },
                grad_clip_norm: adam.grad_clip_norm,
            },
        },
        json!({}),
        key,
    )
}

/// The checkpoint a save names: `path` is a name, or a sequence-numbered one when not given.
fn save_path(
    model_id: &str,
    name: Option<String>,
    seq_id: Option<u64>,
    kind: Kind,
) -> Result<CheckpointPath, Failure> {
    let name = name.unwrap_or_else(|| format!("seq-{:06}", seq_id.unwrap_or(0)));
    store::check_name(&name, "path").map_err(bad)?;
    Ok(CheckpointPath {
        run: model_id.to_string(),
        kind,
        name,
    })
}

async fn save_weights(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::SaveWeights = parse(body)?;
    service.check_model(&request.model_id)?;
    let path = save_path(
        &request.model_id,
        request.path,
        request.seq_id,
        Kind::Weights,
    )?;
    let key = sequence(&request.model_id, request.seq_id);
    service.submit(
        Job::Save {
            model_id: request.model_id,
            path,
            overwrite: request.overwrite,
            ttl_seconds: request.ttl_seconds,
        },
        json!({}),
        key,
    )
}

async fn save_weights_for_sampler(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::SaveWeightsForSampler = parse(body)?;
    if let Some(kind) = request.kind.as_deref().filter(|kind| *kind != "snapshot") {
        return Err(bad(format!(
            "kind: `{kind}` sampling clients are not served (only snapshot)"
        )));
    }
    service.check_model(&request.model_id)?;
    let key = sequence(&request.model_id, request.seq_id);
    match (request.path, request.sampling_session_seq_id) {
        (Some(name), _) => {
            let path = save_path(&request.model_id, Some(name), None, Kind::Sampler)?;
            service.submit(
                Job::Save {
                    model_id: request.model_id,
                    path,
                    // The SDK has no overwrite flag here: a sampler checkpoint saved again under its
                    // name is the newer weights, as on the hosted service.
                    overwrite: true,
                    ttl_seconds: request.ttl_seconds,
                },
                json!({}),
                key,
            )
        }
        // A snapshot lives in memory for its sampling session, until a restart or until
        // `SNAPSHOTS_KEPT` newer ones are made: a TTL cannot make it live longer, and the SDK sends
        // none for one.
        (None, Some(seq)) => {
            if request.ttl_seconds.is_some() {
                return Err(bad(
                    "ttl_seconds: a snapshot for a sampling session lives in memory, until the server \
                     restarts or newer snapshots replace it; name the checkpoint (path) to give it a TTL",
                ));
            }
            let session = format!("{}:sample:{seq}", request.model_id);
            service
                .samplers
                .lock()
                .expect("not poisoned")
                .insert(session.clone(), Weights::Snapshot(session.clone()));
            service.submit(
                Job::Snapshot {
                    model_id: request.model_id,
                    session,
                },
                json!({}),
                key,
            )
        }
        (None, None) => Err(bad(
            "path or sampling_session_seq_id: one of them is needed",
        )),
    }
}

async fn load_weights(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::LoadWeights = parse(body)?;
    if request.weights_access_token.is_some() {
        return Err(bad(
            "weights_access_token: not served (checkpoints here have one owner)",
        ));
    }
    if let Some(optimizer) = &request.optimizer_config {
        if optimizer.kind != "adamw" {
            return Err(bad(format!(
                "optimizer_config.type: `{}` is not served (only adamw)",
                optimizer.kind
            )));
        }
    }
    let path = service.existing(&request.path, "path").await?;
    if path.kind != Kind::Weights {
        return Err(bad(format!(
            "path: `{}` is sampler weights; loading takes a tinker://<run>/weights/<name> training state",
            request.path
        )));
    }
    let (model_id, create, key) =
        match (&request.model_id, &request.session_id, request.model_seq_id) {
            (Some(model_id), None, None) => {
                service.check_model(model_id)?;
                (model_id.clone(), false, sequence(model_id, request.seq_id))
            }
            (None, Some(session), Some(seq)) => {
                service.check_session(session)?;
                let run = path.run.clone();
                let info = service
                    .on_store(move |store| store.run_info(&run))
                    .await?
                    .map_err(missing)?;
                if let Some(base) = &request.base_model {
                    service.check_base(base)?;
                }
                service.check_base(&info.base_model)?;
                let model_id = format!("{session}:train:{seq}");
                register_model(&service, &model_id, &info)?;
                let key = Some(format!("create/{model_id}"));
                (model_id, true, key)
            }
            _ => return Err(bad(
                "model_id, or session_id with model_seq_id: exactly one of the two forms is needed",
            )),
        };
    service.submit(
        Job::Load {
            model_id: model_id.clone(),
            path,
            optimizer: request.optimizer,
            create,
        },
        json!({"model_id": model_id}),
        key,
    )
}

async fn create_sampling_session(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::CreateSamplingSession = parse(body)?;
    service.check_session(&request.session_id)?;
    let weights = sampler_weights(
        &service,
        request.model_path.as_deref(),
        request.base_model.as_deref(),
    )
    .await?;
    let id = format!(
        "{}:sample:{}",
        request.session_id, request.sampling_session_seq_id
    );
    service
        .samplers
        .lock()
        .expect("not poisoned")
        .insert(id.clone(), weights);
    Ok(Json(json!({"type": "create_sampling_session", "sampling_session_id": id})).into_response())
}

/// The weights a sampler of `model_path` (or of the base model) samples.
async fn sampler_weights(
    service: &Service,
    model_path: Option<&str>,
    base_model: Option<&str>,
) -> Result<Weights, Failure> {
    if let Some(base) = base_model {
        service.check_base(base)?;
    }
    match model_path {
        Some(path) => Ok(Weights::Checkpoint(
            service.existing(path, "model_path").await?,
        )),
        None if base_model.is_some() => Ok(Weights::Base),
        None => Err(bad("model_path or base_model: one of them is needed")),
    }
}

async fn get_sampler(State(service): State<Arc<Service>>, Path(sampler): Path<String>) -> Reply {
    let weights = service
        .samplers
        .lock()
        .expect("not poisoned")
        .get(&sampler)
        .cloned()
        .ok_or_else(|| missing(format!("no sampler `{sampler}`")))?;
    let model_path = match weights {
        Weights::Checkpoint(path) => Some(path.uri()),
        Weights::Base | Weights::Snapshot(_) => None,
    };
    Ok(Json(json!({
        "sampler_id": sampler,
        "base_model": service.model_name,
        "model_path": model_path,
    }))
    .into_response())
}

async fn asample(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::SampleRequest = parse(body)?;
    request.check_served().map_err(bad)?;
    request.sampling_params.check().map_err(bad)?;
    let weights = match &request.sampling_session_id {
        Some(session) => service
            .samplers
            .lock()
            .expect("not poisoned")
            .get(session)
            .cloned()
            .ok_or_else(|| missing(format!("sampling_session_id: no sampler `{session}`")))?,
        None => {
            sampler_weights(
                &service,
                request.model_path.as_deref(),
                request.base_model.as_deref(),
            )
            .await?
        }
    };
    let prompt = request
        .prompt
        .tokens("prompt", service.vocab)
        .map_err(bad)?;
    if prompt.is_empty() {
        return Err(bad("prompt: no token"));
    }
    if prompt.len() >= service.context {
        return Err(bad(format!(
            "prompt: {} tokens leave no room in the model's context of {}",
            prompt.len(),
            service.context
        )));
    }
    if request.num_samples == 0 {
        return Err(bad("num_samples: must be at least 1"));
    }
    if let Some(last) = request.prompt_logprobs_last_n {
        if request.prompt_logprobs != Some(true) {
            return Err(bad(
                "prompt_logprobs_last_n: applies to prompt log-probabilities; set prompt_logprobs",
            ));
        }
        if last == 0 || last as usize >= prompt.len() {
            return Err(bad(format!(
                "prompt_logprobs_last_n: {last} is not between 1 and the prompt's {} tokens - 1",
                prompt.len()
            )));
        }
    }
    if request.topk_sample_logprobs > service.vocab as u64 {
        return Err(bad(format!(
            "topk_sample_logprobs: {} is more than the vocabulary's {} tokens",
            request.topk_sample_logprobs, service.vocab
        )));
    }
    let room = service.context - prompt.len();
    let max_tokens = match request.sampling_params.max_tokens {
        Some(max) if max as usize > room => {
            return Err(bad(format!(
                "sampling_params.max_tokens: {max} with a prompt of {} tokens passes the model's \
                 context of {}",
                prompt.len(),
                service.context
            )))
        }
        Some(max) => max as usize,
        None => room,
    };
    let params = &request.sampling_params;
    let sample = Sample {
        weights,
        prompt,
        num_samples: request.num_samples as usize,
        max_tokens,
        temperature: params.temperature,
        top_p: params.top_p,
        top_k: if params.top_k < 0 {
            0
        } else {
            params.top_k as usize
        },
        seed: params.seed,
        stop: params.stop(service.vocab).map_err(bad)?,
        prompt_logprobs: request.prompt_logprobs.unwrap_or(false),
        prompt_logprobs_last_n: request.prompt_logprobs_last_n.map(|last| last as usize),
        topk: request.topk_sample_logprobs as usize,
    };
    // The SDK stamps each sequence with an id given when the request is accepted.
    let tag = format!("{:08x}", futures::random_u64() as u32);
    let sequence_ids: Vec<String> = (0..sample.num_samples)
        .map(|index| format!("{tag}-{index}"))
        .collect();
    // A sampling client's `seq_id`s count from 0.
    let key = match (&request.sampling_session_id, request.seq_id) {
        (Some(session), Some(seq)) => Some(format!("{session}/{seq}")),
        _ => None,
    };
    service.submit(
        Job::Sample(sample),
        json!({"sample_sequence_ids": sequence_ids}),
        key,
    )
}

async fn retrieve_future(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Reply {
    let request: requests::RetrieveFuture = parse(body)?;
    match service.futures.retrieve(&request.request_id).await {
        Retrieved::Unknown => Err(missing(format!(
            "request_id: no request `{}` (futures end with a server restart)",
            request.request_id
        ))),
        Retrieved::Pending => Ok(Json(json!({
            "type": "try_again",
            "request_id": request.request_id,
            "queue_state": "active",
        }))
        .into_response()),
        Retrieved::Done(Outcome::Json(value)) => Ok(Json(value).into_response()),
        Retrieved::Done(Outcome::Proto(bytes)) => {
            Ok(([(header::CONTENT_TYPE, "application/x-protobuf")], bytes).into_response())
        }
        Retrieved::Done(Outcome::Failed { error, category }) => {
            Ok(Json(json!({"error": error, "category": category.name()})).into_response())
        }
    }
}

/// A checkpoint as the SDK's `Checkpoint` type describes it (`time` in seconds since the epoch, which
/// pydantic reads as a datetime).
fn checkpoint_json(path: &CheckpointPath, written: u64) -> Value {
    let kind = match path.kind {
        Kind::Weights => "training",
        Kind::Sampler => "sampler",
    };
    json!({
        "checkpoint_id": format!("{}/{}", path.kind.folder(), path.name),
        "checkpoint_type": kind,
        "tinker_path": path.uri(),
        "training_run_id": path.run,
        "time": written,
    })
}

async fn checkpoints(State(service): State<Arc<Service>>, Path(run): Path<String>) -> Reply {
    store::check_name(&run, "training run").map_err(bad)?;
    let list = service
        .on_store(move |store| {
            store.run_info(&run).map_err(missing)?;
            let found = store.list(&run).map_err(|error| Failure {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                detail: error.to_string(),
            })?;
            Ok::<Vec<Value>, Failure>(
                found
                    .iter()
                    .map(|path| checkpoint_json(path, store.written(path).unwrap_or(0)))
                    .collect(),
            )
        })
        .await??;
    Ok(Json(json!({"checkpoints": list})).into_response())
}

async fn delete_checkpoint(
    State(service): State<Arc<Service>>,
    Path((run, kind, name)): Path<(String, String, String)>,
) -> Reply {
    let path = CheckpointPath::parse(&format!("tinker://{run}/{kind}/{name}"), "checkpoint")
        .map_err(bad)?;
    let asked = path.clone();
    match service.on_store(move |store| store.delete(&asked)).await? {
        Ok(true) => Ok(StatusCode::NO_CONTENT.into_response()),
        Ok(false) => Err(missing(format!(
            "checkpoint `{}` does not exist",
            path.uri()
        ))),
        Err(error) => Err(Failure {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            detail: error.to_string(),
        }),
    }
}
