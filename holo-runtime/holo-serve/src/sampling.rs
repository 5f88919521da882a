//! Each request's samples as one sampler call: the jobs, their events, the dispatcher.

use super::*;

/// One request's samples on their way to the sampler: sample `i` is choice `i`.
pub(super) struct Job {
    pub(super) requests: Vec<Request>,
    pub(super) outlet: Outlet,
    /// The weights the request named: it samples to its end with them, whatever is loaded meanwhile.
    pub(super) sampler: Arc<dyn Sampler>,
}

/// Where a request's events go.
#[derive(Clone)]
pub(super) struct Outlet {
    pub(super) events: mpsc::UnboundedSender<Event>,
    /// Whether the request wants tokens as they are sampled.
    pub(super) stream: bool,
    /// The request's log line: when sampling started, how many tokens it sampled.
    pub(super) tally: Tally,
}

/// What a request hears of its samples: tokens as they are sampled (streamed requests only), then each
/// sample's result.
pub(super) enum Event {
    Token {
        choice: usize,
        token: u32,
        logprob: f32,
        /// The most likely alternatives, when asked for and the sampler reports them.
        top: Vec<(u32, f32)>,
    },
    /// The prompt's log-probabilities, for a request that asked for them (`echo` with `logprobs`),
    /// before its first token.
    Prompt {
        choice: usize,
        scored: PromptLogprobs,
    },
    Done {
        choice: usize,
        result: Result<Completion, SamplerError>,
    },
}

/// A prompt's log-probabilities as the sampler reported them ([`TokenSink::prompt_logprobs`]): of
/// every token after the first, their ranks, and the most likely tokens at each of those positions.
#[derive(Debug, Clone, Default)]
pub(super) struct PromptLogprobs {
    pub(super) logprobs: Vec<f32>,
    pub(super) ranks: Vec<u32>,
    pub(super) top: Vec<Vec<(u32, f32)>>,
}

/// A request's outlet as the sampler's [`TokenSink`]: a request whose client has gone (its receiver
/// dropped) wants no more tokens.
impl TokenSink for Outlet {
    fn token(&self, choice: usize, token: u32, logprob: f32) -> bool {
        self.token_with_top(choice, token, logprob, &[])
    }

    fn token_with_top(&self, choice: usize, token: u32, logprob: f32, top: &[(u32, f32)]) -> bool {
        // A sampler that does not say when it starts has started by its first token.
        self.tally.started();
        if self.stream {
            self.events
                .send(Event::Token {
                    choice,
                    token,
                    logprob,
                    top: top.to_vec(),
                })
                .is_ok()
        } else {
            !self.events.is_closed()
        }
    }

    fn wanted(&self, _choice: usize) -> bool {
        !self.events.is_closed()
    }

    fn started(&self, _choice: usize) {
        self.tally.started();
    }

    fn prompt_logprobs(
        &self,
        choice: usize,
        logprobs: &[f32],
        ranks: &[u32],
        top: &[Vec<(u32, f32)>],
    ) {
        let scored = PromptLogprobs {
            logprobs: logprobs.to_vec(),
            ranks: ranks.to_vec(),
            top: top.to_vec(),
        };
        let _ = self.events.send(Event::Prompt { choice, scored });
    }
}

/// Starts a sampler call for every job as it arrives; ends when the job senders are gone and every call
/// has answered.
pub(super) async fn dispatch(mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut calls = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            job = jobs.recv() => match job {
                Some(job) if job.outlet.events.is_closed() => {}
                Some(job) => {
                    calls.spawn(sample(job));
                }
                None => break,
            },
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
        }
    }
    while calls.join_next().await.is_some() {}
}

/// One job's sampler call; every choice hears of its result.
pub(super) async fn sample(job: Job) {
    let Job {
        requests,
        outlet,
        sampler,
    } = job;
    let count = requests.len();
    let sink: Arc<dyn TokenSink> = Arc::new(outlet.clone());
    let runtime = tokio::runtime::Handle::current();
    let outcome = tokio::task::spawn_blocking(move || {
        runtime.block_on(async move { sampler.sample_streaming(&requests, sink).await })
    })
    .await;
    let mut results = match outcome {
        Ok(results) => results.into_iter(),
        Err(error) => {
            let message = if error.is_panic() {
                "the sampler panicked".to_string()
            } else {
                format!("the sampler task failed: {error}")
            };
            vec![Err(SamplerError::Malformed(message)); count].into_iter()
        }
    };
    let returned = results.len();
    for choice in 0..count {
        let result = results.next().unwrap_or_else(|| {
            Err(SamplerError::Malformed(format!(
                "the sampler returned {returned} results for a request of {count}"
            )))
        });
        if let Ok(completion) = &result {
            outlet.tally.add_completion_tokens(completion.tokens.len());
        }
        let _ = outlet.events.send(Event::Done { choice, result });
    }
}
