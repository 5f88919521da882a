//! Weights that change while the server serves: LoRA adapters loaded and unloaded by name (vLLM's
//! `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`, same bodies and answers), the base
//! weights replaced from safetensors (SGLang's `POST /update_weights_from_disk`; vLLM has no route for
//! it outside its development mode's `collective_rpc`), and the weight version every answer reports.
//!
//! Each set of weights (the base, each adapter) is its own [`LocalModel`]: its own copy of the model
//! (the base's tensors shared, an adapter's own), its own scheduler and its own prefix cache. So keys and
//! values computed under one set of weights are never read under another, whatever requests arrive
//! when, and a request samples to its end with the weights it started with: it holds its model, and a
//! load only changes which model the next requests get. The price is that sequences of different
//! adapters are not batched together (each model batches its own) and that each model's batch has its
//! own memory; per-row adapters in one batch (vLLM's punica kernels) would batch them, at the cost of
//! a decoder path the trainer does not run. Here an adapter runs unmerged (`W x + scale · B (A x)`)
//! exactly as the trainer's LoRA model runs it, so the server's log-probabilities are the trainer's.

use std::path::PathBuf;
use std::sync::RwLock;

use axum::http::HeaderValue;
use holo_model::LocalModel;

use super::*;

/// The header every answer of a sampling route carries: the version of the weights that sampled it.
pub const WEIGHT_VERSION_HEADER: &str = "x-holo-weight-version";

/// One set of weights a request can name: the base model or an adapter.
#[derive(Clone)]
pub(super) struct Target {
    /// What `model` names and answers report.
    pub(super) name: String,
    pub(super) sampler: Arc<dyn Sampler>,
    /// The base weights: 0, then one more per replacement. An adapter: how many times its name has
    /// been loaded (1 for the first load; an unloaded name reloaded goes on counting).
    pub(super) version: u64,
    /// The local model, when the server can build new weights from it.
    local: Option<LocalModel>,
    /// Where an adapter was loaded from (`root` in `/v1/models`).
    path: Option<String>,
}

struct Table {
    base: Target,
    adapters: BTreeMap<String, Target>,
    /// The last version of every adapter name ever loaded.
    versions: HashMap<String, u64>,
}

/// The served weights and their versions.
pub(super) struct Weights {
    table: RwLock<Table>,
    /// Updates one at a time: two loads of one name must not both read its version.
    updating: tokio::sync::Mutex<()>,
}

