//! Hugging Face Qwen2 and Llama checkpoints in process, on candle.
//!
//! [`LocalModel::load`] reads a model folder (see [`files`]) or a GGUF file (see [`gguf`]); the
//! model implements [`Sampler`], so the Loom, `holo eval` and `holo serve` drive it like any other
//! sampler, batched.
//! [`model::Model`] is the network itself, with a differentiable forward for training.
//!
//! A program that runs these models should call [`threads::settle`] first thing in `main`: without
//! `RAYON_NUM_THREADS`, candle reads `/proc/cpuinfo` at every matrix product.

mod backward;
pub mod balance;
pub mod config;
mod constrain;
pub mod dispatch;
mod draw;
mod error;
pub mod files;
pub mod generate;
pub mod gguf;
pub mod init;
mod kernels;
pub mod layout;
pub mod model;
pub mod mxfp4;
pub mod peft;
mod recompute;
mod routing;
pub mod sample;
pub mod schedule;
#[doc(hidden)]
pub mod testing;
pub mod threads;
pub mod update;

pub use kernels::head;
pub use kernels::mxfp4::Mxfp4Matrix;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Device};
use tokenizers::Tokenizer;

pub use config::{
    Activation, Arch, ClampedSwiGlu, ConfigError, Experts, LayerSpec, LinearAttention, ModelConfig,
    NormPlacement, QkNorm, RopeScaling, Variant,
};
pub use constrain::{Grammar, Grammars};
pub use files::LoadError;
pub use layout::Layout;
pub use model::{Model, Ops};
pub use sample::{Generation, GenerationParams, PrefixCache};
pub use schedule::{Limits, SchedulerStats};

use holo_core::chat::{ChatTemplate, RenderOptions};
use holo_core::machine::Completion;
use holo_core::sampler::{Prompt, Request, SampleFuture, Sampler, SamplerError, TokenSink};

/// How a local model samples when a request leaves something unset.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    pub device: Device,
    /// Weight precision; `BF16` on the CPU keeps the matrices in bf16 and computes in f32.
    pub dtype: DType,
    /// `max_tokens` for requests that give none.
    pub default_max_tokens: usize,
    /// How many sequences decode together, how many tokens a prefill step runs, and the cache budget
    /// for admitting more (see [`schedule`]).
    pub limits: Limits,
    /// Sequences queued (not admitted yet) beyond which a new call is refused with
    /// [`SamplerError::Overloaded`] (one is always queued when nothing waits).
    pub max_waiting: usize,
    /// Seeds requests without one: request `n` of this model gets `seed + n`.
    pub seed: u64,
    /// Tokens of earlier sequences kept so that a prompt extending one (the next turn of a multi-turn
    /// rollout) only runs its new tokens; 0 turns the prefix cache off. Memory per token: layers × 2 ×
    /// kv_heads × head_dim × 4 bytes (24.6 KB for Qwen2.5-0.5B).
    pub prefix_cache_tokens: usize,
    /// Record the experts a mixture-of-experts model routes every token through, with each completion
    /// ([`Completion::routes`]), for routing replay in training.
    pub record_routes: bool,
    /// Keep a GGUF file's quantized projections as its blocks ([`gguf::Blocks::Keep`]) when the model
    /// runs on the CPU: decoding reads the blocks' bytes instead of `dtype`'s, faster at one sequence
    /// and slower from eight (candle's products of several rows of blocks; `benches/README.md`). Off (the
    /// default), or on another device, every tensor is dequantized to `dtype`. No effect on a model folder.
    pub quantized: bool,
}

impl Default for LocalOptions {
    fn default() -> Self {
        LocalOptions {
            device: Device::Cpu,
            dtype: DType::F32,
            default_max_tokens: 256,
            limits: Limits::default(),
            max_waiting: 4096,
            seed: 0,
            prefix_cache_tokens: 16_384,
            record_routes: false,
            quantized: false,
        }
    }
}

