//! `holo gym`, a holoware as a NeMo Gym agent server. Without NeMo Gym: the wire against the real
//! `holo gym` binary, with a stub policy whose tokens and log-probabilities are known (row mapping,
//! sampling parameters, the response's items and token ids, rewards), with `holo serve` on a tiny
//! model (token ids that re-decode to the text), and the failures a user meets (a row that does not
//! fit, a policy that is down, a head server that is unreachable). With the NeMo Gym 0.7.0 venv
//! (`~/.cache/holo-engines/gym-venv`, or `HOLO_GYM_VENV`; `bash scripts/prepare.sh gym`): nemo-gym's own head server and
//! `ng_collect_rollouts` against `holo gym`, `holo serve` as the policy.

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::http::{stub, Seen};
use crate::common::process::{free_port, Process};
use crate::common::served::{tiny_model, Served};
use crate::common::tempdir::Dir;
use serde_json::{json, Value};
use tokenizers::Tokenizer;

const HOLOWARE: &str = "holo-runtime/tests/fixtures/gym/twoturn.hol";
const ROWS: &str = "holo-runtime/tests/fixtures/gym/rows.jsonl";

/// `holo gym HOLOWARE ARGS` on a free port, up when this returns.
fn gym(args: &[&str]) -> Served {
    let mut command = crate::common::holo_command(&["gym", HOLOWARE, "--port", "0"]);
    command.args(args);
    Served::start(&mut command)
}

/// `POST {base}{path}` with a JSON body (or raw text): the status and the JSON answer.
async fn post(base: &str, path: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
    let answer = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap_or_else(|error| panic!("POST {base}{path}: no answer: {error}"));
    let status = answer.status().as_u16();
    let text = answer.text().await.unwrap();
    let value = serde_json::from_str(&text).unwrap_or_else(|error| {
        panic!("POST {path} answered {status} with no JSON ({error}): {text}")
    });
    (status, value)
}

fn tokenizer(model: &Path) -> Tokenizer {
    Tokenizer::from_file(model.join("tokenizer.json")).unwrap()
}

fn decode(tokenizer: &Tokenizer, ids: &[u32]) -> String {
    tokenizer.decode(ids, true).unwrap()
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {value}"))
        .iter()
        .map(|id| id.as_u64().unwrap() as u32)
        .collect()
}

/// The response's assistant items, after checking what every item must hold: text that the
/// generation's ids decode to, one log-probability per id, and a prompt that starts with the
/// previous turn's prompt and generation (NeMo RL's contiguity).
fn checked_turns<'a>(tokenizer: &Tokenizer, answer: &'a Value) -> Vec<&'a Value> {
    let output = answer["response"]["output"].as_array().unwrap();
    let turns: Vec<&Value> = output
        .iter()
        .filter(|item| item["role"] == "assistant")
        .collect();
    let mut seen: Vec<u32> = Vec::new();
    for turn in &turns {
        let (prompt, generation) = (
            ids(&turn["prompt_token_ids"]),
            ids(&turn["generation_token_ids"]),
        );
        let logprobs = turn["generation_log_probs"].as_array().unwrap();
        assert_eq!(logprobs.len(), generation.len(), "{turn}");
        assert!(
            logprobs.iter().all(|l| l.as_f64().unwrap() <= 0.0),
            "{turn}"
        );
        assert_eq!(
            decode(tokenizer, &generation),
            turn["content"][0]["text"].as_str().unwrap(),
            "{turn}"
        );
        assert!(prompt.starts_with(&seen), "not contiguous: {answer}");
        seen = [prompt, generation].concat();
    }
    turns
}

