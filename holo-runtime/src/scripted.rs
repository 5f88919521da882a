//! [`Scripted`]: a sampler that answers from a list, for tests and dry runs.

use crate::machine::{Completion, Finish, SampleRequest};

/// Completes requests with scripted replies, in order. A reply is cut at the first stop string it
/// contains (which it keeps, as a model's output would) and otherwise ends the turn.
#[derive(Debug, Clone, Default)]
pub struct Scripted {
    replies: Vec<String>,
    next: usize,
}

impl Scripted {
    pub fn new<S: Into<String>>(replies: impl IntoIterator<Item = S>) -> Self {
        Scripted {
            replies: replies.into_iter().map(Into::into).collect(),
            next: 0,
        }
    }

    /// The next reply, or `None` when the script has run out.
    pub fn complete(&mut self, request: &SampleRequest) -> Option<Completion> {
        let reply = self.replies.get(self.next)?;
        self.next += 1;
        let first_stop = request
            .stop
            .iter()
            .filter_map(|stop| reply.find(stop.as_str()).map(|at| (at, stop)))
            .min_by_key(|(at, _)| *at);
        Some(match first_stop {
            Some((at, stop)) => Completion {
                text: reply[..at + stop.len()].to_string(),
                finish: Finish::Stop(stop.clone()),
                ..Completion::default()
            },
            None => Completion {
                text: reply.clone(),
                finish: Finish::EndOfTurn,
                ..Completion::default()
            },
        })
    }
}
