//! The guard rails through the real trainer, on `hol/arithmetic.hol` answered by a scripted student
//! (`common/student.rs`) that forces each condition: evaluations that stop improving, a student whose
//! answers collapse once the trained weights have drifted (so that a rollback with a lower learning rate
//! cures it), one that collapses for good, and a learning rate that drives the KL up.

use std::path::Path;

use crate::common::student::{self, Student, RIGHT, WRONG};
use crate::common::tempdir::Dir;
use candle_core::{Device, Var};
use holo_runtime::interpreter::Row;
use holo_runtime::train::config::LrSchedulerType;
use holo_runtime::train::{
    GrpoConfig, Policy, RunOptions, TrainError, TrainSummary, Trainer, TrainingArguments,
    TrainingConfig,
};
use serde_json::{json, Value};

const HALF: f64 = (RIGHT + WRONG) / 2.0;

fn config(steps: i64) -> GrpoConfig {
    GrpoConfig {
        training: TrainingArguments {
            max_steps: steps,
            per_device_train_batch_size: 4,
            learning_rate: 1e-2,
            lr_scheduler_type: LrSchedulerType::Constant,
            save_steps: 1,
            ..GrpoConfig::default().training
        },
        num_generations: 2,
        max_completion_length: 16,
        vllm_importance_sampling_correction: false,
        ..GrpoConfig::default()
    }
}

/// Three rows the student answers right every other time: every group has a spread.
fn rows() -> Vec<(usize, Row)> {
    student::rows(0, &[(3, 1), (3, 2), (3, 3)], json!({}))
}

fn trainer(
    out: &Path,
    config: GrpoConfig,
    resume: bool,
) -> Trainer<holo_runtime::loom::Interpreted> {
    let policy = Policy::load(&student::model_dir(), &Device::Cpu).unwrap();
    let options = RunOptions {
        out: out.to_path_buf(),
        resume,
        progress: false,
    };
    Trainer::new(student::arithmetic(), policy, config, options).unwrap()
}

fn train(
    out: &Path,
    config: GrpoConfig,
    eval_rows: &[(usize, Row)],
    policy: impl Fn(&str, usize) -> bool + Send + Sync + 'static,
) -> Result<TrainSummary, TrainError> {
    let rows = rows();
    let student = Student::new(&[&rows, eval_rows], policy);
    trainer(out, config, false)
        .with_sampler(Box::new(student), Some(2048))
        .train(&rows, eval_rows)
}

fn column(metrics: &[Value], key: &str) -> Vec<f64> {
    metrics
        .iter()
        .map(|m| m[key].as_f64().unwrap_or(f64::NAN))
        .collect()
}

fn checkpoints(out: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(out)
        .unwrap()
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.strip_prefix("checkpoint-")?.parse().ok()
        })
        .collect();
    steps.sort();
    steps
}

