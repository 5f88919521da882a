//! Rollouts of a trainer's rows through the Loom, appended to the run folder (the GRPO trainer's and
//! the Tinker backend's, `holo_engines::tinker::train`), and the metrics of an evaluation.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use indicatif::ProgressBar;

use super::advantages::nanmean;
use super::batch;
use super::checkpoint::RunDir;
use super::error::TrainError;
use holo_core::holophore::Holophore;
use holo_core::holotypes::{ReflectionMemory, ToolStats};
use holo_core::interpreter::Row;
use holo_core::loom::{Loom, LoomConfig, RolloutRecord, RolloutSource, Summary};
use holo_core::machine::Rollout;
use holo_core::sampler::Sampler;

/// Borrows a rollout source for one Loom.
struct Borrowed<'a, S>(&'a S);

impl<S: RolloutSource> RolloutSource for Borrowed<'_, S> {
    fn check(&self, row: &Row) -> Result<(), String> {
        self.0.check(row)
    }

    fn start(&self, row: &Row) -> Result<Box<dyn Rollout + Send>, String> {
        self.0.start(row)
    }

    fn blocks(&self) -> bool {
        self.0.blocks()
    }

    fn pass_component(&self) -> Option<&str> {
        self.0.pass_component()
    }

    fn tool_stats(&self) -> Option<Arc<ToolStats>> {
        self.0.tool_stats()
    }

    fn reflection_memory(&self) -> Option<Arc<ReflectionMemory>> {
        self.0.reflection_memory()
    }
}

/// Rollouts of a trainer's rows: through the Loom, recorded by a fork of `holophore`, sampled by
/// `sampler` (already the training sampler); [`append`] writes them to the run folder.
pub struct Rollouts<'a, S> {
    pub source: &'a S,
    pub holophore: &'a Holophore,
    pub sampler: &'a dyn Sampler,
}

/// What a run does with failed rollouts. A failed rollout has no reward and trains nothing; the
/// `rollouts/failed_ratio` metric counts them. Beyond that, a batch's first failure with a message not
/// shown before in the run is printed as a warning, so that a broken tool or reward is noticed; and a
/// generation batch or evaluation in which every rollout failed stops the run, since there is nothing to
/// train on (a holotype that fails every time, a sampler gone).
#[derive(Default)]
pub struct Failures {
    warned: Mutex<BTreeSet<String>>,
}

impl Failures {
    /// Checks the rollouts `file` received at `step`: a warning for a new message, an error when all
    /// failed.
    pub fn check(
        &self,
        records: &[RolloutRecord],
        step: u64,
        file: &str,
        progress: &ProgressBar,
    ) -> Result<(), TrainError> {
        if let Some(warning) = self.warning(records, step, file)? {
            progress.suspend(|| eprintln!("{warning}"));
        }
        Ok(())
    }

    /// [`Failures::check`]'s verdict: the warning to print, if any, or the error that stops the run.
    fn warning(
        &self,
        records: &[RolloutRecord],
        step: u64,
        file: &str,
    ) -> Result<Option<String>, TrainError> {
        let failed: Vec<_> = records
            .iter()
            .filter_map(|record| record.error.as_ref().map(|error| (record, error)))
            .collect();
        let Some(&(first, error)) = failed.first() else {
            return Ok(None);
        };
        let at = |record: &RolloutRecord| {
            format!(
                "row {}, rollout {}",
                record.row_index + 1,
                record.rollout_index + 1
            )
        };
        if failed.len() == records.len() {
            return Err(TrainError::Rollouts(format!(
                "step {step}: all {} rollouts failed ({file} holds each error); the first, {}: {}",
                records.len(),
                at(first),
                error.message
            )));
        }
        let mut warned = self
            .warned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // One warning a batch at most: a message that differs from rollout to rollout cannot flood.
        let new = failed
            .iter()
            .find(|(_, error)| !warned.contains(&error.message));
        Ok(new.map(|&(record, error)| {
            warned.insert(error.message.clone());
            format!(
                "warning: step {step}: {} of {} rollouts failed ({file} holds each error; later ones with a message already shown are only counted); {}: {}",
                failed.len(),
                records.len(),
                at(record),
                error.message
            )
        }))
    }
}

