//! Snapshot tests of the front end: the AST and IR of every `inputs/ok` file and of the errloom corpus,
//! and the rendered diagnostics of every `inputs/err` file.

use std::collections::BTreeSet;
use std::path::Path;

use holoc::diagnostics::{Code, Severity};
use holoc::scan::{CrateScan, HolotypeDecl};
use holoc::{codegen, compile, report, Options, Output};

/// Inputs named `scan_*` are checked as if their crate defined `ToolRunner` (parameters `max_turns` and
/// `stop_on`) and a plain struct `Plain`; inputs named `builtin_*` with the runtime's built-in holotypes
/// (`holoc check`'s options outside a crate); the others as files outside any crate.
fn compile_file(path: &Path) -> (String, Output) {
    let bytes = std::fs::read(path).expect("test input is readable");
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let mut options = if name.starts_with("builtin_") {
        Options::with_builtins(None)
    } else {
        Options::default()
    };
    if name.starts_with("scan_") {
        let mut scan = CrateScan::default();
        scan.holotypes.insert(
            "ToolRunner".to_string(),
            HolotypeDecl {
                params: Some(vec!["max_turns".to_string(), "stop_on".to_string()]),
                file: "src/tools.rs".into(),
            },
        );
        scan.types.insert("Plain".to_string());
        options.scan = Some(scan);
    }
    (name, compile(&bytes, &options.for_file(path)))
}

fn expanded(path: &Path, output: &Output) -> String {
    let stem = path.file_stem().unwrap().to_string_lossy();
    let name = path.file_name().unwrap().to_string_lossy();
    let settings = codegen::Settings::new(codegen::module_name(&stem), name);
    codegen::pretty(codegen::module(output.program.as_ref().unwrap(), &settings))
}

fn rendered_diagnostics(name: &str, output: &Output) -> String {
    let source = report::SourceFile::new(name, &output.source);
    output
        .diagnostics
        .iter()
        .map(|diagnostic| source.plain(diagnostic))
        .collect::<Vec<_>>()
        .join("")
}

fn errors(output: &Output) -> Vec<String> {
    output
        .diagnostics
        .iter()
        .filter(|diagnostic| diagnostic.severity == Severity::Error)
        .map(|diagnostic| format!("{}: {}", diagnostic.code, diagnostic.message))
        .collect()
}

#[test]
fn ok_inputs() {
    insta::glob!("inputs/ok/*.hol", |path| {
        let (name, output) = compile_file(path);
        assert_eq!(
            errors(&output),
            Vec::<String>::new(),
            "{name} must check without errors"
        );
        insta::assert_debug_snapshot!("ast", output.document.as_ref().unwrap());
        insta::assert_snapshot!("ir", output.program.as_ref().unwrap().to_string());
        insta::assert_snapshot!("expand", expanded(path, &output));
    });
}

#[test]
fn corpus() {
    insta::glob!("../../tests/corpus/errloom", "**/*.hol", |path| {
        let (name, output) = compile_file(path);
        assert_eq!(
            errors(&output),
            Vec::<String>::new(),
            "{name} must check without errors"
        );
        insta::assert_snapshot!("corpus_ir", output.program.as_ref().unwrap().to_string());
        insta::assert_snapshot!("corpus_expand", expanded(path, &output));
    });
}

#[test]
fn standard_library() {
    insta::glob!("../../hol", "*.hol", |path| {
        let (name, output) = compile_file(path);
        assert_eq!(
            errors(&output),
            Vec::<String>::new(),
            "{name} must check without errors"
        );
        insta::assert_snapshot!("hol_ir", output.program.as_ref().unwrap().to_string());
    });
}

#[test]
fn err_inputs() {
    insta::glob!("inputs/err/*.hol", |path| {
        let (name, output) = compile_file(path);
        assert!(
            !output.diagnostics.is_empty(),
            "{name} must produce at least one diagnostic"
        );
        insta::assert_snapshot!(rendered_diagnostics(&name, &output));
    });
}

/// Every diagnostic in the catalogue has at least one `inputs/err` file that produces it.
#[test]
fn every_code_has_an_err_input() {
    let mut seen = BTreeSet::new();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/inputs/err");
    for entry in std::fs::read_dir(dir).unwrap() {
        let (_, output) = compile_file(&entry.unwrap().path());
        seen.extend(
            output
                .diagnostics
                .iter()
                .map(|diagnostic| diagnostic.code.id()),
        );
    }
    let missing: Vec<&str> = Code::ALL
        .iter()
        .map(|code| code.id())
        .filter(|id| !seen.contains(id))
        .collect();
    assert!(
        missing.is_empty(),
        "codes without an err input: {missing:?}"
    );
}

/// An error input reports each mistake once: no diagnostic repeats another's code and span.
#[test]
fn no_duplicate_diagnostics() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/inputs/err");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let (name, output) = compile_file(&path);
        let mut keys = BTreeSet::new();
        for diagnostic in &output.diagnostics {
            let span = diagnostic.span();
            assert!(
                keys.insert((diagnostic.code.id(), span.start.offset, span.end.offset)),
                "{name}: duplicate {} at {span:?}",
                diagnostic.code
            );
        }
    }
}
