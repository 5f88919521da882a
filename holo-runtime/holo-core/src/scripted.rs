//! [`Scripted`]: a sampler that answers from a list, for tests and dry runs.
//!
//! Two ways to use it:
//! - [`Scripted::complete`] takes the replies in order, one per call, and runs out (`None`) at the end of
//!   the list: a driver stepping one rollout by hand, as `holo dry` does;
//! - as a [`Sampler`] (what the [`crate::loom::Loom`] and `holo eval --sampler scripted` use), a request is
//!   answered by its *turn*: a [`Prompt::Chat`] that already holds `k` assistant messages before the one in
//!   progress gets reply `k`, so every rollout of a batch gets the script from its start, whatever else is in
//!   the batch and in whatever order (reproducible by construction). The script repeats from its start
//!   when a conversation outlasts it (two samples within one assistant message are the same turn and get
//!   the same reply). A [`Prompt::Tokens`] prompt counts its turns the same way when the sampler is
//!   [`Scripted::tokenized`]: by the assistant headers of the chat template in the ids (the header of the
//!   message in progress not counted). A text prompt, or a token prompt of a sampler that is not
//!   tokenized, carries no turns: those take the replies in order from a cursor shared by every batch,
//!   also repeating. An empty script fails every request with [`SamplerError::Rejected`].
//!
//! A [`Scripted::tokenized`] sampler also answers in token space, as a model would: each completion
//! carries the ids of its text (tokenized once, with the model's tokenizer) and a logprob of 0 for each
//! (the script is certain). It does not append an end-of-turn token.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::holophore::Holophore;
use crate::machine::{Completion, Finish, SampleRequest};
use crate::sampler::{Prompt, Request, SampleFuture, Sampler, SamplerError};
use crate::Role;

/// Completes requests with scripted replies, in order. A reply is cut at the first stop string it
/// contains (which it keeps, as a model's output would) and otherwise ends the turn.
#[derive(Default)]
pub struct Scripted {
    replies: Vec<String>,
    next: AtomicUsize,
    tokens: Option<TokenSpace>,
}

/// What a [`Scripted::tokenized`] sampler needs: the tokenizer and the assistant header.
#[derive(Clone)]
struct TokenSpace {
    tokenizer: Arc<Tokenizer>,
    header: Vec<u32>,
}

impl fmt::Debug for Scripted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scripted")
            .field("replies", &self.replies)
            .field("next", &self.next)
            .field("tokenized", &self.tokens.is_some())
            .finish()
    }
}

impl Clone for Scripted {
    fn clone(&self) -> Self {
        Scripted {
            replies: self.replies.clone(),
            next: AtomicUsize::new(self.next.load(Ordering::Relaxed)),
            tokens: self.tokens.clone(),
        }
    }
}

impl Scripted {
    pub fn new<S: Into<String>>(replies: impl IntoIterator<Item = S>) -> Self {
        Scripted {
            replies: replies.into_iter().map(Into::into).collect(),
            next: AtomicUsize::new(0),
            tokens: None,
        }
    }

    /// The same script answering in token space with the tokenizer of `holophore`, and counting the
    /// turns of token prompts by its chat template's assistant header; see the
    /// [module documentation](self).
    pub fn tokenized(mut self, holophore: &Holophore) -> Self {
        self.tokens = Some(TokenSpace {
            tokenizer: Arc::clone(holophore.tokenizer()),
            header: holophore.assistant_header(),
        });
        self
    }

    /// `completion` with the ids of its text and zero logprobs, when tokenized.
    fn in_token_space(&self, mut completion: Completion) -> Result<Completion, SamplerError> {
        if let Some(space) = &self.tokens {
            let ids = space
                .tokenizer
                .encode(completion.text.as_str(), false)
                .map_err(|error| SamplerError::Rejected(format!("tokenizer: {error}")))?
                .get_ids()
                .to_vec();
            completion.logprobs = vec![0.0; ids.len()];
            completion.tokens = ids;
        }
        Ok(completion)
    }

    /// The replies, in order.
    pub fn replies(&self) -> &[String] {
        &self.replies
    }

    /// The next reply, or `None` when the script has run out.
    pub fn complete(&mut self, request: &SampleRequest) -> Option<Completion> {
        let next = self.next.get_mut();
        let reply = self.replies.get(*next)?;
        *next += 1;
        // A tokenizer that cannot encode the reply leaves it in text (the holophore re-tokenizes it).
        let completion = cut(reply, &request.stop);
        Some(
            self.in_token_space(completion.clone())
                .unwrap_or(completion),
        )
    }

    /// The reply a [`Sampler`] request gets; see the [module documentation](self).
    pub fn reply_for(&self, request: &Request) -> Result<Completion, SamplerError> {
        if self.replies.is_empty() {
            return Err(SamplerError::Rejected(
                "the scripted sampler has no replies".into(),
            ));
        }
        if let Some(parameter) = request.params.beyond_sampling() {
            return Err(SamplerError::Rejected(format!(
                "the scripted sampler replies what it was given and cannot honour {parameter}"
            )));
        }
        let turn = match &request.prompt {
            Prompt::Chat(messages) => {
                let done = match messages.split_last() {
                    Some((last, before)) if last.role == Role::Assistant => before,
                    _ => messages.as_slice(),
                };
                done.iter()
                    .filter(|message| message.role == Role::Assistant)
                    .count()
            }
            Prompt::Tokens(ids) => match &self.tokens {
                Some(space) if !space.header.is_empty() => {
                    count(ids, &space.header).saturating_sub(1)
                }
                _ => self.next.fetch_add(1, Ordering::Relaxed),
            },
            Prompt::Text(_) => self.next.fetch_add(1, Ordering::Relaxed),
        };
        self.in_token_space(cut(
            &self.replies[turn % self.replies.len()],
            &request.params.stop,
        ))
    }
}

impl Sampler for Scripted {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        let results = batch
            .iter()
            .map(|request| self.reply_for(request))
            .collect();
        Box::pin(std::future::ready(results))
    }
}

/// How many times `needle` (not empty) occurs in `ids`, without overlaps.
fn count(ids: &[u32], needle: &[u32]) -> usize {
    let mut found = 0;
    let mut at = 0;
    while at + needle.len() <= ids.len() {
        if ids[at..].starts_with(needle) {
            found += 1;
            at += needle.len();
        } else {
            at += 1;
        }
    }
    found
}

/// `reply` cut after the first stop string it contains.
fn cut(reply: &str, stop: &[String]) -> Completion {
    let first_stop = stop
        .iter()
        .filter(|stop| !stop.is_empty())
        .filter_map(|stop| reply.find(stop.as_str()).map(|at| (at, stop)))
        .min_by_key(|(at, _)| *at);
    match first_stop {
        Some((at, stop)) => Completion {
            text: reply[..at + stop.len()].to_string(),
            finish: Finish::Stop(stop.clone()),
            ..Completion::default()
        },
        None => Completion {
            text: reply.to_string(),
            finish: Finish::EndOfTurn,
            ..Completion::default()
        },
    }
}
