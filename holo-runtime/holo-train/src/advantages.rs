//! Rewards → advantages, as TRL's `GRPOTrainer._generate_and_score_completions` computes them.
//!
//! The input is one row per completion (grouped: the `G` completions of a prompt are consecutive) and one
//! column per reward component, `NaN` where a completion has no value for a component. A completion whose
//! components are all missing (or that failed) is *unscorable*: it is left out of every mean and standard
//! deviation, and its advantage is 0.
//!
//! - `sum_then_normalize`: `R_i = Σ_k w_k r_ik` (missing components count 0), then
//!   `A_i = (R_i − mean_group R) / (S + 1e-4)` with `S` the group's standard deviation (`group`), the
//!   batch's (`batch`), or no division (`none`).
//! - `normalize_then_sum`: each component normalized within its group, `(r − mean) / (std + 1e-4)`, the
//!   weighted sum taken, then normalized over the whole batch.
//!
//! Standard deviations are Bessel-corrected (`n − 1`), as `trl.trainer.utils.nanstd`; with fewer than two
//! values it is `NaN`, which makes the advantage `NaN` and so 0.

use std::collections::BTreeMap;

use super::config::{MultiObjectiveAggregation, ScaleRewards};

/// The rewards of a generation batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Rewards {
    /// Component names, one per column.
    pub names: Vec<String>,
    /// Each component's weight.
    pub weights: Vec<f64>,
    /// One row per completion, one value per component; `NaN` where missing.
    pub values: Vec<Vec<f64>>,
}

/// Advantages and the reward metrics TRL logs for them.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub advantages: Vec<f64>,
    /// The weighted total of each completion (`NaN` when unscorable).
    pub totals: Vec<f64>,
    /// `reward`, `reward_std`, `frac_reward_zero_std`, `rewards/<name>/mean`, `rewards/<name>/std`.
    pub metrics: BTreeMap<String, f64>,
}

/// Mean of the values that are not `NaN` (`NaN` when none is).
pub fn nanmean(values: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, count) = values
        .into_iter()
        .filter(|value| !value.is_nan())
        .fold((0.0, 0usize), |(sum, count), value| {
            (sum + value, count + 1)
        });
    if count == 0 {
        f64::NAN
    } else {
        sum / count as f64
    }
}

/// Bessel-corrected standard deviation of the values that are not `NaN` (`NaN` with fewer than two).
pub fn nanstd(values: &[f64]) -> f64 {
    let mean = nanmean(values.iter().copied());
    let count = values.iter().filter(|value| !value.is_nan()).count();
    if count < 2 {
        return f64::NAN;
    }
    let variance = nanmean(values.iter().map(|value| (value - mean).powi(2)));
    (variance * count as f64 / (count - 1) as f64).sqrt()
}

/// Whether a group's rewards differ (DAPO's dynamic sampling keeps only such groups): a standard
/// deviation that is neither `NaN` (fewer than two rewards) nor 0.
pub fn spread(group: &[f64]) -> bool {
    let std = nanstd(group);
    !std.is_nan() && !is_zero(std)
}

/// `torch.isclose(std, 0)`: within the default absolute tolerance.
fn is_zero(std: f64) -> bool {
    std.abs() <= 1e-8
}

/// `torch.nansum(values * weights)`: missing components count for nothing.
fn weighted_nansum(values: &[f64], weights: &[f64]) -> f64 {
    values
        .iter()
        .zip(weights)
        .filter(|(value, _)| !value.is_nan())
        .map(|(value, weight)| value * weight)
        .sum()
}

/// The weighted sum of each row (`nansum`), `NaN` for rows with every component missing.
pub fn weighted_totals(rewards: &Rewards) -> Vec<f64> {
    rewards
        .values
        .iter()
        .map(|row| {
            if row.iter().all(|value| value.is_nan()) {
                return f64::NAN;
            }
            weighted_nansum(row, &rewards.weights)
        })
        .collect()
}

