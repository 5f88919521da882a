//! The memory plan of `holo train` (`holo_runtime::train::plan`): a run that fits writes
//! `memory_plan.json` and trains; one that cannot fit in the stated `memory_limit` is refused before its
//! weights are loaded, naming the option and the largest value of it that fits.

use std::path::{Path, PathBuf};

use crate::common::{holo_command, tiny_train};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("holo-memory-plan-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `holo train` on the committed tiny Qwen2 for one step with micro-batches of `batch` completions.
fn train(out: &Path, batch: usize, extra: &[&str]) -> std::process::Output {
    let mut args = tiny_train("train/short.hol", "train/rows.jsonl", out);
    let batch = batch.to_string();
    args.extend(
        [
            "--max-steps",
            "1",
            "--num-generations",
            "2",
            "--per-device-train-batch-size",
            &batch,
            "--max-completion-length",
            "8",
            "--save-strategy",
            "no",
        ]
        .iter()
        .chain(extra)
        .map(|arg| arg.to_string()),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    holo_command(&args).output().unwrap()
}

fn peak(out: &Path) -> u64 {
    let text = std::fs::read_to_string(out.join("memory_plan.json")).unwrap();
    let plan: serde_json::Value = serde_json::from_str(&text).unwrap();
    // The micro-batch's phases: the head's backward, or a recomputed layer's.
    let phase = plan["peak"]["phase"].as_str().unwrap();
    assert!(["training", "backward"].contains(&phase), "{plan}");
    plan["peak"]["bytes"].as_u64().unwrap()
}

#[test]
fn a_run_that_cannot_fit_is_refused_naming_the_batch_that_fits() {
    let dir = scratch("refuse");
    let fits = dir.join("fits");
    let output = train(&fits, 2, &["--memory-limit", "100"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("memory plan (peak resident memory, by term):"),
        "{stderr}"
    );
    assert!(
        stderr.contains("of 100.0 GiB available (memory_limit)"),
        "{stderr}"
    );
    assert!(fits.join("metrics.jsonl").exists());
    let two = peak(&fits);

    // Exactly the plan of micro-batches of 2: 8 cannot fit, 2 is the largest that does.
    let limit = format!("{}", (two as f64 + 0.5) / (1u64 << 30) as f64);
    let refused = dir.join("refused");
    let output = train(&refused, 8, &["--memory-limit", &limit]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("error: memory plan: `--per-device-train-batch-size 2` fits; 8 needs"),
        "{stderr}"
    );
    assert!(
        stderr.contains("(training: ") || stderr.contains("(backward: "),
        "{stderr}"
    );
    assert!(stderr.contains("memory_check = \"warn\""), "{stderr}");
    // Refused before loading: the plan is there, nothing of a run.
    assert!(peak(&refused) > two);
    assert!(!refused.join("config.toml").exists());
    assert!(!refused.join("metrics.jsonl").exists());

    // Under `memory_check = "warn"` the same run trains.
    let warned = dir.join("warned");
    let output = train(
        &warned,
        8,
        &["--memory-limit", &limit, "--memory-check", "warn"],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: memory plan: `--per-device-train-batch-size 2` fits"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_memory_check_is_refused_with_the_values() {
    let dir = scratch("values");
    let output = train(&dir.join("run"), 2, &["--memory-check", "maybe"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("memory_check"), "{stderr}");
    assert!(stderr.contains("refuse, warn, off"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
