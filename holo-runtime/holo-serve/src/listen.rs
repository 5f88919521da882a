//! Connections: the accept loop, the connection limit, and the timeouts that close what a slow or idle
//! client leaves open.
//!
//! - At most [`ServeConfig::max_connections`] connections are open: the loop takes a slot before it
//!   accepts, so the others wait in the kernel's listen backlog (answered as soon as a slot frees) instead
//!   of failing.
//! - When `accept` fails for want of resources (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`: the process is out
//!   of file descriptors), the loop logs it (then at most every 10 s while it lasts), waits for a
//!   connection to close (or a backoff of up to a second) and tries again; it logs when accepts have
//!   succeeded for a second again.
//! - A connection that has no request in progress, new or between two requests, is closed when a whole
//!   request head has not arrived within [`ServeConfig::keep_alive_timeout`] (hyper's header-read timeout,
//!   which starts whenever the connection waits for a head): idle keep-alive sockets and slow headers both.
//! - A request body that has not fully arrived within [`ServeConfig::timeout`] of its head is a 408 (see
//!   [`Deadline`]); a client that reads nothing of its response for that long is disconnected (see
//!   [`Stall`]).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tower::ServiceExt;

use super::log::Tally;
use super::*;

/// What the accept loop shares with `/metrics`.
#[derive(Debug)]
pub(super) struct Connections {
    slots: Arc<Semaphore>,
    max: usize,
    /// Notified when a connection closes, for an accept loop out of file descriptors.
    closed: Notify,
}

impl Connections {
    pub(super) fn new(max: usize) -> Self {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        Connections {
            slots: Arc::new(Semaphore::new(max)),
            max,
            closed: Notify::new(),
        }
    }

    /// Connections open now.
    pub(super) fn open(&self) -> usize {
        self.max - self.slots.available_permits()
    }
}

/// A run of failed accepts, logged at its first failure and then every [`REPEAT`]: when connections
/// close one at a time, accepts succeed and fail in turn, and one line per failure would flood the log.
struct Failing {
    failures: u64,
    since: Instant,
    last: Instant,
    logged: Option<Instant>,
}

/// How often a run of failed accepts is logged.
const REPEAT: Duration = Duration::from_secs(10);

/// How long accepts must go without failing for a run of failures to end.
const CALM: Duration = Duration::from_secs(1);

/// Accepts connections until `shutdown` completes, then lets every open connection finish its request
/// in flight and returns once all are closed.
pub(super) async fn serve(
    listener: TcpListener,
    app: Router,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let connections = Arc::clone(&state.connections);
    let (stop, stopping) = watch::channel(false);
    tokio::pin!(shutdown);
    let mut failing: Option<Failing> = None;
    loop {
        let slot = tokio::select! {
            slot = Arc::clone(&connections.slots).acquire_owned() => slot.expect("the slots are never closed"),
            () = &mut shutdown => break,
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                if failing
                    .as_ref()
                    .is_some_and(|failing| failing.last.elapsed() >= CALM)
                {
                    let failing = failing.take().expect("checked");
                    tracing::warn!(
                        target: "holo::serve",
                        failures = failing.failures,
                        seconds = failing.since.elapsed().as_secs_f64(),
                        "accepting connections again"
                    );
                }
                stream
            }
            // The client gave up before it was accepted: nothing to do for it.
            Err(error) if per_connection(&error) => continue,
            Err(error) => {
                drop(slot);
                let now = Instant::now();
                let failing = failing.get_or_insert(Failing {
                    failures: 0,
                    since: now,
                    last: now,
                    logged: None,
                });
                failing.failures += 1;
                failing.last = now;
                if failing
                    .logged
                    .is_none_or(|logged| logged.elapsed() >= REPEAT)
                {
                    failing.logged = Some(now);
                    tracing::warn!(
                        target: "holo::serve",
                        %error,
                        failures = failing.failures,
                        open_connections = connections.open(),
                        "cannot accept connections; waiting for connections to close (lower \
                         --max-connections or raise the file limit, `ulimit -n`)"
                    );
                }
                let backoff = Duration::from_millis(10 << failing.failures.min(7))
                    .min(Duration::from_secs(1));
                tokio::select! {
                    () = connections.closed.notified() => {}
                    () = tokio::time::sleep(backoff) => {}
                    () = &mut shutdown => break,
                }
                continue;
            }
        };
        tokio::spawn(connection(
            stream,
            slot,
            app.clone(),
            Arc::clone(&state),
            stopping.clone(),
        ));
    }
    let _ = stop.send(true);
    drop(listener);
    // Every slot back: every connection has closed.
    let _ = connections.slots.acquire_many(connections.max as u32).await;
    Ok(())
}

