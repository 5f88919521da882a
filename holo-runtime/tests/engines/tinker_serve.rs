//! `holo tinker-serve` against the other side's own code: the `tinker` SDK 0.38.0 from PyPI
//! (`tinker_sdk.py`, in the venv `scripts/prepare.sh tinker` makes) trains, samples, checkpoints and
//! restarts against the server on the tiny Qwen2 fixture, and our own `holo train --backend tinker` runs
//! against it (tinker-cookbook's loops: `cookbook.rs`).
#![cfg(feature = "cli")]

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::common::process::Process;
use crate::common::served::Served;
use crate::common::tempdir::Dir;

/// The name the server gives the model.
const MODEL: &str = "holo/tiny-qwen2";

pub(super) fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen2")
}

/// `holo tinker-serve` of the fixture, keeping checkpoints in `store`.
fn serve(store: &Path) -> Served {
    serve_as(store, MODEL)
}

/// [`serve`], the model named `name`.
pub(super) fn serve_as(store: &Path, name: &str) -> Served {
    let model = model_dir();
    let store = store.display().to_string();
    Served::start(&mut crate::common::holo_command(&[
        "tinker-serve",
        model.to_str().unwrap(),
        "--served-model-name",
        name,
        "--store",
        &store,
        "--port",
        "0",
    ]))
}

/// Runs a phase of `tinker_sdk.py` with the SDK's Python against `base`, at most five minutes; its
/// measurements.
fn sdk(python: &Path, phase: &str, base: &str, dir: &Path, before: Option<&Path>) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/engines/tinker_sdk.py");
    let out = dir.join(format!("{phase}.json"));
    let mut command = std::process::Command::new(python);
    command
        .arg(&script)
        .args([phase, base, MODEL])
        .arg(&out)
        .args(before)
        .env(
            "SNAPSHOTS_KEPT",
            holo_runtime::engines::tinker::serve::worker::SNAPSHOTS_KEPT.to_string(),
        )
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .env_remove("TINKER_BASE_URL");
    let mut process = Process::spawn(&mut command, dir.join(format!("{phase}.log")));
    let (status, log) = process.finish(Duration::from_secs(300));
    assert!(status.success(), "tinker_sdk.py {phase} failed:\n{log}");
    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

fn floats(value: &Value) -> Vec<f64> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {value}"))
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

fn close(got: f64, want: f64, tolerance: f64, what: &str) {
    assert!(
        (got - want).abs() <= tolerance * want.abs().max(1.0),
        "{what}: {got} != {want}"
    );
}

/// A refusal the SDK raised: its HTTP status and a message that names the cause.
fn refused(error: &Value, status: u64, says: &str) {
    assert_eq!(error["status"].as_u64(), Some(status), "{error}");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains(says), "{says:?} not in {message}");
}