impl LocalOptions {
    /// Whether these options can run: batch-invariant sampling ([`Limits::batch_invariant`]) needs the
    /// CPU and f32 or bf16 weights.
    pub fn check(&self) -> Result<(), String> {
        if self.limits.batch_invariant
            && (!self.device.is_cpu() || !matches!(self.dtype, DType::F32 | DType::BF16))
        {
            return Err(format!(
                "batch-invariant sampling runs on the CPU with f32 or bf16 weights, not {:?} on {:?}",
                self.dtype,
                self.device.location()
            ));
        }
        Ok(())
    }
}

/// A device named as the CLI takes it: `cpu`, `cuda`, `cuda:N`, `metal`, `metal:N`. A GPU is opened
/// here, so that a build without its feature, or a machine without that device, is told before any work
/// starts.
pub fn parse_device(name: &str) -> Result<Device, String> {
    let (kind, ordinal) = match name.split_once(':') {
        Some((kind, ordinal)) => (
            kind,
            ordinal
                .parse::<usize>()
                .map_err(|_| format!("device {name:?}: {ordinal:?} is not a device number"))?,
        ),
        None => (name, 0),
    };
    let device = match kind {
        "cpu" if ordinal == 0 => Ok(Device::Cpu),
        "cuda" => open_cuda(ordinal),
        "metal" => open_metal(ordinal),
        _ => {
            return Err(format!(
                "unknown device {name:?}: cpu, cuda, cuda:N, metal or metal:N"
            ))
        }
    };
    device.map_err(|error| format!("device {name:?}: {error}"))
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device, String> {
    Device::new_cuda(ordinal).map_err(|error| {
        // The driver's error, without the backtrace candle appends when RUST_BACKTRACE is set.
        let error = error.to_string();
        let cause = error.lines().next().unwrap_or_default();
        format!("cannot open CUDA device {ordinal} (is there an NVIDIA GPU with that number, and its driver?): {cause}")
    })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize) -> Result<Device, String> {
    Err(
        "this holo was built without CUDA; build it with `--features cuda` (scripts/cuda-build.sh, docs/cuda.md)"
            .into(),
    )
}

#[cfg(feature = "metal")]
fn open_metal(ordinal: usize) -> Result<Device, String> {
    Device::new_metal(ordinal)
        .map_err(|error| format!("cannot open Metal device {ordinal}: {error}"))
}

#[cfg(not(feature = "metal"))]
fn open_metal(_ordinal: usize) -> Result<Device, String> {
    Err("this holo was built without Metal; build it with `--features metal`".into())
}

/// A weight precision named as the CLI takes it: `f32`, `f16`, `bf16`, or none for the device's own
/// ([`dispatch::sampling_dtype`]: bf16 on CUDA, f32 elsewhere). On the CPU, `bf16` keeps the matrices in
/// bf16 and computes in f32 (half the memory, up to twice the decoding speed; sampling only), and `f16`
/// is slower than `f32` (candle has no native f16 arithmetic there).
pub fn parse_dtype(name: Option<&str>, device: &Device) -> Result<DType, String> {
    match name {
        None => Ok(dispatch::sampling_dtype(device.location())),
        Some("f32") => Ok(DType::F32),
        Some("f16") => Ok(DType::F16),
        Some("bf16") => Ok(DType::BF16),
        Some(name) => Err(format!("unknown dtype {name:?}: f32, f16 or bf16")),
    }
}

/// A training precision named as `holo train --dtype` takes it: `f32`, `bf16`, or none for the
/// device's own ([`dispatch::training_dtype`]: bf16 on CUDA, f32 elsewhere). f16 is refused: its range
/// needs loss scaling, which the trainers do not do. So is bf16 on the CPU, where a bf16 model samples
/// with f32 arithmetic and does not train.
pub fn parse_training_dtype(name: Option<&str>, device: &Device) -> Result<DType, String> {
    match name {
        None => Ok(dispatch::training_dtype(device.location())),
        Some("f32") => Ok(DType::F32),
        Some("bf16") if device.is_cpu() => Err(
            "--dtype bf16: the CPU trains in f32 (bf16 training is for CUDA; docs/cuda.md, \"Precision\")"
                .into(),
        ),
        Some("bf16") => Ok(DType::BF16),
        Some("f16") => Err(
            "--dtype f16: training in f16 needs loss scaling, which holo does not do; use bf16 or f32"
                .into(),
        ),
        Some(name) => Err(format!("unknown --dtype {name:?}: f32 or bf16")),
    }
}

/// [`Inner::weight_version`] before any is set.
const UNVERSIONED: u64 = u64::MAX;

/// What the scheduler's thread shares with the model's handles.
struct Core {
    model: Model,
    /// Shared with [`LocalModel::with_model`]'s copies: at a real vocabulary a tokenizer is tens of MiB.
    tokenizer: Arc<Tokenizer>,
    end_of_turn: Vec<u32>,
    prefix: PrefixCache,
}

struct Inner {
    core: Arc<Core>,
    template: ChatTemplate,
    grammars: Grammars,
    options: LocalOptions,
    unseeded: AtomicU64,
    /// [`LocalModel::set_weight_version`]'s, [`UNVERSIONED`] until set.
    weight_version: AtomicU64,
    /// Started by the first sample.
    scheduler: OnceLock<schedule::Scheduler>,
}

/// A model folder loaded for sampling. Cheap to clone; clones share the weights.
#[derive(Clone)]
pub struct LocalModel {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for LocalModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalModel")
            .field("config", &self.inner.core.model.config)
            .field("end_of_turn", &self.inner.core.end_of_turn)
            .finish_non_exhaustive()
    }
}

