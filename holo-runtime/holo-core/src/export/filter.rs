//! Which rollouts an export may use: completed ones, grouped by row (the `G` rollouts of one data row at one
//! training step), each group best first.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use super::Rollout;

/// A row's group: its dataset (several `--data` files of `holo eval`), the training step (none for
/// `holo eval`) and the row's index.
pub type GroupKey = (Option<String>, Option<u64>, usize);

pub fn group_key(rollout: &Rollout) -> GroupKey {
    let record = &rollout.record;
    (record.dataset.clone(), record.step, record.row_index)
}

/// Splits off the failed rollouts (`error` set): what they recorded stops where they failed, so they are
/// never exported. Returns the completed ones and how many failed.
pub fn completed(rollouts: Vec<Rollout>) -> (Vec<Rollout>, usize) {
    keep(rollouts, |rollout| rollout.record.error.is_none())
}

/// Keeps the rollouts whose total reward is at least `min_reward` (a NaN reward never is). Returns them and
/// how many were dropped.
pub fn at_least(rollouts: Vec<Rollout>, min_reward: f64) -> (Vec<Rollout>, usize) {
    keep(rollouts, |rollout| rollout.record.reward >= min_reward)
}

/// The rollouts `wanted` keeps, and how many it dropped.
fn keep(mut rollouts: Vec<Rollout>, wanted: impl FnMut(&Rollout) -> bool) -> (Vec<Rollout>, usize) {
    let total = rollouts.len();
    rollouts.retain(wanted);
    let dropped = total - rollouts.len();
    (rollouts, dropped)
}

/// Best first: higher total reward, then the lower rollout index (so the order is the same on every
/// run); a NaN reward sorts last.
pub fn best_first(a: &Rollout, b: &Rollout) -> Ordering {
    let reward = |rollout: &Rollout| rollout.record.reward;
    match (reward(a).is_nan(), reward(b).is_nan()) {
        (false, true) => Ordering::Less,
        (true, false) => Ordering::Greater,
        _ => reward(b)
            .partial_cmp(&reward(a))
            .unwrap_or(Ordering::Equal)
            .then(a.record.rollout_index.cmp(&b.record.rollout_index)),
    }
}

/// The rollouts grouped by [`GroupKey`] (groups in key order), each group sorted [`best_first`].
pub fn groups(rollouts: Vec<Rollout>) -> Vec<Vec<Rollout>> {
    let mut by_key: BTreeMap<GroupKey, Vec<Rollout>> = BTreeMap::new();
    for rollout in rollouts {
        by_key.entry(group_key(&rollout)).or_default().push(rollout);
    }
    by_key
        .into_values()
        .map(|mut group| {
            group.sort_by(best_first);
            group
        })
        .collect()
}

/// Keeps the `top_k` best of each group (groups from [`groups`]). Returns them, in group order, and how
/// many were dropped.
pub fn top_k(groups: Vec<Vec<Rollout>>, top_k: usize) -> (Vec<Rollout>, usize) {
    let mut kept = Vec::new();
    let mut dropped = 0;
    for mut group in groups {
        dropped += group.len().saturating_sub(top_k);
        group.truncate(top_k);
        kept.extend(group);
    }
    (kept, dropped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::fixtures::{failed, record, rollouts};

    fn indices(rollouts: &[Rollout]) -> Vec<(usize, usize)> {
        rollouts
            .iter()
            .map(|r| (r.record.row_index, r.record.rollout_index))
            .collect()
    }

    #[test]
    fn failed_rollouts_are_dropped_and_counted() {
        let (kept, failed_count) = completed(rollouts(vec![
            record(0, 0, 1.0, "a"),
            failed(record(0, 1, 1.0, "b")),
        ]));
        assert_eq!(indices(&kept), [(0, 0)]);
        assert_eq!(failed_count, 1);
    }

    #[test]
    fn min_reward_keeps_rewards_at_or_above_it() {
        let (kept, dropped) = at_least(
            rollouts(vec![
                record(0, 0, 0.5, "a"),
                record(0, 1, 0.49, "b"),
                record(0, 2, f64::NAN, "c"),
                record(0, 3, 2.0, "d"),
            ]),
            0.5,
        );
        assert_eq!(indices(&kept), [(0, 0), (0, 3)]);
        assert_eq!(dropped, 2);
    }

    #[test]
    fn groups_are_per_row_and_step_best_first_ties_by_rollout_index() {
        let mut later = record(0, 0, 9.0, "a");
        later.step = Some(2);
        let grouped = groups(rollouts(vec![
            record(1, 0, 0.0, "a"),
            record(0, 2, 1.0, "a"),
            record(0, 0, 0.0, "a"),
            record(0, 1, 1.0, "a"),
            record(0, 3, f64::NAN, "a"),
            later,
        ]));
        let shape: Vec<Vec<(usize, usize)>> = grouped.iter().map(|g| indices(g)).collect();
        assert_eq!(
            shape,
            [
                vec![(0, 1), (0, 2), (0, 0), (0, 3)],
                vec![(1, 0)],
                vec![(0, 0)],
            ]
        );
        assert_eq!(grouped[2][0].record.step, Some(2));
    }

    #[test]
    fn top_k_keeps_the_best_of_each_group() {
        let grouped = groups(rollouts(vec![
            record(0, 0, 0.0, "a"),
            record(0, 1, 3.0, "a"),
            record(0, 2, 2.0, "a"),
            record(1, 0, 1.0, "a"),
        ]));
        let (kept, dropped) = top_k(grouped, 2);
        assert_eq!(indices(&kept), [(0, 1), (0, 2), (1, 0)]);
        assert_eq!(dropped, 1);
    }
}
