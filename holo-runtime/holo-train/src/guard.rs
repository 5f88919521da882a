//! Guard rails: early stopping on `eval/reward`, and rollback when the KL or the training reward says the
//! run is collapsing.
//!
//! - **Early stopping** (`early_stopping_patience`, `early_stopping_threshold`; transformers'
//!   `EarlyStoppingCallback` with `eval/reward` as the metric, greater is better): each evaluation whose
//!   `eval/reward` does not beat the best so far by more than the threshold counts; after `patience` of
//!   them in a row the run saves a checkpoint and ends. A resumed run that had stopped stays stopped.
//! - **Rollback** (`rollback_kl`, `rollback_reward_drop`): a step *trips* when its `kl` exceeds
//!   `rollback_kl`, or when the moving mean of the training reward over the last `rollback_window`
//!   generating steps falls more than `rollback_reward_drop` below the best such mean of the run (only
//!   full windows count). The training reward is the mean of every rollout the step generated
//!   (`dynamic_sampling/reward` under dynamic sampling, whose `reward` covers the kept groups only);
//!   a curriculum level's change starts a new window and a new best, since the rows changed.
//!
//! A step's measurements describe the weights it started from, the ones the previous step saved. So
//! the *last good checkpoint* of a trip at step `s` is the newest one at step `s − 2` or before: its
//! weights passed the guard at the step after it. (A run that rolls back saves `checkpoint-0`, the
//! starting weights, before its first step, and keeps at least two checkpoints.) A rollback restores
//! it (weights, optimizer moments, data position, curriculum, memory), deletes the checkpoints after
//! it, cuts `metrics.jsonl` and the rollout files back to it, moves the metrics of the abandoned steps
//! into `rollbacks.jsonl`, multiplies the learning rate by `rollback_lr_factor` for the rest of the run,
//! and logs `guard/rollbacks` and `guard/lr_factor` on every later step. The steps after the checkpoint
//! are then trained again with the same seeds and the lower learning rate. A trip after `max_rollbacks`
//! rollbacks (or one with no good checkpoint) rolls the run folder back the same way and stops the run
//! with an error.
//! - **Blown-up numbers**: a step whose `loss` or `grad_norm` is not a finite number (NaN, ±inf) trips
//!   whatever the options (`non_finite_loss`, `non_finite_grad_norm`): weights that blew up give NaN
//!   from then on, and training on would only save NaN checkpoints. A run that rolls back rolls back as
//!   for any trip; any other run stops with an error before it logs or saves the step.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::path::Path;

use indicatif::ProgressBar;
use serde_json::{json, Value};

use super::advantages::nanmean;
use super::checkpoint::RunDir;
use super::config::GrpoConfig;
use super::error::TrainError;
use super::metrics::{read_metrics, MetricsLog, METRICS_FILE};
pub use super::state::GuardState;
use super::state::{TrainSummary, TrainerState};

/// The run folder's record of rollbacks: one JSON object per trip.
pub const ROLLBACKS_FILE: &str = "rollbacks.jsonl";

/// What the terminal says when training has had no signal for `no_signal_steps` steps: what the rollouts
/// got, one of them (`example`: its last sampled text), what would give a signal, and whether the run
/// stops.
pub fn no_signal_note(
    config: &GrpoConfig,
    step: u64,
    metrics: &BTreeMap<String, f64>,
    example: Option<&str>,
) -> String {
    let reward = metrics.get("reward").copied().unwrap_or(f64::NAN);
    let mut note = format!(
        "warning: no learning signal for {} steps (to step {step}): in every group all {} rollouts got the same reward (frac_reward_zero_std 1, mean reward {reward:.3}), so every advantage is 0 and GRPO changes nothing.",
        config.no_signal_steps, config.num_generations
    );
    if let Some(example) = example {
        note.push_str(&format!("\n  a rollout's last reply: {example:?}"));
    }
    note.push_str(
        "\n  rewards that differ within a group give a signal: partial credit (a reward for the format or for \
         being close), a check that accepts more answer forms (MathAnswer's `untagged=last_number`), more \
         rollouts per group (num_generations), or a warm-up on examples first (`holo sft`).",
    );
    note.push_str(if config.stop_on_no_signal {
        "\n  stopping here (stop_on_no_signal)"
    } else {
        "\n  training goes on; `--stop-on-no-signal` ends such a run here, `--no-signal-steps 0` silences this"
    });
    note
}

