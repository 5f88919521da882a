//! Structured output end to end: the official `openai` Python client against the server on the random
//! tiny Qwen3 (`tests/fixtures/models/qwen3`) with Qwen3's own chat template. The model's replies are
//! noise; every constrained one must still parse and validate (pydantic validates the client's
//! `parse` helper's replies against the model class the schema came from).

use super::python_client::run_python;
use super::*;
use holo_runtime::local::{LocalModel, LocalOptions};
use holo_runtime::serve::ReasoningParser;

/// The random Qwen3 served in process under [`MODEL`], with the chat template of the real Qwen3 and a
/// context of 4096 positions (the fixture's 512 do not hold Qwen3's tool prompt in a 512-token
/// vocabulary); the folder lives as long as the server.
pub(super) async fn start_qwen3() -> (ServerHandle, String, crate::common::tempdir::Dir) {
    start_qwen3_with(|_| {}, |_| {}).await
}

/// The same, its folder changed by `change` before it loads and the served model by `serve`.
pub(super) async fn start_qwen3_with(
    change: impl FnOnce(&Path),
    serve: impl FnOnce(&mut ServedModel),
) -> (ServerHandle, String, crate::common::tempdir::Dir) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3");
    let dir = crate::common::tempdir::Dir::with_files_of("serve-qwen3", &fixture);
    change(dir.path());
    let config_file = dir.path().join("config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_file).unwrap()).unwrap();
    config["max_position_embeddings"] = json!(4096);
    std::fs::write(&config_file, config.to_string()).unwrap();
    let model = LocalModel::load(dir.path(), LocalOptions::default()).unwrap();
    let mut served = ServedModel::local(MODEL, model);
    served.template = ChatTemplate::from_dir(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/models/qwen3"),
    )
    .unwrap();
    serve(&mut served);
    let server = Server::bind("127.0.0.1:0", served, ServeConfig::default())
        .await
        .unwrap()
        .spawn();
    let base = server.base_url();
    (server, base, dir)
}

const STRUCTURED: &str = r#"
import json, sys
from typing import Literal
import openai
from openai import OpenAI
from pydantic import BaseModel, Field

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
model = sys.argv[2]
messages = [{"role": "user", "content": "What is the weather in Paris this week?"}]

class Forecast(BaseModel):
    city: Literal["Paris", "Tokyo", "Lima"]
    days: int = Field(ge=1, le=7)
    rain: bool
    note: str = Field(max_length=6)

out = {"parsed": [], "schema": []}
for seed in range(6):
    reply = client.chat.completions.parse(
        model=model, messages=messages, response_format=Forecast, temperature=1.0, seed=seed,
        max_tokens=80, logprobs=True,
    )
    choice = reply.choices[0]
    out["parsed"].append({
        "content": choice.message.content,
        "parsed": choice.message.parsed.model_dump(),
        "finish_reason": choice.finish_reason,
        "logprobs": [entry.logprob for entry in choice.logprobs.content],
    })
schema = Forecast.model_json_schema()
schema["additionalProperties"] = False
stream = client.chat.completions.create(
    model=model, messages=messages, temperature=1.0, seed=11, max_tokens=80, stream=True,
    response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema, "strict": True}},
)
chunks = [chunk.model_dump() for chunk in stream]
out["streamed"] = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
out["streamed_finish"] = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
Forecast.model_validate_json(out["streamed"])

completion = client.completions.create(
    model=model, prompt="The answer is", max_tokens=16, n=4, temperature=1.0, seed=5,
    extra_body={"guided_regex": "(yes|no), [0-9]{1,2}"},
)
out["regex"] = [(c.text, c.finish_reason) for c in completion.choices]
completion = client.completions.create(
    model=model, prompt="Pick one:", max_tokens=16, n=4, temperature=1.0, seed=6,
    extra_body={"guided_choice": ["red", "green apple", "blue?"]},
)
out["choice"] = [(c.text, c.finish_reason) for c in completion.choices]
chat = client.chat.completions.create(
    model=model, messages=messages, max_tokens=32, n=3, temperature=1.0, seed=7,
    extra_body={"guided_grammar": 'start: "ok(" NUMBER ")"\nNUMBER: /[0-9]{1,3}/\n'},
)
out["grammar"] = [(c.message.content, c.finish_reason) for c in chat.choices]

def error(**body):
    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, **body)
        return None
    except openai.BadRequestError as e:
        return {"status": e.status_code, "body": e.body}

