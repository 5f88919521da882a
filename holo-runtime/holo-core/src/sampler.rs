//! The sampler interface: one batched call completes many prompts.
//!
//! Implementations: [`crate::Scripted`] (tests, dry runs), `openai` (any OpenAI-compatible server), and
//! the local candle model. The Loom gathers the pending requests of every machine into one batch.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

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

/// A language the completion must belong to. The local model masks, at every step, the tokens that
/// cannot continue a sentence of it, and allows its end-of-turn tokens only where a sentence is complete,
/// so that a completion that ends its turn is always in the language (one cut by `max_tokens` or a stop
/// string may not be). The log-probabilities it reports are those of the masked distribution.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON that validates against a JSON schema (OpenAI's `json_schema`, vLLM's `guided_json`).
    JsonSchema(serde_json::Value),
    /// Text that the regular expression matches whole (vLLM's `guided_regex`).
    Regex(String),
    /// One of these texts exactly (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// A context-free grammar in the Lark syntax that llguidance reads (vLLM's `guided_grammar`):
    /// its `start` rule, with `%json {schema}` for embedded JSON and `<[id]>` for a token by id.
    Lark(String),
}

impl Constraint {
    /// The name clients know it by, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonObject => "a JSON object",
            Constraint::JsonSchema(_) => "a JSON schema",
            Constraint::Regex(_) => "a regular expression",
            Constraint::Choice(_) => "a choice",
            Constraint::Lark(_) => "a Lark grammar",
        }
    }
}

/// The tokens a [`Constraint`] allowed at one position of a completion: a bit per entry of the model's
/// logits. The trainer masks its logits there with it, as the sampler masked them
/// (holo-model's `Grammar::replay` gives them).
#[derive(Clone, PartialEq, Eq)]
pub struct Allowed {
    /// Bit `id % 32` of word `id / 32` is set where token `id` is allowed.
    words: Arc<[u32]>,
    len: usize,
}

impl fmt::Debug for Allowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count: u32 = self.words.iter().map(|word| word.count_ones()).sum();
        write!(f, "Allowed({count} of {} tokens)", self.len)
    }
}

impl Allowed {
    /// The set of `len` tokens whose bits `words` holds (bit `id % 32` of word `id / 32`).
    pub fn from_words(words: &[u32], len: usize) -> Allowed {
        let mut words = words[..len.div_ceil(32).min(words.len())].to_vec();
        words.resize(len.div_ceil(32), 0);
        Allowed {
            words: words.into(),
            len,
        }
    }

    /// The tokens `ids` out of `len`.
    pub fn of(ids: &[u32], len: usize) -> Allowed {
        let mut words = vec![0u32; len.div_ceil(32)];
        for &id in ids.iter().filter(|&&id| (id as usize) < len) {
            words[id as usize / 32] |= 1 << (id % 32);
        }
        Allowed {
            words: words.into(),
            len,
        }
    }

    /// Whether token `id` is allowed (an id past the set's tokens is not).
    pub fn contains(&self, id: usize) -> bool {
        id < self.len && self.words[id / 32] & (1 << (id % 32)) != 0
    }
}

/// A sampler tag's constraint as holoc checked it. A schema's text was checked to parse; were it not
/// JSON, the schema `false` stands for it, which allows nothing and which every sampler refuses.
impl From<&holoc::ir::Constraint> for Constraint {
    fn from(constraint: &holoc::ir::Constraint) -> Constraint {
        use holoc::ir::Constraint as Written;
        match constraint {
            Written::JsonObject => Constraint::JsonObject,
            Written::JsonSchema(text) => Constraint::JsonSchema(
                serde_json::from_str(text).unwrap_or(serde_json::Value::Bool(false)),
            ),
            Written::Regex(regex) => Constraint::Regex(regex.clone()),
            Written::Choice(choices) => Constraint::Choice(choices.clone()),
            Written::Grammar(grammar) => Constraint::Lark(grammar.clone()),
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
