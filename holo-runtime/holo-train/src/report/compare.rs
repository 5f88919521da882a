//! Two policies on the same rows (`holo compare`): each metric's mean under A and B and the difference
//! B − A with a paired bootstrap 95% interval.
//!
//! Both policies roll out the same rows with the same rollout seeds, so a row is the unit of pairing:
//! [`row_values`] reduces a policy's records to one value per row and metric (the mean total reward and
//! each component's mean over the row's completed rollouts; pass@1 and pass@G with the Loom's unbiased
//! estimator, a failed rollout counting as not passing). [`compare`] pairs the rows that have a value
//! under both policies, and [`paired_bootstrap`] resamples those rows with replacement to put a
//! percentile interval around the mean difference. Resampling rows (not rollouts) keeps the rollouts of
//! a row together, as they share its difficulty.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use plotters::prelude::*;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::plot::{register_font, render, AXIS, FONT, GRID, LINE};
use holo_core::loom::{pass_at_k, passes, RolloutRecord};

/// The mean total reward's metric name.
pub const REWARD: &str = "reward";
/// The default number of bootstrap resamples.
pub const RESAMPLES: usize = 10_000;
/// The interval's coverage.
const COVERAGE: f64 = 0.95;

/// One metric of a [`Comparison`]: means over the paired rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metric {
    /// `reward`, `reward/<component>`, `pass@1` or `pass@G` (with G's value).
    pub name: String,
    pub a: f64,
    pub b: f64,
    /// `b - a`: the mean of the rows' paired differences.
    pub difference: f64,
    /// The percentile bootstrap 95% interval of `difference`.
    pub low: f64,
    pub high: f64,
    /// Rows with a value under both policies.
    pub rows: usize,
}

/// What `holo compare` reports (and writes as `compare.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    pub a: String,
    pub b: String,
    /// Rollouts per row (G).
    pub rollouts_per_row: usize,
    pub resamples: usize,
    /// The bootstrap's seed.
    pub seed: u64,
    pub metrics: Vec<Metric>,
}

/// Each row's value of each metric under one policy: `row index → metric → value`. `per_row` is G, the
/// k of pass@G (only pass@1 when it is 1); pass@k counts `pass_component` as the Loom does
/// ([`passes`]), and is left out without one.
pub fn row_values(
    records: &[RolloutRecord],
    per_row: usize,
    pass_component: Option<&str>,
) -> BTreeMap<usize, BTreeMap<String, f64>> {
    #[derive(Default)]
    struct Row {
        rollouts: usize,
        passed: usize,
        rewards: Vec<f64>,
        components: BTreeMap<String, Vec<f64>>,
    }
    let mut rows: BTreeMap<usize, Row> = BTreeMap::new();
    for record in records {
        let row = rows.entry(record.row_index).or_default();
        row.rollouts += 1;
        if record.error.is_some() {
            continue;
        }
        row.rewards.push(record.reward);
        if passes(record, pass_component) {
            row.passed += 1;
        }
        for (name, value) in &record.rewards {
            row.components.entry(name.clone()).or_default().push(*value);
        }
    }
    let mut ks = Vec::new();
    if pass_component.is_some() {
        ks.push(1);
        if per_row > 1 {
            ks.push(per_row);
        }
    }
    rows.into_iter()
        .map(|(index, row)| {
            let mut values = BTreeMap::new();
            if !row.rewards.is_empty() {
                values.insert(REWARD.to_string(), mean(&row.rewards));
            }
            for (name, component) in &row.components {
                values.insert(format!("{REWARD}/{name}"), mean(component));
            }
            for &k in &ks {
                values.insert(format!("pass@{k}"), pass_at_k(row.rollouts, row.passed, k));
            }
            (index, values)
        })
        .collect()
}

