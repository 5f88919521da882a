//! Atropos both ways. Without the peer venv: the wire rules (retries, gzip) against an in-process stub
//! API, the failures a user meets (an API that is down, a malformed batch) through the `holo` binary,
//! and batches the trainer must take apart (per-token advantages, groups of different sizes) from a
//! stub. With the peer venv's `atroposlib` 0.4.0: its real `run-api` between `holo atropos-env` (with
//! `holo serve` as the policy) and `holo train --rollouts atropos`, between an `atroposlib` `BaseEnv`
//! and `holo train`, two environments with their own group sizes, weights and batch shares feeding one
//! trainer, and an API restarted in the middle of a run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::components::{self, Component};
use crate::common::http::stub;
use crate::common::process::{free_port, Process};
use crate::common::served::{tiny_model, Served};
use crate::common::tempdir::Dir;
use holo_runtime::engines::atropos::api::{Api, ApiError, Retry, ScoredData};
use serde_json::{json, Value};

/// Retries without waits, so that the stub tests take no time.
fn quick() -> Retry {
    Retry {
        attempts: 3,
        base_delay: Duration::ZERO,
        max_delay: Duration::ZERO,
    }
}

#[tokio::test]
async fn posts_are_tried_three_times_on_5xx_and_once_on_4xx() {
    let cases = [
        // (statuses in turn, requests expected, the HTTP status of the final error or None)
        (vec![503, 502, 200], 3, None),
        (vec![500, 500, 500, 200], 3, Some(500)),
        (vec![422, 200], 1, Some(422)),
    ];
    for (statuses, requests, error) in cases {
        let script = statuses.clone();
        let (url, seen) = stub(move |_, index| {
            let status = script[index.min(script.len() - 1)];
            (
                status,
                json!({"status": "received", "detail": "nope"}).to_string(),
            )
        })
        .await;
        let api = Api::new(&url, quick()).unwrap();
        let result = api.post("/scored_data", &json!({"tokens": [[1]]})).await;
        assert_eq!(seen.lock().unwrap().len(), requests, "{statuses:?}");
        match (result, error) {
            (Ok(value), None) => assert_eq!(value["status"], "received"),
            (
                Err(ApiError::Status {
                    status, url: at, ..
                }),
                Some(expected),
            ) => {
                assert_eq!(status, expected);
                assert_eq!(at, format!("{url}/scored_data"));
            }
            (other, _) => panic!("{statuses:?}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn large_bodies_go_gzipped_and_small_ones_plain_as_base_env_sends_them() {
    let (url, seen) = stub(|_, _| (200, json!({"status": "received"}).to_string())).await;
    let api = Api::new(&url, quick()).unwrap();
    let large = ScoredData {
        tokens: vec![vec![17; 600]],
        masks: vec![vec![-100; 600]],
        scores: vec![1.0],
        env_id: Some(0),
        ..ScoredData::default()
    };
    let small = json!({"env_id": 0});
    api.post("/scored_data", &serde_json::to_value(&large).unwrap())
        .await
        .unwrap();
    api.get_with_body("/status-env", &small).await.unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen[0].headers.get("content-encoding").map(String::as_str),
        Some("gzip")
    );
    let mut plain = Vec::new();
    std::io::Read::read_to_end(
        &mut flate2::read::GzDecoder::new(&seen[0].raw[..]),
        &mut plain,
    )
    .unwrap();
    let sent: ScoredData = serde_json::from_slice(&plain).unwrap();
    assert_eq!(sent, large);
    assert!(seen[0].raw.len() < plain.len());
    // `/status-env` reads its env_id from a GET's JSON body.
    assert_eq!((seen[1].method.as_str(), &seen[1].body), ("GET", &small));
    assert_eq!(seen[1].headers.get("content-encoding"), None);
}

fn holo(args: &[&str]) -> Command {
    crate::common::holo_command(args)
}

/// Polls until `ready` holds, failing after `limit` with `what`.
fn wait_for(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `holo train --rollouts atropos` for `steps` steps with `num_generations` 2 and generation batches of
/// `batch` sequences (one micro-batch).
fn train_args<'a>(
    api: &'a str,
    model: &'a str,
    out: &'a str,
    steps: &'a str,
    batch: &'a str,
) -> Vec<&'a str> {
    vec![
        "train",
        "--rollouts",
        "atropos",
        "--api",
        api,
        "--model",
        model,
        "--out",
        out,
        "--max-steps",
        steps,
        "--num-generations",
        "2",
        "--per-device-train-batch-size",
        batch,
        "--gradient-accumulation-steps",
        "1",
        "--save-steps",
        "100",
    ]
}

#[test]
fn an_api_that_is_down_is_named_by_the_trainer_and_the_environment() {
    let dir = Dir::new("atropos-down");
    let model = tiny_model("atropos-down");
    let url = format!("http://127.0.0.1:{}", free_port());
    let out = dir.path().join("run");
    let trainer = holo(&train_args(
        &url,
        model.to_str().unwrap(),
        out.to_str().unwrap(),
        "1",
        "4",
    ))
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&trainer.stderr);
    assert_eq!(trainer.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot reach the Atropos API at {url}/register")),
        "{stderr}"
    );
    let env = holo(&[
        "atropos-env",
        "holo-runtime/tests/fixtures/train/short.hol",
        "--api",
        &url,
        "--policy-url",
        "http://127.0.0.1:9",
        "--model",
        model.to_str().unwrap(),
        "--data",
        "holo-runtime/tests/fixtures/train/rows.jsonl",
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&env.stderr);
    assert_eq!(env.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "cannot reach the Atropos API at {url}/register-env"
        )),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(model);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_batch_names_the_group_and_the_field() {
    let group = |masks: Value| {
        json!({"tokens": [[5, 6, 7, 8], [5, 6, 9, 3]], "masks": masks, "scores": [1.0, 0.0],
               "env_id": 0})
    };
    let good = group(json!([[-100, -100, 7, 8], [-100, -100, 9, 3]]));
    let bad = group(json!([[-100, 7, 8], [-100, -100, 9, 3]]));
    let (url, _) = stub(move |request, _| match request.path.as_str() {
        // run-api's uuid is a uuid4 as a 128-bit integer, past u64.
        "/register" => (
            200,
            r#"{"uuid": 313729403537440821469433052952933050392}"#.into(),
        ),
        "/info" => (
            200,
            json!({"batch_size": 4, "max_token_len": 64}).to_string(),
        ),
        "/batch" => (200, json!({"batch": [good, bad]}).to_string()),
        _ => (404, json!({"detail": "Not Found"}).to_string()),
    })
    .await;
    let dir = Dir::new("atropos-malformed");
    let model = tiny_model("atropos-malformed");
    let out = dir.path().join("run");
    let args: Vec<String> = train_args(
        &url,
        model.to_str().unwrap(),
        out.to_str().unwrap(),
        "1",
        "4",
    )
    .into_iter()
    .map(String::from)
    .collect();
    let trainer = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        holo(&args).output().unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&trainer.stderr);
    assert_eq!(trainer.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{url}/batch: group 1: `masks[0]` has 3 entries, `tokens[0]` 4"
        )),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(model);
}

