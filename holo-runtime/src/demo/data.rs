//! The demo's problems: additions of two numbers, split into a held-out set and a training pool that
//! never shares a pair of operands with it (in either order); and the warm-up's sloppy [`Teacher`].

use std::collections::BTreeSet;
use std::ops::RangeInclusive;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use crate::interpreter::Row;

/// `a + b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Problem {
    pub a: u32,
    pub b: u32,
}

impl Problem {
    /// What the user asks (the row's `question`).
    pub fn question(&self) -> String {
        format!("What is {}+{}?", self.a, self.b)
    }

    pub fn answer(&self) -> u32 {
        self.a + self.b
    }

    /// The right reply, in the format the environment rewards.
    pub fn reply(&self) -> String {
        format!("<answer>{}</answer>", self.answer())
    }

    /// Whether the ones digits add up to ten or more, so that the sum carries into the tens.
    pub fn carries(&self) -> bool {
        self.a % 10 + self.b % 10 >= 10
    }

    /// The data row of `hol/arithmetic.hol`: `question` and `expected`.
    pub fn row(&self) -> Row {
        let mut row = Row::new();
        row.insert("question".into(), json!(self.question()));
        row.insert("expected".into(), json!(self.answer().to_string()));
        row
    }

    /// The operands without their order: `a+b` and `b+a` are the same pair.
    pub fn pair(&self) -> (u32, u32) {
        (self.a.min(self.b), self.a.max(self.b))
    }
}

/// The warm-up's teacher: right, except that when a sum carries it forgets the carry (`47+8` gives
/// `45`) with probability `forget_carry`, drawn afresh for each reply. Imitating it caps a model's
/// accuracy; the environment's reward knows better.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Teacher {
    pub forget_carry: f64,
}

impl Teacher {
    /// The teacher's reply to `problem`, in the rewarded format, and whether it is right.
    pub fn reply(&self, problem: &Problem, rng: &mut impl Rng) -> (String, bool) {
        if problem.carries() && rng.random_bool(self.forget_carry) {
            let forgotten = problem.answer() - 10;
            (format!("<answer>{forgotten}</answer>"), false)
        } else {
            (problem.reply(), true)
        }
    }
}

/// The problems of one demo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problems {
    /// Problems for the warm-up and GRPO.
    pub train: Vec<Problem>,
    /// Evaluation only: no pair of these operands is in `train`, in either order.
    pub heldout: Vec<Problem>,
}

/// Every `a + b` with `a` in `first` and `b` in `second`, shuffled by `seed`: the first `heldout`
/// problems of distinct pairs are held out, and every problem on another pair (in either order) is in
/// the training pool. Fails when `heldout` leaves no training problem.
pub fn split(
    first: RangeInclusive<u32>,
    second: RangeInclusive<u32>,
    heldout: usize,
    seed: u64,
) -> Result<Problems, String> {
    let mut all: Vec<Problem> = first
        .clone()
        .flat_map(|a| second.clone().map(move |b| Problem { a, b }))
        .collect();
    if all.is_empty() {
        return Err(format!(
            "the operand ranges {first:?} and {second:?} make no problem"
        ));
    }
    all.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let mut held = BTreeSet::new();
    let mut heldout_problems = Vec::with_capacity(heldout);
    let mut train = Vec::with_capacity(all.len());
    for problem in all {
        if held.contains(&problem.pair()) {
            continue;
        }
        if heldout_problems.len() < heldout {
            held.insert(problem.pair());
            heldout_problems.push(problem);
        } else {
            train.push(problem);
        }
    }
    // A problem met before its pair was held out (the other order) leaves the pool too.
    train.retain(|problem| !held.contains(&problem.pair()));
    if heldout_problems.len() < heldout || train.is_empty() {
        return Err(format!(
            "{heldout} held-out problems leave none to train on: {first:?} + {second:?} has too few pairs"
        ));
    }
    Ok(Problems {
        train,
        heldout: heldout_problems,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_out_pairs_never_reach_training_in_either_order() {
        for seed in 0..5 {
            let problems = split(10..=99, 10..=99, 100, seed).unwrap();
            assert_eq!(problems.heldout.len(), 100);
            let held: BTreeSet<(u32, u32)> = problems.heldout.iter().map(Problem::pair).collect();
            assert_eq!(held.len(), 100, "held-out pairs are distinct");
            assert!(problems
                .train
                .iter()
                .all(|problem| !held.contains(&problem.pair())));
            for problem in &problems.heldout {
                let swapped = Problem {
                    a: problem.b,
                    b: problem.a,
                };
                assert!(!problems.train.contains(problem) && !problems.train.contains(&swapped));
            }
            // Every other problem trains: 90 × 90 problems, less both orders of each held-out pair
            // (one order for a doubled operand).
            let doubled = held.iter().filter(|(a, b)| a == b).count();
            assert_eq!(problems.train.len(), 90 * 90 - 2 * 100 + doubled);
            let demo = split(super::super::FIRST, super::super::SECOND, 100, seed).unwrap();
            let held: BTreeSet<(u32, u32)> = demo.heldout.iter().map(Problem::pair).collect();
            assert_eq!(held.len(), 100);
            assert!(demo.train.iter().all(|p| !held.contains(&p.pair())));
        }
    }

    #[test]
    fn the_split_is_a_function_of_the_seed() {
        let problems = |seed| split(0..=20, 0..=20, 10, seed).unwrap();
        assert_eq!(problems(3), problems(3));
        assert_ne!(problems(3).heldout, problems(4).heldout);
    }

    #[test]
    fn rows_and_replies_carry_the_sum() {
        let problem = Problem { a: 23, b: 45 };
        let row = problem.row();
        assert_eq!(row["question"], "What is 23+45?");
        assert_eq!(row["expected"], "68");
        assert_eq!(problem.reply(), "<answer>68</answer>");
    }

    #[test]
    fn the_teacher_forgets_only_carries_and_as_often_as_told() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let sloppy = Teacher { forget_carry: 0.5 };
        let plain = Problem { a: 42, b: 5 };
        assert!(!plain.carries());
        for _ in 0..100 {
            assert_eq!(sloppy.reply(&plain, &mut rng), (plain.reply(), true));
        }
        let carry = Problem { a: 47, b: 8 };
        assert!(carry.carries() && Problem { a: 95, b: 5 }.carries());
        let replies: Vec<(String, bool)> =
            (0..1000).map(|_| sloppy.reply(&carry, &mut rng)).collect();
        let forgotten = replies.iter().filter(|(_, right)| !right).count();
        assert!((430..570).contains(&forgotten), "{forgotten} of 1000");
        for (reply, right) in &replies {
            let expected = if *right {
                "<answer>55</answer>"
            } else {
                "<answer>45</answer>"
            };
            assert_eq!(reply, expected);
        }
        let careful = Teacher { forget_carry: 0.0 };
        assert!((0..100).all(|_| careful.reply(&carry, &mut rng).1));
    }

    #[test]
    fn a_split_without_training_problems_is_an_error() {
        assert!(split(0..=1, 0..=1, 3, 0)
            .unwrap_err()
            .contains("leave none"));
        #[allow(clippy::reversed_empty_ranges)]
        let empty = split(5..=4, 0..=1, 1, 0);
        assert!(empty.unwrap_err().contains("no problem"));
    }
}
