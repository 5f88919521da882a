//! End-to-end tests of `holoc lsp`: the binary is driven over a pipe with JSON-RPC messages, as an editor
//! drives it.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use serde_json::{json, Value};

mod scratch;
use scratch::Scratch;

/// How long to wait for a message before failing the test instead of hanging it.
const TIMEOUT: Duration = Duration::from_secs(20);

struct Client {
    child: Child,
    stdin: ChildStdin,
    messages: Receiver<Value>,
    /// Notifications read while waiting for a response.
    notifications: Vec<Value>,
    next_id: i64,
}

/// Reads one `Content-Length` framed message.
fn read_message(reader: &mut impl BufRead) -> Option<Value> {
    let mut length = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some(value) = line.strip_prefix("Content-Length: ") {
            length = Some(value.parse::<usize>().unwrap());
        }
    }
    let mut body = vec![0; length?];
    reader.read_exact(&mut body).ok()?;
    Some(serde_json::from_slice(&body).unwrap())
}

impl Client {
    fn start() -> Client {
        let mut child = Command::new(env!("CARGO_BIN_EXE_holoc"))
            .arg("lsp")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("holoc lsp starts");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let (sender, messages) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            while let Some(message) = read_message(&mut stdout) {
                if sender.send(message).is_err() {
                    break;
                }
            }
        });
        let mut client = Client {
            child,
            stdin,
            messages,
            notifications: Vec::new(),
            next_id: 1,
        };
        let result = client.request("initialize", json!({ "capabilities": {} }));
        assert_eq!(result["serverInfo"]["name"], "holoc");
        client.notify("initialized", json!({}));
        client
    }

    fn send_raw(&mut self, body: &str) {
        write!(self.stdin, "Content-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        self.stdin.flush().unwrap();
    }

    fn send(&mut self, message: Value) {
        self.send_raw(&message.to_string());
    }

    fn receive(&mut self) -> Value {
        match self.messages.recv_timeout(TIMEOUT) {
            Ok(message) => message,
            Err(RecvTimeoutError::Timeout) => panic!("no message from holoc lsp in {TIMEOUT:?}"),
            Err(RecvTimeoutError::Disconnected) => panic!("holoc lsp closed its output"),
        }
    }

    /// Sends a request and returns its whole response (`result` or `error`).
    fn request_response(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        self.send(json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }));
        self.response(json!(id))
    }

    fn response(&mut self, id: Value) -> Value {
        loop {
            let message = self.receive();
            if message.get("method").is_some() {
                self.notifications.push(message);
            } else if message["id"] == id {
                return message;
            }
        }
    }

    fn request(&mut self, method: &str, params: Value) -> Value {
        let response = self.request_response(method, params);
        assert!(response.get("error").is_none(), "{method}: {response}");
        response["result"].clone()
    }

    fn notify(&mut self, method: &str, params: Value) {
        self.send(json!({ "jsonrpc": "2.0", "method": method, "params": params }));
    }

    /// The next diagnostics published for `uri`.
    fn diagnostics(&mut self, uri: &str) -> Vec<Value> {
        let matches = |message: &Value| {
            message["method"] == "textDocument/publishDiagnostics"
                && message["params"]["uri"] == uri
        };
        if let Some(at) = self.notifications.iter().position(matches) {
            let message = self.notifications.remove(at);
            return message["params"]["diagnostics"].as_array().unwrap().clone();
        }
        loop {
            let message = self.receive();
            if matches(&message) {
                return message["params"]["diagnostics"].as_array().unwrap().clone();
            }
            self.notifications.push(message);
        }
    }

    fn open(&mut self, uri: &str, text: &str) -> Vec<Value> {
        self.notify(
            "textDocument/didOpen",
            json!({ "textDocument": { "uri": uri, "languageId": "holoware", "version": 1, "text": text } }),
        );
        self.diagnostics(uri)
    }

    fn at(&mut self, method: &str, uri: &str, line: u32, character: u32) -> Value {
        self.request(
            method,
            json!({ "textDocument": { "uri": uri }, "position": { "line": line, "character": character } }),
        )
    }

    /// Shuts the server down as an editor does, and checks that it exits cleanly.
    fn shutdown(mut self) {
        assert_eq!(self.request("shutdown", Value::Null), Value::Null);
        self.notify("exit", Value::Null);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}");
    }
}

fn file_uri(path: &Path) -> String {
    format!("file://{}", path.display()).replace(' ', "%20")
}

/// A fresh folder under the system temp dir, removed when dropped.
fn scratch(name: &str) -> Scratch {
    Scratch::new("lsp", name)
}

