//! TRL's importance-sampling correction for a sampler whose log-probabilities differ from the trainer's
//! (a server, bf16 sampling): `vllm_importance_sampling_correction` and its mode and bounds.

use std::collections::BTreeMap;

use super::advantages::nanmean;
use super::batch::Completion;
use super::config::GrpoConfig;

/// TRL's importance-sampling correction for a sampler whose log-probabilities differ from the
/// trainer's: `exp(old − sampling)` per token (or summed per completion), clamped or masked to
/// `[clip_min, clip_max]`; and the `sampling/*` metrics.
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
            differences.extend(
                old.iter()
                    .zip(&sampling)
                    .map(|(&old, &sampled)| (old - sampled).abs() as f64)
                    .filter(|difference| !difference.is_nan()),
            );
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
        }
        completion.is_ratio = Some(corrected);
    }
    let fold = |values: &[f64], f: fn(f64, f64) -> f64, empty: f64| {
        values.iter().copied().reduce(f).unwrap_or(empty)
    };
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
        fold(&differences, f64::max, 0.0),
    );
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
}
