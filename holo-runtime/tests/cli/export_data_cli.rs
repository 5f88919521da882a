//! `holo export-data` end to end: rollouts from real runs of `holo train` (the tiny Qwen2's own replies,
//! rewards that differ within a row) and `holo eval` (scripted multi-turn tool use), exported as SFT and
//! DPO files; bad input is reported, not fatal; TRL's trainers train on the files (in the peer venv).

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;

use crate::common::components;
use crate::common::tempdir::Dir;
use crate::common::{holo_command, repo};
use serde_json::Value;

fn fixtures() -> PathBuf {
    repo().join("holo-runtime/tests/fixtures")
}

fn holo(args: &[&str]) -> Output {
    holo_command(args).output().unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A run folder of `holo train` (2 steps, 2 rows x 4 replies of the tiny Qwen2 each), made once for the
/// tests of this file.
fn train_run() -> &'static Path {
    // Statics are never dropped: the folder stays for the whole test binary.
    static RUN: OnceLock<(Dir, PathBuf)> = OnceLock::new();
    &RUN.get_or_init(|| {
        let dir = Dir::new("export-data-train");
        let out = dir.path().join("run");
        let output = holo(&[
            "train",
            fixtures().join("train/short.hol").to_str().unwrap(),
            "--model",
            fixtures().join("models/qwen2").to_str().unwrap(),
            "--data",
            fixtures().join("train/rows.jsonl").to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--max-steps",
            "2",
            "--num-generations",
            "4",
            "--per-device-train-batch-size",
            "8",
            "--max-completion-length",
            "12",
            "--seed",
            "3",
        ]);
        assert!(output.status.success(), "holo train: {}", stderr(&output));
        (dir, out)
    })
    .1
}

/// `holo eval` of hol/tool.hol with tokens: one tool call, then the answer, for two rows (the first one
/// right, reward 1; the second wrong, reward 0), two rollouts each.
fn tool_rollouts() -> &'static Path {
    static ROLLOUTS: OnceLock<(Dir, PathBuf)> = OnceLock::new();
    &ROLLOUTS
        .get_or_init(|| {
            let dir = Dir::new("export-data-tool");
            let data = dir.path().join("rows.jsonl");
            std::fs::write(
                &data,
                "{\"query\": \"What is 17 * 23?\", \"expected\": \"391\"}\n\
             {\"query\": \"What is 17 * 24?\", \"expected\": \"408\"}\n",
            )
            .unwrap();
            let out = dir.path().join("rollouts.jsonl");
            let output = holo(&[
                "eval",
                "hol/tool.hol",
                "--data",
                data.to_str().unwrap(),
                "-n",
                "2",
                "--model",
                fixtures().join("models/qwen2").to_str().unwrap(),
                "--reply",
                "<tool>{\"name\": \"calculator\", \"args\": {\"expression\": \"17 * 23\"}}</tool>",
                "--reply",
                "<answer>391</answer>",
                "--out",
                out.to_str().unwrap(),
            ]);
            assert!(output.status.success(), "holo eval: {}", stderr(&output));
            (dir, out)
        })
        .1
}

