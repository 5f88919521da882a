//! End-to-end tests of `holo dry`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn holo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_holo"))
        .args(args)
        .current_dir(repo())
        .env("NO_COLOR", "1")
        .output()
        .expect("holo runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

fn scratch(name: &str, contents: &str) -> String {
    let dir = std::env::temp_dir().join(format!("holo-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path.display().to_string()
}

#[test]
fn tool_episode_end_to_end() {
    let output = holo(&[
        "dry",
        "hol/tool.hol",
        "--data",
        "examples/data/arithmetic.jsonl",
        "--reply",
        r#"<tool>{"name": "calculator", "args": {"expression": "17 * 23"}}</tool>"#,
        "--reply",
        "<answer>391</answer>",
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(
        stdout.contains("# row 1, rollout 1, reward 1\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("--- user\nWhat is 17 * 23?\n--- assistant\n⟦<tool>"),
        "{stdout}"
    );
    assert!(
        stdout.contains("--- user\n<result>391</result>\n--- assistant\n⟦<answer>391</answer>⟧"),
        "{stdout}"
    );
    assert!(
        stdout.contains("# row 2, rollout 1, reward 0\n"),
        "{stdout}"
    );
    assert!(stdout.contains("reward math_answer = 1\n"), "{stdout}");
}

#[test]
fn without_data_inputs_are_placeholders() {
    let output = holo(&[
        "dry",
        "hol/qa.hol",
        "-n",
        "2",
        "--reply",
        "<answer>x</answer>",
    ]);
    let stdout = text(&output.stdout);
    assert!(stdout.contains("<question>"), "{stdout}");
    assert!(stdout.contains("# row 1, rollout 2"), "{stdout}");
}

#[test]
fn bad_rows_are_reported_with_their_line_and_the_rest_run() {
    let data = scratch(
        "rows.jsonl",
        "{\"question\": \"ok?\", \"expected\": \"yes\"}\n{\"question\": \n[1, 2]\n{\"expected\": \"no question\"}\n\n{\"question\": \"again\", \"expected\": \"yes\"}\n",
    );
    let output = holo(&["dry", "hol/qa.hol", "--data", &data, "--reply", "yes"]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("rows.jsonl:2: column 13: invalid JSON"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rows.jsonl:3: a row must be a JSON object"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rows.jsonl:4: missing column `question` (used at hol/qa.hol:13:3)"),
        "{stderr}"
    );
    let stdout = text(&output.stdout);
    assert!(stdout.contains("# row 1, rollout 1, reward 1"), "{stdout}");
    assert!(stdout.contains("# row 6, rollout 1, reward 1"), "{stdout}");
}

#[test]
fn a_broken_holoware_reports_diagnostics() {
    let file = scratch("broken.hol", "<|o_o|>\n<|answer|>\n<|@_@:answer|>\n");
    let output = holo(&["dry", &file]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output.stderr).contains("error[H0021]"),
        "{}",
        text(&output.stderr)
    );
}

#[test]
fn an_unknown_holotype_fails_the_load_with_a_suggestion() {
    let file = scratch(
        "unknown.hol",
        "<|o_o|>\nq\n<|@_@:answer|>\n<|ExactAnswr|>\n",
    );
    let output = holo(&["dry", &file]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("error[H0026]: unknown holotype `ExactAnswr`"),
        "{stderr}"
    );
    assert!(stderr.contains("did you mean `ExactAnswer`?"), "{stderr}");
}

#[test]
fn missing_data_file_is_a_usage_error() {
    let output = holo(&["dry", "hol/qa.hol", "--data", "nope.jsonl"]);
    assert_eq!(output.status.code(), Some(2));
}