/// `holo train --rollouts atropos --model MODEL --out OUT` for one step against a stub API whose one
/// `/batch` holds `groups` (the generation batch: all their sequences), with the `extra` options: the
/// stub's URL and the trainer's output.
async fn train_on_groups(
    model: &Path,
    out: &Path,
    groups: Vec<Value>,
    extra: &[&str],
) -> (String, std::process::Output) {
    let batch: usize = groups
        .iter()
        .map(|group| group["tokens"].as_array().unwrap().len())
        .sum();
    let (url, _) = stub(move |request, _| match request.path.as_str() {
        "/register" => (200, json!({"uuid": 1}).to_string()),
        "/info" => (
            200,
            json!({"batch_size": batch, "max_token_len": 64}).to_string(),
        ),
        "/batch" => (200, json!({ "batch": groups }).to_string()),
        _ => (404, json!({"detail": "Not Found"}).to_string()),
    })
    .await;
    let mut args: Vec<String> = train_args(
        &url,
        model.to_str().unwrap(),
        out.to_str().unwrap(),
        "1",
        &batch.to_string(),
    )
    .into_iter()
    .map(String::from)
    .collect();
    args.extend(extra.iter().map(|arg| arg.to_string()));
    let output = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        holo(&args).output().unwrap()
    })
    .await
    .unwrap();
    (url, output)
}