/// `holo export-data` of `path` into `out` with `args`; the written lines when it succeeded.
fn export(path: &Path, out: &Path, args: &[&str]) -> (Output, Vec<Value>) {
    let mut all = vec![
        "export-data",
        path.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let output = holo(&all);
    let lines = if output.status.success() {
        records(out)
    } else {
        Vec::new()
    };
    (output, lines)
}

fn roles(messages: &Value) -> Vec<&str> {
    messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect()
}

/// The lines of a JSONL file, as JSON.
fn records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

#[test]
fn sft_keeps_the_top_k_of_each_group_above_min_reward() {
    let run = train_run();
    let rollouts = records(&run.join("rollouts.jsonl"));
    // Rewards of short.hol are at most 0 (a length penalty).
    let min_reward = -0.2;
    // What the filters must keep: per (step, row), at most 2 at or above min_reward.
    let mut expected: std::collections::BTreeMap<(u64, u64), usize> = Default::default();
    for record in &rollouts {
        if record["reward"].as_f64().unwrap() >= min_reward {
            let key = (
                record["step"].as_u64().unwrap(),
                record["row_index"].as_u64().unwrap(),
            );
            let kept = expected.entry(key).or_default();
            *kept = (*kept + 1).min(2);
        }
    }
    let want: usize = expected.values().sum();
    assert!(
        want > 0 && want < rollouts.len(),
        "the run's rewards do not exercise the filters"
    );

    let dir = Dir::new("export-data-sft");
    let out = dir.path().join("sft.jsonl");
    let (output, lines) = export(
        run,
        &out,
        &["--format", "sft", "--min-reward", "-0.2", "--top-k", "2"],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(lines.len(), want);
    for line in &lines {
        assert_eq!(roles(&line["messages"]), ["user", "assistant"], "{line}");
        assert_eq!(
            line.as_object().unwrap().len(),
            1,
            "only `messages`: {line}"
        );
    }
    let report = stderr(&output);
    assert!(
        report.contains(&format!("{} rollouts: 0 failed", rollouts.len())),
        "{report}"
    );
    assert!(
        report.contains(&format!("wrote {want} examples")),
        "{report}"
    );
}

#[test]
fn sft_of_multi_turn_tool_rollouts_keeps_every_turn_and_the_tokens() {
    let dir = Dir::new("export-data-sft-tool");
    let out = dir.path().join("sft.jsonl");
    let (output, lines) = export(
        tool_rollouts(),
        &out,
        &[
            "--format",
            "sft",
            "--min-reward",
            "1",
            "--prompt-completion",
            "--tokens",
        ],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    // The first row's two rollouts answered right; the second row's did not.
    assert_eq!(lines.len(), 2, "{}", stderr(&output));
    let line = &lines[0];
    assert_eq!(roles(&line["prompt"]), ["system", "user"]);
    assert_eq!(
        roles(&line["completion"]),
        ["assistant", "user", "assistant"]
    );
    assert!(line["completion"][1]["content"]
        .as_str()
        .unwrap()
        .contains("391"));
    let ids = line["input_ids"].as_array().unwrap();
    let mask = line["assistant_masks"].as_array().unwrap();
    assert_eq!(ids.len(), mask.len());
    // Two sampled turns: two runs of 1s in the mask, the tool's result between them is 0s.
    let bits: String = mask
        .iter()
        .map(|b| if b == 1 { '1' } else { '0' })
        .collect();
    assert_eq!(
        bits.split('0').filter(|run| !run.is_empty()).count(),
        2,
        "{bits}"
    );
    assert!(
        stderr(&output).contains("2 below --min-reward"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn dpo_pairs_better_and_worse_replies_to_the_same_prompt() {
    let run = train_run();
    let dir = Dir::new("export-data-dpo");
    let out = dir.path().join("dpo.jsonl");
    let (output, lines) = export(
        run,
        &out,
        &["--format", "dpo", "--pairs-per-row", "2", "--tokens"],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(!lines.is_empty());
    let rollouts = records(&run.join("rollouts.jsonl"));
    let reward_of = |reply: &Value| {
        // Replies of one pair come from one group, so the reply text finds its rollout's reward.
        let text = reply[0]["content"].as_str().unwrap();
        rollouts
            .iter()
            .filter(|r| r["contexts"][0]["messages"][1]["parts"][0]["text"] == text)
            .map(|r| r["reward"].as_f64().unwrap())
            .collect::<Vec<_>>()
    };
    for line in &lines {
        assert_eq!(roles(&line["prompt"]), ["user"]);
        let best_chosen = reward_of(&line["chosen"])
            .into_iter()
            .fold(f64::MIN, f64::max);
        let worst_rejected = reward_of(&line["rejected"])
            .into_iter()
            .fold(f64::MAX, f64::min);
        assert!(best_chosen > worst_rejected, "{line}");
        for column in [
            "prompt_ids",
            "chosen_ids",
            "rejected_ids",
            "chosen_loss_mask",
        ] {
            assert!(line[column].is_array(), "{column} missing: {line}");
        }
        assert_eq!(
            line["chosen_ids"].as_array().unwrap().len(),
            line["chosen_loss_mask"].as_array().unwrap().len()
        );
    }
    assert!(
        stderr(&output).contains(&format!("; {} pairs", lines.len())),
        "{}",
        stderr(&output)
    );
}

#[test]
fn bad_lines_are_named_and_skipped() {
    let dir = Dir::new("export-data-bad");
    let text = std::fs::read_to_string(train_run().join("rollouts.jsonl")).unwrap();
    let count = text.lines().count();
    let file = dir.path().join("rollouts.jsonl");
    std::fs::write(&file, format!("{text}{{\"row_index\": oops}}\n[1, 2]\n")).unwrap();
    let (output, lines) = export(&file, &dir.path().join("sft.jsonl"), &["--format", "sft"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(lines.len(), count);
    let report = stderr(&output);
    assert!(
        report.contains(&format!("line {}, column 15", count + 1)),
        "{report}"
    );
    assert!(
        report.contains(&format!("line {}, column", count + 2)),
        "{report}"
    );
    assert!(report.contains("2 lines skipped"), "{report}");
}

#[test]
fn a_missing_file_an_empty_result_and_a_foreign_option_are_clear_errors() {
    let dir = Dir::new("export-data-errors");
    let out = dir.path().join("out.jsonl");
    let (output, _) = export(&dir.path().join("absent.jsonl"), &out, &["--format", "sft"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("absent.jsonl"),
        "{}",
        stderr(&output)
    );

    let (output, _) = export(
        train_run(),
        &out,
        &["--format", "sft", "--min-reward", "1000"],
    );
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("no example left"),
        "{}",
        stderr(&output)
    );
    assert!(!out.exists(), "an empty result writes no file");

    let (output, _) = export(train_run(), &out, &["--format", "dpo", "--top-k", "1"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("--top-k does not apply to --format dpo"),
        "{}",
        stderr(&output)
    );

    // A margin that can pair nothing is a usage error, found before the file is read.
    for margin in ["0", "-1"] {
        let (output, _) = export(
            Path::new("absent.jsonl"),
            &out,
            &["--format", "dpo", "--min-margin", margin],
        );
        assert_eq!(output.status.code(), Some(2), "--min-margin {margin}");
        let report = stderr(&output);
        assert!(report.contains("--min-margin must be above 0"), "{report}");
    }
}

#[test]
fn trl_trains_a_step_on_the_exported_files() {
    let Some(python) = components::peers(&["torch", "transformers", "trl", "datasets"]) else {
        return;
    };
    let dir = Dir::new("export-data-trl");
    let files = [
        ("sft", "sft.jsonl", vec!["--format", "sft", "--top-k", "2"]),
        (
            "sft",
            "sft_tokens.jsonl",
            vec!["--format", "sft", "--top-k", "2", "--tokens"],
        ),
        ("dpo", "dpo.jsonl", vec!["--format", "dpo"]),
        (
            "dpo",
            "dpo_tokens.jsonl",
            vec!["--format", "dpo", "--tokens"],
        ),
    ];
    let mut script_args = vec![
        repo()
            .join("scripts/trl_loads_export.py")
            .to_str()
            .unwrap()
            .to_string(),
        "--model".to_string(),
        fixtures()
            .join("models/qwen2")
            .to_str()
            .unwrap()
            .to_string(),
    ];
    for (trainer, name, args) in &files {
        let out = dir.path().join(name);
        let (output, _) = export(train_run(), &out, args);
        assert!(output.status.success(), "{name}: {}", stderr(&output));
        script_args.push(format!("--{trainer}"));
        script_args.push(out.to_str().unwrap().to_string());
    }
    let tool_sft = dir.path().join("tool_sft.jsonl");
    let (output, _) = export(tool_rollouts(), &tool_sft, &["--format", "sft", "--tokens"]);
    assert!(output.status.success(), "{}", stderr(&output));
    script_args.extend(["--sft".to_string(), tool_sft.to_str().unwrap().to_string()]);

    let output = std::process::Command::new(&python)
        .args(&script_args)
        .current_dir(repo())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        stderr(&output)
    );
    // The trainers also print their logs on stdout; the script's results are the lines naming a file.
    let results: Vec<Value> = stdout
        .lines()
        .filter(|line| line.starts_with("{\"file\""))
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(results.len(), files.len() + 1, "{stdout}");
    for result in &results {
        assert!(result["loss"].as_f64().unwrap().is_finite(), "{result}");
        assert_eq!(result["errors"], serde_json::json!([]), "{result}");
    }
    eprintln!("{stdout}");
}
