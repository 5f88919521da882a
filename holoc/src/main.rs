//! `holoc`: check and format `.hol` files, and print their syntax tree or IR.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use codespan_reporting::term::termcolor::{ColorChoice, StandardStream};
use holoc::diagnostics::Code;
use holoc::{report, scan, Options, Output};

#[derive(Parser)]
#[command(name = "holoc", version, about = "The Holoware compiler")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check .hol files (or folders, searched recursively for *.hol) and report diagnostics.
    Check {
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
        /// Fail (exit 1) when there are warnings.
        #[arg(long)]
        deny_warnings: bool,
        /// Also list each file's inputs: the variables that no sampler binds.
        #[arg(long)]
        inputs: bool,
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Print the syntax tree of a .hol file.
    Ast { file: PathBuf },
    /// Print the IR state machine of a .hol file.
    Ir {
        file: PathBuf,
        /// Print the IR as JSON instead of a listing.
        #[arg(long)]
        json: bool,
    },
    /// Print the Rust module that include_holoware! generates for a .hol file.
    Expand { file: PathBuf },
    /// Explain an error code, such as H0005.
    Explain { code: String },
    /// Serve the language server protocol on stdin and stdout, for editors.
    Lsp,
    /// Rewrite .hol files (or folders, searched recursively for *.hol) in the canonical layout.
    Fmt {
        /// Change no file: list the files that would change, and exit 1 if there are any.
        #[arg(long)]
        check: bool,
        /// Format the text read from stdin and write it to stdout.
        #[arg(long, conflicts_with = "paths")]
        stdin: bool,
        /// Files and folders; the current folder when none is given.
        paths: Vec<PathBuf>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    /// Rich text on stderr, as rustc prints.
    Human,
    /// One JSON array of diagnostics on stdout.
    Json,
    /// GitHub Actions annotations on stdout.
    Github,
}

const EXIT_ERRORS: u8 = 1;
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check {
            format,
            deny_warnings,
            inputs,
            paths,
        } => check(format, deny_warnings, inputs, &paths),
        Command::Ast { file } => show(&file, |output| {
            output
                .document
                .as_ref()
                .map(|document| format!("{document:#?}\n"))
        }),
        Command::Ir { file, json } => show(&file, |output| {
            output.program.as_ref().map(|program| {
                if json {
                    serde_json::to_string_pretty(program).expect("the IR serializes") + "\n"
                } else {
                    program.to_string()
                }
            })
        }),
        Command::Expand { file } => {
            let settings = holoc::codegen::Settings::new(
                holoc::codegen::module_name(
                    &file.file_stem().unwrap_or_default().to_string_lossy(),
                ),
                file.file_name().unwrap_or_default().to_string_lossy(),
            );
            show(&file, |output| {
                output.program.as_ref().map(|program| {
                    holoc::codegen::pretty(holoc::codegen::module(program, &settings))
                })
            })
        }
        Command::Fmt {
            check,
            stdin,
            paths,
        } => {
            if stdin {
                format_stdin(check)
            } else if paths.is_empty() {
                format_paths(check, &[PathBuf::from(".")])
            } else {
                format_paths(check, &paths)
            }
        }
        Command::Lsp => match holoc::lsp::run_stdio() {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("error: holoc lsp: {error}");
                ExitCode::from(EXIT_USAGE)
            }
        },
        Command::Explain { code } => match Code::from_id(&code) {
            Some(code) => {
                print_out(&format!(
                    "{} ({}): {}\n\n{}\n",
                    code.id(),
                    severity_name(code),
                    code.title(),
                    code.explanation()
                ));
                ExitCode::SUCCESS
            }
            None => {
                eprintln!("error: no diagnostic has the code `{code}`");
                ExitCode::from(EXIT_USAGE)
            }
        },
    }
}

fn severity_name(code: Code) -> &'static str {
    match code.severity() {
        holoc::diagnostics::Severity::Error => "error",
        holoc::diagnostics::Severity::Warning => "warning",
    }
}

