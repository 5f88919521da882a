//! The thread that owns the model: every operation that runs it (creating adapters, forward and backward
//! passes, optimizer steps, checkpoints, sampling) is a [`Job`] it takes in arrival order, so the HTTP
//! handlers never block on the model, and one training run's operations apply in the order its client
//! sent them (the SDK sends one at a time per training client).
//!
//! Training runs are LoRA adapters over the one base model (several at once: multi-tenant LoRA), each
//! with its AdamW and the gradients accumulated since its last `optim_step`.

use std::collections::HashMap;
use std::sync::mpsc;

use candle_core::{DType, Tensor, Var};
use prost::Message;
use serde_json::{json, Value};

use super::futures::{Category, Outcome, Promise};
use super::losses::LossFn;
use super::store::{CheckpointPath, Kind, RunInfo, Store};
use crate::tinker::proto;
use holo_model::generate::{generate, Stopping};
use holo_model::model::{LoraConfig, Targets};
use holo_model::{GenerationParams, Model, Ops};
use holo_train::batch::Sequence;
use holo_train::optim::{clip_coefficient, grad_norm, AdamSettings, AdamW};
use holo_train::run::Policy;
use holo_train::{pack, score};

/// One datum of `forward_backward`: the model reads `input` and position `i` predicts `targets[i]`;
/// `floats` are the loss's float inputs ([`LossFn::inputs`]), each aligned with the targets.
#[derive(Debug, Clone, PartialEq)]
pub struct Datum {
    pub input: Vec<u32>,
    pub targets: Vec<u32>,
    pub floats: Vec<Vec<f32>>,
}

/// AdamW's settings of one `optim_step` (the SDK's `AdamParams`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamParams {
    pub learning_rate: f64,
    pub settings: AdamSettings,
    /// 0: no clipping.
    pub grad_clip_norm: f64,
}

/// Where a sampler's weights come from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Weights {
    Base,
    Checkpoint(CheckpointPath),
    /// Weights a training client handed to a sampling session without a name (`save_weights_and_get_
    /// sampling_client`): kept in memory under the session's id.
    Snapshot(String),
}

/// How to end sampled sequences.
#[derive(Debug, Clone, PartialEq)]
pub enum Stop {
    /// The model's end-of-turn tokens (the SDK's `stop: None`).
    EndOfTurn,
    Strings(Vec<String>),
    /// These tokens only (`[]`: none, not even end of turn).
    Tokens(Vec<u32>),
}

/// A sampling request.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub weights: Weights,
    pub prompt: Vec<u32>,
    pub num_samples: usize,
    pub max_tokens: usize,
    pub temperature: f64,
    pub top_p: f64,
    /// 0: every token.
    pub top_k: usize,
    pub seed: Option<u64>,
    pub stop: Stop,
    pub prompt_logprobs: bool,
    /// Only the last this many prompt tokens are scored (the others get none), when given.
    pub prompt_logprobs_last_n: Option<usize>,
    /// The most likely tokens to report at each sampled position, with their log-probabilities (0: none).
    pub topk: usize,
}

pub enum Job {
    CreateModel {
        model_id: String,
        info: RunInfo,
    },
    ForwardBackward {
        model_id: String,
        data: Vec<Datum>,
        loss: LossFn,
        forward_only: bool,
    },
    OptimStep {
        model_id: String,
        params: AdamParams,
    },
    /// `save_weights` (a training state) or `save_weights_for_sampler`, by the path's kind.
    Save {
        model_id: String,
        path: CheckpointPath,
        overwrite: bool,
        ttl_seconds: Option<u64>,
    },
    /// `save_weights_for_sampler` without a name: the adapter as it is now, for one sampling session.
    Snapshot {
        model_id: String,
        session: String,
    },
    /// `load_weights` into `model_id`, created from the checkpoint's run first when `create`.
    Load {
        model_id: String,
        path: CheckpointPath,
        optimizer: bool,
        create: bool,
    },
    Unload {
        model_id: String,
    },
    Sample(Sample),
}

/// The model and what it runs.
pub struct Worker {
    base: Policy,
    store: Store,
    runs: HashMap<String, Run>,
    /// Sampling snapshots, the oldest first; at most [`SNAPSHOTS_KEPT`].
    snapshots: Vec<Snapshot>,
    /// Sampler models of checkpoints and snapshots, the most recently used last.
    samplers: Vec<(Weights, Model)>,
    /// The seed of the next sample that names none.
    next_seed: u64,
}