/// A scored group of 8-token sequences: positions 0–2 the prompt, 3–7 trained.
fn scored_group(
    tokens: Vec<Vec<i64>>,
    scores: Vec<f64>,
    advantages: Option<Vec<Vec<f64>>>,
) -> Value {
    let masks: Vec<Vec<i64>> = tokens
        .iter()
        .map(|tokens| {
            tokens
                .iter()
                .enumerate()
                .map(|(position, &token)| if position < 3 { -100 } else { token })
                .collect()
        })
        .collect();
    json!({"tokens": tokens, "masks": masks, "scores": scores, "advantages": advantages,
           "env_id": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_token_advantages_reach_the_loss_token_by_token() {
    let dir = Dir::new("atropos-per-token");
    let model = tiny_model("atropos-per-token");
    // Sequence 0 of the batch, in two versions that differ only after position 3; the other three
    // sequences have advantage 0 throughout.
    let first = vec![5, 6, 7, 10, 11, 12, 13, 14];
    let changed = vec![5, 6, 7, 10, 20, 21, 22, 23];
    let batch = |sequence: &Vec<i64>, advantages: Vec<f64>| {
        let zero = vec![0.0; 8];
        vec![
            scored_group(
                vec![sequence.clone(), vec![5, 6, 8, 15, 16, 17, 18, 19]],
                vec![1.0, 0.0],
                Some(vec![advantages, zero.clone()]),
            ),
            scored_group(
                vec![
                    vec![5, 9, 7, 24, 25, 26, 27, 28],
                    vec![5, 9, 8, 29, 30, 31, 32, 33],
                ],
                vec![0.0, 1.0],
                Some(vec![zero.clone(), zero]),
            ),
        ]
    };
    let mut norms = Vec::new();
    // Advantage 1 on position 3 alone (per token), then on every trained position (per sequence).
    for (name, advantages) in [
        ("token", vec![0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
        ("sequence", vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ] {
        for (version, sequence) in [("first", &first), ("changed", &changed)] {
            let out = dir.path().join(format!("{name}-{version}"));
            let (_, trainer) =
                train_on_groups(&model, &out, batch(sequence, advantages.clone()), &[]).await;
            let stderr = String::from_utf8_lossy(&trainer.stderr);
            assert!(trainer.status.success(), "{name}, {version}: {stderr}");
            let grad_norm = metric(&out, "grad_norm");
            assert_eq!(grad_norm.len(), 1, "{grad_norm:?}");
            norms.push(grad_norm[0].1);
        }
    }
    eprintln!("grad_norm (token: first, changed; sequence: first, changed): {norms:?}");
    // Only position 3 has a gradient, and what follows it cannot change its log-probability: the
    // gradient is the same for both versions. With the advantage on every position, the changed
    // tokens' own terms change it.
    assert!(norms[0] > 0.0, "{norms:?}");
    assert!(
        (norms[0] - norms[1]).abs() <= 1e-6 * norms[0],
        "per token: {norms:?}"
    );
    assert!(
        (norms[2] - norms[3]).abs() > 1e-3 * norms[2],
        "per sequence: {norms:?}"
    );
    let _ = std::fs::remove_dir_all(model);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_token_advantages_are_refused_by_a_loss_that_takes_one_per_sequence() {
    let dir = Dir::new("atropos-per-token-gspo");
    let model = tiny_model("atropos-per-token-gspo");
    let tokens = vec![
        vec![5, 6, 7, 10, 11, 12, 13, 14],
        vec![5, 6, 8, 15, 16, 17, 18, 19],
    ];
    let groups = vec![
        scored_group(tokens.clone(), vec![1.0, 0.0], None),
        scored_group(
            tokens,
            vec![1.0, 0.0],
            Some(vec![
                vec![0.0; 8],
                vec![0.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0],
            ]),
        ),
    ];
    let out = dir.path().join("run");
    let (url, trainer) = train_on_groups(
        &model,
        &out,
        groups,
        &["--importance-sampling-level", "sequence"],
    )
    .await;
    let stderr = String::from_utf8_lossy(&trainer.stderr);
    assert_eq!(trainer.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{url}/batch: group 1: `advantages[1]` varies over the trained tokens, and `importance_sampling_level = \"sequence\"` (GSPO)"
        )),
        "{stderr}"
    );
    assert!(metric(&out, "grad_norm").is_empty());
    let _ = std::fs::remove_dir_all(model);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_of_different_sizes_are_normalized_each_within_itself() {
    let dir = Dir::new("atropos-mixed-sizes");
    let model = tiny_model("atropos-mixed-sizes");
    let tokens = |count: i64| -> Vec<Vec<i64>> {
        (0..count)
            .map(|i| vec![5, 6, 7, 10 + i, 11, 12, 13, 14])
            .collect()
    };
    // A group of 4 whose scores differ, a group of 2 whose scores are equal, a group of 2 whose
    // differ: 2 of 8 sequences in a group with no spread. Taken as groups of num_generations = 2,
    // it would be 6 of 8.
    let groups = vec![
        scored_group(tokens(4), vec![1.0, 1.0, 0.0, 0.0], None),
        scored_group(tokens(2), vec![1.0, 1.0], None),
        scored_group(tokens(2), vec![0.0, 1.0], None),
    ];
    let out = dir.path().join("run");
    let (_, trainer) = train_on_groups(&model, &out, groups, &[]).await;
    let stderr = String::from_utf8_lossy(&trainer.stderr);
    assert!(trainer.status.success(), "{stderr}");
    assert_eq!(metric(&out, "frac_reward_zero_std"), [(1, 0.25)]);
    let rows: Vec<u64> = std::fs::read_to_string(out.join("rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            serde_json::from_str::<Value>(line).unwrap()["row_index"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(rows, [0, 0, 0, 0, 1, 1, 2, 2]);
    let _ = std::fs::remove_dir_all(model);
}

/// `run-api` of the peers' venv's `atroposlib`, or `None` after `Component::missing`.
fn run_api() -> Option<PathBuf> {
    let python = components::peers(&["atroposlib"])?;
    let run_api = python.with_file_name("run-api");
    if !run_api.is_file() {
        Component::Peers.missing(&format!("no {}", run_api.display()));
        return None;
    }
    Some(run_api)
}

/// The real Atropos API on a free port of 127.0.0.1, up (accepting) when this returns.
fn start_api(run_api: &Path, port: u16, log: PathBuf) -> Process {
    let mut process = Process::spawn(
        Command::new(run_api).args(["--host", "127.0.0.1", "--port", &port.to_string()]),
        log,
    );
    process.wait_accepting(port, Duration::from_secs(60));
    process
}

/// What the end-to-end tests share: run-api on a free port, `holo serve` on the tiny model as the
/// policy, and `holo train --rollouts atropos` for `steps` steps into `run`. `None` (the test skips)
/// without atroposlib.
struct Setup {
    run_api: PathBuf,
    dir: Dir,
    model: PathBuf,
    port: u16,
    url: String,
    api: Process,
    policy: Served,
    run: PathBuf,
    trainer: Process,
}

fn setup(name: &str, steps: &str, batch: &str) -> Option<Setup> {
    let run_api = run_api()?;
    let dir = Dir::new(name);
    let model = tiny_model(name);
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let api = start_api(&run_api, port, dir.path().join("api.log"));
    let policy = served_tiny(&model);
    let run = dir.path().join("run");
    let trainer = Process::spawn(
        &mut holo(&train_args(
            &url,
            model.to_str().unwrap(),
            run.to_str().unwrap(),
            steps,
            batch,
        )),
        dir.path().join("train.log"),
    );
    Some(Setup {
        run_api,
        dir,
        model,
        port,
        url,
        api,
        policy,
        run,
        trainer,
    })
}

/// The steps and one metric of each line of a run's metrics.jsonl.
fn metric(run: &Path, key: &str) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|line| {
            let value: Value = serde_json::from_str(line).unwrap();
            (
                value["step"].as_u64().unwrap(),
                value[key].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect()
}

fn served_tiny(model: &Path) -> Served {
    Served::start(&mut holo(&[
        "serve",
        model.to_str().unwrap(),
        "--port",
        "0",
        "--served-model-name",
        "tiny",
    ]))
}

/// `holo atropos-env FILE --data DATA` against `api`, sampling the tiny model at `policy`.
fn atropos_env_on(
    api: &str,
    policy: &str,
    model: &Path,
    file: &str,
    data: &str,
    extra: &[&str],
) -> Command {
    let mut command = holo(&[
        "atropos-env",
        file,
        "--api",
        api,
        "--policy-url",
        policy,
        "--model",
        model.to_str().unwrap(),
        "--served-model-name",
        "tiny",
        "--data",
        data,
    ]);
    command.args(extra);
    command
}

/// `holo atropos-env` on `tests/fixtures/train/short.hol`, groups of 2.
fn atropos_env(api: &str, policy: &str, model: &Path, extra: &[&str]) -> Command {
    let mut command = atropos_env_on(
        api,
        policy,
        model,
        "holo-runtime/tests/fixtures/train/short.hol",
        "holo-runtime/tests/fixtures/train/rows.jsonl",
        &["--group-size", "2"],
    );
    command.args(extra);
    command
}

#[test]
fn a_holoware_environment_feeds_holo_train_through_run_api() {
    let Some(Setup {
        dir,
        model,
        url,
        api: _api,
        policy,
        run,
        mut trainer,
        ..
    }) = setup("atropos-holoware", "2", "4")
    else {
        return;
    };
    let mut env = Process::spawn(
        &mut atropos_env(&url, &policy.base, &model, &[]),
        dir.path().join("env.log"),
    );
    let (status, env_log) = env.finish(Duration::from_secs(300));
    assert!(status.success(), "{env_log}");
    let (status, train_log) = trainer.finish(Duration::from_secs(300));
    assert!(status.success(), "{train_log}\n{env_log}");
    let rewards = metric(&run, "reward");
    assert_eq!(
        rewards.iter().map(|(step, _)| *step).collect::<Vec<_>>(),
        [1, 2]
    );
    assert!(
        rewards.iter().all(|(_, reward)| reward.is_finite()),
        "{rewards:?}"
    );
    // The served model is the trained one before its first update: at step 1, the trainer's
    // log-probabilities of the posted tokens are the sampler's, position for position, so tokens,
    // masks and inference_logprobs arrived aligned.
    let difference = metric(&run, "sampling/sampling_logp_difference/max");
    assert!(difference[0].1 < 1e-3, "{difference:?}");
    let posted: usize = env_log
        .lines()
        .find_map(|line| line.split(" groups posted").next()?.parse().ok())
        .unwrap_or_else(|| panic!("{env_log}"));
    assert!(posted >= 4, "{env_log}");
    eprintln!("{env_log}{train_log}sampling/sampling_logp_difference/max by step: {difference:?}");
    let _ = std::fs::remove_dir_all(model);
}

#[test]
fn an_atroposlib_base_env_feeds_holo_train() {
    let Some(Setup {
        dir,
        model,
        url,
        api: _api,
        policy,
        run,
        mut trainer,
        ..
    }) = setup("atropos-base-env", "2", "4")
    else {
        return;
    };
    let python = components::peers(&["atroposlib"]).expect("run_api found the venv");
    let script = crate::common::repo().join("holo-runtime/tests/fixtures/atropos/adder_env.py");
    let mut env = Process::spawn(
        Command::new(python).arg(script).args([
            url.as_str(),
            policy.base.as_str(),
            model.to_str().unwrap(),
            "tiny",
            "2",
        ]),
        dir.path().join("env.log"),
    );
    let (status, train_log) = trainer.finish(Duration::from_secs(300));
    assert!(status.success(), "{train_log}\n{}", env.output());
    let (status, env_log) = env.finish(Duration::from_secs(120));
    assert!(status.success(), "{env_log}");
    assert!(env_log.contains("adder env done"), "{env_log}");
    let rewards = metric(&run, "reward");
    assert_eq!(
        rewards.iter().map(|(step, _)| *step).collect::<Vec<_>>(),
        [1, 2]
    );
    // The environment's scores are minus the completion's length in twelfths.
    assert!(
        rewards.iter().all(|(_, reward)| *reward < 0.0),
        "{rewards:?}"
    );
    let _ = std::fs::remove_dir_all(model);
}

#[test]
fn a_restarted_api_is_registered_with_again_and_the_run_completes() {
    let Some(Setup {
        run_api,
        dir,
        model,
        port,
        url,
        mut api,
        policy,
        run,
        mut trainer,
    }) = setup("atropos-restart", "4", "4")
    else {
        return;
    };
    // One batch ahead at most, so that the environment still runs when the API goes.
    let mut env = Process::spawn(
        &mut atropos_env(
            &url,
            &policy.base,
            &model,
            &["--max-batches-offpolicy", "1"],
        ),
        dir.path().join("env.log"),
    );
    wait_for("the trainer's first step", Duration::from_secs(300), || {
        !metric(&run, "reward").is_empty()
    });
    api.child.kill().unwrap();
    api.child.wait().unwrap();
    let _api = start_api(&run_api, port, dir.path().join("api-2.log"));
    let (status, train_log) = trainer.finish(Duration::from_secs(300));
    assert!(status.success(), "{train_log}\n{}", env.output());
    let (status, env_log) = env.finish(Duration::from_secs(300));
    assert!(status.success(), "{env_log}");
    assert!(train_log.contains("registering again"), "{train_log}");
    assert!(
        env_log.contains("registered again as environment"),
        "{env_log}"
    );
    let steps: Vec<u64> = metric(&run, "reward")
        .iter()
        .map(|(step, _)| *step)
        .collect();
    assert_eq!(steps, [1, 2, 3, 4]);
    let _ = std::fs::remove_dir_all(model);
}

#[test]
fn two_environments_with_their_own_group_sizes_and_shares_feed_one_trainer() {
    let Some(Setup {
        dir,
        model,
        url,
        api: _api,
        policy,
        run,
        mut trainer,
        ..
    }) = setup("atropos-two-envs", "3", "8")
    else {
        return;
    };
    // A placeholder environment that claims a share of every batch and posts nothing: run-api makes no
    // batch while it is connected, so none is made before both environments have registered (the
    // first to register would otherwise fill the first batches alone). Environments register once the
    // trainer has asked for its first batch.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let client = Api::new(&url, Retry::default()).unwrap();
    let mut placeholder = None;
    wait_for(
        "the placeholder's registration",
        Duration::from_secs(120),
        || {
            let answer = runtime
                .block_on(client.post(
                    "/register-env",
                    &json!({"max_token_length": 64, "desired_name": "placeholder", "weight": 1.0,
                            "group_size": 2, "min_batch_allocation": 0.25}),
                ))
                .unwrap();
            placeholder = answer["env_id"].as_i64();
            placeholder.is_some()
        },
    );
    // (holoware, rows, group size, weight, min_batch_allocation). Both run past the trainer's steps,
    // so that both stay connected (and their shares claimed) until it is done.
    let environments = [
        (
            "holo-runtime/tests/fixtures/train/short.hol",
            "holo-runtime/tests/fixtures/train/rows.jsonl",
            2,
            "1",
            0.25,
        ),
        (
            "holo-runtime/tests/fixtures/atropos/terse.hol",
            "holo-runtime/tests/fixtures/atropos/topics.jsonl",
            4,
            "2",
            0.5,
        ),
    ];
    let processes: Vec<Process> = environments
        .iter()
        .enumerate()
        .map(|(index, (file, data, group, weight, share))| {
            let (group, share) = (group.to_string(), share.to_string());
            let extra = [
                "--group-size",
                group.as_str(),
                "--weight",
                weight,
                "--min-batch-allocation",
                share.as_str(),
                "--total-steps",
                "1000",
            ];
            Process::spawn(
                &mut atropos_env_on(&url, &policy.base, &model, file, data, &extra),
                dir.path().join(format!("env-{index}.log")),
            )
        })
        .collect();
    wait_for(
        "both environments' registrations",
        Duration::from_secs(120),
        || {
            processes
                .iter()
                .all(|process| process.output().contains(" as environment "))
        },
    );
    runtime
        .block_on(client.post("/disconnect-env", &json!({ "env_id": placeholder })))
        .unwrap();
    let (status, train_log) = trainer.finish(Duration::from_secs(300));
    let logs: Vec<String> = processes.iter().map(Process::output).collect();
    assert!(status.success(), "{train_log}\n{logs:?}");
    // Each environment's id at the API, from its log.
    let ids: Vec<u64> = logs
        .iter()
        .map(|log| {
            log.lines()
                .find_map(|line| {
                    let rest = line.split(" as environment ").nth(1)?;
                    rest.split(':').next()?.parse().ok()
                })
                .unwrap_or_else(|| panic!("no registration in {log}"))
        })
        .collect();
    // Per step, the sequences of each environment, and the size of each group.
    let records: Vec<Value> = std::fs::read_to_string(run.join("rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let mut groups: std::collections::BTreeMap<u64, (u64, u64, usize)> = Default::default();
    for record in &records {
        let entry = groups
            .entry(record["row_index"].as_u64().unwrap())
            .or_insert((
                record["step"].as_u64().unwrap(),
                record["row"]["env_id"].as_u64().unwrap(),
                0,
            ));
        entry.2 += 1;
    }
    let mut batches: std::collections::BTreeMap<u64, Vec<usize>> = Default::default();
    for (step, env, size) in groups.values() {
        let index = ids.iter().position(|id| id == env).unwrap();
        assert_eq!(*size, environments[index].2, "a group of environment {env}");
        batches.entry(*step).or_insert_with(|| vec![0; 2])[index] += size;
    }
    eprintln!("sequences per step, by environment (groups of 2, of 4): {batches:?}");
    assert_eq!(batches.keys().copied().collect::<Vec<_>>(), [1, 2, 3]);
    for (step, sequences) in &batches {
        // run-api's minimum: ⌊batch_size · min_batch_allocation⌋ sequences of each environment.
        assert!(
            sequences[0] >= 2 && sequences[1] >= 4,
            "step {step}: {sequences:?}"
        );
        assert_eq!(sequences.iter().sum::<usize>(), 8, "step {step}");
    }
    let rewards = metric(&run, "reward");
    assert!(
        rewards.iter().all(|(_, reward)| reward.is_finite()),
        "{rewards:?}"
    );
    let _ = std::fs::remove_dir_all(model);
}
