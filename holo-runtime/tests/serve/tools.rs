//! Tool calls end to end: the official `openai` Python client against the server on the random tiny
//! Qwen3 with Qwen3's own chat template (so the `hermes` format, detected from the template). A forced
//! call (`required`, a named function) is a well-formed call even from random weights; the call, the
//! tool's answer and the final answer make a round trip, streamed and not, and the history with the
//! assistant's `tool_calls` and the `tool` message renders as transformers renders it.

use super::python_client::run_python;
use super::structured::start_qwen3;
use super::*;

const ROUND_TRIP: &str = r#"
import json, sys
from pathlib import Path
import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
model = sys.argv[2]
fixtures = Path(sys.argv[3])
tools = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}},
]
question = [{"role": "user", "content": "What is the weather in Paris?"}]
out = {}

def round_trip(stream, seed):
    kwargs = dict(model=model, tools=tools, temperature=1.0, max_tokens=120)
    if stream:
        chunks = list(client.chat.completions.create(
            messages=question, tool_choice="required", parallel_tool_calls=False, seed=seed, stream=True, **kwargs))
        calls, content, finish = {}, "", None
        for chunk in chunks:
            choice = chunk.choices[0]
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
                call["id"] = delta.id or call["id"]
                call["type"] = delta.type or call["type"]
                call["function"]["name"] += delta.function.name or ""
                call["function"]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
        calls = [calls[index] for index in sorted(calls)]
        shape = [(
            [{"id": d.id, "name": d.function.name, "arguments": d.function.arguments} for d in c.choices[0].delta.tool_calls or []],
            c.choices[0].finish_reason,
        ) for c in chunks if c.choices]
    else:
        reply = client.chat.completions.create(
            messages=question, tool_choice="required", parallel_tool_calls=False, seed=seed, **kwargs)
        message = reply.choices[0].message
        calls = [call.model_dump() for call in message.tool_calls]
        content, finish = message.content, reply.choices[0].finish_reason
        shape = None
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "22 degrees and sunny"},
    ]
    final = client.chat.completions.create(
        messages=history, extra_body={"return_token_ids": True}, seed=seed, **kwargs, stream=False)
    return {
        "calls": calls, "content": content, "finish": finish, "history": history, "shape": shape,
        "final": final.choices[0].message.content, "final_finish": final.choices[0].finish_reason,
        "final_calls": [c.model_dump() for c in final.choices[0].message.tool_calls or []] or None,
        "prompt_token_ids": final.model_extra["prompt_token_ids"],
    }

out["plain"] = round_trip(False, 3)
out["streamed"] = round_trip(True, 4)

named = client.chat.completions.create(
    model=model, messages=question, tools=tools, temperature=1.0, max_tokens=120, seed=5,
    tool_choice={"type": "function", "function": {"name": "get_time"}})
out["named"] = [call.model_dump() for call in named.choices[0].message.tool_calls]
out["named_finish"] = named.choices[0].finish_reason
none = client.chat.completions.create(
    model=model, messages=question, tools=tools, tool_choice="none", max_tokens=8, seed=6)
out["none"] = {"content": none.choices[0].message.content, "calls": none.choices[0].message.tool_calls and True}

# What transformers renders for the same history.
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(str(fixtures / "models/qwen3"))
tokenizer.chat_template = json.loads((fixtures / "chat/models/qwen3/tokenizer_config.json").read_text())["chat_template"]
for case in ["plain", "streamed"]:
    history = json.loads(json.dumps(out[case]["history"]))
    # As vLLM hands them to templates: the call's null content as "", its arguments as objects.
    history[1]["content"] = ""
    for call in history[1]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    out[case]["transformers"] = tokenizer.apply_chat_template(
        history, tools=tools, tokenize=False, add_generation_prompt=True)
    out[case]["served_prompt"] = tokenizer.decode(out[case]["prompt_token_ids"])

def error(**body):
    body.setdefault("messages", question)
    try:
        client.chat.completions.create(model=model, max_tokens=4, **body)
        return None
    except openai.BadRequestError as e:
        return {"status": e.status_code, "body": e.body}

