//! `holo train` on the native-tool holoware `hol/tool_native.hol` with the Qwen3 model fixture given
//! Qwen3's real chat template (the fixture's own is a bare ChatML, which renders no tools): the tools
//! reach the template, and every context is trained on exactly the tokens the model sampled in it. A model of random weights writes no well-formed call, so the tool
//! loop's calls and results are covered by holo-core's tests/core/native_tools.rs, through the Loom.

use crate::common::{fixture, holo_command, repo, run_metrics};
use holo_runtime::loom::RolloutRecord;

#[test]
fn a_native_tool_run_trains_exactly_the_sampled_tokens() {
    let run = crate::common::tempdir::Dir::new("native-tools-train");
    let out = run.path().join("run");
    let model = run.path().join("qwen3");
    std::fs::create_dir(&model).unwrap();
    let tiny = std::path::Path::new(&fixture("models/qwen3")).to_path_buf();
    for file in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ] {
        std::fs::copy(tiny.join(file), model.join(file)).unwrap();
    }
    std::fs::copy(
        repo().join("holo-runtime/tests/fixtures/chat/models/qwen3/tokenizer_config.json"),
        model.join("tokenizer_config.json"),
    )
    .unwrap();
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
