//! `holo view --serve`: the page over HTTP on the loopback interface, for a browser on the same machine
//! (or through an SSH tunnel). One connection at a time is enough for one person reading one page.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};

/// The most request-head bytes read before answering; a browser's GET fits many times over.
const MAX_HEAD: u64 = 64 * 1024;

/// A listener on `127.0.0.1:port` (0: a free port, see [`TcpListener::local_addr`]).
pub fn bind(port: u16) -> io::Result<TcpListener> {
    TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port)))
}

/// Answers every connection: `GET /` (or `/index.html`) with `page`, anything else with 404. Runs until
/// the listener fails; a connection that fails is dropped and the next one served.
pub fn serve(listener: &TcpListener, page: &str) -> io::Error {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                // A client that hangs up mid-request costs only its own answer.
                let _ = answer(stream, page);
            }
            Err(error) => return error,
        }
    }
}

fn answer(mut stream: TcpStream, page: &str) -> io::Result<()> {
    let mut reader = BufReader::new((&stream).take(MAX_HEAD));
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    skip_headers(&mut reader)?;
    let mut words = request_line.split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split(['?', '#']).next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/" | "/index.html") => ("200 OK", "text/html", page),
        _ => ("404 Not Found", "text/plain", "not found\n"),
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}; charset=utf-8\r\ncontent-length: {}\r\n\
         cache-control: no-store\r\nconnection: close\r\n\r\n",
        body.len()
    )?;
    if method != "HEAD" {
        stream.write_all(body.as_bytes())?;
    }
    stream.flush()
}

/// Reads the request's header lines up to the blank line that ends them (or the end of what is read).
fn skip_headers(reader: &mut impl BufRead) -> io::Result<()> {
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
            return Ok(());
        }
    }
}
