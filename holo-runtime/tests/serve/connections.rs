//! Connections: the connection limit, the keep-alive, header and body timeouts, a server that stays
//! responsive while a huge body arrives, and `/metrics`. Every wait is for an event (a response, the
//! server closing a socket), bounded so that a regression fails instead of hanging; the server's own
//! timeouts are short so that the events come quickly.

use std::collections::BTreeMap;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;

/// The longest a test waits for an event.
const BOUND: Duration = Duration::from_secs(30);

/// Reads until the server closes the connection; what it sent.
async fn read_to_close(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    tokio::time::timeout(BOUND, stream.read_to_end(&mut received))
        .await
        .expect("the server closed the connection in time")
        .expect("the connection reads");
    String::from_utf8_lossy(&received).into_owned()
}

/// Reads one HTTP/1.1 response whose body has a `content-length`; the status line and the body.
async fn read_response(stream: &mut TcpStream) -> (String, String) {
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&received).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length: usize = text[..end]
                .lines()
                .find_map(|line| {
                    let (name, value) = line.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().unwrap())
                })
                .expect("a content-length");
            if received.len() >= end + 4 + length {
                let status = text.lines().next().unwrap().to_string();
                return (status, text[end + 4..end + 4 + length].to_string());
            }
        }
        let read = tokio::time::timeout(BOUND, stream.read(&mut buffer))
            .await
            .expect("the response came in time")
            .expect("the connection reads");
        assert!(read > 0, "the server closed before answering: {text:?}");
        received.extend_from_slice(&buffer[..read]);
    }
}

fn short_timeouts() -> ServeConfig {
    ServeConfig {
        keep_alive_timeout: Duration::from_millis(200),
        timeout: Duration::from_millis(200),
        ..ServeConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_over_the_limit_time_out_and_the_next_request_is_answered() {
    let f = start_with(
        ServeConfig {
            max_connections: 3,
            ..short_timeouts()
        },
        None,
        Duration::ZERO,
    )
    .await;
    let addr = f.server.local_addr();
    // Three idle sockets take every slot; a fourth connection waits in the backlog with its request.
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut waiting = TcpStream::connect(addr).await.unwrap();
    waiting
        .write_all(b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n")
        .await
        .unwrap();
    // The server closes the idle sockets (they sent nothing), and then answers the waiting one.
    for socket in &mut idle {
        assert_eq!(read_to_close(socket).await, "");
    }
    let (status, body) = read_response(&mut waiting).await;
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"status": "ok"})
    );
    // The answered connection is idle now, and closes in turn.
    assert_eq!(read_to_close(&mut waiting).await, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_finishes_its_headers_is_closed() {
    let f = start_with(short_timeouts(), None, Duration::ZERO).await;
    let mut slow = TcpStream::connect(f.server.local_addr()).await.unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\n")
        .await
        .unwrap();
    let sent = read_to_close(&mut slow).await;
    assert!(
        sent.is_empty() || sent.starts_with("HTTP/1.1 408"),
        "{sent:?}"
    );
    // The server goes on.
    assert_eq!(f.get("/health").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_is_a_408_and_the_connection_closes() {
    let f = start_with(short_timeouts(), None, Duration::ZERO).await;
    let mut slow = TcpStream::connect(f.server.local_addr()).await.unwrap();
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"prompt\": ",
    )
    .await
    .unwrap();
    let (status, body) = read_response(&mut slow).await;
    assert!(status.starts_with("HTTP/1.1 408"), "{status}: {body}");
    let error = check_error_shape(&serde_json::from_str(&body).unwrap());
    assert_eq!(error["code"], "request_timeout", "{body}");
    assert_eq!(read_to_close(&mut slow).await, "");
}

/// A 20 MB prompt on its way in holds a connection, not the server: `/health` is answered while the
/// body is still arriving, and the prompt is then refused for its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_while_a_20_mb_prompt_arrives_and_is_refused() {
    let f = start_with(ServeConfig::default(), Some(64), Duration::ZERO).await;
    let prompt = "hello ".repeat((20 << 20) / 6);
    let body = json!({"prompt": prompt, "max_tokens": 1}).to_string();
    let mut big = TcpStream::connect(f.server.local_addr()).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    big.write_all(head.as_bytes()).await.unwrap();
    let half = body.len() / 2;
    big.write_all(&body.as_bytes()[..half]).await.unwrap();
    let (status, health) = f.get("/health").await;
    assert_eq!((status, health), (200, json!({"status": "ok"})));
    big.write_all(&body.as_bytes()[half..]).await.unwrap();
    let (status, answer) = read_response(&mut big).await;
    assert!(status.starts_with("HTTP/1.1 400"), "{status}: {answer}");
    let error = check_error_shape(&serde_json::from_str(&answer).unwrap());
    assert_eq!(error["code"], "context_length_exceeded", "{answer}");
}

// ---------------------------------------------------------------------------------------------------
// /metrics

/// A Prometheus text page as `name{labels}` → value, checking its syntax: every sample belongs to a
/// family declared by `# HELP` and `# TYPE` lines before it, and every value is a number.
pub(super) fn parse_prometheus(page: &str) -> BTreeMap<String, f64> {
    let mut families: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = BTreeMap::new();
    for line in page.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            assert!(
                ["counter", "gauge", "summary", "histogram", "untyped"].contains(&kind),
                "{line}"
            );
            families.insert(name.to_string(), kind.to_string());
            continue;
        }
        if line.starts_with("# HELP ") || line.is_empty() {
            continue;
        }
        assert!(!line.starts_with('#'), "{line}");
        let (key, value) = line.rsplit_once(' ').expect("a sample: name value");
        let name = key.split('{').next().unwrap();
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line}"
        );
        let family = [
            name,
            name.trim_end_matches("_sum"),
            name.trim_end_matches("_count"),
        ];
        assert!(
            family.iter().any(|family| families.contains_key(*family)),
            "{line}: no # TYPE before it"
        );
        if let Some(labels) = key.strip_prefix(name) {
            if !labels.is_empty() {
                assert!(
                    labels.starts_with('{') && labels.ends_with('}') && labels.contains("=\""),
                    "{line}"
                );
            }
        }
        let value: f64 = value
            .parse()
            .unwrap_or_else(|error| panic!("{line}: {error}"));
        assert!(
            samples.insert(key.to_string(), value).is_none(),
            "{line}: twice"
        );
    }
    samples
}

