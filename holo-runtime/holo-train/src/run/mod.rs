//! What every trainer's run shares (GRPO's [`Trainer`](super::Trainer), whichever its backend, and
//! SFT's): the run folder ([`open_with`]: a new run, or the resumption of one with the same
//! configuration), the metrics of a step ([`Window`]) and the progress bar. With the `local` feature,
//! the model folder trained in process (`Policy`), the weights it trains and their optimizer
//! (`Trainable`: every weight or LoRA adapters, one optimizer step of clipping, the schedule and AdamW,
//! checkpoints), and the run folder opened onto them (`open`, `restore`), in `local.rs`.

use std::collections::BTreeMap;
use std::io::{self, IsTerminal};
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::advantages::nanmean;
use super::checkpoint::{RunDir, TrainerState};
use super::config::TrainingConfig;
pub use super::error::TrainError;
use super::metrics::MetricsLog;

#[cfg(feature = "local")]
mod local;

#[cfg(feature = "local")]
pub use local::{open, restore, Policy, Trainable};

/// Where a run writes and how it reports.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The run folder.
    pub out: PathBuf,
    /// Continue the run in `out` from its newest checkpoint.
    pub resume: bool,
    /// A progress bar on stderr (drawn only on a terminal).
    pub progress: bool,
}

/// The splitmix64 finalizer, for seeds derived from the run seed.
pub(crate) use holo_core::loom::mix;

/// A run folder opened by [`open_with`].
pub struct Opened {
    pub state: TrainerState,
    pub metrics: MetricsLog,
    /// Whether it continues a run from its newest checkpoint.
    pub resumed: bool,
}

/// Opens the run folder for any backend: a new run (refusing a folder that holds one; `config.toml` is
/// written, then whatever `create` writes into the folder), or with `resume` the newest checkpoint,
/// which `restore` brings back (refusing one made with another configuration) and whose state it
/// returns. A resume that finds no checkpoint (the run was killed before its first) starts the run over
/// as a new one, unless the folder's `config.toml` is another configuration's.
pub fn open_with<C: TrainingConfig>(
    run: &RunDir,
    resume: bool,
    config: &C,
    create: impl FnOnce(&Path) -> io::Result<()>,
    restore: impl FnOnce(&Path) -> Result<TrainerState, TrainError>,
) -> Result<Opened, TrainError> {
    let dir = &run.path;
    std::fs::create_dir_all(dir)?;
    run.remove_partial()?;
    let checkpoints = run.checkpoints()?;
    let Some((_, newest)) = checkpoints.last().filter(|_| resume) else {
        if resume {
            // Killed before its first checkpoint, the run has nothing to go on from: it starts over.
            // A `config.toml` that does not parse was cut short by a kill at the run's very start.
            let saved = std::fs::read_to_string(dir.join("config.toml"))
                .ok()
                .and_then(|text| toml::from_str::<C>(&text).ok());
            if let Some(saved) = saved {
                check_same_config(config, &saved, dir)?;
            }
            eprintln!(
                "note: `{}` has no checkpoint yet: --resume starts the run from its first step",
                dir.display()
            );
        } else if !checkpoints.is_empty() || dir.join(super::metrics::METRICS_FILE).exists() {
            return Err(TrainError::Input(format!(
                "`{}` already holds a run: pass --resume to continue it, or choose another --out",
                dir.display()
            )));
        }
        std::fs::write(dir.join("config.toml"), config.to_toml())?;
        create(dir)?;
        return Ok(Opened {
            state: TrainerState::default(),
            metrics: MetricsLog::create(dir)?,
            resumed: false,
        });
    };
    let state = restore(newest)?;
    let step = state.global_step;
    Ok(Opened {
        state,
        metrics: MetricsLog::resume(dir, step)?,
        resumed: true,
    })
}

/// Refuses to resume the run in `run_dir`, made with `saved`, with a `config` that would compute otherwise,
/// naming the first key that differs.
pub fn check_same_config<C: TrainingConfig>(
    config: &C,
    saved: &C,
    run_dir: &Path,
) -> Result<(), TrainError> {
    match config.differs_from(saved) {
        None => Ok(()),
        Some((key, saved, now)) => Err(TrainError::Input(format!(
            "--resume: `{key}` is {now} but the run in `{}` was made with {saved}; resume with the same configuration",
            run_dir.display()
        ))),
    }
}

/// Metric values gathered over one optimizer step's micro-batches (and generations), averaged as TRL
/// averages its metric lists at logging; `loss` is the sum of the micro-batches' losses (each already
/// scaled for the accumulation), as transformers logs it.
#[derive(Default)]
pub struct Window {
    values: BTreeMap<String, Vec<f64>>,
    /// Seconds spent in each phase of the step (`time/<phase>`), summed over its micro-batches.
    times: BTreeMap<&'static str, f64>,
    pub loss: f64,
}

impl Window {
    pub fn extend(&mut self, metrics: BTreeMap<String, f64>) {
        for (name, value) in metrics {
            self.values.entry(name).or_default().push(value);
        }
    }

    /// Adds the time since `started` to the step's `time/<phase>`.
    pub fn time(&mut self, phase: &'static str, started: Instant) {
        *self.times.entry(phase).or_default() += started.elapsed().as_secs_f64();
    }

    /// Each metric's mean over the micro-batches, and each phase's time.
    pub fn means(&self) -> BTreeMap<String, f64> {
        self.values
            .iter()
            .map(|(name, values)| (name.clone(), nanmean(values.iter().copied())))
            .chain(
                self.times
                    .iter()
                    .map(|(phase, seconds)| (format!("time/{phase}"), *seconds)),
            )
            .collect()
    }
}

/// Whether a metric measures wall-clock time (`step_time`, `time/<phase>`): the figures that two runs
/// of the same seed do not share.
pub fn is_wall_clock(name: &str) -> bool {
    name == "step_time" || name.starts_with("time/")
}

/// A progress bar of `total` `what`s ("step", "warm-up step") on stderr, drawn only when `enabled` and
/// stderr is a terminal.
pub fn progress_bar(enabled: bool, total: u64, what: &str) -> ProgressBar {
    if !enabled || !io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(&format!(
        "{{elapsed_precise}} [{{bar:30}}] {what} {{pos}}/{{len}}, ETA {{eta}}, {{msg}}"
    )) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}
