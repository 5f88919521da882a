//! What a Loom run did: its [`Summary`] (pass@k, reward means, failures), gathered as rollouts finish.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{RolloutFailure, RolloutRecord, RowFailure};

/// The mean of one reward component.
#[derive(Debug, Clone, PartialEq)]
pub struct ComponentMean {
    pub name: String,
    pub mean: f64,
    /// The completed rollouts that recorded it.
    pub count: usize,
}

/// What a run did; see the [module documentation](super) for the definitions.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Rows that ran their rollouts.
    pub rows: usize,
    /// Rollouts written, failed ones included.
    pub rollouts: usize,
    /// Rollouts that failed.
    pub failed: usize,
    pub row_failures: Vec<RowFailure>,
    pub failures: Vec<RolloutFailure>,
    /// Each component's mean over the completed rollouts that recorded it, by name.
    pub components: Vec<ComponentMean>,
    /// The mean total reward of the completed rollouts; `None` when none completed.
    pub mean_reward: Option<f64>,
    /// `(k, pass@k)` for k = 1 and k = G (when G > 1) on [`Summary::pass_component`]; empty when no row
    /// ran or there is no correctness component.
    pub pass_at_k: Vec<(usize, f64)>,
    /// The reward component pass@k counts, when there is one.
    pub pass_component: Option<String>,
    /// Sampler calls: one per sample request.
    pub sampler_calls: usize,
    pub elapsed: Duration,
}

impl Summary {
    /// Rollouts written per second of the run.
    pub fn rollouts_per_second(&self) -> f64 {
        self.rollouts as f64 / self.elapsed.as_secs_f64().max(f64::MIN_POSITIVE)
    }
}

/// Running totals for the [`Summary`].
pub(super) struct Stats {
    pub(super) rows_ran: usize,
    rollouts: usize,
    failures: Vec<RolloutFailure>,
    pub(super) row_failures: Vec<RowFailure>,
    /// name → (sum, count) over completed rollouts.
    components: BTreeMap<String, (f64, usize)>,
    reward_sum: f64,
    completed: usize,
    /// Per row position: (rollouts, passing).
    passes: Vec<(usize, usize)>,
    /// The component whose full credit makes a rollout pass.
    pass_component: Option<String>,
    pub(super) sampler_calls: usize,
}

impl Stats {
    pub(super) fn new(rows: usize, pass_component: Option<&str>) -> Self {
        Stats {
            rows_ran: 0,
            rollouts: 0,
            failures: Vec::new(),
            row_failures: Vec::new(),
            components: BTreeMap::new(),
            reward_sum: 0.0,
            completed: 0,
            passes: vec![(0, 0); rows],
            pass_component: pass_component.map(str::to_string),
            sampler_calls: 0,
        }
    }

    pub(super) fn add(&mut self, position: usize, record: &RolloutRecord) {
        self.rollouts += 1;
        let pass = &mut self.passes[position];
        pass.0 += 1;
        if let Some(failure) = &record.error {
            self.failures.push(RolloutFailure {
                row_index: record.row_index,
                rollout_index: record.rollout_index,
                failure: failure.clone(),
            });
            return;
        }
        self.completed += 1;
        self.reward_sum += record.reward;
        if passes(record, self.pass_component.as_deref()) {
            pass.1 += 1;
        }
        for (name, value) in &record.rewards {
            let entry = self.components.entry(name.clone()).or_insert((0.0, 0));
            entry.0 += value;
            entry.1 += 1;
        }
    }

    pub(super) fn mean_reward(&self) -> Option<f64> {
        (self.completed > 0).then(|| self.reward_sum / self.completed as f64)
    }

    pub(super) fn summary(self, per_row: usize, elapsed: Duration) -> Summary {
        let ran: Vec<(usize, usize)> = self.passes.iter().copied().filter(|p| p.0 > 0).collect();
        let mut ks = vec![1];
        if per_row > 1 {
            ks.push(per_row);
        }
        let pass_at_k = if ran.is_empty() || self.pass_component.is_none() {
            Vec::new()
        } else {
            ks.into_iter()
                .map(|k| {
                    let total: f64 = ran.iter().map(|&(n, c)| pass_at_k(n, c, k)).sum();
                    (k, total / ran.len() as f64)
                })
                .collect()
        };
        Summary {
            rows: self.rows_ran,
            rollouts: self.rollouts,
            failed: self.failures.len(),
            mean_reward: self.mean_reward(),
            row_failures: self.row_failures,
            failures: self.failures,
            components: self
                .components
                .into_iter()
                .map(|(name, (sum, count))| ComponentMean {
                    name,
                    mean: sum / count as f64,
                    count,
                })
                .collect(),
            pass_at_k,
            pass_component: self.pass_component,
            sampler_calls: self.sampler_calls,
            elapsed,
        }
    }
}

/// Whether a completed rollout passes: full credit (≥ 1) on `component`, the correctness component (see
/// the [module documentation](super)); never without one.
pub fn passes(record: &RolloutRecord, component: Option<&str>) -> bool {
    component
        .and_then(|component| record.rewards.get(component))
        .is_some_and(|&value| value >= 1.0)
}

/// The unbiased pass@k estimator for `n` samples of which `c` pass: `1 - C(n-c, k) / C(n, k)`, computed
/// as a product to stay exact for large `n`. With fewer than `k` samples, whether any passed.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if c == 0 {
        return 0.0;
    }
    if n < k || n - c < k {
        return 1.0;
    }
    let mut fail = 1.0;
    for i in (n - c + 1)..=n {
        fail *= 1.0 - k as f64 / i as f64;
    }
    1.0 - fail
}