/// The reasons of a step whose loss, or gradient norm, is not a finite number.
pub const NON_FINITE_LOSS: &str = "non_finite_loss";
pub const NON_FINITE_GRAD_NORM: &str = "non_finite_grad_norm";

/// A step whose measurements tripped a rollback condition.
#[derive(Debug, Clone, PartialEq)]
pub struct Trip {
    pub step: u64,
    /// The option that tripped (`rollback_kl` or `rollback_reward_drop`), or [`NON_FINITE_LOSS`] /
    /// [`NON_FINITE_GRAD_NORM`].
    pub key: &'static str,
    /// What was measured (`kl`, or the moving mean reward) and the bound it passed.
    pub value: f64,
    pub bound: f64,
}

impl std::fmt::Display for Trip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.key {
            NON_FINITE_LOSS | NON_FINITE_GRAD_NORM => write!(
                f,
                "step {}: {} is {}, not a finite number: training blew up (a learning rate too large for the model?)",
                self.step,
                self.key.trim_start_matches("non_finite_"),
                self.value
            ),
            "rollback_kl" => write!(
                f,
                "step {}: kl {:.4} is above rollback_kl {}",
                self.step, self.value, self.bound
            ),
            _ => write!(
                f,
                "step {}: the moving mean reward {:.4} fell below {:.4} (its best minus rollback_reward_drop)",
                self.step, self.value, self.bound
            ),
        }
    }
}

impl GuardState {
    /// Takes an evaluation's `eval/reward`; true when early stopping's patience has run out.
    pub fn evaluated(&mut self, config: &GrpoConfig, reward: f64) -> bool {
        let Some(patience) = config.early_stopping_patience else {
            return false;
        };
        let improved = !reward.is_nan()
            && self
                .best_eval
                .is_none_or(|best| reward > best + config.early_stopping_threshold);
        if improved {
            self.best_eval = Some(reward);
            self.evals_since_best = 0;
        } else {
            self.evals_since_best += 1;
        }
        self.stopped = self.evals_since_best >= patience;
        self.stopped
    }

    /// Takes a finished step's metrics; true when this step makes `no_signal_steps` generating steps in a
    /// row whose every group had identical rewards (once a streak: the next says nothing until a step
    /// with a signal starts another). Under `stop_on_no_signal` the run stops there.
    pub fn without_signal(&mut self, config: &GrpoConfig, metrics: &BTreeMap<String, f64>) -> bool {
        // Steps that took a generation batch made earlier measure nothing new.
        let Some(&flat) = metrics.get("frac_reward_zero_std") else {
            return false;
        };
        if flat < 1.0 {
            self.steps_without_signal = 0;
            return false;
        }
        self.steps_without_signal += 1;
        let reached =
            config.no_signal_steps > 0 && self.steps_without_signal == config.no_signal_steps;
        if reached && config.stop_on_no_signal {
            self.stopped = true;
        }
        reached
    }

