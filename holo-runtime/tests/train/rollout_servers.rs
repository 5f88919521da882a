//! `holo train --vllm-server-base-url`: rollouts sampled by `holo serve` child processes while the
//! weights train in process, pushed after every step and verified with a probe. A sync that leaves the
//! served weights as they were stops the run with an error that names the cause; so does a server that
//! dies mid-run when it is the only one, while beside another it is dropped from the pool.
#![cfg(feature = "cli")]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::common::http::read_request;
use crate::common::served::Served;
use crate::common::{
    fixture, holo_command, run_metrics, run_rollouts, sampled_versions, tiny_grpo,
};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("holo-sync-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `holo serve` on the committed tiny Qwen2, the model `tiny_grpo` trains.
fn serve() -> Served {
    Served::start(
        Command::new(env!("CARGO_BIN_EXE_holo"))
            .args(["serve", &fixture("models/qwen2"), "--port", "0"])
            .args(["--no-access-log"]),
    )
}

/// A two-step run of the trainers' test environment on `servers`, with `extra` options.
fn train_on(servers: &[&str], out: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = tiny_grpo("short.hol", out, 2, extra);
    for server in servers {
        args.extend(["--vllm-server-base-url".to_string(), server.to_string()]);
    }
    args.extend(["--vllm-server-timeout".to_string(), "5".to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    holo_command(&args).output().unwrap()
}

/// What a [`Proxy`] does with the requests it forwards.
#[derive(Clone, Copy)]
enum Fault {
    /// Answers every load after the first with vLLM's success without forwarding it: the adapter is
    /// never synced again, silently.
    SwallowLoads,
    /// Kills the server behind it at the second load (the first step's push): a server that dies
    /// mid-run.
    KillAtLoad,
    /// Kills the server behind it at the first rollout it is asked for: a server that dies while it
    /// samples.
    KillAtRollout,
    /// Kills the server behind it at the second load, as [`Fault::KillAtLoad`] does, and starts a new
    /// one behind the same address when it is next asked for `GET /health`: a server restarted after
    /// it was dropped from the pool.
    RestartAtLoad,
}

/// An HTTP proxy in front of a `holo serve` child, on its own thread, that injects `fault`.
struct Proxy {
    url: String,
    loads: Arc<AtomicUsize>,
    /// The server behind it, killed when the proxy is dropped (if the fault has not killed it).
    served: Arc<Mutex<Option<Served>>>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        drop(self.served.lock().unwrap().take());
    }
}

impl Proxy {
    fn start(served: Served, fault: Fault) -> Proxy {
        let (sender, receiver) = std::sync::mpsc::channel();
        let loads = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&loads);
        let backend = Arc::new(Mutex::new(served.base.clone()));
        // `Fault::RestartAtLoad`'s new server, starting while the old one is down.
        let restarted: Arc<Mutex<Option<std::thread::JoinHandle<Served>>>> = Arc::default();
        let served = Arc::new(Mutex::new(Some(served)));
        let kept = Arc::clone(&served);
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                use tokio::io::AsyncWriteExt;

                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                sender
                    .send(format!("http://{}", listener.local_addr().unwrap()))
                    .unwrap();
                let client = reqwest::Client::builder().no_proxy().build().unwrap();
                loop {
                    let Ok((mut stream, _)) = listener.accept().await else {
                        return;
                    };
                    let (client, backend) = (client.clone(), Arc::clone(&backend));
                    let (served, loads) = (Arc::clone(&served), Arc::clone(&counted));
                    let restarted = Arc::clone(&restarted);
                    tokio::spawn(async move {
                        while let Some(request) = read_request(&mut stream).await {
                            let rollout = request.path == "/v1/completions"
                                && request.body["max_tokens"] != 0;
                            if rollout && matches!(fault, Fault::KillAtRollout) {
                                drop(served.lock().unwrap().take());
                            }
                            let restarting = restarted.lock().unwrap().take();
                            if let Some(restarting) = restarting {
                                if request.path != "/health" {
                                    // Still down: the load's retries fail until the pool drops it.
                                    *restarted.lock().unwrap() = Some(restarting);
                                    return;
                                }
                                // Back at the first health check (its server started at the kill).
                                let started =
                                    tokio::task::spawn_blocking(|| restarting.join().unwrap())
                                        .await
                                        .unwrap();
                                *backend.lock().unwrap() = started.base.clone();
                                *served.lock().unwrap() = Some(started);
                            }
                            if request.path == "/v1/load_lora_adapter"
                                || request.path == "/update_weights_from_disk"
                            {
                                let load = loads.fetch_add(1, Ordering::SeqCst);
                                match fault {
                                    Fault::SwallowLoads if load > 0 => {
                                        let body = "Success: LoRA adapter added successfully.";
                                        let head = format!(
                                            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n",
                                            body.len()
                                        );
                                        let _ = stream.write_all(head.as_bytes()).await;
                                        let _ = stream.write_all(body.as_bytes()).await;
                                        continue;
                                    }
                                    Fault::RestartAtLoad if load == 1 => {
                                        drop(served.lock().unwrap().take());
                                        *restarted.lock().unwrap() =
                                            Some(std::thread::spawn(serve));
                                        return;
                                    }
                                    Fault::KillAtLoad if load > 0 => {
                                        // Dropping the child kills it (and waits for it).
                                        drop(served.lock().unwrap().take());
                                    }
                                    _ => {}
                                }
                            }
                            let forwarded = client
                                .request(
                                    request.method.parse().unwrap(),
                                    format!("{}{}", backend.lock().unwrap(), request.path),
                                )
                                .header("content-type", "application/json")
                                .body(request.raw.clone())
                                .send()
                                .await;
                            let Ok(response) = forwarded else {
                                // The server is gone: so is the connection.
                                return;
                            };
                            let status = response.status().as_u16();
                            let version = response
                                .headers()
                                .get("x-holo-weight-version")
                                .map(|value| value.to_str().unwrap().to_string());
                            let body = response.bytes().await.unwrap();
                            let mut head = format!(
                                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
                                body.len()
                            );
                            if let Some(version) = version {
                                head.push_str(&format!("x-holo-weight-version: {version}\r\n"));
                            }
                            head.push_str("\r\n");
                            if stream.write_all(head.as_bytes()).await.is_err()
                                || stream.write_all(&body).await.is_err()
                            {
                                return;
                            }
                        }
                    });
                }
            });
        });
        let url = receiver
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the proxy listens");
        Proxy {
            url,
            loads,
            served: kept,
        }
    }
}

