//! The trained weights pushed to inference servers after every optimizer step, and verified there.
//!
//! A push writes the weights where the servers can read them (`RUN_DIR/sync/`: a PEFT adapter folder,
//! or `model.safetensors`), asks each server to load them (vLLM's `POST /v1/load_lora_adapter`, or
//! SGLang's `POST /update_weights_from_disk`, which `holo serve` both answers), then
//! scores a probe, a few fixed tokens, through the server's `/v1/completions` (`echo`, `logprobs: 0`,
//! `max_tokens: 0`: each token's log-probability given those before it). The push stands only if
//! - the server's log-probabilities match the trainer's own of the same tokens within `tolerance`
//!   (largest absolute difference), and
//! - they differ from the previous push's, when the trainer's own moved by more than [`NOISE`] since
//!   then: a server that answers the same numbers after a load did not take the new weights (the
//!   silent no-op of an adapter never synced). A step that changed nothing (a learning rate of 0) is
//!   not pushed.
//!
//! A server that reports weight versions (`x-holo-weight-version`, `holo serve`'s) must also score the
//! probe with the version its load answered. Otherwise the run stops with [`TrainError::Source`] naming
//! the server, the step and the cause, with the numbers. Every request has a deadline and says what it
//! waited for; a connection refused, reset or cut short is retried until the deadline. A server still
//! unreachable then is dropped from the pool ([`Servers`]: the sampler sends it nothing more) while
//! another is left, and the run stops, naming it, when it was the last. The sampler ([`QuickestServer`])
//! drops a server the same way when it fails requests and no longer answers `GET /health`, and sends
//! those requests to the others. At every push a dropped server that answers `GET /health` again is
//! pushed to and verified like the others, and back in the pool if that succeeds.
//!
//! **Adapter names.** A LoRA adapter is loaded in place under one name ([`SyncOptions::adapter_name`])
//! while the loop samples only between its steps. When it samples ahead ([`SyncOptions::versioned`]),
//! each push loads the adapter under a name of its own, `NAME-STEP`, and the sampler of the weights
//! after step `STEP` names it: a generation drawn while a push lands keeps the weights it started
//! with for every request it still makes (a multi-turn rollout's later turns, a refill), so each
//! generation samples one version. A name is unloaded (`POST /v1/unload_lora_adapter`) at the first
//! push after the last sampler naming it is dropped; its folder under `RUN_DIR/sync/` is kept until
//! then (vLLM may read an adapter again when it evicts it from its cache).

mod pool;
mod speed;

use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use serde_json::{json, Value};

use crate::checkpoint::{self, Weights};
use crate::error::TrainError;
use holo_core::openai::{OpenAi, OpenAiConfig};
use holo_model::{Model, Ops};
pub use pool::{QuickestServer, Servers};
pub use speed::Clock;

/// Below this, a change of the trainer's probe log-probabilities may round away on a server: the
/// no-op check applies only above it.
pub const NOISE: f32 = 1e-5;

/// How long a dropped server has to answer `GET /health` at a push for it to be tried again.
const REJOIN_HEALTH: Duration = Duration::from_secs(5);

/// How the trainer pushes its weights and to which servers (`holo train --vllm-server-base-url`).
#[derive(Debug, Clone, PartialEq)]
pub struct SyncOptions {
    /// The servers' base URLs, `http://host:port` (a trailing `/v1` is accepted).
    pub servers: Vec<String>,
    /// The name a LoRA run's adapter is loaded under, which its rollouts then name as their `model`
    /// (with `versioned`, the prefix of each push's name).
    pub adapter_name: String,
    /// Load each push's adapter under a name of its own (`adapter_name-STEP`) instead of in place, so
    /// that what is being sampled when a push lands keeps its weights (see the [module
    /// documentation](self)). The trainer sets it when it samples ahead of its steps.
    pub versioned: bool,
    /// The largest absolute difference allowed between a server's probe log-probabilities and the
    /// trainer's (default 1e-3: f32 on both sides differs by about 1e-5; raise it for a bf16 server).
    pub tolerance: f32,
    /// Deadline of every request to a server, retries of a refused connection included (default
    /// 240 s, TRL's `vllm_server_timeout`).
    pub timeout: Duration,
    /// The probe's tokens (default: 16 ids spread over the vocabulary).
    pub probe: Option<Vec<u32>>,
    /// Rollout requests a server runs at once at most (default 64, `holo serve`'s `--max-num-seqs`;
    /// give a vLLM server's `--max-num-seqs`): the others wait at the trainer and go to the first
    /// server done with one. Below it, each request goes to the server that would be done with it
    /// first by its measured speed, so a faster server takes more of them ([`QuickestServer`]).
    pub concurrency: usize,
}

