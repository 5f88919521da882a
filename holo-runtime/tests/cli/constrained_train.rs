//! `holo train` on a holoware whose samplers are held to a JSON schema, a regex, a choice and a regex
//! in a fence (`tests/fixtures/train/constrained.hol`), with the random Qwen2 fixture: every reply of every
//! rollout validates, each record names the constrained runs the trainer replayed, and the steps train.
//! A constraint the model cannot compile, written in the holoware or given by a data row, stops `holo
//! train`, `holo eval`, `holo dry` (and, given by a row, `holo compare`) before any rollout. A schema
//! read from a file (`json_schema_file`) holds `holo eval`'s replies. A run resumed from a checkpoint
//! trains its constrained tokens on policy, with ratios of 1.

use std::path::{Path, PathBuf};

use crate::common::{fixture, holo_output, holo_succeeds, run_metrics, tiny_train};
use holo_runtime::loom::RolloutRecord;

/// `dir/bad.hol`: a sampler whose grammar llguidance refuses (an undefined rule), which holoc's checks
/// cannot see.
fn refused_grammar(dir: &Path) -> PathBuf {
    let holoware = dir.join("bad.hol");
    std::fs::write(
        &holoware,
        "<|o_o|>\n<|question|>\n<|@_@:answer grammar=\"start: undefined_rule\"|>\n",
    )
    .unwrap();
    holoware
}

/// `dir/schema.hol`, whose sampler's schema is each row's `schema` column, and `dir/rows.jsonl`: a row
/// whose schema compiles, `between`, then one whose schema llguidance refuses (a remote `$ref`).
fn row_schemas(dir: &Path, between: &str) -> (PathBuf, PathBuf) {
    let holoware = dir.join("schema.hol");
    std::fs::write(
        &holoware,
        "<|o_o|>\n<|question|>\n<|@_@:answer json_schema=schema|>\n",
    )
    .unwrap();
    let data = dir.join("rows.jsonl");
    let rows = [
        r#"{"question": "1+1?", "schema": {"type": "integer"}}"#,
        r#"{"question": "2+2?", "schema": {"$ref": "https://example.com/schema.json"}}"#,
    ];
    std::fs::write(&data, format!("{}{between}{}\n", rows[0], rows[1])).unwrap();
    (holoware, data)
}

