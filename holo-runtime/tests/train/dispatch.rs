//! The rollout servers' sampler ([`QuickestServer`]) against two fake OpenAI-compatible servers, one
//! slow (it holds its requests while told to, and is measured ten times slower), one fast: requests go
//! to the server that would be done with them first, a server not measured yet first, and wait for
//! room rather than queue on a full server, so a slow server does not hold up the rollouts a fast one
//! could sample. The pool's clock moves only when a fake server answers, by a fixed tick of that
//! server's, so what it measures does not depend on how busy the machine running the test is.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use holo_runtime::train::sync::{Clock, QuickestServer, Servers};
use holo_runtime::{OpenAi, OpenAiConfig, Prompt, Request, SampleParams, Sampler};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::common::http::read_request;

/// How long the test waits for any one event before it fails (nothing here takes more than a few
/// milliseconds when it works).
const DEADLINE: Duration = Duration::from_secs(60);

/// How far the pool's clock moves when the slow server answers, and when the fast one does.
const SLOW_TICK: Duration = Duration::from_millis(100);
const FAST_TICK: Duration = Duration::from_millis(8);

/// The pool's clock: it moves only when a fake server answers.
struct Ticking {
    start: Instant,
    elapsed: Mutex<Duration>,
}

impl Clock for Ticking {
    fn now(&self) -> Instant {
        self.start + *self.elapsed.lock().unwrap()
    }
}

/// A fake completions server: it answers every request with one token, at once, or, while `hold`
/// is true, once the test sets it false, moving `clock` on by `tick` first; each request is counted
/// and announced on `arrived`.
struct Fake {
    url: String,
    answered: Arc<AtomicUsize>,
}

