//! Rollouts sampled on several OpenAI-compatible servers, each request sent to the server with room
//! for it that would be done with it first by its measured speed ([`super::speed`]), with the servers
//! that die dropped and their requests sent to the others.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::speed::{self, Clock, Load, Sent, SystemClock};

use holo_core::machine::Completion;
use holo_core::openai::OpenAi;
use holo_core::sampler::{Request, SampleFuture, Sampler, SamplerError};

/// The rollout servers, which of them are still in the pool, how many requests each has outstanding
/// and how fast each answers them, shared by the samplers ([`QuickestServer`]) and the weight sync
/// ([`super::WeightSync`]): a server either finds unreachable is dropped for both.
pub struct Servers {
    urls: Vec<String>,
    alive: Vec<AtomicBool>,
    /// Per server, the weights a push loaded there and the trainer's version of each: a server
    /// numbers its own loads (`holo serve` counts an adapter name's), the records carry the trainer's
    /// (optimizer steps taken), so that `async/staleness` is exact on servers too.
    held: Vec<Mutex<Vec<Held>>>,
    /// Per server, the requests sent to it that have not come back, over every sampler (a push's
    /// sampler and the one before it may both be sampling while a generation drawn ahead ends), and
    /// the estimate of its speed from those that did.
    loads: Mutex<Vec<Load>>,
    /// Where the loads read the time.
    clock: Arc<dyn Clock>,
    /// The requests a server runs at once at most: the others wait here, not in a server's queue,
    /// so that they go to whichever server is done with one first.
    capacity: usize,
    /// Told when a request comes back or the pool changes: requests waiting for room look again.
    changed: Notify,
}

/// Weights a push loaded on a server: the name requests give as `model`, the version the server
/// answered the load with (none from a server that does not say), and the optimizer steps taken by
/// the trainer's weights they are.
#[derive(Debug, Clone, PartialEq)]
struct Held {
    name: String,
    version: Option<u64>,
    step: u64,
}

impl Servers {
    /// The servers at `urls`, each running at most `capacity` requests at once (at least 1), timed by
    /// the system's clock.
    pub fn new(urls: Vec<String>, capacity: usize) -> Self {
        Self::with_clock(urls, capacity, Arc::new(SystemClock))
    }

    /// The servers at `urls`, each running at most `capacity` requests at once (at least 1), their
    /// requests timed by `clock`.
    pub fn with_clock(urls: Vec<String>, capacity: usize, clock: Arc<dyn Clock>) -> Self {
        let alive = urls.iter().map(|_| AtomicBool::new(true)).collect();
        let held = urls.iter().map(|_| Mutex::new(Vec::new())).collect();
        let now = clock.now();
        let loads = Mutex::new(urls.iter().map(|_| Load::new(now)).collect());
        Servers {
            urls,
            alive,
            held,
            loads,
            clock,
            capacity: capacity.max(1),
            changed: Notify::new(),
        }
    }

    /// The requests sent to server `index` that have not come back yet.
    pub fn outstanding(&self, index: usize) -> usize {
        self.loads()[index].outstanding()
    }

    /// Server `index`'s time per token generated, as measured on the requests it answered since it
    /// (last) joined the pool; `None` before the first.
    pub fn per_token(&self, index: usize) -> Option<Duration> {
        self.loads()[index].per_token().map(Duration::from_secs_f64)
    }