    /// The option that stopped a stopped run: a streak without signal under `stop_on_no_signal`, else
    /// early stopping's patience.
    pub fn stopped_by(&self, config: &GrpoConfig) -> &'static str {
        let no_signal = config.stop_on_no_signal
            && config.no_signal_steps > 0
            && self.steps_without_signal >= config.no_signal_steps;
        if no_signal {
            "stop_on_no_signal"
        } else {
            "early_stopping_patience"
        }
    }

    /// The line that says early stopping ended the run after `step`.
    pub fn stopping_note(&self, step: u64) -> String {
        format!(
            "early stopping after step {step}: eval/reward has not improved on {:.4} for {} evaluations (early_stopping_patience)",
            self.best_eval.unwrap_or(f64::NAN),
            self.evals_since_best
        )
    }

    /// Takes a finished step's metrics; the trip, when the step passed a rollback bound.
    pub fn check(
        &mut self,
        config: &GrpoConfig,
        step: u64,
        metrics: &BTreeMap<String, f64>,
    ) -> Option<Trip> {
        for (name, key) in [
            ("loss", NON_FINITE_LOSS),
            ("grad_norm", NON_FINITE_GRAD_NORM),
        ] {
            if let Some(&value) = metrics.get(name).filter(|value| !value.is_finite()) {
                return Some(Trip {
                    step,
                    key,
                    value,
                    bound: f64::NAN,
                });
            }
        }
        if let (Some(bound), Some(&kl)) = (config.rollback_kl, metrics.get("kl")) {
            // A NaN KL is a collapse too.
            if kl.is_nan() || kl > bound {
                return Some(Trip {
                    step,
                    key: "rollback_kl",
                    value: kl,
                    bound,
                });
            }
        }
        let drop = config.rollback_reward_drop?;
        let reward = metrics
            .get("dynamic_sampling/reward")
            .or_else(|| metrics.get("reward"))
            .copied()
            .filter(|reward| !reward.is_nan())?;
        let level = metrics.get("curriculum/level").map(|&level| level as usize);
        if level != self.rewards_level {
            self.rewards.clear();
            self.best_mean_reward = None;
            self.rewards_level = level;
        }
        self.rewards.push(reward);
        let excess = self.rewards.len().saturating_sub(config.rollback_window);
        self.rewards.drain(..excess);
        if self.rewards.len() < config.rollback_window {
            return None;
        }
        let mean = nanmean(self.rewards.iter().copied());
        let best = self.best_mean_reward.map_or(mean, |best| best.max(mean));
        self.best_mean_reward = Some(best);
        (mean < best - drop).then_some(Trip {
            step,
            key: "rollback_reward_drop",
            value: mean,
            bound: best - drop,
        })
    }

    /// The guard's metrics for a step: `guard/rollbacks` and `guard/lr_factor` when the run rolls back,
    /// `guard/mean_reward` (the moving mean) once a reward window is full, and
    /// `guard/evals_since_best` under early stopping.
    pub fn metrics(&self, config: &GrpoConfig) -> BTreeMap<String, f64> {
        let mut metrics = BTreeMap::new();
        if config.rolls_back() {
            metrics.insert("guard/rollbacks".into(), self.rollbacks as f64);
            metrics.insert("guard/lr_factor".into(), self.lr_factor);
        }
        if config.rollback_reward_drop.is_some() && self.rewards.len() >= config.rollback_window {
            metrics.insert(
                "guard/mean_reward".into(),
                nanmean(self.rewards.iter().copied()),
            );
        }
        if config.early_stopping_patience.is_some() {
            metrics.insert(
                "guard/evals_since_best".into(),
                self.evals_since_best as f64,
            );
        }
        metrics
    }
}

/// Why a run that does not roll back stops at `trip` (one of blown-up numbers: the others trip only runs
/// that roll back), and what is left of it.
pub fn stop_without_rollback(trip: &Trip) -> TrainError {
    TrainError::Diverged(format!(
        "{trip}. The step was neither logged nor saved; the checkpoints from step {} on hold the weights \
         it started from, so resuming would blow up again. Train again with a lower learning_rate, or set \
         rollback_kl or rollback_reward_drop: such a run rolls back to its last good checkpoint and lowers \
         the learning rate there (rollback_lr_factor)",
        trip.step.saturating_sub(1)
    ))
}