impl LocalModel {
    pub fn load(dir: impl AsRef<Path>, options: LocalOptions) -> Result<Self, LoadError> {
        let dir = dir.as_ref();
        let model = if options.quantized && options.device.is_cpu() && gguf::is_gguf(dir) {
            if options.limits.batch_invariant {
                return Err(LoadError::Config(config::ConfigError(format!(
                    "{}: batch-invariant sampling multiplies dense weights row by row; load the GGUF \
                     file dequantized (without `--quantized`)",
                    dir.display()
                ))));
            }
            gguf::load_quantized(dir, options.dtype, &options.device)?
        } else {
            files::load_model(dir, options.dtype, &options.device)?
        };
        let tokenizer = files::load_tokenizer(dir)?;
        let template = files::load_template(dir)?;
        let end_of_turn = files::end_of_turn_ids(dir, &model.config, &tokenizer, &template)?;
        Ok(Self::new(model, tokenizer, template, end_of_turn, options))
    }

    /// A sampler over an already built model (for instance the detached policy of a trainer).
    pub fn new(
        model: Model,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        end_of_turn: Vec<u32>,
        options: LocalOptions,
    ) -> Self {
        let grammars = Grammars::new(
            tokenizer.clone(),
            model.config.vocab_size,
            end_of_turn.clone(),
        );
        Self::assembled(
            model,
            Arc::new(tokenizer),
            template,
            end_of_turn,
            grammars,
            options,
        )
    }

    /// A sampler of `model` (this one's architecture with other weights: a trainer's
    /// [`Model::snapshot`]) within `limits`, sharing this one's tokenizer, template, end-of-turn tokens,
    /// grammars and other options, with a scheduler and an empty prefix cache of its own, so that no key
    /// or value cached under other weights is ever read; unversioned until
    /// [`LocalModel::set_weight_version`].
    pub fn with_model(&self, model: Model, limits: Limits) -> LocalModel {
        let core = &self.inner.core;
        Self::assembled(
            model,
            Arc::clone(&core.tokenizer),
            self.inner.template.clone(),
            core.end_of_turn.clone(),
            self.inner.grammars.clone(),
            LocalOptions {
                limits,
                ..self.inner.options.clone()
            },
        )
    }