/// `holo train` on `train/constrained.hol` into `out` with the budget its tests share (4 completions
/// of up to 48 tokens a row, one batch of 8 a step), then `extra`.
fn constrained_train(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = tiny_train("train/constrained.hol", "train/rows.jsonl", out);
    args.extend(
        [
            "--num-generations",
            "4",
            "--per-device-train-batch-size",
            "8",
            "--max-completion-length",
            "48",
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .map(String::from),
    );
    args
}

#[test]
fn a_constrained_holoware_trains() {
    let run = crate::common::tempdir::Dir::new("constrained-train");
    let out = run.path().join("run");
    let args = constrained_train(&out, &["--max-steps", "2"]);
    holo_succeeds(&args);
    let metrics = run_metrics(&out);
    assert_eq!(metrics.len(), 2);
    assert!(metrics
        .iter()
        .all(|step| step["loss"].as_f64().unwrap().is_finite()));
    let records: Vec<RolloutRecord> = std::fs::read_to_string(out.join("rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert!(!records.is_empty());
    for record in &records {
        assert!(record.error.is_none(), "{:?}", record.error);
        let replies: Vec<&str> = record.contexts[0]
            .messages
            .iter()
            .flat_map(|message| &message.parts)
            .filter(|part| part.sampled)
            .map(|part| part.text.as_str())
            .collect();
        let [plan, bags, sure, total] = replies.as_slice() else {
            panic!("{replies:?}")
        };
        let plan: serde_json::Value = serde_json::from_str(plan).unwrap();
        assert!(["Paris", "Lima", "Oslo"].contains(&plan["city"].as_str().unwrap()));
        assert!(bags.parse::<u8>().is_ok(), "{bags:?}");
        assert!(["yes", "no", "not quite"].contains(sure), "{sure:?}");
        assert!(
            total
                .strip_suffix("</answer>")
                .is_some_and(|digits| digits.parse::<u16>().is_ok()),
            "{total:?}"
        );
        let tokens = record.contexts[0].tokens.as_ref().unwrap();
        assert_eq!(tokens.constraints.len(), 4);
    }
}

/// A constrained run stopped after its first checkpoint and resumed from it (`--resume`, the second
/// checkpoint removed, as a run killed before writing it would leave it). With a generation drawn ahead
/// (`--max-off-policy-steps 1`: the checkpoint keeps it, and the sampler's log-probabilities are
/// corrected for and measured) and a learning rate of 0 (every generation on policy), the resumed step's
/// importance ratios against the sampler are 1 only if its constrained tokens' masks were replayed in
/// training; and the step matches the uninterrupted run's.
#[test]
fn a_resumed_constrained_run_trains_on_policy_with_ratios_of_one() {
    let run = crate::common::tempdir::Dir::new("constrained-resume");
    let out = run.path().join("run");
    let mut args = constrained_train(
        &out,
        &[
            "--max-steps",
            "2",
            "--save-steps",
            "1",
            "--max-off-policy-steps",
            "1",
            "--learning-rate",
            "0",
        ],
    );
    holo_succeeds(&args);
    let whole = run_metrics(&out);
    std::fs::remove_dir_all(out.join("checkpoint-2")).unwrap();
    args.push("--resume".into());
    holo_succeeds(&args);
    let resumed = run_metrics(&out);
    assert_eq!(resumed.len(), 2);
    let step = &resumed[1];
    assert_eq!(step["step"], 2);
    let metric = |name: &str| {
        step[name]
            .as_f64()
            .unwrap_or_else(|| panic!("no {name} in {step}"))
    };
    assert!(metric("sampling/mismatch_kl") < 1e-8, "{step}");
    for bound in ["min", "max"] {
        let ratio = metric(&format!("sampling/importance_sampling_ratio/{bound}"));
        assert!((ratio - 1.0).abs() < 1e-4, "{bound}: {ratio}");
    }
    for name in ["loss", "entropy", "reward", "sampling/mismatch_kl"] {
        let (now, then) = (metric(name), whole[1][name].as_f64().unwrap());
        assert!(
            (now - then).abs() < 1e-6,
            "{name}: {now} resumed, {then} whole"
        );
    }
}

/// A grammar llguidance refuses, which the checker cannot see, stops the run before any rollout, with
/// the tag's place.
#[test]
fn a_grammar_the_sampler_refuses_stops_the_run_before_any_rollout() {
    let run = crate::common::tempdir::Dir::new("constrained-refused");
    let holoware = refused_grammar(run.path());
    let out = run.path().join("run");
    let mut args = tiny_train("train/constrained.hol", "train/rows.jsonl", &out);
    args[1] = holoware.to_str().unwrap().into();
    args.extend(["--max-steps", "1"].map(String::from));
    let output = holo_output(&args);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("bad.hol:3:1") && stderr.contains("undefined_rule"),
        "{stderr}"
    );
    assert!(!out.join("rollouts.jsonl").exists());
}

/// A schema a data row gives (`json_schema=schema`) that llguidance refuses stops `holo train` before
/// any rollout, naming the row and the tag.
#[test]
fn a_row_schema_the_sampler_refuses_stops_the_run_before_any_rollout() {
    let run = crate::common::tempdir::Dir::new("constrained-row-schema");
    let (holoware, data) = row_schemas(run.path(), "\n");
    let out = run.path().join("run");
    let mut args = tiny_train("train/constrained.hol", "train/rows.jsonl", &out);
    args[1] = holoware.to_str().unwrap().into();
    args[5] = data.to_str().unwrap().into();
    args.extend(["--max-steps", "1"].map(String::from));
    let output = holo_output(&args);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--data: data row 2: ") && stderr.contains("schema.hol:3:1: "),
        "{stderr}"
    );
    assert!(!out.join("rollouts.jsonl").exists());
}

/// `holo eval` and `holo dry` with the local model compile the holoware's constraints before any rollout,
/// as `holo train` does: the refused grammar is named at its tag, and no rollout is written.
#[test]
fn eval_and_dry_refuse_a_grammar_the_model_cannot_compile_before_any_rollout() {
    let run = crate::common::tempdir::Dir::new("constrained-refused-eval");
    let holoware = refused_grammar(run.path());
    let out = run.path().join("rollouts.jsonl");
    let local = [
        "--sampler".to_string(),
        "local".into(),
        "--model".into(),
        fixture("models/qwen2"),
        "--data".into(),
        fixture("train/rows.jsonl"),
    ];
    let eval = ["eval".to_string(), holoware.to_str().unwrap().into()]
        .into_iter()
        .chain(local.clone())
        .chain(["--out".to_string(), out.to_str().unwrap().into()]);
    let dry = ["dry".to_string(), holoware.to_str().unwrap().into()]
        .into_iter()
        .chain(local);
    for args in [eval.collect::<Vec<_>>(), dry.collect()] {
        let output = holo_output(&args);
        assert_eq!(output.status.code(), Some(2), "{}", args[0]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("bad.hol:3:1") && stderr.contains("undefined_rule"),
            "{}: {stderr}",
            args[0]
        );
        assert!(output.stdout.is_empty(), "{}", args[0]);
    }
    assert!(!out.exists());
}

/// A schema a data row gives that llguidance refuses stops `holo eval`, `holo dry` and `holo compare`
/// with the local model before any rollout, as it stops `holo train`: the row is named by its file and
/// line, with the tag; the row whose schema compiles is not.
#[test]
fn eval_dry_and_compare_refuse_a_row_schema_the_model_cannot_compile_before_any_rollout() {
    let run = crate::common::tempdir::Dir::new("constrained-row-schema-eval");
    let (holoware, data) = row_schemas(run.path(), "\n\n");
    let (holoware, data) = (holoware.to_str().unwrap(), data.to_str().unwrap());
    let model = fixture("models/qwen2");
    let (rollouts, compared) = (
        run.path().join("rollouts.jsonl"),
        run.path().join("compare"),
    );
    let (rollouts, compared) = (rollouts.to_str().unwrap(), compared.to_str().unwrap());
    let local = ["--sampler", "local", "--model", &model, "--data", data];
    let eval = [&["eval", holoware][..], &local, &["--out", rollouts]].concat();
    let dry = [&["dry", holoware][..], &local].concat();
    let compare = [
        "compare", holoware, &model, &model, "--data", data, "--out", compared,
    ];
    for args in [eval, dry, compare.to_vec()] {
        let args: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
        let output = holo_output(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{}: {stderr}", args[0]);
        // The refused row is the file's third line; the first is not named.
        assert!(
            stderr.contains(&format!("{data}:3: {holoware}:3:1: the sampler's"))
                && stderr.contains("does not compile"),
            "{}: {stderr}",
            args[0]
        );
        assert!(
            !stderr.contains(&format!("{data}:1:")),
            "{}: {stderr}",
            args[0]
        );
        assert!(output.stdout.is_empty(), "{}", args[0]);
    }
    assert!(!Path::new(rollouts).exists());
    assert!(!Path::new(compared).join("a.jsonl").exists());
}

/// `json_schema_file` (`tests/fixtures/train/schema_file.hol`, its schema in `schemas/trip.json` beside
/// it): every reply of the random model, sampled by `holo eval`, validates against the file's schema.
#[test]
fn replies_validate_against_a_schema_read_from_a_file() {
    let run = crate::common::tempdir::Dir::new("constrained-schema-file");
    let out = run.path().join("rollouts.jsonl");
    let args = [
        "eval",
        &fixture("train/schema_file.hol"),
        "--sampler",
        "local",
        "--model",
        &fixture("models/qwen2"),
        "--data",
        &fixture("train/rows.jsonl"),
        "-n",
        "4",
        "--out",
        out.to_str().unwrap(),
    ]
    .map(String::from);
    holo_succeeds(&args);
    let records: Vec<RolloutRecord> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert!(records.len() >= 8, "{}", records.len());
    let mut cities = std::collections::BTreeSet::new();
    for record in &records {
        assert!(record.error.is_none(), "{:?}", record.error);
        let replies: Vec<&str> = record.contexts[0]
            .messages
            .iter()
            .flat_map(|message| &message.parts)
            .filter(|part| part.sampled)
            .map(|part| part.text.as_str())
            .collect();
        let [plan] = replies.as_slice() else {
            panic!("{replies:?}")
        };
        // The schema of schemas/trip.json, checked by hand.
        let plan: serde_json::Value = serde_json::from_str(plan).unwrap();
        let fields = plan.as_object().unwrap();
        assert_eq!(
            fields.keys().collect::<Vec<_>>(),
            ["city", "days", "sights"],
            "{plan}"
        );
        let city = plan["city"].as_str().unwrap();
        assert!(["Paris", "Lima", "Oslo"].contains(&city), "{plan}");
        cities.insert(city.to_string());
        assert!(
            plan["days"]
                .as_u64()
                .is_some_and(|days| (1..=9).contains(&days)),
            "{plan}"
        );
        let sights = plan["sights"].as_array().unwrap();
        assert!(sights.len() <= 2, "{plan}");
        assert!(
            sights
                .iter()
                .all(|sight| ["museum", "park"].contains(&sight.as_str().unwrap())),
            "{plan}"
        );
    }
    // Sampled, not forced: the random model's replies differ.
    assert!(cities.len() > 1, "{cities:?}");
}