out["errors"] = {
    "bad_schema": error(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "$ref": "https://example.com/other.json"}}}),
    "no_schema": error(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
    "unknown_type": error(response_format={"type": "yaml"}),
    "bad_regex": error(extra_body={"guided_regex": "("}),
    "two": error(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
    "unknown_key": error(extra_body={"structured_outputs": {"json": {"type": "object"}, "whitespace": "x"}}),
}
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_replies_of_a_random_model_validate() {
    let (_server, base, _dir) = start_qwen3().await;
    let Some(out) = run_python(
        &["openai", "pydantic", "transformers"],
        STRUCTURED,
        &base,
        &[],
    )
    .await
    else {
        return;
    };

    let parsed = out["parsed"].as_array().unwrap();
    assert_eq!(parsed.len(), 6);
    let mut contents = Vec::new();
    for reply in parsed {
        assert_eq!(reply["finish_reason"], "stop", "{reply}");
        let content: Value = serde_json::from_str(reply["content"].as_str().unwrap()).unwrap();
        assert_eq!(content, reply["parsed"], "{reply}");
        assert!(
            floats(&reply["logprobs"])
                .iter()
                .all(|lp| lp.is_finite() && *lp <= 0.0),
            "{reply}"
        );
        contents.push(reply["content"].clone());
    }
    contents.sort_by_key(Value::to_string);
    contents.dedup();
    assert!(contents.len() > 1, "six seeds, one reply: {contents:?}");
    assert_eq!(out["streamed_finish"], "stop");

    for (text, finish) in out["regex"].as_array().unwrap().iter().map(pair) {
        assert_eq!(finish, "stop", "{text}");
        let (word, number) = text.split_once(", ").unwrap();
        assert!(["yes", "no"].contains(&word), "{text}");
        assert!((1..=2).contains(&number.len()) && number.bytes().all(|b| b.is_ascii_digit()));
    }
    for (text, finish) in out["choice"].as_array().unwrap().iter().map(pair) {
        assert_eq!(finish, "stop", "{text}");
        assert!(
            ["red", "green apple", "blue?"].contains(&text.as_str()),
            "{text}"
        );
    }
    for (text, finish) in out["grammar"].as_array().unwrap().iter().map(pair) {
        assert_eq!(finish, "stop", "{text}");
        let number = text.strip_prefix("ok(").and_then(|t| t.strip_suffix(')'));
        assert!(
            number.is_some_and(
                |n| (1..=3).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit())
            ),
            "{text}"
        );
    }

    let errors = &out["errors"];
    for (case, param) in [
        ("bad_schema", "response_format"),
        ("no_schema", "response_format"),
        ("unknown_type", "response_format"),
        ("bad_regex", "guided_regex"),
        ("two", "guided_regex"),
        ("unknown_key", "structured_outputs"),
    ] {
        assert_eq!(errors[case]["status"], 400, "{case}: {}", errors[case]);
        assert_eq!(
            errors[case]["body"]["param"], param,
            "{case}: {}",
            errors[case]
        );
    }
    let message = errors["bad_schema"]["body"]["message"].as_str().unwrap();
    assert!(message.contains("cannot be enforced"), "{message}");
}

fn pair(value: &Value) -> (String, String) {
    (
        value[0].as_str().unwrap().to_string(),
        value[1].as_str().unwrap().to_string(),
    )
}

const SHAPING: &str = r#"
import json, sys
import openai
from openai import OpenAI
from transformers import AutoTokenizer

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
model = sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(sys.argv[3])
x, y = tokenizer.convert_tokens_to_ids("x"), tokenizer.convert_tokens_to_ids("y")
end = tokenizer.convert_tokens_to_ids("<|im_end|>")
messages = [{"role": "user", "content": "Go"}]
out = {"ids": {"x": x, "y": y, "end": end}}

def ids(**body):
    reply = client.chat.completions.create(
        model=model, messages=messages, temperature=1.0, seed=2, extra_body={"return_token_ids": True, **body.pop("extra", {})}, **body)
    choice = reply.choices[0]
    return {"ids": choice.model_extra["token_ids"], "finish": choice.finish_reason, "text": choice.message.content}

out["bias"] = ids(max_tokens=4, logit_bias={str(x): 100})
out["min_tokens"] = ids(max_tokens=9, logit_bias={str(end): 100}, extra={"min_tokens": 3})
out["stop_token_ids"] = ids(max_tokens=9, logit_bias={str(y): 100}, extra={"stop_token_ids": [y]})
out["ignore_eos"] = ids(max_tokens=3, logit_bias={str(end): 100}, extra={"ignore_eos": True})
try:
    client.chat.completions.create(model=model, messages=messages, max_tokens=2, logit_bias={"99999": 5})
    out["outside"] = None
except openai.BadRequestError as e:
    out["outside"] = {"status": e.status_code, "body": e.body}
print(json.dumps(out))
"#;

