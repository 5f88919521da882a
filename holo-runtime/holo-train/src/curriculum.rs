//! The data stream: which rows each generation draws, and the curriculum that orders them by difficulty.
//!
//! Without a curriculum the stream runs over all training rows, epoch after epoch, each epoch a
//! permutation seeded by `data_seed` and the epoch (`shuffle_dataset`), and a generation takes its next
//! distinct rows.
//!
//! With `difficulty_column`, every training row must hold a number in that column (integers or decimals;
//! a missing value, text or `null` is refused naming the row and the column before any work). Its
//! distinct values are the *levels*, served in ascending order: the stream runs over the rows of every
//! level reached so far (`curriculum_cumulative`, the default; a model trained on the hard rows alone
//! forgets the easy ones: measured in `benches/algorithms.sh`) or the current level's only, each level's
//! epochs seeded apart. After each generation batch the mean reward of each of
//! its groups (every group drawn, the ones dynamic sampling dropped included: a group that every rollout
//! solves is the evidence a level is learned) joins the level's window of its last `curriculum_window`
//! groups; when the window is full and its mean reaches `curriculum_threshold`, the next generation draws
//! from the next level, whose window starts empty. The last level is served until the run ends. A group
//! whose rollouts all failed has no reward and is not counted.
//!
//! The level, the rows taken from it and the window are in each checkpoint's `trainer_state.json`
//! ([`CurriculumState`]), so a resumed run draws what the uninterrupted one drew.

use std::collections::BTreeMap;

use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::advantages::nanmean;
use super::config::GrpoConfig;
pub use super::state::CurriculumState;
use super::state::TrainerState;
use holo_core::interpreter::Row;
use holo_core::loom::mix;

/// The seed salt of the data order (the trainer's other salts draw independent streams).
const DATA: u64 = 1;

/// A level change, for the log.
#[derive(Debug, Clone, PartialEq)]
pub struct Advance {
    /// The level passed (0: the lowest difficulty) and its difficulty.
    pub from: (usize, f64),
    /// The level served next and its difficulty.
    pub to: (usize, f64),
    /// The window mean that reached the threshold.
    pub mean: f64,
}

impl std::fmt::Display for Advance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "curriculum: level {} (difficulty {}) is next: the mean reward of level {}'s last groups (difficulty {}) reached {:.4}",
            self.to.0, self.to.1, self.from.0, self.from.1, self.mean
        )
    }
}

/// The training rows as generations draw them.
pub struct Stream<'r> {
    rows: &'r [(usize, Row)],
    /// The difficulties, ascending, and the positions (in `rows`) of each one's rows.
    levels: Option<Vec<(f64, Vec<usize>)>>,
    data_seed: u64,
    shuffle: bool,
    window: usize,
    threshold: f64,
    /// Serve every level reached so far, not only the current one.
    cumulative: bool,
}

impl<'r> Stream<'r> {
    /// The stream over `rows`; with `difficulty_column`, its levels, each checked to hold the
    /// `prompts_per_generation` distinct rows one generation draws.
    pub fn new(rows: &'r [(usize, Row)], config: &GrpoConfig) -> Result<Self, String> {
        let levels = match &config.difficulty_column {
            Some(column) => Some(levels(rows, column, config.prompts_per_generation())?),
            None => None,
        };
        Ok(Stream {
            rows,
            levels,
            data_seed: config.data_seed(),
            shuffle: config.shuffle_dataset,
            window: config.curriculum_window,
            threshold: config.curriculum_threshold,
            cumulative: config.curriculum_cumulative,
        })
    }

    /// The curriculum's state at the start of a run, when it has one.
    pub fn start(&self) -> Option<CurriculumState> {
        self.levels.as_ref().map(|_| CurriculumState::default())
    }

    /// Checks a resumed run's curriculum state against the levels of the data.
    pub fn check_resumed(&self, state: &TrainerState) -> Result<(), String> {
        match (&self.levels, &state.curriculum) {
            (Some(levels), Some(curriculum)) if curriculum.level >= levels.len() => Err(format!(
                "--resume: the run is at curriculum level {} but the data has {} levels; resume with the same data",
                curriculum.level + 1,
                levels.len()
            )),
            (Some(_), None) => Err(
                "--resume: the checkpoint has no curriculum state; resume with the same configuration"
                    .into(),
            ),
            _ => Ok(()),
        }
    }

