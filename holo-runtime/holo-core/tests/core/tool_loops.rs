//! Native tool loops in the formats whose markers are special tokens: Mistral's `[TOOL_CALLS]` (Mistral
//! Nemo's and Mistral Small 3.2's templates) and gpt-oss's harmony, run through a holoware end to end with a sampler that hands
//! back the tokens a model writes and, as samplers do, their text without the special tokens. Every
//! prompt is compared token for token with transformers' rendering of the same conversation
//! (`tests/fixtures/chat/tool_models/tool_loops.json`, written by `scripts/tool_loop_fixtures.py` with the
//! real templates), and the records with that conversation.

use std::sync::{Arc, Mutex};

use holo_core::chat::{json_value, ChatTemplate, RenderOptions};
use holo_core::export;
use holo_core::holophore::Holophore;
use holo_core::holotypes::{self, ToolStats, Tools};
use holo_core::interpreter::Holoware;
use holo_core::loom::{Loom, LoomConfig, RolloutRecord};
use holo_core::sampler::SampleFuture;
use holo_core::tools::ToolFormat;
use holo_core::{Completion, Prompt, Request, Resources, Sampler};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::common::tempdir::Dir;
use crate::recording::Recording;

fn fixture() -> Value {
    let path = crate::common::fixtures().join("chat/tool_models/tool_loops.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Replies as a model writes them: the tokens of each reply (its special tokens included), and as text
/// what samplers hand back, the tokens decoded without their special tokens.
struct Model {
    tokenizer: Arc<Tokenizer>,
    replies: Vec<String>,
    next: Mutex<usize>,
}

impl Sampler for Model {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        let results = batch
            .iter()
            .map(|_| {
                let mut next = self.next.lock().unwrap();
                let reply = &self.replies[*next];
                *next += 1;
                let tokens = self.tokenizer.encode(reply.as_str(), false).unwrap();
                let tokens = tokens.get_ids().to_vec();
                Ok(Completion {
                    text: self.tokenizer.decode(&tokens, true).unwrap(),
                    logprobs: vec![0.0; tokens.len()],
                    tokens,
                    ..Completion::default()
                })
            })
            .collect();
        Box::pin(std::future::ready(results))
    }
}

/// A tool loop over the calculator; the tools are offered in the system message, or in the user's
/// when there is none (Mistral Nemo's template shows a system message only with the last user turn).
fn holoware(system: Option<&str>) -> String {
    let start = match system {
        Some(system) => {
            format!(
                "<|+++|>\n<|x_x|>\n{system}<|ToolSchema parser=auto|>\n\n<|o_o|>\n<|question|>\n\n"
            )
        }
        None => "<|+++|>\n<|o_o|>\n<|question|><|ToolSchema parser=auto|>\n\n".to_string(),
    };
    start + "<|ToolRunner max_turns=6|>\n    <|@_@:turn|>\n    <|ToolExecutor turn|>\n<|MathAnswer var=turn|>\n"
}

/// What a run gave: the record, each request's token prompt with the completion it got, and the counts
/// of calls (`tools/calls`, `tools/failed`).
struct Run {
    record: RolloutRecord,
    turns: Vec<(Vec<u32>, Completion)>,
    counts: (u64, u64),
}

/// Runs `case`'s holoware on its model folder.
fn run(case: &Value) -> Run {
    let folder = crate::common::fixtures()
        .join("chat/tool_models")
        .join(case["model"].as_str().unwrap());
    let holophore = Holophore::from_dir(&folder).unwrap();
    let dir = Dir::new("tool-loops");
    let hol = dir.join("loop.hol");
    std::fs::write(&hol, holoware(case["system"].as_str())).unwrap();
    let holoware = Arc::new(Holoware::open(&hol, Arc::new(holotypes::registry())).unwrap());
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());
    resources.insert(ToolStats::default());
    let stats = resources.get::<ToolStats>().unwrap();
    let loom = Loom::interpreted(
        holoware,
        resources,
        LoomConfig {
            rollouts_per_row: 1,
            timing: false,
            ..LoomConfig::default()
        },
    )
    .with_holophore(holophore.fork());
    let replies: Vec<String> = case["replies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|reply| reply.as_str().unwrap().to_string())
        .collect();
    let sampler = Recording {
        inner: Model {
            tokenizer: Arc::clone(holophore.tokenizer()),
            replies,
            next: Mutex::new(0),
        },
        seen: Mutex::new(Vec::new()),
    };
    let row = serde_json::json!({"question": case["question"], "expected": "391"}).to_string();
    let (summary, record) = crate::recording::run_row(&loom, &row, &sampler);
    assert_eq!(summary.failed, 0, "{summary:?} {:?}", record.error);
    let seen = sampler
        .seen
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|(request, completion)| match request.prompt {
            Prompt::Tokens(ids) => (ids, completion),
            other => panic!("a token prompt, not {other:?}"),
        })
        .collect();
    let counts = stats.counts();
    Run {
        record,
        turns: seen,
        counts: (counts.calls, counts.failed),
    }
}