const TOOL: &str = "<|o_o|>\n<|query|>\n<|ToolRunner max_turns=8|>\n    <|@_@:turn stop=\"</tool>\"|>\n    <|o_o|>\n    <|ToolExecutor turn|>\n<|@_@:answer <>answer|>\n<|ExactAnswer var=answer|>\n";

#[test]
fn diagnostics_are_holoc_checks() {
    let dir = scratch("diagnostics");
    let inputs = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/inputs/err");
    let mut client = Client::start();
    for name in [
        "semantic_errors_together.hol",
        "errors_on_several_lines.hol",
        "scan_unknown_holotype.hol",
        "unresolved_holotype.hol",
    ] {
        // Outside any crate, as `holoc check` sees the copy.
        let path = dir.join(name);
        std::fs::copy(inputs.join(name), &path).unwrap();
        let check = Command::new(env!("CARGO_BIN_EXE_holoc"))
            .args(["check", "--format", "json"])
            .arg(&path)
            .output()
            .unwrap();
        let expected: Vec<Value> = serde_json::from_slice(&check.stdout).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let published = client.open(&file_uri(&path), &text);
        assert_eq!(published.len(), expected.len(), "{name}: {published:?}");
        assert!(!published.is_empty(), "{name}");
        for (lsp, check) in published.iter().zip(&expected) {
            assert_eq!(lsp["code"], check["code"], "{name}");
            assert_eq!(lsp["source"], "holoc");
            assert_eq!(
                lsp["range"]["start"]["line"],
                json!(check["line"].as_u64().unwrap() - 1)
            );
            assert_eq!(
                lsp["range"]["start"]["character"],
                json!(check["column"].as_u64().unwrap() - 1)
            );
            let severity = if check["severity"] == "error" { 1 } else { 2 };
            assert_eq!(lsp["severity"], severity, "{name}");
            let message = lsp["message"].as_str().unwrap();
            assert!(
                message.starts_with(check["message"].as_str().unwrap()),
                "{message}"
            );
            if let Some(help) = check["help"].as_str() {
                assert!(message.ends_with(&format!("help: {help}")), "{message}");
            }
        }
    }
    client.shutdown();
}

#[test]
fn diagnostics_follow_changes_and_close() {
    let mut client = Client::start();
    let uri = "file:///nowhere/edit.hol";
    let published = client.open(uri, "<|o_o|>\n<|@_@:answer <>|>\n");
    assert_eq!(published.len(), 1);
    assert_eq!(published[0]["code"], "H0005");
    client.notify(
        "textDocument/didChange",
        json!({ "textDocument": { "uri": uri, "version": 2 }, "contentChanges": [{ "text": TOOL }] }),
    );
    assert_eq!(client.diagnostics(uri), Vec::<Value>::new());
    client.notify(
        "textDocument/didChange",
        json!({ "textDocument": { "uri": uri, "version": 3 }, "contentChanges": [{ "text": "<|o_o|>\n<|x|>\n<|@_@:x|>\n" }] }),
    );
    let published = client.diagnostics(uri);
    assert_eq!(published.len(), 1);
    assert_eq!(published[0]["code"], "H0021");
    client.notify(
        "textDocument/didClose",
        json!({ "textDocument": { "uri": uri } }),
    );
    assert_eq!(client.diagnostics(uri), Vec::<Value>::new());
    client.shutdown();
}

/// A file full of errors, malformed messages, bad parameters and unknown methods: the server answers
/// each one and keeps serving.
#[test]
fn survives_bad_input() {
    let mut client = Client::start();
    let uri = "file:///nowhere/broken.hol";
    let garbage: String = (0..2000)
        .map(|i| match i % 5 {
            0 => "<|unclosed\n",
            1 => "\t<|Foo-bar x=|>\n",
            2 => "<|@_@:Answer <>1 <>2 max_tokens=0|>\n",
            3 => "  <|/Nothing|>\n",
            _ => "<|o_o \"|>\n",
        })
        .collect();
    assert!(!client.open(uri, &garbage).is_empty());
    for method in [
        "textDocument/hover",
        "textDocument/definition",
        "textDocument/completion",
    ] {
        client.at(method, uri, 2, 5);
    }
    client.request(
        "textDocument/semanticTokens/full",
        json!({ "textDocument": { "uri": uri } }),
    );
    client.request(
        "textDocument/documentSymbol",
        json!({ "textDocument": { "uri": uri } }),
    );

    client.send_raw("{ this is not json");
    let parse_error = client.response(Value::Null);
    assert_eq!(parse_error["error"]["code"], -32700);

    let bad_params = client.request_response("textDocument/hover", json!({ "position": 3 }));
    assert_eq!(bad_params["error"]["code"], -32602, "{bad_params}");

    let unknown = client.request_response("holoware/teleport", json!({}));
    assert_eq!(unknown["error"]["code"], -32601, "{unknown}");

    // A position far past the end of the document.
    client.at("textDocument/hover", uri, 99_999, 99_999);
    // A document that was never opened.
    assert_eq!(
        client.at("textDocument/hover", "file:///nowhere/unknown.hol", 0, 0),
        Value::Null
    );
    client.shutdown();
}

