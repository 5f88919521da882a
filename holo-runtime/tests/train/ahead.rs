//! `max_off_policy_steps` (asynchronous GRPO): generations drawn on a thread of their own, by a snapshot
//! of the weights, while earlier ones train. Each generation is sampled by the weights of exactly `k`
//! steps before those that train on it (its records say which), the importance-sampling correction
//! weighs the difference, and the data stream and seeds are those of the synchronous run: its first
//! generation, sampled by the same weights, is the synchronous run's to the token.
#![cfg(feature = "cli")]

use std::path::PathBuf;

use serde_json::Value;

use crate::common::{holo_output, run_metrics, run_rollouts, sampled_versions, tiny_grpo};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("holo-ahead-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn generations_drawn_ahead_are_sampled_by_older_weights_and_corrected() {
    let steps = 4;
    let (sync, ahead) = (scratch("sync"), scratch("k1"));
    for (out, extra) in [
        (&sync, vec![]),
        (&ahead, vec!["--max-off-policy-steps", "1"]),
    ] {
        let output = holo_output(&tiny_grpo("short.hol", out, steps, &extra));
        assert!(
            output.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    let records = run_rollouts(&ahead);
    assert_eq!(records.len(), run_rollouts(&sync).len());
    for record in &records {
        let step = record["step"].as_u64().unwrap();
        // Step s trains on weights after s - 1 steps; its rollouts were sampled one step before.
        let sampled_by = step.saturating_sub(2);
        for version in sampled_versions(record) {
            assert_eq!(version, Some(sampled_by), "step {step}: {record}");
        }
    }
    // The same rows in the same order, and the first generation (the starting weights in both) the
    // same to the token.
    let rows = |records: &[Value]| -> Vec<(u64, u64)> {
        records
            .iter()
            .map(|r| {
                (
                    r["step"].as_u64().unwrap(),
                    r["row_index"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let synchronous = run_rollouts(&sync);
    assert_eq!(rows(&records), rows(&synchronous));
    // Tokens equal; log-probabilities to rounding (the sampler's batches may be composed otherwise).
    let first = |records: &[Value]| -> Vec<(Value, Vec<f64>)> {
        records
            .iter()
            .filter(|r| r["step"] == 1)
            .flat_map(|r| r["contexts"].as_array().unwrap().clone())
            .map(|context| {
                let tokens = &context["tokens"];
                let logprobs = tokens["logprobs"].as_array().unwrap();
                let logprobs = logprobs.iter().map(|l| l.as_f64().unwrap()).collect();
                (tokens["ids"].clone(), logprobs)
            })
            .collect()
    };
    let (drawn_ahead, drawn_now) = (first(&records), first(&synchronous));
    assert_eq!(drawn_ahead.len(), drawn_now.len());
    for ((ids, logprobs), (now_ids, now_logprobs)) in drawn_ahead.iter().zip(&drawn_now) {
        assert_eq!(ids, now_ids);
        for (a, b) in logprobs.iter().zip(now_logprobs) {
            assert!(
                (a - b).abs() <= 1e-4,
                "{logprobs:?} against {now_logprobs:?}"
            );
        }
    }

    let metrics = run_metrics(&ahead);
    let trained: Vec<&Value> = metrics.iter().filter(|m| m.get("loss").is_some()).collect();
    assert_eq!(trained.len(), steps as usize);
    for (index, step) in trained.iter().enumerate() {
        let behind = index.min(1) as f64;
        assert_eq!(step["async/staleness"], behind, "{step:#}");
        assert_eq!(step["async/staleness_max"], behind, "{step:#}");
        // Corrected as a server's rollouts are: TRL's ratio metrics on every step.
        assert!(
            step.get("sampling/importance_sampling_ratio/mean")
                .is_some(),
            "{step:#}"
        );
        let difference = step["sampling/sampling_logp_difference/max"]
            .as_f64()
            .unwrap();
        if index == 0 {
            // A snapshot of the weights that train: the same log-probabilities.
            assert!(difference <= 1e-4, "{step:#}");
        } else {
            // Sampled by the weights of the step before: they moved since.
            assert!(difference > 1e-4, "{step:#}");
        }
    }
    // The synchronous run samples with the weights that train, and corrects nothing.
    for step in run_metrics(&sync)
        .iter()
        .filter(|m| m.get("loss").is_some())
    {
        assert_eq!(step["async/staleness"], 0.0, "{step:#}");
        assert!(step
            .get("sampling/importance_sampling_ratio/mean")
            .is_none());
    }
    for dir in [sync, ahead] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn max_off_policy_steps_is_refused_where_it_cannot_run() {
    let out = scratch("refused");
    for (extra, cause) in [
        (
            vec!["--algorithm", "ppo"],
            "PPO's value model trains on each generation",
        ),
        (
            vec!["--rollback-kl", "1"],
            "a rollback would have to discard",
        ),
    ] {
        let mut options = vec!["--max-off-policy-steps", "2"];
        options.extend(extra.iter().copied());
        let output = holo_output(&tiny_grpo("short.hol", &out, 2, &options));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(
            stderr.contains("max_off_policy_steps") && stderr.contains(cause),
            "{extra:?}: {stderr}"
        );
        assert!(!out.join("metrics.jsonl").exists(), "{extra:?}");
    }
    let _ = std::fs::remove_dir_all(out);
}

/// prime-rl's loss (`loss_type = "dppo"`) trains on generations drawn ahead with its ratio to the
/// sampler's own log-probabilities: the first step's generation was sampled by the weights that train
/// on it (ratios of 1 to rounding, no mismatch), the later ones by the weights of the step before; and
/// TRL's correction options are refused beside it, naming why.
#[test]
fn prime_rl_s_loss_trains_ahead_with_its_ratio_to_the_sampler() {
    let out = scratch("dppo");
    let extra = ["--loss-type", "dppo", "--max-off-policy-steps", "1"];
    let output = holo_output(&tiny_grpo("short.hol", &out, 3, &extra));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metrics = run_metrics(&out);
    let trained: Vec<&Value> = metrics.iter().filter(|m| m.get("loss").is_some()).collect();
    assert_eq!(trained.len(), 3);
    for (index, step) in trained.iter().enumerate() {
        let mismatch = step["dppo/unmasked_mismatch_kl"].as_f64().unwrap();
        if index == 0 {
            assert!(mismatch < 1e-9, "{step:#}");
            assert_eq!(step["dppo/is_masked"], 0.0, "{step:#}");
        } else {
            assert!(mismatch > 1e-9, "{step:#}");
        }
        for key in [
            "dppo/is_masked_high",
            "dppo/is_masked_low",
            "dppo/masked_mismatch_kl",
        ] {
            assert!(step[key].as_f64().is_some(), "{key}: {step:#}");
        }
        assert!(step.get("clip_ratio/region_mean").is_none(), "{step:#}");
    }
    let refused = holo_output(&tiny_grpo(
        "short.hol",
        &out,
        1,
        &["--loss-type", "dppo", "--epsilon", "0.3"],
    ));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(
        stderr.contains("epsilon") && stderr.contains("dppo_mask_low"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(out);
}

/// Without the importance-sampling correction a run drawing ahead still measures how far its sampler
/// was from the weights that train (`sampling/mismatch_kl`, `sampling/sampling_logp_difference/*`),
/// while nothing is corrected (no ratio metrics).
#[test]
fn the_mismatch_is_measured_without_the_correction() {
    let out = scratch("uncorrected");
    let extra = [
        "--max-off-policy-steps",
        "1",
        "--vllm-importance-sampling-correction",
        "false",
    ];
    let output = holo_output(&tiny_grpo("short.hol", &out, 3, &extra));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metrics = run_metrics(&out);
    let trained: Vec<&Value> = metrics.iter().filter(|m| m.get("loss").is_some()).collect();
    assert_eq!(trained.len(), 3);
    for (index, step) in trained.iter().enumerate() {
        let kl = step["sampling/mismatch_kl"].as_f64().unwrap();
        let difference = step["sampling/sampling_logp_difference/max"]
            .as_f64()
            .unwrap();
        if index == 0 {
            assert!(kl < 1e-9 && difference <= 1e-4, "{step:#}");
        } else {
            assert!(kl > 1e-9 && difference > 1e-4, "{step:#}");
        }
        assert!(
            step.get("sampling/importance_sampling_ratio/mean")
                .is_none(),
            "{step:#}"
        );
    }
    let _ = std::fs::remove_dir_all(out);
}
