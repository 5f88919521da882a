//! The `openai` sampler against real HTTP servers on 127.0.0.1 (ephemeral ports): a fake that answers like
//! vLLM (or like a plain OpenAI server), and handlers that inject faults. Requests are counted server-side
//! to check the retry policy. Nothing here leaves the loopback interface.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use holo_core::openai::{OpenAi, OpenAiConfig};
use holo_core::{
    ChatMessage, Completion, Finish, Prompt, Request, Role, SampleParams, Sampler, SamplerError,
};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::common::http::{read_request, Seen};

// ---------------------------------------------------------------------------------------------------
// A small HTTP/1.1 server: one request per connection, answered by a handler.

enum Reply {
    Json(u16, Value),
    /// Status, extra headers, body.
    Raw(u16, Vec<(&'static str, String)>, String),
    /// Close the connection without answering.
    Drop,
    /// Wait, then reply.
    After(Duration, Box<Reply>),
}

/// The handler gets the request and how many times this exact body has been received (1 on the first).
type Handler = Arc<dyn Fn(&Seen, usize) -> Reply + Send + Sync>;

struct Server {
    base: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    max_in_flight: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Server {
    async fn start(handler: impl Fn(&Seen, usize) -> Reply + Send + Sync + 'static) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let handler: Handler = Arc::new(handler);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let counts = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let max_in_flight = Arc::new(AtomicUsize::new(0));
        let accept = {
            let (seen, max_in_flight) = (seen.clone(), max_in_flight.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        return;
                    };
                    let (handler, seen, counts) = (handler.clone(), seen.clone(), counts.clone());
                    let (in_flight, max_in_flight) = (in_flight.clone(), max_in_flight.clone());
                    tokio::spawn(async move {
                        let mut stream = stream;
                        let Some(request) = read_request(&mut stream).await else {
                            return;
                        };
                        let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        max_in_flight.fetch_max(now, Ordering::SeqCst);
                        let n = {
                            let mut counts = counts.lock().unwrap();
                            let count = counts.entry(request.body.to_string()).or_default();
                            *count += 1;
                            *count
                        };
                        seen.lock().unwrap().push(request.clone());
                        let reply = handler(&request, n);
                        // Leave the count before the reply is written: once the client has the reply
                        // it may start its next request, which must not see this one still counted.
                        respond(&mut stream, reply, || {
                            in_flight.fetch_sub(1, Ordering::SeqCst);
                        })
                        .await;
                    });
                }
            })
        };
        Server {
            base,
            seen,
            max_in_flight,
            accept,
        }
    }

