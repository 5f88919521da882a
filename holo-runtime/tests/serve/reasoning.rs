//! Reasoning output (`--reasoning-parser`): a scripted sampler writes chosen replies token by token (the
//! fixture's tokenizer spells `</think>` with several tokens); the answers, whole and streamed, and the
//! official `openai` Python client reading them, split them as vLLM's `qwen3` and `deepseek_r1` parsers
//! do. (How many tokens a chunk holds depends on when the stream reads them: the parser's unit tests
//! cut replies at every byte.) The random tiny Qwen3 served by the binary, with its real
//! template, shows the two ends: thinking (never closed by random weights: all reasoning) and
//! `enable_thinking: false` (all content).

use super::python_client::run_python;
use super::*;
use holo_runtime::serve::ReasoningParser;
use holo_runtime::tools::ToolFormat;

/// Replies with the text after the last `REPLY:` of its prompt, tokenized, a token at a time, cut at
/// `max_tokens`; the completion's text skips special tokens, as the local model's does.
struct Replier {
    tokenizer: Tokenizer,
}

impl Replier {
    fn reply(&self, request: &Request, sink: &dyn TokenSink, index: usize) -> Completion {
        let prompt = self.tokenizer.decode(&prompt_ids(request), false).unwrap();
        let script = &prompt[prompt.rfind("REPLY:").expect("a REPLY: in the prompt") + 6..];
        let mut tokens = self
            .tokenizer
            .encode(script, false)
            .unwrap()
            .get_ids()
            .to_vec();
        let mut finish = Finish::EndOfTurn;
        if let Some(max) = request.params.max_tokens {
            if tokens.len() > max as usize {
                tokens.truncate(max as usize);
                finish = Finish::Length;
            }
        }
        for &token in &tokens {
            assert!(sink.token(index, token, -1.0), "the client left");
        }
        Completion {
            text: self.tokenizer.decode(&tokens, true).unwrap(),
            logprobs: vec![-1.0; tokens.len()],
            tokens,
            top_logprobs: Vec::new(),
            finish,
            routes: Vec::new(),
            weight_version: None,
            constraint: None,
        }
    }
}

impl Sampler for Replier {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        self.sample_streaming(batch, Arc::new(|_: usize, _: u32, _: f32| true))
    }

    fn sample_streaming<'a>(
        &'a self,
        batch: &'a [Request],
        sink: Arc<dyn TokenSink>,
    ) -> SampleFuture<'a> {
        Box::pin(async move {
            batch
                .iter()
                .enumerate()
                .map(|(index, request)| Ok(self.reply(request, &*sink, index)))
                .collect()
        })
    }
}

/// A server of the replier with `parser` and Hermes' tool calls; its template writes the messages'
/// contents one after the other (and takes `tools`, which it does not show).
async fn start_replier(parser: Option<ReasoningParser>) -> ServerHandle {
    serve_replier(tokenizer(), parser, ToolFormat::Hermes).await
}

/// The same with `tokenizer` and the tool calls of `format`.
pub(super) async fn serve_replier(
    tokenizer: Tokenizer,
    parser: Option<ReasoningParser>,
    format: ToolFormat,
) -> ServerHandle {
    let template = ChatTemplate::from_source(
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{% endif %}",
        "replier.jinja",
        Default::default(),
    )
    .unwrap();
    let replier = Arc::new(Replier {
        tokenizer: tokenizer.clone(),
    });
    let mut model = ServedModel::new(MODEL, replier, tokenizer, template);
    model.reasoning_parser = parser;
    model.tool_parser = Some(format);
    Server::bind("127.0.0.1:0", model, ServeConfig::default())
        .await
        .unwrap()
        .spawn()
}

