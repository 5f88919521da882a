//! gpt-oss's harmony format (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`): the
//! replies of `tests/fixtures/chat/harmony.json`, rendered by openai-harmony
//! (`scripts/harmony_fixtures.py`), written token by token by a scripted sampler whose tokenizer has
//! harmony's markers as special tokens (so the reply's text, decoded without them, shows none). Whole
//! and streamed, and read by the official `openai` client, the answers hold what vLLM's chat API reads
//! from those replies: the `analysis` channel as `reasoning`, `final` messages and preambles as
//! `content`, messages to `functions.NAME` as `tool_calls`, and the reasoning tokens in `usage`.

use super::python_client::run_python;
use super::reasoning::{joined, serve_replier};
use super::structured::{respell, start_qwen3_with};
use super::*;
use holo_runtime::serve::ReasoningParser;
use holo_runtime::tools::harmony::MARKERS;
use holo_runtime::tools::ToolFormat;
use tokenizers::AddedToken;

/// The fixture's tokenizer with harmony's markers as special tokens.
fn harmony_tokenizer() -> Tokenizer {
    let mut tokenizer = tokenizer();
    let markers = MARKERS.map(|marker| AddedToken::from(marker, true));
    assert_eq!(
        tokenizer.add_special_tokens(markers).unwrap(),
        MARKERS.len()
    );
    tokenizer
}

fn cases() -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/harmony.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    fixture["cases"].as_array().unwrap().clone()
}