impl SyncOptions {
    pub fn new(servers: Vec<String>) -> Self {
        SyncOptions {
            servers,
            adapter_name: "holo-policy".into(),
            versioned: false,
            tolerance: 1e-3,
            timeout: Duration::from_secs(240),
            probe: None,
            concurrency: 64,
        }
    }
}

/// What a push reports, as `sync/…` metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct Pushed {
    /// The largest difference between a server's probe and the trainer's.
    pub mismatch: f32,
    /// The largest change of the servers' probes since the previous push.
    pub change: f32,
    /// The weight version the servers report (the first one's), when they do and the adapter is not
    /// loaded under a name of its own.
    pub version: Option<u64>,
    /// The servers that took the push (those that could not be reached are dropped).
    pub servers: usize,
    pub seconds: f64,
}

/// Why a request to a server failed: the server is gone (it cannot be reached within the deadline),
/// or it answered what stops the run.
enum Failure {
    Gone(String),
    Stop(TrainError),
}

impl Failure {
    fn into_error(self) -> TrainError {
        match self {
            Failure::Gone(message) => TrainError::Source(message),
            Failure::Stop(error) => error,
        }
    }
}

/// A push that verified on one server.
struct Verified {
    /// The largest difference between its probe and the trainer's.
    mismatch: f32,
    /// The largest change of its probe since the previous push (none on the first).
    change: Option<f32>,
    /// The weight version it reports, when it does.
    version: Option<u64>,
    /// Its probe log-probabilities.
    scored: Vec<f32>,
}

/// One server as the sync sees it.
struct Server {
    url: String,
    /// What the latest push loaded and the probe names as `model`: the adapter's name, or the served
    /// model's id.
    model: String,
    /// The server's probe at the previous push.
    previous: Option<Vec<f32>>,
}

/// An adapter loaded under a name of its own ([`SyncOptions::versioned`]), until it is unloaded.
struct Published {
    name: String,
    /// Its sampler: the name is unloaded once every copy of it has been dropped.
    sampler: Weak<QuickestServer>,
    /// The servers it was loaded on.
    holders: Vec<usize>,
    /// The folder it was loaded from.
    folder: PathBuf,
}

/// Pushes and verifies the trained weights on every server; see the [module documentation](self).
pub struct WeightSync {
    options: SyncOptions,
    dir: PathBuf,
    client: reqwest::Client,
    servers: Vec<Server>,
    /// Which servers are still in the pool (shared with the sampler, [`WeightSync::sampler`]).
    pool: Arc<Servers>,
    lora: bool,
    probe: Vec<u32>,
    /// The trainer's probe at the previous push.
    previous: Option<Vec<f32>>,
    pushes: u64,
    /// The sampler of the latest push's weights (none before the first push).
    current: Option<Arc<QuickestServer>>,
    /// The adapters loaded under names of their own and not yet unloaded, oldest first.
    published: Vec<Published>,
}

impl WeightSync {
    /// Asks every server which model it serves (`GET /v1/models`; what a full fine-tuning run's
    /// rollouts name), writing pushed weights under `dir`. `lora`: the run trains LoRA adapters.
    pub async fn connect(
        options: SyncOptions,
        dir: PathBuf,
        lora: bool,
        vocab_size: usize,
    ) -> Result<Self, TrainError> {
        if options.servers.is_empty() {
            return Err(TrainError::Input(
                "weight sync: no server to sample on".into(),
            ));
        }
        let client = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(|error| TrainError::Input(format!("weight sync: an HTTP client: {error}")))?;
        let probe = options.probe.clone().unwrap_or_else(|| {
            (0..16u64)
                .map(|i| ((i * 7919 + 13) % vocab_size.max(1) as u64) as u32)
                .collect()
        });
        let mut sync = WeightSync {
            dir,
            client,
            servers: Vec::new(),
            pool: Arc::new(Servers::new(Vec::new(), options.concurrency)),
            lora,
            probe,
            previous: None,
            pushes: 0,
            current: None,
            published: Vec::new(),
            options,
        };
        for url in sync.options.servers.clone() {
            let url = url
                .trim_end_matches('/')
                .trim_end_matches("/v1")
                .to_string();
            let model = if lora {
                sync.options.adapter_name.clone()
            } else {
                let (_, _, models) = sync
                    .request(&url, "GET", "/v1/models", None, "the served models")
                    .await
                    .map_err(Failure::into_error)?;
                models["data"][0]["id"]
                    .as_str()
                    .ok_or_else(|| {
                        TrainError::Source(format!(
                            "weight sync: {url}/v1/models lists no model: {models}"
                        ))
                    })?
                    .to_string()
            };
            sync.servers.push(Server {
                url,
                model,
                previous: None,
            });
        }
        let urls = sync
            .servers
            .iter()
            .map(|server| server.url.clone())
            .collect();
        sync.pool = Arc::new(Servers::new(urls, sync.options.concurrency));
        Ok(sync)
    }

