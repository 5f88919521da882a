//! The Loom recording in token space with a Holophore (the fixture model folder
//! `tests/fixtures/holophore`: a byte-level BPE tokenizer and a ChatML template), over `hol/tool.hol` and
//! `hol/qa.hol` with the tokenized scripted sampler: token prompts, token-exact records, masks that cover
//! exactly the sampled tokens.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::recording::Recording;
use holo_core::chat::{ChatTemplate, RenderOptions};
use holo_core::holophore::Holophore;
use holo_core::holotypes::{self, Tools};
use holo_core::interpreter::{Holoware, Row};
use holo_core::loom::{Jsonl, Loom, LoomConfig, RolloutRecord};
use holo_core::{ChatMessage, Completion, Prompt, Request, Resources, Scripted};
use tokenizers::Tokenizer;

const TOOL_CALL: &str = r#"<tool>{"name": "calculator", "args": {"expression": "17 * 23"}}</tool>"#;
const ANSWER: &str = "<reasoning>17 * 23 = 391.</reasoning>\n<answer>391</answer>";

fn repo() -> PathBuf {
    crate::common::repo()
}

fn model() -> PathBuf {
    crate::common::fixtures().join("holophore")
}

fn holophore() -> Holophore {
    Holophore::from_dir(model()).expect("the fixture model folder loads")
}

fn rows(file: &str) -> Vec<(usize, Row)> {
    let text = std::fs::read_to_string(repo().join("examples/data").join(file)).unwrap();
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).unwrap())
        .enumerate()
        .collect()
}

fn run(
    hol: &str,
    data: &str,
    script: &[&str],
    per_row: usize,
) -> (Vec<RolloutRecord>, Vec<(Request, Completion)>) {
    let holophore = holophore();
    let holoware =
        Arc::new(Holoware::open(&repo().join(hol), Arc::new(holotypes::registry())).unwrap());
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());
    let loom = Loom::interpreted(
        holoware,
        resources,
        LoomConfig {
            rollouts_per_row: per_row,
            timing: false,
            ..LoomConfig::default()
        },
    )
    .with_holophore(holophore.fork());
    let sampler = Recording {
        inner: Scripted::new(script.iter().copied()).tokenized(&holophore),
        seen: Mutex::new(Vec::new()),
    };
    let mut out = Vec::new();
    let summary = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(loom.run(&rows(data), &sampler, &mut Jsonl(&mut out)))
        .unwrap();
    assert_eq!(summary.failed, 0, "{summary:?}");
    let records = std::str::from_utf8(&out)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    (records, sampler.seen.into_inner().unwrap())
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(model().join("tokenizer.json")).unwrap()
}

fn decode(tokenizer: &Tokenizer, ids: &[u32]) -> String {
    tokenizer.decode(ids, false).unwrap()
}

/// The maximal runs of 1 in `mask`, as ranges.
fn runs(mask: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut start = None;
    for (i, &m) in mask.iter().chain([0u8].iter()).enumerate() {
        match (m, start) {
            (1, None) => start = Some(i),
            (0, Some(s)) => {
                runs.push(s..i);
                start = None;
            }
            _ => {}
        }
    }
    runs
}

/// Every record is token-exact: its ids decode to the chat template's rendering of its text transcript,
/// the mask is 1 exactly on the tokens the sampler returned (in order), and every request's prompt,
/// followed by the tokens it got, is a prefix of its rollout's ids.
fn check_token_exact(records: &[RolloutRecord], seen: &[(Request, Completion)]) {
    let tokenizer = tokenizer();
    let template = ChatTemplate::from_dir(model()).unwrap();
    let mut all_ids = Vec::new();
    for record in records {
        assert_eq!(record.error, None);
        for context in &record.contexts {
            let tokens = context.tokens.as_ref().expect("token records");
            assert!(!tokens.retokenized);
            assert_eq!(tokens.ids.len(), tokens.loss_mask.len());
            assert_eq!(tokens.ids.len(), tokens.logprobs.len());

            let messages: Vec<ChatMessage> =
                context.messages.iter().map(ChatMessage::from).collect();
            let rendered = template
                .render(&messages, &RenderOptions::default())
                .unwrap();
            assert_eq!(decode(&tokenizer, &tokens.ids), rendered);

            // The mask covers exactly the sampled parts, each a run of its own.
            let sampled: Vec<&str> = context
                .messages
                .iter()
                .flat_map(|message| &message.parts)
                .filter(|part| part.sampled)
                .map(|part| part.text.as_str())
                .collect();
            let trained: Vec<String> = runs(&tokens.loss_mask)
                .into_iter()
                .map(|run| decode(&tokenizer, &tokens.ids[run]))
                .collect();
            assert_eq!(trained, sampled);
            for (i, &m) in tokens.loss_mask.iter().enumerate() {
                if m == 0 {
                    assert_eq!(tokens.logprobs[i], 0.0);
                }
            }
            all_ids.push(tokens.ids.clone());
        }
    }
    for (request, completion) in seen {
        let Prompt::Tokens(prompt) = &request.prompt else {
            panic!("a chat prompt with a holophore: {:?}", request.prompt);
        };
        assert!(!completion.tokens.is_empty());
        let mut expected = prompt.clone();
        expected.extend_from_slice(&completion.tokens);
        assert!(
            all_ids.iter().any(|ids| ids.starts_with(&expected)),
            "a prompt plus its completion is not a prefix of any record: {:?}",
            decode(&tokenizer, &expected)
        );
    }
    // The sampled ids of all contexts are exactly the completions' tokens.
    let mut from_records: Vec<u32> = Vec::new();
    for record in records {
        for context in &record.contexts {
            let tokens = context.tokens.as_ref().unwrap();
            from_records.extend(
                tokens
                    .ids
                    .iter()
                    .zip(&tokens.loss_mask)
                    .filter(|(_, &m)| m == 1)
                    .map(|(&id, _)| id),
            );
        }
    }
    let mut sampled: Vec<u32> = seen.iter().flat_map(|(_, c)| c.tokens.clone()).collect();
    from_records.sort_unstable();
    sampled.sort_unstable();
    assert_eq!(from_records, sampled);
}