    /// The requests a server runs at once at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn loads(&self) -> std::sync::MutexGuard<'_, Vec<Load>> {
        self.loads
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Sends a request to one of `live`: of those with room for one more, the one that would be done
    /// with it first ([`speed::quickest`]), of those tied the first from `turn` on; it counts as
    /// outstanding there until the guard is dropped (its answer is back, or the call was given up).
    /// Waits while every one is full; `None` when none of `live` is in the pool any more. The wait
    /// ends: a slot frees when a request comes back, and every request has its deadline.
    async fn send(self: &Arc<Self>, live: &[usize], turn: usize) -> Option<Outstanding> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before looking, so that a slot freed meanwhile wakes this wait.
            changed.as_mut().enable();
            let live: Vec<usize> = live
                .iter()
                .copied()
                .filter(|&index| self.alive(index))
                .collect();
            if live.is_empty() {
                return None;
            }
            {
                let mut loads = self.loads();
                let in_turn = (0..live.len()).map(|k| live[(turn + k) % live.len()]);
                if let Some(index) = speed::quickest(&loads, in_turn, self.capacity) {
                    // Read under the lock, so that the loads see the times in order.
                    let sent = loads[index].send(self.clock.now());
                    return Some(Outstanding {
                        servers: Arc::clone(self),
                        index,
                        sent,
                        tokens: None,
                    });
                }
            }
            changed.await;
        }
    }

    fn held(&self, index: usize) -> std::sync::MutexGuard<'_, Vec<Held>> {
        self.held[index]
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Server `index` holds the trainer's weights after optimizer step `step` under `name`, as its
    /// version `version` (`None`: the server does not number its weights, and `name` is loaded
    /// only once, so the name alone says which weights sampled).
    pub fn loaded(&self, index: usize, name: &str, version: Option<u64>, step: u64) {
        let mut held = self.held(index);
        held.retain(|held| !(held.name == name && held.version == version));
        held.push(Held {
            name: name.to_string(),
            version,
            step,
        });
    }

    /// The weights after step `step` are those of the last push (it was not pushed): every server's
    /// newest weights stand for that step now.
    pub fn unchanged(&self, step: u64) {
        for index in 0..self.urls.len() {
            if let Some(newest) = self.held(index).last_mut() {
                newest.step = step;
            }
        }
    }

    /// Forgets what server `index` holds: it may have been restarted, numbering its loads anew.
    pub fn forget(&self, index: usize) {
        self.held(index).clear();
    }

    /// Forgets `name` on every server: it was unloaded.
    pub fn unloaded(&self, name: &str) {
        for index in 0..self.urls.len() {
            self.held(index).retain(|held| held.name != name);
        }
    }

    /// The trainer's version of the weights server `index` sampled with as `name`, its `version`,
    /// when a push loaded them.
    pub fn step_of(&self, index: usize, name: &str, version: Option<u64>) -> Option<u64> {
        self.held(index)
            .iter()
            .rev()
            .find(|held| held.name == name && held.version == version)
            .map(|held| held.step)
    }

    pub fn alive(&self, index: usize) -> bool {
        self.alive[index].load(Ordering::SeqCst)
    }

    /// The servers still in the pool, by index.
    pub fn live(&self) -> Vec<usize> {
        (0..self.urls.len())
            .filter(|&index| self.alive(index))
            .collect()
    }

    /// Takes server `index`, dropped before, back into the pool, saying so on stderr.
    pub fn rejoin(&self, index: usize) {
        if !self.alive[index].swap(true, Ordering::SeqCst) {
            self.changed.notify_waiters();
            eprintln!(
                "note: rollout server {} is back in the pool ({} in it)",
                self.urls[index],
                self.live().len()
            );
        }
    }

    /// Whether server `index` answers `GET /health` with 200 within `deadline`.
    pub async fn healthy(
        &self,
        client: &reqwest::Client,
        index: usize,
        deadline: Duration,
    ) -> bool {
        let url = format!("{}/health", self.urls[index]);
        let answer = client.get(url).timeout(deadline).send().await;
        answer.is_ok_and(|response| response.status().is_success())
    }

    /// Drops server `index` from the pool, saying so on stderr (once) with `why`, and forgets how
    /// fast it was: back in the pool, it is measured anew.
    pub fn drop_server(&self, index: usize, why: &str) {
        if self.alive[index].swap(false, Ordering::SeqCst) {
            self.loads()[index].forget();
            self.changed.notify_waiters();
            eprintln!(
                "warning: rollout server {} dropped from the pool ({} left): {why}",
                self.urls[index],
                self.live().len()
            );
        }
    }
}

/// A request counted as outstanding on a server while it lives ([`Servers::send`]).
struct Outstanding {
    servers: Arc<Servers>,
    index: usize,
    sent: Sent,
    /// The tokens its answer generated, once it is back with one.
    tokens: Option<usize>,
}

impl Outstanding {
    /// Back with `answer`: a completion measures the server's speed by its tokens (one without token
    /// ids, from a server that answers text alone, by the request: [`Load::answered`] counts it one).
    fn answered(mut self, answer: &[Result<Completion, SamplerError>]) {
        if let Some(Ok(completion)) = answer.first() {
            self.tokens = Some(completion.tokens.len());
        }
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        {
            let mut loads = self.servers.loads();
            // A late answer from a server dropped meanwhile measures a server that left the pool.
            let tokens = self.tokens.filter(|_| self.servers.alive(self.index));
            loads[self.index].answered(self.sent, self.servers.clock.now(), tokens);
        }
        self.servers.changed.notify_waiters();
    }
}

