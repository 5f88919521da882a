//! A loss that is not a number: a learning rate so large (1e30) that the first update blows the tiny
//! model's weights up, so that the next step's loss is NaN.
//!
//! The guard rails (holo-train's `guard`) catch it at that step whatever the options: a run without
//! rollback options stops there with an error that names the step, the metric and the likely cause,
//! logging and saving nothing of it; a run with them rolls back to its last good checkpoint and lowers
//! the learning rate, and either trains on from there with finite numbers or, after `max_rollbacks`,
//! stops saying so. Before the guard, such a run trained on, logging `loss: null` and saving NaN
//! checkpoints, and exited 0.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::common::tempdir::Dir;
use crate::support::{checkpoints, each_seed, records, run, train_args};

const LIMIT: Duration = Duration::from_secs(120);

/// The metrics lines of a run folder.
fn metrics(run: &Path) -> Vec<Value> {
    records(&run.join("metrics.jsonl"))
}

/// Whether every metrics line has a finite `loss` and `grad_norm` (JSON writes NaN as `null`).
fn all_finite(lines: &[Value]) -> bool {
    lines.iter().all(|line| {
        ["loss", "grad_norm"]
            .iter()
            .all(|key| line[key].as_f64().is_some_and(f64::is_finite))
    })
}

/// The step a `the run diverged: step N: ` error names.
fn tripped_step(output: &str) -> u64 {
    let at = output
        .find("the run diverged: step ")
        .unwrap_or_else(|| panic!("no divergence named:\n{output}"));
    let rest = &output[at + "the run diverged: step ".len()..];
    rest[..rest.find(':').unwrap()].parse().unwrap()
}

#[test]
fn a_nan_loss_stops_a_run_without_rollback_naming_the_step_and_saving_nothing_of_it() {
    each_seed(&[1, 2, 3], |seed| {
        let dir = Dir::new("chaos-nan");
        let out = dir.join("run");
        let args = train_args(&out, 4, seed, &["--learning-rate", "1e30"]);
        let (code, output) = run(&dir, "nan", &args, LIMIT);
        assert_eq!(
            code, 1,
            "a run whose loss is NaN must not succeed:\n{output}"
        );
        assert!(
            output.contains("loss is NaN, not a finite number: training blew up")
                || output.contains("grad_norm is NaN, not a finite number"),
            "{output}"
        );
        assert!(
            output.contains("Train again with a lower learning_rate")
                && !output.contains("`--resume` continues from the newest"),
            "a resume would blow up again, and the error says what to do instead:\n{output}"
        );
        let step = tripped_step(&output);
        let logged = metrics(&out);
        assert_eq!(logged.len() as u64, step - 1, "{output}");
        assert!(all_finite(&logged), "the steps logged before are intact");
        assert_eq!(
            checkpoints(&out),
            (1..step).collect::<Vec<_>>(),
            "nothing saved of the step"
        );
    });
}

#[test]
fn a_nan_loss_rolls_a_guarded_run_back_and_it_trains_on_or_stops_after_max_rollbacks() {
    each_seed(&[1, 2], |seed| {
        // A reward drop no run of this reward can reach: the run rolls back, and only NaN trips it.
        let guarded = ["--learning-rate", "1e30", "--rollback-reward-drop", "1000"];

        // A factor that brings the learning rate down to 10: one rollback, then finite numbers.
        let dir = Dir::new("chaos-nan-rollback");
        let out = dir.join("run");
        let mut options = guarded.to_vec();
        options.extend(["--rollback-lr-factor", "1e-29"]);
        let (code, output) = run(
            &dir,
            "recovers",
            &train_args(&out, 4, seed, &options),
            LIMIT,
        );
        assert_eq!(code, 0, "{output}");
        assert!(
            output.contains("rollback 1 of 3: step ")
                && output.contains("is NaN, not a finite number")
                && output.contains("restored checkpoint-0"),
            "{output}"
        );
        let events = records(&out.join("rollbacks.jsonl"));
        assert_eq!(events.len(), 1, "{output}");
        assert!(events[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("non_finite_"));
        let logged = metrics(&out);
        assert_eq!(logged.len(), 4);
        assert!(all_finite(&logged), "the steps trained again are finite");

        // The default factor (0.5) leaves it blowing up: three rollbacks, then the run stops.
        let dir = Dir::new("chaos-nan-diverged");
        let out = dir.join("run");
        let (code, output) = run(
            &dir,
            "diverges",
            &train_args(&out, 4, seed, &guarded),
            LIMIT,
        );
        assert_eq!(code, 1, "{output}");
        assert!(
            output.contains(
                "after 3 rollbacks (max_rollbacks); the run folder is back at checkpoint-0"
            ),
            "{output}"
        );
        assert_eq!(records(&out.join("rollbacks.jsonl")).len(), 4);
        assert!(metrics(&out).is_empty(), "cut back to checkpoint-0");
        assert_eq!(checkpoints(&out), [0]);
    });
}