/// A stub OpenAI completions policy that answers request `index` with `reply(index)` (its token ids
/// with `<|im_end|>`, log-probabilities that differ by request and position).
async fn stub_replies<F>(tokenizer: &Tokenizer, reply: F) -> (String, Arc<Mutex<Vec<Seen>>>)
where
    F: Fn(usize) -> String + Send + Sync + 'static,
{
    let tokenizer = tokenizer.clone();
    let end = tokenizer.token_to_id("<|im_end|>").unwrap();
    stub(move |request, index| {
        if request.path != "/v1/completions" {
            return (404, json!({"detail": "Not Found"}).to_string());
        }
        let text = reply(index);
        let mut ids = tokenizer.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        ids.push(end);
        let logprobs: Vec<f64> = (0..ids.len())
            .map(|i| -0.5 - index as f64 - i as f64 / 10.0)
            .collect();
        let tokens: Vec<String> = ids.iter().map(|id| format!("token_id:{id}")).collect();
        (
            200,
            json!({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
                   "choices": [{"index": 0, "text": text, "finish_reason": "stop", "stop_reason": null,
                                "logprobs": {"tokens": tokens, "token_logprobs": logprobs}}],
                   "usage": {"prompt_tokens": 1, "completion_tokens": ids.len(), "total_tokens": 1}})
            .to_string(),
        )
    })
    .await
}