/// The SDK's whole surface that the cookbook's loops use, and the server's arithmetic checked against
/// itself across paths: the sampler's log-probabilities are the trainer's, each loss is its formula on
/// the wire, a supervised loop lowers its loss, checkpoints restore exactly, and survive a restart.
#[test]
fn the_tinker_sdk_trains_samples_and_restarts() {
    let Some(venv) = crate::common::components::tinker() else {
        return;
    };
    let python = venv.join("bin/python");
    let dir = Dir::new("tinker-serve");
    let store = dir.path().join("store");
    let server = serve(&store);
    let out = sdk(&python, "train", &server.base, dir.path(), None);

    assert_eq!(out["models"], serde_json::json!([MODEL]));
    refused(&out["unknown_base"], 400, "is not served here");
    assert_eq!(out["info"]["lora_rank"], 4);
    assert_eq!(out["info"]["is_lora"], true);

    // Sampling: two samples of six tokens (no stop), each token with its log-probability.
    let samples = out["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 2);
    for sample in samples {
        assert_eq!(sample["tokens"].as_array().unwrap().len(), 6, "{sample}");
        assert_eq!(sample["stop_reason"], "length");
        let logprobs = floats(&sample["logprobs"]);
        assert_eq!(logprobs.len(), 6);
        assert!(
            logprobs.iter().all(|lp| lp.is_finite() && *lp <= 0.0),
            "{logprobs:?}"
        );
    }
    assert_ne!(
        samples[0]["tokens"], samples[1]["tokens"],
        "each sample draws its own seed"
    );
    // Top-3 per position: most likely first, the sampled token's log-probability never above the first;
    // where the sampled token is among them, with its own log-probability.
    let topk = samples[0]["topk"].as_array().unwrap();
    assert_eq!(topk.len(), 6);
    let sampled_pairs = samples[0]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .zip(floats(&samples[0]["logprobs"]));
    for (position, (top, (token, logprob))) in topk.iter().zip(sampled_pairs).enumerate() {
        let top = top.as_array().unwrap();
        assert_eq!(top.len(), 3, "position {position}: {top:?}");
        let values: Vec<f64> = top.iter().map(|pair| pair[1].as_f64().unwrap()).collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "{values:?}");
        assert!(
            logprob <= values[0] + 1e-5,
            "{logprob} above the top {values:?}"
        );
        if let Some(pair) = top.iter().find(|pair| pair[0] == *token) {
            close(
                pair[1].as_f64().unwrap(),
                logprob,
                1e-5,
                "top-k entry of the sampled token",
            );
        }
    }
    let prompt = out["prompt_logprobs"].as_array().unwrap();
    assert_eq!(prompt.len(), 5);
    assert!(prompt[0].is_null());
    assert!(prompt[1..].iter().all(|lp| lp.as_f64().unwrap() < 0.0));
    // compute_logprobs (the cookbook's KL reference): the same values, or only the last two.
    let prompt = floats(&Value::Array(prompt[1..].to_vec()));
    let computed = out["computed"].as_array().unwrap();
    assert!(computed[0].is_null());
    for (got, want) in floats(&Value::Array(computed[1..].to_vec()))
        .iter()
        .zip(&prompt)
    {
        close(*got, *want, 1e-6, "compute_logprobs");
    }
    let last = out["computed_last_2"].as_array().unwrap();
    assert_eq!(last.len(), 5);
    assert!(last[..3].iter().all(Value::is_null), "{last:?}");
    close(
        last[4].as_f64().unwrap(),
        prompt[3],
        1e-6,
        "compute_logprobs(last 2)",
    );

    // The trainer scores the sampled tokens as the sampler did.
    let forward = floats(&out["forward_logprobs"]);
    assert_eq!(forward.len(), 10);
    let sampled = floats(&samples[0]["logprobs"]);
    for (trained, sampled) in forward[4..].iter().zip(&sampled) {
        close(
            *trained,
            *sampled,
            1e-4,
            "forward vs sampler log-probability",
        );
    }
    close(
        out["forward_loss"].as_f64().unwrap(),
        -forward[4..].iter().sum::<f64>(),
        1e-4,
        "cross_entropy loss:sum",
    );

    // Each RL loss on on-policy log-probabilities: the ratio is 1.
    let advantages = floats(&out["advantages"]);
    let rl = &out["rl"];
    for loss in ["importance_sampling", "ppo", "cispo"] {
        let logprobs = floats(&rl[loss]["logprobs"]);
        for (got, want) in logprobs.iter().zip(&forward) {
            close(*got, *want, 1e-5, "forward_backward logprobs");
        }
        let elementwise = floats(&rl[loss]["elementwise"]);
        assert_eq!(elementwise.len(), 10);
        close(
            rl[loss]["loss"].as_f64().unwrap(),
            elementwise.iter().sum(),
            1e-4,
            "loss:sum is the elementwise sum",
        );
    }
    let minus_advantages = -advantages.iter().sum::<f64>();
    close(
        rl["importance_sampling"]["loss"].as_f64().unwrap(),
        minus_advantages,
        1e-4,
        "importance_sampling",
    );
    close(
        rl["ppo"]["loss"].as_f64().unwrap(),
        minus_advantages,
        1e-4,
        "ppo",
    );
    let cispo: f64 = -forward
        .iter()
        .zip(&advantages)
        .map(|(lp, a)| lp * a)
        .sum::<f64>();
    close(rl["cispo"]["loss"].as_f64().unwrap(), cispo, 1e-4, "cispo");
    // DRO off-policy: its loss and each token's as Tinker's documentation computes them (in the
    // script, from the returned log-probabilities), which are the forward's.
    let dro = &out["dro"];
    for (got, want) in floats(&dro["logprobs"]).iter().zip(&forward) {
        close(*got, *want, 1e-5, "dro logprobs");
    }
    let elementwise = floats(&dro["elementwise"]);
    let reference = floats(&dro["reference_elementwise"]);
    assert_eq!((elementwise.len(), reference.len()), (10, 10));
    for (got, want) in elementwise.iter().zip(&reference) {
        close(*got, *want, 1e-4, "dro elementwise_loss");
    }
    close(
        dro["loss"].as_f64().unwrap(),
        dro["reference"].as_f64().unwrap(),
        1e-4,
        "dro loss:sum",
    );
    // The quadratic penalty counted: without it the loss would be −Σ log p·A, CISPO's on-policy value.
    assert!(
        (dro["loss"].as_f64().unwrap() - cispo).abs() > 1e-2,
        "{dro}"
    );
    let grad_norm = out["rl_step"]["grad_norm"].as_f64().unwrap();
    assert!(
        grad_norm.is_finite() && grad_norm > 0.0,
        "{}",
        out["rl_step"]
    );

    // A custom loss restating importance sampling, through the SDK's forward_backward_custom: its
    // loss is the built-in's, and one step from the same adapter leaves the same weights (AdamW's step
    // made to grow with the gradient by its epsilon), which the step moved.
    let custom = &out["custom"];
    let metrics = &custom["metrics"];
    close(
        metrics["loss:sum"].as_f64().unwrap(),
        custom["builtin_loss"].as_f64().unwrap(),
        1e-4,
        "custom loss:sum",
    );
    close(
        metrics["custom:sum"].as_f64().unwrap(),
        metrics["loss:sum"].as_f64().unwrap(),
        1e-6,
        "the custom loss's own metric",
    );
    assert!(metrics["surrogate_loss:sum"].is_f64(), "{metrics}");
    let after = floats(&custom["after"]);
    close(
        after[0],
        after[1],
        1e-5,
        "a custom loss's step against the built-in's",
    );
    let before = custom["before"].as_f64().unwrap();
    assert!((after[0] - before).abs() > 1e-3, "{custom}");

    // Refusals name the cause, with the status the SDK expects.
    refused(&out["unknown_loss"], 400, "`gspo` is not served");
    refused(&out["dro_without_beta"], 400, "`dro` needs `beta`");
    refused(
        &out["unknown_setting"],
        400,
        "`beta` is not a setting of `ppo`",
    );
    refused(
        &out["bad_shape"],
        400,
        "data[0].loss_fn_inputs.weights: shape [9]",
    );
    refused(
        &out["missing_input"],
        400,
        "loss_fn_inputs.weights: not an input of this loss",
    );
    refused(&out["unknown_checkpoint"], 404, "does not exist");
    refused(&out["expired"], 404, "does not exist");

    // Two LoRA runs at once: the second's step moved it, not the first.
    let first = out["forward_loss"].as_f64().unwrap();
    assert!((out["second_moved"].as_f64().unwrap() - first).abs() > 1e-3);
    close(
        out["first_after_second"].as_f64().unwrap(),
        first,
        1e-6,
        "first run untouched",
    );

    // Each checkpoint says what its adapter trains: the unembedding too, the SDK's default.
    fn trains(info: &Value) -> (Option<&str>, Option<u64>, [Option<bool>; 3]) {
        (
            info["base_model"].as_str(),
            info["lora_rank"].as_u64(),
            [
                &info["train_attn"],
                &info["train_mlp"],
                &info["train_unembed"],
            ]
            .map(Value::as_bool),
        )
    }
    let said = out["weights_info"].as_array().unwrap();
    let all = [Some(true), Some(true), Some(true)];
    assert_eq!(trains(&said[0]), (Some(MODEL), Some(4), all));
    let no_mlp = [Some(true), Some(false), Some(true)];
    assert_eq!(trains(&said[1]), (Some(MODEL), Some(2), no_mlp));
    // The head's adapter (on the fixture's tied embeddings) is in the sampler checkpoints under PEFT's
    // names, and the training between them moved it.
    let head = |path: &Value| {
        let checkpoint = path.as_str().unwrap().strip_prefix("tinker://").unwrap();
        let file = store.join(checkpoint).join("adapter.safetensors");
        candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap()
    };
    let (initial, trained) = (
        head(&out["sampler_path"]),
        head(&out["trained_sampler_path"]),
    );
    for part in ["lora_A", "lora_B"] {
        let name = format!("base_model.model.lm_head.{part}.weight");
        let moved = (&initial[&name] - &trained[&name])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(moved > 1e-4, "{name} moved by {moved}");
    }

    // The supervised loop lowers its loss.
    let curve = floats(&out["sl_losses"]);
    let after = out["sl_after"].as_f64().unwrap();
    assert!(after < 0.5 * curve[0], "loss {curve:?} then {after}");

    // Checkpoints restore exactly: into the same client, into a new one with the optimizer's state.
    assert!((out["moved"].as_f64().unwrap() - after).abs() > 1e-3);
    close(out["reloaded"].as_f64().unwrap(), after, 1e-6, "load_state");
    close(
        out["other_loaded"].as_f64().unwrap(),
        after,
        1e-6,
        "from_state_with_optimizer",
    );
    let stepped = floats(&out["stepped"]);
    close(
        stepped[0],
        stepped[1],
        1e-6,
        "a step from the same optimizer state",
    );
    assert_eq!(out["snapshot_sample"], out["trained_sample"]);
    // Snapshots are kept in memory up to a bound: the oldest is dropped, saying why.
    let dropped = out["dropped_snapshot"]["message"].as_str().unwrap();
    assert!(dropped.contains("most recent snapshots"), "{dropped}");
    assert_eq!(out["newest_snapshot_sample"], out["trained_sample"]);

    // A restarted server keeps every checkpoint.
    drop(server);
    let server = serve(&store);
    let before = dir.path().join("train.json");
    let again = sdk(&python, "restart", &server.base, dir.path(), Some(&before));
    close(
        again["restored_loss"].as_f64().unwrap(),
        after,
        1e-6,
        "restored after a restart",
    );
    assert_eq!(again["restored_sample"], out["trained_sample"]);
    let run = out["run_id"].as_str().unwrap();
    let listed: Vec<String> = [
        "sampler_weights/after-sl",
        "sampler_weights/initial",
        "weights/after-sl",
    ]
    .iter()
    .map(|name| format!("tinker://{run}/{name}"))
    .collect();
    assert_eq!(again["listed"], serde_json::json!(listed));
    assert_eq!(
        again["after_delete"],
        serde_json::json!([listed[0], listed[2]])
    );
    refused(&again["deleted_sampler"], 404, "does not exist");
}