/// A LoRA run and a full fine-tuning sample on two servers, round-robin: every step's push is
/// verified (the probe matches the trainer to rounding and the servers report one version more per
/// push), and the sampler's log-probabilities match the trainer's.
#[test]
fn a_run_samples_on_servers_and_verifies_every_push() {
    for (name, extra) in [
        ("lora", vec!["--use-peft", "--lora-r", "4"]),
        ("full", vec![]),
    ] {
        let (first, second) = (serve(), serve());
        let out = scratch(name);
        let output = train_on(&[&first.base, &second.base], &out, &extra);
        assert!(
            output.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let metrics = run_metrics(&out);
        let steps: Vec<&Value> = metrics.iter().filter(|m| m.get("loss").is_some()).collect();
        assert_eq!(steps.len(), 2, "{name}: {metrics:#?}");
        for (i, step) in steps.iter().enumerate() {
            // Version 1 is the starting weights' push; step n's is n + 1.
            assert_eq!(
                step["sync/weight_version"],
                (i + 2) as f64,
                "{name}: {step:#}"
            );
            let mismatch = step["sync/mismatch"].as_f64().unwrap();
            assert!(mismatch <= 1e-4, "{name}: {step:#}");
            assert!(
                step["sync/change"].as_f64().unwrap() > 0.0,
                "{name}: {step:#}"
            );
            let difference = step["sampling/sampling_logp_difference/max"]
                .as_f64()
                .unwrap();
            assert!(
                difference <= 1e-3,
                "{name}: sampler and trainer differ: {step:#}"
            );
        }
        // Each sampled part says which weights sampled it, in the trainer's numbering: step n's
        // rollouts, those after n - 1 steps (the servers' version n, translated).
        for rollout in run_rollouts(&out) {
            let step = rollout["step"].as_u64().unwrap();
            for version in sampled_versions(&rollout) {
                assert_eq!(version, Some(step - 1), "{name}: {rollout}");
            }
        }
        for step in &steps {
            assert_eq!(step["async/staleness_max"], 0.0, "{name}: {step:#}");
        }
        // Both servers sampled: each holds the last push.
        for server in [&first, &second] {
            let models = reqwest_get(&format!("{}/v1/models", server.base));
            let versions: Vec<u64> = models["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|model| model["weight_version"].as_u64().unwrap())
                .collect();
            assert!(versions.contains(&3), "{name}: {models:#}");
        }
    }
}

/// Asynchronous GRPO on a server: the generation of step n + 1 is sampled while step n trains, every
/// push is still verified, and each sampled part's version is one the server held while its
/// generation was drawn (the weights after 0 to n steps for step n + 1's), which `async/staleness`
/// counts, the correction weighing the difference.
#[test]
fn a_run_samples_ahead_on_a_server_while_it_trains() {
    let server = serve();
    let out = scratch("ahead");
    let output = train_on(&[&server.base], &out, &["--max-off-policy-steps", "1"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metrics = run_metrics(&out);
    let steps: Vec<&Value> = metrics.iter().filter(|m| m.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 2, "{metrics:#?}");
    for (i, step) in steps.iter().enumerate() {
        assert_eq!(step["sync/weight_version"], (i + 2) as f64, "{step:#}");
        assert!(step["sync/mismatch"].as_f64().unwrap() <= 1e-4, "{step:#}");
        assert!(
            step.get("sampling/importance_sampling_ratio/mean")
                .is_some(),
            "{step:#}"
        );
    }
    // Both generations start on the starting weights' push (the trainer's version 0); the second may
    // end on step 1's. Staleness counts, in optimizer steps, how far behind the training weights
    // (after step - 1 steps) the sampling ones were.
    let mut behind: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for rollout in run_rollouts(&out) {
        let step = rollout["step"].as_u64().unwrap();
        for version in sampled_versions(&rollout) {
            let version = version.unwrap_or_else(|| panic!("step {step}: {rollout}"));
            assert!(version < step, "step {step}: {rollout}");
            behind.entry(step).or_default().push(step - 1 - version);
        }
    }
    assert_eq!(behind.keys().copied().collect::<Vec<_>>(), [1, 2]);
    assert!(behind[&1].iter().all(|&behind| behind == 0));
    for (step, metrics) in (1..).zip(&steps) {
        let counts = &behind[&step];
        let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
        let max = *counts.iter().max().unwrap() as f64;
        assert!(
            (metrics["async/staleness"].as_f64().unwrap() - mean).abs() < 1e-9,
            "step {step}: {counts:?} {metrics:#}"
        );
        assert_eq!(
            metrics["async/staleness_max"], max,
            "step {step}: {metrics:#}"
        );
    }
    let _ = std::fs::remove_dir_all(out);
}

/// A LoRA run sampling ahead loads each push's adapter under a name of its own: a generation drawn
/// while a push lands keeps the adapter it started with, so every rollout of a step was sampled by one
/// version (both generations started before any step trained: the starting weights'), and an adapter
/// nothing samples with any more is unloaded from the server, its folder removed.
#[test]
fn a_lora_run_sampling_ahead_loads_each_push_under_its_own_name() {
    let server = serve();
    let out = scratch("ahead-lora");
    let output = train_on(
        &[&server.base],
        &out,
        &["--use-peft", "--lora-r", "4", "--max-off-policy-steps", "1"],
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metrics = run_metrics(&out);
    let steps: Vec<&Value> = metrics.iter().filter(|m| m.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 2, "{metrics:#?}");
    for step in &steps {
        assert!(step["sync/mismatch"].as_f64().unwrap() <= 1e-4, "{step:#}");
        assert!(step["sync/change"].as_f64().unwrap() > 0.0, "{step:#}");
        // Each name is loaded once: the server's count of its loads says nothing.
        assert!(step.get("sync/weight_version").is_none(), "{step:#}");
    }
    let mut versions: BTreeMap<u64, Vec<Option<u64>>> = BTreeMap::new();
    for rollout in run_rollouts(&out) {
        let step = rollout["step"].as_u64().unwrap();
        versions
            .entry(step)
            .or_default()
            .extend(sampled_versions(&rollout));
    }
    assert_eq!(versions.keys().copied().collect::<Vec<_>>(), [1, 2]);
    for (step, sampled) in &versions {
        assert!(
            sampled.iter().all(|&version| version == Some(0)),
            "step {step}: {sampled:?}"
        );
    }
    assert_eq!(steps[1]["async/staleness_max"], 1.0, "{:#}", steps[1]);
    let models = reqwest_get(&format!("{}/v1/models", server.base));
    let adapters: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|model| !model["parent"].is_null())
        .map(|model| model["id"].as_str().unwrap())
        .collect();
    // Step 2's push unloads the starting weights' adapter (both generations it sampled are drawn);
    // step 1's stays while its sampler is the latest one handed out.
    assert_eq!(adapters, ["holo-policy-1", "holo-policy-2"], "{models:#}");
    let mut folders: Vec<String> = std::fs::read_dir(out.join("sync"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    folders.sort();
    assert_eq!(folders, ["push-1", "push-2"]);
    let _ = std::fs::remove_dir_all(out);
}

/// A push the server silently does not take is caught at the first step, naming the cause.
#[test]
fn a_no_op_sync_stops_the_run_at_the_first_step() {
    let proxy = Proxy::start(serve(), Fault::SwallowLoads);
    let out = scratch("noop");
    let output = train_on(&[&proxy.url], &out, &["--use-peft", "--lora-r", "4"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("weight sync: no-op sync at") && stderr.contains("after step 1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("the server did not take the new weights"),
        "{stderr}"
    );
    assert_eq!(proxy.loads.load(Ordering::SeqCst), 2);
}

/// A server that dies mid-run (at the first step's push): alone, it stops the run once the deadline
/// has passed, naming the server and what the trainer waited for; beside another, it is dropped from
/// the pool and the run goes on on the other, every later push verified there.
#[test]
fn a_server_that_dies_mid_run_stops_it_alone_and_is_dropped_beside_another() {
    let lora = ["--use-peft", "--lora-r", "4"];
    let proxy = Proxy::start(serve(), Fault::KillAtLoad);
    let out = scratch("dead");
    let output = train_on(&[&proxy.url], &out, &lora);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("weight sync: {} is unreachable", proxy.url))
            && stderr.contains("loading step 1's adapter, for 5 s"),
        "{stderr}"
    );

    let proxy = Proxy::start(serve(), Fault::KillAtLoad);
    let other = serve();
    let out = scratch("dead-pool");
    let output = train_on(&[&proxy.url, &other.base], &out, &lora);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "warning: rollout server {} dropped from the pool (1 left)",
            proxy.url
        )),
        "{stderr}"
    );
    let metrics = run_metrics(&out);
    let steps: Vec<&Value> = metrics.iter().filter(|m| m.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 2, "{metrics:#?}");
    for (i, step) in steps.iter().enumerate() {
        assert_eq!(step["sync/servers"], 1.0, "{step:#}");
        assert_eq!(step["sync/weight_version"], (i + 2) as f64, "{step:#}");
        assert!(step["sync/mismatch"].as_f64().unwrap() <= 1e-4, "{step:#}");
    }
}

/// A server dropped from the pool that answers again (restarted, with the base weights) is pushed the
/// current weights at the next step, verified, and samples again from then on.
#[test]
fn a_dropped_server_that_comes_back_rejoins_the_pool() {
    let proxy = Proxy::start(serve(), Fault::RestartAtLoad);
    let other = serve();
    let out = scratch("rejoin");
    let mut args = tiny_grpo("short.hol", &out, 3, &["--use-peft", "--lora-r", "4"]);
    for server in [&proxy.url, &other.base] {
        args.extend(["--vllm-server-base-url".to_string(), server.to_string()]);
    }
    args.extend(["--vllm-server-timeout".to_string(), "5".to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = holo_command(&args).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    for said in [
        format!(
            "rollout server {} dropped from the pool (1 left)",
            proxy.url
        ),
        format!("rollout server {} is back in the pool (2 in it)", proxy.url),
    ] {
        assert!(stderr.contains(&said), "{said}: {stderr}");
    }
    let metrics = run_metrics(&out);
    let servers: Vec<f64> = metrics
        .iter()
        .filter(|m| m.get("loss").is_some())
        .map(|m| m["sync/servers"].as_f64().unwrap())
        .collect();
    assert_eq!(servers, [1.0, 2.0, 2.0], "{metrics:#?}");
    // The restarted server took the adapter at step 2's push.
    let restarted = proxy.served.lock().unwrap();
    let models = reqwest_get(&format!("{}/v1/models", restarted.as_ref().unwrap().base));
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|model| model["id"] == "holo-policy"),
        "{models:#}"
    );
}

/// A server that dies while it samples is dropped from the pool, and the requests it failed are
/// sampled by the other: every rollout of the step is there, none failed.
#[test]
fn rollouts_of_a_server_that_dies_go_to_the_others() {
    let proxy = Proxy::start(serve(), Fault::KillAtRollout);
    let other = serve();
    let out = scratch("requeue");
    let output = train_on(
        &[&proxy.url, &other.base],
        &out,
        &["--use-peft", "--lora-r", "4"],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "warning: rollout server {} dropped from the pool (1 left)",
            proxy.url
        )),
        "{stderr}"
    );
    let records = run_rollouts(&out);
    for step in [1, 2] {
        let of_step: Vec<&Value> = records.iter().filter(|r| r["step"] == step).collect();
        assert_eq!(of_step.len(), 8, "step {step}");
        assert!(of_step.iter().all(|r| r["error"].is_null()), "{of_step:#?}");
    }
    let metrics = run_metrics(&out);
    let last = metrics.iter().rfind(|m| m.get("loss").is_some()).unwrap();
    assert_eq!(last["sync/servers"], 1.0, "{last:#}");
}

fn reqwest_get(url: &str) -> Value {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let response = client
            .get(url)
            .timeout(std::time::Duration::from_secs(60))
            .send()
            .await
            .unwrap();
        serde_json::from_str(&response.text().await.unwrap()).unwrap()
    })
}

