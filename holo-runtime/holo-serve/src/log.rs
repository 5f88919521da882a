//! The access log and the request counters: each request's [`Tally`] gathers what the log line and
//! `/metrics` report, and is written once its response has been sent (or its client has gone).
//!
//! The line is a `tracing` event at `INFO` with target `holo::access`, message `request`, and the fields
//! `id` (the answer's `cmpl-…`/`chatcmpl-…` id, `-` when there is none), `method`, `path`, `status`,
//! `prompt_tokens`, `completion_tokens`, `queue_ms` (from the request's arrival until the sampler started
//! its first sample; `-` when the sampler does not say), `total_ms` (until the response's last byte was
//! handed to the connection) and `finished` (`false` when the client left before the end).

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::AtomicUsize;
use std::sync::{Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use hyper::body::{Frame, SizeHint};

use super::*;

/// What one request's log line says, filled in as the request goes.
#[derive(Clone)]
pub(super) struct Tally(Arc<Fill>);

struct Fill {
    method: Method,
    path: String,
    received: Instant,
    id: OnceLock<String>,
    prompt_tokens: AtomicUsize,
    completion_tokens: AtomicUsize,
    started: OnceLock<Instant>,
    /// The version of the weights the request named.
    weight_version: OnceLock<u64>,
    /// The request body's `content-length`, when given.
    body_bytes: u64,
}

impl Tally {
    pub(super) fn new<B>(request: &Request<B>) -> Self {
        Tally(Arc::new(Fill {
            method: request.method().clone(),
            path: request.uri().path().to_string(),
            received: Instant::now(),
            id: OnceLock::new(),
            prompt_tokens: AtomicUsize::new(0),
            completion_tokens: AtomicUsize::new(0),
            started: OnceLock::new(),
            weight_version: OnceLock::new(),
            body_bytes: request
                .headers()
                .get(axum::http::header::CONTENT_LENGTH)
                .and_then(|value| value.to_str().ok()?.parse().ok())
                .unwrap_or(0),
        }))
    }

    /// The answer's id.
    pub(super) fn id(&self, id: &str) {
        let _ = self.0.id.set(id.to_string());
    }

    pub(super) fn prompt_tokens(&self, count: usize) {
        self.0.prompt_tokens.store(count, Ordering::Relaxed);
    }

    pub(super) fn add_completion_tokens(&self, count: usize) {
        self.0.completion_tokens.fetch_add(count, Ordering::Relaxed);
    }

    /// The request samples with weights of this version.
    pub(super) fn weight_version(&self, version: u64) {
        let _ = self.0.weight_version.set(version);
    }

    /// The version of the weights the request samples with, once it named them.
    pub(super) fn weight_versioned(&self) -> Option<u64> {
        self.0.weight_version.get().copied()
    }

    /// The sampler has started one of the request's samples (the first call counts).
    pub(super) fn started(&self) {
        let _ = self.0.started.set(Instant::now());
    }

    /// The response, written to the log and the counters when its body has been sent or dropped.
    pub(super) fn watch(self, response: Response, state: Arc<AppState>) -> Response {
        let status = response.status();
        response.map(|body| {
            Body::new(Watched {
                body,
                end: Some(End {
                    tally: self,
                    state,
                    status,
                }),
            })
        })
    }
}

/// A response body that reports its request when it ends.
struct Watched {
    body: Body,
    end: Option<End>,
}

struct End {
    tally: Tally,
    state: Arc<AppState>,
    status: StatusCode,
}

impl End {
    fn report(self, finished: bool) {
        let fill = &self.tally.0;
        let total = fill.received.elapsed();
        let queue = fill
            .started
            .get()
            .map(|started| started.saturating_duration_since(fill.received));
        let prompt_tokens = fill.prompt_tokens.load(Ordering::Relaxed);
        let completion_tokens = fill.completion_tokens.load(Ordering::Relaxed);
        tracing::info!(
            target: "holo::access",
            id = %fill.id.get().map_or("-", String::as_str),
            method = %fill.method,
            path = %fill.path,
            status = self.status.as_u16(),
            prompt_tokens,
            completion_tokens,
            queue_ms = %queue.map_or("-".to_string(), |queue| format!("{:.1}", millis(queue))),
            total_ms = %format!("{:.1}", millis(total)),
            finished,
            "request"
        );
        // A large body's buffers (the body, its parsed JSON, its tokens) are freed by now.
        if fill.body_bytes >= LARGE_BODY {
            holo_core::trim::release();
        }
        self.state
            .counters
            .record(self.status, prompt_tokens, completion_tokens, queue, total);
    }
}

/// Bodies from which on the allocator's free memory is given back after the request.
const LARGE_BODY: u64 = 1 << 20;

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

impl hyper::body::Body for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let poll = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(None | Some(Err(_))) = &poll {
            if let Some(end) = self.end.take() {
                end.report(matches!(poll, Poll::Ready(None)));
            }
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if let Some(end) = self.end.take() {
            // A body hyper never polled to its end: sent whole when it said it had ended (a fixed-length
            // body is not polled past its last frame), cut short otherwise.
            let finished = hyper::body::Body::is_end_stream(&self.body);
            end.report(finished);
        }
    }
}

/// The server's request counters since it started, for `/metrics`.
#[derive(Debug, Default)]
pub(super) struct Counters {
    /// Requests answered, by status.
    requests: Mutex<BTreeMap<u16, u64>>,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    /// Sums (seconds) and counts of the queue and total times.
    times: Mutex<Times>,
}

#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Times {
    pub(super) queue_seconds: f64,
    pub(super) queued: u64,
    pub(super) total_seconds: f64,
    pub(super) requests: u64,
}

impl Counters {
    fn record(
        &self,
        status: StatusCode,
        prompt_tokens: usize,
        completion_tokens: usize,
        queue: Option<Duration>,
        total: Duration,
    ) {
        *self
            .requests
            .lock()
            .expect("counters")
            .entry(status.as_u16())
            .or_default() += 1;
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(completion_tokens as u64, Ordering::Relaxed);
        let mut times = self.times.lock().expect("counters");
        if let Some(queue) = queue {
            times.queue_seconds += queue.as_secs_f64();
            times.queued += 1;
        }
        times.total_seconds += total.as_secs_f64();
        times.requests += 1;
    }

    pub(super) fn requests(&self) -> BTreeMap<u16, u64> {
        self.requests.lock().expect("counters").clone()
    }

    pub(super) fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens.load(Ordering::Relaxed)
    }

    pub(super) fn completion_tokens(&self) -> u64 {
        self.completion_tokens.load(Ordering::Relaxed)
    }

    pub(super) fn times(&self) -> Times {
        *self.times.lock().expect("counters")
    }
}
