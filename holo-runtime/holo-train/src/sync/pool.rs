//! Rollouts sampled on several OpenAI-compatible servers, round-robin.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use holo_core::machine::Completion;
use holo_core::openai::OpenAi;
use holo_core::sampler::{Request, SampleFuture, Sampler, SamplerError};

/// A [`Sampler`] over several servers holding the same weights: the requests of a batch go to them in
/// turn (request `i` of the `k`-th request so far to server `k mod n`), all servers at once. A request
/// keeps its seed wherever it goes, so which server samples it does not change what it samples beyond
/// the last bits of a server's arithmetic.
pub struct RoundRobin {
    servers: Vec<Arc<OpenAi>>,
    next: AtomicUsize,
}

impl RoundRobin {
    /// `servers` must not be empty.
    pub fn new(servers: Vec<OpenAi>) -> Self {
        assert!(!servers.is_empty(), "a round-robin needs a server");
        RoundRobin {
            servers: servers.into_iter().map(Arc::new).collect(),
            next: AtomicUsize::new(0),
        }
    }
}

impl Sampler for RoundRobin {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        Box::pin(async move {
            let count = self.servers.len();
            let first = self.next.fetch_add(batch.len(), Ordering::Relaxed);
            let mut shares: Vec<(Vec<usize>, Vec<Request>)> = vec![(Vec::new(), Vec::new()); count];
            for (index, request) in batch.iter().enumerate() {
                let share = &mut shares[(first + index) % count];
                share.0.push(index);
                share.1.push(request.clone());
            }
            let mut calls = tokio::task::JoinSet::new();
            for (server, (indices, requests)) in self.servers.iter().zip(shares) {
                if requests.is_empty() {
                    continue;
                }
                let server = Arc::clone(server);
                calls.spawn(async move { (indices, server.sample(&requests).await) });
            }
            let mut results: Vec<Option<Result<Completion, SamplerError>>> =
                vec![None; batch.len()];
            while let Some(joined) = calls.join_next().await {
                match joined {
                    Ok((indices, answers)) => {
                        for (index, answer) in indices.into_iter().zip(answers) {
                            results[index] = Some(answer);
                        }
                    }
                    Err(error) => {
                        let message = format!("a server's call failed: {error}");
                        for slot in results.iter_mut().filter(|slot| slot.is_none()) {
                            *slot = Some(Err(SamplerError::Malformed(message.clone())));
                        }
                    }
                }
            }
            results
                .into_iter()
                .map(|result| {
                    result.unwrap_or_else(|| {
                        Err(SamplerError::Malformed(
                            "a server returned too few results".into(),
                        ))
                    })
                })
                .collect()
        })
    }
}
