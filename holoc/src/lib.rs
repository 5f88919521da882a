//! The Holoware compiler front end.
//!
//! `.hol` bytes → [`lexer`] → [`parser`] → [`ast`] → [`sema`] → [`ir`]. [`compile`] runs the whole front end;
//! `holoc check`, `holoc ir` and the `include_holoware!` macro all call it, so they accept and reject
//! exactly the same files. [`fmt`] rewrites a file in its canonical layout (`holoc fmt`), and `lsp` (feature
//! `lsp`, on with `cli`) serves both to editors (`holoc lsp`).

pub mod ast;
pub mod build;
pub mod builtins;
pub mod codegen;
pub mod diagnostics;
pub mod fmt;
pub mod ir;
pub mod lexer;
#[cfg(feature = "lsp")]
pub mod lsp;
pub mod parser;
pub mod report;
pub mod scan;
pub mod sema;
pub mod span;

use std::path::{Path, PathBuf};

use diagnostics::{Code, Diagnostic};
pub use sema::Options;
use span::LineIndex;

/// The result of compiling one file.
#[derive(Debug)]
pub struct Output {
    /// The source as text (invalid UTF-8 replaced), for rendering diagnostics.
    pub source: String,
    /// The syntax tree, when the file lexed and parsed.
    pub document: Option<ast::Document>,
    /// The checked program, when there were no errors.
    pub program: Option<ir::Program>,
    /// Errors and warnings, in source order within each stage.
    pub diagnostics: Vec<Diagnostic>,
}

impl Output {
    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(Diagnostic::is_error)
    }
}

/// Runs the front end on the bytes of one `.hol` file. Never panics; every problem is a diagnostic.
///
/// Stages stop at the first one that reports errors, so a mistake yields its own diagnostic and not a
/// cascade: all lexical errors (one per line), else the first syntax error, else every semantic error.
pub fn compile(bytes: &[u8], options: &Options) -> Output {
    let source = match decode(bytes) {
        Ok(source) => source.to_string(),
        Err(invalid) => {
            return Output {
                source: invalid.lossy,
                document: None,
                program: None,
                diagnostics: vec![invalid.diagnostic],
            };
        }
    };
    let index = LineIndex::new(&source);
    let lexed = lexer::lex(&source, &index);
    if !lexed.diagnostics.is_empty() {
        return Output {
            diagnostics: lexed.diagnostics,
            document: None,
            program: None,
            source,
        };
    }
    let document = match parser::parse(lexed.tokens, &index) {
        Ok(document) => document,
        Err(diagnostics) => {
            return Output {
                diagnostics,
                document: None,
                program: None,
                source,
            }
        }
    };
    let (program, diagnostics) = sema::analyze(&document, options);
    Output {
        source,
        document: Some(document),
        program,
        diagnostics,
    }
}

/// A file that is not UTF-8: its H0001 diagnostic, and its text with invalid bytes replaced, to render it.
#[derive(Debug)]
pub struct InvalidUtf8 {
    pub lossy: String,
    pub diagnostic: Diagnostic,
}

/// The bytes of a `.hol` file as text, or H0001 at the first byte that is not UTF-8.
pub fn decode(bytes: &[u8]) -> Result<&str, Box<InvalidUtf8>> {
    std::str::from_utf8(bytes).map_err(|error| {
        let lossy = String::from_utf8_lossy(bytes).into_owned();
        let index = LineIndex::new(&lossy);
        let at = error.valid_up_to();
        let bad = error.error_len().unwrap_or(bytes.len() - at);
        let shown: Vec<String> = bytes[at..at + bad]
            .iter()
            .map(|b| format!("0x{b:02x}"))
            .collect();
        let diagnostic = Diagnostic::new(
            Code::InvalidUtf8,
            format!("invalid UTF-8 at byte {at}"),
            index.span(at, at + '\u{fffd}'.len_utf8()),
            format!("byte {} is not valid UTF-8 here", shown.join(" ")),
        )
        .with_help("save the file as UTF-8");
        Box::new(InvalidUtf8 { lossy, diagnostic })
    })
}

/// Every `*.hol` file under `dir`, recursively, in name order. Build output (a folder with a
/// `CACHEDIR.TAG`, as Cargo's `target/`) and hidden folders (`.git`) are left out, and symbolic links to
/// folders are not followed, so a link back up cannot loop.
pub fn hol_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> std::io::Result<()> {
        let mut entries: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
        entries.sort_by_key(|entry| entry.file_name());
        for entry in entries {
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                let hidden = entry.file_name().to_string_lossy().starts_with('.');
                if !hidden && !path.join("CACHEDIR.TAG").is_file() {
                    walk(&path, files)?;
                }
            } else if path.extension().is_some_and(|extension| extension == "hol") {
                files.push(path);
            }
        }
        Ok(())
    }
    let mut files = Vec::new();
    walk(dir, &mut files)?;
    Ok(files)
}