/// [`stub_replies`] alternating between `texts`.
async fn stub_policy(tokenizer: &Tokenizer, texts: [&str; 2]) -> (String, Arc<Mutex<Vec<Seen>>>) {
    let texts = texts.map(str::to_string);
    stub_replies(tokenizer, move |index| texts[index % 2].clone()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_is_rolled_out_and_answered_with_its_tokens_as_sampled() {
    let model = tiny_model("gym-exact");
    let tokenizer = tokenizer(&model);
    let (policy, seen) = stub_policy(&tokenizer, ["4", "5"]).await;
    let server = gym(&[
        "--policy-url",
        &policy,
        "--model",
        model.to_str().unwrap(),
        "--served-model-name",
        "tiny",
    ]);
    let row = json!({
        "responses_create_params": {
            "input": [{"role": "system", "content": "Be terse."},
                      {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]}],
            "instructions": "Answer with a number.",
            "temperature": 0.3, "top_p": 0.9, "max_output_tokens": 4
        },
        "verifier_metadata": {"expected": "5"},
        "agent_ref": {"type": "responses_api_agents", "name": "holo_agent"},
        "_ng_task_index": 0, "_ng_rollout_index": 1
    });
    let (status, answer) = post(&server.base, "/run", row.to_string()).await;
    assert_eq!(status, 200, "{answer}");

    // The policy was asked twice, with token ids and the row's sampling parameters (max_output_tokens
    // caps the holoware's max_tokens=6).
    let requests: Vec<Value> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.body.clone())
        .collect();
    assert_eq!(requests.len(), 2, "{requests:?}");
    for request in &requests {
        assert_eq!(request["model"], "tiny");
        assert_eq!(request["temperature"], 0.3);
        assert_eq!(request["top_p"], 0.9);
        assert_eq!(request["max_tokens"], 4);
        assert!(
            request["prompt"].as_array().unwrap()[0].is_u64(),
            "{request}"
        );
    }

    // One item per sampled turn, the question between them; tokens and log-probabilities exactly as
    // the policy sampled them, prompts exactly as it was sent.
    let output = answer["response"]["output"].as_array().unwrap();
    let roles: Vec<&str> = output
        .iter()
        .map(|item| item["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["assistant", "user", "assistant"], "{answer}");
    assert_eq!(output[1]["content"][0]["text"], "Are you sure?");
    for (turn, (item, request)) in [&output[0], &output[2]]
        .into_iter()
        .zip(&requests)
        .enumerate()
    {
        assert_eq!(ids(&item["prompt_token_ids"]), ids(&request["prompt"]));
        let mut expected = tokenizer
            .encode(["4", "5"][turn], false)
            .unwrap()
            .get_ids()
            .to_vec();
        expected.push(tokenizer.token_to_id("<|im_end|>").unwrap());
        assert_eq!(ids(&item["generation_token_ids"]), expected);
        let logprobs: Vec<f64> = item["generation_log_probs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_f64().unwrap())
            .collect();
        let sent: Vec<f64> = (0..expected.len())
            .map(|i| -0.5 - turn as f64 - i as f64 / 10.0)
            .collect();
        assert!(
            logprobs
                .iter()
                .zip(&sent)
                .all(|(a, b)| (a - b).abs() < 1e-6),
            "{logprobs:?} {sent:?}"
        );
        assert_eq!(item["content"][0]["text"], ["4", "5"][turn]);
    }
    checked_turns(&tokenizer, &answer);
    let prompt = decode(&tokenizer, &ids(&output[0]["prompt_token_ids"]));
    assert!(
        prompt.contains("Answer with a number.\n\nBe terse.") && prompt.contains("What is 2+2?"),
        "{prompt}"
    );

    // The row comes back with the reward and its components; the response says what it is.
    assert_eq!(answer["reward"], 1.0);
    assert_eq!(
        answer["reward_components"],
        json!({"exact": 1.0, "length_penalty": 0.0})
    );
    assert_eq!(answer["verifier_metadata"], row["verifier_metadata"]);
    assert_eq!(answer["_ng_rollout_index"], 1);
    assert_eq!(
        answer["responses_create_params"],
        row["responses_create_params"]
    );
    let response = &answer["response"];
    assert_eq!(
        (&response["object"], &response["model"], &response["status"]),
        (&json!("response"), &json!("tiny"), &json!("completed"))
    );
    assert!(response["id"].as_str().unwrap().starts_with("resp_"));
    let _ = std::fs::remove_dir_all(model);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_that_do_not_fit_are_answered_422_naming_the_field() {
    let model = tiny_model("gym-rows");
    // No rollout reaches the policy: it may be anywhere.
    let closed = format!("http://127.0.0.1:{}", free_port());
    let server = gym(&["--policy-url", &closed, "--model", model.to_str().unwrap()]);
    // The same holoware with its input column renamed: rows lack `question`.
    let renamed = gym(&[
        "--policy-url",
        &closed,
        "--model",
        model.to_str().unwrap(),
        "--input-column",
        "prompt",
    ]);
    let cases: [(&Served, String, Vec<Value>, &str); 7] = [
        (&server, "{\"responses_create_params\": ".into(), vec![json!("body")], "not JSON"),
        (&server, json!({}).to_string(), vec![json!("body"), json!("responses_create_params")], "missing"),
        (
            &server,
            json!({"responses_create_params": {"input": 7}}).to_string(),
            vec![json!("body"), json!("responses_create_params"), json!("input")],
            "must be a string or a list of messages, not a number",
        ),
        (
            &server,
            json!({"responses_create_params": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}}).to_string(),
            vec![json!("body"), json!("responses_create_params"), json!("input"), json!(0), json!("content"), json!(0)],
            "only text parts",
        ),
        (
            &server,
            json!({"responses_create_params": {"input": "hi", "temperature": "warm"}}).to_string(),
            vec![json!("body"), json!("responses_create_params"), json!("temperature")],
            "must be a number, not a string",
        ),
        (
            &server,
            json!({"responses_create_params": {"input": "hi"}, "verifier_metadata": ["4"]}).to_string(),
            vec![json!("body"), json!("verifier_metadata")],
            "must be an object, not a list",
        ),
        (
            &renamed,
            json!({"responses_create_params": {"input": "hi"}}).to_string(),
            vec![json!("body"), json!("verifier_metadata"), json!("question")],
            "missing column `question` (used at holo-runtime/tests/fixtures/gym/twoturn.hol:",
        ),
    ];
    for (served, body, loc, message) in cases {
        let (status, answer) = post(&served.base, "/run", body.clone()).await;
        assert_eq!(status, 422, "{body}: {answer}");
        let detail = &answer["detail"][0];
        assert_eq!(detail["loc"], json!(loc), "{body}: {answer}");
        assert!(
            detail["msg"].as_str().unwrap().contains(message),
            "{body}: {answer}"
        );
    }
    // Still serving, on the same connections.
    let health = reqwest::get(format!("{}/", server.base)).await.unwrap();
    assert_eq!(health.status(), 200);
    let _ = std::fs::remove_dir_all(model);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_that_is_down_is_named_in_a_502() {
    let model = tiny_model("gym-down");
    let policy = format!("http://127.0.0.1:{}", free_port());
    let server = gym(&[
        "--policy-url",
        &policy,
        "--model",
        model.to_str().unwrap(),
        "--policy-retries",
        "0",
    ]);
    let row = json!({"responses_create_params": {"input": "What is 2+2?"}, "verifier_metadata": {"expected": "4"}});
    let (status, answer) = post(&server.base, "/run", row.to_string()).await;
    assert_eq!(status, 502, "{answer}");
    let detail = answer["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!("the policy at {policy} failed"))
            && detail.contains(&format!("POST {policy}/v1/completions: cannot connect")),
        "{detail}"
    );
    let _ = std::fs::remove_dir_all(model);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_comes_from_the_head_server_and_an_unreachable_one_is_named() {
    let model = tiny_model("gym-head");
    let tokenizer = tokenizer(&model);
    let (policy, seen) = stub_policy(&tokenizer, ["4", "4"]).await;
    // As nemo-gym's head server answers: a JSON string holding OmegaConf's YAML.
    let yaml = format!(
        "head_server:\n  host: 127.0.0.1\n  port: 11000\npolicy_base_url: {policy}/v1\npolicy_api_key: dummy\n\
         policy_model_name: {}\nholo_agent:\n  responses_api_agents:\n    holo_agent:\n      port: 1\n",
        model.display()
    );
    let (head, _) = stub(move |request, _| match request.path.as_str() {
        "/global_config_dict_yaml" => (200, Value::String(yaml.clone()).to_string()),
        _ => (404, json!({"detail": "Not Found"}).to_string()),
    })
    .await;
    let server = gym(&["--head-url", &head]);
    let row = json!({"responses_create_params": {"input": "What is 2+2?"}, "verifier_metadata": {"expected": "4"}});
    let (status, answer) = post(&server.base, "/run", row.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["reward_components"]["exact"], 1.0);
    // The model the head server names is the served id and the tokenizer's folder.
    assert_eq!(answer["response"]["model"], model.display().to_string());
    assert_eq!(
        seen.lock().unwrap()[0].body["model"],
        model.display().to_string()
    );
    checked_turns(&tokenizer, &answer);

    let unreachable = format!("http://127.0.0.1:{}", free_port());
    let output =
        crate::common::holo_command(&["gym", HOLOWARE, "--port", "0", "--head-url", &unreachable])
            .output()
            .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the NeMo Gym head server at {unreachable}/global_config_dict_yaml: cannot reach it"
        )),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(model);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregate_metrics_summarizes_rewards_and_components() {
    let model = tiny_model("gym-metrics");
    let closed = format!("http://127.0.0.1:{}", free_port());
    let server = gym(&["--policy-url", &closed, "--model", model.to_str().unwrap()]);
    let responses: Vec<Value> = (0..3)
        .map(|repeat| {
            json!({"_ng_task_index": 0, "_ng_rollout_index": repeat, "reward": repeat as f64,
                   "reward_components": {"exact": (repeat % 2) as f64}, "agent_ref": {"name": "holo_agent"},
                   "response": {"usage": {"input_tokens": 3}}})
        })
        .collect();
    let (status, metrics) = post(
        &server.base,
        "/aggregate_metrics",
        json!({"verify_responses": responses}).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{metrics}");
    assert_eq!(metrics["agent_metrics"]["mean/reward"], 1.0);
    assert_eq!(metrics["agent_metrics"]["std/reward"], 1.0);
    assert_eq!(metrics["agent_metrics"]["num_repeats"], 3);
    assert_eq!(
        metrics["key_metrics"],
        json!({"mean/reward": 1.0, "mean/exact": 1.0 / 3.0})
    );
    assert_eq!(metrics["group_level_metrics"][0]["num_rollouts"], 3);
    assert_eq!(metrics["repeat_level_metrics"][2]["mean/reward"], 2.0);
    let (status, error) = post(
        &server.base,
        "/aggregate_metrics",
        json!({"verify_responses": [{"reward": null}]}).to_string(),
    )
    .await;
    assert_eq!(status, 422, "{error}");
    assert_eq!(
        error["detail"][0]["loc"],
        json!(["body", "verify_responses", 0, "reward"])
    );
    let _ = std::fs::remove_dir_all(model);
}

fn served_tiny(model: &Path) -> Served {
    Served::start(&mut crate::common::holo_command(&[
        "serve",
        model.to_str().unwrap(),
        "--port",
        "0",
        "--no-access-log",
    ]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollouts_sampled_by_holo_serve_re_decode_to_their_text() {
    let model = tiny_model("gym-served");
    let tokenizer = tokenizer(&model);
    let policy = served_tiny(&model);
    let server = gym(&[
        "--policy-url",
        &policy.base,
        "--model",
        model.to_str().unwrap(),
    ]);
    let rows: Vec<Value> = std::fs::read_to_string(crate::common::repo().join(ROWS))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let mut first_turns = Vec::new();
    for (task, row) in rows.iter().enumerate() {
        for repeat in 0..2 {
            let mut row = row.clone();
            row["_ng_task_index"] = json!(task);
            row["_ng_rollout_index"] = json!(repeat);
            let (status, answer) = post(&server.base, "/run", row.to_string()).await;
            assert_eq!(status, 200, "{answer}");
            let turns = checked_turns(&tokenizer, &answer);
            assert_eq!(turns.len(), 2, "{answer}");
            first_turns.push(ids(&turns[0]["generation_token_ids"]));
        }
    }
    // Repeats of a task are seeded apart.
    assert_ne!(first_turns[0], first_turns[1]);
    let _ = std::fs::remove_dir_all(model);
}

#[test]
fn ng_collect_rollouts_collects_holo_gym_rollouts_sampled_by_holo_serve() {
    let Some(venv) = crate::common::components::gym() else {
        return;
    };
    let python = venv.join("bin/python");
    let dir = Dir::new("gym-e2e");
    let model = tiny_model("gym-e2e");
    let policy = served_tiny(&model);
    let (head_port, gym_port) = (free_port(), free_port());
    let config = dir.path().join("gym.yaml");
    std::fs::write(
        &config,
        format!(
            "head_server:\n  host: 127.0.0.1\n  port: {head_port}\n\
             policy_base_url: {}/v1\npolicy_api_key: dummy\npolicy_model_name: {}\n\
             holo_agent:\n  responses_api_agents:\n    holo_agent:\n      host: 127.0.0.1\n      port: {gym_port}\n\
             holo_env:\n  environment_servers:\n    holo_env:\n      host: 127.0.0.1\n      port: {gym_port}\n\
             \x20     agent_server:\n        type: responses_api_agents\n        name: holo_agent\n",
            policy.base,
            model.display()
        ),
    )
    .unwrap();
    let config_arg = format!("+config_paths=[{}]", config.display());
    let mut head = Process::spawn(
        Command::new(&python)
            .arg(crate::common::repo().join("holo-runtime/tests/fixtures/gym/head.py"))
            .arg(&config_arg)
            .current_dir(dir.path()),
        dir.path().join("head.log"),
    );
    head.wait_accepting(head_port, Duration::from_secs(120));
    // The policy from the head server's configuration: no --policy-url, no --model.
    let mut gym = Process::spawn(
        &mut crate::common::holo_command(&[
            "gym",
            HOLOWARE,
            "--port",
            &gym_port.to_string(),
            "--head-url",
            &format!("http://127.0.0.1:{head_port}"),
        ]),
        dir.path().join("gym.log"),
    );
    gym.wait_accepting(gym_port, Duration::from_secs(60));
    let out = dir.path().join("out.jsonl");
    let started = Instant::now();
    let mut collect = Process::spawn(
        Command::new(venv.join("bin/ng_collect_rollouts"))
            .arg(&config_arg)
            .arg(format!(
                "+input_jsonl_fpath={}",
                crate::common::repo().join(ROWS).display()
            ))
            .arg(format!("+output_jsonl_fpath={}", out.display()))
            .arg("+num_repeats=4")
            .current_dir(dir.path()),
        dir.path().join("collect.log"),
    );
    let (status, log) = collect.finish(Duration::from_secs(300));
    let seconds = started.elapsed().as_secs_f64();
    assert!(status.success(), "{log}\n{}", gym.output());
    let rows: Vec<Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(rows.len(), 8, "{log}");

    // Every row is a valid verify response to nemo-gym itself.
    let check = Command::new(&python)
        .arg("-c")
        .arg(
            "import json, sys\n\
             from nemo_gym.base_resources_server import BaseVerifyResponse\n\
             rows = [json.loads(line) for line in open(sys.argv[1])]\n\
             for row in rows:\n    BaseVerifyResponse.model_validate(row)\n\
             print('validated', len(rows))",
        )
        .arg(&out)
        .output()
        .unwrap();
    let checked = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() && checked.contains("validated 8"),
        "{checked}{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let tokenizer = tokenizer(&model);
    for row in &rows {
        let turns = checked_turns(&tokenizer, row);
        assert_eq!(turns.len(), 2, "{row}");
        assert!(
            row["reward"].is_f64() && row["reward_components"]["exact"].is_f64(),
            "{row}"
        );
        assert_eq!(row["response"]["model"], model.display().to_string());
    }
    let metrics: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("out_aggregate_metrics.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(metrics[0]["agent_metrics"]["num_repeats"], 4, "{metrics}");
    assert!(
        metrics[0]["key_metrics"]["mean/exact"].is_f64(),
        "{metrics}"
    );
    eprintln!(
        "ng_collect_rollouts: {} rollouts in {seconds:.1} s (the command's whole run, Python's start included)",
        rows.len()
    );
    let _ = std::fs::remove_dir_all(model);
}

/// `holo gym` answers its health check while every worker thread's worth of `/run`s runs model-written
/// code that sleeps: the code runs on the blocking pool (`Holotype::BLOCKS`), not on the threads that
/// serve requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_check_answers_while_runs_execute_sleeping_code() {
    if !crate::common::components::sandbox() {
        return;
    }
    let model = tiny_model("gym-sleeping-code");
    let tokenizer = tokenizer(&model);
    // The first turn of every run writes code that sleeps; the second answers.
    let code = "<code>\nimport time\ntime.sleep(20)\nprint('slept')\n</code>";
    let runs = std::thread::available_parallelism().map_or(2, |n| n.get().max(2));
    let (policy, seen) = stub_replies(&tokenizer, move |index| {
        if index < runs { code } else { "4" }.to_string()
    })
    .await;
    let dir = Dir::new("gym-sleeping-code");
    let hol = dir.path().join("code.hol");
    std::fs::write(
        &hol,
        "<|o_o|>\n<|question|>\n\n<|@_@:turn stop=\"</code>\"|>\n\n<|o_o|>\n<|CodeExecutor turn timeout=60|>\n\n<|@_@:final max_tokens=6|>\n",
    )
    .unwrap();
    let mut command = crate::common::holo_command(&[
        "gym",
        hol.to_str().unwrap(),
        "--port",
        "0",
        "--policy-url",
        &policy,
        "--model",
        model.to_str().unwrap(),
        "--served-model-name",
        "tiny",
    ]);
    let server = Served::start(&mut command);
    let row = json!({
        "responses_create_params": {"input": "What is 2+2?"},
        "verifier_metadata": {},
        "agent_ref": {"type": "responses_api_agents", "name": "holo_agent"}
    });
    let posts: Vec<_> = (0..runs)
        .map(|_| {
            let (base, row) = (server.base.clone(), row.to_string());
            tokio::spawn(async move { post(&base, "/run", row).await })
        })
        .collect();
    // Every run has had its code reply (a bounded wait on the policy's requests, not on time).
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.lock().unwrap().len() < runs {
        assert!(
            Instant::now() < deadline,
            "the policy had {} of {runs} first turns after 60 s",
            seen.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let health = reqwest::Client::new()
        .get(format!("{}/", server.base))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("GET / answered within 10 s while the runs' code sleeps");
    assert_eq!(health.status(), 200);
    assert_eq!(
        seen.lock().unwrap().len(),
        runs,
        "the health check answered only after a run's code had ended (20 s of sleep)"
    );
    for posted in posts {
        let (status, answer) = posted.await.unwrap();
        assert_eq!(status, 200, "{answer}");
    }
    assert_eq!(seen.lock().unwrap().len(), 2 * runs);
    let _ = std::fs::remove_dir_all(model);
}
