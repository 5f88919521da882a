//! The curriculum and DAPO's dynamic sampling through the real trainer, on `hol/arithmetic.hol` answered
//! by a scripted student: which questions it gets right decides every group's rewards, so which level
//! is served, which groups are dropped and how often the batch is refilled are all known.

use std::collections::BTreeSet;
use std::path::Path;

use crate::common::student::{self, Student, RIGHT, WRONG};
use crate::common::tempdir::Dir;
use candle_core::Device;
use holo_runtime::interpreter::Row;
use holo_runtime::train::{
    GrpoConfig, Policy, RunOptions, TrainError, TrainSummary, Trainer, TrainingArguments,
    TrainingConfig,
};
use serde_json::json;

fn config(steps: i64) -> GrpoConfig {
    GrpoConfig {
        training: TrainingArguments {
            max_steps: steps,
            per_device_train_batch_size: 4,
            learning_rate: 1e-3,
            save_steps: 1,
            seed: 3,
            ..GrpoConfig::default().training
        },
        num_generations: 2,
        max_completion_length: 16,
        vllm_importance_sampling_correction: false,
        ..GrpoConfig::default()
    }
}

fn train(
    out: &Path,
    config: GrpoConfig,
    rows: &[(usize, Row)],
    student: Student,
) -> Result<TrainSummary, TrainError> {
    let policy = Policy::load(&student::model_dir(), &Device::Cpu).unwrap();
    let options = RunOptions {
        out: out.to_path_buf(),
        resume: false,
        progress: false,
    };
    Trainer::new(student::arithmetic(), policy, config, options)?
        .with_sampler(Box::new(student), Some(2048))
        .train(rows, &[])
}

/// The row indices of each step's rollouts.
fn rows_by_step(out: &Path) -> Vec<(u64, BTreeSet<u64>)> {
    let mut steps: Vec<(u64, BTreeSet<u64>)> = Vec::new();
    for record in student::records(out) {
        let (step, row) = (
            record["step"].as_u64().unwrap(),
            record["row_index"].as_u64().unwrap(),
        );
        match steps.last_mut() {
            Some((last, rows)) if *last == step => {
                rows.insert(row);
            }
            _ => steps.push((step, BTreeSet::from([row]))),
        }
    }
    steps
}

#[test]
fn levels_are_served_easiest_first_and_advance_on_the_window_mean() {
    // Difficulty 1: always right (1.2); 5: right every other time (0.7); 10: always wrong (0.2). Written
    // out of order, and 10 sorts after 5 as a number.
    let rows: Vec<(usize, Row)> = [
        student::rows(0, &[(40, 2), (40, 3), (40, 4)], json!({"level": 10})),
        student::rows(3, &[(1, 2), (1, 3), (1, 4)], json!({"level": 1})),
        student::rows(6, &[(5, 2), (5, 3), (5, 4)], json!({"level": 5.0})),
    ]
    .concat();
    let policy = |question: &str, count: usize| {
        if question.contains("is 1+") {
            true
        } else if question.contains("is 5+") {
            count.is_multiple_of(2)
        } else {
            false
        }
    };
    let dir = Dir::new("curriculum");
    let out = dir.path().join("run");
    let config = GrpoConfig {
        difficulty_column: Some("level".into()),
        curriculum_window: 2,
        curriculum_threshold: 0.6,
        curriculum_cumulative: false,
        ..config(4)
    };
    train(&out, config, &rows, Student::new(&[&rows], policy)).unwrap();

    // Each step draws 2 rows of one level: 1 (rows 3-5), passed at once (1.2); 5 (rows 6-8), passed with
    // 0.7; then 10 (rows 0-2), the last level, kept.
    let levels = rows_by_step(&out);
    let within = |rows: &BTreeSet<u64>, range: std::ops::Range<u64>| {
        rows.len() == 2 && rows.iter().all(|row| range.contains(row))
    };
    assert!(within(&levels[0].1, 3..6), "{levels:?}");
    assert!(within(&levels[1].1, 6..9), "{levels:?}");
    assert!(within(&levels[2].1, 0..3), "{levels:?}");
    assert!(within(&levels[3].1, 0..3), "{levels:?}");
    let metrics = crate::common::run_metrics(&out);
    let column = |key: &str| -> Vec<f64> {
        metrics
            .iter()
            .map(|m| m[key].as_f64().unwrap_or(f64::NAN))
            .collect()
    };
    assert_eq!(column("curriculum/level"), [0.0, 1.0, 2.0, 2.0]);
    assert_eq!(column("curriculum/difficulty"), [1.0, 5.0, 10.0, 10.0]);
    assert_eq!(
        column("reward"),
        [RIGHT, (RIGHT + WRONG) / 2.0, WRONG, WRONG]
    );
    let mean = column("curriculum/mean_reward");
    assert!((mean[0] - RIGHT).abs() < 1e-12 && (mean[1] - 0.7).abs() < 1e-12);
    assert!((mean[3] - WRONG).abs() < 1e-12, "{mean:?}");

    // The level and its window are in the checkpoints.
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint-3/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["curriculum"]["level"], 2);
    assert_eq!(state["curriculum"]["position"], 2);
    assert_eq!(state["curriculum"]["window"].as_array().unwrap().len(), 2);
}

