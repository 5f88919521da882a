//! [`TinkerSampler`]: a [`Sampler`] over a Tinker service's `asample`, sampling from the sampler weights
//! the trainer saved last ([`TinkerSampler::set_weights`]), with the log-probability of every sampled
//! token.
//!
//! Prompts are token ids (the Holophore renders them with the model's chat template). Every request
//! stops at the model's end-of-turn tokens (sent as the service's stop tokens); stop strings, which the
//! service takes only instead of stop tokens, are applied here: the completion is cut after the token
//! whose decoding completes the first stop string, as the local sampler cuts it. Requests run
//! concurrently; the service batches them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::future::join_all;
use tokenizers::Tokenizer;

use super::client::Client;
use super::wire::SamplingParams;
use holo_core::machine::{Completion, Finish};
use holo_core::sampler::{Prompt, Request, SampleFuture, Sampler, SamplerError};
use holo_core::stop::first_stop;

/// Samples from the sampler weights at a `tinker://` path.
pub struct TinkerSampler {
    client: Client,
    tokenizer: Arc<Tokenizer>,
    end_of_turn: Vec<u32>,
    /// `max_tokens` of a request that has none.
    default_max_tokens: u32,
    weights: Mutex<String>,
    /// The bits of a request's seed sent: the service's, 31 until [`TinkerSampler::set_seed_bits`].
    seed_mask: AtomicU64,
    /// The first failure since [`TinkerSampler::take_error`]: the trainer stops on it rather than
    /// train on rollouts the service could not sample.
    error: Mutex<Option<String>>,
}

impl TinkerSampler {
    /// A sampler of the weights at `weights` (a `tinker://…/sampler_weights/…` path).
    pub fn new(
        client: Client,
        tokenizer: Arc<Tokenizer>,
        end_of_turn: Vec<u32>,
        default_max_tokens: u32,
        weights: String,
    ) -> Self {
        TinkerSampler {
            client,
            tokenizer,
            end_of_turn,
            default_max_tokens,
            weights: Mutex::new(weights),
            seed_mask: AtomicU64::new(seed_mask(31)),
            error: Mutex::new(None),
        }
    }

    /// Sends the low `bits` bits of each request's seed from now on (at most 63, the seeds' own).
    pub fn set_seed_bits(&self, bits: u32) {
        self.seed_mask.store(seed_mask(bits), Ordering::Relaxed);
    }

    /// Samples from `weights` from now on.
    pub fn set_weights(&self, weights: String) {
        *self.weights.lock().expect("not poisoned") = weights;
    }

    /// The weights sampled from.
    pub fn weights(&self) -> String {
        self.weights.lock().expect("not poisoned").clone()
    }

    /// The first failure since the last call, if any.
    pub fn take_error(&self) -> Option<String> {
        self.error.lock().expect("not poisoned").take()
    }

    async fn complete(&self, request: &Request, weights: &str) -> Result<Completion, SamplerError> {
        let Prompt::Tokens(prompt) = &request.prompt else {
            return Err(SamplerError::Rejected(
                "the Tinker sampler takes token prompts (rendered with the tokenizer's chat template)"
                    .into(),
            ));
        };
        let params = &request.params;
        if let Some(parameter) = params.beyond_sampling() {
            return Err(SamplerError::Rejected(format!(
                "the Tinker service's sampling parameters cannot honour {parameter}"
            )));
        }
        let sampling = SamplingParams {
            max_tokens: params.max_tokens.unwrap_or(self.default_max_tokens),
            // SkyRL draws with JAX, whose seeds are 32-bit: a service that says nothing gets 31 bits;
            // `holo tinker-serve` takes the whole seed and draws what the local sampler draws with it.
            seed: params
                .seed
                .map(|seed| seed & self.seed_mask.load(Ordering::Relaxed)),
            stop: self.end_of_turn.clone(),
            temperature: params.temperature.unwrap_or(1.0),
            top_k: match params.top_k {
                None | Some(0) => -1,
                Some(k) => i64::from(k),
            },
            top_p: params.top_p.unwrap_or(1.0),
        };
        let sequences = self
            .client
            .sample(weights, prompt.clone(), sampling, 1)
            .await
            .map_err(|error| self.failed(error.to_string()))?;
        let Some(sequence) = sequences.into_iter().next() else {
            return Err(self.malformed(format!(
                "the Tinker service at {} sampled no sequence",
                self.client.url()
            )));
        };
        if sequence.logprobs.len() != sequence.tokens.len() {
            return Err(self.malformed(format!(
                "the Tinker service at {} sampled {} tokens with {} log-probabilities",
                self.client.url(),
                sequence.tokens.len(),
                sequence.logprobs.len()
            )));
        }
        let mut completion = Completion {
            finish: if sequence
                .tokens
                .last()
                .is_some_and(|token| self.end_of_turn.contains(token))
                || !sequence.length
            {
                Finish::EndOfTurn
            } else {
                Finish::Length
            },
            tokens: sequence.tokens,
            logprobs: sequence.logprobs,
            ..Completion::default()
        };
        completion.text = self.decode(&completion.tokens)?;
        if let Some((at, stop)) = first_stop(&completion.text, 0, &params.stop) {
            let end = at + stop.len();
            // The first token whose prefix's decoding holds the whole stop string ends the completion.
            let mut kept = completion.tokens.len();
            for count in 1..=completion.tokens.len() {
                let text = self.decode(&completion.tokens[..count])?;
                if text.len() >= end && first_stop(&text, 0, &params.stop).is_some() {
                    kept = count;
                    break;
                }
            }
            completion.tokens.truncate(kept);
            completion.logprobs.truncate(kept);
            completion.text.truncate(end);
            completion.finish = Finish::Stop(stop.clone());
        }
        Ok(completion)
    }

    fn decode(&self, tokens: &[u32]) -> Result<String, SamplerError> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|error| self.malformed(format!("cannot decode sampled tokens: {error}")))
    }

    fn failed(&self, message: String) -> SamplerError {
        self.error
            .lock()
            .expect("not poisoned")
            .get_or_insert_with(|| message.clone());
        SamplerError::Unavailable(message)
    }

    fn malformed(&self, message: String) -> SamplerError {
        self.error
            .lock()
            .expect("not poisoned")
            .get_or_insert_with(|| message.clone());
        SamplerError::Malformed(message)
    }
}

/// The mask of a seed's low `bits` bits (at most 63).
fn seed_mask(bits: u32) -> u64 {
    (i64::MAX as u64) >> (63 - bits.min(63))
}

impl Sampler for TinkerSampler {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        let weights = self.weights();
        Box::pin(async move {
            join_all(batch.iter().map(|request| self.complete(request, &weights))).await
        })
    }
}
