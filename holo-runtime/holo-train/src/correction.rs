//! TRL's importance-sampling correction for a sampler whose log-probabilities differ from the trainer's
//! (a server, bf16 sampling): `vllm_importance_sampling_correction` and its mode and bounds; TRL's
//! `sampling/*` metrics of the mismatch, and two of ours: `sampling/mismatch_kl`, the KL divergence from
//! the sampler's distribution to the trainer's estimated on the sampled tokens (`r − 1 − ln r` with
//! `r = p_trainer / p_sampler`, Schulman's k3, never negative), and
//! `sampling/importance_sampling_ratio/corrected_fraction`, the share of ratios (tokens, or completions
//! in the sequence modes) that the bounds clamped or masked.

use std::collections::BTreeMap;

use super::advantages::nanmean;
use super::batch::Completion;
use super::config::GrpoConfig;

/// TRL's importance-sampling correction for a sampler whose log-probabilities differ from the
/// trainer's: `exp(old − sampling)` per token (or summed per completion), clamped or masked to
/// `[clip_min, clip_max]`; and the `sampling/*` metrics (see the module documentation).
pub fn importance_sampling(
    config: &GrpoConfig,
    completions: &mut [Completion],
    metrics: &mut BTreeMap<String, f64>,
) {
    let mode = config.vllm_importance_sampling_mode;
    let (low, high) = (
        config.vllm_importance_sampling_clip_min,
        config.vllm_importance_sampling_clip_max,
    );
    let mut differences = Vec::new();
    let mut ratios = Vec::new();
    let mut divergences = Vec::new();
    let (mut corrected_count, mut counted) = (0usize, 0usize);
    for completion in completions.iter_mut() {
        let sampling = completion.sampling_logprobs();
        let old = completion.old_logprobs.clone().unwrap_or_default();
        // In f32, as TRL computes it.
        let diffs: Vec<f32> = old
            .iter()
            .zip(&sampling)
            .map(|(&old, &sampled)| {
                let diff = (old - sampled) * completion.mask;
                if diff.is_nan() {
                    0.0
                } else {
                    diff
                }
            })
            .collect();
        if completion.mask != 0.0 {
            mismatch_terms(&old, &sampling, &mut divergences, &mut differences);
        }
        let raw: Vec<f64> = if mode.is_sequence() {
            vec![diffs.iter().sum::<f32>().exp() as f64]
        } else {
            diffs.iter().map(|diff| diff.exp() as f64).collect()
        };
        let corrected: Vec<f32> = raw
            .iter()
            .map(|&ratio| {
                let value = if mode.truncates() {
                    let ratio = low.map_or(ratio, |low| ratio.max(low));
                    high.map_or(ratio, |high| ratio.min(high))
                } else if low.is_some_and(|low| ratio < low)
                    || high.is_some_and(|high| ratio > high)
                {
                    0.0
                } else {
                    ratio
                };
                value as f32
            })
            .collect();
        if mode.is_sequence() || completion.mask != 0.0 {
            ratios.extend(corrected.iter().map(|&r| r as f64));
            counted += raw.len();
            corrected_count += raw
                .iter()
                .filter(|&&ratio| {
                    low.is_some_and(|low| ratio < low) || high.is_some_and(|high| ratio > high)
                })
                .count();
        }
        completion.is_ratio = Some(corrected);
    }
    let fold = |values: &[f64], f: fn(f64, f64) -> f64, empty: f64| {
        values.iter().copied().reduce(f).unwrap_or(empty)
    };
    insert_mismatch(metrics, &divergences, &differences);
    metrics.insert(
        "sampling/importance_sampling_ratio/min".into(),
        fold(&ratios, f64::min, 0.0),
    );
    metrics.insert(
        "sampling/importance_sampling_ratio/mean".into(),
        if ratios.is_empty() {
            0.0
        } else {
            nanmean(ratios.iter().copied())
        },
    );
    metrics.insert(
        "sampling/importance_sampling_ratio/max".into(),
        fold(&ratios, f64::max, 0.0),
    );
    metrics.insert(
        "sampling/importance_sampling_ratio/corrected_fraction".into(),
        match counted {
            0 => 0.0,
            n => corrected_count as f64 / n as f64,
        },
    );
}