/// Rolls the run folder back to checkpoint `good` after `trip`: appends the event to `rollbacks.jsonl`
/// (`rollback` (the rollbacks so far, this one included), `stopped` (the trip came after
/// `max_rollbacks`), `step`, `reason` (the option that tripped), `value`, `bound`, `restored` (the step
/// of the checkpoint), `lr_factor`, and `abandoned`: the metrics of the steps after the checkpoint, the
/// tripping one last), removes the later checkpoints, cuts the rollout files and `metrics.jsonl` back to
/// the checkpoint and returns the metrics log reopened there. Each part can be redone: a run killed
/// midway and resumed trips again at the same step and does it again.
pub fn roll_back(
    run: &RunDir,
    trip: &Trip,
    good: u64,
    guard: &GuardState,
    stopped: bool,
    metrics: &BTreeMap<String, f64>,
) -> io::Result<MetricsLog> {
    let logged = read_metrics(&run.path.join(METRICS_FILE)).map_err(io::Error::other)?;
    let abandoned: Vec<Value> = logged
        .iter()
        .filter(|(step, _)| *step > good)
        .map(|(step, metrics)| step_json(*step, metrics))
        .chain([step_json(trip.step, metrics)])
        .collect();
    let event = json!({
        "rollback": guard.rollbacks,
        "stopped": stopped,
        "step": trip.step,
        "reason": trip.key,
        "value": number(trip.value),
        "bound": number(trip.bound),
        "restored": good,
        "lr_factor": guard.lr_factor,
        "abandoned": abandoned,
    });
    let mut file = fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(run.path.join(ROLLBACKS_FILE))?;
    writeln!(file, "{event}")?;
    file.sync_all()?;
    run.remove_after(good)?;
    for name in ["rollouts.jsonl", "eval_rollouts.jsonl"] {
        run.keep_records_until(name, good)?;
    }
    MetricsLog::resume(&run.path, good)
}

/// What a run shows after [`rewind`] brought back `restored`: the evaluations past its step leave the
/// summary, the log line `note` is printed and the progress bar moves back to the step.
pub(crate) fn after_rewind(
    summary: &mut TrainSummary,
    restored: &TrainerState,
    note: &str,
    progress: &ProgressBar,
) {
    summary
        .evaluations
        .retain(|(step, _)| *step <= restored.global_step);
    progress.suspend(|| eprintln!("{note}"));
    progress.set_position(restored.global_step);
}

/// Answers a trip of the guard rails: rolls the run folder back to its last good checkpoint
/// ([`roll_back`]), has `restore` bring back that checkpoint's weights, optimizer and trainer state,
/// and returns the restored state with the scaled learning rate and a line for the log. After
/// `max_rollbacks` rollbacks, or with no good checkpoint left, stops with [`TrainError::Diverged`]
/// (the folder rolled back all the same, nothing restored).
pub fn rewind(
    run: &RunDir,
    config: &GrpoConfig,
    trip: Trip,
    current: &GuardState,
    metrics: &BTreeMap<String, f64>,
    metrics_log: &mut MetricsLog,
    restore: impl FnOnce(&Path) -> Result<TrainerState, TrainError>,
) -> Result<(TrainerState, String), TrainError> {
    let good = run
        .checkpoints()?
        .into_iter()
        .rfind(|(step, _)| step + 2 <= trip.step);
    let Some((good_step, good_dir)) = good else {
        return Err(TrainError::Diverged(format!(
            "{trip}, and no checkpoint before step {} is left to return to: the weights it started from were measured at its first step",
            trip.step.saturating_sub(1)
        )));
    };
    let max = config.max_rollbacks;
    let stop = current.rollbacks >= max;
    let mut guard = current.clone();
    if !stop {
        guard.rollbacks += 1;
        guard.lr_factor *= config.rollback_lr_factor;
    }
    *metrics_log = roll_back(run, &trip, good_step, &guard, stop, metrics)?;
    if stop {
        return Err(TrainError::Diverged(format!(
            "{trip}, after {max} rollbacks (max_rollbacks); the run folder is back at checkpoint-{good_step}, its last good checkpoint"
        )));
    }
    let mut state = restore(&good_dir)?;
    state.guard.rollbacks = guard.rollbacks;
    state.guard.lr_factor = guard.lr_factor;
    let note = format!(
        "rollback {} of {max}: {trip}; restored checkpoint-{good_step}, learning rate × {}",
        guard.rollbacks, guard.lr_factor
    );
    Ok((state, note))
}