/// A sampling session's weights as they were when it was made: its session id, its run, the adapter.
type Snapshot = (String, RunInfo, Vec<(String, Tensor)>);

/// Sampler models kept ready at most.
const SAMPLERS_KEPT: usize = 4;

/// Snapshots (`save_weights_and_get_sampling_client`) kept in memory at most: a training loop makes one
/// per step and samples from the newest, so older ones are dropped rather than held until a restart.
pub const SNAPSHOTS_KEPT: usize = 16;

/// A training run: the base model with its adapter, the adapter's optimizer, and the gradients summed
/// over the `forward_backward` calls since the last `optim_step` (`None` where none flowed).
struct Run {
    info: RunInfo,
    model: Model,
    vars: Vec<(String, Var)>,
    optimizer: AdamW,
    grads: Vec<Option<Tensor>>,
}

type Failure = (String, Category);

fn user(message: impl Into<String>) -> Failure {
    (message.into(), Category::User)
}

fn server(error: impl std::fmt::Display) -> Failure {
    (error.to_string(), Category::Server)
}

/// A failure of the model's work on a request's data (a forward and backward pass, sampling): a device
/// out of memory is the request's to fix, category `user`, which the SDK raises at once as
/// `RequestFailedError` instead of sending again what cannot fit; anything else is the server's.
fn work(error: candle_core::Error) -> Failure {
    let message = error.to_string();
    match out_of_memory(&message) {
        true => user(format!(
            "out of memory on the device running this request ({message}): send fewer or shorter \
             sequences at once"
        )),
        false => server(message),
    }
}

/// Whether `message` is a device's failure to allocate: CUDA's `CUDA_ERROR_OUT_OF_MEMORY` ("out of
/// memory"), cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED`. (On the CPU an allocation that fails aborts the
/// process: the SDK then sees the server gone.)
fn out_of_memory(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    ["out of memory", "out_of_memory", "alloc_failed"]
        .iter()
        .any(|sign| message.contains(sign))
}

/// The seed sample `index` of a request seeded with `seed` draws: `holo serve`'s for its `n` samples, so
/// that a request's first sample draws what the in-process sampler and `holo serve` draw with that seed
/// (`holo train --backend tinker` then samples what `--backend local` does).
pub fn sample_seed(seed: u64, index: u64) -> u64 {
    use holo_core::loom::mix;
    match index {
        0 => seed,
        _ => mix(seed ^ mix(index)) & i64::MAX as u64,
    }
}

/// The LoRA configuration of a run's adapter.
pub fn lora_config(info: &RunInfo) -> LoraConfig {
    LoraConfig {
        rank: info.rank,
        alpha: info.alpha,
        targets: Targets::Names(info.targets.clone()),
        seed: info.seed,
        dropout: 0.0,
        // Tinker's LoRA config names no expert stacks.
        parameters: Vec::new(),
        ..Default::default()
    }
}

/// AdamW's defaults until the first `optim_step` sets its own (the SDK's `AdamParams` defaults).
const SDK_ADAM: AdamSettings = AdamSettings {
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-12,
    weight_decay: 0.0,
};

impl Worker {
    pub fn new(base: Policy, store: Store, seed: u64) -> Self {
        Worker {
            base,
            store,
            runs: HashMap::new(),
            snapshots: Vec::new(),
            samplers: Vec::new(),
            next_seed: seed,
        }
    }

    /// Runs jobs until every sender is gone.
    pub fn serve(mut self, jobs: mpsc::Receiver<(Job, Promise)>) {
        for (job, promise) in jobs {
            let outcome = match self.run(job) {
                Ok(outcome) => outcome,
                Err((error, category)) => {
                    if out_of_memory(&error) {
                        // The sampler models kept ready are the memory that can go: they are built
                        // again from their weights when next asked for.
                        self.samplers.clear();
                    }
                    Outcome::Failed { error, category }
                }
            };
            promise.fulfil(outcome);
        }
    }