fn events(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("rollbacks.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

#[test]
fn early_stopping_ends_the_run_when_eval_reward_stops_improving() {
    // Held-out questions answered right every other time: eval/reward is the same at every evaluation.
    let eval_rows = student::rows(10, &[(7, 1), (7, 2)], json!({}));
    let dir = Dir::new("early");
    let out = dir.path().join("run");
    let config = GrpoConfig {
        eval_steps: Some(1),
        early_stopping_patience: Some(2),
        ..config(8)
    };
    let summary = train(&out, config.clone(), &eval_rows, |_, count| {
        count.is_multiple_of(2)
    })
    .unwrap();
    assert!(summary.stopped_early);
    assert_eq!(
        summary.steps, 3,
        "best at step 1, then two evaluations without a rise"
    );
    let metrics = crate::common::run_metrics(&out);
    assert_eq!(column(&metrics, "eval/reward"), [HALF; 3]);
    assert_eq!(column(&metrics, "guard/evals_since_best"), [0.0, 1.0, 2.0]);
    assert_eq!(checkpoints(&out), [1, 2, 3]);

    // The stopped run stays stopped when resumed.
    let rows = rows();
    let student = Student::new(&[&rows, &eval_rows], |_, _| true);
    let summary = trainer(&out, config, true)
        .with_sampler(Box::new(student), Some(2048))
        .train(&rows, &eval_rows)
        .unwrap();
    assert!(summary.stopped_early);
    assert_eq!(crate::common::run_metrics(&out).len(), 3);

    // Early stopping needs evaluations.
    let error = GrpoConfig {
        early_stopping_patience: Some(2),
        ..GrpoConfig::default()
    }
    .validate()
    .unwrap_err();
    assert_eq!(error.key.as_deref(), Some("early_stopping_patience"));
    assert!(error.message.contains("eval_steps"), "{error}");
}

/// The mean absolute change of `var` since the start.
fn drift(var: &Var, start: &candle_core::Tensor) -> f32 {
    (var.as_tensor() - start)
        .and_then(|d| d.abs())
        .and_then(|d| d.mean_all())
        .and_then(|d| d.to_scalar::<f32>())
        .unwrap()
}

#[test]
fn a_collapse_is_rolled_back_and_the_run_goes_on_with_a_lower_learning_rate() {
    // The student answers every other time right while the final norm's weights are within 0.0185 of
    // their start (mean absolute change), and always wrong past it. At a learning rate of 0.01 that
    // happens at step 4's generation (0.0153 after two updates, 0.0194 after three); the guard trips at
    // step 4, blames the weights of checkpoint 3 and returns to checkpoint 2; at 0.01 × 0.01 the weights
    // barely move and the run ends at step 6 without another trip.
    let dir = Dir::new("rollback");
    let out = dir.path().join("run");
    let config = GrpoConfig {
        rollback_reward_drop: Some(0.3),
        rollback_window: 1,
        rollback_lr_factor: 0.01,
        ..config(6)
    };
    let trainer = trainer(&out, config, false);
    let var = trainer
        .vars()
        .iter()
        .find(|(name, _)| name == "model.norm.weight")
        .unwrap()
        .1
        .clone();
    let start = var.as_tensor().copy().unwrap();
    let rows = rows();
    let student = Student::new(&[&rows], move |_, count| {
        drift(&var, &start) < 0.0185 && count.is_multiple_of(2)
    });
    let summary = trainer
        .with_sampler(Box::new(student), Some(2048))
        .train(&rows, &[])
        .unwrap();
    assert_eq!((summary.steps, summary.rollbacks), (6, 1));

    let metrics = crate::common::run_metrics(&out);
    assert_eq!(metrics.len(), 6, "one line per step: {metrics:?}");
    assert_eq!(column(&metrics, "reward"), [HALF; 6]);
    assert_eq!(
        column(&metrics, "guard/rollbacks"),
        [0., 0., 1., 1., 1., 1.]
    );
    assert_eq!(
        column(&metrics, "guard/lr_factor"),
        [1., 1., 0.01, 0.01, 0.01, 0.01]
    );
    let learning_rates = column(&metrics, "learning_rate");
    assert!(learning_rates[..2].iter().all(|&lr| lr == 1e-2));
    assert!(learning_rates[2..]
        .iter()
        .all(|&lr| (lr - 1e-4).abs() < 1e-12));
    assert_eq!(checkpoints(&out), [0, 1, 2, 3, 4, 5, 6]);

    let events = events(&out);
    assert_eq!(events.len(), 1);
    let event = &events[0];
    assert_eq!(event["rollback"], 1);
    assert_eq!(event["stopped"], false);
    assert_eq!(event["reason"], "rollback_reward_drop");
    assert_eq!(
        (event["step"].as_u64(), event["restored"].as_u64()),
        (Some(4), Some(2))
    );
    let abandoned = event["abandoned"].as_array().unwrap();
    assert_eq!(column(abandoned, "step"), [3.0, 4.0]);
    assert_eq!(column(abandoned, "reward"), [HALF, WRONG]);
    // The abandoned steps' rollouts are gone; the replayed ones are there once each.
    let records = student::records(&out);
    assert_eq!(records.len(), 6 * 4);
    assert_eq!(
        records.iter().filter(|r| r["reward"] == WRONG).count(),
        6 * 2,
        "every step's rollouts right every other time"
    );
}

#[test]
fn a_collapse_that_persists_stops_the_run_after_max_rollbacks() {
    // From its 13th answer on (after three generations of four), the student is always wrong: each
    // rollback replays into the collapse, one step earlier each time.
    let dir = Dir::new("diverged");
    let out = dir.path().join("run");
    let config = GrpoConfig {
        rollback_reward_drop: Some(0.3),
        rollback_window: 1,
        max_rollbacks: 2,
        ..config(6)
    };
    let asked = std::sync::atomic::AtomicUsize::new(0);
    let error = train(&out, config, &[], move |_, count| {
        asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 12 && count.is_multiple_of(2)
    })
    .unwrap_err();
    let TrainError::Diverged(message) = &error else {
        panic!("{error}");
    };
    assert!(message.contains("max_rollbacks"), "{message}");
    let events = events(&out);
    let steps: Vec<(u64, u64, bool)> = events
        .iter()
        .map(|e| {
            (
                e["step"].as_u64().unwrap(),
                e["restored"].as_u64().unwrap(),
                e["stopped"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(steps, [(4, 2, false), (3, 1, false), (2, 0, true)]);
    assert_eq!(column(&events, "lr_factor"), [0.5, 0.25, 0.25]);
    // The run folder is back at the starting weights, the last good checkpoint.
    assert_eq!(checkpoints(&out), [0]);
    assert!(crate::common::run_metrics(&out).is_empty());
}

#[test]
fn a_kl_past_rollback_kl_is_rolled_back() {
    // The student's replies are far from the tiny model's own: the KL to the reference grows fast with
    // the learning rate (3.5 at step 2, 70 at step 3 at 1e-3). A bound of 10 trips at step 3, and the
    // run goes on from checkpoint 1 at 1e-5.
    let dir = Dir::new("kl");
    let out = dir.path().join("run");
    let config = GrpoConfig {
        training: TrainingArguments {
            learning_rate: 1e-3,
            ..(config(5)).training
        },
        beta: 0.04,
        rollback_kl: Some(10.0),
        rollback_lr_factor: 0.01,
        ..config(5)
    };
    let summary = train(&out, config, &[], |_, count| count.is_multiple_of(2)).unwrap();
    assert_eq!((summary.steps, summary.rollbacks), (5, 1));
    let events = events(&out);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["reason"], "rollback_kl");
    assert_eq!(
        (events[0]["step"].as_u64(), events[0]["restored"].as_u64()),
        (Some(3), Some(1))
    );
    assert!(events[0]["value"].as_f64().unwrap() > 10.0);
    let metrics = crate::common::run_metrics(&out);
    assert!(
        column(&metrics, "kl").iter().all(|&kl| kl <= 10.0),
        "{metrics:?}"
    );
    assert_eq!(column(&metrics, "guard/rollbacks"), [0., 1., 1., 1., 1.]);

    // The KL bound needs the reference model.
    let error = GrpoConfig {
        rollback_kl: Some(1.0),
        ..GrpoConfig::default()
    }
    .validate()
    .unwrap_err();
    assert_eq!(error.key.as_deref(), Some("rollback_kl"));
    assert!(error.message.contains("beta"), "{error}");
}
