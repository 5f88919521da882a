//! The trainer as a library: a rollout source of the caller's, and a sampler that is not the trained
//! model (here a bf16 copy, whose log-probabilities differ from the f32 trainer's), corrected for as TRL
//! corrects vLLM's.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};
use holo_runtime::holotypes;
use holo_runtime::interpreter::{Holoware, Row};
use holo_runtime::local::{LocalModel, LocalOptions};
use holo_runtime::train::{GrpoConfig, Policy, RunOptions, TrainError, Trainer, TrainingArguments};
use holo_runtime::{Resources, Rollout};

fn fixtures() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn rows() -> Vec<(usize, Row)> {
    std::fs::read_to_string(fixtures().join("train/rows.jsonl"))
        .unwrap()
        .lines()
        .enumerate()
        .map(|(i, line)| (i, serde_json::from_str(line).unwrap()))
        .collect()
}

fn trainer(config: GrpoConfig, out: &Path) -> Trainer<impl holo_runtime::loom::RolloutSource> {
    let holoware = Arc::new(
        Holoware::open(
            &fixtures().join("train/short.hol"),
            Arc::new(holotypes::registry()),
        )
        .unwrap(),
    );
    let resources = Resources::default();
    let source = move |row: &Row| -> Result<Box<dyn Rollout + Send>, String> {
        let rollout = holoware
            .start_with(row, &resources)
            .map_err(|error| error.to_string())?;
        Ok(Box::new(rollout))
    };
    let model_dir = fixtures().join("models/qwen2");
    let policy = Policy::load(&model_dir, &Device::Cpu).unwrap();
    let options = RunOptions {
        out: out.to_path_buf(),
        resume: false,
        progress: false,
    };
    let sampler = LocalModel::load(
        &model_dir,
        LocalOptions {
            dtype: DType::BF16,
            ..LocalOptions::default()
        },
    )
    .unwrap();
    Trainer::new(source, policy, config, options)
        .unwrap()
        .with_sampler(Box::new(sampler), Some(2048))
}

fn config() -> GrpoConfig {
    GrpoConfig {
        training: TrainingArguments {
            max_steps: 2,
            per_device_train_batch_size: 8,
            learning_rate: 1e-3,
            ..GrpoConfig::default().training
        },
        num_generations: 4,
        max_completion_length: 8,
        vllm_importance_sampling_mode:
            holo_runtime::train::config::ImportanceSamplingMode::TokenTruncate,
        vllm_importance_sampling_clip_min: Some(0.5),
        vllm_importance_sampling_clip_max: Some(2.0),
        ..GrpoConfig::default()
    }
}

#[test]
fn a_sampler_other_than_the_policy_is_corrected_for() {
    let out = std::env::temp_dir().join(format!("holo-train-library-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let summary = trainer(config(), &out).train(&rows(), &[]).unwrap();
    assert_eq!(summary.steps, 2);
    let metrics = &summary.last;
    let mean = metrics["sampling/importance_sampling_ratio/mean"];
    let difference = metrics["sampling/sampling_logp_difference/mean"];
    // bf16 weights move the log-probabilities a little: ratios near 1, but not all exactly 1.
    assert!((mean - 1.0).abs() < 0.2, "mean ratio {mean}");
    assert!(
        difference > 0.0 && difference < 0.5,
        "difference {difference}"
    );
    assert!(metrics["loss"].is_finite());
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn vespo_refuses_sequence_level_correction() {
    let out = std::env::temp_dir().join(format!("holo-train-vespo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let config = GrpoConfig {
        loss_type: holo_runtime::train::config::LossType::Vespo,
        vllm_importance_sampling_mode:
            holo_runtime::train::config::ImportanceSamplingMode::SequenceMask,
        ..config()
    };
    match trainer(config, &out).train(&rows(), &[]) {
        Err(TrainError::Input(message)) => {
            assert!(
                message.contains("vllm_importance_sampling_mode"),
                "{message}"
            )
        }
        other => panic!("expected a refusal, got {:?}", other.map(|s| s.steps)),
    }
    assert!(!out.join("metrics.jsonl").exists());
}