    fn run(&mut self, job: Job) -> Result<Outcome, Failure> {
        match job {
            Job::CreateModel { model_id, info } => {
                self.store.create_run(&model_id, &info).map_err(server)?;
                let run = self.new_run(&info)?;
                self.runs.insert(model_id.clone(), run);
                Ok(Outcome::Json(
                    json!({"model_id": model_id, "type": "create_model"}),
                ))
            }
            Job::ForwardBackward {
                model_id,
                data,
                loss,
                forward_only,
            } => {
                let run = self
                    .runs
                    .get_mut(&model_id)
                    .ok_or_else(|| unknown(&model_id))?;
                let output = forward_backward(run, &data, loss, forward_only).map_err(work)?;
                Ok(Outcome::Proto(output.encode_to_vec()))
            }
            Job::OptimStep { model_id, params } => {
                let run = self
                    .runs
                    .get_mut(&model_id)
                    .ok_or_else(|| unknown(&model_id))?;
                let norm = grad_norm(&run.grads).map_err(server)?;
                let scale = clip_coefficient(norm, params.grad_clip_norm);
                run.optimizer.set_settings(params.settings);
                run.optimizer
                    .step(&run.grads, params.learning_rate, scale)
                    .map_err(server)?;
                run.grads = vec![None; run.vars.len()];
                Ok(Outcome::Json(json!({"metrics": {
                    "grad_norm": norm,
                    "learning_rate": params.learning_rate,
                }})))
            }
            Job::Save {
                model_id,
                path,
                overwrite,
                ttl_seconds,
            } => {
                let run = self.runs.get(&model_id).ok_or_else(|| unknown(&model_id))?;
                let adapter = snapshot(&run.vars).map_err(server)?;
                let optimizer = match path.kind {
                    Kind::Weights => Some((
                        run.optimizer.step,
                        run.optimizer
                            .state()
                            .into_iter()
                            .map(|(name, state)| Ok((name, state.to_tensor()?)))
                            .collect::<candle_core::Result<Vec<_>>>()
                            .map_err(server)?,
                    )),
                    Kind::Sampler => None,
                };
                self.store
                    .save(&path, adapter, optimizer, overwrite, ttl_seconds)
                    .map_err(|error| match error.kind() {
                        std::io::ErrorKind::AlreadyExists => user(error.to_string()),
                        _ => server(error),
                    })?;
                let kind = match path.kind {
                    Kind::Weights => "save_weights",
                    Kind::Sampler => "save_weights_for_sampler",
                };
                // A checkpoint saved again under its name must not be sampled from a stale model.
                self.samplers
                    .retain(|(weights, _)| *weights != Weights::Checkpoint(path.clone()));
                Ok(Outcome::Json(json!({"path": path.uri(), "type": kind})))
            }
            Job::Snapshot { model_id, session } => {
                let run = self.runs.get(&model_id).ok_or_else(|| unknown(&model_id))?;
                let adapter = snapshot(&run.vars).map_err(server)?;
                let info = run.info.clone();
                self.keep_snapshot(session.clone(), info, adapter);
                Ok(Outcome::Json(json!({
                    "path": null,
                    "sampling_session_id": session,
                    "type": "save_weights_for_sampler",
                })))
            }
            Job::Load {
                model_id,
                path,
                optimizer,
                create,
            } => {
                if create {
                    let info = self.store.run_info(&path.run).map_err(user)?;
                    self.store.create_run(&model_id, &info).map_err(server)?;
                    let run = self.new_run(&info)?;
                    self.runs.insert(model_id.clone(), run);
                }
                let device = self.base.model.device().clone();
                let loaded = self.store.load(&path, &device).map_err(user)?;
                let run = self
                    .runs
                    .get_mut(&model_id)
                    .ok_or_else(|| unknown(&model_id))?;
                holo_train::checkpoint::restore(&run.vars, &loaded.adapter).map_err(user)?;
                if optimizer {
                    let (step, moments) = loaded.optimizer.ok_or_else(|| {
                        user(format!(
                            "{} holds no optimizer state (a sampler checkpoint)",
                            path.uri()
                        ))
                    })?;
                    run.optimizer
                        .load_state(step, &moments)
                        .map_err(|error| user(format!("{}: {error}", path.uri())))?;
                }
                run.grads = vec![None; run.vars.len()];
                Ok(Outcome::Json(json!({
                    "path": path.uri(),
                    "model_id": model_id,
                    "type": "load_weights",
                })))
            }
            Job::Unload { model_id } => {
                self.runs
                    .remove(&model_id)
                    .ok_or_else(|| unknown(&model_id))?;
                Ok(Outcome::Json(
                    json!({"model_id": model_id, "type": "unload_model"}),
                ))
            }
            Job::Sample(sample) => {
                let response = self.sample(&sample)?;
                Ok(Outcome::Proto(response.encode_to_vec()))
            }
        }
    }