/// Compares the records of policy `a` with those of `b` (the same rows and seeds, `per_row` rollouts
/// each): every metric either has, over the rows that have it under both, with `resamples` bootstrap
/// resamples seeded by `seed`. Metrics come in the order reward, its components, pass@k. An error when
/// no row completed under both.
pub fn compare(
    (a_name, a): (&str, &[RolloutRecord]),
    (b_name, b): (&str, &[RolloutRecord]),
    (per_row, pass_component): (usize, Option<&str>),
    resamples: usize,
    seed: u64,
) -> Result<Comparison, String> {
    let a_rows = row_values(a, per_row, pass_component);
    let b_rows = row_values(b, per_row, pass_component);
    let names: BTreeSet<&String> = a_rows
        .values()
        .chain(b_rows.values())
        .flat_map(BTreeMap::keys)
        .collect();
    // Reward first, then the components, then pass@k in k's order.
    let order = |name: &str| match name.strip_prefix("pass@") {
        Some(k) => (
            2,
            k.parse::<usize>().unwrap_or(usize::MAX),
            name.to_string(),
        ),
        None if name == REWARD => (0, 0, String::new()),
        None => (1, 0, name.to_string()),
    };
    let mut names: Vec<&String> = names.into_iter().collect();
    names.sort_by_key(|name| order(name));
    let mut metrics = Vec::new();
    for name in names {
        let pairs: Vec<(f64, f64)> = a_rows
            .iter()
            .filter_map(|(row, values)| Some((*values.get(name)?, *b_rows.get(row)?.get(name)?)))
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let a_values: Vec<f64> = pairs.iter().map(|p| p.0).collect();
        let b_values: Vec<f64> = pairs.iter().map(|p| p.1).collect();
        let differences: Vec<f64> = pairs.iter().map(|(a, b)| b - a).collect();
        let (low, high) = paired_bootstrap(&differences, resamples, seed);
        metrics.push(Metric {
            name: name.clone(),
            a: mean(&a_values),
            b: mean(&b_values),
            difference: mean(&differences),
            low,
            high,
            rows: pairs.len(),
        });
    }
    if !metrics.iter().any(|metric| metric.name == REWARD) {
        return Err(format!(
            "no row has a completed rollout under both {a_name} and {b_name}: nothing to compare"
        ));
    }
    Ok(Comparison {
        a: a_name.to_string(),
        b: b_name.to_string(),
        rollouts_per_row: per_row,
        resamples,
        seed,
        metrics,
    })
}

