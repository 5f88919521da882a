//! `holo dry --model DIR` (token-level transcripts from a model folder's tokenizer and chat template),
//! `holo eval --model DIR` (token records in the JSONL), and `hol/codemath.hol` end to end.

use std::path::PathBuf;
use std::process::Output;

use crate::common::holo_command;

const TOOL_CALL: &str = r#"<tool>{"name": "calculator", "args": {"expression": "17 * 23"}}</tool>"#;
const ANSWER: &str = "<answer>391</answer>";
const MODEL: &str = "holo-runtime/tests/fixtures/holophore";

fn holo(args: &[&str]) -> Output {
    holo_command(args)
        .env_remove("NO_COLOR")
        .output()
        .expect("holo runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("holo-dry-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn first_row() -> String {
    let path = scratch("first-row.jsonl");
    std::fs::write(
        &path,
        "{\"query\": \"What is 17 * 23?\", \"expected\": \"391\"}\n",
    )
    .unwrap();
    path.display().to_string()
}

#[test]
fn dry_with_a_model_prints_the_trained_tokens() {
    let data = first_row();
    let output = holo(&[
        "dry",
        "hol/tool.hol",
        "--data",
        &data,
        "--model",
        MODEL,
        "--reply",
        TOOL_CALL,
        "--reply",
        ANSWER,
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    // Not a terminal: the plain form (`--color auto`).
    insta::assert_snapshot!(text(&output.stdout));
}

#[test]
fn dry_with_a_model_in_colour() {
    let data = first_row();
    let output = holo(&[
        "dry",
        "hol/tool.hol",
        "--data",
        &data,
        "--model",
        MODEL,
        "--color",
        "always",
        "--reply",
        ANSWER,
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(!stdout.contains('⟦'), "{stdout}");
    // Token by token on alternating green backgrounds; special tokens dimmed.
    assert!(
        stdout.contains("\x1b[2m<|im_start|>\x1b[0massistant\n\x1b[1;30;42m"),
        "{stdout:?}"
    );
    assert!(stdout.contains("\x1b[1;30;102m"), "{stdout:?}");
    assert!(
        stdout.contains("\x1b[2m=== context 0 (trained): "),
        "{stdout:?}"
    );
}

#[test]
fn never_colour_and_a_prefilled_fence() {
    let output = holo(&[
        "dry",
        "hol/qa.hol",
        "--data",
        "examples/data/capitals.jsonl",
        "--model",
        MODEL,
        "--color",
        "never",
        "--reply",
        "Paris</answer>",
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(!stdout.contains('\x1b'), "{stdout:?}");
    // The fence's `<answer>` is prompt; the reply is trained.
    assert!(
        stdout.contains("<|im_start|>assistant\n<answer>⟦Paris</answer>⟧<|im_end|>\n"),
        "{stdout}"
    );
}

#[test]
fn a_folder_that_is_no_model_is_a_usage_error() {
    let output = holo(&["dry", "hol/qa.hol", "--model", "examples/data"]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = text(&output.stderr);
    assert!(
        stderr
            .contains("error: --model `examples/data`: cannot load `examples/data/tokenizer.json`"),
        "{stderr}"
    );
}

#[test]
fn eval_with_a_model_writes_token_records() {
    let out = scratch("eval-tokens.jsonl").display().to_string();
    let output = holo(&[
        "eval",
        "hol/tool.hol",
        "--data",
        "examples/data/arithmetic.jsonl",
        "-n",
        "2",
        "--model",
        MODEL,
        "--reply",
        TOOL_CALL,
        "--reply",
        ANSWER,
        "--out",
        &out,
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(records.len(), 6);
    for record in &records {
        let tokens = &record["contexts"][0]["tokens"];
        let ids = tokens["ids"].as_array().unwrap();
        let mask = tokens["loss_mask"].as_array().unwrap();
        assert_eq!(ids.len(), mask.len());
        assert_eq!(tokens["logprobs"].as_array().unwrap().len(), ids.len());
        assert!(mask.iter().any(|m| m == 1));
        // The same script for every rollout: both turns of each are the scripted ones.
        assert_eq!(record["samples"], 2);
    }
    let stdout = text(&output.stdout);
    // Row 1 (17 * 23) is right in both rollouts.
    assert!(stdout.contains("pass@1 = 0.3333\n"), "{stdout}");
}

#[test]
fn codemath_runs_python_end_to_end() {
    let output = holo(&[
        "dry",
        "hol/codemath.hol",
        "--data",
        "examples/data/arithmetic.jsonl",
        "--reply",
        "<reasoning>Multiply.</reasoning>\n<code>\nprint(17 * 23)\n</code>",
        "--reply",
        ANSWER,
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(
        stdout.contains("--- user\nWhat is 17 * 23?\n--- assistant\n⟦<reasoning>Multiply.</reasoning>\n<code>\nprint(17 * 23)\n</code>⟧\n--- user\n<output>391</output>\n--- assistant\n⟦<answer>391</answer>⟧\n"),
        "{stdout}"
    );
    assert_eq!(stdout.matches("# row ").count(), 3, "{stdout}");
}

/// A model folder with Qwen3's chat template (the fixture tokenizer, Qwen3's `tokenizer_config.json`).
fn qwen3_folder() -> String {
    let dir = scratch("qwen3-template");
    std::fs::create_dir_all(&dir).unwrap();
    let fixtures = crate::common::repo().join("holo-runtime/tests/fixtures");
    std::fs::copy(
        fixtures.join("holophore/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::copy(
        fixtures.join("chat/models/qwen3/tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    dir.display().to_string()
}

#[test]
fn qwen3_multi_turn_thinking_records_a_context_per_turn_and_takes_template_kwargs() {
    let model = qwen3_folder();
    let data = first_row();
    let first = "<think>\nMultiply.\n</think>\n\n<answer>391</answer>";
    let second = "<think>\nCheck.\n</think>\n\n<answer>391</answer>";
    let out = scratch("qwen3-eval.jsonl").display().to_string();
    let output = holo(&[
        "eval",
        "hol/doublecheck.hol",
        "--data",
        &data,
        "--model",
        &model,
        "--reply",
        first,
        "--reply",
        second,
        "--out",
        &out,
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let record: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&out).unwrap().trim()).unwrap();
    // The template drops the first turn's thinking at the second turn: two trained contexts, each
    // with one turn's sampled tokens.
    let contexts = record["contexts"].as_array().unwrap();
    assert_eq!(contexts.len(), 2, "{record}");
    for context in contexts {
        assert_eq!(context["trained"], true);
        let mask = context["tokens"]["loss_mask"].as_array().unwrap();
        assert!(mask.iter().any(|m| m == 1));
    }
    let sampled: Vec<&str> = contexts
        .iter()
        .flat_map(|c| c["messages"].as_array().unwrap())
        .flat_map(|m| m["parts"].as_array().unwrap())
        .filter(|p| p["sampled"] == true)
        .map(|p| p["text"].as_str().unwrap())
        .collect();
    assert_eq!(sampled, [first, second]);

    // `--chat-template-kwargs` reaches the rendering: without thinking, the generation prompt ends in
    // an empty think block.
    let dry = |kwargs: Option<&str>| {
        let mut args = vec![
            "dry",
            "hol/doublecheck.hol",
            "--data",
            &data,
            "--model",
            &model,
            "--color",
            "never",
            "--reply",
            "<answer>391</answer>",
        ];
        if let Some(kwargs) = kwargs {
            args.extend(["--chat-template-kwargs", kwargs]);
        }
        let output = holo(&args);
        assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
        text(&output.stdout)
    };
    let empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n⟦<answer>";
    assert!(dry(Some(r#"{"enable_thinking": false}"#)).contains(empty_think));
    assert!(!dry(None).contains(empty_think));
    // Anything but a JSON object is refused, naming the flag.
    let output = holo(&[
        "dry",
        "hol/doublecheck.hol",
        "--data",
        &data,
        "--chat-template-kwargs",
        "[true]",
    ]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("--chat-template-kwargs") && stderr.contains("must be a JSON object"),
        "{stderr}"
    );
}