async fn scrape(f: &Fixture) -> BTreeMap<String, f64> {
    let response = f
        .client
        .get(format!("{}/metrics", f.base))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let kind = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(kind.starts_with("text/plain; version=0.0.4"), "{kind}");
    parse_prometheus(&response.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_is_prometheus_text_and_counts_requests_and_tokens() {
    let f = start().await;
    let before = scrape(&f).await;
    assert_eq!(before["holo_prompt_tokens_total"], 0.0);
    assert_eq!(before["holo_generation_tokens_total"], 0.0);
    assert!(before["holo_open_connections"] >= 1.0, "{before:?}");
    // An echo sampler is not the local model: no scheduler gauges.
    assert!(!before.contains_key("holo_num_requests_running"));
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": "Hello world", "max_tokens": 3, "n": 2}),
        )
        .await;
    f.fails("/v1/completions", json!({"prompt": ""}), 400).await;
    let after = scrape(&f).await;
    let usage = &answer["usage"];
    assert_eq!(
        after["holo_prompt_tokens_total"],
        usage["prompt_tokens"].as_f64().unwrap()
    );
    assert_eq!(
        after["holo_generation_tokens_total"],
        usage["completion_tokens"].as_f64().unwrap()
    );
    // The first scrape and the completion: 200s; the empty prompt: a 400.
    assert_eq!(
        after["holo_requests_total{status=\"200\"}"], 2.0,
        "{after:?}"
    );
    assert_eq!(
        after["holo_requests_total{status=\"400\"}"], 1.0,
        "{after:?}"
    );
    assert_eq!(after["holo_request_duration_seconds_count"], 3.0);
    assert!(after["holo_request_duration_seconds_sum"] > 0.0);
}

/// A client that stops reading its streamed answer (its receive buffer and the server's send buffer
/// full) is disconnected once a write has waited `timeout`: its sample is cancelled, and the server
/// goes on answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_disconnected_and_its_sample_cancelled() {
    // Each choice's first chunk carries the prompt's 20,000 token ids: 128 of them are megabytes more
    // than the two sockets' buffers hold, while the sampler is still at work (128 × 32 tokens, 5 ms
    // each).
    let f = start_echo(
        Echo::streaming(Duration::from_millis(5)),
        short_timeouts(),
        None,
    )
    .await;
    let prompt = "word ".repeat(20_000);
    let body =
        json!({"prompt": prompt, "n": 128, "return_token_ids": true, "stream": true}).to_string();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(f.server.local_addr()).await.unwrap();
    stalled
        .write_all(
            format!(
                "POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    // Nothing is read from `stalled` from here on.
    let deadline = std::time::Instant::now() + BOUND;
    while f.echo.cancelled.load(Ordering::SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the stalled client's sample was never cancelled"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let health = f
        .client
        .get(format!("{}/health", f.base))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    // What reached the client is a cut stream: the server closed it before the end.
    let received = tokio::time::timeout(BOUND, async {
        let mut received = Vec::new();
        let _ = stalled.read_to_end(&mut received).await;
        received
    })
    .await
    .expect("the server closed the stalled connection");
    assert!(!String::from_utf8_lossy(&received).contains("[DONE]"));
}