    fn new_run(&self, info: &RunInfo) -> Result<Run, Failure> {
        let (model, vars) = self
            .base
            .model
            .with_lora(&lora_config(info))
            .map_err(|error| user(format!("lora_config: {error}")))?;
        let optimizer = AdamW::with_settings(vars.clone(), SDK_ADAM);
        let grads = vec![None; vars.len()];
        Ok(Run {
            info: info.clone(),
            model,
            vars,
            optimizer,
            grads,
        })
    }

    /// The model that samples `weights`, built (and kept) on first use.
    fn sampler(&mut self, weights: &Weights) -> Result<Model, Failure> {
        if *weights == Weights::Base {
            return Ok(self.base.model.detached());
        }
        if let Some(index) = self.samplers.iter().position(|(w, _)| w == weights) {
            let entry = self.samplers.remove(index);
            let model = entry.1.clone();
            self.samplers.push(entry);
            return Ok(model);
        }
        let device = self.base.model.device().clone();
        let (info, adapter): (RunInfo, HashMap<String, Tensor>) = match weights {
            Weights::Base => unreachable!("answered above"),
            Weights::Checkpoint(path) => {
                let info = self.store.run_info(&path.run).map_err(user)?;
                (info, self.store.load(path, &device).map_err(user)?.adapter)
            }
            Weights::Snapshot(session) => {
                let (_, info, adapter) = self
                    .snapshots
                    .iter()
                    .find(|(kept, ..)| kept == session)
                    .ok_or_else(|| {
                        user(format!(
                            "sampling session `{session}` has no weights: the server keeps the \
                             {SNAPSHOTS_KEPT} most recent snapshots in memory (save_weights_for_sampler \
                             with a name keeps weights on disk)"
                        ))
                    })?;
                (info.clone(), adapter.iter().cloned().collect())
            }
        };
        let (model, vars) = self
            .base
            .model
            .with_lora(&lora_config(&info))
            .map_err(server)?;
        holo_train::checkpoint::restore(&vars, &adapter).map_err(user)?;
        let model = model.detached();
        self.samplers.push((weights.clone(), model.clone()));
        if self.samplers.len() > SAMPLERS_KEPT {
            self.samplers.remove(0);
        }
        Ok(model)
    }

    /// Keeps a session's snapshot, dropping the oldest beyond [`SNAPSHOTS_KEPT`] (and its sampler).
    fn keep_snapshot(&mut self, session: String, info: RunInfo, adapter: Vec<(String, Tensor)>) {
        self.snapshots.retain(|(kept, ..)| *kept != session);
        self.snapshots.push((session, info, adapter));
        while self.snapshots.len() > SNAPSHOTS_KEPT {
            let (dropped, ..) = self.snapshots.remove(0);
            self.samplers
                .retain(|(weights, _)| *weights != Weights::Snapshot(dropped.clone()));
        }
    }