    /// The next `wanted` distinct rows of the stream, none of them in `exclude` (row indices), advancing
    /// `state.data_position` (and the curriculum's position) by the rows passed.
    pub fn next(
        &self,
        state: &mut TrainerState,
        wanted: usize,
        exclude: &[usize],
    ) -> Vec<(usize, Row)> {
        let (pool, position, salt): (Vec<usize>, &mut u64, Option<u64>) =
            match (&self.levels, state.curriculum.as_mut()) {
                (Some(levels), Some(curriculum)) => (
                    if self.cumulative {
                        levels[..=curriculum.level]
                            .iter()
                            .flat_map(|(_, rows)| rows.iter().copied())
                            .collect()
                    } else {
                        levels[curriculum.level].1.clone()
                    },
                    &mut curriculum.position,
                    Some(curriculum.level as u64),
                ),
                _ => (
                    (0..self.rows.len()).collect(),
                    &mut state.data_position,
                    None,
                ),
            };
        let before = *position;
        let picked = draw(
            &pool,
            wanted,
            position,
            |epoch| {
                let seed = mix(mix(self.data_seed ^ DATA) ^ epoch);
                let seed = salt.map_or(seed, |level| mix(seed ^ level));
                self.shuffle.then_some(seed)
            },
            |row| exclude.contains(&self.rows[row].0),
        );
        let passed = *position - before;
        if salt.is_some() {
            state.data_position += passed;
        }
        picked
            .into_iter()
            .map(|row| self.rows[row].clone())
            .collect()
    }

    /// Takes the mean rewards of a generation batch's groups into the level's window; moves to the next
    /// level when the full window's mean reaches the threshold. Returns the window's mean (`NaN` when
    /// empty) and the move.
    pub fn observe(
        &self,
        state: &mut CurriculumState,
        group_means: &[f64],
    ) -> (f64, Option<Advance>) {
        state
            .window
            .extend(group_means.iter().copied().filter(|mean| !mean.is_nan()));
        let excess = state.window.len().saturating_sub(self.window);
        state.window.drain(..excess);
        let mean = nanmean(state.window.iter().copied());
        let Some(levels) = &self.levels else {
            return (mean, None);
        };
        if state.window.len() < self.window
            || mean < self.threshold
            || state.level + 1 >= levels.len()
        {
            return (mean, None);
        }
        let from = state.level;
        *state = CurriculumState {
            level: from + 1,
            position: 0,
            window: Vec::new(),
        };
        let advance = Advance {
            from: (from, levels[from].0),
            to: (from + 1, levels[from + 1].0),
            mean,
        };
        (mean, Some(advance))
    }

    /// `curriculum/level` (0 for the lowest) and `curriculum/difficulty` of the level served.
    pub fn metrics(&self, state: &CurriculumState) -> BTreeMap<String, f64> {
        let Some(levels) = &self.levels else {
            return BTreeMap::new();
        };
        BTreeMap::from([
            ("curriculum/level".to_string(), state.level as f64),
            ("curriculum/difficulty".to_string(), levels[state.level].0),
        ])
    }
}

/// The next `wanted` distinct items of `pool` that `excluded` lets through, reading a stream of epochs
/// (each `pool` in the order `seed_of_epoch` shuffles it, or as it is for `None`) from `position`, which
/// advances by the items passed. `pool` must hold `wanted` items besides the excluded ones.
fn draw(
    pool: &[usize],
    wanted: usize,
    position: &mut u64,
    seed_of_epoch: impl Fn(u64) -> Option<u64>,
    excluded: impl Fn(usize) -> bool,
) -> Vec<usize> {
    let mut picked: Vec<usize> = Vec::with_capacity(wanted);
    let mut epoch_order: Option<(u64, Vec<usize>)> = None;
    let length = pool.len() as u64;
    while picked.len() < wanted {
        let epoch = *position / length;
        let offset = (*position % length) as usize;
        if epoch_order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut order = pool.to_vec();
            if let Some(seed) = seed_of_epoch(epoch) {
                order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
            }
            epoch_order = Some((epoch, order));
        }
        let candidate = epoch_order.as_ref().expect("set above").1[offset];
        *position += 1;
        // Across an epoch boundary a row may come again; a group of its own twice would be the same
        // rollouts twice.
        if !picked.contains(&candidate) && !excluded(candidate) {
            picked.push(candidate);
        }
    }
    picked
}

