//! End-to-end tests of `holo dry`.

use std::process::Output;

use crate::common::holo_command;

fn holo(args: &[&str]) -> Output {
    holo_command(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("holo runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

fn scratch(name: &str, contents: &str) -> String {
    let dir = std::env::temp_dir().join(format!("holo-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path.display().to_string()
}

#[test]
fn tool_episode_end_to_end() {
    let output = holo(&[
        "dry",
        "hol/tool.hol",
        "--data",
        "examples/data/arithmetic.jsonl",
        "--reply",
        r#"<tool>{"name": "calculator", "args": {"expression": "17 * 23"}}</tool>"#,
        "--reply",
        "<answer>391</answer>",
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(
        stdout.contains("# row 1, rollout 1, reward 1\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("--- user\nWhat is 17 * 23?\n--- assistant\n⟦<tool>"),
        "{stdout}"
    );
    assert!(
        stdout.contains("--- user\n<result>391</result>\n--- assistant\n⟦<answer>391</answer>⟧"),
        "{stdout}"
    );
    assert!(
        stdout.contains("# row 2, rollout 1, reward 0\n"),
        "{stdout}"
    );
    assert!(stdout.contains("reward math_answer = 1\n"), "{stdout}");
}

#[test]
fn without_data_inputs_are_placeholders() {
    let output = holo(&[
        "dry",
        "hol/qa.hol",
        "-n",
        "2",
        "--reply",
        "<answer>x</answer>",
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(stdout.contains("<question>"), "{stdout}");
    assert!(stdout.contains("# row 1, rollout 2"), "{stdout}");
}

#[test]
fn bad_rows_are_reported_with_their_line_and_the_rest_run() {
    let data = scratch(
        "rows.jsonl",
        "{\"question\": \"ok?\", \"expected\": \"yes\"}\n{\"question\": \n[1, 2]\n{\"expected\": \"no question\"}\n\n{\"question\": \"again\", \"expected\": \"yes\"}\n",
    );
    let output = holo(&["dry", "hol/qa.hol", "--data", &data, "--reply", "yes"]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("rows.jsonl:2: column 13: invalid JSON"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rows.jsonl:3: a row must be a JSON object"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rows.jsonl:4: missing column `question` (used at hol/qa.hol:13:3)"),
        "{stderr}"
    );
    let stdout = text(&output.stdout);
    assert!(stdout.contains("# row 1, rollout 1, reward 1"), "{stdout}");
    assert!(stdout.contains("# row 6, rollout 1, reward 1"), "{stdout}");
}

#[test]
fn a_broken_holoware_reports_diagnostics() {
    let file = scratch("broken.hol", "<|o_o|>\n<|answer|>\n<|@_@:answer|>\n");
    let output = holo(&["dry", &file]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output.stderr).contains("error[H0021]"),
        "{}",
        text(&output.stderr)
    );
}

#[test]
fn an_unknown_holotype_fails_the_load_with_a_suggestion() {
    let file = scratch(
        "unknown.hol",
        "<|o_o|>\nq\n<|@_@:answer|>\n<|ExactAnswr|>\n",
    );
    let output = holo(&["dry", &file]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("error[H0026]: unknown holotype `ExactAnswr`"),
        "{stderr}"
    );
    assert!(stderr.contains("did you mean `ExactAnswer`?"), "{stderr}");
}

#[test]
fn a_holotype_argument_its_type_refuses_fails_before_any_rollout() {
    let file = scratch(
        "retry.hol",
        "<|o_o|>\nq\n<|@_@:answer|>\n<|MathAnswer|>\n<|Retry threshold=1|>\n    <|@_@:again|>\n",
    );
    let output = holo(&["dry", &file, "--reply", "<answer>4</answer>"]);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(text(&output.stdout), "", "no rollout runs");
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains(
            "retry.hol:5:1: Retry needs the name of a reward component, as in `<|Retry first|>`"
        ),
        "{stderr}"
    );
}

#[test]
fn missing_data_file_is_a_usage_error() {
    let output = holo(&["dry", "hol/qa.hol", "--data", "nope.jsonl"]);
    assert_eq!(output.status.code(), Some(2));
}

// ---------------------------------------------------------------------------------------------------
// `holo eval`

fn jsonl(path: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

fn scratch_path(name: &str) -> String {
    let dir = std::env::temp_dir().join(format!("holo-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name).display().to_string()
}

#[test]
fn eval_runs_a_dataset_with_the_scripted_sampler() {
    let out = scratch_path("eval-scripted.jsonl");
    let output = holo(&[
        "eval",
        "hol/tool.hol",
        "--data",
        "examples/data/arithmetic.jsonl",
        "-n",
        "3",
        "--seed",
        "5",
        "--reply",
        r#"<tool>{"name": "calculator", "args": {"expression": "17 * 23"}}</tool>"#,
        "--reply",
        "<answer>391</answer>",
        "--out",
        &out,
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(
        stdout.contains("== examples/data/arithmetic.jsonl: 3 rows x 3 rollouts: 9 rollouts, 0 failed, 18 sampler calls"),
        "{stdout}"
    );
    assert!(
        stdout.contains("reward math_answer = 0.3333 (mean of 9)\n"),
        "{stdout}"
    );
    assert!(stdout.contains("mean reward = 0.3333\n"), "{stdout}");
    assert!(stdout.contains("pass@1 = 0.3333\n"), "{stdout}");
    assert!(stdout.contains("pass@3 = 0.3333\n"), "{stdout}");

    let records = jsonl(&out);
    assert_eq!(records.len(), 9);
    let mut seen: Vec<(u64, u64)> = records
        .iter()
        .map(|r| {
            (
                r["row_index"].as_u64().unwrap(),
                r["rollout_index"].as_u64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        (0..3)
            .flat_map(|row| (0..3).map(move |k| (row, k)))
            .collect::<Vec<_>>()
    );
    let first = &records[0];
    assert_eq!(first["dataset"], "examples/data/arithmetic.jsonl");
    assert_eq!(first["row"]["query"], "What is 17 * 23?");
    assert_eq!(first["rewards"]["math_answer"], 1.0);
    assert_eq!(first["weights"]["math_answer"], 1.0);
    assert_eq!(first["reward"], 1.0);
    assert_eq!(first["samples"], 2);
    assert!(first["error"].is_null());
    assert!(first["timing"]["wall_ms"].as_f64().unwrap() >= 0.0);
    let messages = first["contexts"][0]["messages"].as_array().unwrap();
    assert_eq!(first["contexts"][0]["trained"], true);
    assert_eq!(messages[2]["role"], "assistant");
    assert_eq!(messages[2]["parts"][0]["sampled"], true);
    assert_eq!(messages[3]["parts"][0]["text"], "<result>391</result>");
    assert_eq!(messages[3]["parts"][0]["sampled"], false);

    // The same seed gives the same rollouts (timing aside).
    let again = scratch_path("eval-scripted-again.jsonl");
    let mut args: Vec<&str> = vec![
        "eval",
        "hol/tool.hol",
        "--data",
        "examples/data/arithmetic.jsonl",
        "-n",
        "3",
        "--seed",
        "5",
        "--reply",
        r#"<tool>{"name": "calculator", "args": {"expression": "17 * 23"}}</tool>"#,
        "--reply",
        "<answer>391</answer>",
        "--out",
    ];
    args.push(&again);
    assert_eq!(holo(&args).status.code(), Some(0));
    let strip = |mut records: Vec<serde_json::Value>| {
        for record in &mut records {
            record.as_object_mut().unwrap().remove("timing");
        }
        records
    };
    assert_eq!(strip(jsonl(&out)), strip(jsonl(&again)));
}

/// pass@k reads the answer check, not the total: a wrong answer in the right format earns arithmetic.hol's
/// format bonus (total 0.2) and does not pass; `--pass-component` names another component, and a file
/// with two unmarked answer checks is refused before any rollout.
#[test]
fn eval_counts_pass_at_k_on_the_answer_check() {
    let out = scratch_path("eval-pass.jsonl");
    let data = scratch(
        "sums.jsonl",
        "{\"question\": \"What is 2+2?\", \"expected\": \"4\"}\n{\"question\": \"What is 3+5?\", \"expected\": \"8\"}\n",
    );
    let eval = |file: &str, extra: &[&str]| {
        let mut args = vec![
            "eval",
            file,
            "--data",
            &data,
            "--reply",
            "<answer>0</answer>",
            "--out",
            &out,
        ];
        args.extend(extra);
        holo(&args)
    };
    let output = eval("hol/arithmetic.hol", &[]);
    let stdout = text(&output.stdout);
    assert!(stdout.contains("mean reward = 0.2000\n"), "{stdout}");
    assert!(stdout.contains("pass@1 = 0.0000\n"), "{stdout}");
    assert!(
        stdout.contains("(a rollout passes with full credit on `math_answer`)"),
        "{stdout}"
    );
    let output = eval("hol/arithmetic.hol", &["--pass-component", "format"]);
    let stdout = text(&output.stdout);
    assert!(stdout.contains("pass@1 = 1.0000\n"), "{stdout}");

    let two = scratch(
        "two-checks.hol",
        "<|o_o|>\n<|question|>\n<|@_@:reply|>\n<|MathAnswer var=reply name=first|>\n<|ExactAnswer var=reply name=second|>\n",
    );
    std::fs::remove_file(&out).unwrap();
    let output = eval(&two, &[]);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("`first` (")
            && stderr.contains("two-checks.hol:4:1)")
            && stderr.contains("`second` (")
            && stderr.contains("pass=true"),
        "{stderr}"
    );
    assert!(!std::path::Path::new(&out).exists(), "no rollout ran");
}

#[test]
fn eval_reports_bad_rows_runs_the_rest_and_exits_1() {
    let data = scratch(
        "eval-rows.jsonl",
        "{\"query\": \"What is 17 * 23?\", \"expected\": \"391\"}\n\n{\"expected\": \"1\"}\nnot json\n{\"query\": \"What is 1 + 1?\", \"expected\": \"2\"}\n",
    );
    let out = scratch_path("eval-rows-out.jsonl");
    let output = holo(&[
        "eval",
        "hol/tool.hol",
        "--data",
        &data,
        "-n",
        "2",
        "--reply",
        "<answer>2</answer>",
        "--out",
        &out,
    ]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("eval-rows.jsonl:3: missing column `query` (used at hol/tool.hol:"),
        "{stderr}"
    );
    assert!(
        stderr.contains("eval-rows.jsonl:4: column 2: invalid JSON"),
        "{stderr}"
    );
    let stdout = text(&output.stdout);
    assert!(
        stdout.contains("2 rows x 2 rollouts: 4 rollouts, 0 failed"),
        "{stdout}"
    );
    assert!(stdout.contains("pass@1 = 0.5000\n"), "{stdout}");
    let records = jsonl(&out);
    assert_eq!(records.len(), 4);
    // Row indices count the data rows (non-blank lines): the fourth row is index 3.
    let rows: Vec<u64> = records
        .iter()
        .map(|r| r["row_index"].as_u64().unwrap())
        .collect();
    assert_eq!(rows, [0, 0, 3, 3]);
}

#[test]
fn eval_openai_needs_a_server_and_a_model() {
    let output = holo(&[
        "eval",
        "hol/qa.hol",
        "--data",
        "examples/data/arithmetic.jsonl",
        "--sampler",
        "openai",
    ]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = text(&output.stderr);
    assert!(stderr.contains("--base-url"), "{stderr}");
}

// A fake OpenAI-compatible server on 127.0.0.1 for `holo eval --sampler openai`: it plays a model that
// calls the calculator with the question's expression, then answers with the tool's result; it injects a
// 500 on the very first request, or rejects (400) every request about a power.

mod fake_openai {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use serde_json::{json, Value};
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    use crate::common::http::read_request;
    pub use crate::common::http::Seen;

    #[derive(Clone, Copy, PartialEq, Eq)]
    pub enum Fault {
        FirstIs500,
        RejectPowers,
    }

    pub struct Server {
        pub base: String,
        pub seen: Arc<Mutex<Vec<Seen>>>,
        accept: tokio::task::JoinHandle<()>,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.accept.abort();
        }
    }

    impl Server {
        pub async fn start(fault: Fault) -> Server {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let base = format!("http://{}", listener.local_addr().unwrap());
            let seen = Arc::new(Mutex::new(Vec::new()));
            let count = Arc::new(AtomicUsize::new(0));
            let accept = {
                let seen = seen.clone();
                tokio::spawn(async move {
                    loop {
                        let Ok((mut stream, _)) = listener.accept().await else {
                            return;
                        };
                        let (seen, count) = (seen.clone(), count.clone());
                        tokio::spawn(async move {
                            let Some(request) = read_request(&mut stream).await else {
                                return;
                            };
                            seen.lock().unwrap().push(request.clone());
                            let first = count.fetch_add(1, Ordering::SeqCst) == 0;
                            let power = request.body.to_string().contains("power");
                            let (status, body) = match fault {
                                Fault::FirstIs500 if first => {
                                    (500, json!({"error": {"message": "injected fault"}}))
                                }
                                Fault::RejectPowers if power => {
                                    (400, json!({"error": {"message": "no powers here"}}))
                                }
                                _ => (200, answer(&request.body)),
                            };
                            respond(&mut stream, status, &body.to_string()).await;
                        });
                    }
                })
            };
            Server { base, seen, accept }
        }
    }

    /// What the fake model writes, answered like vLLM (stop string kept, `stop_reason`).
    fn answer(body: &Value) -> Value {
        let messages = body["messages"].as_array().unwrap();
        let assistant_turns = messages.iter().filter(|m| m["role"] == "assistant").count();
        let last = messages.last().unwrap()["content"].as_str().unwrap();
        let written = if assistant_turns == 0 {
            let expression = last
                .trim()
                .trim_start_matches("What is ")
                .trim_end_matches('?');
            format!(
                "<tool>{}</tool> and then some",
                json!({"name": "calculator", "args": {"expression": expression}})
            )
        } else {
            let result = last
                .split("<result>")
                .nth(1)
                .and_then(|rest| rest.split("</result>").next())
                .unwrap_or("?");
            format!("<answer>{result}</answer>")
        };
        let stops: Vec<String> =
            serde_json::from_value(body.get("stop").cloned().unwrap_or(json!([]))).unwrap();
        let (text, stop_reason) = match stops
            .iter()
            .filter_map(|stop| written.find(stop.as_str()).map(|at| (at, stop)))
            .min()
        {
            Some((at, stop)) => (written[..at + stop.len()].to_string(), json!(stop)),
            None => (written, Value::Null),
        };
        json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "stop_reason": stop_reason,
            }],
        })
    }

    async fn respond(stream: &mut TcpStream, status: u16, body: &str) {
        let out = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = stream.write_all(out.as_bytes()).await;
        let _ = stream.shutdown().await;
    }
}

/// `holo COMMAND hol/tool.hol` on the arithmetic rows, 2 rollouts each, against the fake server.
async fn holo_openai(server: &fake_openai::Server, command: &str, extra: &[&str]) -> Output {
    let args: Vec<String> = [
        command,
        "hol/tool.hol",
        "--data",
        "examples/data/arithmetic.jsonl",
        "-n",
        "2",
        "--sampler",
        "openai",
        "--base-url",
        &server.base,
        "--model",
        "fake-model",
    ]
    .iter()
    .chain(extra)
    .map(|arg| arg.to_string())
    .collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        holo_command(&args)
            .env("NO_COLOR", "1")
            .env("OPENAI_API_KEY", "sk-test-key")
            .env_remove("HTTP_PROXY")
            .env_remove("http_proxy")
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("ALL_PROXY")
            .env_remove("all_proxy")
            .env("NO_PROXY", "127.0.0.1,localhost")
            .output()
            .expect("holo runs")
    })
    .await
    .unwrap()
}

async fn eval_openai(server: &fake_openai::Server, out: &str) -> Output {
    holo_openai(server, "eval", &["--seed", "3", "--out", out]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_with_a_model_prints_every_transcript() {
    let server = fake_openai::Server::start(fake_openai::Fault::FirstIs500).await;
    let output = holo_openai(&server, "dry", &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    for (line, reward) in [(1, 1), (2, 1), (3, 0)] {
        for rollout in 1..=2 {
            assert!(
                stdout.contains(&format!(
                    "# row {line}, rollout {rollout}, reward {reward}\n"
                )),
                "{stdout}"
            );
        }
    }
    assert!(
        stdout.contains(
            "--- user\nWhat is 17 * 23?\n--- assistant\n⟦<tool>{\"name\":\"calculator\",\"args\":{\"expression\":\"17 * 23\"}}</tool>⟧\n--- user\n<result>391</result>\n--- assistant\n⟦<answer>391</answer>⟧"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("reward math_answer = 1\n"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_against_an_openai_server_survives_a_500() {
    let server = fake_openai::Server::start(fake_openai::Fault::FirstIs500).await;
    let out = scratch_path("eval-openai.jsonl");
    let output = eval_openai(&server, &out).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));

    // 3 rows × 2 rollouts × 2 turns, plus the request that got the 500 and was retried.
    let seen = server.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 13);
    assert!(seen[1..].iter().any(|s| s.body == seen[0].body), "retried");
    for request in &seen {
        assert_eq!(request.path, "/v1/chat/completions");
        assert_eq!(request.headers["authorization"], "Bearer sk-test-key");
        assert_eq!(request.body["model"], "fake-model");
        assert!(request.body["seed"].as_u64().is_some());
        assert_eq!(request.body["stop"], serde_json::json!(["</tool>"]));
        // A fresh assistant turn: the chat ends with the user message, nothing to continue.
        assert!(request.body.get("continue_final_message").is_none());
    }

    let records = jsonl(&out);
    assert_eq!(records.len(), 6);
    for record in &records {
        assert!(record["error"].is_null(), "{record}");
        assert_eq!(record["samples"], 2);
    }
    let reward = |row: u64| {
        records
            .iter()
            .filter(|r| r["row_index"] == row)
            .map(|r| r["reward"].as_f64().unwrap())
            .collect::<Vec<_>>()
    };
    // 17 * 23 = 391 and (1.5 + 2.5) / 4 = 1 are right; "2 to the power of 10" is no expression.
    assert_eq!(reward(0), [1.0, 1.0]);
    assert_eq!(reward(1), [1.0, 1.0]);
    assert_eq!(reward(2), [0.0, 0.0]);
    let stdout = text(&output.stdout);
    assert!(stdout.contains("mean reward = 0.6667\n"), "{stdout}");
    assert!(stdout.contains("pass@1 = 0.6667\n"), "{stdout}");
    assert!(stdout.contains("pass@2 = 0.6667\n"), "{stdout}");
    // Records are written as rollouts finish, in no fixed order against a server.
    let row_0 = records.iter().find(|r| r["row_index"] == 0).unwrap();
    let tool_turn = &row_0["contexts"][0]["messages"][2]["parts"][0];
    assert_eq!(
        tool_turn["text"],
        r#"<tool>{"name":"calculator","args":{"expression":"17 * 23"}}</tool>"#
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_a_rejected_request_fails_its_rollout_only_and_exits_1() {
    let server = fake_openai::Server::start(fake_openai::Fault::RejectPowers).await;
    let out = scratch_path("eval-openai-rejected.jsonl");
    let output = eval_openai(&server, &out).await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    for rollout in 0..2 {
        assert!(
            stderr.contains(&format!(
                "examples/data/arithmetic.jsonl:3: rollout {rollout}: request rejected: HTTP 400: no powers here"
            )),
            "{stderr}"
        );
    }
    // A 4xx is not retried: 2 rows × 2 rollouts × 2 turns, and one request per rejected rollout.
    assert_eq!(server.seen.lock().unwrap().len(), 10);
    let records = jsonl(&out);
    assert_eq!(records.len(), 6);
    let failed: Vec<&serde_json::Value> =
        records.iter().filter(|r| !r["error"].is_null()).collect();
    assert_eq!(failed.len(), 2);
    for record in failed {
        assert_eq!(record["row_index"], 2);
        assert_eq!(record["error"]["stage"], "sampler");
    }
    let stdout = text(&output.stdout);
    assert!(stdout.contains("6 rollouts, 2 failed"), "{stdout}");
    assert!(stdout.contains("mean reward = 1.0000\n"), "{stdout}");
    assert!(stdout.contains("pass@1 = 0.6667\n"), "{stdout}");
}