/// Early stopping watches `eval/reward`: a run with it needs held-out rows.
pub fn check_eval_rows(config: &GrpoConfig, eval_rows: usize) -> Result<(), TrainError> {
    if config.early_stopping_patience.is_some() && eval_rows == 0 {
        return Err(TrainError::Input(
            "`early_stopping_patience` needs held-out rows (--eval-data): it watches eval/reward"
                .into(),
        ));
    }
    Ok(())
}

/// Keeps the first `rollbacks` events of `rollbacks.jsonl` (those of a resumed checkpoint's past; later
/// ones are written again when their trips come again).
pub fn keep_events(run: &RunDir, rollbacks: u64) -> io::Result<()> {
    let path = run.path.join(ROLLBACKS_FILE);
    let Ok(text) = fs::read_to_string(&path) else {
        return Ok(());
    };
    let kept: String = text
        .split_inclusive('\n')
        .filter(|line| line.ends_with('\n'))
        .take(rollbacks as usize)
        .collect();
    let staging = path.with_extension("jsonl.resume");
    fs::write(&staging, kept)?;
    fs::rename(staging, path)
}

/// A number, or `null` where JSON has none.
fn number(value: f64) -> Value {
    serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number)
}

/// A step's metrics as a `metrics.jsonl` line has them.
fn step_json(step: u64, metrics: &BTreeMap<String, f64>) -> Value {
    let mut object = serde_json::Map::new();
    object.insert("step".into(), step.into());
    for (name, &value) in metrics {
        object.insert(name.clone(), number(value));
    }
    Value::Object(object)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn a_streak_of_flat_groups_is_said_once_and_stops_the_run_when_asked() {
        let config = GrpoConfig::default();
        let mut guard = GuardState::default();
        let flat = metrics(&[("frac_reward_zero_std", 1.0), ("reward", 0.0)]);
        let mixed = metrics(&[("frac_reward_zero_std", 0.5), ("reward", 0.4)]);
        let reused = metrics(&[("reward", 0.0)]);
        // Flat, flat, a step on an earlier generation (counts nothing), flat: said at the third flat one.
        assert!(!guard.without_signal(&config, &flat));
        assert!(!guard.without_signal(&config, &flat));
        assert!(!guard.without_signal(&config, &reused));
        assert!(guard.without_signal(&config, &flat));
        assert!(!guard.stopped, "only a warning by default");
        // Once a streak; a step with a signal starts another.
        assert!(!guard.without_signal(&config, &flat));
        assert!(!guard.without_signal(&config, &mixed));
        assert_eq!(guard.steps_without_signal, 0);
        let note = no_signal_note(&config, 4, &flat, Some("133 is the larger number."));
        assert!(
            note.contains("no learning signal for 3 steps")
                && note.contains("133 is the larger number.")
                && note.contains("untagged=last_number")
                && note.contains("--stop-on-no-signal"),
            "{note}"
        );

        let config = GrpoConfig {
            no_signal_steps: 2,
            stop_on_no_signal: true,
            ..GrpoConfig::default()
        };
        let mut guard = GuardState::default();
        assert!(!guard.without_signal(&config, &flat));
        assert!(guard.without_signal(&config, &flat));
        assert!(guard.stopped);
        assert_eq!(guard.stopped_by(&config), "stop_on_no_signal");
        assert!(no_signal_note(&config, 2, &flat, None).contains("stopping here"));

        let never = GrpoConfig {
            no_signal_steps: 0,
            ..GrpoConfig::default()
        };
        let mut guard = GuardState::default();
        assert!((0..10).all(|_| !guard.without_signal(&never, &flat)));
    }

    #[test]
    fn patience_counts_evaluations_without_a_large_enough_rise() {
        let config = GrpoConfig {
            eval_steps: Some(1),
            early_stopping_patience: Some(2),
            early_stopping_threshold: 0.1,
            ..GrpoConfig::default()
        };
        let mut guard = GuardState::default();
        assert!(!guard.evaluated(&config, 0.5));
        assert!(!guard.evaluated(&config, 0.55), "within the threshold");
        assert!(
            !guard.evaluated(&config, 0.7),
            "an improvement resets the count"
        );
        assert_eq!(guard.evals_since_best, 0);
        assert!(!guard.evaluated(&config, f64::NAN));
        assert!(guard.evaluated(&config, 0.7));
        assert!(guard.stopped);
    }

    #[test]
    fn the_reward_trips_below_its_best_moving_mean_and_a_new_level_starts_over() {
        let config = GrpoConfig {
            rollback_reward_drop: Some(0.3),
            rollback_window: 2,
            ..GrpoConfig::default()
        };
        let mut guard = GuardState::default();
        let step = |guard: &mut GuardState, n, reward, level: f64| {
            guard.check(
                &config,
                n,
                &metrics(&[("reward", reward), ("curriculum/level", level)]),
            )
        };
        assert_eq!(step(&mut guard, 1, 1.0, 0.0), None);
        assert_eq!(step(&mut guard, 2, 0.8, 0.0), None);
        assert_eq!(guard.best_mean_reward, Some(0.9));
        // A new level: the lower reward is no drop.
        assert_eq!(step(&mut guard, 3, 0.2, 1.0), None);
        assert_eq!(step(&mut guard, 4, 0.2, 1.0), None);
        assert_eq!(step(&mut guard, 5, 0.6, 1.0), None);
        assert_eq!(guard.best_mean_reward, Some(0.4));
        assert_eq!(
            step(&mut guard, 6, 0.0, 1.0),
            None,
            "0.3 is within the drop"
        );
        // A step that did not generate has no reward and changes nothing.
        assert_eq!(guard.check(&config, 7, &metrics(&[])), None);
        let trip = step(&mut guard, 8, 0.0, 1.0).unwrap();
        assert_eq!((trip.key, trip.step), ("rollback_reward_drop", 8));
        assert!(trip.value.abs() < 1e-12 && (trip.bound - 0.1).abs() < 1e-12);
    }

    #[test]
    fn the_kl_trips_above_its_bound() {
        let config = GrpoConfig {
            beta: 0.1,
            rollback_kl: Some(0.5),
            ..GrpoConfig::default()
        };
        let mut guard = GuardState::default();
        assert_eq!(guard.check(&config, 1, &metrics(&[("kl", 0.4)])), None);
        let trip = guard.check(&config, 2, &metrics(&[("kl", 0.6)])).unwrap();
        assert_eq!(trip.key, "rollback_kl");
        assert!(trip
            .to_string()
            .contains("kl 0.6000 is above rollback_kl 0.5"));
        assert!(guard
            .check(&config, 3, &metrics(&[("kl", f64::NAN)]))
            .is_some());
    }

    #[test]
    fn a_loss_or_gradient_norm_that_is_not_finite_trips_whatever_the_options() {
        let config = GrpoConfig::default();
        assert!(!config.rolls_back());
        let mut guard = GuardState::default();
        let finite = metrics(&[("loss", 0.1), ("grad_norm", 2.0)]);
        assert_eq!(guard.check(&config, 1, &finite), None);
        let nan = metrics(&[("loss", f64::NAN), ("grad_norm", 2.0)]);
        let trip = guard.check(&config, 2, &nan).unwrap();
        assert_eq!((trip.key, trip.step), (NON_FINITE_LOSS, 2));
        assert!(trip.to_string().contains("step 2: loss is NaN"), "{trip}");
        let infinite = metrics(&[("loss", 0.1), ("grad_norm", f64::INFINITY)]);
        let trip = guard.check(&config, 3, &infinite).unwrap();
        assert_eq!(trip.key, NON_FINITE_GRAD_NORM);
        assert!(stop_without_rollback(&trip)
            .to_string()
            .contains("the run diverged: step 3: grad_norm is inf"));
    }
}