fn tools() -> Value {
    json!({"tools": [{"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})
}

/// The reasoning tokens vLLM counts in a reply whose messages are `messages` (harmony's reading): per
/// message on `analysis`, or on `commentary` to a recipient, its `<|message|>` and its text's tokens
/// (the tokenizer cuts the text between two special tokens on its own).
fn reasoning_tokens(tokenizer: &Tokenizer, messages: &[Value]) -> usize {
    messages
        .iter()
        .filter(|message| {
            message["channel"] == "analysis"
                || (message["channel"] == "commentary" && !message["recipient"].is_null())
        })
        .map(|message| {
            let text = message["text"].as_str().unwrap();
            1 + tokenizer.encode(text, false).unwrap().get_ids().len()
        })
        .sum()
}

/// Every fixture reply, whole and streamed, answers as vLLM reads it; a call whose arguments are not
/// JSON is no call in the whole answer (vLLM passes their text on), and streamed, as the call's
/// arguments are sent as they are written, it is vLLM's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_are_read_by_their_channels_as_vllm_reads_them() {
    let tokenizer = harmony_tokenizer();
    let server = serve_replier(
        tokenizer.clone(),
        Some(ReasoningParser::GptOss),
        ToolFormat::Harmony,
    )
    .await;
    let client = Client::new(&server);
    for case in cases() {
        let name = &case["name"];
        let reply = case["reply"].as_str().unwrap();
        let expected = &case["expected"];
        let calls = expected["tool_calls"].as_array().unwrap();
        let well_formed = calls.iter().all(|call| !call["arguments"].is_null());
        let calls: &[Value] = if well_formed { calls } else { &[] };
        let finish = if calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        };

        let answer = client.chat(reply, tools()).await;
        let choice = &answer["choices"][0];
        let message = &choice["message"];
        assert_eq!(
            message["reasoning"], expected["reasoning"],
            "{name}: {answer:#}"
        );
        assert_eq!(
            message["content"], expected["content"],
            "{name}: {answer:#}"
        );
        assert_eq!(choice["finish_reason"], finish, "{name}: {answer:#}");
        let read: Vec<Value> = message["tool_calls"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .map(|call| {
                let arguments = call["function"]["arguments"].as_str().unwrap();
                json!({"name": call["function"]["name"],
                       "arguments": serde_json::from_str::<Value>(arguments).unwrap()})
            })
            .collect();
        assert_eq!(read, calls, "{name}: {answer:#}");
        let counted = reasoning_tokens(&tokenizer, case["messages"].as_array().unwrap());
        assert_eq!(
            answer["usage"]["completion_tokens_details"]["reasoning_tokens"], counted,
            "{name}: {answer:#}"
        );

        let chunks = client.chat_streamed(reply, tools()).await;
        let text = |key: &str| expected[key].as_str().map(str::to_string);
        assert_eq!(
            joined(&chunks),
            (text("reasoning"), text("content")),
            "{name}: {chunks:#?}"
        );
        let mut streamed: Vec<Value> = Vec::new();
        for delta in chunks
            .iter()
            .filter_map(|chunk| chunk["delta"]["tool_calls"].as_array())
        {
            for piece in delta {
                let index = piece["index"].as_u64().unwrap() as usize;
                if index == streamed.len() {
                    streamed.push(json!({"name": piece["function"]["name"], "arguments": ""}));
                }
                let arguments = piece["function"]["arguments"].as_str().unwrap_or("");
                let so_far = streamed[index]["arguments"].as_str().unwrap().to_string();
                streamed[index]["arguments"] = json!(so_far + arguments);
            }
        }
        let streamed: Vec<Value> = streamed
            .into_iter()
            .map(|call| {
                let arguments = call["arguments"].as_str().unwrap();
                let arguments = serde_json::from_str::<Value>(arguments).unwrap_or(Value::Null);
                json!({"name": call["name"], "arguments": arguments})
            })
            .collect();
        // Streamed as they are written, calls are vLLM's, a call whose arguments are not JSON
        // included (its finish is still the whole answer's).
        assert_eq!(
            streamed,
            expected["tool_calls"].as_array().unwrap()[..],
            "{name}: {chunks:#?}"
        );
        assert_eq!(chunks.last().unwrap()["finish_reason"], finish, "{name}");
        for chunk in &chunks {
            let delta = chunk["delta"].to_string();
            assert!(!delta.contains("<|"), "{name}: a marker in {delta}");
        }
    }
}

/// `include_reasoning: false` leaves the analysis out; without the reasoning parser (only
/// `--tool-call-parser openai`) the analysis is dropped, as vLLM drops it, and `usage` has no details.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn analysis_is_reported_with_the_reasoning_parser_only() {
    let reply = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final\
                 <|message|>Answer.<|return|>";
    let server = serve_replier(
        harmony_tokenizer(),
        Some(ReasoningParser::GptOss),
        ToolFormat::Harmony,
    )
    .await;
    let answer = Client::new(&server)
        .chat(reply, json!({"include_reasoning": false}))
        .await;
    assert_eq!(answer["choices"][0]["message"]["reasoning"], Value::Null);
    assert_eq!(answer["choices"][0]["message"]["content"], "Answer.");

    let server = serve_replier(harmony_tokenizer(), None, ToolFormat::Harmony).await;
    let answer = Client::new(&server).chat(reply, json!({})).await;
    let message = answer["choices"][0]["message"].as_object().unwrap();
    assert_eq!(message["content"], "Answer.");
    assert!(!message.contains_key("reasoning"), "{answer:#}");
    assert!(answer["usage"].get("completion_tokens_details").is_none());
}

/// Streamed with `include_usage`, the last chunk's `usage` counts the reasoning tokens; with
/// `continuous_usage_stats`, every chunk counts those so far, never more than the whole reply's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_usage_counts_the_reasoning_tokens() {
    let tokenizer = harmony_tokenizer();
    let server = serve_replier(
        tokenizer.clone(),
        Some(ReasoningParser::GptOss),
        ToolFormat::Harmony,
    )
    .await;
    let client = Client::new(&server);
    let case = cases()
        .into_iter()
        .find(|case| case["name"] == "reasoning_then_call")
        .unwrap();
    let counted = reasoning_tokens(&tokenizer, case["messages"].as_array().unwrap());
    assert!(counted > 2);
    let reply = case["reply"].as_str().unwrap();
    let body = json!({
        "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true},
        "messages": [{"role": "user", "content": format!("REPLY:{reply}")}],
    });
    let (_, text) = client.post_text("/v1/chat/completions", body).await;
    let chunks = sse_payloads(&text);
    let counts: Vec<u64> = chunks
        .iter()
        .map(|chunk| {
            chunk["usage"]["completion_tokens_details"]["reasoning_tokens"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert!(
        counts.windows(2).all(|pair| pair[0] <= pair[1]),
        "{counts:?}"
    );
    assert_eq!(counts[0], 0);
    assert_eq!(*counts.last().unwrap(), counted as u64, "{chunks:#?}");
}

const CLIENT: &str = r#"
import json, sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
model = sys.argv[2]
messages = [{"role": "user", "content": "REPLY:" + sys.argv[3]}]
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
reply = client.chat.completions.create(model=model, messages=messages, tools=tools)
message = reply.choices[0].message
calls, reasoning = {}, ""
stream = client.chat.completions.create(
    model=model, messages=messages, tools=tools, stream=True, stream_options={"include_usage": True})
usage = None
for chunk in stream:
    usage = chunk.usage or usage
    for choice in chunk.choices:
        reasoning += getattr(choice.delta, "reasoning", None) or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
print(json.dumps({
    "reasoning": message.reasoning,
    "content": message.content,
    "finish_reason": reply.choices[0].finish_reason,
    "calls": [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in message.tool_calls],
    "reasoning_tokens": reply.usage.completion_tokens_details.reasoning_tokens,
    "streamed_reasoning": reasoning,
    "streamed_calls": [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls.values()],
    "streamed_reasoning_tokens": usage.completion_tokens_details.reasoning_tokens,
}))
"#;

/// The official `openai` client reads a gpt-oss call: the reasoning, the call and its arguments, the
/// reasoning tokens, whole and streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_reads_a_harmony_call() {
    let tokenizer = harmony_tokenizer();
    let server = serve_replier(
        tokenizer.clone(),
        Some(ReasoningParser::GptOss),
        ToolFormat::Harmony,
    )
    .await;
    let case = cases()
        .into_iter()
        .find(|case| case["name"] == "call_after_the_channel")
        .unwrap();
    let reply = case["reply"].as_str().unwrap();
    let Some(out) = run_python(&["openai"], CLIENT, &server.base_url(), &[reply]).await else {
        return;
    };
    let expected = &case["expected"];
    let counted = reasoning_tokens(&tokenizer, case["messages"].as_array().unwrap());
    assert_eq!(out["reasoning"], expected["reasoning"]);
    assert_eq!(out["content"], Value::Null);
    assert_eq!(out["finish_reason"], "tool_calls");
    assert_eq!(out["calls"], expected["tool_calls"]);
    assert_eq!(out["reasoning_tokens"], counted);
    assert_eq!(out["streamed_reasoning"], expected["reasoning"]);
    assert_eq!(out["streamed_calls"], expected["tool_calls"]);
    assert_eq!(out["streamed_reasoning_tokens"], counted);
}

/// `tool_choice` `required` or a named function holds a reply to one call in harmony's format (a
/// grammar that names harmony's markers by token id): the random tiny Qwen3, its tokenizer given
/// harmony's markers as tokens of their own, calls as told, and the call reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_calls_are_written_in_harmony_s_format() {
    let markers: Vec<(u32, &str)> = (500..).zip(MARKERS).collect();
    let (server, _base, _dir) = start_qwen3_with(
        |dir| respell(dir, &markers),
        |served| {
            served.tool_parser = Some(ToolFormat::Harmony);
            served.reasoning_parser = Some(ReasoningParser::GptOss);
        },
    )
    .await;
    let client = Client::new(&server);
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}},
            "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "ping"}},
    ]);
    let named = json!({"type": "function", "function": {"name": "ping"}});
    for (tool_choice, names) in [
        (json!("required"), &["get_weather", "ping"][..]),
        (named, &["ping"][..]),
    ] {
        for seed in 0..3 {
            let body = json!({
                "messages": [{"role": "user", "content": "Call a tool."}],
                "tools": tools, "tool_choice": tool_choice, "seed": seed, "max_tokens": 200,
            });
            let (status, answer) = client.post("/v1/chat/completions", body).await;
            assert_eq!(status, 200, "{answer:#}");
            let choice = &answer["choices"][0];
            assert_eq!(choice["finish_reason"], "tool_calls", "{answer:#}");
            let calls = choice["message"]["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1, "{answer:#}");
            let name = calls[0]["function"]["name"].as_str().unwrap();
            assert!(names.contains(&name), "{answer:#}");
            let arguments: Value =
                serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
            match name {
                "get_weather" => {
                    assert!(["Paris", "Lima"].contains(&arguments["city"].as_str().unwrap()))
                }
                _ => assert_eq!(arguments, json!({})),
            }
            assert_eq!(choice["message"]["content"], Value::Null, "{answer:#}");
            assert_eq!(choice["message"]["reasoning"], Value::Null, "{answer:#}");
        }
    }
}

/// The id of `<|end|>` in [`start_gpt_oss_qwen3`]'s tokenizer.
const END: u32 = 501;

/// The random tiny Qwen3 served with `--reasoning-parser openai_gptoss`, its tokenizer given
/// harmony's markers as tokens of their own (ids 500 to 506, [`MARKERS`]' order).
async fn start_gpt_oss_qwen3() -> (ServerHandle, String, crate::common::tempdir::Dir) {
    let markers: Vec<(u32, &str)> = (500..).zip(MARKERS).collect();
    assert_eq!(markers[1], (END, "<|end|>"));
    start_qwen3_with(
        |dir| respell(dir, &markers),
        |served| served.reasoning_parser = Some(ReasoningParser::GptOss),
    )
    .await
}

/// A streamed chat's choices, chunk by chunk.
async fn streamed_choices(client: &Client, mut body: Value) -> Vec<Value> {
    body["stream"] = json!(true);
    let (status, text) = client.post_text("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{text}");
    sse_payloads(&text)
        .into_iter()
        .flat_map(|chunk| chunk["choices"].as_array().unwrap().clone())
        .collect()
}

/// The reply's JSON, checked against the schema of the structured tests below: `ok` a boolean and `n`
/// an integer from 0 to 9, nothing else.
fn validated(content: &str) -> Value {
    let value: Value =
        serde_json::from_str(content).unwrap_or_else(|error| panic!("{error}: {content:?}"));
    let object = value.as_object().unwrap();
    assert!(object["ok"].is_boolean(), "{content}");
    assert!(
        (0..=9).contains(&object["n"].as_i64().unwrap()),
        "{content}"
    );
    assert_eq!(object.len(), 2, "{content}");
    value
}

const FINAL: &str = r#"
import json, sys
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
model = sys.argv[2]
bias = {sys.argv[3]: 12}

class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ok: bool
    n: int = Field(ge=0, le=9)

out = {"parsed": [], "streamed": []}
for seed in range(3):
    messages = [{"role": "user", "content": f"Answer {seed} in JSON."}]
    reply = client.chat.completions.parse(
        model=model, messages=messages, response_format=Answer, temperature=1.0, seed=seed,
        max_tokens=200, logit_bias=bias,
    )
    message = reply.choices[0].message
    out["parsed"].append({
        "content": message.content,
        "parsed": message.parsed.model_dump(),
        "reasoning": getattr(message, "reasoning", None),
        "finish_reason": reply.choices[0].finish_reason,
    })
    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=1.0, seed=seed, max_tokens=200,
        logit_bias=bias, stream=True,
        response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "schema": Answer.model_json_schema(), "strict": True}},
    )
    content, reasoning = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning", None) or ""
    Answer.model_validate_json(content)
    out["streamed"].append({"content": content, "reasoning": reasoning})