fn today() -> String {
    chrono::Local::now().format("%Y-%m-%d").to_string()
}

/// Runs case `key` and checks every prompt, the contexts and the record against the fixture; returns
/// the last context exported (TRL's conversational format), its ids and the tokenizer.
fn check(
    key: &str,
    contexts: usize,
    counts: (u64, u64),
) -> (export::Conversation, Vec<u32>, Tokenizer) {
    let fixture = fixture();
    let case = &fixture["cases"][key];
    let folder = crate::common::fixtures()
        .join("chat/tool_models")
        .join(case["model"].as_str().unwrap());
    let tokenizer = Tokenizer::from_file(folder.join("tokenizer.json")).unwrap();
    let encode = |text: &str| tokenizer.encode(text, false).unwrap().get_ids().to_vec();
    // gpt-oss's template prints today's date, which transformers rendered at the fixture's instant: run
    // again if the day changed during the run.
    let (record, seen, date) = loop {
        let date = today();
        let Run {
            record,
            turns: seen,
            counts: got,
        } = run(case);
        if today() == date {
            assert_eq!(got, counts, "{key}: tools/calls, tools/failed");
            break (record, seen, date);
        }
    };
    let at_fixture = format!("Current date: {}", &fixture["now"].as_str().unwrap()[..10]);
    let prompts = case["prompts"].as_array().unwrap();
    assert_eq!(seen.len(), prompts.len(), "{key}: turns");
    for (turn, ((prompt, _), expected)) in seen.iter().zip(prompts).enumerate() {
        let text = expected["text"].as_str().unwrap();
        // The tokenizer splits transformers' rendering as transformers does.
        let ids: Vec<u32> = serde_json::from_value(expected["ids"].clone()).unwrap();
        assert_eq!(encode(text), ids, "{key} turn {turn}: tokenizer");
        let text = text.replace(&at_fixture, &format!("Current date: {date}"));
        assert_eq!(
            tokenizer.decode(prompt, false).unwrap(),
            text,
            "{key} turn {turn}"
        );
        assert_eq!(*prompt, encode(&text), "{key} turn {turn}: ids");
        if expected["grows"].as_bool().unwrap() {
            let (before, completion) = &seen[turn - 1];
            let extended = [before.as_slice(), &completion.tokens].concat();
            assert_eq!(prompt[..extended.len()], extended[..], "{key} turn {turn}");
        }
    }
    // A context per prompt that does not extend the one before, each trained on exactly the tokens
    // sampled in it.
    let mut pieces: Vec<Vec<u32>> = Vec::new();
    for ((_, completion), expected) in seen.iter().zip(prompts) {
        if !expected["grows"].as_bool().unwrap() {
            pieces.push(Vec::new());
        }
        pieces.last_mut().unwrap().extend(&completion.tokens);
    }
    assert_eq!(pieces.len(), contexts, "{key}: contexts");
    assert_eq!(record.contexts.len(), contexts, "{key}: contexts");
    for (index, (context, sampled)) in record.contexts.iter().zip(&pieces).enumerate() {
        let tokens = context.tokens.as_ref().unwrap();
        let trained: Vec<u32> = tokens
            .ids
            .iter()
            .zip(&tokens.loss_mask)
            .filter(|(_, mask)| **mask == 1)
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(trained, *sampled, "{key}: context {index}");
        assert!(!tokens.retokenized, "{key}: context {index}");
    }
    assert!(record.error.is_none(), "{:?}", record.error);
    assert_eq!(record.rewards.get("math_answer"), Some(&1.0), "{key}");

    // The last context's record holds the whole conversation: the calls with their ids and the
    // reasoning harmony writes apart, the results answering them by id, and the answer (the sampler's
    // text; harmony's final message, its analysis as `thinking`), as the fixture's messages.
    let last = record.contexts.last().unwrap();
    assert_eq!(
        last.tools,
        fixture["tools"].as_array().unwrap()[..],
        "{key}"
    );
    let conversation = export::conversation(last).unwrap();
    let messages: Vec<Value> = conversation
        .prompt
        .iter()
        .chain(&conversation.completion)
        .map(|message| serde_json::to_value(message).unwrap())
        .collect();
    assert_eq!(
        messages,
        case["messages"].as_array().unwrap()[..],
        "{key}: {messages:#?}"
    );
    (conversation, last.tokens.clone().unwrap().ids, tokenizer)
}
/// Mistral Nemo: a call written with its id as the template writes it (the context grows), a malformed
/// call (recorded as a call of `mistral` with the text written, answered with what was wrong: the
/// context splits), two calls, one of an unknown tool, without ids (ids drawn: it splits), the answer.
#[test]
fn mistral_tool_loops_render_as_transformers_renders_them() {
    let (conversation, ids, tokenizer) = check("mistral", 3, (4, 2));
    // Exported, the conversation renders through the model's template to the tokens it was trained on.
    let values = |values: Vec<Value>| {
        values
            .iter()
            .map(|value| json_value(&value.to_string()).unwrap())
            .collect::<Vec<_>>()
    };
    let messages = conversation
        .prompt
        .iter()
        .chain(&conversation.completion)
        .map(|message| serde_json::to_value(message).unwrap())
        .collect();
    let template =
        ChatTemplate::from_dir(crate::common::fixtures().join("chat/tool_models/mistral-nemo"))
            .unwrap();
    let rendered = template
        .render_values(
            values(messages),
            &RenderOptions {
                tools: Some(values(conversation.tools.clone())),
                ..RenderOptions::default()
            },
        )
        .unwrap();
    assert_eq!(rendered, tokenizer.decode(&ids, false).unwrap());
}

