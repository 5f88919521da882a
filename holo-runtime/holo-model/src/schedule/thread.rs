//! The engine on its own thread, and what it shares with its callers.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{Engine, Limits, Listener, Results};
use crate::sample::{GenerationParams, Stopping};
use crate::Core;
use holo_core::sampler::TokenSink;

/// What the scheduler is doing, for `/metrics` and progress lines.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    waiting: AtomicUsize,
    /// Submitted sequences the engine has not taken from the channel yet.
    in_channel: AtomicUsize,
    running: AtomicUsize,
    kv_bytes: AtomicUsize,
    generated: AtomicUsize,
    prefilled: AtomicUsize,
    /// Tokens per second over the last measured window, as `f64` bits.
    rate: AtomicU64,
}

impl SchedulerStats {
    /// Sequences queued, not admitted yet.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed) + self.in_channel.load(Ordering::Relaxed)
    }

    /// Sequences prefilling or decoding.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Bytes of keys and values the running batch holds.
    pub fn kv_bytes(&self) -> usize {
        self.kv_bytes.load(Ordering::Relaxed)
    }

    /// Tokens sampled since the scheduler started.
    pub fn generated_tokens(&self) -> usize {
        self.generated.load(Ordering::Relaxed)
    }

    /// Prompt tokens run through the model since the scheduler started: identical prompts prefilled
    /// together (the `n` samples of a request) count once, and tokens the prefix cache held not at all.
    pub fn prefilled_tokens(&self) -> usize {
        self.prefilled.load(Ordering::Relaxed)
    }

    /// Tokens sampled per second over the engine's last second (or a little more) of steps; 0 once it is
    /// idle.
    pub fn tokens_per_second(&self) -> f64 {
        f64::from_bits(self.rate.load(Ordering::Relaxed))
    }
}

/// The shortest span of steps [`SchedulerStats::tokens_per_second`] averages over.
const RATE_WINDOW: Duration = Duration::from_secs(1);

/// Measures [`SchedulerStats::tokens_per_second`] on the engine's thread: the tokens of a window of
/// steps at least [`RATE_WINDOW`] long.
struct Rate {
    since: Instant,
    generated: usize,
}

impl Rate {
    fn start(stats: &SchedulerStats) -> Rate {
        Rate {
            since: Instant::now(),
            generated: stats.generated_tokens(),
        }
    }

    /// After a step: a window that has lasted long enough becomes the rate, and a new one starts.
    fn step(&mut self, stats: &SchedulerStats) {
        let elapsed = self.since.elapsed();
        if elapsed >= RATE_WINDOW {
            let tokens = stats.generated_tokens() - self.generated;
            let rate = tokens as f64 / elapsed.as_secs_f64();
            stats.rate.store(rate.to_bits(), Ordering::Relaxed);
            *self = Rate::start(stats);
        }
    }
}

struct Submission {
    sequences: Vec<(Vec<u32>, GenerationParams)>,
    listener: SinkListener,
    done: oneshot::Sender<Results>,
}

/// A [`TokenSink`] as the engine's listener: submission index `i` is the sink's `indices[i]`.
struct SinkListener {
    sink: Arc<dyn TokenSink>,
    indices: Vec<usize>,
    stats: Arc<SchedulerStats>,
}

impl Listener for SinkListener {
    fn token(&mut self, index: usize, token: u32, logprob: f32, top: &[(u32, f32)]) -> bool {
        self.stats.generated.fetch_add(1, Ordering::Relaxed);
        self.sink
            .token_with_top(self.indices[index], token, logprob, top)
    }

    fn wanted(&self, index: usize) -> bool {
        self.sink.wanted(self.indices[index])
    }

    fn started(&mut self, index: usize) {
        self.sink.started(self.indices[index]);
    }

    fn prompt_logprobs(
        &mut self,
        index: usize,
        logprobs: &[f32],
        ranks: &[u32],
        top: &[Vec<(u32, f32)>],
    ) {
        self.sink
            .prompt_logprobs(self.indices[index], logprobs, ranks, top);
    }
}

/// Why a submission was not queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overloaded {
    pub waiting: usize,
    pub max_waiting: usize,
}

/// An [`Engine`] on its own thread, shared by every caller of one [`LocalModel`](crate::LocalModel).
/// The thread ends when the scheduler is dropped and its work is done.
pub(crate) struct Scheduler {
    submissions: mpsc::Sender<Submission>,
    stats: Arc<SchedulerStats>,
    max_waiting: usize,
}