/// Checks every training and evaluation row with `source` before any work, naming the first that does
/// not fit; and that the training rows are at least the `prompts` one generation draws (when the
/// trainer draws them itself).
pub fn check_rows<S: RolloutSource>(
    source: &S,
    rows: &[(usize, Row)],
    eval_rows: &[(usize, Row)],
    prompts: Option<usize>,
) -> Result<(), TrainError> {
    if let Some(prompts) = prompts.filter(|&prompts| rows.len() < prompts) {
        return Err(TrainError::Input(format!(
            "the data has {} rows; one generation batch needs {prompts} distinct prompts (generation_batch_size / num_generations)",
            rows.len()
        )));
    }
    for (rows, what) in [(rows, "training"), (eval_rows, "evaluation")] {
        for (index, row) in rows {
            source.check(row).map_err(|message| {
                TrainError::Input(format!("{what} row {}: {message}", index + 1))
            })?;
        }
    }
    Ok(())
}

impl<S: RolloutSource> Rollouts<'_, S> {
    /// Runs `G` rollouts of each row, and returns them grouped: row by row, rollouts in order.
    pub fn run(
        &self,
        runtime: &tokio::runtime::Runtime,
        rows: &[(usize, Row)],
        group: usize,
        seed: u64,
    ) -> Result<(Vec<RolloutRecord>, Summary), TrainError> {
        let loom = Loom::new(
            Borrowed(self.source),
            LoomConfig {
                rollouts_per_row: group,
                seed,
                concurrency: (rows.len() * group).max(1),
                progress: false,
                timing: false,
                ..LoomConfig::default()
            },
        )
        .with_holophore(self.holophore.fork());
        let mut records: Vec<RolloutRecord> = Vec::new();
        let summary = runtime.block_on(loom.run(rows, self.sampler, &mut records))?;
        let position: BTreeMap<usize, usize> = rows
            .iter()
            .enumerate()
            .map(|(position, (index, _))| (*index, position))
            .collect();
        records.sort_by_key(|record| (position[&record.row_index], record.rollout_index));
        Ok((records, summary))
    }
}

/// Appends `records` to `file` in the run folder, each marked with `step`.
pub fn append(
    run: &RunDir,
    file: &str,
    step: u64,
    records: &mut [RolloutRecord],
) -> Result<(), TrainError> {
    let mut out = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(run.path.join(file))?;
    let mut lines = Vec::new();
    for record in records {
        record.step = Some(step);
        serde_json::to_writer(&mut lines, record).map_err(io::Error::other)?;
        lines.push(b'\n');
    }
    out.write_all(&lines)?;
    out.flush()?;
    Ok(())
}

/// The metrics of an evaluation's rollouts: `eval/reward`, `eval/pass@k`, each component's mean, the
/// mean completion length and the failed rollouts.
pub fn evaluation_metrics(records: &[RolloutRecord], summary: &Summary) -> BTreeMap<String, f64> {
    let mut metrics = BTreeMap::new();
    metrics.insert(
        "eval/reward".to_string(),
        summary.mean_reward.unwrap_or(f64::NAN),
    );
    for (k, value) in &summary.pass_at_k {
        metrics.insert(format!("eval/pass@{k}"), *value);
    }
    for component in &summary.components {
        metrics.insert(
            format!("eval/rewards/{}/mean", component.name),
            component.mean,
        );
    }
    let lengths: Vec<f64> = records
        .iter()
        .map(|record| {
            batch::sequences(record)
                .iter()
                .map(|s| s.trained.len() as f64)
                .sum()
        })
        .collect();
    metrics.insert(
        "eval/completions/mean_length".into(),
        nanmean(lengths.iter().copied()),
    );
    metrics.insert("eval/failed".into(), summary.failed as f64);
    metrics
}