#[test]
fn tool_episodes_are_recorded_token_exact() {
    let (records, seen) = run("hol/tool.hol", "arithmetic.jsonl", &[TOOL_CALL, ANSWER], 2);
    assert_eq!(records.len(), 6);
    // 6 rollouts in one batch per tick: the tokenized script answers each by its turn, so every
    // rollout calls the tool, then answers.
    assert_eq!(seen.len(), 12);
    for record in &records {
        assert_eq!(record.samples, 2);
        let parts: Vec<&str> = record.contexts[0]
            .messages
            .iter()
            .flat_map(|message| &message.parts)
            .filter(|part| part.sampled)
            .map(|part| part.text.as_str())
            .collect();
        assert_eq!(parts, [TOOL_CALL, ANSWER]);
        let expected = if record.row_index == 0 { 1.0 } else { 0.0 };
        assert_eq!(record.reward, expected);
    }
    check_token_exact(&records, &seen);

    // The first prompt ends with the generation prompt; the second after the tool's result.
    let tokenizer = tokenizer();
    let Prompt::Tokens(first) = &seen[0].0.prompt else {
        unreachable!()
    };
    assert!(
        decode(&tokenizer, first).ends_with("What is 17 * 23?<|im_end|>\n<|im_start|>assistant\n")
    );
    let Prompt::Tokens(second) = &seen[6].0.prompt else {
        unreachable!()
    };
    assert!(decode(&tokenizer, second)
        .ends_with("<|im_start|>user\n<result>391</result><|im_end|>\n<|im_start|>assistant\n"));
}

#[test]
fn a_prefilled_fence_is_continued_in_token_space() {
    // qa.hol writes `<answer>` and samples inside the fence.
    let (records, seen) = run("hol/qa.hol", "capitals.jsonl", &["Paris</answer>"], 3);
    assert_eq!(records.len(), 6);
    let tokenizer = tokenizer();
    for (request, _) in &seen {
        let Prompt::Tokens(prompt) = &request.prompt else {
            unreachable!()
        };
        assert!(decode(&tokenizer, prompt).ends_with("<|im_start|>assistant\n<answer>"));
    }
    check_token_exact(&records, &seen);
    for record in &records {
        let expected = if record.row_index == 0 { 1.0 } else { 0.0 };
        assert_eq!(record.reward, expected, "{record:?}");
        let tokens = record.contexts[0].tokens.as_ref().unwrap();
        // `<answer>` is prompt, `Paris</answer>` sampled.
        let trained = runs(&tokens.loss_mask);
        assert_eq!(trained.len(), 1);
        assert_eq!(
            decode(&tokenizer, &tokens.ids[trained[0].clone()]),
            "Paris</answer>"
        );
    }
}

#[test]
fn without_a_holophore_records_have_no_tokens() {
    let holoware = Arc::new(
        Holoware::open(&repo().join("hol/qa.hol"), Arc::new(holotypes::registry())).unwrap(),
    );
    let loom = Loom::interpreted(holoware, Resources::default(), LoomConfig::default());
    let mut out = Vec::new();
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(loom.run(
            &rows("capitals.jsonl"),
            &Scripted::new(["Paris"]),
            &mut Jsonl(&mut out),
        ))
        .unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(!text.contains("\"tokens\""), "{text}");
    let record: RolloutRecord = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert!(record.contexts[0].tokens.is_none());
}

/// Rollouts/s of the Loom over 10k rollouts of `tool.hol` (tool call + answer) with the tokenized scripted
/// sampler, recording with and without the holophore (the fixture's tiny tokenizer). A measurement, not a
/// test: `cargo test --release -p holo-core --test core loom_holophore:: -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement: run it by hand"]
fn throughput_with_and_without_the_holophore() {
    let base = rows("arithmetic.jsonl");
    let rows: Vec<(usize, Row)> = (0..2500).map(|i| (i, base[i % 3].1.clone())).collect();
    let holophore = holophore();
    let holoware = Arc::new(
        Holoware::open(
            &repo().join("hol/tool.hol"),
            Arc::new(holotypes::registry()),
        )
        .unwrap(),
    );
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());
    for with in [false, true] {
        let mut loom = Loom::interpreted(
            Arc::clone(&holoware),
            resources.clone(),
            LoomConfig {
                rollouts_per_row: 4,
                ..LoomConfig::default()
            },
        );
        let mut sampler = Scripted::new([TOOL_CALL, ANSWER]);
        if with {
            loom = loom.with_holophore(holophore.fork());
            sampler = sampler.tokenized(&holophore);
        }
        let mut out = std::io::sink();
        let started = std::time::Instant::now();
        let summary = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(loom.run(&rows, &sampler, &mut Jsonl(&mut out)))
            .unwrap();
        let elapsed = started.elapsed();
        assert_eq!(summary.rollouts, 10_000);
        assert_eq!(summary.failed, 0);
        println!(
            "holophore {with}: {} rollouts in {elapsed:.2?}: {:.0} rollouts/s, {:.1} µs per rollout",
            summary.rollouts,
            summary.rollouts as f64 / elapsed.as_secs_f64(),
            elapsed.as_secs_f64() * 1e6 / summary.rollouts as f64
        );
    }
}
