//! Loopback fault servers: a plain HTTP/1.1 server on `std::net` threads that does with each request
//! what a script says (answer it, fail it with a status, never answer, stall its body, forward it to a
//! real server, or die), and keeps every request it saw in arrival order.
//!
//! Every blocking read of the server has a deadline ([`IDLE`]), so that no thread of it outlives a test
//! by more than that, whatever the client does.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

/// The longest any read of a fault server waits (a silent connection, a forwarded request).
pub const IDLE: Duration = Duration::from_secs(60);

/// What the server does with one request.
pub enum Act {
    /// 200 with this JSON body.
    Answer(String),
    /// This status with an OpenAI-style error body.
    Status(u16),
    /// Nothing: the connection stays open, unanswered, until the client gives up.
    Silent,
    /// The head (with the body's whole `content-length`) and half of this body, then nothing.
    StallBody(String),
    /// A chunked head and this body's first half as a chunk, then nothing.
    StallChunked(String),
    /// The request forwarded to a real server, its answer relayed.
    Forward(SocketAddr),
    /// `before` (say, SIGCONT the real server), then [`Act::Forward`].
    ForwardAfter(SocketAddr, Box<dyn FnOnce() + Send>),
    /// The request forwarded to a real server, then `then` (say, SIGKILL or SIGSTOP it) and this server
    /// dies: the real server has the request, and its answer never reaches the client.
    ForwardAndDie(SocketAddr, Box<dyn FnOnce() + Send>),
    /// This connection closed unanswered, and no other accepted: the port refuses from then on.
    Die,
}

/// A request as the fault server read it.
pub struct Request {
    /// Its path (`/v1/chat/completions`).
    pub path: String,
    /// The body (`null` when it is not JSON).
    pub body: Value,
    /// Every byte of it, head and body, to forward.
    raw: Vec<u8>,
}

impl Request {
    /// The text of its chat messages, or its prompt, one string: what tells rows apart.
    pub fn prompt(&self) -> String {
        match (self.body.get("messages"), self.body.get("prompt")) {
            (Some(messages), _) => messages.to_string(),
            (None, Some(prompt)) => prompt.to_string(),
            _ => String::new(),
        }
    }
}

type Script = dyn Fn(&Request, usize) -> Act + Send + Sync;

struct Shared {
    listener: TcpListener,
    dead: AtomicBool,
    /// The bodies seen, in arrival order (a request's index is its place here).
    seen: Mutex<Vec<Value>>,
    script: Box<Script>,
}

impl Shared {
    /// Stops accepting: the listening socket is shut down (connections to the port are refused from
    /// then on) but stays open, so that its descriptor cannot be reused by another test's socket while
    /// this one still refers to it.
    fn die(&self) {
        self.dead.store(true, Ordering::SeqCst);
        // SAFETY: the descriptor belongs to `self.listener`, which lives as long as `self`.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

/// A fault server on 127.0.0.1; it stops accepting when dropped.
pub struct FaultServer {
    pub url: String,
    shared: Arc<Shared>,
}

impl FaultServer {
    /// Serves each request as `script` says, given the request and its index (0-based, in arrival
    /// order over every connection).
    pub fn start(script: impl Fn(&Request, usize) -> Act + Send + Sync + 'static) -> FaultServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let shared = Arc::new(Shared {
            listener,
            dead: AtomicBool::new(false),
            seen: Mutex::new(Vec::new()),
            script: Box::new(script),
        });
        let accepting = Arc::clone(&shared);
        std::thread::spawn(move || loop {
            let accepted = accepting.listener.accept();
            if accepting.dead.load(Ordering::SeqCst) {
                return;
            }
            if let Ok((stream, _)) = accepted {
                let shared = Arc::clone(&accepting);
                std::thread::spawn(move || serve(stream, &shared));
            }
        });
        FaultServer { url, shared }
    }

    /// The bodies of the requests it saw, in arrival order.
    pub fn seen(&self) -> Vec<Value> {
        self.shared.seen.lock().unwrap().clone()
    }
}

impl Drop for FaultServer {
    fn drop(&mut self) {
        self.shared.die();
    }
}

