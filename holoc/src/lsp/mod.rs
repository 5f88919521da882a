//! The language server behind `holoc lsp`: JSON-RPC over stdio, as editors speak it.
//!
//! Every answer comes from the same front end as `holoc check`: diagnostics are [`crate::compile`]'s, with
//! the crate scan's holotypes when the file sits in a crate, and formatting is [`crate::fmt::format()`].
//! Documents are synchronised whole on every change and analysed at once; a 10,000-line file compiles in a
//! few milliseconds, so there is no background work to cancel.
//!
//! The server reads one message at a time and answers it before reading the next. A message that is not
//! JSON-RPC gets a parse error (`-32700`), a request with bad parameters `-32602`, an unknown method
//! `-32601`, and a handler that panics `-32603`: the server answers and goes on, and exits only on `exit`
//! or at the end of its input.

mod catalog;
mod completion;
mod definition;
mod diagnostics;
mod hover;
mod position;
mod semantic;
mod symbols;
mod target;

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use lsp_server::{ErrorCode, Message, Notification, Request, RequestId, Response};
use lsp_types as lsp;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{ast, scan, Options, Output};
use position::Lines;

/// One open document and what the front end made of it.
pub(crate) struct Document {
    pub(crate) uri: lsp::Uri,
    pub(crate) text: String,
    pub(crate) lines: Lines,
    pub(crate) output: Output,
    /// While this version does not parse: the tree of its lines without lexical errors, if they parse,
    /// else the tree of the last version that parsed, so that answers go on while a tag is being typed.
    pub(crate) last_tree: Option<ast::Document>,
    /// The scan of the crate the file belongs to, if any.
    pub(crate) options: Options,
}

impl Document {
    /// The syntax tree of this version, or the best stand-in for it (see `last_tree`).
    pub(crate) fn tree(&self) -> Option<&ast::Document> {
        self.output.document.as_ref().or(self.last_tree.as_ref())
    }
}

/// The server's state: open documents, and the scans of the crates they belong to.
pub struct Server {
    documents: HashMap<String, Document>,
    crates: BTreeMap<PathBuf, Options>,
    outside: Options,
    shutdown: bool,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            documents: HashMap::new(),
            crates: BTreeMap::new(),
            outside: Options::with_builtins(None),
            shutdown: false,
        }
    }
}

/// Serves the language server protocol on stdin and stdout until `exit` or the end of stdin.
pub fn run_stdio() -> io::Result<()> {
    let stdin = io::stdin();
    let stdout = io::stdout();
    Server::default().serve(&mut stdin.lock(), &mut stdout.lock())
}

/// A message to the client. Results are serialised straight to JSON text: building a `serde_json::Value`
/// first costs more than the answer itself for a large document (an outline of thousands of symbols).
enum Outgoing {
    Message(Message),
    Result { id: RequestId, json: String },
}

impl Outgoing {
    fn write(self, output: &mut impl Write) -> io::Result<()> {
        match self {
            Outgoing::Message(message) => message.write(output),
            Outgoing::Result { id, json } => {
                let id = serde_json::to_string(&id).expect("ids serialize");
                let body = format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{json}}}"#);
                write!(output, "Content-Length: {}\r\n\r\n{body}", body.len())?;
                output.flush()
            }
        }
    }
}

/// What the server should do after a message.
enum Flow {
    Continue,
    Exit,
}

impl Server {
    /// Serves the protocol on `input` and `output` until `exit` or the end of the input.
    pub fn serve(mut self, input: &mut impl BufRead, output: &mut impl Write) -> io::Result<()> {
        loop {
            let message = match Message::read(input) {
                Ok(Some(message)) => message,
                Ok(None) => return Ok(()),
                Err(error) if error.kind() == io::ErrorKind::InvalidData => {
                    write_parse_error(output, &error.to_string())?;
                    continue;
                }
                Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(error) => return Err(error),
            };
            let mut replies = Vec::new();
            let flow = self.handle(message, &mut replies);
            for reply in replies {
                reply.write(output)?;
            }
            if let Flow::Exit = flow {
                return Ok(());
            }
        }
    }

    fn handle(&mut self, message: Message, replies: &mut Vec<Outgoing>) -> Flow {
        match message {
            Message::Request(request) => {
                let id = request.id.clone();
                let result = catch_unwind(AssertUnwindSafe(|| self.request(request, replies)))
                    .unwrap_or_else(|_| {
                        Err((
                            ErrorCode::InternalError as i32,
                            "holoc lsp failed on this request (a bug; please report it)"
                                .to_string(),
                        ))
                    });
                replies.push(match result {
                    Ok(json) => Outgoing::Result { id, json },
                    Err((code, message)) => {
                        Outgoing::Message(Message::Response(Response::new_err(id, code, message)))
                    }
                });
                Flow::Continue
            }
            Message::Notification(notification) if notification.method == "exit" => Flow::Exit,
            Message::Notification(notification) => {
                let _ = catch_unwind(AssertUnwindSafe(|| {
                    self.notification(notification, replies)
                }));
                Flow::Continue
            }
            Message::Response(_) => Flow::Continue,
        }
    }