#[test]
fn a_bad_difficulty_is_refused_naming_the_row_and_the_column_before_any_work() {
    let mut rows = student::rows(0, &[(1, 2), (1, 3), (2, 2), (2, 3)], json!({"level": 1}));
    rows[2].1.insert("level".into(), json!("hard"));
    let dir = Dir::new("curriculum-bad");
    let out = dir.path().join("run");
    let config = GrpoConfig {
        difficulty_column: Some("level".into()),
        ..config(2)
    };
    let student = Student::new(&[&rows], |_, _| true);
    let error = train(&out, config.clone(), &rows, student).unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("training row 3")
            && message.contains("`level`")
            && message.contains("\"hard\", not a number"),
        "{message}"
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());

    rows[2].1.remove("level");
    let student = Student::new(&[&rows], |_, _| true);
    let message = train(&out, config, &rows, student).unwrap_err().to_string();
    assert!(
        message.contains("training row 3") && message.contains("no such column"),
        "{message}"
    );
}

/// Rows 0-1 always right, 2-3 always wrong, 4-5 right every other time: only 4 and 5 have a spread.
fn mixed_rows() -> Vec<(usize, Row)> {
    student::rows(
        0,
        &[(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)],
        json!({}),
    )
}

fn mixed_policy(question: &str, count: usize) -> bool {
    if question.contains("is 1+") {
        true
    } else if question.contains("is 2+") {
        false
    } else {
        count.is_multiple_of(2)
    }
}

#[test]
fn dynamic_sampling_drops_groups_without_spread_and_refills_the_batch() {
    let rows = mixed_rows();
    let dir = Dir::new("dynamic");
    let out = dir.path().join("run");
    let config = GrpoConfig {
        dynamic_sampling: true,
        ..config(4)
    };
    train(&out, config, &rows, Student::new(&[&rows], mixed_policy)).unwrap();
    let metrics = crate::common::run_metrics(&out);
    let records = student::records(&out);
    for (step, logged) in (1..=4u64).zip(&metrics) {
        // Every step trains on the two groups with a spread, whatever the stream brought first.
        assert_eq!(
            logged["reward"],
            (RIGHT + WRONG) / 2.0,
            "step {step}: {logged}"
        );
        assert_eq!(logged["frac_reward_zero_std"], 0.0, "step {step}");
        assert_eq!(logged["dynamic_sampling/short"], 0.0, "step {step}");
        let groups: Vec<(u64, f64)> = records
            .iter()
            .filter(|r| r["step"] == step && r["rollout_index"] == 0)
            .map(|r| {
                (
                    r["row_index"].as_u64().unwrap(),
                    r["reward"].as_f64().unwrap(),
                )
            })
            .collect();
        let dropped = groups.iter().filter(|(row, _)| *row < 4).count();
        assert_eq!(groups.len() - dropped, 2, "step {step}: {groups:?}");
        assert_eq!(
            logged["dynamic_sampling/dropped"], dropped as f64,
            "step {step}"
        );
        // The mean over every rollout drawn, the dropped groups' included.
        let all: Vec<f64> = records
            .iter()
            .filter(|r| r["step"] == step)
            .map(|r| r["reward"].as_f64().unwrap())
            .collect();
        let mean = all.iter().sum::<f64>() / all.len() as f64;
        let logged_mean = logged["dynamic_sampling/reward"].as_f64().unwrap();
        assert!((logged_mean - mean).abs() < 1e-12, "step {step}");
        assert!(logged["dynamic_sampling/refills"].as_f64().unwrap() >= (dropped > 0) as u8 as f64);
    }
    let dropped: f64 = metrics
        .iter()
        .map(|m| m["dynamic_sampling/dropped"].as_f64().unwrap())
        .sum();
    assert!(
        dropped > 0.0,
        "the stream brought no group to drop: {metrics:?}"
    );
}