/// A LoRA run killed after its second step and resumed on the same server (which still holds its
/// adapter) pushes the restored weights before its next step and goes on verifying.
#[test]
fn a_resumed_run_pushes_its_restored_weights_first() {
    let server = serve();
    let out = scratch("resume");
    let mut args = tiny_grpo(
        "short.hol",
        &out,
        3,
        &["--use-peft", "--lora-r", "4", "--save-steps", "1"],
    );
    args.extend(["--vllm-server-base-url".to_string(), server.base.clone()]);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    let killed = holo_command(&args)
        .env("HOLO_KILL_AT", "checkpoint:renamed@2")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&killed.stderr);
    assert!(
        stderr.contains("HOLO_KILL_AT: killed at checkpoint:renamed"),
        "{stderr}"
    );
    args.push("--resume");
    let output = holo_command(&args).output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metrics = run_metrics(&out);
    let last = metrics.iter().rfind(|m| m.get("loss").is_some()).unwrap();
    assert_eq!(last["step"], 3, "{last:#}");
    // Versions 1 to 3 by the killed run, 4 the resumed run's restored weights, 5 its step 3.
    assert_eq!(last["sync/weight_version"], 5.0, "{last:#}");
    assert!(last["sync/mismatch"].as_f64().unwrap() <= 1e-4, "{last:#}");
}
