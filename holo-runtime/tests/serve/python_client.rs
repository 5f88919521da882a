//! The official `openai` Python client, when the peers' venv has it.

use super::*;

const PYTHON_CLIENT: &str = r#"
import json, sys
import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
out = {}
models = client.models.list()
out["models"] = [m.id for m in models.data]
c = client.completions.create(model=sys.argv[2], prompt="Hello world", max_tokens=20, logprobs=1, n=2, seed=7)
out["completion"] = c.model_dump()
c = client.completions.create(model=sys.argv[2], prompt=[[1, 2, 3], [4, 5]], max_tokens=2, stop=["zz"])
out["token_prompts"] = c.model_dump()
chat = client.chat.completions.create(
    model=sys.argv[2],
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    logprobs=True, top_logprobs=2, max_tokens=4, seed=1, temperature=0.5,
)
out["chat"] = chat.model_dump()
stream = client.completions.create(
    model=sys.argv[2], prompt="Hello world", max_tokens=20, logprobs=1, n=2, seed=7, stream=True
)
out["completion_stream"] = [chunk.model_dump() for chunk in stream]
stream = client.chat.completions.create(
    model=sys.argv[2],
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    logprobs=True, top_logprobs=2, max_tokens=4, seed=1, temperature=0.5,
    stream=True, stream_options={"include_usage": True},
)
out["chat_stream"] = [chunk.model_dump() for chunk in stream]
try:
    for _ in client.completions.create(model=sys.argv[2], prompt="UNAVAILABLE", stream=True):
        pass
    out["stream_error"] = None
except openai.APIError as error:
    out["stream_error"] = {"message": error.message}
try:
    client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "x"}],
                                   extra_body={"echo": True})
    out["echo_error"] = None
except openai.BadRequestError as error:
    out["echo_error"] = {"status": error.status_code, "body": error.body}
