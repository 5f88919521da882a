//! The sampler interface: one batched call completes many prompts.
//!
//! Implementations: [`crate::Scripted`] (tests, dry runs), `openai` (any OpenAI-compatible server), and
//! the local candle model. The Loom gathers the pending requests of every machine into one batch.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

pub use crate::constraint::{Allowed, Constraint};
use crate::machine::Completion;
use crate::Role;

/// What to complete.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Token ids, rendered with the model's chat template by the holophore (exact, no re-tokenization).
    Tokens(Vec<u32>),
    /// Raw text, for servers that only take text.
    Text(String),
    /// Chat messages, for chat-completion endpoints; the last message is the assistant message to
    /// continue when it is one.
    Chat(Vec<ChatMessage>),
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
}

/// Generation parameters. `None` leaves the sampler's default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SampleParams {
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u32>,
    pub stop: Vec<String>,
    /// Per-request seed, for reproducible sampling.
    pub seed: Option<u64>,
    /// How many of the most likely tokens to report at each sampled position, with their
    /// log-probabilities ([`Completion::top_logprobs`](crate::Completion::top_logprobs)); 0 for none.
    /// Samplers that cannot report them leave the completion's list empty.
    pub top_logprobs: u32,
    /// What the completion must match, enforced token by token (constrained decoding). A sampler that
    /// cannot enforce it refuses the request ([`SamplerError::Rejected`]) rather than ignore it.
    pub constraint: Option<Constraint>,
    /// Added to these tokens' logits before each draw (OpenAI's `logit_bias`, -100 to 100).
    pub logit_bias: Vec<(u32, f32)>,
    /// No end-of-turn token, stop token or stop string ends the completion before it has this many
    /// tokens (vLLM's `min_tokens`).
    pub min_tokens: u32,
    /// More tokens that end the completion, kept in it as an end-of-turn token is (vLLM's
    /// `stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// End-of-turn tokens do not end the completion: it runs to `max_tokens` (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// With `Some(k)`: the log-probability of every prompt token after the first given the tokens
    /// before it, with the `k` most likely tokens at its position, told to the sink
    /// ([`TokenSink::prompt_logprobs`]) before the completion's first token (vLLM's `prompt_logprobs`;
    /// what `echo` with `logprobs` returns). `max_tokens` may then be 0: the prompt is only scored.
    pub prompt_logprobs: Option<u32>,
    /// Chat-template arguments for a chat prompt ([`Prompt::Chat`]), over the sampler's own (vLLM's
    /// `chat_template_kwargs`): a context's own (`<|+++ enable_thinking=false|>`) when the sampler
    /// renders the conversation. A token or text prompt is rendered already: a sampler refuses them
    /// there.
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

impl SampleParams {
    /// The first parameter set here that shapes the draw or the ending beyond temperature, top-p, top-k,
    /// stop strings and length (`constraint`, `logit_bias`, `min_tokens`, `stop_token_ids`,
    /// `ignore_eos`), asks for more than the completion (`prompt_logprobs`), or renders the prompt
    /// otherwise (`chat_template_kwargs`), by its request name: what a sampler that cannot honour it
    /// refuses.
    pub fn beyond_sampling(&self) -> Option<&'static str> {
        if self.prompt_logprobs.is_some() {
            Some("prompt_logprobs")
        } else if self.constraint.is_some() {
            Some("a constraint (structured output)")
        } else if !self.logit_bias.is_empty() {
            Some("logit_bias")
        } else if self.min_tokens > 0 {
            Some("min_tokens")
        } else if !self.stop_token_ids.is_empty() {
            Some("stop_token_ids")
        } else if self.ignore_eos {
            Some("ignore_eos")
        } else if self.chat_template_kwargs.is_some() {
            Some("chat_template_kwargs")
        } else {
            None
        }
    }
}

/// One prompt of a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub prompt: Prompt,
    pub params: SampleParams,
}

/// Why a batch (or one of its requests) could not be completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SamplerError {
    /// The request is wrong and retrying cannot help (an HTTP 4xx, an unsupported prompt kind).
    Rejected(String),
    /// The sampler could not answer after its retries (timeouts, 5xx, dropped connections).
    Unavailable(String),
    /// The sampler answered something that is not a valid completion.
    Malformed(String),
    /// The sampler's queue is full: the same request may succeed later (an HTTP 429).
    Overloaded(String),
}

impl fmt::Display for SamplerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SamplerError::Rejected(message) => write!(f, "request rejected: {message}"),
            SamplerError::Unavailable(message) => write!(f, "sampler unavailable: {message}"),
            SamplerError::Malformed(message) => write!(f, "malformed response: {message}"),
            SamplerError::Overloaded(message) => write!(f, "sampler overloaded: {message}"),
        }
    }
}

impl std::error::Error for SamplerError {}