/// The percentile bootstrap 95% interval of the mean of `differences` (one per row, not empty):
/// `resamples` times, as many rows drawn with replacement (seeded by `seed`), their mean; the 2.5th and
/// 97.5th percentiles of those means (linear interpolation between order statistics).
pub fn paired_bootstrap(differences: &[f64], resamples: usize, seed: u64) -> (f64, f64) {
    assert!(!differences.is_empty(), "a bootstrap needs a row");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = differences.len();
    let mut means: Vec<f64> = (0..resamples.max(1))
        .map(|_| {
            (0..n)
                .map(|_| differences[rng.random_range(0..n)])
                .sum::<f64>()
                / n as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    let tail = (1.0 - COVERAGE) / 2.0;
    (percentile(&means, tail), percentile(&means, 1.0 - tail))
}

/// The `q` quantile of sorted `values`, interpolating between neighbours.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let position = q * (sorted.len() - 1) as f64;
    let below = position.floor() as usize;
    let above = position.ceil() as usize;
    sorted[below] + (sorted[above] - sorted[below]) * (position - below as f64)
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

impl Comparison {
    /// The table `holo compare` prints: metric, A, B, B − A, its 95% interval and the paired rows.
    pub fn table(&self) -> String {
        let width = self
            .metrics
            .iter()
            .map(|metric| metric.name.len())
            .max()
            .unwrap_or(0)
            .max("metric".len());
        let mut text = format!(
            "A = {}\nB = {}\n{:<width$}  {:>8}  {:>8}  {:>8}  {:>20}  {:>5}\n",
            self.a, self.b, "metric", "A", "B", "B-A", "95% CI", "rows"
        );
        for metric in &self.metrics {
            let interval = format!("[{:+.4}, {:+.4}]", metric.low, metric.high);
            text.push_str(&format!(
                "{:<width$}  {:>8.4}  {:>8.4}  {:>+8.4}  {:>20}  {:>5}\n",
                metric.name, metric.a, metric.b, metric.difference, interval, metric.rows
            ));
        }
        text.push_str(&format!(
            "(B-A: mean paired difference over rows; 95% CI: paired bootstrap over rows, {} resamples, seed {})\n",
            self.resamples, self.seed
        ));
        text
    }

    /// Draws each metric's difference B − A with its 95% interval, and the zero line, as a PNG.
    pub fn plot(&self, path: &Path) -> Result<(), String> {
        register_font()?;
        let count = self.metrics.len();
        let (low, high) = self
            .metrics
            .iter()
            .flat_map(|metric| [metric.low, metric.high, 0.0])
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(low, high), v| {
                (low.min(v), high.max(v))
            });
        let pad = if high > low { (high - low) * 0.1 } else { 1.0 };
        let names: Vec<&str> = self.metrics.iter().map(|m| m.name.as_str()).collect();
        let width = (160 * count as u32).max(640);
        render(path, (width, 520), |root| {
            root.fill(&WHITE)?;
            let mut chart = ChartBuilder::on(root)
                .caption("B - A with paired bootstrap 95% intervals", (FONT, 22))
                .margin(14)
                .x_label_area_size(44)
                .y_label_area_size(78)
                .build_cartesian_2d(-0.5..count as f64 - 0.5, (low - pad)..(high + pad))?;
            let label = |x: &f64| {
                let index = x.round();
                if (x - index).abs() < 1e-6 && index >= 0.0 {
                    names
                        .get(index as usize)
                        .map_or(String::new(), |n| n.to_string())
                } else {
                    String::new()
                }
            };
            chart
                .configure_mesh()
                .light_line_style(WHITE)
                .bold_line_style(GRID)
                .axis_style(AXIS)
                .x_labels(count * 2 + 1)
                .x_label_formatter(&label)
                .y_desc("B - A")
                .label_style((FONT, 14).into_font().color(&AXIS))
                .axis_desc_style((FONT, 15).into_font().color(&AXIS))
                .draw()?;
            chart.draw_series(LineSeries::new(
                [(-0.5, 0.0), (count as f64 - 0.5, 0.0)],
                AXIS.stroke_width(1),
            ))?;
            chart.draw_series(self.metrics.iter().enumerate().map(|(i, metric)| {
                ErrorBar::new_vertical(
                    i as f64,
                    metric.low,
                    metric.difference,
                    metric.high,
                    LINE.stroke_width(2),
                    16,
                )
            }))?;
            chart.draw_series(
                self.metrics.iter().enumerate().map(|(i, metric)| {
                    Circle::new((i as f64, metric.difference), 5, LINE.filled())
                }),
            )?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_constant_difference_has_a_point_interval() {
        assert_eq!(paired_bootstrap(&[0.25; 7], 500, 3), (0.25, 0.25));
        assert_eq!(paired_bootstrap(&[0.0; 7], 500, 3), (0.0, 0.0));
    }

    #[test]
    fn two_rows_span_their_values() {
        // Resampled means of {0, 1}: 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4; the 2.5th and 97.5th
        // percentiles fall in the end groups.
        assert_eq!(paired_bootstrap(&[0.0, 1.0], 10_000, 1), (0.0, 1.0));
    }

    #[test]
    fn the_interval_matches_the_normal_approximation() {
        // 0..100: mean 49.5, standard error sqrt((100² - 1) / 12) / 10 = 2.8866; ±1.96 of it.
        let differences: Vec<f64> = (0..100).map(f64::from).collect();
        let (low, high) = paired_bootstrap(&differences, RESAMPLES, 11);
        let half = 1.96 * 2.8866;
        assert!((low - (49.5 - half)).abs() < 0.4, "{low}");
        assert!((high - (49.5 + half)).abs() < 0.4, "{high}");
    }

    #[test]
    fn the_interval_is_deterministic_for_a_seed() {
        let differences = [0.1, -0.4, 0.9, 0.3, 0.0, 0.5];
        let first = paired_bootstrap(&differences, 2_000, 9);
        assert_eq!(first, paired_bootstrap(&differences, 2_000, 9));
        assert_ne!(first, paired_bootstrap(&differences, 2_000, 10));
    }

    fn record(row_index: usize, rollout_index: usize, reward: f64, failed: bool) -> RolloutRecord {
        let json = serde_json::json!({
            "row_index": row_index,
            "rollout_index": rollout_index,
            "seed": 0,
            "row": {},
            "contexts": [],
            // `right`, the correctness component pass@k counts: 1 for any positive reward.
            "rewards": if failed { serde_json::json!({}) } else { serde_json::json!({"len": reward, "right": if reward > 0.0 { 1.0 } else { 0.0 }}) },
            "weights": {"len": 1.0},
            "reward": if failed { 0.0 } else { reward },
            "samples": 1,
            "error": if failed { serde_json::json!({"stage": "sampler", "message": "down"}) } else { serde_json::Value::Null },
        });
        serde_json::from_value(json).expect("a record")
    }

    fn record_failed(done: &RolloutRecord) -> RolloutRecord {
        record(done.row_index, done.rollout_index, 0.0, true)
    }

    /// Rows 0..10 with G = 2 rollouts each, rewards from `reward(row, rollout)`.
    fn policy(reward: impl Fn(usize, usize) -> f64) -> Vec<RolloutRecord> {
        (0..10)
            .flat_map(|row| (0..2).map(move |k| (row, k)))
            .map(|(row, k)| record(row, k, reward(row, k), false))
            .collect()
    }

    fn metric<'a>(comparison: &'a Comparison, name: &str) -> &'a Metric {
        comparison
            .metrics
            .iter()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("no metric {name}: {comparison:?}"))
    }

    #[test]
    fn row_values_follow_the_loom_summary() {
        let records = vec![
            record(0, 0, 1.0, false),
            record(0, 1, 0.0, false),
            record(0, 2, 0.5, true),
            record(1, 0, 0.0, true),
        ];
        let rows = row_values(&records, 3, Some("right"));
        assert_eq!(rows[&0]["reward"], 0.5);
        assert_eq!(rows[&0]["reward/len"], 0.5);
        // 1 of 3 passed (the failed one does not).
        assert!((rows[&0]["pass@1"] - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(rows[&0]["pass@3"], 1.0);
        // A row with no completed rollout has pass@k but no reward.
        assert!(!rows[&1].contains_key("reward"));
        assert_eq!(rows[&1]["pass@1"], 0.0);
    }

    /// A wrong answer with a format bonus (total 0.2) fails, a right one with a length penalty (total
    /// 0.5) passes: pass@k reads the correctness component, not the total.
    #[test]
    fn pass_at_k_counts_the_correctness_component_not_the_total() {
        let scored = |rollout_index: usize, right: f64, total: f64| {
            let mut record = record(0, rollout_index, total, false);
            record.rewards.insert("right".into(), right);
            record
        };
        let records = vec![scored(0, 0.0, 0.2), scored(1, 1.0, 0.5)];
        let rows = row_values(&records, 2, Some("right"));
        assert_eq!(rows[&0]["pass@1"], 0.5);
        assert_eq!(rows[&0]["pass@2"], 1.0);
        // Without a correctness component there is no pass@k at all.
        let rows = row_values(&records, 2, None);
        assert!(rows[&0].keys().all(|name| !name.starts_with("pass@")));
    }

    #[test]
    fn identical_policies_differ_by_nothing() {
        let a = policy(|row, k| (row * 2 + k) as f64 / 20.0);
        let comparison = compare(("a", &a), ("b", &a), (2, Some("right")), 1_000, 0).unwrap();
        let names: Vec<&str> = comparison.metrics.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(
            names,
            ["reward", "reward/len", "reward/right", "pass@1", "pass@2"]
        );
        for metric in &comparison.metrics {
            assert_eq!(
                (metric.difference, metric.low, metric.high),
                (0.0, 0.0, 0.0)
            );
            assert_eq!(metric.a, metric.b);
            assert_eq!(metric.rows, 10);
        }
    }

    #[test]
    fn a_clear_difference_excludes_zero() {
        let a = policy(|row, _| if row % 2 == 0 { 0.0 } else { 0.2 });
        let b = policy(|row, _| if row % 3 == 0 { 0.6 } else { 0.8 });
        let comparison = compare(("a", &a), ("b", &b), (2, Some("right")), RESAMPLES, 5).unwrap();
        let reward = metric(&comparison, "reward");
        assert!((reward.a - 0.1).abs() < 1e-12 && (reward.b - 0.72).abs() < 1e-12);
        assert!((reward.difference - 0.62).abs() < 1e-12);
        assert!(0.0 < reward.low && reward.low < 0.62 && 0.62 < reward.high);
        // B passes every rollout, A only half the rows'.
        let pass = metric(&comparison, "pass@1");
        assert_eq!((pass.a, pass.b), (0.5, 1.0));
        assert!(pass.low > 0.0);
        let table = comparison.table();
        assert!(table.contains("reward/len"), "{table}");
        assert!(table.contains("+0.6200"), "{table}");
    }

    #[test]
    fn rows_without_a_completed_rollout_under_both_are_left_out() {
        let a = policy(|_, _| 1.0);
        let mut b = policy(|_, _| 1.0);
        for record in b.iter_mut().filter(|r| r.row_index == 3) {
            *record = record_failed(record);
        }
        let comparison = compare(("a", &a), ("b", &b), (2, Some("right")), 100, 0).unwrap();
        assert_eq!(metric(&comparison, "reward").rows, 9);
        // pass@k counts a failed rollout as failing: row 3 pairs 1 with 0.
        let pass = metric(&comparison, "pass@1");
        assert_eq!(pass.rows, 10);
        assert!((pass.difference + 0.1).abs() < 1e-12);
        let none: Vec<RolloutRecord> = Vec::new();
        let error = compare(("a", &a), ("b", &none), (2, Some("right")), 100, 0).unwrap_err();
        assert!(error.contains("nothing to compare"), "{error}");
    }

    #[test]
    fn the_plot_is_a_png() {
        let a = policy(|row, _| row as f64 / 10.0);
        let b = policy(|row, _| row as f64 / 8.0);
        let comparison = compare(("a", &a), ("b", &b), (2, Some("right")), 200, 0).unwrap();
        let path =
            std::env::temp_dir().join(format!("holo-compare-plot-{}.png", std::process::id()));
        comparison.plot(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    }
}