    fn sample(&mut self, sample: &Sample) -> Result<proto::SampleResponse, Failure> {
        let model = self.sampler(&sample.weights)?;
        let (eos, stop_token_ids, stop) = match &sample.stop {
            Stop::EndOfTurn => (self.base.end_of_turn.clone(), Vec::new(), Vec::new()),
            Stop::Strings(strings) => (self.base.end_of_turn.clone(), Vec::new(), strings.clone()),
            Stop::Tokens(tokens) => (Vec::new(), tokens.clone(), Vec::new()),
        };
        let seed = match sample.seed {
            Some(seed) => seed,
            None => {
                self.next_seed = self.next_seed.wrapping_add(1);
                holo_core::loom::mix(self.next_seed)
            }
        };
        let params: Vec<GenerationParams> = (0..sample.num_samples)
            .map(|index| GenerationParams {
                max_tokens: sample.max_tokens,
                temperature: sample.temperature,
                top_p: sample.top_p,
                top_k: sample.top_k,
                stop: stop.clone(),
                seed: sample_seed(seed, index as u64),
                stop_token_ids: stop_token_ids.clone(),
                top_logprobs: sample.topk,
                ..GenerationParams::default()
            })
            .collect();
        let prompts = vec![sample.prompt.clone(); sample.num_samples];
        let stopping = Stopping {
            eos: &eos,
            tokenizer: &self.base.tokenizer,
        };
        let generations = generate(&model, &stopping, &prompts, &params, None).map_err(work)?;
        let sequences = generations
            .into_iter()
            .map(|generation| proto::SampledSequence {
                stop_reason: match generation.finish {
                    holo_core::machine::Finish::Length => proto::StopReason::Length,
                    _ => proto::StopReason::Stop,
                } as i32,
                tokens: generation
                    .tokens
                    .iter()
                    .flat_map(|&token| (token as i32).to_le_bytes())
                    .collect(),
                logprobs: Some(f32_bytes(&generation.logprobs)),
                topk_sampled_logprobs: (sample.topk > 0)
                    .then(|| topk_matrices(&generation.top_logprobs, sample.topk)),
            })
            .collect();
        let prompt_logprobs = if sample.prompt_logprobs {
            let sequence = Sequence {
                ids: sample.prompt.clone(),
                trained: (1..sample.prompt.len()).collect(),
                sampling_logprobs: vec![f32::NAN; sample.prompt.len() - 1],
                routes: None,
                constraints: Default::default(),
            };
            let scored = score::sequence_logprobs(&model, &[&sequence], 1.0, 1).map_err(work)?;
            let mut values = vec![f32::NAN];
            values.extend(scored.into_iter().flatten());
            if let Some(last) = sample.prompt_logprobs_last_n {
                let unscored = values.len().saturating_sub(last);
                values[..unscored].fill(f32::NAN);
            }
            Some(f32_bytes(&values))
        } else {
            None
        };
        Ok(proto::SampleResponse {
            sequences,
            prompt_logprobs,
            ..Default::default()
        })
    }
}

fn unknown(model_id: &str) -> Failure {
    user(format!(
        "model_id: no model `{model_id}` on this server (created by create_model or load_weights, \
         gone after unload_model or a restart)"
    ))
}

/// Copies of the adapter's tensors as they are now.
fn snapshot(vars: &[(String, Var)]) -> candle_core::Result<Vec<(String, Tensor)>> {
    vars.iter()
        .map(|(name, var)| Ok((name.clone(), var.as_tensor().copy()?)))
        .collect()
}