/// A [`Sampler`] over several servers holding the same weights: each request goes to the server in
/// the pool that would be done with it first, its requests outstanding (counted over every sampler of
/// the pool) plus this one times its measured time per token ([`Servers::per_token`]), ties taken in turn,
/// among those running fewer than [`Servers::capacity`]; a server not measured yet is tried first.
/// So a server that answers slowly is sent fewer, in proportion to its speed, even while every server
/// has room, instead of an equal share of the generation that it finishes last. When every server is
/// full a request waits here and goes to the first one done with a request: requests wait at the
/// trainer, where any server can take them, rather than in one server's queue. A request that a server
/// fails as unavailable (after its own retries) while the server no longer answers `GET /health`
/// within `health_timeout` drops the server from the pool and goes to another one, so no rollout is
/// lost while a server is left; a request a healthy server fails keeps its error. A request keeps its
/// seed wherever it goes, so which server samples it does not change what it samples beyond the last
/// bits of a server's arithmetic. A completion's `weight_version` is translated from the server's
/// numbering to the trainer's ([`Servers::step_of`]); a version no push made (weights the trainer did
/// not push) is left out.
pub struct QuickestServer {
    samplers: Vec<Arc<OpenAi>>,
    /// What each server's requests name as `model`.
    models: Vec<String>,
    /// The servers that hold these weights, when not every server in the pool does (an adapter
    /// loaded under a name of its own: a server that rejoined the pool later lacks it).
    holders: Option<Vec<usize>>,
    servers: Arc<Servers>,
    client: reqwest::Client,
    health_timeout: Duration,
    /// Where the turn of the servers tied for first done starts, moved on by every request.
    next: AtomicUsize,
}

impl QuickestServer {
    /// One sampler per server of `servers`, in order, each naming its entry of `models`; only
    /// `holders` take requests, when given.
    pub fn new(
        samplers: Vec<OpenAi>,
        models: Vec<String>,
        holders: Option<Vec<usize>>,
        servers: Arc<Servers>,
        client: reqwest::Client,
        health_timeout: Duration,
    ) -> Self {
        assert_eq!(samplers.len(), servers.urls.len(), "one sampler per server");
        QuickestServer {
            samplers: samplers.into_iter().map(Arc::new).collect(),
            models,
            holders,
            servers,
            client,
            health_timeout,
            next: AtomicUsize::new(0),
        }
    }

    /// The servers in the pool that hold these weights.
    fn live(&self) -> Vec<usize> {
        let mut live = self.servers.live();
        if let Some(holders) = &self.holders {
            live.retain(|index| holders.contains(index));
        }
        live
    }
}

impl Sampler for QuickestServer {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        Box::pin(async move {
            let mut results: Vec<Option<Result<Completion, SamplerError>>> =
                vec![None; batch.len()];
            let mut pending: Vec<usize> = (0..batch.len()).collect();
            while !pending.is_empty() {
                let live = self.live();
                if live.is_empty() {
                    for index in pending {
                        results[index] = Some(Err(SamplerError::Unavailable(format!(
                            "every rollout server holding `{}` was dropped from the pool",
                            self.models.first().map_or("", String::as_str)
                        ))));
                    }
                    break;
                }
                // One call per request, counted outstanding from the moment it is placed, so that
                // the next request of the batch sees it, until its answer is back.
                let mut calls = tokio::task::JoinSet::new();
                let mut unplaced = Vec::new();
                for index in pending {
                    let turn = self.next.fetch_add(1, Ordering::Relaxed);
                    let Some(sent) = self.servers.send(&live, turn).await else {
                        unplaced.push(index);
                        continue;
                    };
                    let server = sent.index;
                    let sampler = Arc::clone(&self.samplers[server]);
                    let request = batch[index].clone();
                    calls.spawn(async move {
                        let answer = sampler.sample(std::slice::from_ref(&request)).await;
                        sent.answered(&answer);
                        (server, index, answer)
                    });
                }
                let mut failed: Vec<(usize, usize, SamplerError)> = Vec::new();
                while let Some(joined) = calls.join_next().await {
                    let Ok((server, index, answers)) = joined else {
                        // A call cannot panic short of a bug in the sampler: its request fails.
                        continue;
                    };
                    match answers.into_iter().next() {
                        Some(Err(SamplerError::Unavailable(message))) => {
                            failed.push((server, index, SamplerError::Unavailable(message)))
                        }
                        Some(answer) => {
                            results[index] = Some(answer.map(|mut completion| {
                                completion.weight_version = self.servers.step_of(
                                    server,
                                    &self.models[server],
                                    completion.weight_version,
                                );
                                completion
                            }))
                        }
                        None => {}
                    }
                }
                // Left when the servers it could go to were dropped meanwhile: the loop looks again.
                pending = unplaced;
                for (server, index, error) in failed {
                    if self.servers.alive(server)
                        && self
                            .servers
                            .healthy(&self.client, server, self.health_timeout)
                            .await
                    {
                        results[index] = Some(Err(error));
                    } else {
                        self.servers.drop_server(server, &error.to_string());
                        pending.push(index);
                    }
                }
            }
            results
                .into_iter()
                .map(|result| {
                    result.unwrap_or_else(|| {
                        Err(SamplerError::Malformed("a server's call failed".into()))
                    })
                })
                .collect()
        })
    }
}