/// Serves one connection until the client or a timeout closes it, or the server stops (after the
/// request in flight).
async fn connection(
    stream: TcpStream,
    slot: OwnedSemaphorePermit,
    app: Router,
    state: Arc<AppState>,
    mut stopping: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let (timeout, keep_alive) = (state.config.timeout, state.config.keep_alive_timeout);
    let connections = Arc::clone(&state.connections);
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let app = app.clone();
        let state = Arc::clone(&state);
        async move {
            let tally = Tally::new(&request);
            let mut request = request.map(|body| Body::new(Deadline::new(body, timeout)));
            request.extensions_mut().insert(tally.clone());
            let response = app.oneshot(request).await?;
            Ok::<_, Infallible>(tally.watch(response, state))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(keep_alive)
        .keep_alive(true);
    let connection = builder.serve_connection(TokioIo::new(Stall::new(stream, timeout)), service);
    tokio::pin!(connection);
    let stop = async move {
        let _ = stopping.wait_for(|stop| *stop).await;
    };
    tokio::select! {
        _ = connection.as_mut() => {}
        () = stop => {
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
    }
    drop(slot);
    connections.closed.notify_one();
}

/// Errors of one connection that `accept` reports; the next accept is unaffected.
fn per_connection(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

// ---------------------------------------------------------------------------------------------------
// Timeouts

/// Why a request body ended early: it had not fully arrived in time.
#[derive(Debug)]
pub(super) struct BodyTimeout(pub(super) Duration);

impl fmt::Display for BodyTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the request body did not arrive within {} s",
            self.0.as_secs_f64()
        )
    }
}

impl std::error::Error for BodyTimeout {}

impl BodyTimeout {
    /// Whether `error`, or an error it wraps, is a body timeout.
    pub(super) fn caused(error: &(dyn std::error::Error + 'static)) -> bool {
        let mut cause = Some(error);
        while let Some(error) = cause {
            if error.is::<BodyTimeout>() {
                return true;
            }
            cause = error.source();
        }
        false
    }
}

/// A request body that fails with [`BodyTimeout`] when it has not ended within its time.
pub(super) struct Deadline {
    body: Incoming,
    limit: Duration,
    sleep: Pin<Box<Sleep>>,
}

impl Deadline {
    fn new(body: Incoming, limit: Duration) -> Self {
        Deadline {
            body,
            limit,
            sleep: Box::pin(tokio::time::sleep(limit)),
        }
    }
}

impl hyper::body::Body for Deadline {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        ready!(self.sleep.as_mut().poll(cx));
        Poll::Ready(Some(Err(Box::new(BodyTimeout(self.limit)))))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A connection whose writes fail with `TimedOut` when the client has read nothing for `limit` (its
/// receive window and the socket's buffer full): a client that stops reading a response does not hold
/// the connection, or the tokens queued for it, forever.
struct Stall {
    stream: TcpStream,
    limit: Duration,
    /// Running while a write waits.
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Stall {
    fn new(stream: TcpStream, limit: Duration) -> Self {
        Stall {
            stream,
            limit,
            sleep: None,
        }
    }

    /// `poll` of a write: pending writes start the clock, a write that goes through stops it.
    fn watch<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.sleep = None;
            return poll;
        }
        let limit = self.limit;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(sleep.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the client read nothing of the response for {} s",
                limit.as_secs_f64()
            ),
        )))
    }
}

impl AsyncRead for Stall {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Stall {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_shutdown(cx);
        self.watch(cx, poll)
    }
}
