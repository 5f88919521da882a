//! `holo`: run holowares. `holo dry FILE.hol` runs rollouts with a scripted sampler and prints what
//! would be trained; `holo eval FILE.hol --data rows.jsonl` runs a dataset through the Loom, writes the
//! rollouts as JSONL and prints the mean rewards and pass@k.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};
use holo_runtime::holotypes::{self, Tools};
use holo_runtime::interpreter::{Holoware, Row};
use holo_runtime::loom::{Loom, LoomConfig, RolloutRecord, Summary};
use holo_runtime::{
    Completion, OpenAi, OpenAiConfig, Recorder, Resources, Rollout, RolloutError, Sampler,
    Scripted, Step, Transcript,
};

#[derive(Parser)]
#[command(name = "holo", version, about = "Run Holoware environments")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run rollouts of a .hol file with scripted replies (or a model) and print each transcript,
    /// sampled text highlighted (what training would learn from).
    Dry {
        file: PathBuf,
        /// Data rows, one JSON object per line. Without it, one row gives each input the value `<name>`.
        #[arg(long)]
        data: Option<PathBuf>,
        /// Rollouts per row.
        #[arg(short = 'n', long, default_value_t = 1)]
        rollouts: usize,
        #[arg(long, value_enum, default_value_t = Color::Auto)]
        color: Color,
        #[command(flatten)]
        sampler: SamplerArgs,
    },
    /// Run a dataset through the Loom: G rollouts per row, every pending request of a tick sampled in
    /// one batch. Writes each rollout as a JSONL line as it finishes, then prints the mean of each reward
    /// component, the mean total reward and pass@k (k = 1 and G; a rollout passes when it completed with
    /// a total reward > 0). Exit status 1 when a row or a rollout failed.
    Eval {
        file: PathBuf,
        /// Data rows, one JSON object per line; repeat for several datasets (each summarized apart).
        #[arg(long, required = true)]
        data: Vec<PathBuf>,
        /// Rollouts per row (G).
        #[arg(short = 'n', long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        rollouts: u32,
        #[command(flatten)]
        sampler: SamplerArgs,
        /// Where the rollouts are written, one JSON object per line.
        #[arg(long, default_value = "rollouts.jsonl")]
        out: PathBuf,
        /// The run seed; every rollout's sampling seed is derived from it, the row and the rollout.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Rollouts in flight at once: the largest batch, and the most requests sent to a server at
        /// once.
        #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
        concurrency: u32,
    },
}

/// Where completions come from, shared by `dry` and `eval`.
#[derive(Args)]
struct SamplerArgs {
    /// `openai` samples from a server through the Loom instead of the scripted --reply texts.
    #[arg(long, value_enum, default_value_t = SamplerKind::Scripted)]
    sampler: SamplerKind,
    /// The OpenAI-compatible server (`http://host:port`, with or without `/v1`); the API key is read
    /// from OPENAI_API_KEY.
    #[arg(long, required_if_eq("sampler", "openai"))]
    base_url: Option<String>,
    /// The model the server serves.
    #[arg(long, required_if_eq("sampler", "openai"))]
    model: Option<String>,
    /// A scripted reply; repeat to give several, used in turn (the list repeats).
    #[arg(long = "reply")]
    replies: Vec<String>,
}

