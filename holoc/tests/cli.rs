//! End-to-end tests of the `holoc` binary: exit codes and the three output formats.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod scratch;
use scratch::Scratch;

fn holoc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_holoc"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("holoc runs")
}

fn input(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/inputs")
        .join(path)
        .display()
        .to_string()
}

fn corpus() -> String {
    repo_root()
        .join("tests/corpus/errloom")
        .display()
        .to_string()
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).unwrap()
}

#[test]
fn corpus_checks_clean() {
    let output = holoc(&["check", &corpus()]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("checked 9 files: 0 errors"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn standard_library_checks_clean() {
    // Every holotype of the standard holowares is a built-in: no H0100 warning either.
    let output = holoc(&[
        "check",
        "--deny-warnings",
        &repo_root().join("hol").display().to_string(),
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("0 errors, 0 warnings"),
        "{}",
        stderr(&output)
    );
}

/// A fresh folder under the system temp dir, outside any crate, removed when dropped.
fn scratch(name: &str) -> Scratch {
    Scratch::new("cli", name)
}

#[test]
fn warnings_fail_only_when_denied() {
    let dir = scratch("warnings");
    let file = dir.join("schema.hol");
    std::fs::write(&file, "<|o_o|>\n<|Planner|>\n").unwrap();
    let file = file.display().to_string();
    assert_eq!(holoc(&["check", &file]).status.code(), Some(0));
    let denied = holoc(&["check", "--deny-warnings", &file]);
    assert_eq!(denied.status.code(), Some(1));
    assert!(
        stderr(&denied).contains("warning[H0100]"),
        "{}",
        stderr(&denied)
    );
}

/// A crate whose sources define holotypes: `holoc check` scans it and resolves names and arguments.
fn crate_with_holotypes(name: &str, hol: &str) -> (Scratch, String) {
    let dir = scratch(name);
    std::fs::write(
        dir.join("Cargo.toml"),
        "[package]\nname = \"agent\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("src/tools")).unwrap();
    std::fs::write(
        dir.join("src/lib.rs"),
        "mod tools;\npub struct Plain;\nholo_macros::include_holoware!(\"hol/env.hol\");\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("src/tools/mod.rs"),
        "use holo_runtime::{Args, Holotype, HolotypeError};\n\
         pub struct ToolRunner;\n\
         impl Holotype for ToolRunner {\n\
             const PARAMS: &'static [&'static str] = &[\"max_turns\", \"stop_on\"];\n\
             fn new(_: &Args) -> Result<Self, HolotypeError> { Ok(ToolRunner) }\n\
         }\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("hol")).unwrap();
    let file = dir.join("hol/env.hol");
    std::fs::write(&file, hol).unwrap();
    (dir, file.display().to_string())
}

#[test]
fn scanned_crate_resolves_holotypes() {
    let (_dir, file) =
        crate_with_holotypes("resolves", "<|ToolRunner max_turns=3|>\n    <|@_@:turn|>\n");
    let output = holoc(&["check", "--deny-warnings", &file]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
}

#[test]
fn scanned_crate_reports_unknown_holotype_with_suggestion() {
    let (_dir, file) = crate_with_holotypes("unknown", "<|o_o|>\n<|ToolRunnr|>\n");
    let output = holoc(&["check", &file]);
    assert_eq!(output.status.code(), Some(1));
    let text = stderr(&output);
    assert!(
        text.contains("error[H0026]: unknown holotype `ToolRunnr`"),
        "{text}"
    );
    assert!(text.contains("env.hol:2:3"), "{text}");
    assert!(text.contains("did you mean `ToolRunner`?"), "{text}");
}

#[test]
fn scanned_crate_reports_unknown_argument_with_suggestion() {
    let (_dir, file) =
        crate_with_holotypes("argument", "<|ToolRunner max_turn=3|>\n    <|@_@:turn|>\n");
    let output = holoc(&["check", &file]);
    assert_eq!(output.status.code(), Some(1));
    let text = stderr(&output);
    assert!(
        text.contains("error[H0028]: holotype `ToolRunner` has no parameter `max_turn`"),
        "{text}"
    );
    assert!(text.contains("env.hol:1:14"), "{text}");
    assert!(text.contains("did you mean `max_turns`?"), "{text}");
}

#[test]
fn scanned_crate_reports_a_type_that_is_not_a_holotype() {
    let (_dir, file) = crate_with_holotypes("plain", "<|o_o|>\n<|Plain|>\n");
    let output = holoc(&["check", &file]);
    assert_eq!(output.status.code(), Some(1));
    let text = stderr(&output);
    assert!(
        text.contains("error[H0027]: `Plain` does not implement `Holotype`"),
        "{text}"
    );
}

#[test]
fn errors_exit_one_with_rustc_style_output() {
    let file = input("err/use_before_bind.hol");
    let output = holoc(&["check", &file]);
    assert_eq!(output.status.code(), Some(1));
    let text = stderr(&output);
    assert!(
        text.contains("error[H0021]: `answer` is used before the sampler that binds it"),
        "{text}"
    );
    assert!(text.contains("use_before_bind.hol:2:3"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "no colour when not on a terminal: {text}"
    );
}

#[test]
fn missing_file_exits_two() {
    let output = holoc(&["check", "does/not/exist.hol"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("does/not/exist.hol"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn missing_file_exits_two_even_beside_a_failing_file() {
    let output = holoc(&["check", &input("err/use_before_bind.hol"), "missing.hol"]);
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn folder_without_hol_files_exits_two() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let output = holoc(&["check", &dir.display().to_string()]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("no .hol files"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn usage_error_exits_two() {
    assert_eq!(holoc(&["check"]).status.code(), Some(2));
    assert_eq!(
        holoc(&["check", "--format", "xml", "x.hol"]).status.code(),
        Some(2)
    );
    assert_eq!(holoc(&["frobnicate"]).status.code(), Some(2));
}

#[test]
fn json_format() {
    let output = holoc(&[
        "check",
        "--format",
        "json",
        &input("err/semantic_errors_together.hol"),
    ]);
    assert_eq!(output.status.code(), Some(1));
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).expect("stdout is JSON");
    let diagnostics = value.as_array().expect("one JSON array");
    assert_eq!(diagnostics.len(), 3);
    let first = &diagnostics[0];
    assert!(first["file"]
        .as_str()
        .unwrap()
        .ends_with("semantic_errors_together.hol"));
    assert_eq!(first["line"], 1);
    assert_eq!(first["column"], 14);
    assert_eq!(first["end_line"], 1);
    assert_eq!(first["end_column"], 24);
    assert_eq!(first["severity"], "error");
    assert_eq!(first["code"], "H0014");
    assert_eq!(first["message"], "unknown sampler argument `temprature`");
    assert_eq!(first["help"], "did you mean `temperature`?");
    let codes: Vec<&str> = diagnostics
        .iter()
        .map(|d| d["code"].as_str().unwrap())
        .collect();
    assert_eq!(codes, ["H0014", "H0010", "H0018"]);
}

#[test]
fn json_format_clean_file_is_an_empty_array() {
    let output = holoc(&["check", "--format", "json", &input("ok/roles.hol")]);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&stdout(&output)).unwrap(),
        serde_json::json!([])
    );
}

#[test]
fn github_format() {
    let output = holoc(&["check", "--format", "github", &input("err/tab_in_body.hol")]);
    assert_eq!(output.status.code(), Some(1));
    let text = stdout(&output);
    let line = text.lines().next().unwrap();
    assert!(line.starts_with("::error file="), "{line}");
    assert!(
        line.contains("tab_in_body.hol,line=2,col=1,endLine=2,endColumn=2,title=H0008::"),
        "{line}"
    );
    assert!(
        line.contains("H0008: tab in body indentation%0Ahelp: indent bodies with spaces only"),
        "{line}"
    );
}

#[test]
fn github_format_warnings() {
    let output = holoc(&[
        "check",
        "--format",
        "github",
        &input("err/unreachable_alternative.hol"),
    ]);
    assert!(
        stdout(&output).starts_with("::warning file="),
        "{}",
        stdout(&output)
    );
}

#[test]
fn inputs_listing() {
    let file = repo_root()
        .join("tests/corpus/errloom/compressor.hol")
        .display()
        .to_string();
    let output = holoc(&["check", "--inputs", &file]);
    assert_eq!(output.status.code(), Some(0));
    let text = stdout(&output);
    assert!(text.contains("original"), "{text}");
    let original = text
        .lines()
        .find(|line| line.trim_start().starts_with("original"))
        .unwrap();
    assert!(original.contains("required"), "{original}");
    let data = text
        .lines()
        .find(|line| line.trim_start().starts_with("data"))
        .unwrap();
    assert!(data.contains("optional"), "{data}");
    assert!(
        !text.contains("compressed "),
        "sampler-bound variables are not inputs: {text}"
    );
}

#[test]
fn inputs_json() {
    let file = repo_root().join("hol/qa.hol").display().to_string();
    let output = holoc(&["check", "--format", "json", "--inputs", &file]);
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    let inputs = value["inputs"][&file].as_array().unwrap();
    let names: Vec<(&str, bool)> = inputs
        .iter()
        .map(|input| {
            (
                input["name"].as_str().unwrap(),
                input["required"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            ("system_prompt", false),
            ("few_shot", false),
            ("question", true)
        ]
    );
    assert!(value["diagnostics"].is_array());
}

#[test]
fn ast_and_ir_commands() {
    let file = input("ok/bodies.hol");
    let ast = holoc(&["ast", &file]);
    assert_eq!(ast.status.code(), Some(0));
    assert!(stdout(&ast).contains("Holotype(\n"), "{}", stdout(&ast));
    assert!(stdout(&ast).contains("@ 2:3-2:8"), "{}", stdout(&ast));

    let ir = holoc(&["ir", &file]);
    assert_eq!(ir.status.code(), Some(0));
    assert!(stdout(&ir).contains("holotype Loop #1"), "{}", stdout(&ir));

    let json = holoc(&["ir", "--json", &file]);
    let program: holoc::ir::Program =
        serde_json::from_str(&stdout(&json)).expect("IR JSON deserializes");
    assert_eq!(program.holotypes.len(), 3);
}

#[test]
fn ir_of_a_broken_file_reports_and_fails() {
    let output = holoc(&["ir", &input("err/two_fences.hol")]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("error[H0011]"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn explain() {
    let output = holoc(&["explain", "H0021"]);
    assert_eq!(output.status.code(), Some(0));
    assert!(stdout(&output).contains("variable used before it is bound"));
    assert_eq!(holoc(&["explain", "H9999"]).status.code(), Some(2));
}

/// Copies `files` (name, contents) into a fresh scratch folder.
fn scratch_with(name: &str, files: &[(&str, &str)]) -> Scratch {
    let dir = scratch(name);
    for (file, contents) in files {
        std::fs::write(dir.join(file), contents).unwrap();
    }
    dir
}

const UNFORMATTED: &str = "<| o_o |>\n<|query|>\n<|Loop|>\n  <|@_@ : turn|>\n";
const FORMATTED: &str = "<|o_o|>\n<|query|>\n<|Loop|>\n    <|@_@:turn|>\n";

#[test]
fn fmt_check_names_each_file_that_would_change() {
    let dir = scratch_with(
        "fmt-check",
        &[
            ("a.hol", UNFORMATTED),
            ("b.hol", FORMATTED),
            ("c.hol", "<|o_o|>\nHello\n<|@_@:x   max_tokens = 3|>\n"),
        ],
    );
    let output = holoc(&["fmt", "--check", &dir.display().to_string()]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let a = dir.join("a.hol").display().to_string();
    let c = dir.join("c.hol").display().to_string();
    assert_eq!(
        stdout(&output),
        format!("would reformat {a} (from line 1)\nwould reformat {c} (from line 3)\n")
    );
    assert!(
        stderr(&output).contains("would reformat 2 of 3 files"),
        "{}",
        stderr(&output)
    );
    // --check changes nothing.
    assert_eq!(
        std::fs::read_to_string(dir.join("a.hol")).unwrap(),
        UNFORMATTED
    );

    let clean = holoc(&["fmt", "--check", &dir.join("b.hol").display().to_string()]);
    assert_eq!(clean.status.code(), Some(0), "{}", stderr(&clean));
    assert_eq!(stdout(&clean), "");
}

#[test]
fn fmt_rewrites_files_in_place() {
    let dir = scratch_with("fmt-write", &[("a.hol", UNFORMATTED), ("b.hol", FORMATTED)]);
    let output = holoc(&["fmt", &dir.display().to_string()]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("reformatted 1 of 2 files"),
        "{}",
        stderr(&output)
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("a.hol")).unwrap(),
        FORMATTED
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("b.hol")).unwrap(),
        FORMATTED
    );
    let again = holoc(&["fmt", "--check", &dir.display().to_string()]);
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
}

#[test]
fn fmt_leaves_a_file_that_does_not_parse_with_its_diagnostic() {
    let broken = "<| o_o |>\n<|@_@:answer <>|>\n";
    let dir = scratch_with(
        "fmt-broken",
        &[("broken.hol", broken), ("a.hol", UNFORMATTED)],
    );
    let output = holoc(&["fmt", &dir.display().to_string()]);
    assert_eq!(output.status.code(), Some(1));
    let err = stderr(&output);
    let name = dir.join("broken.hol").display().to_string();
    assert!(
        err.contains("error[H0005]: unexpected `|>` in a tag"),
        "{err}"
    );
    assert!(err.contains(&format!("--> {name}:2:16")), "{err}");
    assert!(
        err.contains(&format!("error: `{name}` was not formatted: it has errors")),
        "{err}"
    );
    assert!(
        err.contains("reformatted 1 of 2 files; 1 not formatted because of errors"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("broken.hol")).unwrap(),
        broken
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("a.hol")).unwrap(),
        FORMATTED
    );
}

fn holoc_stdin(args: &[&str], input: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_holoc"))
        .args(args)
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("holoc runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn fmt_stdin() {
    let output = holoc_stdin(&["fmt", "--stdin"], UNFORMATTED);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(stdout(&output), FORMATTED);

    let check = holoc_stdin(&["fmt", "--stdin", "--check"], UNFORMATTED);
    assert_eq!(check.status.code(), Some(1));
    assert_eq!(stdout(&check), "would reformat <stdin>\n");

    // A buffer that cannot be formatted comes back unchanged, so an editor filter never loses it.
    let broken = "<|o_o|>\n<|unclosed\n";
    let output = holoc_stdin(&["fmt", "--stdin"], broken);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(stdout(&output), broken);
    assert!(
        stderr(&output).contains("--> <stdin>:2:1"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn fmt_without_paths_formats_the_current_folder() {
    let dir = scratch_with("fmt-cwd", &[("a.hol", UNFORMATTED)]);
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("sub/b.hol"), UNFORMATTED).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_holoc"))
        .args(["fmt", "--check"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(
        stdout(&output),
        "would reformat ./a.hol (from line 1)\nwould reformat ./sub/b.hol (from line 1)\n"
    );
}

#[test]
fn fmt_reports_a_file_that_is_not_utf8() {
    let dir = scratch("fmt-utf8");
    let file = dir.join("latin1.hol");
    std::fs::write(&file, b"<|o_o|>\ncaf\xe9\n").unwrap();
    let output = holoc(&["fmt", &file.display().to_string()]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("error[H0001]: invalid UTF-8 at byte 11"),
        "{}",
        stderr(&output)
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"<|o_o|>\ncaf\xe9\n");
}

#[test]
fn fmt_standard_library_is_formatted() {
    let output = holoc(&[
        "fmt",
        "--check",
        &repo_root().join("hol").display().to_string(),
    ]);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}{}",
        stdout(&output),
        stderr(&output)
    );
}

/// A folder walk finds the `.hol` files a person wrote: not build output (a folder with a
/// `CACHEDIR.TAG`, as Cargo's `target/`), not hidden folders, and a crate whose `src/` links back up to
/// itself is scanned once instead of overflowing the stack.
#[test]
fn folder_walks_skip_build_output_and_hidden_folders_and_links_cannot_loop() {
    let dir = scratch("walk");
    std::fs::write(
        dir.join("Cargo.toml"),
        "[package]\nname = \"walked\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::write(dir.join("src/lib.rs"), "pub struct Nothing;\n").unwrap();
    std::os::unix::fs::symlink("..", dir.join("src/up")).unwrap();
    std::fs::write(dir.join("env.hol"), "<|o_o|>\nHello.\n").unwrap();
    for skipped in ["target", ".git"] {
        std::fs::create_dir_all(dir.join(skipped)).unwrap();
        std::fs::write(dir.join(skipped).join("broken.hol"), "<|Unclosed\n").unwrap();
    }
    std::fs::write(
        dir.join("target/CACHEDIR.TAG"),
        "Signature: 8a477f597d28d172789f06886806bc55\n",
    )
    .unwrap();
    let folder = dir.display().to_string();
    let checked = holoc(&["check", &folder]);
    assert_eq!(checked.status.code(), Some(0), "{}", stderr(&checked));
    let formatted = holoc(&["fmt", "--check", &folder]);
    assert_eq!(formatted.status.code(), Some(0), "{}", stderr(&formatted));
    // Without the CACHEDIR.TAG the folder is an ordinary one, and its broken file is found.
    std::fs::remove_file(dir.join("target/CACHEDIR.TAG")).unwrap();
    let checked = holoc(&["check", &folder]);
    assert_eq!(checked.status.code(), Some(1), "{}", stderr(&checked));
    assert!(
        stderr(&checked).contains("broken.hol"),
        "{}",
        stderr(&checked)
    );
}
