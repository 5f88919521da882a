//! Renders diagnostics: rich text through codespan-reporting (with or without colour), JSON objects, and
//! GitHub Actions annotations.

use codespan_reporting::diagnostic as cs;
use codespan_reporting::files::SimpleFile;
use codespan_reporting::term::{self, termcolor::WriteColor};
use serde::Serialize;

use crate::diagnostics::{Diagnostic, Severity};

/// A source file prepared for rendering its diagnostics as rich text. Build it once per file: it indexes
/// the file's lines.
pub struct SourceFile<'a> {
    file: SimpleFile<&'a str, &'a str>,
}

/// rustc's look: `-->`, `|` and `^` in plain ASCII.
fn config() -> term::Config {
    term::Config {
        chars: term::Chars::ascii(),
        ..term::Config::default()
    }
}

impl<'a> SourceFile<'a> {
    pub fn new(name: &'a str, source: &'a str) -> Self {
        SourceFile {
            file: SimpleFile::new(name, source),
        }
    }

    /// Plain text, as rustc prints it without colour: header, `--> file:line:col`, excerpt, help.
    pub fn plain(&self, diagnostic: &Diagnostic) -> String {
        term::emit_into_string(&config(), &self.file, &to_codespan(diagnostic))
            .unwrap_or_else(|error| format!("{}: {}: {error}", diagnostic.code, diagnostic.message))
    }

    /// Rich text to a terminal writer (coloured when the writer supports it).
    pub fn emit(
        &self,
        writer: &mut dyn WriteColor,
        diagnostic: &Diagnostic,
    ) -> std::io::Result<()> {
        term::emit_to_write_style(writer, &config(), &self.file, &to_codespan(diagnostic))
            .map_err(std::io::Error::other)
    }
}

fn to_codespan(diagnostic: &Diagnostic) -> cs::Diagnostic<()> {
    let severity = match diagnostic.severity {
        Severity::Error => cs::Severity::Error,
        Severity::Warning => cs::Severity::Warning,
    };
    let labels = diagnostic
        .labels
        .iter()
        .map(|label| {
            let style = if label.primary {
                cs::LabelStyle::Primary
            } else {
                cs::LabelStyle::Secondary
            };
            cs::Label::new(style, (), label.span.range()).with_message(&label.message)
        })
        .collect();
    let mut notes: Vec<String> = diagnostic
        .notes
        .iter()
        .map(|note| format!("note: {note}"))
        .collect();
    if let Some(help) = &diagnostic.help {
        notes.push(format!("help: {help}"));
    }
    cs::Diagnostic::new(severity)
        .with_code(diagnostic.code.id())
        .with_message(&diagnostic.message)
        .with_labels(labels)
        .with_notes(notes)
}

/// One diagnostic as `holoc check --format json` prints it. Lines and columns are 1-based; columns count
/// characters.
#[derive(Debug, Serialize)]
pub struct JsonDiagnostic<'a> {
    pub file: &'a str,
    pub line: u32,
    pub column: u32,
    pub end_line: u32,
    pub end_column: u32,
    pub severity: Severity,
    pub code: &'static str,
    pub message: &'a str,
    pub help: Option<&'a str>,
}

pub fn json<'a>(file_name: &'a str, diagnostic: &'a Diagnostic) -> JsonDiagnostic<'a> {
    let span = diagnostic.span();
    JsonDiagnostic {
        file: file_name,
        line: span.start.line,
        column: span.start.col,
        end_line: span.end.line,
        end_column: span.end.col,
        severity: diagnostic.severity,
        code: diagnostic.code.id(),
        message: &diagnostic.message,
        help: diagnostic.help.as_deref(),
    }
}

/// A GitHub Actions workflow command: `::error file=…,line=…,col=…::message`.
pub fn github(file_name: &str, diagnostic: &Diagnostic) -> String {
    let span = diagnostic.span();
    let level = match diagnostic.severity {
        Severity::Error => "error",
        Severity::Warning => "warning",
    };
    let mut message = format!("{}: {}", diagnostic.code, diagnostic.message);
    if let Some(help) = &diagnostic.help {
        message.push_str("\nhelp: ");
        message.push_str(help);
    }
    format!(
        "::{level} file={},line={},col={},endLine={},endColumn={},title={}::{}",
        escape_property(file_name),
        span.start.line,
        span.start.col,
        span.end.line,
        span.end.col,
        diagnostic.code,
        escape_data(&message)
    )
}

/// Escaping of GitHub workflow command data (the message).
fn escape_data(text: &str) -> String {
    text.replace('%', "%25")
        .replace('\r', "%0D")
        .replace('\n', "%0A")
}

/// Escaping of GitHub workflow command properties (file=..., title=...).
fn escape_property(text: &str) -> String {
    escape_data(text).replace(':', "%3A").replace(',', "%2C")
}