impl Weights {
    pub(super) fn new(
        id: String,
        sampler: Arc<dyn Sampler>,
        updatable: Option<LocalModel>,
    ) -> Self {
        Weights {
            table: RwLock::new(Table {
                base: Target {
                    name: id,
                    sampler,
                    version: 0,
                    local: updatable,
                    path: None,
                },
                adapters: BTreeMap::new(),
                versions: HashMap::new(),
            }),
            updating: tokio::sync::Mutex::new(()),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        self.table
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Table> {
        self.table
            .write()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// The weights `model` names (the base when absent).
    pub(super) fn target(&self, model: Option<&str>) -> Result<Target, ApiError> {
        let table = self.read();
        match model {
            None => Ok(table.base.clone()),
            Some(name) if name == table.base.name => Ok(table.base.clone()),
            Some(name) => table.adapters.get(name).cloned().ok_or_else(|| {
                let mut known = vec![format!("`{}`", table.base.name)];
                known.extend(table.adapters.keys().map(|name| format!("`{name}`")));
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!(
                        "The model `{name}` does not exist; this server serves {}.",
                        known.join(", ")
                    ),
                )
                .param("model")
                .code("model_not_found")
            }),
        }
    }

    /// `/v1/models`' objects: the base, then the adapters by name (with `parent`, as vLLM lists them).
    pub(super) fn model_objects(&self, created: u64, max_model_len: Option<u32>) -> Vec<Value> {
        let table = self.read();
        let base = &table.base.name;
        let mut objects = vec![json!({
            "id": base,
            "object": "model",
            "created": created,
            "owned_by": "holo",
            "root": base,
            "parent": null,
            "max_model_len": max_model_len,
            "weight_version": table.base.version,
        })];
        objects.extend(table.adapters.values().map(|adapter| {
            json!({
                "id": adapter.name,
                "object": "model",
                "created": created,
                "owned_by": "holo",
                "root": adapter.path,
                "parent": base,
                "max_model_len": max_model_len,
                "weight_version": adapter.version,
            })
        }));
        objects
    }

    /// Every served name with its version, for `/metrics`.
    pub(super) fn versions(&self) -> Vec<(String, u64)> {
        let table = self.read();
        std::iter::once(&table.base)
            .chain(table.adapters.values())
            .map(|target| (target.name.clone(), target.version))
            .collect()
    }

    /// The scheduler of the base weights now served, when local.
    pub(super) fn scheduler(&self) -> Option<Arc<holo_model::SchedulerStats>> {
        let table = self.read();
        table.base.local.as_ref().map(LocalModel::scheduler_stats)
    }

    /// The served base's local model, which new weights are built from, or the refusal of a server
    /// that has none.
    fn updatable(&self) -> Result<LocalModel, String> {
        match &self.read().base.local {
            Some(model) => Ok(model.clone()),
            None => Err(
                "this server's sampler is not a local model that takes new weights (serve a model \
                 folder with `holo serve`)"
                    .into(),
            ),
        }
    }
}

/// Why new weights were not built ([`Weights::rebuilt`]).
enum Rebuild {
    /// This server's sampler takes no new weights (it is not a local model).
    Fixed(String),
    /// The weights do not fit the model (missing files, other shapes, unknown targets).
    Refused(String),
    /// The building thread failed (a panic).
    Failed(String),
}

impl Weights {
    /// A copy of the served base with the weights `build` makes from the base model's, built on a
    /// blocking thread (reading files and copying tensors must not stall the server's async threads).
    async fn rebuilt(
        &self,
        build: impl FnOnce(&holo_model::Model) -> Result<holo_model::Model, String> + Send + 'static,
    ) -> Result<LocalModel, Rebuild> {
        let base = self.updatable().map_err(Rebuild::Fixed)?;
        // The copy shares the base's tokenizer, template, grammars and limits (`LocalModel::with_model`).
        let built = tokio::task::spawn_blocking(move || {
            build(base.model()).map(|model| base.with_model(model, base.limits()))
        })
        .await;
        match built {
            Ok(built) => built.map_err(Rebuild::Refused),
            Err(error) => Err(Rebuild::Failed(error.to_string())),
        }
    }
}

/// An error in vLLM's shape for its LoRA routes (`type` `InvalidUserInput`, `NotFoundError`,
/// `BadRequestError`).
fn vllm_error(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Response {
    let mut error = ApiError::new(status, message);
    error.kind = kind;
    error.into_response()
}

/// `text` as vLLM answers its LoRA routes (a plain-text body), with the adapter's version.
fn success(text: String, version: u64) -> Response {
    let mut response = (StatusCode::OK, text).into_response();
    set_version(&mut response, version);
    response
}

pub(super) fn set_version(response: &mut Response, version: u64) {
    response
        .headers_mut()
        .insert(WEIGHT_VERSION_HEADER, HeaderValue::from(version));
}

/// A JSON object body, or the answer that refuses it.
fn object(body: Result<Bytes, BytesRejection>) -> Result<Map<String, Value>, ApiError> {
    body_bytes(body).and_then(|bytes| parse_object(&bytes))
}

fn string_field(body: &Map<String, Value>, key: &str) -> Option<String> {
    body.get(key)
        .and_then(Value::as_str)
        .filter(|value| !value.is_empty())
        .map(str::to_string)
}

/// `POST /v1/load_lora_adapter` `{"lora_name", "lora_path", "load_inplace"}`.
pub(super) async fn load_lora_adapter(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match object(body) {
        Ok(body) => body,
        Err(error) => return error.into_response(),
    };
    let (Some(name), Some(path)) = (
        string_field(&body, "lora_name"),
        string_field(&body, "lora_path"),
    ) else {
        return vllm_error(
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "Both 'lora_name' and 'lora_path' must be provided.",
        );
    };
    let in_place = body.get("load_inplace").and_then(Value::as_bool) == Some(true);
    let weights = &state.weights;
    let _updating = weights.updating.lock().await;
    {
        let table = weights.read();
        if name == table.base.name {
            return vllm_error(
                StatusCode::BAD_REQUEST,
                "InvalidUserInput",
                format!("'{name}' is the base model's name; an adapter needs another."),
            );
        }
        if table.adapters.contains_key(&name) && !in_place {
            return vllm_error(
                StatusCode::BAD_REQUEST,
                "InvalidUserInput",
                format!(
                    "The lora adapter '{name}' has already been loaded. If you want to load the \
                     adapter in place, set 'load_inplace' to True."
                ),
            );
        }
    }
    let dir = PathBuf::from(&path);
    if !dir.join("adapter_config.json").is_file()
        || !dir.join("adapter_model.safetensors").is_file()
    {
        // vLLM answers 404 when the path holds no adapter.
        return vllm_error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!(
                "No adapter found for {path}: it needs adapter_config.json and \
                 adapter_model.safetensors (PEFT's layout)"
            ),
        );
    }
    let built = weights
        .rebuilt(move |base| holo_model::update::with_adapter(base, &dir))
        .await;
    let model = match built {
        Ok(model) => model,
        Err(Rebuild::Fixed(message)) => {
            return vllm_error(StatusCode::BAD_REQUEST, "BadRequestError", message)
        }
        Err(Rebuild::Refused(message)) => {
            return vllm_error(
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                format!("Cannot load the LoRA adapter '{name}' from {path}: {message}"),
            )
        }
        Err(Rebuild::Failed(error)) => {
            return vllm_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                format!("loading the LoRA adapter '{name}' failed: {error}"),
            )
        }
    };
    let version = {
        let mut table = weights.write();
        let version = table.versions.get(&name).map_or(1, |last| last + 1);
        table.versions.insert(name.clone(), version);
        table.adapters.insert(
            name.clone(),
            Target {
                name: name.clone(),
                sampler: Arc::new(model.clone()),
                version,
                local: Some(model),
                path: Some(path.clone()),
            },
        );
        version
    };
    tracing::info!(target: "holo::serve", "loaded LoRA adapter '{name}' from {path} (version {version})");
    success(
        format!("Success: LoRA adapter '{name}' added successfully."),
        version,
    )
}

/// `POST /v1/unload_lora_adapter` `{"lora_name"}`.
pub(super) async fn unload_lora_adapter(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match object(body) {
        Ok(body) => body,
        Err(error) => return error.into_response(),
    };
    let Some(name) = string_field(&body, "lora_name") else {
        return vllm_error(
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "either 'lora_name' and 'lora_int_id' needs to be provided.",
        );
    };
    let _updating = state.weights.updating.lock().await;
    let removed = state.weights.write().adapters.remove(&name);
    match removed {
        Some(adapter) => {
            tracing::info!(target: "holo::serve", "unloaded LoRA adapter '{name}'");
            success(
                format!("Success: LoRA adapter '{name}' removed successfully."),
                adapter.version,
            )
        }
        None => vllm_error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The lora adapter '{name}' cannot be found."),
        ),
    }
}