/// Our own client against our own server: two steps of `holo train --backend tinker` on the fixtures
/// of `tests/engines/tinker.rs`, checkpointed on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holo_train_runs_against_holo_tinker_serve() {
    train_against_holo_tinker_serve("tinker-serve-train", env!("CARGO_BIN_EXE_holo").into()).await;
}

/// The same run by a `holo` built without candle (`--no-default-features --features cli,train`):
/// `holo train --backend tinker` needs no model in process. The binary is the one `scripts/prepare.sh
/// lean` builds; it refuses `--backend local`, which shows it is that build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holo_without_candle_trains_against_holo_tinker_serve() {
    let Some(holo) = crate::common::components::lean_holo() else {
        return;
    };
    let dir = Dir::new("tinker-serve-lean");
    let refused = std::process::Command::new(&holo)
        .args(["train", "x.hol", "--data", "rows.jsonl", "--model", "m"])
        .arg("--out")
        .arg(dir.path().join("local"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{said}");
    assert!(said.contains("built without the `local` feature"), "{said}");
    train_against_holo_tinker_serve("tinker-serve-lean-train", holo).await;
}

/// The fixtures of `tests/engines/tinker.rs`.
fn tinker_fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tinker")
        .join(name)
        .display()
        .to_string()
}

/// `holo train` of `short.hol` on the fixtures' rows by the binary `holo` with `args`, its run folder
/// `run`, at most five minutes; the metrics of its steps.
async fn holo_train(holo: PathBuf, args: Vec<String>, run: &Path, log: PathBuf) -> Vec<Value> {
    let args = [
        vec!["train".to_string(), tinker_fixture("short.hol")],
        vec!["--data".into(), tinker_fixture("rows.jsonl")],
        vec!["--out".into(), run.display().to_string()],
        args,
    ]
    .concat();
    let (status, output) = tokio::task::spawn_blocking(move || {
        let mut command = std::process::Command::new(holo);
        command
            .args(&args)
            .current_dir(crate::common::repo())
            .env("TINKER_API_KEY", "tml-holo-test");
        let mut process = Process::spawn(&mut command, log);
        process.finish(Duration::from_secs(300))
    })
    .await
    .unwrap();
    assert!(status.success(), "{output}");
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// `holo train --backend tinker`'s arguments against `server` with the configuration `config`.
fn tinker_args(server: &Served, config: &str) -> Vec<String> {
    [
        "--backend",
        "tinker",
        "--base-url",
        &server.base,
        "--model",
        MODEL,
        "--tokenizer",
        model_dir().to_str().unwrap(),
        "--config",
        config,
    ]
    .map(String::from)
    .to_vec()
}

/// Two steps of `holo train --backend tinker` by the binary `holo` against `holo tinker-serve` (this
/// build's), in a folder named after `name`: the metrics of both steps, the sampler's log-probabilities
/// matching the trainer's, the last checkpoint's path on the server.
async fn train_against_holo_tinker_serve(name: &str, holo: PathBuf) {
    let dir = Dir::new(name);
    let server = serve(&dir.path().join("store"));
    let run = dir.path().join("run");
    let args = tinker_args(&server, &tinker_fixture("train.toml"));
    let steps = holo_train(holo, args, &run, dir.path().join("train.log")).await;
    assert_eq!(steps.len(), 2);
    for step in &steps {
        for key in ["reward", "loss", "grad_norm", "learning_rate"] {
            assert!(step[key].as_f64().unwrap().is_finite(), "{key} in {step}");
        }
    }
    // The server scores the sampled tokens as its sampler did.
    let ratio = steps[0]["sampling/importance_sampling_ratio/mean"]
        .as_f64()
        .unwrap();
    assert!((ratio - 1.0).abs() < 1e-3, "{ratio}");
    let saved: Value = serde_json::from_str(
        &std::fs::read_to_string(run.join("checkpoint-2/tinker.json")).unwrap(),
    )
    .unwrap();
    let state = saved.to_string();
    assert!(state.contains("tinker://"), "{state}");
}

/// The same two GRPO steps of `short.hol` by `holo train --backend local` and by `holo train --backend
/// tinker` against `holo tinker-serve`, on the same seed: the server draws what the local sampler draws
/// with each request's seed (`holo` sends it whole, the server having said it takes 63 bits), so the
/// rollouts, rewards and token counts are the same, and the loss, gradient norm and learning rate too,
/// to the precision the two paths' arithmetic allows: the Tinker loss weighs each token by the ratio of
/// the server's log-probability to its sampler's (they differ by up to 5e-6 here), where the local
/// trainer's ratio is exactly 1; and the sums run in other orders. The second step samples the weights
/// each path's first step made, so it checks the optimizer's step too. The local run names the
/// adapters the service trains (the attention and MLP projections and the output head, the SDK's
/// `train_unembed` being on by default; rank 8, alpha 32, no dropout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holo_train_takes_the_same_steps_locally_and_against_holo_tinker_serve() {
    let dir = Dir::new("tinker-serve-parity");
    let server = serve(&dir.path().join("store"));
    let holo = PathBuf::from(env!("CARGO_BIN_EXE_holo"));
    let config = std::fs::read_to_string(tinker_fixture("train.toml")).unwrap();
    let local_config = dir.path().join("local.toml");
    std::fs::write(
        &local_config,
        format!(
            "{config}use_peft = true\nlora_alpha = 32.0\nlora_dropout = 0.0\n\
             lora_target_modules = [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\", \"lm_head\"]\n"
        ),
    )
    .unwrap();
    let local_args = vec![
        "--model".to_string(),
        model_dir().display().to_string(),
        "--config".into(),
        local_config.display().to_string(),
    ];
    let local = holo_train(
        holo.clone(),
        local_args,
        &dir.path().join("local"),
        dir.path().join("local.log"),
    )
    .await;
    let args = tinker_args(&server, &tinker_fixture("train.toml"));
    let tinker = holo_train(
        holo,
        args,
        &dir.path().join("tinker"),
        dir.path().join("tinker.log"),
    )
    .await;

    assert_eq!(local.len(), 2);
    assert_eq!(tinker.len(), 2);
    for (local, tinker) in local.iter().zip(&tinker) {
        // Every metric both paths log but the timings.
        let mut compared = Vec::new();
        for (key, value) in local.as_object().unwrap() {
            let (Some(want), Some(got)) = (value.as_f64(), tinker[key].as_f64()) else {
                continue;
            };
            if key.starts_with("time/") || key == "step_time" {
                continue;
            }
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{key}: {got} through holo tinker-serve, {want} locally"
            );
            compared.push(key.as_str());
        }
        for key in [
            "reward",
            "reward_std",
            "num_tokens",
            "loss",
            "grad_norm",
            "learning_rate",
        ] {
            assert!(compared.contains(&key), "{key} not in both: {compared:?}");
        }
    }
    // Groups whose rewards differ: the loss and gradient are not 0 for want of a signal.
    assert!(
        local[0]["grad_norm"].as_f64().unwrap() > 0.1,
        "{}",
        local[0]
    );
}

