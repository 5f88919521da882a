//! Rollouts of a trainer's rows through the Loom, appended to the run folder (the GRPO trainer's and
//! the Tinker backend's, `crate::engines::tinker::train`), and the metrics of an evaluation.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use indicatif::ProgressBar;

use super::advantages::nanmean;
use super::batch;
use super::checkpoint::RunDir;
use super::run::TrainError;
use crate::holophore::Holophore;
use crate::holotypes::{ReflectionMemory, ToolStats};
use crate::interpreter::Row;
use crate::loom::{Loom, LoomConfig, RolloutRecord, RolloutSource, Summary};
use crate::machine::Rollout;
use crate::sampler::Sampler;

/// Borrows a rollout source for one Loom.
struct Borrowed<'a, S>(&'a S);

impl<S: RolloutSource> RolloutSource for Borrowed<'_, S> {
    fn check(&self, row: &Row) -> Result<(), String> {
        self.0.check(row)
    }

    fn start(&self, row: &Row) -> Result<Box<dyn Rollout + Send>, String> {
        self.0.start(row)
    }

    fn tool_stats(&self) -> Option<Arc<ToolStats>> {
        self.0.tool_stats()
    }

    fn reflection_memory(&self) -> Option<Arc<ReflectionMemory>> {
        self.0.reflection_memory()
    }
}

/// Rollouts of a trainer's rows: through the Loom, recorded by a fork of `holophore`, sampled by
/// `sampler` (already the training sampler), appended to a file of the run folder.
pub(crate) struct Rollouts<'a, S> {
    pub source: &'a S,
    pub holophore: &'a Holophore,
    pub sampler: &'a dyn Sampler,
    pub run: &'a RunDir,
}

/// What a run does with failed rollouts. A failed rollout has no reward and trains nothing; the
/// `rollouts/failed_ratio` metric counts them. Beyond that, a batch's first failure with a message not
/// shown before in the run is printed as a warning, so that a broken tool or reward is noticed; and a
/// generation batch or evaluation in which every rollout failed stops the run, since there is nothing to
/// train on (a holotype that fails every time, a sampler gone).
#[derive(Default)]
pub(crate) struct Failures {
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
        let failed: Vec<_> = records
            .iter()
            .filter_map(|record| record.error.as_ref().map(|error| (record, error)))
            .collect();
        let Some(&(first, error)) = failed.first() else {
            return Ok(());
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
        if let Some(&(record, error)) = new {
            warned.insert(error.message.clone());
            progress.suspend(|| {
                eprintln!(
                    "warning: step {step}: {} of {} rollouts failed ({file} holds each error; later ones with a message already shown are only counted); {}: {}",
                    failed.len(),
                    records.len(),
                    at(record),
                    error.message
                )
            });
        }
        Ok(())
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
    /// Runs `G` rollouts of each row, appends them (with `step`) to `file` in the run folder, and
    /// returns them grouped: row by row, rollouts in order.
    pub fn run(
        &self,
        runtime: &tokio::runtime::Runtime,
        rows: &[(usize, Row)],
        group: usize,
        seed: u64,
        step: u64,
        file: &str,
    ) -> Result<(Vec<RolloutRecord>, Summary), TrainError> {
        let loom = Loom::new(
            Borrowed(self.source),
            LoomConfig {
                rollouts_per_row: group,
                seed,
                concurrency: (rows.len() * group).max(1),
                progress: false,
                timing: false,
                dataset: None,
            },
        )
        .with_holophore(self.holophore.fork());
        let mut jsonl = Vec::new();
        let summary = runtime.block_on(loom.run(rows, self.sampler, &mut jsonl))?;
        let mut records: Vec<RolloutRecord> = jsonl
            .split(|&byte| byte == b'\n')
            .filter(|line| !line.is_empty())
            .map(serde_json::from_slice)
            .collect::<Result<_, _>>()
            .map_err(io::Error::other)?;
        let position: BTreeMap<usize, usize> = rows
            .iter()
            .enumerate()
            .map(|(position, (index, _))| (*index, position))
            .collect();
        records.sort_by_key(|record| (position[&record.row_index], record.rollout_index));
        let mut out = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(self.run.path.join(file))?;
        let mut lines = Vec::new();
        for record in &mut records {
            record.step = Some(step);
            serde_json::to_writer(&mut lines, record).map_err(io::Error::other)?;
            lines.push(b'\n');
        }
        out.write_all(&lines)?;
        out.flush()?;
        Ok((records, summary))
    }
}

/// The metrics of an evaluation's rollouts: `eval/reward`, `eval/pass@k`, each component's mean, the
/// mean completion length and the failed rollouts.
pub(crate) fn evaluation_metrics(
    records: &[RolloutRecord],
    summary: &Summary,
) -> BTreeMap<String, f64> {
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