try:
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    out["model_error"] = None
except openai.NotFoundError as error:
    out["model_error"] = {"status": error.status_code, "body": error.body}
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_client() {
    let f = start().await;
    let Some(out) = run_python(&["openai"], PYTHON_CLIENT, &f.base, &[]).await else {
        return;
    };

    assert_eq!(out["models"], json!([MODEL]));

    let completion = &out["completion"];
    let prompt = encode("Hello world");
    assert_eq!(completion["object"], "text_completion");
    let choices = completion["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (index, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], index);
        assert_eq!(choice["text"], "Hello world");
        assert_eq!(choice["finish_reason"], "stop");
        let seed = if index == 0 {
            7
        } else {
            f.echo.requests()[1].params.seed.unwrap()
        };
        let expected: Vec<f32> = (0..prompt.len())
            .map(|i| -0.25 * (i as f32 + 1.0) - 0.0625 * (seed % 4) as f32)
            .collect();
        assert_eq!(floats(&choice["logprobs"]["token_logprobs"]), expected);
        assert_eq!(
            choice["logprobs"]["tokens"].as_array().unwrap().len(),
            prompt.len()
        );
        assert_eq!(choice["logprobs"]["text_offset"][0], 0);
        // `logprobs=1`: the sampled token is the most likely, so each position's dict holds it alone.
        for (i, &lp) in expected.iter().enumerate() {
            let token = choice["logprobs"]["tokens"][i].as_str().unwrap();
            assert_eq!(
                choice["logprobs"]["top_logprobs"][i],
                json!({token: f64::from(lp)})
            );
        }
    }
    assert_eq!(completion["usage"]["prompt_tokens"], prompt.len());

    let token_prompts = &out["token_prompts"]["choices"];
    assert_eq!(
        token_prompts[0]["text"],
        tokenizer().decode(&[1, 2], false).unwrap()
    );
    assert_eq!(token_prompts[0]["finish_reason"], "length");
    assert_eq!(
        token_prompts[1]["text"],
        tokenizer().decode(&[4, 5], false).unwrap()
    );
    assert_eq!(token_prompts[1]["finish_reason"], "stop");

    let chat = &out["chat"];
    let rendered = rendered_chat(
        &[
            ChatMessage {
                role: Role::System,
                content: "Be brief.".into(),
            },
            user("Hi"),
        ],
        &RenderOptions::generation(),
    );
    let window = &echo_window(&rendered)[..4];
    let choice = &chat["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(
        choice["message"]["content"],
        tokenizer().decode(window, false).unwrap()
    );
    assert_eq!(choice["finish_reason"], "length");
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for (i, entry) in content.iter().enumerate() {
        assert_eq!(
            entry["logprob"].as_f64().unwrap() as f32,
            -0.25 * (i as f32 + 1.0) - 0.0625
        );
        let lp = entry["logprob"].as_f64().unwrap();
        assert_eq!(entry["top_logprobs"][0]["token"], entry["token"]);
        assert_eq!(entry["top_logprobs"][0]["logprob"].as_f64().unwrap(), lp);
        assert_eq!(
            entry["top_logprobs"][1]["logprob"].as_f64().unwrap(),
            lp - 1.0
        );
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
        assert!(entry["bytes"].is_array());
    }
    assert_eq!(chat["usage"]["prompt_tokens"], rendered.len());

    // The streamed answers join into the whole ones (the client's objects carry every field it knows, null
    // where absent).
    let chunks = out["completion_stream"].as_array().unwrap();
    for (index, choice) in choices.iter().enumerate() {
        let joined = join_choice(chunks, index, false);
        assert_eq!(joined["text"], choice["text"]);
        assert_eq!(joined["finish_reason"], choice["finish_reason"]);
        for key in ["tokens", "token_logprobs", "text_offset", "top_logprobs"] {
            assert_eq!(joined["logprobs"][key], choice["logprobs"][key], "{key}");
        }
    }
    let chunks = out["chat_stream"].as_array().unwrap();
    let (usage, chunks) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"]["prompt_tokens"],
        chat["usage"]["prompt_tokens"]
    );
    assert_eq!(
        usage["usage"]["completion_tokens"],
        chat["usage"]["completion_tokens"]
    );
    let joined = join_choice(chunks, 0, true);
    assert_eq!(joined["message"]["content"], choice["message"]["content"]);
    assert_eq!(joined["finish_reason"], choice["finish_reason"]);
    assert_eq!(joined["logprobs"]["content"], choice["logprobs"]["content"]);
    assert!(
        out["stream_error"]["message"]
            .as_str()
            .is_some_and(|message| message.contains("unavailable")),
        "{}",
        out["stream_error"]
    );

    assert_eq!(out["echo_error"]["status"], 400);
    assert_eq!(out["echo_error"]["body"]["param"], "echo");
    assert_eq!(out["model_error"]["status"], 404);
    assert_eq!(out["model_error"]["body"]["code"], "model_not_found");
}

/// Runs `script` with the peers' Python (which must have `modules`) as
/// `python -c script BASE MODEL ARGS…`; its stdout as JSON. `None` when the venv is missing (a failure
/// under `CI=true`, a SKIPPED line elsewhere).
pub(super) async fn run_python(
    modules: &[&str],
    script: &'static str,
    base: &str,
    args: &[&str],
) -> Option<Value> {
    let python = crate::common::components::peers(modules)?;
    let base = base.to_string();
    let args: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .args(["-c", script, &base, MODEL])
            .args(&args)
            .env("NO_PROXY", "127.0.0.1,localhost")
            .env("no_proxy", "127.0.0.1,localhost")
            .env_remove("OPENAI_BASE_URL")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the Python client failed:\n{stderr}"
    );
    Some(
        serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
            panic!(
                "{error}: {}\n{stderr}",
                String::from_utf8_lossy(&output.stdout)
            )
        }),
    )
}
