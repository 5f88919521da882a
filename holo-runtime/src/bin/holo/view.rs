//! `holo view`: rollouts (a rollouts JSONL or a run folder) as one self-contained HTML page, written to a
//! file or served on the loopback interface.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use holo_runtime::view::{self, http, Source, Tokens, ViewError};
use tokenizers::Tokenizer;

use super::{EXIT_FAILURES, EXIT_USAGE};

/// `holo view`'s arguments.
#[derive(clap::Args)]
pub struct ViewArgs {
    /// A rollouts JSONL written by `holo eval` or `holo train`, or a run folder (its rollouts.jsonl and
    /// eval_rollouts.jsonl, and the curves of its metrics.jsonl).
    pub path: PathBuf,
    /// The HTML file to write [default: PATH.html].
    #[arg(long, conflicts_with = "serve")]
    pub out: Option<PathBuf>,
    /// Serve the page on 127.0.0.1 instead of writing it (until interrupted); the address is printed.
    #[arg(long)]
    pub serve: bool,
    /// With --serve: the port (0: a free one).
    #[arg(long, default_value_t = 0, requires = "serve")]
    pub port: u16,
    /// The model folder (tokenizer.json) or .gguf file the rollouts were recorded with, to show each
    /// token's text; a run folder's own model (run.json) is used without it. Without either, tokens
    /// are shown as ids.
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[cfg(feature = "local")]
    /// A model folder or .gguf file whose log-probability of each trained token the page shows beside
    /// the sampler's (and their ratio): the weights a run ended with (`holo export RUN --out DIR`), or the
    /// model that sampled, to check the records. Runs every trained context through it once.
    #[arg(long)]
    pub policy: Option<PathBuf>,
    #[cfg(feature = "local")]
    /// With --policy: the temperature of its distribution [default: the run's `temperature` for a run
    /// folder, else 1].
    #[arg(long, requires = "policy")]
    pub temperature: Option<f64>,
}

