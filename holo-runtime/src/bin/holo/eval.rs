//! `holo eval`: a dataset through the Loom, the rollouts written as JSONL and summarized; `--resume`
//! continues an interrupted run.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use holo_runtime::holophore::Holophore;
use holo_runtime::holotypes::CodeSandbox;
use holo_runtime::interpreter::{read_rows, Holoware, NumberedRow};
use holo_runtime::loom::{Jsonl, Loom, LoomConfig, RolloutRecord, Summary};
use holo_runtime::{Sampler, Scripted};

use crate::{load, runtime, SamplerArgs, EXIT_FAILURES, EXIT_USAGE};

/// `holo eval`'s arguments.
#[derive(clap::Args)]
pub struct EvalArgs {
    pub file: PathBuf,
    /// Data rows, one JSON object per line; repeat for several datasets (each summarized apart).
    #[arg(long, required = true)]
    pub data: Vec<PathBuf>,
    /// Rollouts per row (G).
    #[arg(short = 'n', long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub rollouts: u32,
    #[command(flatten)]
    pub sampler: SamplerArgs,
    /// Where the rollouts are written, one JSON object per line.
    #[arg(long, default_value = "rollouts.jsonl")]
    pub out: PathBuf,
    /// The run seed; every rollout's sampling seed is derived from it, the row and the rollout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Rollouts in flight at once: the largest batch, and the most requests sent to a server at
    /// once.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency: u32,
    /// Continue an interrupted run: keep the completed rollouts already in --out, run the others
    /// (failed ones again) with the seeds they would have had, and summarize them all. Needs the same
    /// .hol file, data, -n and --seed as the run it continues.
    #[arg(long)]
    pub resume: bool,
    /// The reward component whose full credit (>= 1) makes a rollout pass, for pass@k. Default: the
    /// holoware's answer check (ExactAnswer or MathAnswer; the one marked `pass=true` where there are
    /// several); without one, pass@k is not computed.
    #[arg(long, value_name = "NAME")]
    pub pass_component: Option<String>,
}

pub fn run(args: EvalArgs) -> ExitCode {
    let EvalArgs {
        file,
        data,
        rollouts,
        sampler: sampler_args,
        out,
        seed,
        concurrency,
        resume,
        pass_component,
    } = args;
    let code = CodeSandbox {
        allow_unsandboxed: sampler_args.allow_unsandboxed_code,
        ..CodeSandbox::default()
    };
    let holophore = match sampler_args.holophore() {
        Ok(holophore) => holophore,
        Err(code) => return code,
    };
    let scripted = |script: Scripted| match &holophore {
        Some(holophore) => script.tokenized(holophore),
        None => script,
    };
    let holoware = match load(&file) {
        Ok(holoware) => holoware,
        Err(exit) => return exit,
    };
    let mut datasets_rows = Vec::with_capacity(data.len());
    for path in &data {
        match read_rows(path) {
            Ok(rows) => datasets_rows.push((path.display().to_string(), rows)),
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
        }
    }
    let startable: Vec<_> = datasets_rows
        .iter()
        .flat_map(|(name, rows)| crate::startable(name, rows, &holoware))
        .collect();
    let sampler: Box<dyn Sampler> =
        match sampler_args.sampler(concurrency as usize, &holoware, &startable) {
            Ok(Some(sampler)) => sampler,
            Ok(None) if sampler_args.replies.is_empty() => {
                Box::new(scripted(Scripted::new(["<answer>42</answer>"])))
            }
            Ok(None) => Box::new(scripted(Scripted::new(sampler_args.replies))),
            Err(code) => return code,
        };
    let config = LoomConfig {
        rollouts_per_row: rollouts as usize,
        seed,
        concurrency: concurrency as usize,
        progress: true,
        pass_component,
        ..LoomConfig::default()
    };
    eval(
        holoware,
        datasets_rows,
        &*sampler,
        holophore.as_ref(),
        config,
        &out,
        resume,
        code,
    )
}