/// The server's own answers over HTTP, without the SDK: strict bodies refused naming the field, with
/// FastAPI's `{"detail": …}` and the status the SDK acts on; a request sent again with the same
/// `seq_id` (or the same model to create) gets the first one's future.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_and_replays_over_http() {
    let dir = Dir::new("tinker-serve-http");
    let server = serve(&dir.path().join("store"));
    let http = reqwest::Client::new();
    let base = server.base.clone();
    let post = |path: &str, body: Value| {
        let request = http
            .post(format!("{base}/api/v1/{path}"))
            .header("Content-Type", "application/json")
            .body(serde_json::to_vec(&body).unwrap())
            .timeout(Duration::from_secs(60));
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let bytes = response.bytes().await.unwrap();
            (
                status,
                serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            )
        }
    };
    let refused = |(status, body): (u16, Value), want: u16, says: &str| {
        assert_eq!(status, want, "{body}");
        let detail = body["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(says), "{says:?} not in {body}");
    };

    let session =
        serde_json::json!({"tags": [], "sdk_version": "0.38.0", "type": "create_session"});
    let (status, created) = post("create_session", session.clone()).await;
    assert_eq!(status, 200, "{created}");
    let session_id = created["session_id"].as_str().unwrap().to_string();
    let mut colour = session.clone();
    colour["colour"] = "blue".into();
    refused(
        post("create_session", colour).await,
        400,
        "unknown field `colour`",
    );

    let model = serde_json::json!({
        "session_id": session_id, "model_seq_id": 0, "base_model": MODEL,
        "lora_config": {"rank": 2, "seed": 3}, "type": "create_model",
    });
    let (_, first) = post("create_model", model.clone()).await;
    let (_, again) = post("create_model", model.clone()).await;
    assert_eq!(first["request_id"], again["request_id"], "{first} {again}");
    let model_id = first["model_id"].as_str().unwrap().to_string();
    // The future resolves to the model (each retrieval waits for it, bounded by the server's poll).
    let mut created = Value::Null;
    for _ in 0..10 {
        let (status, body) = post(
            "retrieve_future",
            serde_json::json!({"request_id": first["request_id"]}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        if body["type"] != "try_again" {
            created = body;
            break;
        }
    }
    assert_eq!(created["model_id"], model_id.as_str());
    let mut full = model.clone();
    full.as_object_mut().unwrap().remove("lora_config");
    full["model_seq_id"] = 1.into();
    refused(
        post("create_model", full).await,
        400,
        "full fine-tuning is not served",
    );
    let mut other = model.clone();
    other["base_model"] = "no/such-model".into();
    other["model_seq_id"] = 2.into();
    refused(
        post("create_model", other).await,
        400,
        "base_model: `no/such-model` is not served here",
    );

    let step = |seq: u64, beta1: f64, model_id: &str| {
        serde_json::json!({
            "adam_params": {"learning_rate": 1e-3, "beta1": beta1},
            "model_id": model_id, "seq_id": seq, "type": "optim_step",
        })
    };
    let (_, one) = post("optim_step", step(1, 0.9, &model_id)).await;
    let (_, replay) = post("optim_step", step(1, 0.9, &model_id)).await;
    let (_, two) = post("optim_step", step(2, 0.9, &model_id)).await;
    assert_eq!(one["request_id"], replay["request_id"]);
    assert_ne!(one["request_id"], two["request_id"]);
    refused(
        post("optim_step", step(3, 1.5, &model_id)).await,
        400,
        "adam_params.beta1: 1.5 is not below 1",
    );
    refused(
        post("optim_step", step(1, 0.9, "nobody:train:0")).await,
        404,
        "model_id: no model `nobody:train:0`",
    );

    let raw = |headers: &[(&str, &str)], body: Vec<u8>| {
        let mut request = http
            .post(format!("{base}/api/v1/forward_backward"))
            .header("Content-Type", "application/x-protobuf")
            .body(body)
            .timeout(Duration::from_secs(60));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let bytes = response.bytes().await.unwrap();
            (
                status,
                serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            )
        }
    };
    refused(
        raw(&[("Content-Encoding", "zstd")], vec![1, 2, 3]).await,
        415,
        "Content-Encoding",
    );
    refused(
        raw(&[], vec![0xff, 0xff, 0xff]).await,
        400,
        "not a ForwardBackwardRequest",
    );

    refused(
        post("retrieve_future", serde_json::json!({"request_id": "nope"})).await,
        404,
        "no request `nope`",
    );
    let sample = serde_json::json!({
        "prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 2}, "base_model": MODEL, "topk_prompt_logprobs": 2,
    });
    refused(
        post("asample", sample).await,
        400,
        "topk_prompt_logprobs: not served",
    );
    let outside = serde_json::json!({
        "prompt": {"chunks": [{"tokens": [1, 99999999], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 2}, "base_model": MODEL,
    });
    refused(
        post("asample", outside).await,
        400,
        "prompt.chunks[0]: token 99999999 is outside the vocabulary",
    );
    refused(post("no_such_route", Value::Null).await, 404, "Not Found");
}