print(json.dumps(out))
"#;

/// With harmony's reading, a structured reply's grammar holds its `final` message, after any
/// `analysis` messages, as vLLM starts it once `<|channel|>final<|message|>` is written: the random
/// tiny Qwen3, its tokenizer given harmony's markers as tokens of their own (and a bias towards
/// `<|end|>`, since random weights never end a message; a prompt per seed, since from one prompt they
/// choose the same channel), writes analysis messages freely, then a final message of JSON that
/// validates. Whole, streamed (the same seeds, the same replies) and through the
/// official `openai` client (whose `parse` validates with pydantic), the answer reads as that
/// analysis (`reasoning`) and that JSON (`content`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_structured_reply_is_held_in_its_final_message() {
    let (server, base, _dir) = start_gpt_oss_qwen3().await;
    let end = END.to_string();
    let client = Client::new(&server);
    let schema = json!({
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": false,
    });
    let mut reasoned = 0;
    for seed in 0..12 {
        let body = json!({
            "messages": [{"role": "user", "content": format!("Answer {seed} in JSON.")}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
            "logit_bias": {&end: 12},
            "seed": seed,
            "temperature": 1.0,
            "max_tokens": 200,
        });
        let (status, answer) = client.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, 200, "{answer:#}");
        let choice = &answer["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{answer:#}");
        let message = &choice["message"];
        let content = message["content"].as_str().expect("a content");
        validated(content);
        let reasoning = message["reasoning"].as_str();
        if let Some(reasoning) = reasoning {
            assert!(!reasoning.contains("<|"), "{answer:#}");
            let counted = &answer["usage"]["completion_tokens_details"]["reasoning_tokens"];
            assert!(counted.as_u64().unwrap() > 0, "{answer:#}");
            reasoned += 1;
        }

        let chunks = streamed_choices(&client, body).await;
        assert_eq!(
            joined(&chunks),
            (reasoning.map(str::to_string), Some(content.to_string())),
            "{chunks:#?}"
        );
        assert_eq!(chunks.last().unwrap()["finish_reason"], "stop");
        for chunk in &chunks {
            let delta = chunk["delta"].to_string();
            assert!(!delta.contains("<|"), "a marker in {delta}");
        }
    }
    // Replies of both shapes: some with analysis messages, some answering at once.
    assert!(
        (2..12).contains(&reasoned),
        "{reasoned} of 12 replies wrote an analysis before answering"
    );

    let Some(out) = run_python(&["openai", "pydantic"], FINAL, &base, &[&end]).await else {
        return;
    };
    for (parsed, streamed) in out["parsed"]
        .as_array()
        .unwrap()
        .iter()
        .zip(out["streamed"].as_array().unwrap())
    {
        assert_eq!(parsed["finish_reason"], "stop", "{out:#}");
        let content = parsed["content"].as_str().unwrap();
        assert_eq!(validated(content), parsed["parsed"], "{out:#}");
        assert_eq!(streamed["content"], content, "{out:#}");
        let reasoning = parsed["reasoning"].as_str().unwrap_or("");
        assert_eq!(streamed["reasoning"], reasoning, "{out:#}");
    }
}