impl Scheduler {
    pub(crate) fn start(core: Arc<Core>, limits: Limits, max_waiting: usize) -> Scheduler {
        let (submissions, receiver) = mpsc::channel::<Submission>();
        let stats = Arc::new(SchedulerStats::default());
        let thread_stats = Arc::clone(&stats);
        std::thread::Builder::new()
            .name("holo-scheduler".into())
            .spawn(move || run(&core, limits, receiver, &thread_stats))
            .expect("the scheduler's thread starts");
        Scheduler {
            submissions,
            stats,
            max_waiting,
        }
    }

    pub(crate) fn stats(&self) -> &Arc<SchedulerStats> {
        &self.stats
    }

    /// Queues sequences; `sink` hears of their tokens under `indices[i]` for sequence `i`. The receiver
    /// gets their results once all have ended.
    pub(crate) fn submit(
        &self,
        sequences: Vec<(Vec<u32>, GenerationParams)>,
        indices: Vec<usize>,
        sink: Arc<dyn TokenSink>,
    ) -> std::result::Result<oneshot::Receiver<Results>, Overloaded> {
        let count = sequences.len();
        let waiting = self.stats.waiting();
        if waiting + count > self.max_waiting && waiting > 0 {
            return Err(Overloaded {
                waiting,
                max_waiting: self.max_waiting,
            });
        }
        let (done, receiver) = oneshot::channel();
        self.stats.in_channel.fetch_add(count, Ordering::Relaxed);
        let submission = Submission {
            sequences,
            listener: SinkListener {
                sink,
                indices,
                stats: Arc::clone(&self.stats),
            },
            done,
        };
        if let Err(mpsc::SendError(submission)) = self.submissions.send(submission) {
            // The thread is gone (a panic outside a step): the receiver reports it closed.
            self.stats.in_channel.fetch_sub(count, Ordering::Relaxed);
            drop(submission);
        }
        Ok(receiver)
    }
}

fn run(
    core: &Core,
    limits: Limits,
    submissions: mpsc::Receiver<Submission>,
    stats: &SchedulerStats,
) {
    let stopping = Stopping {
        eos: &core.end_of_turn,
        tokenizer: &core.tokenizer,
    };
    let new_engine = || Engine::new(&core.model, stopping, Some(&core.prefix), limits);
    let mut engine = new_engine();
    let mut waiting_for: HashMap<u64, oneshot::Sender<Results>> = HashMap::new();
    let take = |engine: &mut Engine, submission: Submission| {
        // Counted as waiting at once (not at the end of the step), so that a full queue refuses at once.
        let count = submission.sequences.len();
        stats.waiting.fetch_add(count, Ordering::Relaxed);
        stats.in_channel.fetch_sub(count, Ordering::Relaxed);
        let id = engine.submit(submission.sequences, Box::new(submission.listener));
        (id, submission.done)
    };
    let mut rate = Rate::start(stats);
    loop {
        if engine.is_idle() {
            stats.rate.store(0f64.to_bits(), Ordering::Relaxed);
            // The batch's keys and values are freed: give them back before waiting.
            holo_core::trim::release();
            let received = submissions.recv();
            rate = Rate::start(stats);
            match received {
                Ok(submission) => {
                    let (id, done) = take(&mut engine, submission);
                    waiting_for.insert(id, done);
                }
                Err(mpsc::RecvError) => return,
            }
        }
        while let Ok(submission) = submissions.try_recv() {
            let (id, done) = take(&mut engine, submission);
            waiting_for.insert(id, done);
        }
        let ended = match catch_unwind(AssertUnwindSafe(|| engine.step())) {
            Ok(ended) => ended,
            Err(_) => {
                let ended = engine.fail_all("the local model panicked");
                engine = new_engine();
                ended
            }
        };
        stats.waiting.store(engine.waiting(), Ordering::Relaxed);
        stats.running.store(engine.running(), Ordering::Relaxed);
        stats.kv_bytes.store(engine.kv_bytes(), Ordering::Relaxed);
        stats
            .prefilled
            .fetch_add(std::mem::take(&mut engine.prefilled), Ordering::Relaxed);
        rate.step(stats);
        for (id, results) in ended {
            if let Some(done) = waiting_for.remove(&id) {
                let _ = done.send(results);
            }
        }
    }
}