    /// Answers a request with its result as JSON text, or an error code and message.
    fn request(
        &mut self,
        request: Request,
        replies: &mut Vec<Outgoing>,
    ) -> Result<String, (i32, String)> {
        let Request { method, params, .. } = request;
        if self.shutdown {
            return Err((
                ErrorCode::InvalidRequest as i32,
                "the server is shutting down".to_string(),
            ));
        }
        match method.as_str() {
            "initialize" => Ok(initialize_result().to_string()),
            "shutdown" => {
                self.shutdown = true;
                Ok("null".to_string())
            }
            "textDocument/hover" => self.answer(params, |server, params: lsp::HoverParams| {
                let at = &params.text_document_position_params;
                server
                    .document(&at.text_document.uri)
                    .and_then(|document| hover::hover(document, at.position))
            }),
            "textDocument/definition" => {
                self.answer(params, |server, params: lsp::GotoDefinitionParams| {
                    let at = &params.text_document_position_params;
                    server
                        .document(&at.text_document.uri)
                        .and_then(|document| definition::definition(document, at.position))
                })
            }
            "textDocument/completion" => {
                self.answer(params, |server, params: lsp::CompletionParams| {
                    let at = &params.text_document_position;
                    server
                        .document(&at.text_document.uri)
                        .map(|document| completion::complete(document, at.position))
                })
            }
            "textDocument/documentSymbol" => {
                self.answer(params, |server, params: lsp::DocumentSymbolParams| {
                    server
                        .document(&params.text_document.uri)
                        .map(symbols::document_symbols)
                })
            }
            "textDocument/semanticTokens/full" => {
                self.answer(params, |server, params: lsp::SemanticTokensParams| {
                    server
                        .document(&params.text_document.uri)
                        .map(semantic::tokens)
                })
            }
            "textDocument/formatting" => {
                let params = parse::<lsp::DocumentFormattingParams>(params)?;
                let edits = match self.document(&params.text_document.uri) {
                    None => None,
                    Some(document) => match format_edits(document) {
                        Ok(edits) => Some(edits),
                        Err(message) => {
                            replies.push(Outgoing::Message(show_message(
                                lsp::MessageType::WARNING,
                                &message,
                            )));
                            None
                        }
                    },
                };
                Ok(serde_json::to_string(&edits).expect("edits serialize"))
            }
            _ => Err((
                ErrorCode::MethodNotFound as i32,
                format!("holoc lsp does not handle `{method}`"),
            )),
        }
    }

    /// Parses a request's parameters and answers with `handle`'s result as JSON (`null` for `None`).
    fn answer<P: DeserializeOwned, R: serde::Serialize>(
        &mut self,
        params: Value,
        handle: impl FnOnce(&mut Self, P) -> Option<R>,
    ) -> Result<String, (i32, String)> {
        let params = parse::<P>(params)?;
        Ok(serde_json::to_string(&handle(self, params)).expect("results serialize"))
    }

    fn notification(&mut self, notification: Notification, replies: &mut Vec<Outgoing>) {
        match notification.method.as_str() {
            "textDocument/didOpen" => {
                let Ok(params) = parse::<lsp::DidOpenTextDocumentParams>(notification.params)
                else {
                    return;
                };
                let document = params.text_document;
                replies.push(Outgoing::Message(self.update(
                    document.uri,
                    document.text,
                    true,
                )));
            }
            "textDocument/didChange" => {
                let Ok(params) = parse::<lsp::DidChangeTextDocumentParams>(notification.params)
                else {
                    return;
                };
                // Full synchronisation: the last change holds the whole text.
                if let Some(change) = params.content_changes.into_iter().last() {
                    replies.push(Outgoing::Message(self.update(
                        params.text_document.uri,
                        change.text,
                        false,
                    )));
                }
            }
            "textDocument/didSave" => {
                let Ok(params) = parse::<lsp::DidSaveTextDocumentParams>(notification.params)
                else {
                    return;
                };
                // The crate's Rust code may have changed too: scan it again.
                let uri = params.text_document.uri;
                if let Some(text) = self.documents.get(uri.as_str()).map(|d| d.text.clone()) {
                    replies.push(Outgoing::Message(self.update(uri, text, true)));
                }
            }
            "textDocument/didClose" => {
                let Ok(params) = parse::<lsp::DidCloseTextDocumentParams>(notification.params)
                else {
                    return;
                };
                self.documents.remove(params.text_document.uri.as_str());
                replies.push(Outgoing::Message(diagnostics::publish(
                    &params.text_document.uri,
                    Vec::new(),
                )));
            }
            _ => {}
        }
    }

