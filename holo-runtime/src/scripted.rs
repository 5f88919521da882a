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
//!   the same reply). A text or token prompt carries no turns: those take the replies in
//!   order from a cursor shared by every batch, also repeating. An empty script fails every request with
//!   [`SamplerError::Rejected`].

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::machine::{Completion, Finish, SampleRequest};
use crate::sampler::{Prompt, Request, SampleFuture, Sampler, SamplerError};
use crate::Role;

/// Completes requests with scripted replies, in order. A reply is cut at the first stop string it
/// contains (which it keeps, as a model's output would) and otherwise ends the turn.
#[derive(Debug, Default)]
pub struct Scripted {
    replies: Vec<String>,
    next: AtomicUsize,
}

impl Clone for Scripted {
    fn clone(&self) -> Self {
        Scripted {
            replies: self.replies.clone(),
            next: AtomicUsize::new(self.next.load(Ordering::Relaxed)),
        }
    }
}

impl Scripted {
    pub fn new<S: Into<String>>(replies: impl IntoIterator<Item = S>) -> Self {
        Scripted {
            replies: replies.into_iter().map(Into::into).collect(),
            next: AtomicUsize::new(0),
        }
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
        Some(cut(reply, &request.stop))
    }

    /// The reply a [`Sampler`] request gets; see the [module documentation](self).
    pub fn reply_for(&self, request: &Request) -> Result<Completion, SamplerError> {
        if self.replies.is_empty() {
            return Err(SamplerError::Rejected(
                "the scripted sampler has no replies".into(),
            ));
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
            Prompt::Text(_) | Prompt::Tokens(_) => self.next.fetch_add(1, Ordering::Relaxed),
        };
        Ok(cut(
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