#[cfg(test)]
mod tests {
    use super::*;
    use holo_core::loom::{Failure, Stage};

    /// A source that says what a trainer's Loom must hear from it: its rollouts block, and which
    /// component pass@k counts.
    struct Blocking;

    impl RolloutSource for Blocking {
        fn start(&self, _row: &Row) -> Result<Box<dyn Rollout + Send>, String> {
            Err("never started".into())
        }

        fn blocks(&self) -> bool {
            true
        }

        fn pass_component(&self) -> Option<&str> {
            Some("right")
        }
    }

    /// The trainer's Loom sees its source through [`Borrowed`]: rollouts of a holoware whose holotypes
    /// block (code in the sandbox) are stepped off the sampling thread only if `blocks` is passed on.
    #[test]
    fn a_borrowed_source_says_what_the_source_says() {
        let borrowed = Borrowed(&Blocking);
        assert!(borrowed.blocks());
        assert_eq!(borrowed.pass_component(), Some("right"));
    }

    /// Rollouts of rows 0 and 1 (two each); those named in `failing` with their message.
    fn records(failing: &[(usize, usize, &str)]) -> Vec<RolloutRecord> {
        let mut records = Vec::new();
        for row_index in 0..2 {
            for rollout_index in 0..2 {
                let error = failing
                    .iter()
                    .find(|(row, rollout, _)| (*row, *rollout) == (row_index, rollout_index))
                    .map(|(.., message)| Failure {
                        stage: Stage::Rollout,
                        message: message.to_string(),
                    });
                records.push(RolloutRecord {
                    dataset: None,
                    row_index,
                    rollout_index,
                    seed: 0,
                    row: Row::new(),
                    contexts: Vec::new(),
                    rewards: BTreeMap::new(),
                    weights: BTreeMap::new(),
                    feedback: BTreeMap::new(),
                    reward: 0.0,
                    samples: 1,
                    truncated: false,
                    step: None,
                    error,
                    timing: None,
                });
            }
        }
        records
    }

    /// A batch's first new message is a warning once in the run (the first rollout that has it named);
    /// a batch that failed whole is an error; a batch without failures says nothing.
    #[test]
    fn failures_warn_once_per_message_and_stop_a_batch_that_failed_whole() {
        let failures = Failures::default();
        let broken = "env.hol:6:1: the tool is gone";
        assert_eq!(
            failures
                .warning(&records(&[]), 1, "rollouts.jsonl")
                .unwrap(),
            None
        );
        let half = records(&[(1, 0, broken), (1, 1, broken)]);
        assert_eq!(
            failures.warning(&half, 1, "rollouts.jsonl").unwrap().as_deref(),
            Some(
                "warning: step 1: 2 of 4 rollouts failed (rollouts.jsonl holds each error; later ones \
                 with a message already shown are only counted); row 2, rollout 1: env.hol:6:1: the tool is gone"
            )
        );
        // Shown once: the same message later is only counted.
        assert_eq!(failures.warning(&half, 2, "rollouts.jsonl").unwrap(), None);
        // A new message in a batch that also has the old one: the new one is shown.
        let other = "env.hol:9:1: another";
        let mixed = records(&[(0, 0, broken), (1, 1, other)]);
        let warning = failures
            .warning(&mixed, 3, "rollouts.jsonl")
            .unwrap()
            .unwrap();
        assert!(
            warning.ends_with("row 2, rollout 2: env.hol:9:1: another"),
            "{warning}"
        );
        // Every rollout failed: the run stops, naming the first.
        let all = records(&[(0, 0, broken), (0, 1, broken), (1, 0, other), (1, 1, other)]);
        match failures.warning(&all, 4, "eval_rollouts.jsonl") {
            Err(TrainError::Rollouts(message)) => assert_eq!(
                message,
                "step 4: all 4 rollouts failed (eval_rollouts.jsonl holds each error); the first, \
                 row 1, rollout 1: env.hol:6:1: the tool is gone"
            ),
            other => panic!("{other:?}"),
        }
    }
}
