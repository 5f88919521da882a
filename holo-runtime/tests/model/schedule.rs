//! The local model's scheduler: requests join the running batch at the next step, long prompts are
//! prefilled in chunks between decoding steps, a request with many samples shares the batch, the cache
//! budget bounds admission, a full queue refuses, and a sequence's tokens do not depend on what else runs.
//!
//! Every ordering checked here is one of scheduling steps, not of time: a second request is submitted
//! from inside the first one's token callback (on the scheduler's thread, between two steps), so it
//! reaches the scheduler at a known step whatever the machine's load.

use std::sync::{Arc, Mutex};

use holo_runtime::local::{Limits, LocalModel, LocalOptions};
use holo_runtime::machine::Completion;
use holo_runtime::sampler::{
    Prompt, Request, SampleFuture, SampleParams, Sampler, SamplerError, TokenSink,
};

use crate::common::repo;

const MODEL: &str = "holo-runtime/tests/fixtures/models/qwen2";

fn model(limits: Limits, max_waiting: usize) -> &'static LocalModel {
    let options = LocalOptions {
        limits,
        max_waiting,
        ..LocalOptions::default()
    };
    // Leaked so that a request submitted from a token callback may borrow it for the rest of the test.
    Box::leak(Box::new(
        LocalModel::load(repo().join(MODEL), options).unwrap(),
    ))
}

fn request(prompt: Vec<u32>, max_tokens: u32, seed: u64) -> Request {
    Request {
        prompt: Prompt::Tokens(prompt),
        params: SampleParams {
            max_tokens: Some(max_tokens),
            seed: Some(seed),
            ..SampleParams::default()
        },
    }
}

fn prompt(start: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| (start + 7 * i) % 500).collect()
}