    /// The scheduler's limits.
    pub fn limits(&self) -> Limits {
        self.inner.options.limits
    }

    fn assembled(
        model: Model,
        tokenizer: Arc<Tokenizer>,
        template: ChatTemplate,
        end_of_turn: Vec<u32>,
        grammars: Grammars,
        options: LocalOptions,
    ) -> Self {
        LocalModel {
            inner: Arc::new(Inner {
                grammars,
                core: Arc::new(Core {
                    model,
                    tokenizer,
                    end_of_turn,
                    prefix: PrefixCache::new(options.prefix_cache_tokens),
                }),
                template,
                options,
                unseeded: AtomicU64::new(0),
                weight_version: AtomicU64::new(UNVERSIONED),
                scheduler: OnceLock::new(),
            }),
        }
    }

    pub fn model(&self) -> &Model {
        &self.inner.core.model
    }

    /// Marks what this model samples from now on with `version` ([`Completion::weight_version`]): a
    /// trainer whose in-process sampler shares the trained weights sets its count of optimizer steps
    /// after each one, so that every rollout says which weights sampled it.
    pub fn set_weight_version(&self, version: u64) {
        self.inner.weight_version.store(version, Ordering::Relaxed);
    }

    /// The version set by [`LocalModel::set_weight_version`], if any.
    pub fn weight_version(&self) -> Option<u64> {
        match self.inner.weight_version.load(Ordering::Relaxed) {
            UNVERSIONED => None,
            version => Some(version),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.inner.core.model.config
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner.core.tokenizer
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.inner.template
    }

    /// Earlier sequences kept for prompts that extend them (see [`LocalOptions::prefix_cache_tokens`]);
    /// clear it after changing the weights.
    pub fn prefix_cache(&self) -> &PrefixCache {
        &self.inner.core.prefix
    }

    /// Token ids that end the model's turn.
    pub fn end_of_turn(&self) -> &[u32] {
        &self.inner.core.end_of_turn
    }

    /// What compiles this model's [`Constraint`](holo_core::Constraint)s (shared with the sampler, so a
    /// server can check a request's constraint before sampling it).
    pub fn grammars(&self) -> &Grammars {
        &self.inner.grammars
    }

    /// The token ids a prompt stands for: text is tokenized as a completion prompt (special tokens the
    /// tokenizer adds, such as BOS, included), a chat is rendered with the model's template and its
    /// generation prompt.
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, SamplerError> {
        self.ids_of(prompt, None)
    }

    /// The token ids a request samples from: [`LocalModel::prompt_ids`], a chat rendered with the
    /// request's [`SampleParams::chat_template_kwargs`](holo_core::SampleParams) (refused with other
    /// prompts, which are rendered already).
    pub fn request_ids(&self, request: &Request) -> Result<Vec<u32>, SamplerError> {
        self.ids_of(
            &request.prompt,
            request.params.chat_template_kwargs.as_ref(),
        )
    }

    fn ids_of(
        &self,
        prompt: &Prompt,
        kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<Vec<u32>, SamplerError> {
        let encode = |text: &str, special: bool| {
            self.inner
                .core
                .tokenizer
                .encode(text, special)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|error| {
                    SamplerError::Rejected(format!("cannot tokenize the prompt: {error}"))
                })
        };
        let ids = match prompt {
            Prompt::Chat(messages) => {
                let options = RenderOptions {
                    variables: match kwargs {
                        Some(kwargs) => holo_core::chat::template_kwargs(
                            &serde_json::Value::Object(kwargs.clone()),
                        )
                        .map_err(SamplerError::Rejected)?,
                        None => Default::default(),
                    },
                    ..RenderOptions::generation()
                };
                let text = self
                    .inner
                    .template
                    .render(messages, &options)
                    .map_err(|error| SamplerError::Rejected(error.to_string()))?;
                encode(&text, false)?
            }
            _ if kwargs.is_some() => return Err(SamplerError::Rejected(
                "chat template arguments come with chat prompts only: a token or text prompt is \
                     rendered already"
                    .into(),
            )),
            Prompt::Tokens(ids) => ids.clone(),
            Prompt::Text(text) => encode(text, true)?,
        };
        let vocab = self.config().vocab_size as u32;
        if let Some(bad) = ids.iter().find(|&&id| id >= vocab) {
            return Err(SamplerError::Rejected(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            )));
        }
        if ids.is_empty() {
            return match self.config().bos_token_id {
                Some(bos) => Ok(vec![bos]),
                None => Err(SamplerError::Rejected(
                    "empty prompt, and the model has no BOS token to start from".into(),
                )),
            };
        }
        Ok(ids)
    }