    /// Stores and analyses a new text of a document; returns its diagnostics notification.
    fn update(&mut self, uri: lsp::Uri, text: String, rescan: bool) -> Message {
        let path = position::uri_to_path(&uri);
        let options = self.options(path.as_deref(), rescan);
        let options = match path.as_deref() {
            Some(path) => options.for_file(path),
            None => options.clone(),
        };
        let output = crate::compile(text.as_bytes(), &options);
        let last_tree = match &output.document {
            Some(_) => None,
            None => salvage(&text).or_else(|| {
                self.documents
                    .remove(uri.as_str())
                    .and_then(|previous| previous.output.document.or(previous.last_tree))
            }),
        };
        let document = Document {
            lines: Lines::new(&text),
            uri: uri.clone(),
            text,
            output,
            last_tree,
            options,
        };
        let published = diagnostics::publish(&uri, diagnostics::of(&document));
        self.documents.insert(uri.as_str().to_string(), document);
        published
    }

    /// The checker options for a file: its crate's scan (made once, or again with `rescan`), or none.
    fn options(&mut self, path: Option<&Path>, rescan: bool) -> &Options {
        match path.and_then(scan::crate_root) {
            Some(root) => {
                if rescan || !self.crates.contains_key(&root) {
                    let options = Options::with_builtins(Some(scan::scan_crate(&root)));
                    self.crates.insert(root.clone(), options);
                }
                &self.crates[&root]
            }
            None => &self.outside,
        }
    }

    fn document(&self, uri: &lsp::Uri) -> Option<&Document> {
        self.documents.get(uri.as_str())
    }
}

/// The tree of a text's lines that lex, when they parse: the lexer leaves out each line with an error.
fn salvage(text: &str) -> Option<ast::Document> {
    let index = crate::span::LineIndex::new(text);
    let lexed = crate::lexer::lex(text, &index);
    crate::parser::parse(lexed.tokens, &index).ok()
}

fn parse<P: DeserializeOwned>(params: Value) -> Result<P, (i32, String)> {
    serde_json::from_value(params).map_err(|error| {
        (
            ErrorCode::InvalidParams as i32,
            format!("invalid parameters: {error}"),
        )
    })
}

/// The one edit that turns the document into its canonical layout, or why there is none.
fn format_edits(document: &Document) -> Result<Vec<lsp::TextEdit>, String> {
    match crate::fmt::format(&document.text) {
        Ok(formatted) if formatted == document.text => Ok(Vec::new()),
        Ok(formatted) => Ok(vec![lsp::TextEdit {
            range: lsp::Range {
                start: lsp::Position::new(0, 0),
                end: document.lines.position(&document.text, document.text.len()),
            },
            new_text: formatted,
        }]),
        Err(crate::fmt::Error::Invalid(_)) => {
            Err("holoc fmt: the file has errors; fix them to format it".to_string())
        }
        Err(error) => Err(format!("holoc fmt: {error}")),
    }
}

fn show_message(kind: lsp::MessageType, message: &str) -> Message {
    Message::Notification(Notification::new(
        "window/showMessage".to_string(),
        lsp::ShowMessageParams {
            typ: kind,
            message: message.to_string(),
        },
    ))
}

/// JSON-RPC's answer to a message that is not JSON-RPC: a parse error with a null id.
fn write_parse_error(output: &mut impl Write, detail: &str) -> io::Result<()> {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": { "code": ErrorCode::ParseError as i32, "message": format!("not a JSON-RPC message: {detail}") },
    })
    .to_string();
    write!(output, "Content-Length: {}\r\n\r\n{body}", body.len())?;
    output.flush()
}

fn initialize_result() -> Value {
    let capabilities = lsp::ServerCapabilities {
        text_document_sync: Some(lsp::TextDocumentSyncCapability::Options(
            lsp::TextDocumentSyncOptions {
                open_close: Some(true),
                change: Some(lsp::TextDocumentSyncKind::FULL),
                save: Some(lsp::TextDocumentSyncSaveOptions::Supported(true)),
                ..lsp::TextDocumentSyncOptions::default()
            },
        )),
        hover_provider: Some(lsp::HoverProviderCapability::Simple(true)),
        definition_provider: Some(lsp::OneOf::Left(true)),
        completion_provider: Some(lsp::CompletionOptions {
            trigger_characters: Some(
                ["|", " ", ":", "<", "="]
                    .iter()
                    .map(|c| c.to_string())
                    .collect(),
            ),
            ..lsp::CompletionOptions::default()
        }),
        document_symbol_provider: Some(lsp::OneOf::Left(true)),
        document_formatting_provider: Some(lsp::OneOf::Left(true)),
        semantic_tokens_provider: Some(
            lsp::SemanticTokensServerCapabilities::SemanticTokensOptions(
                lsp::SemanticTokensOptions {
                    legend: semantic::legend(),
                    full: Some(lsp::SemanticTokensFullOptions::Bool(true)),
                    range: None,
                    work_done_progress_options: lsp::WorkDoneProgressOptions::default(),
                },
            ),
        ),
        ..lsp::ServerCapabilities::default()
    };
    serde_json::to_value(lsp::InitializeResult {
        capabilities,
        server_info: Some(lsp::ServerInfo {
            name: "holoc".to_string(),
            version: Some(env!("CARGO_PKG_VERSION").to_string()),
        }),
    })
    .expect("the capabilities serialize")
}