/// Mistral Small 3.2 (v11: `[TOOL_CALLS]name[ARGS]{…}`): a call without the `[CALL_ID]` its template
/// writes in history (it splits), one with it (the context grows), a malformed one (its function read,
/// its arguments the text written), the answer.
#[test]
fn mistral_v11_tool_loops_render_as_transformers_renders_them() {
    check("mistral_v11", 3, (3, 1));
}

/// gpt-oss: a call written as the template renders calls (the context grows), one as gpt-oss writes
/// them (the recipient after the channel: it splits), a malformed call, an unknown tool, the answer
/// after its reasoning.
#[test]
fn harmony_tool_loops_render_as_transformers_renders_them() {
    check("harmony", 4, (4, 2));
}

#[test]
fn templates_that_write_special_markers_are_told_apart() {
    for (model, format) in [
        ("mistral-nemo", ToolFormat::Mistral),
        ("mistral-small", ToolFormat::Mistral),
        ("gpt-oss", ToolFormat::Harmony),
    ] {
        let template = ChatTemplate::from_dir(
            crate::common::fixtures()
                .join("chat/tool_models")
                .join(model),
        )
        .unwrap();
        let source: String = template
            .template_names()
            .iter()
            .filter_map(|name| template.source(name))
            .collect();
        assert_eq!(ToolFormat::detect(&source), Some(format), "{model}");
    }
}
