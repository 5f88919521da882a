//! Latency of `holoc lsp` on a 10,000-line file: each request's round trip through the protocol (JSON-RPC
//! framing, parsing, the answer, serialising it), with the server serving in-process on a pipe as it
//! serves an editor. Prints the median and the slowest of the runs per request, against the 20 ms budget.
//!
//! Run with `cargo bench -p holoc --bench lsp`. (It lives under holoc/ rather than the workspace's
//! benches/ because it measures holoc's server alone.)

use std::io::{BufRead, BufReader, Write};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const LINES: usize = 10_000;
const RUNS: usize = 30;
const BUDGET: Duration = Duration::from_millis(20);

/// Tool-use episodes with their own variables, bodies and comments, to `LINES` lines.
fn document() -> String {
    let mut text = String::from("<|+++|>\n<|x_x|>\nYou are a careful assistant.\n\n");
    let mut episode = 0;
    while text.lines().count() < LINES {
        text.push_str(&format!(
            "<|o_o|>\n<|query{episode}|>\n\n<|ToolRunner max_turns=8|>\n    # Episode {episode}: a tool call or an answer.\n    <|@_@:turn{episode} stop=\"</tool>\"|>\n\n    <|o_o|>\n    <|ToolExecutor turn{episode}|>\n<|@_@:answer{episode} <>answer max_tokens=64|>\n<|ExactAnswer var=answer{episode}|>\n\n"
        ));
        episode += 1;
    }
    text
}

/// A message's envelope. A response's result is read through (so it must be JSON) but not built into a
/// `Value`, so that the times are the server's and not this client's.
#[derive(serde::Deserialize)]
struct Envelope {
    id: Option<Value>,
    method: Option<String>,
    params: Option<Value>,
    error: Option<Value>,
}

fn read_message(reader: &mut impl BufRead) -> Envelope {
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("the server answers");
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some(value) = line.strip_prefix("Content-Length: ") {
            length = value.parse().expect("a length");
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).expect("a whole message");
    serde_json::from_slice(&body).expect("JSON")
}

struct Client<W: Write, R: BufRead> {
    to_server: W,
    from_server: R,
    next_id: i64,
}

impl<W: Write, R: BufRead> Client<W, R> {
    fn send(&mut self, message: Value) {
        let body = message.to_string();
        write!(
            self.to_server,
            "Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        self.to_server.flush().unwrap();
    }

    /// Sends a request and waits for its response.
    fn request(&mut self, method: &str, params: Value) -> Envelope {
        let id = self.next_id;
        self.next_id += 1;
        self.send(json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }));
        loop {
            let message = read_message(&mut self.from_server);
            if message.id == Some(json!(id)) {
                assert!(message.error.is_none(), "{method}: {:?}", message.error);
                return message;
            }
        }
    }

    /// Sends a notification and waits for the diagnostics it publishes.
    fn change(&mut self, uri: &str, version: i32, text: &str) -> Envelope {
        let method = if version == 1 {
            "textDocument/didOpen"
        } else {
            "textDocument/didChange"
        };
        let params = if version == 1 {
            json!({ "textDocument": { "uri": uri, "languageId": "holoware", "version": 1, "text": text } })
        } else {
            json!({ "textDocument": { "uri": uri, "version": version }, "contentChanges": [{ "text": text }] })
        };
        self.send(json!({ "jsonrpc": "2.0", "method": method, "params": params }));
        loop {
            let message = read_message(&mut self.from_server);
            if message.method.as_deref() == Some("textDocument/publishDiagnostics") {
                return message;
            }
        }
    }
}

fn report(name: &str, mut times: Vec<Duration>) -> bool {
    times.sort();
    let median = times[times.len() / 2];
    let slowest = times[times.len() - 1];
    let within = slowest <= BUDGET;
    println!(
        "{name:<34} median {:>7.2} ms   slowest {:>7.2} ms   {}",
        median.as_secs_f64() * 1e3,
        slowest.as_secs_f64() * 1e3,
        if within { "within 20 ms" } else { "OVER 20 ms" }
    );
    within
}

fn main() {
    let text = document();
    let (server_in, to_server) = std::io::pipe().expect("a pipe");
    let (from_server, server_out) = std::io::pipe().expect("a pipe");
    let server = std::thread::spawn(move || {
        holoc::lsp::Server::default()
            .serve(
                &mut BufReader::new(server_in),
                &mut std::io::BufWriter::new(server_out),
            )
            .expect("the server runs")
    });
    let mut client = Client {
        to_server,
        from_server: BufReader::new(from_server),
        next_id: 1,
    };
    client.request("initialize", json!({ "capabilities": {} }));
    let uri = "file:///bench/large.hol";
    let opened = client.change(uri, 1, &text);
    assert_eq!(
        opened.params.expect("diagnostics")["diagnostics"],
        json!([]),
        "the document checks clean"
    );
    println!(
        "holoc lsp on a {}-line file ({} KiB), {RUNS} runs each:",
        text.lines().count(),
        text.len() / 1024
    );

    // Positions in the middle of the file: a variable, a holotype, an open tag to complete.
    let middle = text.lines().count() as u32 / 2;
    let lines: Vec<&str> = text.lines().collect();
    let query_line = (middle as usize..)
        .find(|&line| lines[line].starts_with("<|query"))
        .unwrap() as u32;
    let at = |line: u32, character: u32| json!({ "textDocument": { "uri": uri }, "position": { "line": line, "character": character } });
    let mut all_within = true;
    let mut timed = |name: &str, run: &mut dyn FnMut(usize)| {
        let times = (0..RUNS)
            .map(|i| {
                let start = Instant::now();
                run(i);
                start.elapsed()
            })
            .collect();
        all_within &= report(name, times);
    };
    timed("didChange -> publishDiagnostics", &mut |i| {
        // Alternate between two texts so that every change is a real one.
        let changed = if i % 2 == 0 {
            text.replacen("careful", "precise", 1)
        } else {
            text.clone()
        };
        client.change(uri, i as i32 + 2, &changed);
    });
    timed("hover (variable)", &mut |_| {
        client.request("textDocument/hover", at(query_line, 4));
    });
    timed("hover (holotype)", &mut |_| {
        client.request("textDocument/hover", at(query_line + 2, 4));
    });
    timed("definition (variable)", &mut |_| {
        client.request("textDocument/definition", at(query_line + 4, 12));
    });
    timed("completion (tag head)", &mut |_| {
        client.request("textDocument/completion", at(query_line, 2));
    });
    timed("documentSymbol", &mut |_| {
        client.request(
            "textDocument/documentSymbol",
            json!({ "textDocument": { "uri": uri } }),
        );
    });
    timed("semanticTokens/full", &mut |_| {
        client.request(
            "textDocument/semanticTokens/full",
            json!({ "textDocument": { "uri": uri } }),
        );
    });
    timed("formatting", &mut |_| {
        client.request(
            "textDocument/formatting",
            json!({ "textDocument": { "uri": uri }, "options": { "tabSize": 4, "insertSpaces": true } }),
        );
    });
    client.request("shutdown", Value::Null);
    client.send(json!({ "jsonrpc": "2.0", "method": "exit" }));
    server.join().expect("the server exits");
    println!(
        "{}",
        if all_within {
            "every request answered within 20 ms"
        } else {
            "some requests took more than 20 ms"
        }
    );
}
