//! The request side of the fake HTTP servers the tests run on loopback.

use std::collections::HashMap;

use serde_json::Value;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// A request as a fake server saw it; the body is `null` when it is not JSON.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: HashMap<String, String>,
    pub body: Value,
    /// The body's bytes as sent (compressed ones included).
    pub raw: Vec<u8>,
}

/// Reads one HTTP/1.1 request (head, then `content-length` bytes of body); `None` when the client
/// hangs up first.
pub async fn read_request(stream: &mut TcpStream) -> Option<Seen> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|window| window == b"\r\n\r\n") {
            break at + 4;
        }
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..read]);
    };
    let head = String::from_utf8(buffer[..head_end].to_vec()).ok()?;
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next()?.split(' ');
    let (method, path) = (
        request_line.next()?.to_string(),
        request_line.next()?.to_string(),
    );
    let headers: HashMap<String, String> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_string()))
        .collect();
    let length: usize = headers
        .get("content-length")
        .map_or(Some(0), |l| l.parse().ok())?;
    while buffer.len() < head_end + length {
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..read]);
    }
    let raw = buffer[head_end..head_end + length].to_vec();
    let body = serde_json::from_slice(&raw).unwrap_or(Value::Null);
    Some(Seen {
        method,
        path,
        headers,
        body,
        raw,
    })
}

/// A stub HTTP server on 127.0.0.1: `answer` gives each request's status and body (JSON text) from the
/// request and its index; every request is kept, in order. Returns its `http://host:port`.
pub async fn stub<F>(answer: F) -> (String, std::sync::Arc<std::sync::Mutex<Vec<Seen>>>)
where
    F: Fn(&Seen, usize) -> (u16, String) + Send + Sync + 'static,
{
    stub_typed(move |request, index| {
        let (status, body) = answer(request, index);
        Answer {
            status,
            content_type: "application/json".into(),
            body: body.into_bytes(),
        }
    })
    .await
}

/// A stub server's answer of any content type.
#[derive(Clone)]
pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

/// [`stub`] with answers of any content type (protobuf results).
pub async fn stub_typed<F>(answer: F) -> (String, std::sync::Arc<std::sync::Mutex<Vec<Seen>>>)
where
    F: Fn(&Seen, usize) -> Answer + Send + Sync + 'static,
{
    use std::sync::{Arc, Mutex};
    use tokio::io::AsyncWriteExt;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&seen);
    let answer = Arc::new(answer);
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let (kept, answer) = (Arc::clone(&kept), Arc::clone(&answer));
            tokio::spawn(async move {
                while let Some(request) = read_request(&mut stream).await {
                    let index = {
                        let mut kept = kept.lock().unwrap();
                        kept.push(request.clone());
                        kept.len() - 1
                    };
                    let Answer {
                        status,
                        content_type,
                        body,
                    } = answer(&request, index);
                    let head = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    if stream.write_all(head.as_bytes()).await.is_err()
                        || stream.write_all(&body).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (url, seen)
}