/// `curriculum_cumulative` (the default): once a level is passed, the stream runs over its rows and the
/// next level's together, an epoch of them covering each once; without it, over the next level's only.
#[test]
fn a_cumulative_curriculum_keeps_serving_the_levels_passed() {
    let rows: Vec<(usize, Row)> = [
        student::rows(0, &[(1, 1), (1, 2), (1, 3)], json!({"level": 1})),
        student::rows(3, &[(3, 1), (3, 2), (3, 3)], json!({"level": 2})),
    ]
    .concat();
    for cumulative in [true, false] {
        let dir = Dir::new("cumulative");
        let out = dir.path().join("run");
        let config = GrpoConfig {
            difficulty_column: Some("level".into()),
            curriculum_window: 1,
            // Any mean passes: level 2 starts at the second step.
            curriculum_threshold: -1.0,
            curriculum_cumulative: cumulative,
            ..config(4)
        };
        train(&out, config, &rows, Student::new(&[&rows], mixed_policy)).unwrap();
        let steps = rows_by_step(&out);
        assert!(steps[0].1.iter().all(|row| *row < 3), "{steps:?}");
        let later: BTreeSet<u64> = steps[1..4]
            .iter()
            .flat_map(|(_, rows)| rows.clone())
            .collect();
        let expected: BTreeSet<u64> = if cumulative {
            (0..6).collect()
        } else {
            (3..6).collect()
        };
        assert_eq!(later, expected, "cumulative {cumulative}: {steps:?}");
    }
}

#[test]
fn dynamic_sampling_gives_up_after_max_num_gen_batches_and_the_curriculum_counts_dropped_groups() {
    // Level 1 is always right: no group has a spread. After two draws the batch is completed with two
    // of the four dropped groups; all four count for the curriculum, which moves on to level 2.
    let rows: Vec<(usize, Row)> = [
        student::rows(0, &[(1, 1), (1, 2), (1, 3)], json!({"level": 1})),
        student::rows(3, &[(3, 1), (3, 2), (3, 3)], json!({"level": 2})),
    ]
    .concat();
    let dir = Dir::new("dynamic-short");
    let out = dir.path().join("run");
    let config = GrpoConfig {
        dynamic_sampling: true,
        max_num_gen_batches: 2,
        difficulty_column: Some("level".into()),
        curriculum_window: 4,
        curriculum_threshold: 1.0,
        // Level 2 alone at step 2, whose groups all have a spread.
        curriculum_cumulative: false,
        ..config(2)
    };
    train(&out, config, &rows, Student::new(&[&rows], mixed_policy)).unwrap();
    let metrics = crate::common::run_metrics(&out);
    assert_eq!(metrics[0]["dynamic_sampling/dropped"], 4.0);
    assert_eq!(metrics[0]["dynamic_sampling/refills"], 1.0);
    assert_eq!(metrics[0]["dynamic_sampling/short"], 2.0);
    assert_eq!(metrics[0]["reward"], RIGHT);
    assert_eq!(metrics[0]["frac_reward_zero_std"], 1.0);
    assert_eq!(metrics[0]["curriculum/level"], 0.0);
    assert_eq!(metrics[1]["curriculum/level"], 1.0);
    assert_eq!(metrics[1]["dynamic_sampling/dropped"], 0.0);
    assert_eq!(metrics[1]["dynamic_sampling/short"], 0.0);
}

#[test]
fn dynamic_sampling_with_erl_is_refused_naming_the_key() {
    let config = GrpoConfig {
        dynamic_sampling: true,
        erl: true,
        ..config(1)
    };
    let error = config.validate().unwrap_err();
    assert_eq!(error.key.as_deref(), Some("dynamic_sampling"));
}