/// Per position the `k` most likely tokens and their log-probabilities, as the SDK's `TopkLogprobs`
/// reads them: `[length, k]` int32 and float32 matrices, a position with fewer than `k` filled with its
/// sentinel (token 0, log-probability −99999).
fn topk_matrices(positions: &[Vec<(u32, f32)>], k: usize) -> proto::TopkLogprobs {
    let (mut token_ids, mut logprobs) = (Vec::new(), Vec::new());
    for position in positions {
        for index in 0..k {
            let (token, logprob) = position.get(index).copied().unwrap_or((0, -99999.0));
            token_ids.extend((token as i32).to_le_bytes());
            logprobs.extend(logprob.to_le_bytes());
        }
    }
    proto::TopkLogprobs {
        token_ids,
        logprobs,
        k: k as u32,
        length: positions.len() as u32,
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

/// Per-datum float outputs as the SDK reads them: one `BatchedTensor` of every datum's values and the
/// byte offsets between datums.
fn batched(values: &[Vec<f32>]) -> proto::BatchedTensor {
    let mut offsets = vec![0i64];
    let mut data = Vec::new();
    for datum in values {
        data.extend(f32_bytes(datum));
        offsets.push(data.len() as i64);
    }
    proto::BatchedTensor {
        data,
        offsets: offsets.iter().flat_map(|o| o.to_le_bytes()).collect(),
        dtype: proto::DType::DtypeFloat32 as i32,
        trailing_shape: Vec::new(),
    }
}

/// The loss of `data` under `run`'s model, its per-token outputs and (unless `forward_only`) its
/// gradients added to the run's.
fn forward_backward(
    run: &mut Run,
    data: &[Datum],
    loss: LossFn,
    forward_only: bool,
) -> candle_core::Result<proto::ForwardBackwardOutput> {
    let model = if forward_only {
        run.model.detached()
    } else {
        run.model.clone()
    };
    let device = model.device().clone();
    // Position i of a datum predicts targets[i]: a sequence of the input and its last target, every
    // position after the first trained; the packed targets are then replaced by the datum's own, which
    // need not be the next input token.
    let sequences: Vec<Sequence> = data
        .iter()
        .map(|datum| {
            let mut ids = datum.input.clone();
            ids.push(*datum.targets.last().expect("datums are not empty"));
            Sequence {
                ids,
                trained: (1..=datum.input.len()).collect(),
                sampling_logprobs: vec![f32::NAN; datum.input.len()],
                routes: None,
                constraints: Default::default(),
            }
        })
        .collect();
    let refs: Vec<&Sequence> = sequences.iter().collect();
    let mut packed = pack::pack(&refs, &model)?;
    let targets: Vec<u32> = data
        .iter()
        .flat_map(|d| d.targets.iter().copied())
        .collect();
    packed.targets = Tensor::new(targets, &device)?;
    let hidden = score::final_hidden(&model, &packed, Ops::Differentiable)?;
    let head = score::head(&model, &hidden, &packed, 1.0, false)?;
    let logprobs = head.logprobs.to_dtype(DType::F32)?;
    let inputs = (0..loss.inputs().len())
        .map(|index| {
            let flat: Vec<f32> = data
                .iter()
                .flat_map(|d| d.floats[index].iter().copied())
                .collect();
            Tensor::new(flat, &device)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let per_token = loss.per_token(&logprobs, &inputs)?;
    let total = per_token.sum_all()?;
    // The new sums of the gradients are kept only once the whole answer is made: a failure on the way
    // (memory) leaves the run's gradients as they were, so the client can send the batch again in parts.
    let sums = match forward_only {
        true => None,
        false => {
            let grads = total.backward()?;
            let sums = run.vars.iter().zip(&run.grads).map(|((_, var), sum)| {
                match (grads.get(var.as_tensor()), sum) {
                    (Some(grad), Some(previous)) => Ok(Some((previous + grad)?)),
                    (Some(grad), None) => Ok(Some(grad.clone())),
                    (None, previous) => Ok(previous.clone()),
                }
            });
            Some(sums.collect::<candle_core::Result<Vec<_>>>()?)
        }
    };
    let split = |flat: Vec<f32>| -> Vec<Vec<f32>> {
        let mut rest = flat.as_slice();
        data.iter()
            .map(|datum| {
                let (head, tail) = rest.split_at(datum.targets.len());
                rest = tail;
                head.to_vec()
            })
            .collect()
    };
    let record = proto::ArrayRecord {
        type_tag: "ArrayRecord".into(),
        fields: [
            ("logprobs".to_string(), batched(&split(logprobs.to_vec1()?))),
            (
                "elementwise_loss".to_string(),
                batched(&split(per_token.detach().to_vec1()?)),
            ),
        ]
        .into(),
        num_datums: data.len() as i64,
    };
    let loss_sum = f64::from(total.to_dtype(DType::F32)?.to_scalar::<f32>()?);
    if let Some(sums) = sums {
        run.grads = sums;
    }
    Ok(proto::ForwardBackwardOutput {
        loss_fn_output_type: "ArrayRecord".into(),
        loss_fn_outputs: vec![record],
        metrics: [("loss:sum".to_string(), loss_sum)].into(),
    })
}

/// What a `get_info` says of a run's model (JSON, the SDK's `GetInfoResponse`).
pub fn model_info(model_id: &str, info: &RunInfo, arch: &str) -> Value {
    json!({
        "type": "get_info",
        "model_id": model_id,
        "model_data": {
            "arch": arch,
            "model_name": info.base_model,
            "tokenizer_id": info.base_model,
        },
        "is_lora": true,
        "lora_rank": info.rank,
        "model_name": info.base_model,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device out of memory is the request's to fix (`user`: the SDK raises it rather than send the
    /// same batch again), named as such; other failures of the work are the server's.
    #[test]
    fn out_of_memory_is_the_requests_to_fix() {
        let cuda = candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        );
        let (message, category) = work(cuda);
        assert_eq!(category, Category::User);
        assert!(
            message.starts_with("out of memory on the device"),
            "{message}"
        );
        let cublas = candle_core::Error::Msg("cublas error: CUBLAS_STATUS_ALLOC_FAILED".into());
        assert_eq!(work(cublas).1, Category::User);
        let other = candle_core::Error::Msg("shape mismatch in matmul".into());
        assert_eq!(
            work(other),
            ("shape mismatch in matmul".into(), Category::Server)
        );
    }
}