fn hover_text(client: &mut Client, uri: &str, line: u32, character: u32) -> String {
    let hover = client.at("textDocument/hover", uri, line, character);
    hover["contents"]["value"]
        .as_str()
        .unwrap_or_else(|| panic!("no hover at {line}:{character}: {hover}"))
        .to_string()
}

#[test]
fn hover_on_tags_holotypes_and_variables() {
    let mut client = Client::start();
    let uri = "file:///nowhere/tool.hol";
    client.open(uri, TOOL);
    let runner = hover_text(&mut client, uri, 2, 4);
    assert!(
        runner.contains("holo_runtime::holotypes::ToolRunner"),
        "{runner}"
    );
    assert!(runner.contains("`max_turns` (8)"), "{runner}");
    let role = hover_text(&mut client, uri, 0, 3);
    assert!(role.contains("starts a new **user** message"), "{role}");
    let query = hover_text(&mut client, uri, 1, 4);
    assert!(query.contains("**required input**"), "{query}");
    let sampler = hover_text(&mut client, uri, 3, 7);
    assert!(sampler.contains("**sampler**"), "{sampler}");
    let binding = hover_text(&mut client, uri, 3, 10);
    assert!(
        binding.contains("variable `turn`: **bound** by the sampler on line 4"),
        "{binding}"
    );
    let argument = hover_text(&mut client, uri, 2, 15);
    assert!(
        argument.contains(
            "argument `max_turns` of the built-in `ToolRunner`: an integer from 1 to 4294967295"
        ),
        "{argument}"
    );
    let stop = hover_text(&mut client, uri, 3, 18);
    assert!(stop.contains("sampler argument `stop`"), "{stop}");
    // Text is not a tag.
    assert_eq!(client.at("textDocument/hover", uri, 7, 0), Value::Null);
    client.shutdown();
}

/// A crate with its own holotype: hover shows the Rust declaration, go to definition opens the impl.
#[test]
fn crate_holotypes_link_to_rust() {
    let dir = scratch("crate");
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::create_dir_all(dir.join("hol")).unwrap();
    std::fs::write(
        dir.join("Cargo.toml"),
        "[package]\nname = \"calc\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("src/lib.rs"),
        "use holo_runtime::Holotype;\n\n/// Adds numbers.\npub struct Calculator {\n    precision: u32,\n}\n\nimpl Holotype for Calculator {\n    const PARAMS: &'static [&'static str] = &[\"precision\"];\n}\n",
    )
    .unwrap();
    let hol = dir.join("hol/calc.hol");
    let text = "<|o_o|>\nWhat is 2 + 2?\n<|Calculator precison=3|>\n<|@_@:answer|>\n<|answer|>\n";
    std::fs::write(&hol, text).unwrap();
    let uri = file_uri(&hol);
    let mut client = Client::start();
    let published = client.open(&uri, text);
    assert_eq!(published.len(), 1, "{published:?}");
    assert_eq!(published[0]["code"], "H0028");
    assert!(published[0]["message"]
        .as_str()
        .unwrap()
        .contains("did you mean `precision`?"));

    let hover = hover_text(&mut client, &uri, 2, 5);
    assert!(
        hover.contains("```rust\npub struct Calculator {\nimpl Holotype for Calculator\n```"),
        "{hover}"
    );
    assert!(hover.contains("`PARAMS`: `precision`"), "{hover}");

    let definition = client.at("textDocument/definition", &uri, 2, 5);
    let lib = dir.join("src/lib.rs").canonicalize().unwrap();
    assert_eq!(definition["uri"], file_uri(&lib));
    assert_eq!(
        definition["range"],
        json!({ "start": { "line": 7, "character": 18 }, "end": { "line": 7, "character": 28 } })
    );

    // A variable goes to the sampler that binds it.
    let definition = client.at("textDocument/definition", &uri, 4, 3);
    assert_eq!(
        definition,
        json!([{ "uri": uri, "range": { "start": { "line": 3, "character": 6 }, "end": { "line": 3, "character": 12 } } }])
    );

    let completion = client.at("textDocument/completion", &uri, 2, 13);
    let labels = labels(&completion);
    assert_eq!(labels, ["precision"]);

    // Saving the file scans the crate again: a parameter added to the Rust code is then known.
    let lib_rs = std::fs::read_to_string(dir.join("src/lib.rs")).unwrap();
    std::fs::write(
        dir.join("src/lib.rs"),
        lib_rs.replace("&[\"precision\"]", "&[\"precision\", \"precison\"]"),
    )
    .unwrap();
    client.notify(
        "textDocument/didSave",
        json!({ "textDocument": { "uri": uri } }),
    );
    assert_eq!(client.diagnostics(&uri), Vec::<Value>::new());
    client.shutdown();
}