/// The mismatch metrics alone (`sampling/mismatch_kl`, `sampling/sampling_logp_difference/*`), for a
/// run that does not correct for its sampler: `old` holds the trainer's log-probabilities of each
/// completion's trained tokens, which the completions do not keep (the loss then takes its ratios
/// to the policy as it trains, as without the correction).
pub fn mismatch(completions: &[Completion], old: &[Vec<f32>], metrics: &mut BTreeMap<String, f64>) {
    let (mut divergences, mut differences) = (Vec::new(), Vec::new());
    for (completion, old) in completions.iter().zip(old) {
        if completion.mask != 0.0 {
            let sampling = completion.sampling_logprobs();
            mismatch_terms(old, &sampling, &mut divergences, &mut differences);
        }
    }
    insert_mismatch(metrics, &divergences, &differences);
}

/// Per token with both log-probabilities, the k3 divergence of the sampler's from the trainer's and
/// their absolute difference.
fn mismatch_terms(
    old: &[f32],
    sampling: &[f32],
    divergences: &mut Vec<f64>,
    differences: &mut Vec<f64>,
) {
    for (&old, &sampled) in old.iter().zip(sampling) {
        let log_ratio = (old - sampled) as f64;
        if !log_ratio.is_nan() {
            divergences.push(log_ratio.exp_m1() - log_ratio);
            differences.push(log_ratio.abs());
        }
    }
}

fn insert_mismatch(metrics: &mut BTreeMap<String, f64>, divergences: &[f64], differences: &[f64]) {
    metrics.insert(
        "sampling/sampling_logp_difference/mean".into(),
        if differences.is_empty() {
            0.0
        } else {
            nanmean(differences.iter().copied())
        },
    );
    metrics.insert(
        "sampling/sampling_logp_difference/max".into(),
        differences.iter().copied().reduce(f64::max).unwrap_or(0.0),
    );
    metrics.insert(
        "sampling/mismatch_kl".into(),
        if divergences.is_empty() {
            0.0
        } else {
            divergences.iter().sum::<f64>() / divergences.len() as f64
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Sequence;
    use crate::config::ImportanceSamplingMode;

    fn completion(old: &[f32], sampled: &[f32], mask: f32) -> Completion {
        Completion {
            sequences: vec![Sequence {
                ids: (0..=old.len() as u32).collect(),
                trained: (1..=old.len()).collect(),
                sampling_logprobs: sampled.to_vec(),
                routes: None,
                constraints: Default::default(),
            }],
            advantage: 1.0,
            token_advantages: None,
            mask,
            truncated: false,
            old_logprobs: Some(old.to_vec()),
            ref_logprobs: None,
            is_ratio: None,
            second_loss: false,
        }
    }

    /// The mismatch KL and the share of corrected ratios, by hand: a masked-out completion counts in
    /// neither; per token, log-ratios 0, ln 3 and −ln 4 give k3 values 0, 3 − 1 − ln 3 and
    /// 1/4 − 1 + ln 4, and with bounds [0.5, 2] the last two ratios are corrected.
    #[test]
    fn the_mismatch_metrics_are_the_k3_mean_and_the_corrected_share() {
        let ln3 = 3f32.ln();
        let ln4 = 4f32.ln();
        let mut completions = vec![
            completion(&[-1.0, -1.0 + ln3], &[-1.0, -1.0], 1.0),
            completion(&[-2.0 - ln4], &[-2.0], 1.0),
            completion(&[-9.0], &[-1.0], 0.0),
        ];
        let config = GrpoConfig {
            vllm_importance_sampling_mode: ImportanceSamplingMode::TokenTruncate,
            vllm_importance_sampling_clip_min: Some(0.5),
            vllm_importance_sampling_clip_max: Some(2.0),
            ..GrpoConfig::default()
        };
        let mut metrics = BTreeMap::new();
        importance_sampling(&config, &mut completions, &mut metrics);
        let k3 = |r: f64| r - 1.0 - r.ln();
        let expected = (k3(1.0) + k3(3.0) + k3(0.25)) / 3.0;
        let kl = metrics["sampling/mismatch_kl"];
        assert!((kl - expected).abs() < 1e-6, "{kl} against {expected}");
        let fraction = metrics["sampling/importance_sampling_ratio/corrected_fraction"];
        assert!((fraction - 2.0 / 3.0).abs() < 1e-12, "{fraction}");
        // Clamped to the bounds, as TRL's token_truncate does.
        let ratios = completions[0].is_ratio.as_ref().unwrap();
        assert!((ratios[1] - 2.0).abs() < 1e-6, "{ratios:?}");
    }
}