/// Every token every request sampled, in the order the scheduler reported them: (request, sample).
#[derive(Default)]
struct Log(Mutex<Vec<(&'static str, usize)>>);

impl Log {
    fn entries(&self) -> Vec<(&'static str, usize)> {
        self.0.lock().unwrap().clone()
    }

    /// Tokens of `name` logged before the `n`-th token (1-based) of `other`.
    fn before(&self, name: &str, other: &str, n: usize) -> usize {
        let entries = self.entries();
        let at = entries
            .iter()
            .enumerate()
            .filter(|(_, (who, _))| *who == other)
            .nth(n - 1)
            .map(|(at, _)| at)
            .unwrap_or_else(|| panic!("{other} has fewer than {n} tokens"));
        entries[..at].iter().filter(|(who, _)| *who == name).count()
    }
}

/// A sink that logs `name`'s tokens and, at the `at`-th token it sees, submits `then` to `model`.
struct Trigger {
    name: &'static str,
    log: Arc<Log>,
    at: usize,
    then: Option<(&'static LocalModel, &'static [Request], Arc<dyn TokenSink>)>,
    seen: Mutex<usize>,
    started: Mutex<Option<SampleFuture<'static>>>,
}

impl Trigger {
    fn new(name: &'static str, log: &Arc<Log>) -> Arc<Trigger> {
        Arc::new(Trigger {
            name,
            log: Arc::clone(log),
            at: 0,
            then: None,
            seen: Mutex::new(0),
            started: Mutex::new(None),
        })
    }

    fn then(
        name: &'static str,
        log: &Arc<Log>,
        at: usize,
        model: &'static LocalModel,
        requests: Vec<Request>,
        sink: Arc<dyn TokenSink>,
    ) -> Arc<Trigger> {
        let requests: &'static [Request] = Box::leak(requests.into_boxed_slice());
        Arc::new(Trigger {
            at,
            then: Some((model, requests, sink)),
            ..Arc::into_inner(Trigger::new(name, log)).unwrap()
        })
    }

    /// The results of the request submitted from the callback.
    async fn triggered(&self) -> Vec<Result<Completion, SamplerError>> {
        let started = self.started.lock().unwrap().take();
        started.expect("the trigger fired").await
    }
}

impl TokenSink for Trigger {
    fn token(&self, index: usize, _token: u32, _logprob: f32) -> bool {
        self.log.0.lock().unwrap().push((self.name, index));
        let mut seen = self.seen.lock().unwrap();
        *seen += 1;
        if *seen == self.at {
            if let Some((model, requests, sink)) = &self.then {
                // Submits now, on the scheduler's thread; the future only waits for the results.
                let started = model.sample_streaming(requests, Arc::clone(sink));
                *self.started.lock().unwrap() = Some(started);
            }
        }
        true
    }
}

async fn alone(limits: Limits, requests: &[Request]) -> Vec<Completion> {
    model(limits, 1 << 16)
        .sample(requests)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

fn assert_same(a: &[Completion], b: &[Completion], what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (a, b)) in a.iter().zip(b).enumerate() {
        assert_eq!(a.tokens, b.tokens, "{what} {i}");
        assert_eq!(a.finish, b.finish, "{what} {i}");
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-4, "{what} {i}: {x} vs {y}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_request_joins_a_long_one_and_finishes_first() {
    let long = vec![request(prompt(1, 20), 200, 3)];
    let short = vec![request(prompt(2, 12), 4, 9)];
    let log = Arc::new(Log::default());
    let model = model(Limits::default(), 1 << 16);
    let short_sink = Trigger::new("short", &log);
    let long_sink = Trigger::then("long", &log, 1, model, short.clone(), short_sink);
    let long_result = model
        .sample_streaming(&long, Arc::clone(&long_sink) as Arc<dyn TokenSink>)
        .await;
    let short_result = long_sink.triggered().await;
    let long_result: Vec<Completion> = long_result.into_iter().map(Result::unwrap).collect();
    let short_result: Vec<Completion> = short_result.into_iter().map(Result::unwrap).collect();
    assert_eq!(
        long_result[0].tokens.len(),
        200,
        "the long request ran its length"
    );
    assert_eq!(short_result[0].tokens.len(), 4);
    // Submitted after the long one's first token, the short one joins at the next step and ends four
    // steps later; lock-step batching would have made it wait for all 200.
    let long_before_short_ended = log.before("long", "short", 4);
    assert!(
        long_before_short_ended <= 6,
        "the long request sampled {long_before_short_ended} tokens before the short one ended"
    );
    // Neither request's tokens depend on the other.
    assert_same(&long_result, &alone(Limits::default(), &long).await, "long");
    assert_same(
        &short_result,
        &alone(Limits::default(), &short).await,
        "short",
    );
}

/// With `batch_invariant`, a request's tokens and log-probabilities are the same bits alone (its prompt
/// prefilled in chunks of 16) as in a batch with a long and a short prompt (one padded prefill, then
/// decoding beside rows of other lengths that leave at other steps).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_invariant_sampling_gives_a_request_the_same_bits_whatever_runs_beside_it() {
    let invariant = Limits {
        batch_invariant: true,
        ..Limits::default()
    };
    let target = request(prompt(3, 40), 30, 7);
    let chunked = Limits {
        max_num_batched_tokens: 16,
        ..invariant
    };
    let by_itself = alone(chunked, std::slice::from_ref(&target)).await;
    let batch = [
        request(prompt(5, 200), 40, 1),
        target,
        request(prompt(9, 7), 12, 2),
    ];
    let beside_others = alone(invariant, &batch).await;
    let (a, b) = (&by_itself[0], &beside_others[1]);
    assert_eq!(a.tokens.len(), 30);
    assert_eq!(a.tokens, b.tokens);
    let bits = |c: &Completion| c.logprobs.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(a), bits(b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_many_samples_shares_a_full_batch() {
    let limits = Limits {
        max_num_seqs: 2,
        ..Limits::default()
    };
    let many: Vec<Request> = (0..4).map(|i| request(prompt(5, 16), 60, i)).collect();
    let one = vec![request(prompt(6, 10), 3, 1)];
    let log = Arc::new(Log::default());
    let model = model(limits, 1 << 16);
    let one_sink = Trigger::new("one", &log);
    let many_sink = Trigger::then("many", &log, 2, model, one.clone(), one_sink);
    let many_result = model
        .sample_streaming(&many, Arc::clone(&many_sink) as Arc<dyn TokenSink>)
        .await;
    let one_result = many_sink.triggered().await;
    let many_result: Vec<Completion> = many_result.into_iter().map(Result::unwrap).collect();
    assert!(many_result.iter().all(|c| c.tokens.len() == 60));
    assert_eq!(one_result[0].as_ref().unwrap().tokens.len(), 3);
    // Both places were the many-sample request's: one of its sequences is paused at once for the new
    // request, which ends three steps later instead of after 60.
    let before = log.before("many", "one", 3);
    assert!(
        before <= 10,
        "the 4-sample request sampled {before} tokens before the other ended"
    );
    // A paused sequence resumes where it stopped: the same tokens as without the other request.
    assert_same(&many_result, &alone(limits, &many).await, "many");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_is_prefilled_in_chunks_between_decoding_steps() {
    let limits = Limits {
        max_num_batched_tokens: 16,
        ..Limits::default()
    };
    let decoding = vec![request(prompt(3, 8), 100, 4)];
    let long_prompt = vec![request(prompt(4, 300), 2, 5)];
    let log = Arc::new(Log::default());
    let model = model(limits, 1 << 16);
    let prompt_sink = Trigger::new("prompt", &log);
    let decoding_sink = Trigger::then("decoding", &log, 1, model, long_prompt.clone(), prompt_sink);
    let decoded = model
        .sample_streaming(&decoding, Arc::clone(&decoding_sink) as Arc<dyn TokenSink>)
        .await;
    let prompted = decoding_sink.triggered().await;
    assert_eq!(decoded[0].as_ref().unwrap().tokens.len(), 100);
    // 300 prompt tokens at 16 a step: the other request decodes through the 19 steps of prefill.
    let during = log.before("decoding", "prompt", 1);
    assert!(
        during >= 18,
        "the other request sampled only {during} tokens while the long prompt was prefilled"
    );
    // Chunks give the tokens one prefill gives.
    let prompted: Vec<Completion> = prompted.into_iter().map(Result::unwrap).collect();
    assert_same(
        &prompted,
        &alone(Limits::default(), &long_prompt).await,
        "chunked",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_budget_admits_one_sequence_at_a_time() {
    let limits = Limits {
        kv_budget_bytes: 1,
        ..Limits::default()
    };
    let requests: Vec<Request> = (0..3).map(|i| request(prompt(8, 10), 5, i)).collect();
    let log = Arc::new(Log::default());
    let sink = Trigger::new("budget", &log);
    let results = model(limits, 1 << 16)
        .sample_streaming(&requests, sink as Arc<dyn TokenSink>)
        .await;
    assert!(results
        .iter()
        .all(|r| r.as_ref().unwrap().tokens.len() == 5));
    // Nothing else runs beside a sequence: each one's tokens come before the next one's.
    let order: Vec<usize> = log.entries().iter().map(|(_, index)| *index).collect();
    assert_eq!(
        order,
        vec![0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2],
        "{order:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_refuses_new_requests_and_goes_on() {
    let limits = Limits {
        max_num_seqs: 1,
        ..Limits::default()
    };
    let queued: Vec<Request> = (0..3).map(|i| request(prompt(9, 10), 5, i)).collect();
    let refused = vec![request(prompt(10, 10), 5, 1)];
    let log = Arc::new(Log::default());
    let model = model(limits, 2);
    let refused_sink = Trigger::new("refused", &log);
    let sink = Trigger::then("queued", &log, 1, model, refused, refused_sink);
    let results = model
        .sample_streaming(&queued, Arc::clone(&sink) as Arc<dyn TokenSink>)
        .await;
    // Two sequences wait behind the first one; the queue holds two.
    let refusal = sink.triggered().await;
    assert!(
        matches!(&refusal[0], Err(SamplerError::Overloaded(message)) if message.contains("at most 2")),
        "{refusal:?}"
    );
    assert!(results
        .iter()
        .all(|r| r.as_ref().unwrap().tokens.len() == 5));
    // With the queue empty again, the same request is taken.
    let again = model.sample(&[request(prompt(10, 10), 5, 1)]).await;
    assert_eq!(again[0].as_ref().unwrap().tokens.len(), 5);
}