fn labels(completion: &Value) -> Vec<String> {
    completion
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item["label"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn completion_in_tags() {
    let mut client = Client::start();
    let uri = "file:///nowhere/complete.hol";
    let text = "<|o_o|>\n<|query|>\n<|\n<|ToolRunner \n<|@_@ max\n<|@_@:\n<|ExactAnswer var=\nplain text\n";
    client.open(uri, text);
    let heads = labels(&client.at("textDocument/completion", uri, 2, 2));
    for expected in [
        "x_x",
        "o_o",
        "@_@",
        "+++",
        "===",
        "ToolRunner",
        "ExactAnswer",
        "query",
    ] {
        assert!(
            heads.iter().any(|label| label == expected),
            "{expected}: {heads:?}"
        );
    }
    let runner = labels(&client.at("textDocument/completion", uri, 3, 13));
    assert_eq!(runner, ["max_turns", "var", "answer"]);
    let sampler = labels(&client.at("textDocument/completion", uri, 4, 9));
    assert_eq!(
        sampler,
        [
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "stop",
            "json",
            "json_schema",
            "json_schema_file",
            "regex",
            "choice",
            "grammar"
        ]
    );
    let binding = labels(&client.at("textDocument/completion", uri, 5, 6));
    assert!(binding.contains(&"query".to_string()), "{binding:?}");
    let var = labels(&client.at("textDocument/completion", uri, 6, 18));
    assert!(var.contains(&"query".to_string()), "{var:?}");
    assert_eq!(client.at("textDocument/completion", uri, 7, 5), json!([]));
    client.shutdown();
}

#[test]
fn symbols_formatting_and_semantic_tokens() {
    let mut client = Client::start();
    let uri = "file:///nowhere/outline.hol";
    let text = "<| +++ |>\n<|x_x|>\nBe brief.\n<|o_o|>\n<|query|>\n<|ToolRunner max_turns=8|>\n  <|@_@:turn|>\n  <|ToolExecutor turn|>\n<|@_@:answer <>answer|>\n";
    client.open(uri, text);
    let symbols = client.request(
        "textDocument/documentSymbol",
        json!({ "textDocument": { "uri": uri } }),
    );
    let names = |symbols: &Value| -> Vec<String> {
        symbols
            .as_array()
            .unwrap()
            .iter()
            .map(|symbol| symbol["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(&symbols), ["+++ trained context"]);
    let context = &symbols[0]["children"];
    assert_eq!(
        names(context),
        ["x_x system", "o_o user", "ToolRunner", "@_@:answer"]
    );
    assert_eq!(names(&context[2]["children"]), ["@_@:turn", "ToolExecutor"]);

    let edits = client.request(
        "textDocument/formatting",
        json!({ "textDocument": { "uri": uri }, "options": { "tabSize": 4, "insertSpaces": true } }),
    );
    assert_eq!(edits.as_array().unwrap().len(), 1);
    assert_eq!(
        edits[0]["newText"],
        holoc::fmt::format(text).unwrap().as_str()
    );
    assert_eq!(
        edits[0]["range"],
        json!({ "start": { "line": 0, "character": 0 }, "end": { "line": 9, "character": 0 } })
    );

    let tokens = client.request(
        "textDocument/semanticTokens/full",
        json!({ "textDocument": { "uri": uri } }),
    );
    let data: Vec<u64> = tokens["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    assert_eq!(data.len() % 5, 0);
    // `<|`, `+++`, `|>` on the first line: operator, keyword, operator (legend indices 6, 0, 6).
    assert_eq!(&data[..15], [0, 0, 2, 6, 0, 0, 3, 3, 0, 0, 0, 4, 2, 6, 0]);
    client.shutdown();
}