impl Client {
    /// A chat request whose reply is `reply`, with `extra` fields: the answer.
    pub(super) async fn chat(&self, reply: &str, extra: Value) -> Value {
        let mut body = json!({"messages": [{"role": "user", "content": format!("REPLY:{reply}")}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, answer) = self.post("/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{answer:#}");
        answer
    }

    /// The same, streamed: its chunks' choices.
    pub(super) async fn chat_streamed(&self, reply: &str, extra: Value) -> Vec<Value> {
        let mut body = json!({"stream": true, "messages": [{"role": "user", "content": format!("REPLY:{reply}")}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, text) = self.post_text("/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{text}");
        sse_payloads(&text)
            .into_iter()
            .flat_map(|chunk| chunk["choices"].as_array().unwrap().clone())
            .collect()
    }
}

/// A streamed choice's reasoning and content, each joined (`None` when no delta had it), after
/// checking that no reasoning follows content.
pub(super) fn joined(choices: &[Value]) -> (Option<String>, Option<String>) {
    let mut reasoning: Option<String> = None;
    let mut content: Option<String> = None;
    for choice in choices {
        let delta = &choice["delta"];
        if let Some(piece) = delta["reasoning"].as_str() {
            assert!(
                content.as_deref().unwrap_or("").is_empty(),
                "reasoning after content: {choices:#?}"
            );
            reasoning.get_or_insert_with(String::new).push_str(piece);
        }
        if let Some(piece) = delta["content"].as_str().filter(|piece| !piece.is_empty()) {
            content.get_or_insert_with(String::new).push_str(piece);
        }
    }
    (reasoning, content)
}

fn some(text: &str) -> Option<String> {
    Some(text.to_string())
}

/// A reply, the request's other fields, and the reasoning, content and finish reason its answer has.
struct Case {
    reply: &'static str,
    extra: Value,
    reasoning: Option<String>,
    content: Option<String>,
    finish: &'static str,
}

impl Case {
    fn new(
        reply: &'static str,
        extra: Value,
        (reasoning, content): (Option<&str>, Option<&str>),
    ) -> Self {
        Case {
            reply,
            extra,
            reasoning: reasoning.map(str::to_string),
            content: content.map(str::to_string),
            finish: "stop",
        }
    }
}

/// Whole and streamed, each reply's reasoning and content are vLLM's: the text between the markers
/// (the opening one in the reply or not), then the rest; cut before `</think>` all of it is reasoning.
/// Streamed, the reasoning comes before any content, and the deltas join into the whole answer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_is_split_from_content_as_vllm_splits_it() {
    let spelled = tokenizer().encode("a.</think>b", false).unwrap();
    assert!(
        spelled.get_ids().len() > 4,
        "the fixture's tokenizer must cut `</think>` into pieces: {:?}",
        spelled.get_tokens()
    );
    let server = start_replier(Some(ReasoningParser::Qwen3)).await;
    let client = Client::new(&server);
    let cases = [
        Case::new(
            "<think>\nAdd two and two.\n</think>\n\nFour.",
            json!({}),
            (Some("\nAdd two and two.\n"), Some("\n\nFour.")),
        ),
        Case::new(
            "Add two and two.</think>Four.",
            json!({}),
            (Some("Add two and two."), Some("Four.")),
        ),
        // Cut inside the reasoning, in the middle of `</think>` (its first 10 tokens): all reasoning.
        Case {
            finish: "length",
            ..Case::new(
                "Add two and two.</think>Four.",
                json!({"max_tokens": 10}),
                (Some("Add two and two.</think"), None),
            )
        },
        Case::new("Add two.</think>", json!({}), (Some("Add two."), None)),
        // Without thinking, every reply is content.
        Case::new(
            "Four, <think>a</think>.",
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
            (None, Some("Four, <think>a</think>.")),
        ),
        // Asked without reasoning: it is left out.
        Case::new(
            "Add.</think>Four.",
            json!({"include_reasoning": false}),
            (None, Some("Four.")),
        ),
    ];
    for Case {
        reply,
        extra,
        reasoning,
        content,
        finish,
    } in cases
    {
        let answer = client.chat(reply, extra.clone()).await;
        let choice = &answer["choices"][0];
        let message = &choice["message"];
        assert_eq!(
            message["reasoning"],
            json!(reasoning),
            "{reply:?} {extra}: {answer:#}"
        );
        assert_eq!(
            message["content"],
            json!(content),
            "{reply:?} {extra}: {answer:#}"
        );
        assert_eq!(choice["finish_reason"], finish);

        let chunks = client.chat_streamed(reply, extra.clone()).await;
        let streamed = joined(&chunks);
        assert_eq!(
            streamed,
            (reasoning.clone(), content.clone()),
            "{chunks:#?}"
        );
        assert_eq!(chunks.last().unwrap()["finish_reason"], finish);
    }
    // `deepseek_r1` has no switch: a reply without `</think>` is reasoning whatever the kwargs say.
    let server = start_replier(Some(ReasoningParser::DeepSeekR1)).await;
    let answer = Client::new(&server)
        .chat(
            "Four.",
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
        )
        .await;
    assert_eq!(answer["choices"][0]["message"]["reasoning"], "Four.");
    assert_eq!(answer["choices"][0]["message"]["content"], Value::Null);
    // Without a parser nothing changes: the reply is the content, and there is no `reasoning`.
    let server = start_replier(None).await;
    let client = Client::new(&server);
    let answer = client.chat("Add.</think>Four.", json!({})).await;
    let message = answer["choices"][0]["message"].as_object().unwrap();
    assert_eq!(message["content"], "Add.</think>Four.");
    assert!(!message.contains_key("reasoning"), "{message:?}");
    let chunks = client.chat_streamed("Add.</think>Four.", json!({})).await;
    assert_eq!(joined(&chunks), (None, some("Add.</think>Four.")));
}

/// Tool calls are read from the content only: a call after the reasoning is one, a call written inside
/// the reasoning is not; streamed, the reasoning comes before the call's deltas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_are_read_from_the_content_only() {
    let server = start_replier(Some(ReasoningParser::Qwen3)).await;
    let client = Client::new(&server);
    let tools = json!({"tools": [{"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]});
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let reply = format!("I could write {call} here.</think>{call}");
    let answer = client.chat(&reply, tools.clone()).await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{answer:#}");
    assert_eq!(
        choice["message"]["reasoning"],
        format!("I could write {call} here.")
    );
    assert_eq!(choice["message"]["content"], Value::Null);
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], r#"{"city":"Paris"}"#);

    let chunks = client.chat_streamed(&reply, tools.clone()).await;
    assert_eq!(
        joined(&chunks),
        (some(&format!("I could write {call} here.")), None)
    );
    let first_call = chunks
        .iter()
        .position(|choice| choice["delta"]["tool_calls"].is_array())
        .expect("a call delta");
    let last_reasoning = chunks
        .iter()
        .rposition(|choice| choice["delta"]["reasoning"].is_string())
        .unwrap();
    assert!(last_reasoning < first_call, "{chunks:#?}");
    assert_eq!(chunks.last().unwrap()["finish_reason"], "tool_calls");

    // A call only inside the reasoning is no call.
    let reply = format!("Maybe {call}?</think>No call.");
    let answer = client.chat(&reply, tools).await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["message"]["content"], "No call.");
    assert!(choice["message"].get("tool_calls").is_none(), "{answer:#}");
}

const CLIENT: &str = r#"
import json, sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
model = sys.argv[2]
messages = [{"role": "user", "content": "REPLY:<think>Two and two.</think>Four."}]
reply = client.chat.completions.create(model=model, messages=messages)
message = reply.choices[0].message
deltas = []
for chunk in client.chat.completions.create(model=model, messages=messages, stream=True):
    for choice in chunk.choices:
        delta = choice.delta
        deltas.append({"reasoning": getattr(delta, "reasoning", None), "content": delta.content})
print(json.dumps({"reasoning": message.reasoning, "content": message.content, "deltas": deltas}))
"#;

/// The official `openai` client reads `reasoning` from the message and from each delta.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_reads_the_reasoning() {
    let server = start_replier(Some(ReasoningParser::DeepSeekR1)).await;
    let Some(out) = run_python(&["openai"], CLIENT, &server.base_url(), &[]).await else {
        return;
    };
    assert_eq!(out["reasoning"], "Two and two.");
    assert_eq!(out["content"], "Four.");
    let deltas = out["deltas"].as_array().unwrap();
    let reasoning: String = deltas
        .iter()
        .filter_map(|delta| delta["reasoning"].as_str())
        .collect();
    let content: String = deltas
        .iter()
        .filter_map(|delta| delta["content"].as_str())
        .collect();
    assert_eq!(
        (reasoning.as_str(), content.as_str()),
        ("Two and two.", "Four.")
    );
}

/// `holo serve --reasoning-parser qwen3` on the random tiny Qwen3 with Qwen3's own template: random
/// weights never close their thinking, so a reply cut by `max_tokens` is all reasoning (no content);
/// with `enable_thinking: false` (the template writes an empty think block) it is all content. An
/// unknown parser is refused at startup, naming the flag and the parsers there are.
#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holo_serve_splits_a_random_qwen3_s_reasoning() {
    use common::served::Served;
    use std::process::Command;

    let refused = Command::new(env!("CARGO_BIN_EXE_holo"))
        .args(["serve", "no-such-dir", "--reasoning-parser", "qwen"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--reasoning-parser")
            && stderr.contains("qwen3")
            && stderr.contains("deepseek_r1"),
        "{stderr}"
    );

    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3");
    let dir = crate::common::tempdir::Dir::with_files_of("serve-reasoning-qwen3", &fixture);
    // Qwen3's own template, and room for its prompts.
    let read = |path: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let qwen3 = read(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/chat/models/qwen3/tokenizer_config.json"),
    );
    let tokenizer_config = dir.path().join("tokenizer_config.json");
    let mut own = read(&tokenizer_config);
    own["chat_template"] = qwen3["chat_template"].clone();
    std::fs::write(&tokenizer_config, own.to_string()).unwrap();
    let config_file = dir.path().join("config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_file).unwrap()).unwrap();
    config["max_position_embeddings"] = json!(4096);
    std::fs::write(&config_file, config.to_string()).unwrap();
    let served = Served::start(
        Command::new(env!("CARGO_BIN_EXE_holo"))
            .args(["serve", dir.path().to_str().unwrap(), "--port", "0"])
            .args(["--served-model-name", MODEL, "--reasoning-parser", "qwen3"]),
    );
    let client = Client::at(served.base.clone());
    for (kwargs, thinking) in [
        (json!({}), true),
        (json!({"enable_thinking": false}), false),
    ] {
        let body = json!({
            "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "max_tokens": 12, "temperature": 1.0, "seed": 3,
            "chat_template_kwargs": kwargs, "return_token_ids": true,
        });
        let (status, answer) = client.post("/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{answer:#}");
        let choice = &answer["choices"][0];
        let message = &choice["message"];
        let text = match thinking {
            true => message["reasoning"].as_str(),
            false => message["content"].as_str(),
        };
        let text = text.unwrap_or_else(|| panic!("{answer:#}"));
        assert!(!text.is_empty() && !text.contains("</think>"), "{answer:#}");
        let other = if thinking { "content" } else { "reasoning" };
        assert_eq!(message[other], Value::Null, "{answer:#}");
        assert_eq!(choice["finish_reason"], "length", "{answer:#}");
        // The template wrote the empty think block only when thinking is off.
        let prompt: Vec<u32> = ids(&answer["prompt_token_ids"]);
        let rendered = tokenizer_of(dir.path()).decode(&prompt, false).unwrap();
        assert_eq!(
            rendered.ends_with("<think>\n\n</think>\n\n"),
            !thinking,
            "{rendered:?}"
        );
    }
}

#[cfg(feature = "cli")]
fn tokenizer_of(dir: &Path) -> Tokenizer {
    Tokenizer::from_file(dir.join("tokenizer.json")).unwrap()
}