/// A future returned by a sampler.
pub type SampleFuture<'a> =
    Pin<Box<dyn Future<Output = Vec<Result<Completion, SamplerError>>> + Send + 'a>>;

/// Completes batches of requests. The result has one entry per request, in order, so that one failed
/// request loses nothing of the others.
pub trait Sampler: Send + Sync {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a>;

    /// [`Sampler::sample`], telling `sink` each token as it is sampled, before the batch completes (for
    /// streaming). The completions remain the whole answer: the tokens reported for a request are a prefix
    /// of its completion's tokens (all of them, or fewer), in order. When the sink says a request is no
    /// longer wanted, the sampler may end it early.
    ///
    /// The default reports nothing: every token arrives with the completions.
    fn sample_streaming<'a>(
        &'a self,
        batch: &'a [Request],
        sink: Arc<dyn TokenSink>,
    ) -> SampleFuture<'a> {
        drop(sink);
        self.sample(batch)
    }
}

/// Receives the tokens of a batch as a sampler samples them; see [`Sampler::sample_streaming`]. Called on
/// the sampler's thread, so it must not block.
pub trait TokenSink: Send + Sync {
    /// Request `index` of the batch sampled `token` with log-probability `logprob` (as the completion
    /// reports it). Returns whether the request still wants tokens: `false` when whoever asked for it has
    /// gone, and the sampler may stop it.
    fn token(&self, index: usize, token: u32, logprob: f32) -> bool;

    /// [`TokenSink::token`] with the most likely tokens at its position and their log-probabilities
    /// (as [`Completion::top_logprobs`](crate::Completion::top_logprobs) reports them), for samplers
    /// asked for them ([`SampleParams::top_logprobs`]).
    fn token_with_top(&self, index: usize, token: u32, logprob: f32, top: &[(u32, f32)]) -> bool {
        let _ = top;
        self.token(index, token, logprob)
    }

    /// Whether request `index` is still wanted before it has sampled anything: a sampler may skip those
    /// that are not.
    fn wanted(&self, index: usize) -> bool {
        let _ = index;
        true
    }

    /// Request `index` has started: it leaves the sampler's queue (the local model: it joins the batch),
    /// for queue-time statistics. Samplers that do not queue need not call it.
    fn started(&self, index: usize) {
        let _ = index;
    }

    /// Request `index`, which asked for [`SampleParams::prompt_logprobs`] = k, has scored its prompt:
    /// `logprobs[i]` is the log-probability of prompt token `i + 1` given the tokens before it,
    /// `ranks[i]` its rank there (how many tokens are at least as likely, itself included: 1 is the
    /// most likely, as vLLM counts), and `top[i]` the k most likely tokens at that position with
    /// theirs, most likely first (the model's own distribution, at temperature 1). Told once, before
    /// the request's first token.
    fn prompt_logprobs(
        &self,
        index: usize,
        logprobs: &[f32],
        ranks: &[u32],
        top: &[Vec<(u32, f32)>],
    ) {
        let _ = (index, logprobs, ranks, top);
    }
}

impl<F: Fn(usize, u32, f32) -> bool + Send + Sync> TokenSink for F {
    fn token(&self, index: usize, token: u32, logprob: f32) -> bool {
        self(index, token, logprob)
    }
}

/// Parameters imposed on every request of a run, over what each request asks (`holo gym` applies a
/// NeMo Gym row's `temperature`, `top_p` and `max_output_tokens` this way). `None` leaves a request's
/// own value.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Imposed {
    /// Replaces each request's temperature.
    pub temperature: Option<f64>,
    /// Replaces each request's top-p.
    pub top_p: Option<f64>,
    /// Caps each request's `max_tokens` (a request without one gets this one).
    pub max_tokens: Option<u32>,
}

impl Imposed {
    /// `params` with the imposed values.
    pub fn apply(&self, params: &SampleParams) -> SampleParams {
        SampleParams {
            temperature: self.temperature.or(params.temperature),
            top_p: self.top_p.or(params.top_p),
            max_tokens: match (params.max_tokens, self.max_tokens) {
                (Some(own), Some(cap)) => Some(own.min(cap)),
                (own, cap) => own.or(cap),
            },
            ..params.clone()
        }
    }
}

/// A sampler whose every request has [`Imposed`] parameters.
pub struct WithImposed<'a> {
    pub inner: &'a dyn Sampler,
    pub imposed: Imposed,
}

impl Sampler for WithImposed<'_> {
    fn sample<'b>(&'b self, batch: &'b [Request]) -> SampleFuture<'b> {
        let batch: Vec<Request> = batch
            .iter()
            .map(|request| Request {
                prompt: request.prompt.clone(),
                params: self.imposed.apply(&request.params),
            })
            .collect();
        Box::pin(async move { self.inner.sample(&batch).await })
    }
}
