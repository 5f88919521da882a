//! `holo compare`: two policies on the same rows and seeds. The tiny fixture model against itself gives
//! the same rollouts, so every difference and its interval are zero; a run folder is exported and
//! compared; bad input is refused before any rollout. The statistics themselves are unit-tested in
//! `train::compare`.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common::json::assert_close;
use crate::common::tempdir::Dir;
use crate::common::{fixture, holo_command, tiny_train};
use serde_json::Value;

fn compare(a: &str, b: &str, data: &str, out: &Path) -> Output {
    holo_command(&[
        "compare",
        &fixture("train/short.hol"),
        a,
        b,
        "--data",
        data,
        "-n",
        "2",
        "--seed",
        "3",
        "--resamples",
        "2000",
        "--out",
        out.to_str().unwrap(),
    ])
    .output()
    .unwrap()
}

/// `holo train` on the fixture model for one step into `run`, with `extra` options; a checkpoint-1.
fn train_one_step(run: &Path, extra: &[&str]) {
    let mut args = tiny_train("train/short.hol", "train/rows.jsonl", run);
    args.extend(
        [
            "--max-steps",
            "1",
            "--num-generations",
            "2",
            "--per-device-train-batch-size",
            "4",
            "--max-completion-length",
            "8",
            "--save-steps",
            "1",
        ]
        .iter()
        .chain(extra)
        .map(|arg| arg.to_string()),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = holo_command(&args).output().unwrap();
    assert!(output.status.success(), "{}", text(&output.stderr));
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn records(path: PathBuf) -> Vec<Value> {
    std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()))
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

fn metrics(out: &Path) -> Vec<Value> {
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("compare.json")).unwrap()).unwrap();
    assert_eq!(json["rollouts_per_row"], 2);
    assert_eq!(json["resamples"], 2000);
    json["metrics"].as_array().unwrap().clone()
}

