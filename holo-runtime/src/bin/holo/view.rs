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
    let page = view::render(&source, &tokens);
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