impl SamplerArgs {
    /// The `openai` sampler with at most `concurrency` requests in flight, or `None` for the scripted
    /// replies.
    fn server(&self, concurrency: usize) -> Result<Option<OpenAi>, ExitCode> {
        match self.sampler {
            SamplerKind::Scripted => Ok(None),
            SamplerKind::Openai if !self.replies.is_empty() => {
                eprintln!("error: --reply is for the scripted sampler");
                Err(ExitCode::from(EXIT_USAGE))
            }
            SamplerKind::Openai => {
                let config = OpenAiConfig {
                    max_concurrency: concurrency,
                    ..OpenAiConfig::new(
                        self.base_url.clone().unwrap_or_default(),
                        self.model.clone().unwrap_or_default(),
                    )
                };
                OpenAi::new(config).map(Some).map_err(|error| {
                    eprintln!("error: {error}");
                    ExitCode::from(EXIT_USAGE)
                })
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SamplerKind {
    /// Scripted replies (--reply): reproducible, no model.
    Scripted,
    /// An OpenAI-compatible server (--base-url, --model).
    Openai,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Color {
    Auto,
    Always,
    Never,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Dry {
            file,
            data,
            rollouts,
            color,
            sampler: sampler_args,
        } => {
            let sampler = match sampler_args.server(128) {
                Ok(sampler) => sampler,
                Err(code) => return code,
            };
            let color = match color {
                Color::Always => true,
                Color::Never => false,
                Color::Auto => {
                    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
                }
            };
            dry(
                &file,
                data.as_deref(),
                rollouts,
                &sampler_args.replies,
                sampler.as_ref().map(|sampler| sampler as &dyn Sampler),
                color,
            )
        }
        Command::Eval {
            file,
            data,
            rollouts,
            sampler: sampler_args,
            out,
            seed,
            concurrency,
        } => {
            let sampler: Box<dyn Sampler> = match sampler_args.server(concurrency as usize) {
                Ok(Some(server)) => Box::new(server),
                Ok(None) if sampler_args.replies.is_empty() => {
                    Box::new(Scripted::new(["<answer>42</answer>"]))
                }
                Ok(None) => Box::new(Scripted::new(sampler_args.replies)),
                Err(code) => return code,
            };
            let config = LoomConfig {
                rollouts_per_row: rollouts as usize,
                seed,
                concurrency: concurrency as usize,
                progress: true,
                ..LoomConfig::default()
            };
            eval(&file, &data, &*sampler, config, &out)
        }
    }
}

const EXIT_FAILURES: u8 = 1;
const EXIT_USAGE: u8 = 2;

fn dry(
    file: &Path,
    data: Option<&Path>,
    rollouts: usize,
    replies: &[String],
    sampler: Option<&dyn Sampler>,
    color: bool,
) -> ExitCode {
    let holoware = match load(file) {
        Ok(holoware) => holoware,
        Err(exit) => return exit,
    };
    let rows = match data {
        Some(path) => match read_rows(path) {
            Ok(rows) => rows,
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
        },
        None => vec![(1, Ok(placeholder_row(&holoware)))],
    };
    let data_name = data.map_or_else(
        || "placeholder".to_string(),
        |path| path.display().to_string(),
    );
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());
    let replies: Vec<String> = if replies.is_empty() {
        vec!["<answer>42</answer>".to_string()]
    } else {
        replies.to_vec()
    };

    let mut failures = 0;
    let mut stdout = std::io::stdout().lock();
    let mut sampled_rows = Vec::new();
    for (line, row) in rows {
        let row = match row {
            Ok(row) => row,
            Err(message) => {
                eprintln!("error: {data_name}:{line}: {message}");
                failures += 1;
                continue;
            }
        };
        if let Err(missing) = holoware.check_row(&row) {
            eprintln!("error: {data_name}:{line}: {missing}");
            failures += 1;
            continue;
        }
        if sampler.is_some() {
            sampled_rows.push((line, row));
            continue;
        }
        for rollout in 1..=rollouts {
            let mut transcript = Transcript::default();
            let outcome = run(
                &holoware,
                &row,
                &resources,
                replies.iter().cycle(),
                &mut transcript,
            );
            let header = format!(
                "# row {line}, rollout {rollout}, reward {}\n",
                transcript.reward()
            );
            let _ = writeln!(stdout, "{header}{}", transcript.render(color));
            if let Err(error) = outcome {
                eprintln!("error: {data_name}:{line}: rollout {rollout}: {error}");
                failures += 1;
            }
        }
    }
    if let Some(sampler) = sampler {
        match dry_loom(
            &holoware,
            &resources,
            &sampled_rows,
            rollouts,
            sampler,
            color,
            &data_name,
            &mut stdout,
        ) {
            Ok(failed) => failures += failed,
            Err(code) => return code,
        }
    }
    if failures > 0 {
        ExitCode::from(EXIT_FAILURES)
    } else {
        ExitCode::SUCCESS
    }
}

/// `holo dry` with a model: the rows (indexed by their line) run through the Loom, then each transcript
/// is printed in row and rollout order. Returns how many rollouts failed.
#[allow(clippy::too_many_arguments)]
fn dry_loom(
    holoware: &Arc<Holoware>,
    resources: &Resources,
    rows: &[(usize, Row)],
    rollouts: usize,
    sampler: &dyn Sampler,
    color: bool,
    data_name: &str,
    stdout: &mut impl Write,
) -> Result<usize, ExitCode> {
    let runtime = runtime()?;
    let loom = Loom::interpreted(
        Arc::clone(holoware),
        resources.clone(),
        LoomConfig {
            rollouts_per_row: rollouts.max(1),
            progress: true,
            timing: false,
            ..LoomConfig::default()
        },
    );
    let mut jsonl = Vec::new();
    if let Err(error) = runtime.block_on(loom.run(rows, sampler, &mut jsonl)) {
        eprintln!("error: {error}");
        return Err(ExitCode::from(EXIT_FAILURES));
    }
    let mut records: Vec<RolloutRecord> = jsonl
        .split(|&byte| byte == b'\n')
        .filter(|line| !line.is_empty())
        .filter_map(|line| serde_json::from_slice(line).ok())
        .collect();
    records.sort_by_key(|record| (record.row_index, record.rollout_index));
    let mut failed = 0;
    for record in &records {
        let mut transcript = Transcript::default();
        for context in &record.contexts {
            transcript.begin_context(context.trained);
            for message in &context.messages {
                transcript.begin_message(message.role);
                for part in &message.parts {
                    if part.sampled {
                        transcript.completion(&Completion {
                            text: part.text.clone(),
                            ..Completion::default()
                        });
                    } else {
                        transcript.text(&part.text);
                    }
                }
            }
        }
        for (name, value) in &record.rewards {
            let weight = record.weights.get(name).copied().unwrap_or(1.0);
            Recorder::reward(&mut transcript, name, *value, weight);
        }
        let (line, rollout) = (record.row_index, record.rollout_index + 1);
        let _ = writeln!(
            stdout,
            "# row {line}, rollout {rollout}, reward {}\n{}",
            record.reward,
            transcript.render(color)
        );
        if let Some(error) = &record.error {
            eprintln!(
                "error: {data_name}:{line}: rollout {rollout}: {}",
                error.message
            );
            failed += 1;
        }
    }
    Ok(failed)
}

fn runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| {
            eprintln!("error: cannot start the async runtime: {error}");
            ExitCode::from(EXIT_USAGE)
        })
}

fn eval(
    file: &Path,
    datasets: &[PathBuf],
    sampler: &dyn Sampler,
    config: LoomConfig,
    out: &Path,
) -> ExitCode {
    let holoware = match load(file) {
        Ok(holoware) => holoware,
        Err(exit) => return exit,
    };
    let mut datasets_rows = Vec::with_capacity(datasets.len());
    for path in datasets {
        match read_rows(path) {
            Ok(rows) => datasets_rows.push((path.display().to_string(), rows)),
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
        }
    }
    let mut writer = match std::fs::File::create(out) {
        Ok(file) => std::io::BufWriter::new(file),
        Err(error) => {
            eprintln!("error: cannot create `{}`: {error}", out.display());
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());

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
        let loom = Loom::interpreted(
            Arc::clone(&holoware),
            resources.clone(),
            LoomConfig {
                dataset: Some(data_name.clone()),
                ..config.clone()
            },
        );
        let summary = match runtime.block_on(loom.run(&good, sampler, &mut writer)) {
            Ok(summary) => summary,
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

/// The summary of one dataset, one fact a line.
fn report(data_name: &str, per_row: usize, summary: &Summary) -> String {
    let mut text = format!(
        "== {data_name}: {} rows x {per_row} rollouts: {} rollouts, {} failed, {} batches, {:.1} rollouts/s\n",
        summary.rows,
        summary.rollouts,
        summary.failed,
        summary.batches,
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
    for (k, value) in &summary.pass_at_k {
        text.push_str(&format!("pass@{k} = {value:.4}\n"));
    }
    text
}

fn run<'r>(
    holoware: &Arc<Holoware>,
    row: &Row,
    resources: &Resources,
    replies: impl Iterator<Item = &'r String>,
    transcript: &mut Transcript,
) -> Result<(), RolloutError> {
    let mut rollout = holoware.start_with(row, resources)?;
    let mut sampler = Scripted::new(replies.take(1000).cloned());
    while let Step::Sample(request) = rollout.step(transcript)? {
        let completion = sampler
            .complete(&request)
            .ok_or(RolloutError::Protocol("the scripted replies ran out"))?;
        rollout.resume(completion, transcript)?;
    }
    Ok(())
}

/// Every input as `<name>`: enough to see the shape of a holoware without data.
/// Reads and checks a `.hol` file: an unreadable file is a usage error (2), diagnostics a failure (1).
fn load(file: &Path) -> Result<Arc<Holoware>, ExitCode> {
    let bytes = std::fs::read(file).map_err(|error| {
        eprintln!("error: cannot read `{}`: {error}", file.display());
        ExitCode::from(EXIT_USAGE)
    })?;
    let name = file.display().to_string();
    match Holoware::load(&name, &bytes, Arc::new(holotypes::registry())) {
        Ok(holoware) => Ok(Arc::new(holoware)),
        Err(error) => {
            eprint!("{error}");
            Err(ExitCode::from(EXIT_FAILURES))
        }
    }
}

/// Every input as `<name>`, and every column a built-in reward compares with (`target=`, by default
/// `expected`) as `<column>`: enough to see the shape of a holoware without data.
fn placeholder_row(holoware: &Holoware) -> Row {
    let program = holoware.program();
    let targets = program
        .holotypes
        .iter()
        .filter(|holotype| {
            holotype.builtin && matches!(holotype.name.as_str(), "ExactAnswer" | "MathAnswer")
        })
        .map(|holotype| {
            holotype
                .args
                .iter()
                .find(|arg| arg.name.as_deref() == Some("target"))
                .map_or_else(
                    || "expected".to_string(),
                    |arg| arg.value.to_string().trim_matches('"').to_string(),
                )
        });
    program
        .inputs
        .iter()
        .map(|input| input.name.clone())
        .chain(targets)
        .map(|name| {
            let value = serde_json::Value::String(format!("<{name}>"));
            (name, value)
        })
        .collect()
}

/// The rows of a JSONL file, each with its line number; a line that is not a JSON object is an error
/// for that row only. Blank lines are skipped.
type NumberedRow = (usize, Result<Row, String>);

fn read_rows(path: &Path) -> Result<Vec<NumberedRow>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| format!("cannot read `{}`: {error}", path.display()))?;
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(index, line)| {
            let row = match serde_json::from_str::<serde_json::Value>(line) {
                Ok(serde_json::Value::Object(row)) => Ok(row),
                Ok(_) => Err("a row must be a JSON object".to_string()),
                Err(error) => {
                    // serde_json's message ends with ` at line 1 column N`; the line is the file's.
                    let message = error.to_string();
                    let message = message
                        .split(" at line ")
                        .next()
                        .unwrap_or(&message)
                        .to_string();
                    Err(format!(
                        "column {}: invalid JSON: {message}",
                        error.column()
                    ))
                }
            };
            (index + 1, row)
        })
        .collect())
}