pub fn run(args: ViewArgs) -> ExitCode {
    let source = match view::read(&args.path) {
        Ok(source) => source,
        Err(error) => return fail(&error),
    };
    warn_skipped(&source);
    let tokenizer = match &args.model {
        Some(model) => match view::tokenizer(model) {
            Ok(tokenizer) => Some(tokenizer),
            Err(message) => {
                eprintln!("error: --model: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
        },
        None => run_tokenizer(&source),
    };
    let tokens = match &tokenizer {
        Some(tokenizer) => Tokens::Decoded(tokenizer),
        None => Tokens::IdsOnly(
            "no tokenizer: give `holo view --model DIR` the model the rollouts were recorded with"
                .into(),
        ),
    };
    #[cfg(feature = "local")]
    let policy = match &args.policy {
        Some(path) => match policy(&source, path, args.temperature) {
            Ok(policy) => Some(policy),
            Err(code) => return code,
        },
        None => None,
    };
    #[cfg(not(feature = "local"))]
    let policy: Option<view::page::Policy> = None;
    let page = view::render(&source, &tokens, policy.as_ref());
    let done = if args.serve {
        serve(&page, args.port, &source)
    } else {
        let out = args.out.unwrap_or_else(|| default_out(&args.path));
        write(&out, &page, &source)
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => fail(&error),
    }
}

fn fail(error: &ViewError) -> ExitCode {
    eprintln!("error: {error}");
    ExitCode::from(match error {
        ViewError::Input(_) => EXIT_USAGE,
        ViewError::Io(_) => EXIT_FAILURES,
    })
}

fn warn_skipped(source: &Source) {
    for skipped in &source.skipped {
        eprintln!("warning: {skipped}; skipped");
    }
    if !source.skipped.is_empty() {
        eprintln!(
            "{} lines skipped (not records); the page lists them",
            source.skipped.len()
        );
    }
}

/// The tokenizer of the model a run folder names, when it can be loaded here.
fn run_tokenizer(source: &Source) -> Option<Tokenizer> {
    if !source.is_run_folder() {
        return None;
    }
    let model = view::run_model(&source.path)?;
    view::tokenizer(&model)
        .map_err(|message| eprintln!("warning: {message}; tokens are shown as ids"))
        .ok()
}

/// `PATH.html` beside PATH (for a folder, beside the folder).
fn default_out(path: &Path) -> PathBuf {
    // `.` and `..` have no name of their own: the page is named after the folder they are.
    let path = match path.file_name() {
        Some(_) => path.to_path_buf(),
        None => std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
    };
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".html");
    path.with_file_name(name)
}

fn write(out: &Path, page: &str, source: &Source) -> Result<(), ViewError> {
    std::fs::write(out, page)
        .map_err(|error| ViewError::Io(format!("cannot write `{}`: {error}", out.display())))?;
    eprintln!(
        "wrote {} ({} rollouts, {:.1} MB)",
        out.display(),
        source.rollout_count(),
        page.len() as f64 / 1e6
    );
    Ok(())
}

fn serve(page: &str, port: u16, source: &Source) -> Result<(), ViewError> {
    let cannot = |error: std::io::Error| ViewError::Io(format!("cannot serve the page: {error}"));
    let listener = http::bind(port).map_err(cannot)?;
    let address = listener.local_addr().map_err(cannot)?;
    println!("http://{address}/");
    eprintln!(
        "serving {} rollouts of {} on http://{address}/ (Ctrl-C stops)",
        source.rollout_count(),
        source.path.display()
    );
    std::io::stdout().flush().map_err(cannot)?;
    Err(cannot(http::serve(&listener, page)))
}

/// The policy log-probabilities of every rollout's trained tokens under the model at `path`.
#[cfg(feature = "local")]
fn policy(
    source: &Source,
    path: &Path,
    temperature: Option<f64>,
) -> Result<view::page::Policy, ExitCode> {
    let temperature = match temperature {
        Some(value) if value > 0.0 && value.is_finite() => value,
        Some(value) => {
            eprintln!("error: --temperature must be above 0, found {value}");
            return Err(ExitCode::from(EXIT_USAGE));
        }
        None => run_temperature(source)?,
    };
    let policy = match holo_runtime::train::Policy::load(path, &candle_core::Device::Cpu) {
        Ok(policy) => policy,
        Err(error) => {
            eprintln!("error: --policy: {error}");
            return Err(ExitCode::from(EXIT_USAGE));
        }
    };
    // Constrained tokens are scored under their masks, as the trainer scores them.
    let grammars = holo_runtime::local::Grammars::new(
        policy.tokenizer.clone(),
        policy.model.config.vocab_size,
        policy.end_of_turn.clone(),
    );
    let records: Vec<&holo_runtime::loom::RolloutRecord> = source
        .files
        .iter()
        .flat_map(|file| &file.rollouts)
        .map(|rollout| &rollout.record)
        .collect();
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(records.len() as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "scoring with the policy [{bar:30}] {pos}/{len} rollouts, ETA {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    let logprobs = view::policy::logprobs(
        &policy.model,
        &grammars,
        &records,
        temperature,
        16,
        |done| bar.set_position(done as u64),
    );
    bar.finish_and_clear();
    match logprobs {
        Ok(logprobs) => Ok(view::page::Policy {
            name: path.display().to_string(),
            temperature,
            logprobs,
        }),
        Err(error) => {
            eprintln!("error: --policy: the model failed: {error}");
            Err(ExitCode::from(EXIT_FAILURES))
        }
    }
}

/// The sampling temperature of a run folder (its `config.toml`), 1 for anything else.
#[cfg(feature = "local")]
fn run_temperature(source: &Source) -> Result<f64, ExitCode> {
    if !source.is_run_folder() {
        return Ok(1.0);
    }
    let path = source.path.join("config.toml");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(1.0);
    };
    let table: toml::Table = toml::from_str(&text).map_err(|error| {
        eprintln!("error: `{}`: {}", path.display(), error.message());
        ExitCode::from(EXIT_USAGE)
    })?;
    Ok(table
        .get("temperature")
        .and_then(|value| value.as_float().or(value.as_integer().map(|v| v as f64)))
        .unwrap_or(1.0))
}