async fn fake(
    hold: watch::Receiver<bool>,
    arrived: mpsc::UnboundedSender<()>,
    clock: Arc<Ticking>,
    tick: Duration,
) -> Fake {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let answered = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&answered);
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let (mut hold, arrived, counted) = (hold.clone(), arrived.clone(), counted.clone());
            let clock = Arc::clone(&clock);
            tokio::spawn(async move {
                while let Some(request) = read_request(&mut stream).await {
                    assert_eq!(request.path, "/v1/completions");
                    let _ = arrived.send(());
                    if hold.wait_for(|held| !held).await.is_err() {
                        return;
                    }
                    counted.fetch_add(1, Ordering::SeqCst);
                    *clock.elapsed.lock().unwrap() += tick;
                    let body = r#"{"choices":[{"index":0,"text":"x","finish_reason":"length"}]}"#;
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    if stream.write_all(head.as_bytes()).await.is_err()
                        || stream.write_all(body.as_bytes()).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    Fake { url, answered }
}

fn request() -> Request {
    Request {
        prompt: Prompt::Text("hi".into()),
        params: SampleParams {
            max_tokens: Some(1),
            ..SampleParams::default()
        },
    }
}

/// Samples `batch` within the deadline, every answer a completion.
async fn sampled(sampler: &QuickestServer, batch: &[Request], what: &str) {
    let answers = tokio::time::timeout(DEADLINE, sampler.sample(batch))
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {DEADLINE:?}"));
    for answer in answers {
        answer.unwrap_or_else(|error| panic!("{what}: {error}"));
    }
}

/// Two fake servers, the first (slow) holding its requests until released, the second (fast) while
/// told to, under one sampler whose servers run `capacity` requests at once; requests arriving at
/// each are announced on the receivers.
struct Pool {
    slow: Fake,
    fast: Fake,
    servers: Arc<Servers>,
    sampler: Arc<QuickestServer>,
    release: watch::Sender<bool>,
    hold_fast: watch::Sender<bool>,
    at_slow: mpsc::UnboundedReceiver<()>,
    at_fast: mpsc::UnboundedReceiver<()>,
}

impl Pool {
    /// The requests outstanding on the slow server and on the fast one.
    fn outstanding(&self) -> (usize, usize) {
        (self.servers.outstanding(0), self.servers.outstanding(1))
    }

    /// Holds both servers' answers until `release_for`.
    fn hold_both(&self) {
        self.release.send(true).unwrap();
        self.hold_fast.send(true).unwrap();
    }

    /// Waits for `count` requests to arrive at either server: how many at the slow one and at the
    /// fast one.
    async fn arrivals(&mut self, count: usize) -> (usize, usize) {
        let mut arrived = (0, 0);
        for _ in 0..count {
            let at = async {
                tokio::select! {
                    Some(()) = self.at_slow.recv() => (1, 0),
                    Some(()) = self.at_fast.recv() => (0, 1),
                }
            };
            let (slow, fast) = tokio::time::timeout(DEADLINE, at)
                .await
                .unwrap_or_else(|_| panic!("{count} requests did not arrive within {DEADLINE:?}"));
            arrived = (arrived.0 + slow, arrived.1 + fast);
        }
        arrived
    }
}

async fn pool(capacity: usize) -> Pool {
    let (release, held) = watch::channel(true);
    let (hold_fast, fast_held) = watch::channel(false);
    let (arrived_slow, at_slow) = mpsc::unbounded_channel();
    let (arrived_fast, at_fast) = mpsc::unbounded_channel();
    let clock = Arc::new(Ticking {
        start: Instant::now(),
        elapsed: Mutex::new(Duration::ZERO),
    });
    let slow = fake(held, arrived_slow, Arc::clone(&clock), SLOW_TICK).await;
    let fast = fake(fast_held, arrived_fast, Arc::clone(&clock), FAST_TICK).await;
    let urls = vec![slow.url.clone(), fast.url.clone()];
    let servers = Arc::new(Servers::with_clock(urls.clone(), capacity, clock));
    let samplers = urls
        .iter()
        .map(|url| OpenAi::new(OpenAiConfig::new(url, "m")).unwrap())
        .collect();
    let sampler = Arc::new(QuickestServer::new(
        samplers,
        vec!["m".into(), "m".into()],
        None,
        Arc::clone(&servers),
        reqwest::Client::new(),
        Duration::from_secs(5),
    ));
    Pool {
        slow,
        fast,
        servers,
        sampler,
        release,
        hold_fast,
        at_slow,
        at_fast,
    }
}

/// A pool whose slow server was sent one request and the fast one the next, one at a time: measured
/// at their ticks per request (the fakes' answers carry no token ids, so a request counts one token).
async fn measured(capacity: usize) -> Pool {
    let mut pool = pool(capacity).await;
    pool.release.send(false).unwrap();
    // Neither measured: the first goes to the first server; the second, to the one not measured yet.
    sampled(
        &pool.sampler,
        &[request()],
        "the slow server's first request",
    )
    .await;
    sampled(
        &pool.sampler,
        &[request()],
        "the fast server's first request",
    )
    .await;
    arrival(&mut pool.at_slow, "the slow server's first request").await;
    arrival(&mut pool.at_fast, "the fast server's first request").await;
    assert_eq!(pool.slow.answered.load(Ordering::SeqCst), 1);
    assert_eq!(pool.fast.answered.load(Ordering::SeqCst), 1);
    assert_measured(&pool, 0, SLOW_TICK);
    assert_measured(&pool, 1, FAST_TICK);
    pool
}

/// Server `index` is measured at `per_token` (to the nanosecond a float's seconds round to).
fn assert_measured(pool: &Pool, index: usize, per_token: Duration) {
    let measured = pool.servers.per_token(index).expect("measured");
    assert!(
        measured.abs_diff(per_token) <= Duration::from_nanos(1),
        "server {index}: {measured:?} per token, not {per_token:?}"
    );
}

async fn arrival(at: &mut mpsc::UnboundedReceiver<()>, what: &str) {
    tokio::time::timeout(DEADLINE, at.recv())
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing arrived within {DEADLINE:?}"))
        .unwrap();
}

/// Samples a batch of `size` requests on a task of its own.
fn spawn_batch(
    sampler: &Arc<QuickestServer>,
    size: usize,
    what: &'static str,
) -> tokio::task::JoinHandle<()> {
    let sampler = Arc::clone(sampler);
    tokio::spawn(async move {
        let batch: Vec<Request> = (0..size).map(|_| request()).collect();
        sampled(&sampler, &batch, what).await
    })
}

/// Lets the held servers answer, and waits for `task`'s requests to be answered.
async fn release_for(pool: &Pool, task: tokio::task::JoinHandle<()>) {
    pool.release.send(false).unwrap();
    pool.hold_fast.send(false).unwrap();
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("answered once the held server is released")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_to_the_server_that_is_done_first() {
    let mut pool = pool(8).await;

    // Both idle and not measured: the first request goes to the first server, which holds it.
    let first = spawn_batch(&pool.sampler, 1, "the held request");
    arrival(&mut pool.at_slow, "the first request at the first server").await;
    assert_eq!(pool.outstanding(), (1, 0));

    // While it is held, one rollout's requests after another go to the other server, measured fast
    // (the held one counts as fast as it, with one outstanding): taken in turn, every second one
    // would wait behind the held one (and this would time out).
    for turn in 0..6 {
        sampled(&pool.sampler, &[request()], &format!("request {turn}")).await;
    }
    assert_eq!(pool.fast.answered.load(Ordering::SeqCst), 6);
    assert_eq!(pool.slow.answered.load(Ordering::SeqCst), 0);
    assert_eq!(pool.outstanding(), (1, 0));
    assert!(
        pool.at_slow.try_recv().is_err(),
        "nothing more was sent to the held server"
    );

    // Released, it answers, measured at all the time it was held (the six others' ticks and its
    // own); a batch then goes to the other server, which would be done with four before it with one.
    release_for(&pool, first).await;
    assert_eq!(pool.outstanding(), (0, 0));
    assert_measured(&pool, 0, SLOW_TICK + 6 * FAST_TICK);
    let batch: Vec<Request> = (0..4).map(|_| request()).collect();
    sampled(&pool.sampler, &batch, "the batch").await;
    assert_eq!(pool.slow.answered.load(Ordering::SeqCst), 1);
    assert_eq!(pool.fast.answered.load(Ordering::SeqCst), 6 + 4);
    assert_eq!(pool.outstanding(), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_measured_slow_is_sent_fewer_of_a_batch_while_both_have_room() {
    // Room for 64 on each. The fast server, 12.5 times as fast, takes requests until it would be
    // done with its next after the slow server with one: (12 + 1) × 8 ms > 100 ms. Split on
    // outstanding alone, as before, each would take 8, and the step would wait for the slow one's.
    let mut pool = measured(64).await;
    pool.hold_both();
    let batch = spawn_batch(&pool.sampler, 16, "the batch");
    assert_eq!(pool.arrivals(16).await, (1, 15));
    assert_eq!(pool.outstanding(), (1, 15));
    release_for(&pool, batch).await;
    assert_eq!(pool.slow.answered.load(Ordering::SeqCst), 1 + 1);
    assert_eq!(pool.fast.answered.load(Ordering::SeqCst), 1 + 15);
    assert_eq!(pool.outstanding(), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_holds_however_fast_a_server_is() {
    // Room for 4 on each: the fast server takes 4, and the slow one the 2 the fast one has no room
    // for, although the fast one would be done with them first.
    let mut pool = measured(4).await;
    pool.hold_both();
    let batch = spawn_batch(&pool.sampler, 6, "the batch");
    assert_eq!(pool.arrivals(6).await, (2, 4));
    assert_eq!(pool.outstanding(), (2, 4));
    release_for(&pool, batch).await;
    assert_eq!(pool.slow.answered.load(Ordering::SeqCst), 1 + 2);
    assert_eq!(pool.fast.answered.load(Ordering::SeqCst), 1 + 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_back_in_the_pool_is_measured_anew_and_tried_first() {
    let pool = measured(64).await;
    // Measured slow, it is not sent the next request.
    sampled(&pool.sampler, &[request()], "a third request").await;
    assert_eq!(pool.fast.answered.load(Ordering::SeqCst), 2);

    // Dropped, its measurement is forgotten: back in the pool it is tried first, although the fast
    // server's turn comes first and the slow one was measured twelve times slower.
    pool.servers.drop_server(0, "the test drops it");
    assert_eq!(pool.servers.per_token(0), None);
    pool.servers.rejoin(0);
    sampled(
        &pool.sampler,
        &[request()],
        "the first request after it is back",
    )
    .await;
    assert_eq!(pool.slow.answered.load(Ordering::SeqCst), 2);
    assert_eq!(pool.fast.answered.load(Ordering::SeqCst), 2);
    assert_measured(&pool, 0, SLOW_TICK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_waits_for_room_and_goes_to_the_server_done_first() {
    // One request at a time on each server: of a batch of five, the held server takes one and the
    // other the four others, one after another. Split on arrival (three and two), the held server's
    // second would wait behind its first and the other server would see only two or three.
    let mut pool = pool(1).await;
    let batch = spawn_batch(&pool.sampler, 5, "the batch");
    arrival(
        &mut pool.at_slow,
        "the batch's first request at the held server",
    )
    .await;
    for turn in 0..4 {
        arrival(&mut pool.at_fast, &format!("request {turn} of the others")).await;
    }
    assert!(
        pool.at_slow.try_recv().is_err(),
        "one request on the held server"
    );
    release_for(&pool, batch).await;
    assert_eq!(pool.slow.answered.load(Ordering::SeqCst), 1);
    assert_eq!(pool.fast.answered.load(Ordering::SeqCst), 4);
    assert_eq!(pool.outstanding(), (0, 0));
}