/// Compiles one file and prints `render`'s view of it, or its diagnostics when there is nothing to show.
fn show(file: &Path, render: impl Fn(&Output) -> Option<String>) -> ExitCode {
    let bytes = match std::fs::read(file) {
        Ok(bytes) => bytes,
        Err(error) => {
            eprintln!("error: cannot read `{}`: {error}", file.display());
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let output = holoc::compile(&bytes, &Crates::default().options(file).for_file(file));
    let name = file.display().to_string();
    let mut stderr = StandardStream::stderr(stderr_colors());
    let source = report::SourceFile::new(&name, &output.source);
    for diagnostic in &output.diagnostics {
        let _ = source.emit(&mut stderr, diagnostic);
    }
    let Some(text) = render(&output) else {
        return ExitCode::from(EXIT_ERRORS);
    };
    print_out(&text);
    if output.has_errors() {
        ExitCode::from(EXIT_ERRORS)
    } else {
        ExitCode::SUCCESS
    }
}

/// What formatting one file's text came to.
enum Formatted {
    Unchanged,
    Changed(String),
    /// Not formatted: the reasons were printed on stderr.
    Failed,
}

/// Formats the contents of the file `name`; prints on stderr why it cannot be formatted.
fn format_text(name: &str, bytes: &[u8]) -> Formatted {
    let text = match holoc::decode(bytes) {
        Ok(text) => text,
        Err(invalid) => {
            let source = report::SourceFile::new(name, &invalid.lossy);
            let _ = source.emit(
                &mut StandardStream::stderr(stderr_colors()),
                &invalid.diagnostic,
            );
            return Formatted::Failed;
        }
    };
    match holoc::fmt::format(text) {
        Ok(formatted) if formatted == text => Formatted::Unchanged,
        Ok(formatted) => Formatted::Changed(formatted),
        Err(holoc::fmt::Error::Invalid(diagnostics)) => {
            let source = report::SourceFile::new(name, text);
            let mut stderr = StandardStream::stderr(stderr_colors());
            for diagnostic in &diagnostics {
                let _ = source.emit(&mut stderr, diagnostic);
            }
            eprintln!("error: `{name}` was not formatted: it has errors");
            Formatted::Failed
        }
        Err(error) => {
            eprintln!("error: {name}:{error}");
            Formatted::Failed
        }
    }
}

/// `holoc fmt --stdin`: the formatted text on stdout, or the text unchanged when it cannot be formatted
/// (so that an editor piping a buffer through the command never loses it).
fn format_stdin(check: bool) -> ExitCode {
    let mut bytes = Vec::new();
    if let Err(error) = std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut bytes) {
        eprintln!("error: cannot read stdin: {error}");
        return ExitCode::from(EXIT_USAGE);
    }
    match format_text("<stdin>", &bytes) {
        Formatted::Unchanged => {
            if !check {
                let _ = std::io::stdout().lock().write_all(&bytes);
            }
            ExitCode::SUCCESS
        }
        Formatted::Changed(formatted) => {
            if check {
                print_out("would reformat <stdin>\n");
                ExitCode::from(EXIT_ERRORS)
            } else {
                print_out(&formatted);
                ExitCode::SUCCESS
            }
        }
        Formatted::Failed => {
            if !check {
                let _ = std::io::stdout().lock().write_all(&bytes);
            }
            ExitCode::from(EXIT_ERRORS)
        }
    }
}

/// `holoc fmt PATHS`: rewrites each file that is not in the canonical layout, or with `check` names it on
/// stdout with its first changed line. Files with errors are left as they are, their diagnostics on stderr.
fn format_paths(check: bool, paths: &[PathBuf]) -> ExitCode {
    let mut io_failed = false;
    let mut files = Vec::new();
    for path in paths {
        if let Err(message) = collect_hol_files(path, &mut files) {
            eprintln!("error: {message}");
            io_failed = true;
        }
    }
    let (mut changed, mut failed) = (0usize, 0usize);
    for file in &files {
        let name = file.display().to_string();
        let bytes = match std::fs::read(file) {
            Ok(bytes) => bytes,
            Err(error) => {
                eprintln!("error: cannot read `{name}`: {error}");
                io_failed = true;
                continue;
            }
        };
        match format_text(&name, &bytes) {
            Formatted::Unchanged => {}
            Formatted::Failed => failed += 1,
            Formatted::Changed(formatted) => {
                changed += 1;
                if check {
                    let line = first_changed_line(&String::from_utf8_lossy(&bytes), &formatted);
                    print_out(&format!("would reformat {name} (from line {line})\n"));
                } else if let Err(error) = std::fs::write(file, &formatted) {
                    eprintln!("error: cannot write `{name}`: {error}");
                    io_failed = true;
                }
            }
        }
    }
    let verb = if check {
        "would reformat"
    } else {
        "reformatted"
    };
    eprintln!(
        "{verb} {changed} of {} file{}{}",
        files.len(),
        plural(files.len()),
        if failed > 0 {
            format!("; {failed} not formatted because of errors")
        } else {
            String::new()
        }
    );
    if io_failed {
        ExitCode::from(EXIT_USAGE)
    } else if failed > 0 || (check && changed > 0) {
        ExitCode::from(EXIT_ERRORS)
    } else {
        ExitCode::SUCCESS
    }
}

/// The 1-based number of the first line where `before` and `after` differ.
fn first_changed_line(before: &str, after: &str) -> usize {
    let mut before_lines = before.split('\n');
    let mut after_lines = after.split('\n');
    let mut line = 1;
    loop {
        match (before_lines.next(), after_lines.next()) {
            (None, None) => return line,
            (a, b) if a != b => return line,
            _ => line += 1,
        }
    }
}

/// Checker options per crate: each crate that holds checked files is scanned once for its holotypes.
struct Crates {
    scanned: BTreeMap<PathBuf, Options>,
    outside: Options,
}

impl Default for Crates {
    fn default() -> Self {
        Crates {
            scanned: BTreeMap::new(),
            outside: Options::with_builtins(None),
        }
    }
}

impl Crates {
    fn options(&mut self, file: &Path) -> &Options {
        match scan::crate_root(file) {
            Some(root) => self
                .scanned
                .entry(root.clone())
                .or_insert_with(|| Options::with_builtins(Some(scan::scan_crate(&root)))),
            None => &self.outside,
        }
    }
}

fn check(format: Format, deny_warnings: bool, show_inputs: bool, paths: &[PathBuf]) -> ExitCode {
    let mut io_failed = false;
    let mut files = Vec::new();
    for path in paths {
        if let Err(message) = collect_hol_files(path, &mut files) {
            eprintln!("error: {message}");
            io_failed = true;
        }
    }

    let mut crates = Crates::default();
    let mut stderr = StandardStream::stderr(stderr_colors());
    let (mut errors, mut warnings) = (0usize, 0usize);
    let mut json_diagnostics = Vec::new();
    let mut json_inputs = serde_json::Map::new();
    for file in &files {
        let name = file.display().to_string();
        let bytes = match std::fs::read(file) {
            Ok(bytes) => bytes,
            Err(error) => {
                eprintln!("error: cannot read `{name}`: {error}");
                io_failed = true;
                continue;
            }
        };
        let output = holoc::compile(&bytes, &crates.options(file).for_file(file));
        let source = report::SourceFile::new(&name, &output.source);
        for diagnostic in &output.diagnostics {
            if diagnostic.is_error() {
                errors += 1;
            } else {
                warnings += 1;
            }
            match format {
                Format::Human => {
                    let _ = source.emit(&mut stderr, diagnostic);
                }
                Format::Json => json_diagnostics.push(
                    serde_json::to_value(report::json(&name, diagnostic))
                        .expect("diagnostics serialize"),
                ),
                Format::Github => print_out(&format!("{}\n", report::github(&name, diagnostic))),
            }
        }
        if show_inputs {
            if let Some(program) = &output.program {
                if format == Format::Json {
                    json_inputs.insert(name.clone(), inputs_json(program));
                } else {
                    print_inputs(&name, program);
                }
            }
        }
    }

    if format == Format::Json {
        let value = if show_inputs {
            serde_json::json!({ "diagnostics": json_diagnostics, "inputs": json_inputs })
        } else {
            serde_json::Value::Array(json_diagnostics)
        };
        let json = serde_json::to_string_pretty(&value).expect("JSON serializes");
        print_out(&format!("{json}\n"));
    } else if format == Format::Human {
        let _ = writeln!(
            stderr,
            "checked {} file{}: {} error{}, {} warning{}",
            files.len(),
            plural(files.len()),
            errors,
            plural(errors),
            warnings,
            plural(warnings)
        );
    }

    if io_failed {
        ExitCode::from(EXIT_USAGE)
    } else if errors > 0 || (deny_warnings && warnings > 0) {
        ExitCode::from(EXIT_ERRORS)
    } else {
        ExitCode::SUCCESS
    }
}

/// Colour only on a terminal; termcolor's `Auto` also honours NO_COLOR and TERM=dumb.
fn stderr_colors() -> ColorChoice {
    if std::io::stderr().is_terminal() {
        ColorChoice::Auto
    } else {
        ColorChoice::Never
    }
}

fn plural(count: usize) -> &'static str {
    if count == 1 {
        ""
    } else {
        "s"
    }
}