    fn params(
        &self,
        request: &Request,
        prompt_len: usize,
    ) -> Result<GenerationParams, SamplerError> {
        let params = &request.params;
        let context = self.config().max_position_embeddings;
        if prompt_len >= context {
            return Err(SamplerError::Rejected(format!(
                "the prompt has {prompt_len} tokens; the model's context is {context}"
            )));
        }
        let requested = params
            .max_tokens
            .map_or(self.inner.options.default_max_tokens, |n| n as usize);
        let temperature = params.temperature.unwrap_or(1.0);
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(SamplerError::Rejected(format!(
                "temperature must be finite and at least 0, got {temperature}"
            )));
        }
        let top_p = params.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(SamplerError::Rejected(format!(
                "top_p must be in (0, 1], got {top_p}"
            )));
        }
        let seed = params.seed.unwrap_or_else(|| {
            self.inner
                .options
                .seed
                .wrapping_add(self.inner.unseeded.fetch_add(1, Ordering::Relaxed))
        });
        let vocab = self.config().vocab_size;
        let outside = params
            .logit_bias
            .iter()
            .map(|(token, _)| token)
            .chain(&params.stop_token_ids)
            .find(|&&token| token as usize >= vocab);
        if let Some(token) = outside {
            return Err(SamplerError::Rejected(format!(
                "token id {token} is outside the vocabulary (size {vocab})"
            )));
        }
        let constraint = match &params.constraint {
            None => None,
            Some(constraint) => Some(self.inner.grammars.compile(constraint).map_err(|error| {
                SamplerError::Rejected(format!("cannot compile {}: {error}", constraint.kind()))
            })?),
        };
        Ok(GenerationParams {
            max_tokens: requested.min(context - prompt_len),
            temperature,
            top_p,
            top_k: params.top_k.unwrap_or(0) as usize,
            stop: params.stop.clone(),
            seed,
            top_logprobs: params.top_logprobs as usize,
            constraint,
            logit_bias: params.logit_bias.clone(),
            min_tokens: params.min_tokens as usize,
            stop_token_ids: params.stop_token_ids.clone(),
            ignore_eos: params.ignore_eos,
            record_routes: self.inner.options.record_routes && self.config().experts.is_some(),
            prompt_logprobs: params.prompt_logprobs.map(|k| k as usize),
        })
    }

    /// What the scheduler is doing (queue, batch, cache); zeros before the first sample.
    pub fn scheduler_stats(&self) -> Arc<SchedulerStats> {
        Arc::clone(self.scheduler().stats())
    }

    fn scheduler(&self) -> &schedule::Scheduler {
        self.inner.scheduler.get_or_init(|| {
            schedule::Scheduler::start(
                Arc::clone(&self.inner.core),
                self.inner.options.limits,
                self.inner.options.max_waiting,
            )
        })
    }

    /// Samples every request, batched with whatever else this model samples; results in request order.
    pub fn sample_blocking(&self, batch: &[Request]) -> Vec<Result<Completion, SamplerError>> {
        self.sample_blocking_streaming(batch, Arc::new(|_: usize, _: u32, _: f32| true))
    }

    /// [`LocalModel::sample_blocking`], telling `sink` each token as it is sampled; a request the sink no
    /// longer wants ends there (see [`Sampler::sample_streaming`]). Not from inside an async runtime.
    pub fn sample_blocking_streaming(
        &self,
        batch: &[Request],
        sink: Arc<dyn TokenSink>,
    ) -> Vec<Result<Completion, SamplerError>> {
        let version = self.weight_version();
        let (results, queued) = self.submit(batch, sink);
        let generations = queued.map(|(indices, receiver)| (indices, receiver.blocking_recv()));
        collect(results, generations, version)
    }

    /// Prepares the requests and queues those that can run; the others' errors are in the results.
    #[allow(clippy::type_complexity)]
    fn submit(
        &self,
        batch: &[Request],
        sink: Arc<dyn TokenSink>,
    ) -> (
        Vec<Option<Result<Completion, SamplerError>>>,
        Option<(
            Vec<usize>,
            tokio::sync::oneshot::Receiver<schedule::Results>,
        )>,
    ) {
        let mut results: Vec<Option<Result<Completion, SamplerError>>> = vec![None; batch.len()];
        let mut indices = Vec::new();
        let mut sequences = Vec::new();
        for (i, request) in batch.iter().enumerate() {
            let prepared = self
                .request_ids(request)
                .and_then(|ids| Ok((self.params(request, ids.len())?, ids)));
            match prepared {
                Ok((params, ids)) => {
                    indices.push(i);
                    sequences.push((ids, params));
                }
                Err(error) => results[i] = Some(Err(error)),
            }
        }
        if sequences.is_empty() {
            return (results, None);
        }
        match self.scheduler().submit(sequences, indices.clone(), sink) {
            Ok(receiver) => (results, Some((indices, receiver))),
            Err(overloaded) => {
                for i in indices {
                    results[i] = Some(Err(SamplerError::Overloaded(format!(
                        "{} sequences are waiting (at most {})",
                        overloaded.waiting, overloaded.max_waiting
                    ))));
                }
                (results, None)
            }
        }
    }
}

