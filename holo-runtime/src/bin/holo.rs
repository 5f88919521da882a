//! `holo`: run holowares. `holo dry FILE.hol` runs rollouts with a scripted sampler and prints what
//! would be trained.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand, ValueEnum};
use holo_runtime::holotypes::{self, Tools};
use holo_runtime::interpreter::{Holoware, Row};
use holo_runtime::{Resources, Rollout, RolloutError, Scripted, Step, Transcript};

#[derive(Parser)]
#[command(name = "holo", version, about = "Run Holoware environments")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run rollouts of a .hol file with scripted replies and print each transcript, sampled text
    /// highlighted (what training would learn from).
    Dry {
        file: PathBuf,
        /// Data rows, one JSON object per line. Without it, one row gives each input the value `<name>`.
        #[arg(long)]
        data: Option<PathBuf>,
        /// Rollouts per row.
        #[arg(short = 'n', long, default_value_t = 1)]
        rollouts: usize,
        /// A scripted reply; repeat to give several, used in turn (and again from the start).
        #[arg(long = "reply")]
        replies: Vec<String>,
        #[arg(long, value_enum, default_value_t = Color::Auto)]
        color: Color,
    },
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
            replies,
            color,
        } => {
            let color = match color {
                Color::Always => true,
                Color::Never => false,
                Color::Auto => {
                    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
                }
            };
            dry(&file, data.as_deref(), rollouts, &replies, color)
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
    color: bool,
) -> ExitCode {
    let holoware = match Holoware::open(file, Arc::new(holotypes::registry())) {
        Ok(holoware) => Arc::new(holoware),
        Err(error) => {
            eprint!("{error}");
            return ExitCode::from(EXIT_FAILURES);
        }
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
    if failures > 0 {
        ExitCode::from(EXIT_FAILURES)
    } else {
        ExitCode::SUCCESS
    }
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
fn placeholder_row(holoware: &Holoware) -> Row {
    holoware
        .program()
        .inputs
        .iter()
        .map(|input| {
            (
                input.name.clone(),
                serde_json::Value::String(format!("<{}>", input.name)),
            )
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
                Err(error) => Err(format!("column {}: invalid JSON: {error}", error.column())),
            };
            (index + 1, row)
        })
        .collect())
}