fn print_inputs(name: &str, program: &holoc::ir::Program) {
    let mut text = format!("{name}:\n");
    if program.inputs.is_empty() {
        text.push_str("  (no inputs)\n");
    }
    for input in &program.inputs {
        let need = if input.required {
            "required"
        } else {
            "optional"
        };
        let lines: Vec<String> = input
            .uses
            .iter()
            .map(|span| span.start.line.to_string())
            .collect();
        text.push_str(&format!(
            "  {:<24} {need:<8}  line {}\n",
            input.name,
            lines.join(", ")
        ));
    }
    print_out(&text);
}

/// Writes to stdout; a closed pipe (`holoc ... | head`) is not worth a panic.
fn print_out(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
}

fn inputs_json(program: &holoc::ir::Program) -> serde_json::Value {
    program
        .inputs
        .iter()
        .map(|input| {
            let uses: Vec<_> = input
                .uses
                .iter()
                .map(
                    |span| serde_json::json!({ "line": span.start.line, "column": span.start.col }),
                )
                .collect();
            serde_json::json!({ "name": input.name, "required": input.required, "uses": uses })
        })
        .collect()
}

/// Adds `path` if it is a file, or every `*.hol` under it (sorted) if it is a folder.
fn collect_hol_files(path: &Path, files: &mut Vec<PathBuf>) -> Result<(), String> {
    let metadata = std::fs::metadata(path)
        .map_err(|error| format!("cannot read `{}`: {error}", path.display()))?;
    if metadata.is_file() {
        files.push(path.to_path_buf());
        return Ok(());
    }
    let found = holoc::hol_files(path)
        .map_err(|error| format!("cannot read `{}`: {error}", path.display()))?;
    if found.is_empty() {
        return Err(format!("no .hol files under `{}`", path.display()));
    }
    files.extend(found);
    Ok(())
}