/// `POST /update_weights_from_disk` `{"model_path"}` (SGLang's route and body): the base weights
/// replaced by those of a safetensors file or model folder of the same architecture and shapes.
/// Answers `{"success", "message", "weight_version"}`; a refusal is a 400 with `success: false`
/// and a message that names the tensor, and leaves the weights as they were.
pub(super) async fn update_weights_from_disk(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let refuse = |status: StatusCode, message: String| {
        (status, Json(json!({"success": false, "message": message}))).into_response()
    };
    let body = match object(body) {
        Ok(body) => body,
        Err(error) => return error.into_response(),
    };
    let Some(path) = string_field(&body, "model_path") else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "'model_path' must be provided.".into(),
        );
    };
    let weights = &state.weights;
    let _updating = weights.updating.lock().await;
    let file = PathBuf::from(&path);
    let built = weights
        .rebuilt(move |base| holo_model::update::with_weights(base, &file))
        .await;
    let model = match built {
        Ok(model) => model,
        Err(Rebuild::Fixed(message)) => return refuse(StatusCode::BAD_REQUEST, message),
        Err(Rebuild::Refused(message)) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("Cannot update the weights from {path}: {message}"),
            )
        }
        Err(Rebuild::Failed(error)) => {
            return refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("updating the weights failed: {error}"),
            )
        }
    };
    let version = {
        let mut table = weights.write();
        let version = table.base.version + 1;
        table.base = Target {
            name: table.base.name.clone(),
            sampler: Arc::new(model.clone()),
            version,
            local: Some(model),
            path: None,
        };
        version
    };
    tracing::info!(target: "holo::serve", "replaced the weights from {path} (version {version})");
    let mut response = Json(json!({
        "success": true,
        "message": format!("Succeeded to update model weights from {path}."),
        "weight_version": version,
    }))
    .into_response();
    set_version(&mut response, version);
    response
}
