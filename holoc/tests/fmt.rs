//! Tests of the formatter (`holoc::fmt`): snapshots of the formatted standard library, corpus and layout
//! cases, each checked to be idempotent and to compile to the same IR as the original.

mod support;

use std::path::Path;

use holoc::{compile, Options};
use support::format_checked;

fn format_file(path: &Path) -> String {
    let source = std::fs::read_to_string(path).expect("test input is UTF-8");
    format_checked(&source).unwrap_or_else(|| panic!("{} must lex and parse", path.display()))
}

/// The layout cases of `inputs/fmt`: tag spacing, bodies, blank lines, comments, line ends.
#[test]
fn layout_cases() {
    insta::glob!("inputs/fmt/*.hol", |path| {
        insta::assert_snapshot!(format_file(path));
    });
}

#[test]
fn standard_library() {
    insta::glob!("../../hol", "*.hol", |path| {
        insta::assert_snapshot!(format_file(path));
    });
}

#[test]
fn examples() {
    insta::glob!("../../examples", "**/*.hol", |path| {
        insta::assert_snapshot!(format_file(path));
    });
}

#[test]
fn corpus() {
    insta::glob!("../../tests/corpus/errloom", "**/*.hol", |path| {
        insta::assert_snapshot!(format_file(path));
    });
}

/// Every file the checker accepts keeps its IR; a file with semantic errors is formatted and keeps its
/// diagnostics; a file that does not lex or parse is refused with the diagnostics `holoc check` prints.
#[test]
fn checker_inputs() {
    for kind in ["ok", "err"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/inputs")
            .join(kind);
        for path in holoc::hol_files(&dir).unwrap() {
            let bytes = std::fs::read(&path).unwrap();
            let Ok(source) = std::str::from_utf8(&bytes) else {
                continue;
            };
            let formatted = format_checked(source);
            let parses = compile(&bytes, &Options::default()).document.is_some();
            assert_eq!(formatted.is_some(), parses, "{}", path.display());
        }
    }
}

#[test]
fn refuses_a_file_that_does_not_parse() {
    let source = "<|o_o|>\n<|@_@:answer <>|>\n";
    let Err(holoc::fmt::Error::Invalid(diagnostics)) = holoc::fmt::format(source) else {
        panic!("a syntax error must be reported");
    };
    let check = compile(source.as_bytes(), &Options::default());
    assert_eq!(
        support::diagnostics_of(&diagnostics),
        support::diagnostics(&check)
    );
}

#[test]
fn empty_and_comment_only_files() {
    assert_eq!(format_checked("").unwrap(), "");
    assert_eq!(format_checked("\n \n\t\n").unwrap(), "");
    assert_eq!(
        format_checked("\n  # one   \n\n\n# two").unwrap(),
        "# one\n\n# two\n"
    );
}