/// Group-relative advantages; `group` is the number of completions per prompt (`values.len()` must be a
/// multiple of it).
pub fn advantages(
    rewards: &Rewards,
    group: usize,
    scale: ScaleRewards,
    aggregation: MultiObjectiveAggregation,
) -> Scored {
    let group = group.max(1);
    let count = rewards.values.len();
    let sizes: Vec<usize> = (0..count)
        .step_by(group)
        .map(|start| group.min(count - start))
        .collect();
    grouped_advantages(rewards, &sizes, scale, aggregation)
}

/// Group-relative advantages over groups of the given `sizes`, in order (they sum to
/// `values.len()`): each completion is normalized within its own group, whatever the others' sizes.
pub fn grouped_advantages(
    rewards: &Rewards,
    sizes: &[usize],
    scale: ScaleRewards,
    aggregation: MultiObjectiveAggregation,
) -> Scored {
    let count = rewards.values.len();
    debug_assert_eq!(sizes.iter().sum::<usize>(), count);
    let ranges: Vec<std::ops::Range<usize>> = sizes
        .iter()
        .scan(0, |start, &size| {
            let range = *start..*start + size;
            *start += size;
            Some(range)
        })
        .collect();
    let totals = weighted_totals(rewards);
    let (advantages, stds) = match aggregation {
        MultiObjectiveAggregation::SumThenNormalize => {
            let means: Vec<f64> = ranges
                .iter()
                .flat_map(|range| {
                    let chunk = &totals[range.clone()];
                    std::iter::repeat_n(nanmean(chunk.iter().copied()), chunk.len())
                })
                .collect();
            let stds: Vec<f64> = match scale {
                ScaleRewards::Group | ScaleRewards::None => ranges
                    .iter()
                    .flat_map(|range| {
                        let chunk = &totals[range.clone()];
                        let std = if chunk.len() > 1 { nanstd(chunk) } else { 0.0 };
                        std::iter::repeat_n(std, chunk.len())
                    })
                    .collect(),
                ScaleRewards::Batch => {
                    let std = if count > 1 { nanstd(&totals) } else { 0.0 };
                    vec![std; count]
                }
            };
            let advantages: Vec<f64> = totals
                .iter()
                .zip(&means)
                .zip(&stds)
                .map(|((total, mean), std)| match scale {
                    ScaleRewards::None => total - mean,
                    _ => (total - mean) / (std + 1e-4),
                })
                .collect();
            (advantages, stds)
        }
        MultiObjectiveAggregation::NormalizeThenSum => {
            let components = rewards.names.len();
            let mut normalized = vec![vec![0.0; components]; count];
            for range in &ranges {
                for (k, _) in rewards.names.iter().enumerate() {
                    let column: Vec<f64> = range.clone().map(|i| rewards.values[i][k]).collect();
                    let mean = nanmean(column.iter().copied());
                    let std = if range.len() > 1 {
                        nanstd(&column)
                    } else {
                        0.0
                    };
                    for (row, value) in normalized[range.clone()].iter_mut().zip(&column) {
                        row[k] = (value - mean) / (std + 1e-4);
                    }
                }
            }
            let summed: Vec<f64> = normalized
                .iter()
                .zip(&rewards.values)
                .map(|(row, raw)| {
                    if raw.iter().all(|value| value.is_nan()) {
                        return f64::NAN;
                    }
                    weighted_nansum(row, &rewards.weights)
                })
                .collect();
            let std = if count > 1 { nanstd(&summed) } else { 0.0 };
            let mean = nanmean(summed.iter().copied());
            let advantages = summed
                .iter()
                .map(|value| (value - mean) / (std + 1e-4))
                .collect();
            (advantages, vec![std; count])
        }
    };
    let advantages: Vec<f64> = advantages
        .into_iter()
        .map(|advantage: f64| if advantage.is_nan() { 0.0 } else { advantage })
        .collect();

    let mut metrics = BTreeMap::new();
    for (k, name) in rewards.names.iter().enumerate() {
        let column: Vec<f64> = rewards.values.iter().map(|row| row[k]).collect();
        metrics.insert(
            format!("rewards/{name}/mean"),
            nanmean(column.iter().copied()),
        );
        metrics.insert(format!("rewards/{name}/std"), nanstd(&column));
    }
    metrics.insert("reward".into(), nanmean(totals.iter().copied()));
    metrics.insert("reward_std".into(), nanstd(&totals));
    let zero = stds.iter().filter(|std| is_zero(**std)).count();
    metrics.insert(
        "frac_reward_zero_std".into(),
        zero as f64 / count.max(1) as f64,
    );
    Scored {
        advantages,
        totals,
        metrics,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewards(values: Vec<Vec<f64>>) -> Rewards {
        let components = values[0].len();
        Rewards {
            names: (0..components).map(|k| format!("r{k}")).collect(),
            weights: vec![1.0; components],
            values,
        }
    }

    #[test]
    fn group_advantages_are_standardized_within_each_group() {
        let scored = advantages(
            &rewards(vec![vec![1.0], vec![0.0], vec![2.0], vec![2.0]]),
            2,
            ScaleRewards::Group,
            MultiObjectiveAggregation::SumThenNormalize,
        );
        let std = (0.5f64).sqrt();
        assert!((scored.advantages[0] - 0.5 / (std + 1e-4)).abs() < 1e-12);
        assert!((scored.advantages[1] + 0.5 / (std + 1e-4)).abs() < 1e-12);
        assert_eq!(&scored.advantages[2..], &[0.0, 0.0]);
        assert_eq!(scored.metrics["frac_reward_zero_std"], 0.5);
    }

    #[test]
    fn groups_of_different_sizes_are_each_standardized_within_themselves() {
        let totals = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0];
        let scored = grouped_advantages(
            &rewards(totals.iter().map(|&total| vec![total]).collect()),
            &[4, 2, 2],
            ScaleRewards::Group,
            MultiObjectiveAggregation::SumThenNormalize,
        );
        // The group of 4: mean 0.5, std √(1/3); the first group of 2 is flat; the second: mean 0.5,
        // std √(1/2).
        let (four, two) = ((1.0f64 / 3.0).sqrt(), (0.5f64).sqrt());
        let expected = [
            0.5 / (four + 1e-4),
            0.5 / (four + 1e-4),
            -0.5 / (four + 1e-4),
            -0.5 / (four + 1e-4),
            0.0,
            0.0,
            -0.5 / (two + 1e-4),
            0.5 / (two + 1e-4),
        ];
        for (got, want) in scored.advantages.iter().zip(expected) {
            assert!((got - want).abs() < 1e-12, "{:?}", scored.advantages);
        }
        assert_eq!(scored.metrics["frac_reward_zero_std"], 0.25);
        // Equal sizes are `advantages`' groups.
        let uniform = grouped_advantages(
            &rewards(totals.iter().map(|&total| vec![total]).collect()),
            &[2, 2, 2, 2],
            ScaleRewards::Group,
            MultiObjectiveAggregation::NormalizeThenSum,
        );
        let chunked = advantages(
            &rewards(totals.iter().map(|&total| vec![total]).collect()),
            2,
            ScaleRewards::Group,
            MultiObjectiveAggregation::NormalizeThenSum,
        );
        assert_eq!(uniform, chunked);
    }

    #[test]
    fn unscorable_completions_are_left_out_and_get_no_advantage() {
        let nan = f64::NAN;
        let scored = advantages(
            &rewards(vec![vec![1.0, nan], vec![nan, nan], vec![0.0, 0.0]]),
            3,
            ScaleRewards::None,
            MultiObjectiveAggregation::SumThenNormalize,
        );
        assert_eq!(scored.advantages, vec![0.5, 0.0, -0.5]);
        assert!(scored.totals[1].is_nan());
        assert_eq!(scored.metrics["reward"], 0.5);
    }
}