/// Serves one connection's requests until the client closes it, the script stalls or kills it, or the
/// server died.
fn serve(mut stream: TcpStream, shared: &Shared) {
    let _ = stream.set_read_timeout(Some(IDLE));
    let mut pending = Vec::new();
    while let Some(request) = read_request(&mut stream, &mut pending) {
        if shared.dead.load(Ordering::SeqCst) {
            return;
        }
        let index = {
            let mut seen = shared.seen.lock().unwrap();
            seen.push(request.body.clone());
            seen.len() - 1
        };
        let written = match (shared.script)(&request, index) {
            Act::Answer(body) => respond(&mut stream, 200, &body),
            Act::Status(status) => respond(
                &mut stream,
                status,
                &json!({"error": {"message": format!("injected HTTP {status}"), "type": "chaos"}})
                    .to_string(),
            ),
            Act::Silent => return wait_for_close(stream),
            Act::StallBody(body) => {
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&body.as_bytes()[..body.len() / 2]);
                return wait_for_close(stream);
            }
            Act::StallChunked(body) => {
                let half = &body.as_bytes()[..body.len() / 2];
                let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(format!("{:x}\r\n", half.len()).as_bytes());
                let _ = stream.write_all(half);
                let _ = stream.write_all(b"\r\n");
                return wait_for_close(stream);
            }
            Act::Forward(backend) => relay(&mut stream, backend, &request),
            Act::ForwardAfter(backend, before) => {
                before();
                relay(&mut stream, backend, &request)
            }
            Act::ForwardAndDie(backend, then) => {
                // The real server must hold the request before it is killed: it is written whole
                // first (the kernel's buffers take it even from a stopped server's accept queue).
                let upstream = TcpStream::connect_timeout(&backend, Duration::from_secs(10))
                    .and_then(|mut upstream| upstream.write_all(&request.raw).map(|()| upstream));
                then();
                shared.die();
                drop(upstream);
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
            Act::Die => {
                shared.die();
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
        };
        if written.is_err() {
            return;
        }
    }
}

/// Holds a connection open, reading and ignoring, until the client closes it (or [`IDLE`] passes).
fn wait_for_close(mut stream: TcpStream) {
    let mut sink = [0u8; 4096];
    while matches!(stream.read(&mut sink), Ok(read) if read > 0) {}
}

fn respond(stream: &mut TcpStream, status: u16, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status} Chaos\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())
}

/// Forwards `request` to `backend` on a fresh connection and writes its answer back, byte for byte.
fn relay(stream: &mut TcpStream, backend: SocketAddr, request: &Request) -> std::io::Result<()> {
    let mut upstream = TcpStream::connect_timeout(&backend, Duration::from_secs(10))?;
    upstream.set_read_timeout(Some(IDLE))?;
    upstream.write_all(&request.raw)?;
    let answer = read_response(&mut upstream)?;
    stream.write_all(&answer)
}

/// The end of an HTTP head in `buffer`, past its blank line.
fn head_end(buffer: &[u8]) -> Option<usize> {
    buffer
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .map(|at| at + 4)
}

/// A header's value in a head, by lower-case name.
fn header(head: &str, name: &str) -> Option<String> {
    head.split("\r\n").skip(1).find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.trim()
            .eq_ignore_ascii_case(name)
            .then(|| value.trim().to_string())
    })
}

/// Reads into `buffer` from `stream` until `ready` says it holds enough; false at the end of the
/// stream, an error or the read deadline.
fn fill(stream: &mut TcpStream, buffer: &mut Vec<u8>, ready: impl Fn(&[u8]) -> bool) -> bool {
    let mut chunk = [0u8; 8192];
    while !ready(buffer) {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return false,
            Ok(read) => buffer.extend_from_slice(&chunk[..read]),
        }
    }
    true
}

/// The next request of a connection (`pending` keeps what was read past it); `None` when the client
/// closed it.
fn read_request(stream: &mut TcpStream, pending: &mut Vec<u8>) -> Option<Request> {
    if !fill(stream, pending, |buffer| head_end(buffer).is_some()) {
        return None;
    }
    let end = head_end(pending)?;
    let head = String::from_utf8_lossy(&pending[..end]).to_string();
    let length: usize = header(&head, "content-length").map_or(Some(0), |l| l.parse().ok())?;
    if !fill(stream, pending, |buffer| buffer.len() >= end + length) {
        return None;
    }
    let raw: Vec<u8> = pending.drain(..end + length).collect();
    Some(Request {
        path: head.split(' ').nth(1).unwrap_or_default().to_string(),
        body: serde_json::from_slice(&raw[end..]).unwrap_or(Value::Null),
        raw,
    })
}

/// A whole response (head and body, by `content-length` or chunked) read from a real server.
fn read_response(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let cut = || std::io::Error::other("the real server's answer was cut short");
    let mut buffer = Vec::new();
    if !fill(stream, &mut buffer, |buffer| head_end(buffer).is_some()) {
        return Err(cut());
    }
    let end = head_end(&buffer).ok_or_else(cut)?;
    let head = String::from_utf8_lossy(&buffer[..end]).to_string();
    let complete = match header(&head, "content-length") {
        Some(length) => {
            let length: usize = length.parse().map_err(|_| cut())?;
            fill(stream, &mut buffer, |buffer| buffer.len() >= end + length)
        }
        None => fill(stream, &mut buffer, |buffer| {
            buffer.ends_with(b"\r\n0\r\n\r\n")
        }),
    };
    if complete {
        Ok(buffer)
    } else {
        Err(cut())
    }
}

/// An OpenAI chat completion whose reply is `text`.
pub fn chat_answer(text: &str) -> String {
    json!({
        "id": "chaos",
        "object": "chat.completion",
        "model": "stub",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop"
        }]
    })
    .to_string()
}
