//! The rollout servers' sampler ([`LeastOutstanding`]) against two fake OpenAI-compatible servers, one
//! of which holds its requests: requests go to the server with the fewest outstanding, and wait for
//! room rather than queue on a full server, so a slow server does not hold up the rollouts a fast one
//! could sample.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use holo_runtime::train::sync::{LeastOutstanding, Servers};
use holo_runtime::{OpenAi, OpenAiConfig, Prompt, Request, SampleParams, Sampler};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::common::http::read_request;

/// How long the test waits for any one event before it fails (nothing here takes more than a few
/// milliseconds when it works).
const DEADLINE: Duration = Duration::from_secs(60);

/// A fake completions server: it answers every request with one token, at once, or, while `hold`
/// is true, once the test sets it false; each request is counted and announced on `arrived`.
struct Fake {
    url: String,
    answered: Arc<AtomicUsize>,
}

async fn fake(hold: watch::Receiver<bool>, arrived: mpsc::UnboundedSender<()>) -> Fake {
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
            tokio::spawn(async move {
                while let Some(request) = read_request(&mut stream).await {
                    assert_eq!(request.path, "/v1/completions");
                    let _ = arrived.send(());
                    if hold.wait_for(|held| !held).await.is_err() {
                        return;
                    }
                    counted.fetch_add(1, Ordering::SeqCst);
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
async fn sampled(sampler: &LeastOutstanding, batch: &[Request], what: &str) {
    let answers = tokio::time::timeout(DEADLINE, sampler.sample(batch))
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {DEADLINE:?}"));
    for answer in answers {
        answer.unwrap_or_else(|error| panic!("{what}: {error}"));
    }
}

/// Two fake servers, the first holding its requests while `held` is true, under one sampler whose
/// servers run `capacity` requests at once; requests arriving at each are announced on the receivers.
struct Pool {
    slow: Fake,
    fast: Fake,
    servers: Arc<Servers>,
    sampler: Arc<LeastOutstanding>,
    release: watch::Sender<bool>,
    at_slow: mpsc::UnboundedReceiver<()>,
    at_fast: mpsc::UnboundedReceiver<()>,
    _free: watch::Sender<bool>,
}

impl Pool {
    /// The requests outstanding on the held server and on the other.
    fn outstanding(&self) -> (usize, usize) {
        (self.servers.outstanding(0), self.servers.outstanding(1))
    }
}

async fn pool(capacity: usize) -> Pool {
    let (release, held) = watch::channel(true);
    let (free_sender, free) = watch::channel(false);
    let (arrived_slow, at_slow) = mpsc::unbounded_channel();
    let (arrived_fast, at_fast) = mpsc::unbounded_channel();
    let slow = fake(held, arrived_slow).await;
    let fast = fake(free, arrived_fast).await;
    let urls = vec![slow.url.clone(), fast.url.clone()];
    let servers = Arc::new(Servers::new(urls.clone(), capacity));
    let samplers = urls
        .iter()
        .map(|url| OpenAi::new(OpenAiConfig::new(url, "m")).unwrap())
        .collect();
    let sampler = Arc::new(LeastOutstanding::new(
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
        at_slow,
        at_fast,
        _free: free_sender,
    }
}

async fn arrival(at: &mut mpsc::UnboundedReceiver<()>, what: &str) {
    tokio::time::timeout(DEADLINE, at.recv())
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing arrived within {DEADLINE:?}"))
        .unwrap();
}

/// Samples a batch of `size` requests on a task of its own.
fn spawn_batch(
    sampler: &Arc<LeastOutstanding>,
    size: usize,
    what: &'static str,
) -> tokio::task::JoinHandle<()> {
    let sampler = Arc::clone(sampler);
    tokio::spawn(async move {
        let batch: Vec<Request> = (0..size).map(|_| request()).collect();
        sampled(&sampler, &batch, what).await
    })
}

/// Lets the held server answer, and waits for `task`'s requests to be answered.
async fn release_for(release: &watch::Sender<bool>, task: tokio::task::JoinHandle<()>) {
    release.send(false).unwrap();
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("answered once the held server is released")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_to_the_server_with_the_fewest_outstanding() {
    let mut pool = pool(8).await;

    // Both idle: the first request goes to the first server, which holds it.
    let first = spawn_batch(&pool.sampler, 1, "the held request");
    arrival(&mut pool.at_slow, "the first request at the first server").await;
    assert_eq!(pool.outstanding(), (1, 0));

    // While it is held, one rollout's requests after another go to the other server: taken in turn,
    // every second one would wait behind the held one (and this would time out).
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

    // Released, it answers; a batch then splits evenly between the two idle servers.
    release_for(&pool.release, first).await;
    assert_eq!(pool.outstanding(), (0, 0));
    let batch: Vec<Request> = (0..4).map(|_| request()).collect();
    sampled(&pool.sampler, &batch, "the batch").await;
    assert_eq!(pool.slow.answered.load(Ordering::SeqCst), 1 + 2);
    assert_eq!(pool.fast.answered.load(Ordering::SeqCst), 6 + 2);
    assert_eq!(pool.outstanding(), (0, 0));
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
    release_for(&pool.release, batch).await;
    assert_eq!(pool.slow.answered.load(Ordering::SeqCst), 1);
    assert_eq!(pool.fast.answered.load(Ordering::SeqCst), 4);
    assert_eq!(pool.outstanding(), (0, 0));
}