/// The results of [`LocalModel::submit`] with the scheduler's answer for the queued requests.
fn collect(
    mut results: Vec<Option<Result<Completion, SamplerError>>>,
    generations: Option<(
        Vec<usize>,
        Result<schedule::Results, tokio::sync::oneshot::error::RecvError>,
    )>,
    weight_version: Option<u64>,
) -> Vec<Result<Completion, SamplerError>> {
    if let Some((indices, generations)) = generations {
        match generations {
            Ok(generations) => {
                for (i, generation) in indices.into_iter().zip(generations) {
                    results[i] = Some(match generation {
                        Ok(generation) => Ok(Completion {
                            text: generation.text,
                            tokens: generation.tokens,
                            logprobs: generation.logprobs,
                            top_logprobs: generation.top_logprobs,
                            finish: generation.finish,
                            routes: generation.routes,
                            weight_version,
                            constraint: None,
                        }),
                        Err(error) => Err(SamplerError::Unavailable(format!(
                            "local model failed: {error}"
                        ))),
                    });
                }
            }
            Err(_) => {
                for i in indices {
                    results[i] = Some(Err(SamplerError::Unavailable(
                        "the local model's scheduler stopped".into(),
                    )));
                }
            }
        }
    }
    results
        .into_iter()
        .map(|result| result.expect("every request has a result"))
        .collect()
}