/// With harmony's reading a `guided_choice` is held in the final message too; a client's Lark grammar,
/// which cannot be nested in another, holds the whole reply from its first token, so the reply is all
/// content (no harmony message); and a tokenizer without harmony's markers cannot hold a final
/// message, which the request is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn choices_nest_and_client_grammars_hold_the_whole_reply() {
    let (server, _base, _dir) = start_gpt_oss_qwen3().await;
    let client = Client::new(&server);
    let choices = ["red", "green apple"];
    for seed in 0..3 {
        let body = json!({
            // The prompts and seeds after which the test above answers (random weights may write
            // empty analysis messages to any length).
            "messages": [{"role": "user", "content": format!("Answer {seed} in JSON.")}],
            "guided_choice": choices,
            "logit_bias": {END.to_string(): 12},
            "seed": seed,
            "temperature": 1.0,
            "max_tokens": 200,
        });
        let (status, answer) = client.post("/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{answer:#}");
        assert_eq!(answer["choices"][0]["finish_reason"], "stop", "{answer:#}");
        let content = answer["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(choices.contains(&content), "{answer:#}");

        let body = json!({
            "messages": [{"role": "user", "content": format!("Count {seed}.")}],
            "guided_grammar": "start: \"ok(\" NUMBER \")\"\nNUMBER: /[0-9]{1,3}/\n",
            "seed": seed,
            "max_tokens": 20,
        });
        let (status, answer) = client.post("/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{answer:#}");
        let message = &answer["choices"][0]["message"];
        let content = message["content"].as_str().unwrap();
        let number = content
            .strip_prefix("ok(")
            .and_then(|rest| rest.strip_suffix(')'));
        assert!(
            number.is_some_and(|number| number.parse::<u32>().is_ok()),
            "{answer:#}"
        );
        assert_eq!(message["reasoning"], Value::Null, "{answer:#}");
    }

    let server = serve_replier(
        tokenizer(),
        Some(ReasoningParser::GptOss),
        ToolFormat::Harmony,
    )
    .await;
    let body = json!({
        "messages": [{"role": "user", "content": "REPLY:{}"}],
        "response_format": {"type": "json_object"},
    });
    let (status, answer) = Client::new(&server)
        .post("/v1/chat/completions", body)
        .await;
    assert_eq!(status, 400, "{answer:#}");
    assert_eq!(answer["error"]["param"], "response_format", "{answer:#}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("no `<|start|>` token"), "{answer:#}");
}