/// `logit_bias`, and vLLM's `min_tokens`, `stop_token_ids` and `ignore_eos`, reach the local model from
/// the `openai` client: a bias of 100 decides each draw, so each parameter shows in the tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn biases_and_ending_parameters_reach_the_local_model() {
    let (_server, base, dir) = start_qwen3().await;
    let Some(out) = run_python(
        &["openai", "pydantic", "transformers"],
        SHAPING,
        &base,
        &[dir.path().to_str().unwrap()],
    )
    .await
    else {
        return;
    };
    let id = |name: &str| out["ids"][name].clone();
    let (x, y, end) = (id("x"), id("y"), id("end"));
    assert_eq!(out["bias"]["ids"], json!([x, x, x, x]), "{out:#}");
    assert_eq!(out["bias"]["finish"], "length");
    let late = out["min_tokens"]["ids"].as_array().unwrap();
    assert_eq!(late.len(), 4, "{out:#}");
    assert!(!late[..3].contains(&end) && late[3] == end, "{out:#}");
    assert_eq!(out["min_tokens"]["finish"], "stop");
    assert_eq!(out["stop_token_ids"]["ids"], json!([y]), "{out:#}");
    assert_eq!(out["stop_token_ids"]["finish"], "stop");
    assert_eq!(out["ignore_eos"]["ids"], json!([end, end, end]), "{out:#}");
    assert_eq!(out["ignore_eos"]["finish"], "length");
    assert_eq!(out["outside"]["status"], 400);
    assert_eq!(out["outside"]["body"]["param"], "logit_bias");
}

/// The tiny Qwen3's token that spells `</think>` (as Qwen3's own vocabulary has it, one token): its
/// token 508 (`Ġcarry`), respelled (see [`respell`]).
const THINK_END: u32 = 508;

/// The tokenizer of the model folder `dir` with each token of `spellings` (an id of its BPE
/// vocabulary) spelled anew, and the merge that made it dropped: the model writes the new text with
/// that one token, and no text is cut into it.
pub(super) fn respell(dir: &Path, spellings: &[(u32, &str)]) {
    let path = dir.join("tokenizer.json");
    let mut tokenizer: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let model = &mut tokenizer["model"];
    let vocab = model["vocab"].as_object_mut().unwrap();
    let mut olds = Vec::new();
    for &(id, spelling) in spellings {
        let old = vocab
            .iter()
            .find(|(_, known)| **known == json!(id))
            .map(|(old, _)| old.clone())
            .unwrap();
        vocab.remove(&old);
        vocab.insert(spelling.into(), json!(id));
        olds.push(old);
    }
    let merges = model["merges"].as_array_mut().unwrap();
    merges.retain(|merge| {
        let parts = merge.as_array().unwrap().iter();
        let made: String = parts.map(|part| part.as_str().unwrap()).collect();
        !olds.contains(&made)
    });
    std::fs::write(&path, tokenizer.to_string()).unwrap();
}

/// With `--reasoning-parser qwen3`, a structured reply's grammar starts after `</think>`, as vLLM
/// starts it: the random tiny Qwen3 (pushed towards `</think>` by a bias, since random weights never
/// close their thinking) thinks freely, closes its thinking, and answers JSON that validates; the
/// answer splits into that reasoning and that JSON. Without thinking the grammar holds the reply from
/// its first token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_structured_reply_starts_after_the_reasoning() {
    let (server, _base, _dir) = start_qwen3_with(
        |dir| respell(dir, &[(THINK_END, "</think>")]),
        |served| served.reasoning_parser = Some(ReasoningParser::Qwen3),
    )
    .await;
    let client = Client::new(&server);
    let schema = json!({
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": false,
    });
    let mut reasoned = 0;
    for seed in 0..6 {
        let body = json!({
            "messages": [{"role": "user", "content": "Answer in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
            "logit_bias": {THINK_END.to_string(): 6},
            "seed": seed,
            "temperature": 1.0,
            "max_tokens": 120,
            "return_token_ids": true,
        });
        let (status, answer) = client.post("/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{answer:#}");
        let choice = &answer["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{answer:#}");
        let reasoning = choice["message"]["reasoning"]
            .as_str()
            .expect("a reasoning");
        let content = choice["message"]["content"].as_str().expect("a content");
        let value: Value = serde_json::from_str(content.trim_start()).unwrap();
        let object = value.as_object().unwrap();
        assert!(object["ok"].is_boolean() && (0..=9).contains(&object["n"].as_i64().unwrap()));
        assert_eq!(object.len(), 2, "{content}");
        // The grammar let the model write what it liked before `</think>`, and then only JSON.
        let ids = ids(&choice["token_ids"]);
        let end = ids.iter().position(|&id| id == THINK_END).unwrap();
        assert!(!reasoning.contains("</think>"), "{answer:#}");
        reasoned += usize::from(end > 0 && !reasoning.trim().is_empty());
        assert_eq!(
            answer["usage"]["completion_tokens_details"]["reasoning_tokens"], end,
            "{answer:#}"
        );
    }
    assert!(
        reasoned >= 2,
        "only {reasoned} of 6 replies reasoned before answering"
    );

    // Without thinking (the template writes an empty think block) the reply is the JSON alone.
    let body = json!({
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        "chat_template_kwargs": {"enable_thinking": false},
        "seed": 0,
        "max_tokens": 40,
    });
    let (status, answer) = client.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{answer:#}");
    let message = &answer["choices"][0]["message"];
    assert_eq!(message["reasoning"], Value::Null, "{answer:#}");
    let value: Value = serde_json::from_str(message["content"].as_str().unwrap()).unwrap();
    assert!(value["ok"].is_boolean(), "{answer:#}");
}