// The command's options, one argument each, as `run` has them.
#[allow(clippy::too_many_arguments)]
fn eval(
    holoware: Arc<Holoware>,
    datasets_rows: Vec<(String, Vec<NumberedRow>)>,
    sampler: &dyn Sampler,
    holophore: Option<&Holophore>,
    config: LoomConfig,
    out: &Path,
    resume: bool,
    code: CodeSandbox,
) -> ExitCode {
    let previous = if resume && out.exists() {
        match previous_records(out, &datasets_rows) {
            Ok(previous) => previous,
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
        }
    } else {
        Vec::new()
    };
    if let Err(message) = check_previous(&previous, &datasets_rows, &config) {
        eprintln!("error: --resume: {}: {message}", out.display());
        return ExitCode::from(EXIT_USAGE);
    }
    let mut writer = match start_output(out, &previous) {
        Ok(file) => Jsonl(file),
        Err(error) => {
            eprintln!("error: cannot write `{}`: {error}", out.display());
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    let mut resources = crate::resources();
    if let Err(code) = crate::prepare_rollouts(&holoware, &mut resources, code) {
        return code;
    }

    let mut failures = 0;
    let mut stdout = std::io::stdout().lock();
    for (data_name, rows) in datasets_rows {
        // Row index: the row's position among the file's non-blank lines (0-based), as in the JSONL.
        let lines: Vec<usize> = rows.iter().map(|(line, _)| *line).collect();
        let mut good = Vec::with_capacity(rows.len());
        for (index, (line, row)) in rows.into_iter().enumerate() {
            match row.and_then(|row| {
                holoware
                    .check_row(&row)
                    .map(|()| row)
                    .map_err(|missing| missing.to_string())
            }) {
                Ok(row) => good.push((index, row)),
                Err(message) => {
                    eprintln!("error: {data_name}:{line}: {message}");
                    failures += 1;
                }
            }
        }
        let mut loom = Loom::interpreted(
            Arc::clone(&holoware),
            resources.clone(),
            LoomConfig {
                dataset: Some(data_name.clone()),
                ..config.clone()
            },
        );
        if let Some(holophore) = holophore {
            loom = loom.with_holophore(holophore.fork());
        }
        let done: Vec<RolloutRecord> = previous
            .iter()
            .filter(|record| record.dataset.as_deref() == Some(data_name.as_str()))
            .cloned()
            .collect();
        let summary = match runtime.block_on(loom.resume(&good, &done, sampler, &mut writer)) {
            Ok(summary) => summary,
            Err(error) if error.kind() == std::io::ErrorKind::InvalidInput => {
                eprintln!("error: --resume: {}: {error}", out.display());
                return ExitCode::from(EXIT_USAGE);
            }
            Err(error) => {
                eprintln!("error: cannot write `{}`: {error}", out.display());
                return ExitCode::from(EXIT_USAGE);
            }
        };
        for failure in &summary.row_failures {
            eprintln!(
                "error: {data_name}:{}: {}",
                lines[failure.row_index], failure.message
            );
        }
        for failure in &summary.failures {
            eprintln!(
                "error: {data_name}:{}: rollout {}: {}",
                lines[failure.row_index], failure.rollout_index, failure.failure.message
            );
        }
        failures += summary.row_failures.len() + summary.failed;
        let _ = write!(
            stdout,
            "{}",
            report(&data_name, config.rollouts_per_row, &summary)
        );
    }
    let _ = writeln!(stdout, "rollouts written to {}", out.display());
    if failures > 0 {
        ExitCode::from(EXIT_FAILURES)
    } else {
        ExitCode::SUCCESS
    }
}

/// The completed records of an interrupted run's JSONL (failed ones are left out, to run again). A last
/// line cut short by the interruption is ignored; any other unreadable line, or a record of a dataset this
/// run does not read, is an error, so that nothing written is lost.
fn previous_records(
    out: &Path,
    datasets: &[(String, Vec<NumberedRow>)],
) -> Result<Vec<RolloutRecord>, String> {
    let text = std::fs::read_to_string(out)
        .map_err(|error| format!("cannot read `{}`: {error}", out.display()))?;
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let mut records = Vec::new();
    let mut failed = 0;
    for (number, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: RolloutRecord = match serde_json::from_str(line) {
            Ok(record) => record,
            Err(_) if number + 1 == lines.len() && !line.ends_with('\n') => {
                eprintln!(
                    "warning: {}:{}: ignoring an unfinished last line (the interrupted write)",
                    out.display(),
                    number + 1
                );
                continue;
            }
            Err(error) => {
                return Err(format!(
                    "{}:{}:{}: not a rollout record: {error}",
                    out.display(),
                    number + 1,
                    error.column()
                ))
            }
        };
        let known = datasets
            .iter()
            .any(|(name, _)| record.dataset.as_deref() == Some(name.as_str()));
        if !known {
            return Err(format!(
                "{}:{}: a record of dataset {:?}, which this run does not read (give the same --data)",
                out.display(),
                number + 1,
                record.dataset.as_deref().unwrap_or("?")
            ));
        }
        if record.error.is_some() {
            failed += 1;
        } else {
            records.push(record);
        }
    }
    eprintln!(
        "resuming {}: {} rollouts done, {failed} failed ones to run again",
        out.display(),
        records.len()
    );
    Ok(records)
}

/// Refuses, before anything is rewritten, records that this run would not have made: another seed,
/// rollout count or data (the Loom checks the same again when it resumes).
fn check_previous(
    previous: &[RolloutRecord],
    datasets: &[(String, Vec<NumberedRow>)],
    config: &LoomConfig,
) -> Result<(), String> {
    for record in previous {
        let (row, rollout) = (record.row_index, record.rollout_index);
        let rows = datasets
            .iter()
            .find(|(name, _)| record.dataset.as_deref() == Some(name.as_str()))
            .map_or(0, |(_, rows)| rows.len());
        let why = if row >= rows {
            Some("the data has no such row".to_string())
        } else {
            config.foreign(record)
        };
        if let Some(why) = why {
            return Err(format!("record of row {row}, rollout {rollout}: {why}"));
        }
    }
    Ok(())
}

/// Opens the output for appending after writing `previous` into it; the old file is replaced only once
/// the new one is complete (written beside it, then renamed), so an interruption loses nothing.
fn start_output(out: &Path, previous: &[RolloutRecord]) -> std::io::Result<std::fs::File> {
    if previous.is_empty() {
        return std::fs::File::create(out);
    }
    let mut staging = out.as_os_str().to_owned();
    staging.push(".resume");
    let staging = PathBuf::from(staging);
    {
        let mut writer = std::io::BufWriter::new(std::fs::File::create(&staging)?);
        for record in previous {
            serde_json::to_writer(&mut writer, record)?;
            writer.write_all(b"\n")?;
        }
        writer
            .into_inner()
            .map_err(|error| error.into_error())?
            .sync_all()?;
    }
    std::fs::rename(&staging, out)?;
    std::fs::OpenOptions::new().append(true).open(out)
}

/// The summary of one dataset, one fact a line.
fn report(data_name: &str, per_row: usize, summary: &Summary) -> String {
    let mut text = format!(
        "== {data_name}: {} rows x {per_row} rollouts: {} rollouts, {} failed, {} sampler calls, {:.1} rollouts/s\n",
        summary.rows,
        summary.rollouts,
        summary.failed,
        summary.sampler_calls,
        summary.rollouts_per_second()
    );
    for component in &summary.components {
        text.push_str(&format!(
            "reward {} = {:.4} (mean of {})\n",
            component.name, component.mean, component.count
        ));
    }
    match summary.mean_reward {
        Some(mean) => text.push_str(&format!("mean reward = {mean:.4}\n")),
        None => text.push_str("mean reward = n/a (no rollout completed)\n"),
    }
    match &summary.pass_component {
        Some(component) => {
            for (k, value) in &summary.pass_at_k {
                text.push_str(&format!("pass@{k} = {value:.4}\n"));
            }
            text.push_str(&format!(
                "(a rollout passes with full credit on `{component}`)\n"
            ));
        }
        None => text.push_str(
            "pass@k = n/a (no answer check: add ExactAnswer or MathAnswer, or name a reward with \
             --pass-component)\n",
        ),
    }
    text
}
