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
