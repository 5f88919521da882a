//! `holo sft` end to end on the committed tiny Qwen2: a run interrupted after a checkpoint (a half-written
//! metrics line and an unfinished save left behind, as a killed process leaves them) and resumed writes the
//! same metrics as an uninterrupted one, full and LoRA; the loss goes down; `holo export` reads the run;
//! bad rows and options fail before any work, naming the line and key.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common::tempdir::Dir;
use crate::common::{holo_command, repo, run_metrics as metrics, sft_args};

fn fixtures() -> PathBuf {
    repo().join("holo-runtime/tests/fixtures")
}

fn run(args: &[String]) -> Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    holo_command(&args).output().unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Trains uninterrupted, then makes the folder a run killed after its checkpoint of step 4 leaves (the
/// later checkpoint gone, a later metrics line and half of another written, an unfinished save), and
/// resumes it: the metrics must be the uninterrupted run's.
fn interrupted_and_resumed(extra: &[&str]) {
    let dir = Dir::new("sft-resume");
    let data = fixtures().join("sft/train.jsonl");
    let whole = dir.path().join("whole");
    let output = run(&sft_args(&data, &whole, extra));
    assert!(output.status.success(), "{}", stderr(&output));
    let uninterrupted = metrics(&whole);
    assert_eq!(uninterrupted.len(), 6, "3 epochs of 2 steps");
    let epochs: Vec<f64> = uninterrupted
        .iter()
        .map(|m| m["epoch"].as_f64().unwrap())
        .collect();
    assert_eq!(epochs, [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
    let loss = |m: &serde_json::Value| m["loss"].as_f64().unwrap();
    assert!(
        loss(&uninterrupted[5]) < loss(&uninterrupted[0]),
        "the loss goes down: {uninterrupted:?}"
    );
    for key in [
        "loss",
        "grad_norm",
        "learning_rate",
        "entropy",
        "mean_token_accuracy",
        "num_tokens",
        "epoch",
    ] {
        assert!(uninterrupted[0].get(key).is_some(), "no {key}");
    }

    let interrupted = dir.path().join("interrupted");
    std::fs::create_dir_all(&interrupted).unwrap();
    for entry in std::fs::read_dir(&whole).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        if name == "checkpoint-6" || name == "plots" {
            continue;
        }
        copy(&entry.path(), &interrupted.join(&name));
    }
    let lines = std::fs::read_to_string(whole.join("metrics.jsonl")).unwrap();
    let kept: Vec<&str> = lines.lines().take(5).collect();
    std::fs::write(
        interrupted.join("metrics.jsonl"),
        format!("{}\n{{\"step\":6,\"lo", kept.join("\n")),
    )
    .unwrap();
    std::fs::create_dir_all(interrupted.join(".checkpoint-6-99.tmp")).unwrap();

    let mut resumed = sft_args(&data, &interrupted, extra);
    resumed.push("--resume".into());
    let output = run(&resumed);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(metrics(&interrupted), uninterrupted);
    assert!(!interrupted.join(".checkpoint-6-99.tmp").exists());

    // A resumed run with other options is refused, naming the option.
    let mut changed = sft_args(&data, &interrupted, extra);
    changed.extend(["--resume".into(), "--learning-rate".into(), "1e-3".into()]);
    let output = run(&changed);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("`learning_rate` is 0.001 but the run"),
        "{}",
        stderr(&output)
    );

    // `holo export` makes a model folder of the run (LoRA adapters merged).
    let exported = dir.path().join("exported");
    let output = holo_command(&[
        "export",
        whole.to_str().unwrap(),
        "--out",
        exported.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(exported.join("model.safetensors").is_file());
}

fn copy(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            copy(&entry.path(), &to.join(entry.file_name()));
        }
    } else {
        std::fs::copy(from, to).unwrap();
    }
}

#[test]
fn an_interrupted_run_resumes_to_the_same_metrics() {
    interrupted_and_resumed(&[]);
}

#[test]
fn an_interrupted_lora_run_with_dropout_resumes_to_the_same_metrics() {
    interrupted_and_resumed(&["--use-peft", "--lora-dropout", "0.1", "--lora-r", "4"]);
}

#[test]
fn bad_rows_and_options_fail_before_training_naming_line_and_key() {
    let dir = Dir::new("sft-bad");
    let out = dir.path().join("run");
    let data = dir.path().join("data.jsonl");
    let good = std::fs::read_to_string(fixtures().join("sft/train.jsonl")).unwrap();
    let lines: Vec<&str> = good.lines().collect();
    std::fs::write(
        &data,
        format!(
            "{}\n{}\n{{\"prompt\": [{{\"role\": \"user\", \"content\": \"x\"}}], \"completion\": \"y\"}}\n",
            lines[0], lines[1]
        ),
    )
    .unwrap();
    let output = run(&sft_args(&data, &out, &[]));
    assert_eq!(output.status.code(), Some(2));
    let message = stderr(&output);
    assert!(
        message.contains("data.jsonl` line 3: `prompt` and `completion` must both be lists of messages or both be strings"),
        "{message}"
    );
    assert!(!out.exists(), "nothing is written for bad data");

    std::fs::write(&data, format!("{}\n{{\"messages\": \n", lines[0])).unwrap();
    let message = stderr(&run(&sft_args(&data, &out, &[])));
    assert!(message.contains("line 2, column"), "{message}");

    let data = fixtures().join("sft/train.jsonl");
    for (flag, value, expected) in [
        (
            "--learning-rate",
            "fast",
            "--learning-rate: `learning_rate`",
        ),
        ("--loss-type", "mse", "allowed values: nll, dft"),
        ("--packing", "true", "packing is not supported"),
        ("--num-generations", "4", "unknown option --num-generations"),
    ] {
        let output = run(&sft_args(&data, &out, &[flag, value]));
        assert_eq!(output.status.code(), Some(2), "{flag}");
        let message = stderr(&output);
        assert!(message.contains(expected), "{flag}: {message}");
    }
    let output = run(&sft_args(&data, &out, &["--assistant-only-loss"]));
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("line 1: `assistant_only_loss` needs a chat template"),
        "{}",
        stderr(&output)
    );
    assert!(!out.exists(), "nothing is written for bad options");
}