    fn requests(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn respond(stream: &mut TcpStream, reply: Reply, before_writing: impl FnOnce()) {
    let mut reply = reply;
    let mut before_writing = Some(before_writing);
    let mut finish = || {
        if let Some(before_writing) = before_writing.take() {
            before_writing();
        }
    };
    loop {
        match reply {
            Reply::After(delay, next) => {
                tokio::time::sleep(delay).await;
                reply = *next;
            }
            Reply::Drop => {
                finish();
                return;
            }
            Reply::Json(status, body) => {
                reply = Reply::Raw(status, Vec::new(), body.to_string());
            }
            Reply::Raw(status, headers, body) => {
                let mut out = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
                    body.len()
                );
                for (name, value) in headers {
                    out.push_str(&format!("{name}: {value}\r\n"));
                }
                out.push_str("\r\n");
                out.push_str(&body);
                finish();
                let _ = stream.write_all(out.as_bytes()).await;
                let _ = stream.shutdown().await;
                return;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// A fake model served like vLLM: every character is a token (id = its code point), the model "writes"
// a continuation derived from the prompt, and stop strings, max_tokens and the end of sequence are
// applied the way vLLM applies them.

const EOS: u32 = 2;

#[derive(Clone, Copy)]
struct Fake {
    /// vLLM: `stop_reason`, honours `include_stop_str_in_output` and `return_tokens_as_token_ids`, puts
    /// the EOS token in the token list. Otherwise a plain OpenAI server: strips stop strings, reports no
    /// stop reason, tokens are text.
    vllm: bool,
    /// Ignore `include_stop_str_in_output` (always strip).
    strip_stop: bool,
    /// Send no logprobs at all.
    no_logprobs: bool,
}

const VLLM: Fake = Fake {
    vllm: true,
    strip_stop: false,
    no_logprobs: false,
};
const PLAIN: Fake = Fake {
    vllm: false,
    strip_stop: true,
    no_logprobs: false,
};

/// What the fake model writes for a request body.
fn script(body: &Value) -> String {
    let prompt = if let Some(messages) = body.get("messages") {
        messages
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                format!(
                    "{}={}",
                    m["role"].as_str().unwrap(),
                    m["content"].as_str().unwrap()
                )
            })
            .collect::<Vec<_>>()
            .join(";")
    } else {
        match &body["prompt"] {
            Value::String(text) => text.clone(),
            ids => format!("ids {ids}"),
        }
    };
    format!("[{prompt}] <answer>42</answer> and more")
}

fn logprob(i: usize) -> f64 {
    -(i as f64 + 1.0) / 64.0
}

fn fake(fake: Fake, body: &Value) -> Reply {
    let flag = |name: &str| fake.vllm && body.get(name) == Some(&json!(true));
    let stops: Vec<String> = body
        .get("stop")
        .map(|s| serde_json::from_value(s.clone()).unwrap())
        .unwrap_or_default();
    let max_tokens = body
        .get("max_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(1 << 20) as usize;
    let chat = body.get("messages").is_some();

    let mut written = String::new();
    let mut tokens: Vec<u32> = Vec::new();
    let mut finish = ("stop", Value::Null);
    let mut text = None;
    for c in script(body).chars() {
        if tokens.len() == max_tokens {
            finish = ("length", Value::Null);
            break;
        }
        written.push(c);
        tokens.push(c as u32);
        if let Some((at, stop)) = stops
            .iter()
            .filter_map(|s| written.find(s.as_str()).map(|at| (at, s)))
            .min()
        {
            let keep = flag("include_stop_str_in_output") && !fake.strip_stop;
            text = Some(written[..if keep { at + stop.len() } else { at }].to_string());
            finish = ("stop", json!(stop));
            break;
        }
    }
    let text = match text {
        Some(text) => text,
        None => {
            if finish.0 == "stop" && fake.vllm {
                tokens.push(EOS); // vLLM lists the EOS token, the text does not show it
            }
            written
        }
    };
    let as_ids = flag("return_tokens_as_token_ids");
    let token_strings: Vec<String> = tokens
        .iter()
        .map(|&id| match (as_ids, char::from_u32(id)) {
            (true, _) => format!("token_id:{id}"),
            (false, Some(c)) if id != EOS => c.to_string(),
            (false, _) => "</s>".to_string(),
        })
        .collect();
    let wants_logprobs =
        body.get("logprobs").is_some_and(|l| l != &json!(false)) && !fake.no_logprobs;
    let logprobs = match (wants_logprobs, chat) {
        (false, _) => Value::Null,
        (true, false) => json!({
            "text_offset": (0..tokens.len()).collect::<Vec<_>>(),
            "token_logprobs": (0..tokens.len()).map(logprob).collect::<Vec<_>>(),
            "tokens": token_strings,
            "top_logprobs": token_strings.iter().enumerate()
                .map(|(i, t)| json!({ t.clone(): logprob(i) })).collect::<Vec<_>>(),
        }),
        (true, true) => json!({
            "content": token_strings.iter().enumerate().map(|(i, t)| json!({
                "token": t, "logprob": logprob(i), "bytes": t.as_bytes(), "top_logprobs": []
            })).collect::<Vec<_>>()
        }),
    };
    let mut choice = if chat {
        json!({ "index": 0, "message": { "role": "assistant", "content": text }, "logprobs": logprobs,
                "finish_reason": finish.0 })
    } else {
        json!({ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish.0 })
    };
    if fake.vllm {
        choice["stop_reason"] = finish.1;
    }
    Reply::Json(
        200,
        json!({
            "id": "cmpl-1",
            "object": if chat { "chat.completion" } else { "text_completion" },
            "model": body["model"],
            "choices": [choice],
            "usage": { "prompt_tokens": 3, "completion_tokens": tokens.len() },
        }),
    )
}

fn vllm(seen: &Seen) -> Reply {
    fake(VLLM, &seen.body)
}

/// The ids and logprobs the fake reports for `text` (plus EOS when the model ended its sequence).
fn expected(text: &str, eos: bool) -> (Vec<u32>, Vec<f32>) {
    let mut ids: Vec<u32> = text.chars().map(|c| c as u32).collect();
    if eos {
        ids.push(EOS);
    }
    let logprobs = (0..ids.len()).map(|i| logprob(i) as f32).collect();
    (ids, logprobs)
}

// ---------------------------------------------------------------------------------------------------

/// Fast retries, a short deadline, no proxies, no API key.
fn config(server: &Server) -> OpenAiConfig {
    OpenAiConfig {
        request_timeout: Duration::from_secs(3),
        connect_timeout: Duration::from_secs(1),
        max_retries: 4,
        max_malformed_retries: 1,
        base_delay: Duration::from_millis(1),
        max_delay: Duration::from_millis(20),
        jitter_seed: Some(42),
        proxy_from_env: false,
        api_key_env: "HOLO_OPENAI_TEST_UNSET_KEY".into(),
        ..OpenAiConfig::new(server.base.clone(), "fake-model")
    }
}

fn text(prompt: &str) -> Request {
    Request {
        prompt: Prompt::Text(prompt.into()),
        params: SampleParams::default(),
    }
}

fn with_stop(mut request: Request, stop: &str) -> Request {
    request.params.stop = vec![stop.into()];
    request
}

async fn one(sampler: &OpenAi, request: Request) -> Result<Completion, SamplerError> {
    let mut results = sampler.sample(&[request]).await;
    assert_eq!(results.len(), 1);
    results.pop().unwrap()
}

fn rejected(message: &str) -> Reply {
    Reply::Json(
        400,
        json!({ "object": "error", "message": message, "type": "BadRequestError", "param": null, "code": 400 }),
    )
}

// ---------------------------------------------------------------------------------------------------
// Mapping of requests and answers.

#[tokio::test]
async fn token_prompt_goes_to_completions_with_every_parameter() {
    let server = Server::start(|seen, _| vllm(seen)).await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let request = Request {
        prompt: Prompt::Tokens(vec![151644, 872, 198]),
        params: SampleParams {
            max_tokens: Some(64),
            temperature: Some(0.7),
            top_p: Some(0.9),
            top_k: Some(20),
            stop: vec!["</answer>".into(), "\n\n".into()],
            seed: Some(1234),
            top_logprobs: 0,
            ..SampleParams::default()
        },
    };
    let completion = one(&sampler, request).await.unwrap();

    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "POST");
    assert_eq!(seen[0].path, "/v1/completions");
    assert_eq!(seen[0].headers["content-type"], "application/json");
    assert!(!seen[0].headers.contains_key("authorization"));
    assert_eq!(
        seen[0].body,
        json!({
            "model": "fake-model",
            "prompt": [151644, 872, 198],
            "logprobs": 1,
            "n": 1,
            "stream": false,
            "max_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "stop": ["</answer>", "\n\n"],
            "seed": 1234,
            "return_tokens_as_token_ids": true,
            "include_stop_str_in_output": true,
        })
    );

    let text = "[ids [151644,872,198]] <answer>42</answer>";
    let (tokens, logprobs) = expected(text, false);
    assert_eq!(
        completion,
        Completion {
            text: text.into(),
            tokens,
            logprobs,
            top_logprobs: Vec::new(),
            finish: Finish::Stop("</answer>".into()),
            routes: Vec::new(),
            weight_version: None,
            constraint: None,
        }
    );
}

#[tokio::test]
async fn text_prompt_length_and_end_of_sequence() {
    let server = Server::start(|seen, _| vllm(seen)).await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let mut short = text("Q");
    short.params.max_tokens = Some(5);
    let results = sampler.sample(&[short, text("Q")]).await;

    let long = results[0].as_ref().unwrap();
    assert_eq!(long.text, "[Q] <");
    assert_eq!(long.finish, Finish::Length);
    assert_eq!(
        (long.tokens.clone(), long.logprobs.clone()),
        expected("[Q] <", false)
    );

    let eos = results[1].as_ref().unwrap();
    assert_eq!(eos.text, "[Q] <answer>42</answer> and more");
    assert_eq!(eos.finish, Finish::EndOfTurn);
    // vLLM lists the EOS token, which the text does not show; it is kept as sampled.
    assert_eq!(
        (eos.tokens.clone(), eos.logprobs.clone()),
        expected(&eos.text, true)
    );
    assert_eq!(server.seen()[0].body["prompt"], json!("Q"));
    assert_eq!(server.requests(), 2);
}

#[tokio::test]
async fn chat_continues_a_final_assistant_message() {
    let server = Server::start(|seen, _| vllm(seen)).await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let messages = vec![
        ChatMessage {
            role: Role::System,
            content: "Be brief.".into(),
        },
        ChatMessage {
            role: Role::User,
            content: "6*7?".into(),
        },
        ChatMessage {
            role: Role::Assistant,
            content: "<think>".into(),
        },
    ];
    let request = with_stop(
        Request {
            prompt: Prompt::Chat(messages),
            params: SampleParams::default(),
        },
        "</answer>",
    );
    let completion = one(&sampler, request).await.unwrap();

    let seen = &server.seen()[0];
    assert_eq!(seen.path, "/v1/chat/completions");
    assert_eq!(
        seen.body,
        json!({
            "model": "fake-model",
            "messages": [
                { "role": "system", "content": "Be brief." },
                { "role": "user", "content": "6*7?" },
                { "role": "assistant", "content": "<think>" },
            ],
            "logprobs": true,
            "continue_final_message": true,
            "add_generation_prompt": false,
            "n": 1,
            "stream": false,
            "stop": ["</answer>"],
            "return_tokens_as_token_ids": true,
            "include_stop_str_in_output": true,
        })
    );
    let text = "[system=Be brief.;user=6*7?;assistant=<think>] <answer>42</answer>";
    let (tokens, logprobs) = expected(text, false);
    assert_eq!(
        completion,
        Completion {
            text: text.into(),
            tokens,
            logprobs,
            top_logprobs: Vec::new(),
            finish: Finish::Stop("</answer>".into()),
            routes: Vec::new(),
            weight_version: None,
            constraint: None,
        }
    );
}

#[tokio::test]
async fn chat_ending_with_a_user_message_starts_a_new_turn() {
    let server = Server::start(|seen, _| vllm(seen)).await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let request = Request {
        prompt: Prompt::Chat(vec![ChatMessage {
            role: Role::User,
            content: "hi".into(),
        }]),
        params: SampleParams::default(),
    };
    let completion = one(&sampler, request).await.unwrap();
    let body = &server.seen()[0].body;
    assert!(body.get("continue_final_message").is_none());
    assert!(body.get("add_generation_prompt").is_none());
    assert_eq!(completion.text, "[user=hi] <answer>42</answer> and more");
    assert_eq!(completion.finish, Finish::EndOfTurn);
}

#[tokio::test]
async fn chat_template_kwargs_go_with_chat_requests_only() {
    let server = Server::start(|seen, _| vllm(seen)).await;
    let kwargs = json!({"enable_thinking": false});
    let sampler = OpenAi::new(OpenAiConfig {
        chat_template_kwargs: kwargs.as_object().cloned(),
        ..config(&server)
    })
    .unwrap();
    let chat = Request {
        prompt: Prompt::Chat(vec![ChatMessage {
            role: Role::User,
            content: "hi".into(),
        }]),
        params: SampleParams::default(),
    };
    one(&sampler, chat.clone()).await.unwrap();
    one(&sampler, text("Q")).await.unwrap();
    // A request's own (a context's `<|+++ enable_thinking=true depth=2|>`) over the sampler's.
    let own = json!({"enable_thinking": true, "depth": 2});
    let with_own = |prompt| Request {
        prompt,
        params: SampleParams {
            chat_template_kwargs: own.as_object().cloned(),
            ..SampleParams::default()
        },
    };
    one(&sampler, with_own(chat.prompt.clone())).await.unwrap();
    let refused = one(&sampler, with_own(Prompt::Text("Q".into()))).await;
    assert!(
        matches!(&refused, Err(SamplerError::Rejected(message)) if message.contains("chat prompts only")),
        "{refused:?}"
    );
    let seen = server.seen();
    assert_eq!(seen.len(), 3, "the refused request is not sent");
    assert_eq!(seen[0].body["chat_template_kwargs"], kwargs);
    // A text or token prompt is rendered already: nothing to pass.
    assert!(seen[1].body.get("chat_template_kwargs").is_none());
    assert_eq!(seen[2].body["chat_template_kwargs"], own);
}

#[tokio::test]
async fn stop_string_is_appended_when_the_server_strips_it() {
    // A vLLM that ignores include_stop_str_in_output: the stop string comes back in stop_reason only.
    let stripping = Fake {
        strip_stop: true,
        ..VLLM
    };
    let server = Server::start(move |seen, _| fake(stripping, &seen.body)).await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let completion = one(&sampler, with_stop(text("Q"), "</answer>"))
        .await
        .unwrap();
    assert_eq!(completion.text, "[Q] <answer>42</answer>");
    assert_eq!(completion.finish, Finish::Stop("</answer>".into()));
    assert_eq!(
        (completion.tokens, completion.logprobs),
        expected(&completion.text, false)
    );

    // With the extensions off, vLLM strips the stop string and still reports it: appended.
    let sampler = OpenAi::new(OpenAiConfig {
        vllm_extensions: false,
        ..config(&server)
    })
    .unwrap();
    let completion = one(&sampler, with_stop(text("R"), "42")).await.unwrap();
    assert_eq!(completion.text, "[R] <answer>42");
    assert_eq!(completion.finish, Finish::Stop("42".into()));
    let body = &server.seen()[1].body;
    for field in [
        "return_tokens_as_token_ids",
        "include_stop_str_in_output",
        "continue_final_message",
    ] {
        assert!(body.get(field).is_none(), "{field} sent: {body}");
    }
    // No ids without return_tokens_as_token_ids; the logprobs still come.
    assert!(completion.tokens.is_empty());
    assert_eq!(completion.logprobs, expected(&completion.text, false).1);
}

#[tokio::test]
async fn a_text_ending_in_the_stop_string_is_not_doubled() {
    // vLLM kept the stop string as asked: it ends the text once, not twice.
    let server = Server::start(|seen, _| vllm(seen)).await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let completion = one(&sampler, with_stop(text("Q"), "4")).await.unwrap();
    assert_eq!(completion.text, "[Q] <answer>4");
    assert_eq!(completion.finish, Finish::Stop("4".into()));
}

/// A fenced constraint's closing tag is not sent as a stop string (vLLM would cut the JSON string that
/// holds it): the reply the grammar ended, with the end of sequence vLLM lists after the tag, is read as
/// stopped at the tag, without that token. A grammar that is not a fence's keeps its stop strings.
#[tokio::test]
async fn a_fenced_constraint_ends_at_its_closing_tag_without_the_stop_string() {
    const REPLY: &str = r#"{"tag": "</answer>"}</answer>"#;
    let server = Server::start(|_, _| {
        let mut ids: Vec<u32> = REPLY.chars().map(|c| c as u32).collect();
        ids.push(EOS);
        let choice = json!({
            "index": 0,
            "text": REPLY,
            "logprobs": {
                "tokens": ids.iter().map(|id| format!("token_id:{id}")).collect::<Vec<_>>(),
                "token_logprobs": (0..ids.len()).map(logprob).collect::<Vec<_>>(),
            },
            "finish_reason": "stop",
            "stop_reason": null,
        });
        Reply::Json(200, json!({ "choices": [choice] }))
    })
    .await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let schema = holoc::ir::Constraint::JsonSchema(r#"{"type": "object"}"#.into());
    let fenced = |constraint: holoc::ir::Constraint| {
        let mut request = text("Q");
        request.params.stop = vec!["</answer>".into(), "\n\n".into()];
        request.params.constraint = Some(holo_core::Constraint::from(&constraint));
        request
    };
    let completion = one(&sampler, fenced(schema.fenced("answer")))
        .await
        .unwrap();
    assert_eq!(server.seen()[0].body["stop"], json!(["\n\n"]));
    let (tokens, logprobs) = expected(REPLY, false);
    assert_eq!(
        (completion.text.as_str(), &completion.finish),
        (REPLY, &Finish::Stop("</answer>".into()))
    );
    assert_eq!((completion.tokens, completion.logprobs), (tokens, logprobs));

    // The same grammar with another fence's tag, and a grammar of the tag's own: sent as they are.
    for constraint in [
        schema.fenced("other"),
        holoc::ir::Constraint::Grammar(r#"start: "x" "</answer>""#.into()),
    ] {
        let completion = one(&sampler, fenced(constraint)).await.unwrap();
        assert_eq!(completion.finish, Finish::EndOfTurn);
        assert_eq!(completion.tokens.last(), Some(&EOS));
    }
    let sent: Vec<Value> = server.seen()[1..]
        .iter()
        .map(|seen| seen.body["stop"].clone())
        .collect();
    assert_eq!(
        sent,
        [json!(["</answer>", "\n\n"]), json!(["</answer>", "\n\n"])]
    );
}

#[tokio::test]
async fn stop_token_id_and_unknown_finish_reasons_end_the_turn() {
    let server = Server::start(|seen, _| {
        let chat = seen.body.get("messages").is_some();
        let mut choice =
            json!({ "index": 0, "text": "done", "finish_reason": "stop", "stop_reason": 151645 });
        if chat {
            choice = json!({ "index": 0, "message": { "role": "assistant", "content": null },
                             "finish_reason": "tool_calls" });
        }
        Reply::Json(200, json!({ "choices": [choice] }))
    })
    .await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let completion = one(&sampler, with_stop(text("Q"), "</answer>"))
        .await
        .unwrap();
    assert_eq!(completion.text, "done");
    assert_eq!(completion.finish, Finish::EndOfTurn);
    assert!(completion.tokens.is_empty() && completion.logprobs.is_empty());

    let chat = Request {
        prompt: Prompt::Chat(vec![ChatMessage {
            role: Role::User,
            content: "hi".into(),
        }]),
        params: SampleParams::default(),
    };
    let completion = one(&sampler, chat).await.unwrap();
    assert_eq!(completion.text, "");
    assert_eq!(completion.finish, Finish::EndOfTurn);
}

#[tokio::test]
async fn a_plain_openai_server_without_ids_or_stop_reason() {
    let server = Server::start(|seen, _| fake(PLAIN, &seen.body)).await;
    let sampler = OpenAi::new(OpenAiConfig {
        vllm_extensions: false,
        ..config(&server)
    })
    .unwrap();
    let results = sampler
        .sample(&[with_stop(text("Q"), "</answer>"), text("Q")])
        .await;

    // Which stop matched is unknown and the server stripped it: the text is left as it is.
    let stopped = results[0].as_ref().unwrap();
    assert_eq!(stopped.text, "[Q] <answer>42");
    assert_eq!(stopped.finish, Finish::Stop(String::new()));
    assert!(stopped.tokens.is_empty(), "tokens are text, not ids");
    // The logprobs cover every sampled token, those of the stripped stop string too.
    assert_eq!(
        stopped.logprobs,
        expected("[Q] <answer>42</answer>", false).1
    );

    // No stop strings requested: "stop" is the end of the turn.
    let ended = results[1].as_ref().unwrap();
    assert_eq!(ended.text, "[Q] <answer>42</answer> and more");
    assert_eq!(ended.finish, Finish::EndOfTurn);

    // A server that keeps the stop string in the text but does not say which matched.
    let keeping = Server::start(|_, _| {
        Reply::Json(
            200,
            json!({ "choices": [{ "index": 0, "text": "x</b>", "finish_reason": "stop" }] }),
        )
    })
    .await;
    let sampler = OpenAi::new(config(&keeping)).unwrap();
    let mut request = text("Q");
    request.params.stop = vec!["</a>".into(), "b>".into(), "</b>".into()];
    let completion = one(&sampler, request).await.unwrap();
    assert_eq!(completion.text, "x</b>");
    assert_eq!(completion.finish, Finish::Stop("</b>".into()));
}

#[tokio::test]
async fn no_logprobs_leaves_tokens_and_logprobs_empty() {
    let silent = Fake {
        no_logprobs: true,
        ..VLLM
    };
    let server = Server::start(move |seen, _| fake(silent, &seen.body)).await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let completion = one(&sampler, text("Q")).await.unwrap();
    assert_eq!(completion.text, "[Q] <answer>42</answer> and more");
    assert!(completion.tokens.is_empty());
    assert!(completion.logprobs.is_empty());
}

#[tokio::test]
async fn token_ids_field_is_preferred_over_logprob_strings() {
    let server = Server::start(|_, _| {
        Reply::Json(
            200,
            json!({ "choices": [{ "index": 0, "text": "ab", "finish_reason": "length", "stop_reason": null,
                    "token_ids": [7, 8],
                    "logprobs": { "tokens": ["a", "b"], "token_logprobs": [-0.5, -0.25] } }] }),
        )
    })
    .await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let completion = one(&sampler, text("Q")).await.unwrap();
    assert_eq!(completion.tokens, vec![7, 8]);
    assert_eq!(completion.logprobs, vec![-0.5, -0.25]);
    assert_eq!(completion.finish, Finish::Length);
}

#[tokio::test]
async fn base_url_may_end_in_v1() {
    let server = Server::start(|seen, _| vllm(seen)).await;
    let sampler = OpenAi::new(OpenAiConfig {
        base_url: format!("{}/v1/", server.base),
        ..config(&server)
    })
    .unwrap();
    one(&sampler, text("Q")).await.unwrap();
    assert_eq!(server.seen()[0].path, "/v1/completions");
}

#[test]
fn bad_configurations_are_refused() {
    let base = OpenAiConfig::new("http://127.0.0.1:1", "m");
    for config in [
        OpenAiConfig {
            base_url: "ftp://127.0.0.1".into(),
            ..base.clone()
        },
        OpenAiConfig {
            base_url: "127.0.0.1:8000".into(),
            ..base.clone()
        },
        OpenAiConfig {
            max_concurrency: 0,
            ..base.clone()
        },
    ] {
        let error = OpenAi::new(config.clone()).unwrap_err();
        assert!(error.to_string().starts_with("openai sampler: "), "{error}");
    }
    // https is supported (rustls).
    OpenAi::new(OpenAiConfig {
        base_url: "https://api.example.com/v1".into(),
        ..base
    })
    .unwrap();
}

// ---------------------------------------------------------------------------------------------------
// Authentication.

#[tokio::test]
async fn the_api_key_comes_from_the_configured_environment_variable() {
    let variable = "HOLO_OPENAI_TEST_KEY_AUTH";
    std::env::set_var(variable, "sk-test-123");
    let server = Server::start(|seen, _| vllm(seen)).await;
    let sampler = OpenAi::new(OpenAiConfig {
        api_key_env: variable.into(),
        ..config(&server)
    })
    .unwrap();
    assert!(
        !format!("{sampler:?}").contains("sk-test-123"),
        "Debug leaks the key"
    );
    one(&sampler, text("Q")).await.unwrap();
    assert_eq!(
        server.seen()[0]
            .headers
            .get("authorization")
            .map(String::as_str),
        Some("Bearer sk-test-123")
    );
    assert_eq!(
        OpenAiConfig::new("http://x", "m").api_key_env,
        "OPENAI_API_KEY"
    );
}

// ---------------------------------------------------------------------------------------------------
// Faults.

#[tokio::test]
async fn server_errors_are_retried_until_success() {
    let server = Server::start(|seen, n| {
        if n <= 2 {
            Reply::Json(500, json!({ "error": { "message": "engine hiccup" } }))
        } else {
            vllm(seen)
        }
    })
    .await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let completion = one(&sampler, text("Q")).await.unwrap();
    assert_eq!(completion.text, "[Q] <answer>42</answer> and more");
    assert_eq!(server.requests(), 3);
}

#[tokio::test]
async fn too_many_requests_is_retried_after_retry_after() {
    let server = Server::start(|seen, n| {
        if n == 1 {
            Reply::Raw(
                429,
                vec![("retry-after", "0".into())],
                r#"{"error": {"message": "slow down"}}"#.into(),
            )
        } else {
            vllm(seen)
        }
    })
    .await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    one(&sampler, text("Q")).await.unwrap();
    assert_eq!(server.requests(), 2);
}

#[tokio::test]
async fn a_timeout_is_retried() {
    let server = Server::start(|seen, n| {
        if n == 1 {
            Reply::After(Duration::from_millis(1500), Box::new(vllm(seen)))
        } else {
            vllm(seen)
        }
    })
    .await;
    let sampler = OpenAi::new(OpenAiConfig {
        request_timeout: Duration::from_millis(300),
        ..config(&server)
    })
    .unwrap();
    let started = std::time::Instant::now();
    let completion = one(&sampler, text("Q")).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(1400),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(completion.text, "[Q] <answer>42</answer> and more");
    assert_eq!(server.requests(), 2);
}

#[tokio::test]
async fn timeouts_to_the_end_are_unavailable() {
    let server =
        Server::start(|seen, _| Reply::After(Duration::from_millis(1000), Box::new(vllm(seen))))
            .await;
    let sampler = OpenAi::new(OpenAiConfig {
        request_timeout: Duration::from_millis(100),
        max_retries: 2,
        ..config(&server)
    })
    .unwrap();
    let error = one(&sampler, text("Q")).await.unwrap_err();
    let SamplerError::Unavailable(message) = &error else {
        panic!("{error:?}")
    };
    assert!(message.contains("timed out"), "{message}");
    assert!(message.contains("gave up after 3 attempts"), "{message}");
    assert_eq!(server.requests(), 3);
}

#[tokio::test]
async fn a_dropped_connection_is_retried() {
    let server = Server::start(|seen, n| if n == 1 { Reply::Drop } else { vllm(seen) }).await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let completion = one(&sampler, text("Q")).await.unwrap();
    assert_eq!(completion.finish, Finish::EndOfTurn);
    assert_eq!(server.requests(), 2);
}

#[tokio::test]
async fn a_refused_connection_is_unavailable_after_the_retries() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let sampler = OpenAi::new(OpenAiConfig {
        base_url: format!("http://127.0.0.1:{port}"),
        max_retries: 2,
        base_delay: Duration::from_millis(1),
        max_delay: Duration::from_millis(5),
        proxy_from_env: false,
        api_key_env: "HOLO_OPENAI_TEST_UNSET_KEY".into(),
        ..OpenAiConfig::new("", "m")
    })
    .unwrap();
    let error = one(&sampler, text("Q")).await.unwrap_err();
    let SamplerError::Unavailable(message) = &error else {
        panic!("{error:?}")
    };
    assert!(message.contains("cannot connect"), "{message}");
    assert!(message.contains("gave up after 3 attempts"), "{message}");
}

#[tokio::test]
async fn persistent_server_errors_are_unavailable_with_the_servers_message() {
    let server = Server::start(|_, _| {
        Reply::Json(503, json!({ "error": { "message": "model is loading" } }))
    })
    .await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let error = one(&sampler, text("Q")).await.unwrap_err();
    let SamplerError::Unavailable(message) = &error else {
        panic!("{error:?}")
    };
    assert!(message.contains("HTTP 503: model is loading"), "{message}");
    assert!(message.contains("gave up after 5 attempts"), "{message}");
    assert_eq!(server.requests(), 5, "max_retries = 4 → 5 attempts");
}

#[tokio::test]
async fn a_client_error_is_rejected_without_retry() {
    let server = Server::start(|_, _| {
        rejected("This model's maximum context length is 4096 tokens. However, you requested 5000 tokens.")
    })
    .await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let error = one(&sampler, text("Q")).await.unwrap_err();
    assert_eq!(
        error,
        SamplerError::Rejected(
            "HTTP 400: This model's maximum context length is 4096 tokens. However, you requested 5000 tokens."
                .into()
        )
    );
    assert_eq!(server.requests(), 1);
}

#[tokio::test]
async fn malformed_json_is_retried_a_bounded_number_of_times() {
    let server =
        Server::start(|_, _| Reply::Raw(200, Vec::new(), r#"{"choices": [{"text": "#.into())).await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let error = one(&sampler, text("Q")).await.unwrap_err();
    let SamplerError::Malformed(message) = &error else {
        panic!("{error:?}")
    };
    assert!(message.contains("not JSON"), "{message}");
    assert_eq!(server.requests(), 2, "one retry of a malformed answer");

    // With no malformed retries, a single attempt.
    let sampler = OpenAi::new(OpenAiConfig {
        max_malformed_retries: 0,
        ..config(&server)
    })
    .unwrap();
    assert!(matches!(
        one(&sampler, text("R")).await,
        Err(SamplerError::Malformed(_))
    ));
    assert_eq!(server.requests(), 3);
}

#[tokio::test]
async fn missing_fields_are_malformed_and_a_good_retry_recovers() {
    let bodies = [
        json!({ "object": "text_completion" }),
        json!({ "choices": [] }),
        json!({ "choices": [{ "index": 0, "finish_reason": "stop" }] }),
        json!({ "choices": [{ "index": 0, "text": "x" }] }),
        json!({ "choices": [{ "index": 0, "text": "ab", "finish_reason": "length", "token_ids": [1, 2, 3],
                 "logprobs": { "tokens": ["a", "b"], "token_logprobs": [-1.0, -1.0] } }] }),
    ];
    for (case, body) in bodies.into_iter().enumerate() {
        let body = Arc::new(body);
        let bad = body.clone();
        let server = Server::start(move |_, _| Reply::Json(200, (*bad).clone())).await;
        let sampler = OpenAi::new(OpenAiConfig {
            max_malformed_retries: 0,
            ..config(&server)
        })
        .unwrap();
        let result = one(&sampler, text("Q")).await;
        assert!(
            matches!(result, Err(SamplerError::Malformed(_))),
            "{case}: {result:?}"
        );

        let bad = body.clone();
        let server = Server::start(move |seen, n| {
            if n == 1 {
                Reply::Json(200, (*bad).clone())
            } else {
                vllm(seen)
            }
        })
        .await;
        let sampler = OpenAi::new(config(&server)).unwrap();
        let completion = one(&sampler, text("Q")).await;
        assert!(completion.is_ok(), "{case}: {completion:?}");
        assert_eq!(server.requests(), 2);
    }
}

#[tokio::test]
async fn an_aborted_generation_is_retried() {
    let server = Server::start(|seen, n| {
        if n == 1 {
            Reply::Json(
                200,
                json!({ "choices": [{ "index": 0, "text": "", "finish_reason": "abort" }] }),
            )
        } else {
            vllm(seen)
        }
    })
    .await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    one(&sampler, text("Q")).await.unwrap();
    assert_eq!(server.requests(), 2);
}

#[tokio::test]
async fn one_failed_request_loses_nothing_of_the_batch() {
    let server = Server::start(|seen, n| match seen.body["prompt"].as_str() {
        Some("bad") => rejected("prompt is bad"),
        Some("down") => Reply::Json(500, json!({ "error": { "message": "shard down" } })),
        Some("flaky") if n == 1 => Reply::Drop,
        Some("slow") if n == 1 => Reply::Json(502, json!({ "error": "bad gateway" })),
        _ => vllm(seen),
    })
    .await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let prompts = ["a", "bad", "flaky", "down", "slow", "b"];
    let batch: Vec<Request> = prompts.iter().map(|p| text(p)).collect();
    let results = sampler.sample(&batch).await;
    assert_eq!(results.len(), prompts.len());
    for (prompt, result) in prompts.iter().zip(&results) {
        match *prompt {
            "bad" => assert_eq!(
                result,
                &Err(SamplerError::Rejected("HTTP 400: prompt is bad".into()))
            ),
            "down" => assert!(
                matches!(result, Err(SamplerError::Unavailable(m)) if m.contains("shard down")),
                "{result:?}"
            ),
            _ => assert_eq!(
                result.as_ref().unwrap().text,
                format!("[{prompt}] <answer>42</answer> and more")
            ),
        }
    }
    let count = |prompt: &str| {
        server
            .seen()
            .iter()
            .filter(|seen| seen.body["prompt"] == json!(prompt))
            .count()
    };
    assert_eq!(
        [
            count("a"),
            count("bad"),
            count("flaky"),
            count("down"),
            count("slow"),
            count("b")
        ],
        [1, 1, 2, 5, 2, 1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrency_is_bounded_across_the_batch() {
    // Long enough that requests overlap even on a loaded machine.
    let server =
        Server::start(|seen, _| Reply::After(Duration::from_millis(250), Box::new(vllm(seen))))
            .await;
    let sampler = OpenAi::new(OpenAiConfig {
        max_concurrency: 3,
        ..config(&server)
    })
    .unwrap();
    let batch: Vec<Request> = (0..12).map(|i| text(&format!("p{i}"))).collect();
    let results = sampler.sample(&batch).await;
    for (i, result) in results.iter().enumerate() {
        assert_eq!(
            result.as_ref().unwrap().text,
            format!("[p{i}] <answer>42</answer> and more"),
            "results stay in request order"
        );
    }
    let max = server.max_in_flight.load(Ordering::SeqCst);
    assert!((2..=3).contains(&max), "max in flight {max}");
    assert_eq!(server.requests(), 12);
}

#[tokio::test]
async fn the_sampler_works_behind_the_trait_object() {
    let server = Server::start(|seen, _| vllm(seen)).await;
    let sampler: Box<dyn Sampler> = Box::new(OpenAi::new(config(&server)).unwrap());
    let results = sampler.sample(&[]).await;
    assert!(results.is_empty());
    let results = sampler.sample(&[text("x")]).await;
    assert_eq!(results[0].as_ref().unwrap().finish, Finish::EndOfTurn);
}

/// A holoware's sampler tag constraints reach an OpenAI-compatible server as the fields vLLM reads:
/// `response_format` for JSON, `guided_regex`, `guided_choice`, `guided_grammar`.
#[tokio::test]
async fn sampler_tag_constraints_go_as_vllms_guided_fields() {
    use holo_core::interpreter::{Holoware, Row};
    use holo_core::loom::{Loom, LoomConfig, RolloutRecord};

    let server = Server::start(|seen, _| vllm(seen)).await;
    let sampler = OpenAi::new(config(&server)).unwrap();
    let holoware = Holoware::load(
        "constrained.hol",
        concat!(
            "<|o_o|>\nGo.\n",
            "<|@_@:a json=object|>\n",
            "<|@_@:b json_schema='{\"type\": \"object\", \"required\": [\"x\"]}'|>\n",
            "<|@_@:c regex='[0-9]+'|>\n",
            "<|@_@:d choice=yes choice=no|>\n",
            "<|@_@:e grammar=\"start: /[a-z]+/\"|>\n",
        )
        .as_bytes(),
        Arc::new(holo_core::holotypes::registry()),
    )
    .unwrap();
    let loom = Loom::interpreted(
        Arc::new(holoware),
        holo_core::Resources::default(),
        LoomConfig::default(),
    );
    let row: Row = serde_json::from_str("{}").unwrap();
    let mut records: Vec<RolloutRecord> = Vec::new();
    let summary = loom.run(&[(0, row)], &sampler, &mut records).await.unwrap();
    assert_eq!(summary.failed, 0);
    let fields: Vec<(String, Value)> = server
        .seen()
        .iter()
        .map(|seen| {
            let body = seen.body.as_object().unwrap();
            let field = [
                "response_format",
                "guided_regex",
                "guided_choice",
                "guided_grammar",
            ]
            .into_iter()
            .find(|field| body.contains_key(*field))
            .unwrap();
            (field.to_string(), body[field].clone())
        })
        .collect();
    assert_eq!(
        fields,
        [
            (
                "response_format".to_string(),
                json!({"type": "json_object"})
            ),
            (
                "response_format".to_string(),
                json!({"type": "json_schema", "json_schema": {
                    "name": "schema", "strict": true,
                    "schema": {"type": "object", "required": ["x"]},
                }})
            ),
            ("guided_regex".to_string(), json!("[0-9]+")),
            ("guided_choice".to_string(), json!(["yes", "no"])),
            ("guided_grammar".to_string(), json!("start: /[a-z]+/")),
        ]
    );
}