/// The rows' levels by `column`: its distinct numbers ascending, each with the positions of its rows.
fn levels(
    rows: &[(usize, Row)],
    column: &str,
    prompts: usize,
) -> Result<Vec<(f64, Vec<usize>)>, String> {
    let mut levels: Vec<(f64, Vec<usize>)> = Vec::new();
    for (position, (index, row)) in rows.iter().enumerate() {
        let problem = match row.get(column) {
            None => Some("has no such column".to_string()),
            Some(value) => match value.as_f64() {
                Some(number) if number.is_finite() => {
                    match levels.iter_mut().find(|(level, _)| *level == number) {
                        Some((_, members)) => members.push(position),
                        None => levels.push((number, vec![position])),
                    }
                    None
                }
                _ => Some(format!("is {value}, not a number")),
            },
        };
        if let Some(problem) = problem {
            return Err(format!(
                "training row {}: the difficulty column `{column}` (difficulty_column) {problem}; every row needs a numeric difficulty",
                index + 1
            ));
        }
    }
    levels.sort_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((difficulty, members)) = levels.iter().find(|(_, members)| members.len() < prompts)
    {
        return Err(format!(
            "the difficulty level {difficulty} (difficulty_column `{column}`) has {} rows; one generation batch draws {prompts} distinct prompts (generation_batch_size / num_generations)",
            members.len()
        ));
    }
    Ok(levels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TrainingArguments;

    fn rows(values: &[serde_json::Value]) -> Vec<(usize, Row)> {
        values
            .iter()
            .enumerate()
            .map(|(index, value)| {
                let row = serde_json::json!({"question": "q", "level": value});
                (index, row.as_object().unwrap().clone())
            })
            .collect()
    }

    fn config() -> GrpoConfig {
        GrpoConfig {
            training: TrainingArguments {
                per_device_train_batch_size: 4,
                ..GrpoConfig::default().training
            },
            difficulty_column: Some("level".into()),
            num_generations: 2,
            curriculum_window: 2,
            curriculum_threshold: 0.75,
            ..GrpoConfig::default()
        }
    }

    #[test]
    fn levels_are_the_distinct_numbers_ascending() {
        use serde_json::json;
        let rows = rows(&[
            json!(3),
            json!(1.5),
            json!(3),
            json!(1.5),
            json!(2),
            json!(2),
        ]);
        let levels = levels(&rows, "level", 2).unwrap();
        let difficulties: Vec<f64> = levels.iter().map(|(d, _)| *d).collect();
        assert_eq!(difficulties, [1.5, 2.0, 3.0]);
        assert_eq!(levels[0].1, [1, 3]);
    }

    #[test]
    fn a_bad_difficulty_names_the_row_and_the_column() {
        use serde_json::json;
        for (value, expected) in [
            (json!("hard"), "is \"hard\", not a number"),
            (json!(null), "is null, not a number"),
        ] {
            let rows = rows(&[json!(1), value]);
            let error = levels(&rows, "level", 1).unwrap_err();
            assert!(
                error.contains("training row 2")
                    && error.contains("`level`")
                    && error.contains(expected),
                "{error}"
            );
        }
        let error = levels(&rows(&[json!(1)]), "difficulty", 1).unwrap_err();
        assert!(
            error.contains("training row 1") && error.contains("no such column"),
            "{error}"
        );
        let error = levels(&rows(&[json!(1), json!(1), json!(2)]), "level", 2).unwrap_err();
        assert!(
            error.contains("level 2") && error.contains("has 1 rows"),
            "{error}"
        );
    }

    #[test]
    fn a_level_serves_its_rows_and_advances_on_a_full_window() {
        use serde_json::json;
        let rows = rows(&[json!(2), json!(1), json!(2), json!(1)]);
        // The level served alone (tests/train/curriculum.rs has the cumulative stream).
        let config = GrpoConfig {
            curriculum_cumulative: false,
            ..config()
        };
        let stream = Stream::new(&rows, &config).unwrap();
        let mut state = TrainerState {
            curriculum: stream.start(),
            ..TrainerState::default()
        };
        for _ in 0..3 {
            let picked = stream.next(&mut state, 2, &[]);
            let mut indices: Vec<usize> = picked.iter().map(|(index, _)| *index).collect();
            indices.sort();
            assert_eq!(indices, [1, 3]);
        }
        assert_eq!(state.data_position, 6);
        let curriculum = state.curriculum.as_mut().unwrap();
        // Not a full window yet, then a full one below the threshold, then one above it.
        assert_eq!(stream.observe(curriculum, &[1.0]), (1.0, None));
        assert_eq!(stream.observe(curriculum, &[0.0, f64::NAN]), (0.5, None));
        assert_eq!(curriculum.window, [1.0, 0.0]);
        assert_eq!(stream.observe(curriculum, &[1.0]), (0.5, None));
        let advance = stream.observe(curriculum, &[1.0]).1.unwrap();
        assert_eq!((advance.from, advance.to), ((0, 1.0), (1, 2.0)));
        assert_eq!(advance.mean, 1.0);
        assert_eq!(
            *curriculum,
            CurriculumState {
                level: 1,
                position: 0,
                window: vec![]
            }
        );
        let picked = stream.next(&mut state, 1, &[0]);
        assert_eq!(picked[0].0, 2, "row 0 is excluded");
        // The last level stays.
        let curriculum = state.curriculum.as_mut().unwrap();
        assert_eq!(stream.observe(curriculum, &[1.0, 1.0]), (1.0, None));
        assert_eq!(curriculum.level, 1);
        assert_eq!(stream.metrics(curriculum)["curriculum/difficulty"], 2.0);
    }
}
