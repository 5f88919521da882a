//! `holo train` on native-tool holowares with the Qwen3 model fixture given Qwen3's real chat template
//! (the fixture's own is a bare ChatML, which renders no tools). `hol/tool_native.hol`: the tools reach
//! the template, and every context is trained on exactly the tokens the model sampled in it; a model of
//! random weights writes no well-formed call by itself. `tests/fixtures/train/tool_calls.hol` holds each
//! turn to a call with a regex, so the whole loop runs: calls, results as `tool` messages, several turns.

use crate::common::{fixture, holo_command, qwen3_with_tools, run_metrics};
use holo_runtime::loom::{MessageRecord, RolloutRecord, ToolRecord};

#[test]
fn a_native_tool_run_trains_exactly_the_sampled_tokens() {
    let run = crate::common::tempdir::Dir::new("native-tools-train");
    let out = run.path().join("run");
    let model = qwen3_with_tools(run.path(), None);
    let tiny = std::path::Path::new(&fixture("models/qwen3")).to_path_buf();
    let data = run.path().join("rows.jsonl");
    std::fs::write(
        &data,
        "{\"query\": \"What is 6*7?\", \"expected\": \"42\"}\n{\"query\": \"What is 2+8?\", \"expected\": \"10\"}\n",
    )
    .unwrap();
    let output = holo_command(&[
        "train",
        "hol/tool_native.hol",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-steps",
        "2",
        "--num-generations",
        "4",
        "--per-device-train-batch-size",
        "8",
        "--max-completion-length",
        "8",
        "--shuffle-dataset",
        "false",
    ])
    .output()
    .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(run_metrics(&out).len(), 2);
    let records: Vec<RolloutRecord> = std::fs::read_to_string(out.join("rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(records.len(), 16);
    let tokenizer = tokenizers::Tokenizer::from_file(tiny.join("tokenizer.json")).unwrap();
    for record in &records {
        assert!(record.error.is_none(), "{:?}", record.error);
        for context in &record.contexts {
            let tokens = context.tokens.as_ref().expect("token records");
            let text = tokenizer.decode(&tokens.ids, false).unwrap();
            // The template's system turn lists the calculator (`holo`'s tool) for the model.
            assert!(text.contains("# Tools"), "{text}");
            assert!(text.contains("\"name\": \"calculator\""), "{text}");
            // Trained: exactly the sampled tokens (those with the sampler's logprobs), whose text is the
            // context's sampled parts.
            let trained: Vec<u32> = tokens
                .ids
                .iter()
                .zip(&tokens.loss_mask)
                .filter(|(_, mask)| **mask == 1)
                .map(|(id, _)| *id)
                .collect();
            let sampled: String = context
                .messages
                .iter()
                .flat_map(|message| &message.parts)
                .filter(|part| part.sampled)
                .map(|part| part.text.as_str())
                .collect();
            assert_eq!(tokenizer.decode(&trained, false).unwrap(), sampled);
            for (mask, logprob) in tokens.loss_mask.iter().zip(&tokens.logprobs) {
                assert!(*mask == 1 || *logprob == 0.0);
            }
        }
    }
}

/// The multi-turn native-tool run (#38): `holo train` on `tests/fixtures/train/tool_calls.hol`,
/// whose turns a regex holds to one Hermes call of the calculator, with the random Qwen3 given Qwen3's
/// template. Every turn calls the tool and the executor runs it (`tools/calls` > 0, `tools/failed` 0),
/// the results come back as `tool` messages, and in every context the trained tokens are exactly the
/// sampled ones, each turn a constrained run, and no tool message's token is trained.
#[test]
fn a_multi_turn_run_of_held_calls_trains_the_sampled_tokens_and_never_the_tool_messages() {
    let run = crate::common::tempdir::Dir::new("native-tools-held");
    let out = run.path().join("run");
    let model = qwen3_with_tools(run.path(), Some(2048));
    let data = run.path().join("rows.jsonl");
    std::fs::write(
        &data,
        "{\"query\": \"What is 6*7?\", \"expected\": \"42\"}\n{\"query\": \"What is 2+8?\", \"expected\": \"10\"}\n",
    )
    .unwrap();
    let output = holo_command(&[
        "train",
        &fixture("train/tool_calls.hol"),
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-steps",
        "2",
        "--num-generations",
        "2",
        "--per-device-train-batch-size",
        "4",
        "--max-completion-length",
        "96",
        "--shuffle-dataset",
        "false",
    ])
    .output()
    .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metrics = run_metrics(&out);
    assert_eq!(metrics.len(), 2);
    for step in &metrics {
        // Two turns of each of the step's four rollouts, each one call.
        assert_eq!(step["tools/calls"].as_f64(), Some(8.0), "{step}");
        assert_eq!(step["tools/failed"].as_f64(), Some(0.0), "{step}");
        assert!(step["loss"].as_f64().unwrap().is_finite(), "{step}");
    }
    let records: Vec<RolloutRecord> = std::fs::read_to_string(out.join("rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(records.len(), 8);
    let tokenizer = tokenizers::Tokenizer::from_file(model.join("tokenizer.json")).unwrap();
    for record in &records {
        assert!(record.error.is_none(), "{:?}", record.error);
        let messages: Vec<&MessageRecord> = record
            .contexts
            .iter()
            .flat_map(|context| &context.messages)
            .collect();
        let calls = messages
            .iter()
            .filter_map(|message| match &message.tool {
                Some(ToolRecord::ToolCalls { calls, .. }) => Some(calls),
                _ => None,
            })
            .flatten();
        let results = messages
            .iter()
            .filter(|message| matches!(message.tool, Some(ToolRecord::Result { .. })));
        // Each call's result, the message after it, is the calculator's value of its expression.
        let values: Vec<String> = calls
            .map(|call| {
                let expression = call.arguments["expression"].as_str().unwrap();
                let at = expression[1..].find(['+', '-', '*']).unwrap() + 1;
                let (a, b): (i64, i64) = (
                    expression[..at].parse().unwrap(),
                    expression[at + 1..].parse().unwrap(),
                );
                match &expression[at..=at] {
                    "+" => a + b,
                    "-" => a - b,
                    _ => a * b,
                }
                .to_string()
            })
            .collect();
        let results: Vec<String> = results
            .map(|message| {
                message
                    .parts
                    .iter()
                    .map(|part| part.text.as_str())
                    .collect()
            })
            .collect();
        assert_eq!(values.len(), 2, "{messages:?}");
        assert_eq!(results, values, "{messages:?}");
        for context in &record.contexts {
            let tokens = context.tokens.as_ref().expect("token records");
            let trained: Vec<usize> = (0..tokens.ids.len())
                .filter(|&i| tokens.loss_mask[i] == 1)
                .collect();
            let trained_ids: Vec<u32> = trained.iter().map(|&i| tokens.ids[i]).collect();
            // Each turn the model ended itself, with Qwen's end of turn: the regex allows it only once
            // the call is whole.
            let sampled: String = context
                .messages
                .iter()
                .flat_map(|message| &message.parts)
                .filter(|part| part.sampled)
                .map(|part| format!("{}<|im_end|>", part.text))
                .collect();
            assert_eq!(tokenizer.decode(&trained_ids, false).unwrap(), sampled);
            for (mask, logprob) in tokens.loss_mask.iter().zip(&tokens.logprobs) {
                assert!(*mask == 1 || *logprob == 0.0);
            }
            // Each sampled turn is a constrained run, and the runs cover the trained tokens.
            let held: Vec<usize> = tokens
                .constraints
                .iter()
                .flat_map(|run| run.start..run.start + run.len)
                .collect();
            assert_eq!(held, trained);
            // The tool messages are not: a tool result's text is in the context, never trained.
            let text = tokenizer.decode(&tokens.ids, false).unwrap();
            let trained_text = tokenizer.decode(&trained_ids, false).unwrap();
            for message in &context.messages {
                if matches!(message.tool, Some(ToolRecord::Result { .. })) {
                    assert!(message.parts.iter().all(|part| !part.sampled));
                    assert!(text.contains("<tool_response>"), "{text}");
                }
            }
            assert!(!trained_text.contains("<tool_response>"), "{trained_text}");
        }
    }
}