    /// The sampler of the rollouts on the weights of the latest push (none before the first): the
    /// servers, each request to the one that would be done with it first (its requests outstanding
    /// weighed by its measured speed), each one dropped from the pool (for the sync too) when it no
    /// longer answers.
    pub fn sampler(&self) -> Option<Arc<QuickestServer>> {
        self.current.clone()
    }

    /// A sampler of the weights the latest push loaded, on `holders` (every server in the pool:
    /// `None`). With several servers each tries a failed request twice, not six times, before the
    /// pool asks whether the server is still there.
    fn least_outstanding(&self, holders: Option<Vec<usize>>) -> Result<QuickestServer, TrainError> {
        let several = self.servers.len() > 1;
        let samplers = self
            .servers
            .iter()
            .map(|server| {
                let defaults = OpenAiConfig::new(&server.url, &server.model);
                OpenAi::new(OpenAiConfig {
                    proxy_from_env: false,
                    request_timeout: self.options.timeout,
                    max_retries: if several { 2 } else { defaults.max_retries },
                    max_concurrency: self.options.concurrency.max(1),
                    ..defaults
                })
                .map_err(|error| TrainError::Input(format!("weight sync: {}: {error}", server.url)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(QuickestServer::new(
            samplers,
            self.servers
                .iter()
                .map(|server| server.model.clone())
                .collect(),
            holders,
            Arc::clone(&self.pool),
            self.client.clone(),
            self.options.timeout,
        ))
    }

    /// Whether each push loads the adapter under a name of its own.
    fn versioned(&self) -> bool {
        self.lora && self.options.versioned
    }

    /// Pushes `weights` (those of `model`, after optimizer step `step`; 0 before the first) to every
    /// server and verifies them there. `None` when the weights did not change since the last push.
    pub async fn push(
        &mut self,
        model: &Model,
        weights: &Weights<'_>,
        step: u64,
    ) -> Result<Option<Pushed>, TrainError> {
        let started = Instant::now();
        let own = self.own_probe(model)?;
        let moved = match &self.previous {
            Some(previous) => max_difference(previous, &own),
            None => f32::INFINITY,
        };
        if moved == 0.0 {
            self.pool.unchanged(step);
            return Ok(None);
        }
        let (folder, path) = self.write(weights)?;
        let name = self
            .versioned()
            .then(|| format!("{}-{step}", self.options.adapter_name));
        if let Some(name) = &name {
            for server in &mut self.servers {
                server.model = name.clone();
            }
        }
        let mut pushed = Pushed {
            mismatch: 0.0,
            change: 0.0,
            version: None,
            servers: 0,
            seconds: 0.0,
        };
        let dropped: Vec<usize> = (0..self.servers.len())
            .filter(|&index| !self.pool.alive(index))
            .collect();
        // Every server in the pool loads and scores at once: a push takes the slowest server's time,
        // not the sum.
        let live = self.pool.live();
        let results = futures_util::future::join_all(
            live.iter()
                .map(|&index| self.push_to(index, &path, step, &own, moved)),
        )
        .await;
        let mut verified = Vec::new();
        for (index, result) in live.into_iter().zip(results) {
            match result {
                Ok(push) => verified.push((index, push)),
                Err(Failure::Gone(message)) if self.pool.live().len() > 1 => {
                    self.pool.drop_server(index, &message);
                }
                Err(Failure::Gone(message)) => return Err(TrainError::Source(message)),
                Err(Failure::Stop(error)) => return Err(error),
            }
        }
        for index in dropped {
            if let Some(push) = self.rejoin(index, &path, step, &own).await {
                verified.push((index, push));
            }
        }
        let holders: Vec<usize> = verified.iter().map(|(index, _)| *index).collect();
        for (index, push) in verified {
            // A server that does not number its weights: only a name loaded once says which weights
            // sampled (an adapter loaded in place may change while a rollout samples).
            if push.version.is_some() || self.versioned() {
                self.pool
                    .loaded(index, &self.servers[index].model, push.version, step);
            }
            pushed.mismatch = pushed.mismatch.max(push.mismatch);
            pushed.change = pushed.change.max(push.change.unwrap_or(0.0));
            // Under names of their own every push is its name's first load: no version to report.
            if name.is_none() {
                pushed.version = pushed.version.or(push.version);
            }
            self.servers[index].previous = Some(push.scored);
        }
        pushed.servers = self.pool.live().len();
        self.previous = Some(own);
        self.pushes += 1;
        if let Some(name) = name {
            let sampler = Arc::new(self.least_outstanding(Some(holders.clone()))?);
            self.published.push(Published {
                name,
                sampler: Arc::downgrade(&sampler),
                holders,
                folder,
            });
            self.current = Some(sampler);
            self.unload_dropped().await;
        } else if self.current.is_none() {
            self.current = Some(Arc::new(self.least_outstanding(None)?));
        }
        pushed.seconds = started.elapsed().as_secs_f64();
        Ok(Some(pushed))
    }

    /// Unloads the adapters loaded under names of their own whose samplers have all been dropped
    /// (nothing samples with them any more), from the servers in the pool that loaded them, and
    /// removes their folders. A server that does not unload one keeps it, with a warning: the run
    /// goes on.
    async fn unload_dropped(&mut self) {
        let (dropped, kept): (Vec<Published>, Vec<Published>) = std::mem::take(&mut self.published)
            .into_iter()
            .partition(|published| published.sampler.strong_count() == 0);
        self.published = kept;
        for published in dropped {
            let unloads = published
                .holders
                .iter()
                .filter(|&&index| self.pool.alive(index))
                .map(|&index| self.unload(index, &published.name));
            futures_util::future::join_all(unloads).await;
            self.pool.unloaded(&published.name);
            let _ = std::fs::remove_dir_all(&published.folder);
        }
    }

    /// Asks server `index` to unload the adapter `name` (vLLM's `POST /v1/unload_lora_adapter`); a
    /// name the server no longer has (404) is unloaded already.
    async fn unload(&self, index: usize, name: &str) {
        let url = &self.servers[index].url;
        let what = format!("unloading the adapter `{name}`");
        let body = json!({ "lora_name": name });
        let answer = self
            .request(url, "POST", "/v1/unload_lora_adapter", Some(body), &what)
            .await;
        let why = match answer {
            Ok((200 | 404, _, _)) => return,
            Ok((status, _, answer)) => format!("it answered {status}: {answer}"),
            Err(Failure::Gone(message)) => message,
            Err(Failure::Stop(error)) => error.to_string(),
        };
        eprintln!(
            "warning: rollout server {url} keeps the adapter `{name}` loaded ({what}: {why})"
        );
    }

    /// Takes dropped server `index` back into the pool when it answers `GET /health` again (within
    /// [`REJOIN_HEALTH`]) and this push's weights load and verify there as on any server (returned);
    /// the no-op check starts over, since a server that came back may have been restarted. A server
    /// that still fails stays out of the pool, with a warning when it answered but its push did not
    /// verify. A server dropped by this very push is not tried again until the next.
    async fn rejoin(
        &mut self,
        index: usize,
        path: &std::path::Path,
        step: u64,
        own: &[f32],
    ) -> Option<Verified> {
        if !self.pool.healthy(&self.client, index, REJOIN_HEALTH).await {
            return None;
        }
        self.servers[index].previous = None;
        self.pool.forget(index);
        match self.push_to(index, path, step, own, 0.0).await {
            Ok(push) => {
                self.pool.rejoin(index);
                Some(push)
            }
            Err(Failure::Gone(_)) => None,
            Err(Failure::Stop(error)) => {
                eprintln!(
                    "warning: rollout server {} answers again but stays out of the pool: {error}",
                    self.servers[index].url
                );
                None
            }
        }
    }

    /// Loads the weights at `path` on server `index` and verifies them with the probe against the
    /// trainer's `own` (which moved by `moved` since the previous push).
    async fn push_to(
        &self,
        index: usize,
        path: &std::path::Path,
        step: u64,
        own: &[f32],
        moved: f32,
    ) -> Result<Verified, Failure> {
        let loaded = self.load(index, path, step).await?;
        let (scored, version) = self.score(index, step).await?;
        let server = &self.servers[index];
        let at = format!("{} after step {step}", server.url);
        let stop = |message: String| Failure::Stop(TrainError::Source(message));
        if let (Some(loaded), Some(version)) = (loaded, version) {
            if version != loaded {
                return Err(stop(format!(
                    "weight sync: {at}: the load answered version {loaded}, but the probe was scored \
                     with version {version}"
                )));
            }
        }
        if scored.len() != own.len() {
            return Err(stop(format!(
                "weight sync: {at}: the probe of {} tokens came back with {} log-probabilities",
                self.probe.len(),
                scored.len() + 1
            )));
        }
        let change = server
            .previous
            .as_ref()
            .map(|previous| max_difference(previous, &scored));
        if change == Some(0.0) && moved > NOISE {
            return Err(stop(format!(
                "weight sync: no-op sync at {at}: the server scores the probe exactly as before the \
                 push ({}), while the trained weights moved its log-probabilities by up to \
                 {moved:.3e}; the server did not take the new weights (`{}`)",
                numbers(&scored),
                server.model
            )));
        }
        let mismatch = max_difference(own, &scored);
        // NaN (a server answering garbage) fails too.
        if mismatch.is_nan() || mismatch > self.options.tolerance {
            return Err(stop(format!(
                "weight sync: mismatch at {at}: the server's probe log-probabilities differ from the \
                 trainer's by up to {mismatch:.3e} (tolerance {:.1e}); server {}, trainer {}",
                self.options.tolerance,
                numbers(&scored),
                numbers(own)
            )));
        }
        Ok(Verified {
            mismatch,
            change,
            version,
            scored,
        })
    }

    /// The trainer's log-probabilities of the probe's tokens after the first: a sampling pass, as the
    /// servers run it (a differentiable pass would drop LoRA inputs under `lora_dropout`, with the seed
    /// of the step's last micro-batch).
    fn own_probe(&self, model: &Model) -> Result<Vec<f32>, TrainError> {
        let device = model.device();
        let ids = Tensor::new(self.probe.as_slice(), device)?.unsqueeze(0)?;
        let mask = Tensor::ones((1, self.probe.len()), candle_core::DType::U32, device)?;
        let logprobs = model.token_logprobs(&ids, &mask, Ops::Fast)?;
        Ok(logprobs
            .to_dtype(candle_core::DType::F32)?
            .to_device(&Device::Cpu)?
            .squeeze(0)?
            .to_vec1()?)
    }

    /// Writes the weights under the sync folder, removing the previous push's unless its adapter
    /// stays loaded under its own name; returns the push's folder and the path the servers load
    /// (the adapter folder, or the safetensors file).
    fn write(&self, weights: &Weights<'_>) -> Result<(PathBuf, PathBuf), TrainError> {
        let folder = self.dir.join(format!("push-{}", self.pushes));
        if folder.exists() {
            std::fs::remove_dir_all(&folder)?;
        }
        std::fs::create_dir_all(&folder)?;
        let tensors = |vars: &[(String, candle_core::Var)]| {
            vars.iter()
                .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
                .collect::<Vec<_>>()
        };
        let path = match weights {
            Weights::Adapters {
                vars,
                adapter_config,
            } => {
                checkpoint::save_tensors(&folder.join("adapter_model.safetensors"), tensors(vars))?;
                let text = serde_json::to_string_pretty(adapter_config)
                    .map_err(|error| TrainError::Input(error.to_string()))?;
                std::fs::write(folder.join("adapter_config.json"), text)?;
                folder.clone()
            }
            Weights::Full(vars) => {
                let file = folder.join("model.safetensors");
                checkpoint::save_tensors(&file, tensors(vars))?;
                file
            }
        };
        if self.pushes > 0 && !self.versioned() {
            let previous = self.dir.join(format!("push-{}", self.pushes - 1));
            if previous.exists() {
                std::fs::remove_dir_all(previous)?;
            }
        }
        Ok((folder, path))
    }

    /// Asks server `index` to load `path`; the version it answers with, when it says.
    async fn load(
        &self,
        index: usize,
        path: &std::path::Path,
        step: u64,
    ) -> Result<Option<u64>, Failure> {
        let server = &self.servers[index];
        let path = path.display().to_string();
        let (route, body, what) = if self.lora {
            (
                "/v1/load_lora_adapter",
                json!({
                    "lora_name": server.model,
                    "lora_path": path,
                    // Also on the first push: a server that kept the adapter of an earlier run (or of
                    // this one before a resume) has the name loaded already.
                    "load_inplace": true,
                }),
                format!("loading step {step}'s adapter"),
            )
        } else {
            (
                "/update_weights_from_disk",
                json!({"model_path": path}),
                format!("loading step {step}'s weights"),
            )
        };
        let (status, version, answer) = self
            .request(&server.url, "POST", route, Some(body), &what)
            .await?;
        if status != 200 {
            return Err(Failure::Stop(TrainError::Source(format!(
                "weight sync: POST {}{route} ({what}) answered {status}: {answer}",
                server.url
            ))));
        }
        Ok(version)
    }

    /// Server `index`'s log-probabilities of the probe's tokens after the first, and the version it
    /// scored them with, when it says.
    async fn score(&self, index: usize, step: u64) -> Result<(Vec<f32>, Option<u64>), Failure> {
        let server = &self.servers[index];
        let body = json!({
            "model": server.model,
            "prompt": self.probe,
            "max_tokens": 0,
            "echo": true,
            "logprobs": 0,
            "temperature": 1.0,
        });
        let what = format!("scoring the probe after step {step}");
        let (status, version, answer) = self
            .request(&server.url, "POST", "/v1/completions", Some(body), &what)
            .await?;
        let logprobs = answer["choices"][0]["logprobs"]["token_logprobs"].as_array();
        let scored = match (status, logprobs) {
            (200, Some(logprobs)) if !logprobs.is_empty() => logprobs[1..]
                .iter()
                .map(|value| value.as_f64().map(|value| value as f32))
                .collect::<Option<Vec<f32>>>(),
            _ => None,
        };
        let scored = scored.ok_or_else(|| {
            Failure::Stop(TrainError::Source(format!(
                "weight sync: POST {}/v1/completions ({what}) answered {status} without the prompt's \
                 log-probabilities: {answer}",
                server.url
            )))
        })?;
        Ok((scored, version))
    }

    /// One request to a server, within the deadline: its status, its weight version header and its
    /// body (JSON, or a JSON string of a text answer). A connection refused, reset or cut short is
    /// retried until the deadline; then the server is [`Failure::Gone`].
    async fn request(
        &self,
        url: &str,
        method: &str,
        route: &str,
        body: Option<Value>,
        what: &str,
    ) -> Result<(u16, Option<u64>, Value), Failure> {
        let deadline = Instant::now() + self.options.timeout;
        let mut backoff = Duration::from_millis(50);
        let seconds = self.options.timeout.as_secs_f64();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut request = match method {
                "GET" => self.client.get(format!("{url}{route}")),
                _ => self.client.post(format!("{url}{route}")),
            }
            .timeout(left);
            if let Some(body) = &body {
                request = request
                    .header("content-type", "application/json")
                    .body(body.to_string());
            }
            let error = match request.send().await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let version = response
                        .headers()
                        .get("x-holo-weight-version")
                        .and_then(|value| value.to_str().ok()?.parse().ok());
                    match response.text().await {
                        Ok(text) => {
                            let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
                            return Ok((status, version, value));
                        }
                        Err(error) => error,
                    }
                }
                Err(error) => error,
            };
            if error.is_timeout() {
                return Err(Failure::Gone(format!(
                    "weight sync: {method} {url}{route} ({what}) got no answer within {seconds} s \
                     (`vllm_server_timeout`)"
                )));
            }
            if Instant::now() + backoff >= deadline {
                return Err(Failure::Gone(format!(
                    "weight sync: {url} is unreachable ({method} {route}, {what}, for {seconds} s): {error}"
                )));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, |max: f32, difference| {
            if max.is_nan() || difference.is_nan() {
                f32::NAN
            } else {
                max.max(difference)
            }
        })
}

/// Log-probabilities as a short list for an error message.
fn numbers(values: &[f32]) -> String {
    let shown: Vec<String> = values
        .iter()
        .take(6)
        .map(|value| format!("{value:.5}"))
        .collect();
    let more = if values.len() > 6 { ", …" } else { "" };
    format!("[{}{more}]", shown.join(", "))
}