#[test]
fn a_model_against_itself_differs_by_nothing() {
    let dir = Dir::new("compare-same");
    let out = dir.path().join("out");
    let model = fixture("models/qwen2");
    let output = compare(&model, &model, &fixture("train/rows.jsonl"), &out);
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");

    // The same rows, rollout seeds and model: the same rollouts.
    let (a, b) = (records(out.join("a.jsonl")), records(out.join("b.jsonl")));
    assert_eq!(a.len(), 12 * 2);
    let by_rollout = |records: &[Value]| {
        let mut sorted = records.to_vec();
        sorted.sort_by_key(|r| (r["row_index"].as_u64(), r["rollout_index"].as_u64()));
        sorted
    };
    for (a, b) in by_rollout(&a).iter().zip(&by_rollout(&b)) {
        let what = format!("row {} rollout {}", a["row_index"], a["rollout_index"]);
        assert_eq!(
            (
                &a["row_index"],
                &a["rollout_index"],
                &a["seed"],
                &a["reward"]
            ),
            (
                &b["row_index"],
                &b["rollout_index"],
                &b["seed"],
                &b["reward"]
            ),
            "{what}"
        );
        // Log-probabilities may differ by rounding with the sequences that shared a batch.
        assert_close(&a["contexts"], &b["contexts"], &what);
    }

    let metrics = metrics(&out);
    let names: Vec<&str> = metrics
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    // short.hol checks no answer, so there is no pass@k.
    assert_eq!(names, ["reward", "reward/length_penalty"]);
    for metric in &metrics {
        assert_eq!(metric["a"], metric["b"], "{metric}");
        for field in ["difference", "low", "high"] {
            assert_eq!(metric[field].as_f64(), Some(0.0), "{metric}");
        }
        assert_eq!(metric["rows"], 12);
    }
    // The mean reward is the Loom's: that of the records.
    let mean = a.iter().map(|r| r["reward"].as_f64().unwrap()).sum::<f64>() / a.len() as f64;
    assert!((metrics[0]["a"].as_f64().unwrap() - mean).abs() < 1e-9);

    let header = stdout
        .lines()
        .find(|line| line.starts_with("metric"))
        .unwrap_or_else(|| panic!("no table header:\n{stdout}"));
    for column in ["A", "B", "B-A", "95% CI", "rows"] {
        assert!(header.contains(column), "{header}");
    }
    let reward = stdout
        .lines()
        .find(|line| line.starts_with("reward "))
        .unwrap_or_else(|| panic!("no reward line:\n{stdout}"));
    assert!(
        reward.contains("+0.0000") && reward.contains("[+0.0000, +0.0000]"),
        "{reward}"
    );
    let png = std::fs::read(out.join("compare.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}

#[test]
fn a_run_folder_is_exported_and_compared() {
    let dir = Dir::new("compare-run");
    let run = dir.path().join("run");
    train_one_step(&run, &[]);

    let out = dir.path().join("out");
    let output = compare(
        &fixture("models/qwen2"),
        run.to_str().unwrap(),
        &fixture("train/rows.jsonl"),
        &out,
    );
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(out.join("b-model/model.safetensors").is_file());
    assert!(stderr.contains("checkpoint-1"), "{stderr}");
    assert!(stdout.contains("(checkpoint-1)"), "{stdout}");
    for metric in metrics(&out) {
        let (low, difference, high) = (
            metric["low"].as_f64().unwrap(),
            metric["difference"].as_f64().unwrap(),
            metric["high"].as_f64().unwrap(),
        );
        assert!(low <= difference && difference <= high, "{metric}");
    }

    // Its checkpoint folder is compared as the run folder is: exported, then sampled.
    let out = dir.path().join("checkpoint");
    let output = compare(
        &fixture("models/qwen2"),
        run.join("checkpoint-1").to_str().unwrap(),
        &fixture("train/rows.jsonl"),
        &out,
    );
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(out.join("b-model/model.safetensors").is_file());
    assert!(
        stdout.contains(&format!("{} (checkpoint-1)", run.display())),
        "{stdout}"
    );

    // A checkpoint's copy outside its run folder has no run to export from: refused, saying so.
    let loose = dir.path().join("loose");
    std::fs::create_dir_all(&loose).unwrap();
    std::fs::copy(
        run.join("checkpoint-1/trainer_state.json"),
        loose.join("trainer_state.json"),
    )
    .unwrap();
    let output = compare(
        &fixture("models/qwen2"),
        loose.to_str().unwrap(),
        &fixture("train/rows.jsonl"),
        &dir.path().join("refused"),
    );
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("policy B") && stderr.contains("looks like a training checkpoint"),
        "{stderr}"
    );
}

/// A bare PEFT adapter folder (a LoRA run's adapters, in PEFT's layout) is merged into the base model
/// its `base_model_name_or_path` names, or the one `--adapter-base` names, and compares as the run it came
/// from; PEFT settings the merge cannot honour are refused, naming the key.
#[test]
fn a_peft_adapter_folder_is_merged_and_compared() {
    let dir = Dir::new("compare-adapter");
    let run = dir.path().join("run");
    train_one_step(
        &run,
        &[
            "--use-peft",
            "true",
            "--lora-r",
            "4",
            "--learning-rate",
            "0.01",
        ],
    );
    let adapter = dir.path().join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    for file in ["adapter_model.safetensors", "adapter_config.json"] {
        std::fs::copy(run.join("checkpoint-1").join(file), adapter.join(file)).unwrap();
    }

    let out = dir.path().join("out");
    let output = compare(
        run.to_str().unwrap(),
        adapter.to_str().unwrap(),
        &fixture("train/rows.jsonl"),
        &out,
    );
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("policy B: the adapter"), "{stderr}");
    // The same adapters merged the same way: the same weights, so the same rollouts.
    let weights = |policy: &str| std::fs::read(out.join(policy).join("model.safetensors")).unwrap();
    assert!(
        weights("a-model") == weights("b-model"),
        "the merged weights differ"
    );
    for metric in metrics(&out) {
        assert_eq!(metric["difference"].as_f64(), Some(0.0), "{metric}");
    }

    // A base named on the Hub is not local: refused, pointing at --adapter-base, which then works.
    let config_path = adapter.join("adapter_config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["base_model_name_or_path"] = "Qwen/Qwen2.5-0.5B".into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let model = fixture("models/qwen2");
    let output = compare(
        &model,
        adapter.to_str().unwrap(),
        &fixture("train/rows.jsonl"),
        &dir.path().join("hub"),
    );
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("Qwen/Qwen2.5-0.5B") && stderr.contains("--adapter-base"),
        "{stderr}"
    );
    let (holoware, rows) = (fixture("train/short.hol"), fixture("train/rows.jsonl"));
    let with_base = |out: &str| {
        let out = dir.path().join(out);
        holo_command(&[
            "compare",
            &holoware,
            &model,
            adapter.to_str().unwrap(),
            "--adapter-base",
            &model,
            "--data",
            &rows,
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap()
    };
    let output = with_base("based");
    assert!(output.status.success(), "{}", text(&output.stderr));

    // DoRA is not a plain LoRA merge: refused, naming the key.
    config["use_dora"] = true.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let output = with_base("dora");
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("`use_dora` is not supported"), "{stderr}");
}

#[test]
fn bad_input_is_refused_before_any_rollout() {
    let dir = Dir::new("compare-bad");
    let model = fixture("models/qwen2");
    let rows = fixture("train/rows.jsonl");

    let out = dir.path().join("missing-model");
    let output = compare(&model, "no/such/model", &rows, &out);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("policy B") && stderr.contains("no/such/model"),
        "{stderr}"
    );
    assert!(!out.join("a.jsonl").exists());

    let data = dir.path().join("rows.jsonl");
    std::fs::write(&data, "{\"question\": \"1+1?\"}\n{\"prompt\": \"1+1?\"}\n").unwrap();
    let out = dir.path().join("missing-input");
    let output = compare(&model, &model, data.to_str().unwrap(), &out);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("rows.jsonl:2") && stderr.contains("question"),
        "{stderr}"
    );
    assert!(!out.join("a.jsonl").exists());
}