out["errors"] = {
    "unknown_function": error(tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}}),
    "bad_tool": error(tools=[{"type": "function", "function": {"description": "no name"}}]),
    "unknown_key": error(tools=[{"type": "function", "function": {"name": "f", "extra": 1}}]),
    "choice_without_tools": error(tool_choice="required"),
    "bad_arguments": error(messages=question + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]),
    "with_response_format": error(tools=tools, tool_choice="required", response_format={"type": "json_object"}),
}
try:
    client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"tools": tools})
    out["errors"]["completions"] = None
except openai.BadRequestError as e:
    out["errors"]["completions"] = {"status": e.status_code, "body": e.body}
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_round_trip_through_the_openai_client() {
    let (_server, base, _dir) = start_qwen3().await;
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let Some(out) = run_python(
        &["openai", "pydantic", "transformers"],
        ROUND_TRIP,
        &base,
        &[fixtures.to_str().unwrap()],
    )
    .await
    else {
        return;
    };
    for case in ["plain", "streamed"] {
        let trip = &out[case];
        assert_eq!(trip["finish"], "tool_calls", "{case}: {trip:#}");
        let calls = trip["calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{case}: parallel calls are off");
        let call = &calls[0];
        assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
        assert_eq!(call["type"], "function");
        let arguments: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        match call["function"]["name"].as_str().unwrap() {
            "get_weather" => {
                assert!(["Paris", "Tokyo"].contains(&arguments["city"].as_str().unwrap()))
            }
            "get_time" => assert!(["UTC", "CET"].contains(&arguments["zone"].as_str().unwrap())),
            other => panic!("{case}: a call of {other}"),
        }
        assert_eq!(arguments.as_object().unwrap().len(), 1, "{arguments}");
        // The history (the assistant's call, the tool's answer) reaches the model as transformers
        // renders it with Qwen3's template.
        assert_eq!(trip["served_prompt"], trip["transformers"], "{case}");
        let prompt = trip["served_prompt"].as_str().unwrap();
        assert!(
            prompt.contains("<tool_response>\n22 degrees and sunny\n</tool_response>"),
            "{prompt}"
        );
        assert!(prompt.contains("\"name\": \"get_weather\""), "{prompt}");
        // The final answer: the random model's text (auto: a call would need the format by chance).
        assert!(trip["final"].is_string(), "{case}: {trip:#}");
        assert!(trip["final_calls"].is_null(), "{case}: {trip:#}");
        assert!(["stop", "length"].contains(&trip["final_finish"].as_str().unwrap()));
    }
    // Streamed as OpenAI streams calls: a chunk opens the call (id, name, no arguments yet), one
    // carries its arguments, and the last has no call and the finish reason.
    let shape = out["streamed"]["shape"].as_array().unwrap();
    let with_calls: Vec<&Value> = shape.iter().filter(|chunk| chunk[0] != json!([])).collect();
    assert_eq!(with_calls.len(), 2, "{shape:?}");
    let call = &out["streamed"]["calls"][0];
    assert_eq!(
        with_calls[0][0],
        json!([{"id": call["id"], "name": call["function"]["name"], "arguments": ""}])
    );
    assert_eq!(
        with_calls[1][0],
        json!([{"id": null, "name": null, "arguments": call["function"]["arguments"]}])
    );
    let last = shape.last().unwrap();
    assert_eq!((&last[0], &last[1]), (&json!([]), &json!("tool_calls")));
    // Streamed, nothing of the call leaked into the content.
    let streamed_content = &out["streamed"]["content"];
    assert!(
        streamed_content
            .as_str()
            .is_none_or(|content| !content.contains("<tool_call>")),
        "{streamed_content}"
    );

    assert_eq!(out["named_finish"], "tool_calls");
    let named = out["named"].as_array().unwrap();
    assert_eq!(named.len(), 1);
    assert_eq!(named[0]["function"]["name"], "get_time");
    assert!(out["none"]["calls"].is_null());
    assert!(out["none"]["content"].is_string());

    let errors = &out["errors"];
    for (case, param) in [
        ("unknown_function", "tool_choice"),
        ("bad_tool", "tools"),
        ("unknown_key", "tools"),
        ("choice_without_tools", "tool_choice"),
        ("bad_arguments", "messages"),
        ("with_response_format", "tool_choice"),
        ("completions", "tools"),
    ] {
        assert_eq!(errors[case]["status"], 400, "{case}: {}", errors[case]);
        assert_eq!(
            errors[case]["body"]["param"], param,
            "{case}: {}",
            errors[case]
        );
    }
}