impl Sampler for LocalModel {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        self.sample_streaming(batch, Arc::new(|_: usize, _: u32, _: f32| true))
    }

    fn sample_streaming<'a>(
        &'a self,
        batch: &'a [Request],
        sink: Arc<dyn TokenSink>,
    ) -> SampleFuture<'a> {
        // The weights a sample request starts on are the ones that sample it: a trainer steps only
        // between generations.
        let version = self.weight_version();
        let (results, queued) = self.submit(batch, sink);
        Box::pin(async move {
            let generations = match queued {
                Some((indices, receiver)) => Some((indices, receiver.await)),
                None => None,
            };
            collect(results, generations, version)
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::{Limits, LocalOptions};

    #[test]
    fn batch_invariant_sampling_is_refused_off_the_cpu_s_f32_and_bf16() {
        let options = |dtype, batch_invariant| LocalOptions {
            dtype,
            limits: Limits {
                batch_invariant,
                ..Limits::default()
            },
            ..LocalOptions::default()
        };
        for dtype in [DType::F32, DType::BF16] {
            assert_eq!(options(dtype, true).check(), Ok(()));
        }
        for dtype in [DType::F16, DType::F64] {
            assert_eq!(options(dtype, false).check(), Ok(()));
            let error = options(dtype, true).check().unwrap_err();
            assert!(
                error.contains("batch-invariant sampling runs on the CPU"),
                "{error}"
            );
        }
    }

    /// `logit_bias`, `min_tokens`, `stop_token_ids` and `ignore_eos` on a random model: a bias of 100
    /// decides every draw, so each parameter's effect shows in the tokens.
    #[test]
    fn biases_and_ending_parameters_shape_the_draws() {
        use holo_core::machine::Finish;
        use holo_core::sampler::{Prompt, Request, SampleParams, SamplerError};

        let model = crate::testing::random_local_model();
        let id = |text: &str| model.tokenizer().token_to_id(text).unwrap();
        let (x, y, end) = (id("x"), id("y"), id("<|im_end|>"));
        let sample = |params: SampleParams| {
            let request = Request {
                prompt: Prompt::Text("Go:".into()),
                params: SampleParams {
                    temperature: Some(1.0),
                    seed: Some(3),
                    ..params
                },
            };
            model.sample_blocking(&[request]).pop().unwrap()
        };
        let biased = sample(SampleParams {
            max_tokens: Some(5),
            logit_bias: vec![(x, 100.0)],
            ..SampleParams::default()
        })
        .unwrap();
        assert_eq!(biased.tokens, [x; 5]);
        // The log-probabilities are the biased distribution's, in which `x` is all but certain.
        assert!(biased.logprobs.iter().all(|lp| *lp > -1e-3), "{biased:?}");

        let late = sample(SampleParams {
            max_tokens: Some(9),
            logit_bias: vec![(end, 100.0)],
            min_tokens: 4,
            ..SampleParams::default()
        })
        .unwrap();
        assert_eq!(late.tokens.len(), 5, "{late:?}");
        assert!(!late.tokens[..4].contains(&end), "{late:?}");
        assert_eq!((late.tokens[4], &late.finish), (end, &Finish::EndOfTurn));

        let stopped = sample(SampleParams {
            max_tokens: Some(9),
            logit_bias: vec![(y, 100.0)],
            stop_token_ids: vec![y],
            ..SampleParams::default()
        })
        .unwrap();
        assert_eq!(
            (stopped.tokens.as_slice(), &stopped.finish),
            (&[y][..], &Finish::EndOfTurn)
        );

        let ignored = sample(SampleParams {
            max_tokens: Some(4),
            logit_bias: vec![(end, 100.0)],
            ignore_eos: true,
            ..SampleParams::default()
        })
        .unwrap();
        assert_eq!(
            (ignored.tokens.as_slice(), &ignored.finish),
            (&[end; 4][..], &Finish::Length)
        );

        let outside = sample(SampleParams {
            stop_token_ids: vec![100_000],
            ..SampleParams::default()
        });
        assert!(
            matches!(&outside, Err(SamplerError::Rejected(message)) if message.contains("100000")),
            "{outside:?}"
        );
    }
}
