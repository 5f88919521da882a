//! The Holophore with templates it re-renders at each sample request (see "Re-rendered contexts" in
//! `holo_core::holophore`): Qwen3's, which drops earlier turns' `<think>` blocks and takes
//! `enable_thinking`, and Gemma 3's, which has no system role. The templates are the real ones of
//! `tests/fixtures/chat/models/`; the prompts are compared with transformers' renderings of the same
//! conversations (`tests/fixtures/chat/expected.json`), tokenized whole as `apply_chat_template(...,
//! tokenize=True)` does, and every recorded context with what a scripted sampler was fed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use holo_core::chat::{parse_template_kwargs, ChatTemplate};
use holo_core::holophore::{Context, Holophore, Message};
use holo_core::holotypes;
use holo_core::interpreter::Holoware;
use holo_core::loom::{Loom, LoomConfig, RolloutRecord};
use holo_core::sampler::SampleFuture;
use holo_core::{Completion, Prompt, Recorder, Resources, Role, Sampler, Scripted};
use tokenizers::{AddedToken, Tokenizer};

use crate::common::tempdir::Dir;
use crate::recording::Recording;

const SYSTEM: &str = "You are a helpful assistant.";

fn fixtures() -> PathBuf {
    crate::common::fixtures()
}

/// The byte-level BPE tokenizer of the Holophore fixtures (ChatML's special tokens) with the tokens the
/// family adds: Qwen3's `<think>`/`</think>` (added, not special, as Qwen3 ships them), Gemma's turn
/// markers and BOS (special).
fn tokenizer(family: &str) -> Tokenizer {
    let mut tokenizer = Tokenizer::from_file(fixtures().join("holophore/tokenizer.json"))
        .expect("fixture tokenizer");
    match family {
        "qwen3" => {
            let added = tokenizer.add_tokens([
                AddedToken::from("<think>", false),
                AddedToken::from("</think>", false),
            ]);
            assert_eq!(added.unwrap(), 2);
        }
        "gemma3" => {
            let added = tokenizer.add_special_tokens([
                AddedToken::from("<bos>", true),
                AddedToken::from("<start_of_turn>", true),
                AddedToken::from("<end_of_turn>", true),
            ]);
            assert_eq!(added.unwrap(), 3);
        }
        other => panic!("family {other}"),
    }
    tokenizer
}

fn template(family: &str) -> Arc<ChatTemplate> {
    Arc::new(
        ChatTemplate::from_dir(fixtures().join("chat/models").join(family))
            .expect("template loads"),
    )
}

fn holophore(family: &str, kwargs: &str) -> Holophore {
    let kwargs = parse_template_kwargs(kwargs).expect("kwargs");
    let h = Holophore::with_template_kwargs(Arc::new(tokenizer(family)), template(family), kwargs)
        .expect("the holophore accepts the template");
    assert!(
        h.frames().is_none(),
        "{family}'s template is re-rendered, not cut into frames"
    );
    h
}

/// transformers' rendering of a case of `tests/fixtures/chat/cases.json` with a model's template.
fn expected(family: &str, case: &str) -> String {
    let text = std::fs::read_to_string(fixtures().join("chat/expected.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["results"][family][case]
        .as_str()
        .unwrap_or_else(|| panic!("{family}/{case} is a rendering"))
        .to_string()
}

fn encode(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
    tokenizer.encode(text, false).unwrap().get_ids().to_vec()
}

/// One step of a conversation the tests drive the Holophore through.
enum Turn<'a> {
    Text(Role, &'a str),
    /// A sample request answered with these tokens (and text).
    Sample(Vec<u32>, &'a str),
}

/// Drives `h` through `turns` as a machine and a sampler would; returns the token prompt of each sample
/// request and the closed contexts.
fn drive(h: &mut Holophore, turns: &[Turn]) -> (Vec<Vec<u32>>, Vec<Context>) {
    let mut prompts = Vec::new();
    h.begin_context(true);
    for turn in turns {
        match turn {
            Turn::Text(role, text) => {
                h.begin_message(*role);
                h.text(text);
            }
            Turn::Sample(tokens, text) => {
                h.begin_message(Role::Assistant);
                prompts.push(h.prompt_ids());
                let logprobs = (0..tokens.len()).map(|i| -0.25 - i as f32).collect();
                h.completion(&Completion {
                    text: text.to_string(),
                    tokens: tokens.clone(),
                    logprobs,
                    ..Default::default()
                });
            }
        }
    }
    let contexts = h.finish().to_vec();
    assert!(h.errors().is_empty(), "{:?}", h.errors());
    (prompts, contexts)
}

/// Each context is its prompt as fed to the sampler, the sampled tokens verbatim (the only trained
/// tokens, with their logprobs), and at most a footer.
fn assert_trained_as_seen(contexts: &[Context], prompts: &[Vec<u32>], samples: &[&[u32]]) {
    assert_eq!(contexts.len(), prompts.len());
    for (i, context) in contexts.iter().enumerate() {
        let ids = context.ids();
        let (prompt, sampled) = (&prompts[i], samples[i]);
        assert_eq!(
            &ids[..prompt.len()],
            &prompt[..],
            "context {i}: the prompt fed"
        );
        let end = prompt.len() + sampled.len();
        assert_eq!(
            &ids[prompt.len()..end],
            sampled,
            "context {i}: the sampled tokens"
        );
        let mut mask = vec![0u8; ids.len()];
        mask[prompt.len()..end].fill(1);
        assert_eq!(context.loss_mask(), mask, "context {i}: the loss mask");
        let logprobs = context.logprobs();
        assert_eq!(
            logprobs[prompt.len()],
            -0.25,
            "context {i}: logprobs aligned"
        );
        assert!(logprobs[..prompt.len()].iter().all(|&l| l == 0.0));
        assert_eq!(context.sampled_ids(), sampled);
        assert_eq!(context.source, 0);
        assert_eq!(context.completions, i..i + 1);
    }
}

#[test]
fn qwen3_multi_turn_thinking_splits_contexts_and_stays_token_exact() {
    let tok = tokenizer("qwen3");
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    let think = tok.token_to_id("<think>").unwrap();
    let first = "<think>\nLet me add.\n</think>\n\n4";
    let second = "<think>\n3 plus 3.\n</think>\n\n6";
    let third = "<think>\nAnd 6.\n</think>\n\n12";
    // The first two completions end with the end-of-turn token, as a model's do; the last does not.
    let mut a = encode(&tok, first);
    a.push(im_end);
    let mut b = encode(&tok, second);
    b.push(im_end);
    let c = encode(&tok, third);
    assert_eq!(a[0], think, "<think> is one token, as in Qwen3");
    let mut h = holophore("qwen3", "{}");
    let (prompts, contexts) = drive(
        &mut h,
        &[
            Turn::Text(Role::System, SYSTEM),
            Turn::Text(Role::User, "What is 2+2?"),
            Turn::Sample(a.clone(), first),
            Turn::Text(Role::User, "And 3+3?"),
            Turn::Sample(b.clone(), second),
            Turn::Text(Role::User, "And 6+6?"),
            Turn::Sample(c.clone(), third),
        ],
    );
    // Turn 2's prompt is transformers' rendering (the first turn's thinking dropped), tokenized whole.
    let reasoning_gen = expected("qwen3", "reasoning_gen");
    assert!(!reasoning_gen.contains("Let me add"));
    assert_eq!(prompts[1], encode(&tok, &reasoning_gen));
    assert_eq!(
        tok.decode(&prompts[0], false).unwrap(),
        format!("<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    );
    // No later prompt extends an earlier context: one context per turn, each trained as the model saw it.
    assert_trained_as_seen(&contexts, &prompts, &[&a, &b, &c]);
    // A context ends with the footer the template renders after its turn (its thinking kept).
    assert_eq!(
        tok.decode(&contexts[0].ids(), false).unwrap(),
        format!("<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n{first}<|im_end|>\n")
    );
    assert_eq!(
        tok.decode(&contexts[2].ids(), false).unwrap(),
        format!(
            "{}{third}<|im_end|>\n",
            tok.decode(&prompts[2], false).unwrap()
        )
    );
    // Each context's messages are those it holds.
    let message = |role, content: &str| Message {
        role,
        content: content.to_string(),
        tool: None,
    };
    assert_eq!(
        contexts[0].messages(),
        &[
            message(Role::System, SYSTEM),
            message(Role::User, "What is 2+2?"),
            message(Role::Assistant, first),
        ]
    );
    assert_eq!(contexts[2].messages().len(), 7);
}

#[test]
fn qwen3_without_thinking_renders_the_empty_think_block() {
    let tok = tokenizer("qwen3");
    let mut h = holophore("qwen3", r#"{"enable_thinking": false}"#);
    assert_eq!(
        h.template_kwargs()
            .get("enable_thinking")
            .map(|v| v.is_true()),
        Some(false)
    );
    let a = encode(&tok, "4");
    let b = encode(&tok, "6");
    let (prompts, contexts) = drive(
        &mut h,
        &[
            Turn::Text(Role::System, SYSTEM),
            Turn::Text(Role::User, "What is 2+2?"),
            Turn::Sample(a.clone(), "4"),
            Turn::Text(Role::User, "And 3+3?"),
            Turn::Sample(b.clone(), "6"),
        ],
    );
    assert!(tok
        .decode(&prompts[0], false)
        .unwrap()
        .ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert_eq!(
        prompts[1],
        encode(&tok, &expected("qwen3", "no_thinking_multi_turn"))
    );
    // The earlier turn loses its empty think block in the history: a new context.
    assert_trained_as_seen(&contexts, &prompts, &[&a, &b]);
    let last_turn = expected("qwen3", "no_thinking_last_turn");
    assert!(tok
        .decode(&contexts[0].ids(), false)
        .unwrap()
        .ends_with(&last_turn[last_turn.find("<|im_start|>assistant").unwrap()..]));
}

#[test]
fn qwen3_continuing_an_assistant_message_extends_the_context() {
    // A prefill the model continues (transformers' `continue_final_message`: Qwen3 puts an empty think
    // block before the last turn's content), then a second completion of the same message: every
    // rendering extends the context, so nothing is split.
    let tok = tokenizer("qwen3");
    let mut h = holophore("qwen3", "{}");
    h.begin_context(true);
    h.begin_message(Role::System);
    h.text(SYSTEM);
    h.begin_message(Role::User);
    h.text("Count to five.");
    h.begin_message(Role::Assistant);
    h.text("1, 2, 3,");
    let prompt = h.prompt_ids();
    assert_eq!(prompt, encode(&tok, &expected("qwen3", "continue_final")));
    let a = encode(&tok, " 4,");
    h.completion(&Completion {
        text: " 4,".into(),
        tokens: a.clone(),
        ..Default::default()
    });
    let again = h.prompt_ids();
    assert_eq!(again, [prompt, a.clone()].concat());
    let b = encode(&tok, " 5.");
    h.completion(&Completion {
        text: " 5.".into(),
        tokens: b.clone(),
        ..Default::default()
    });
    let contexts = h.finish().to_vec();
    assert!(h.errors().is_empty(), "{:?}", h.errors());
    assert_eq!(contexts.len(), 1);
    assert_eq!(contexts[0].sampled_ids(), [a, b].concat());
    assert_eq!(contexts[0].completions, 0..2);
}

#[test]
fn gemma3_folds_the_system_message_into_the_first_user_turn() {
    let tok = tokenizer("gemma3");
    let end_of_turn = tok.token_to_id("<end_of_turn>").unwrap();
    let mut h = holophore("gemma3", "{}");
    assert_eq!(
        tok.decode(&h.assistant_header(), false).unwrap(),
        "<start_of_turn>model\n"
    );
    let mut a = encode(&tok, "2 + 2 = 4.");
    a.push(end_of_turn);
    let b = encode(&tok, "3 + 3 = 6.");
    let (prompts, contexts) = drive(
        &mut h,
        &[
            Turn::Text(Role::System, SYSTEM),
            Turn::Text(Role::User, "What is 2 + 2?"),
            Turn::Sample(a.clone(), "2 + 2 = 4."),
            Turn::Text(Role::User, "And 3 + 3?"),
            Turn::Sample(b.clone(), "3 + 3 = 6."),
        ],
    );
    // The prompts are transformers' renderings: no system turn, the system text opens the user's.
    assert_eq!(
        prompts[1],
        encode(&tok, &expected("gemma3", "system_multi_turn_gen"))
    );
    assert!(tok
        .decode(&prompts[0], false)
        .unwrap()
        .starts_with(&format!(
            "<bos><start_of_turn>user\n{SYSTEM}\n\nWhat is 2 + 2?"
        )));
    // Every rendering extends the context: one context, both turns trained, the first with its
    // sampled end of turn.
    assert_eq!(contexts.len(), 1);
    let context = &contexts[0];
    let ids = context.ids();
    assert_eq!(ids[..prompts[1].len()], prompts[1][..]);
    assert_eq!(context.sampled_ids(), [a.clone(), b.clone()].concat());
    let trained: Vec<u32> = ids
        .iter()
        .zip(context.loss_mask())
        .filter(|(_, m)| *m == 1)
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(trained, [a, b].concat());
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        expected("gemma3", "system_multi_turn_nogen")
    );
}

#[test]
fn a_conversation_the_template_refuses_is_an_error_of_the_rollout() {
    let mut h = holophore("gemma3", "{}");
    h.begin_context(true);
    h.begin_message(Role::User);
    h.text("one");
    h.begin_message(Role::User);
    h.text("two");
    h.prompt_ids();
    assert!(
        h.errors()
            .iter()
            .any(|e| e.contains("Conversation roles must alternate")),
        "{:?}",
        h.errors()
    );
}

#[test]
fn template_kwargs_are_a_json_object() {
    let kwargs = parse_template_kwargs(r#"{"enable_thinking": false, "n": [1, "a"]}"#).unwrap();
    assert_eq!(kwargs.len(), 2);
    for (text, said) in [
        ("[1]", "got an array"),
        ("true", "got a boolean"),
        ("\"x\"", "got a string"),
        ("{", "not valid JSON"),
    ] {
        let error = parse_template_kwargs(text).unwrap_err();
        assert!(error.contains(said), "{text}: {error}");
    }
    // Frame-cut templates take them too: ChatML ignores `enable_thinking`.
    let tokenizer = Arc::new(tokenizer("qwen3"));
    let chatml = Arc::new(ChatTemplate::chatml());
    let plain = Holophore::new(Arc::clone(&tokenizer), Arc::clone(&chatml)).unwrap();
    let with = Holophore::with_template_kwargs(tokenizer, chatml, BTreeMap::new()).unwrap();
    assert_eq!(plain.frames(), with.frames());
}

/// A Qwen3 model folder for the Loom: the fixture tokenizer with `<think>` tokens and Qwen3's
/// tokenizer_config.json.
fn qwen3_folder(label: &str) -> Dir {
    let dir = Dir::new(label);
    tokenizer("qwen3")
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    std::fs::copy(
        fixtures().join("chat/models/qwen3/tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    dir
}

#[test]
fn the_loom_records_each_split_context_as_the_model_saw_it() {
    // A two-turn holoware on the Qwen3 folder, sampled by the tokenized scripted sampler.
    let dir = qwen3_folder("qwen3-folder");
    let hol = dir.join("two_turns.hol");
    std::fs::write(
        &hol,
        "<|+++|>\n<|x_x|>\nYou are a helpful assistant.\n\n<|o_o|>\n<|question|>\n\n<|@_@:first|>\n\n<|o_o|>\nAnd 3+3?\n\n<|@_@:second|>\n",
    )
    .unwrap();
    let holophore = Holophore::from_dir(dir.path()).unwrap();
    let holoware = Arc::new(Holoware::open(&hol, Arc::new(holotypes::registry())).unwrap());
    let loom = Loom::interpreted(
        holoware,
        Resources::default(),
        LoomConfig {
            rollouts_per_row: 1,
            timing: false,
            ..LoomConfig::default()
        },
    )
    .with_holophore(holophore.fork());
    let replies = [
        "<think>\nLet me add.\n</think>\n\n4",
        "<think>\n3 plus 3.\n</think>\n\n6",
    ];
    let sampler = Recording {
        inner: Scripted::new(replies).tokenized(&holophore),
        seen: Mutex::new(Vec::new()),
    };
    let (summary, record) =
        crate::recording::run_row(&loom, r#"{"question": "What is 2+2?"}"#, &sampler);
    assert_eq!(summary.failed, 0, "{summary:?}");
    assert!(record.error.is_none(), "{:?}", record.error);
    let seen = sampler.seen.into_inner().unwrap();
    assert_eq!(seen.len(), 2);
    // One record per split: each with the tokens fed to the sampler, then the sampled tokens, trained.
    assert_eq!(record.contexts.len(), 2);
    for (context, (request, completion)) in record.contexts.iter().zip(&seen) {
        let Prompt::Tokens(prompt) = &request.prompt else {
            panic!("a token prompt")
        };
        let tokens = context.tokens.as_ref().expect("token records");
        assert!(context.trained);
        assert_eq!(tokens.ids[..prompt.len()], prompt[..]);
        let end = prompt.len() + completion.tokens.len();
        assert_eq!(tokens.ids[prompt.len()..end], completion.tokens[..]);
        let trained: Vec<usize> = (0..tokens.ids.len())
            .filter(|&i| tokens.loss_mask[i] == 1)
            .collect();
        assert_eq!(trained, (prompt.len()..end).collect::<Vec<_>>());
    }
    // The second prompt is the re-rendering: the first turn's thinking is gone.
    let tok = holophore.tokenizer();
    let Prompt::Tokens(second) = &seen[1].0.prompt else {
        unreachable!()
    };
    let text = tok.decode(second, false).unwrap();
    assert!(text.contains("<|im_start|>assistant\n4<|im_end|>") && !text.contains("Let me add"));
    // Messages: the first record ends with its turn; the second holds the first turn as prompt only.
    let roles =
        |i: usize| -> Vec<Role> { record.contexts[i].messages.iter().map(|m| m.role).collect() };
    assert_eq!(roles(0), [Role::System, Role::User, Role::Assistant]);
    assert_eq!(
        roles(1),
        [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::User,
            Role::Assistant
        ]
    );
    assert!(!record.contexts[1].messages[2].parts[0].sampled);
    assert_eq!(record.sampled().collect::<Vec<_>>(), replies);
}

/// The Loom on [`qwen3_folder`] running `source`, sampled by the scripted sampler with `replies`,
/// tokenized by the folder's Holophore: the requests it saw, and the record.
fn loom_on(
    source: &str,
    replies: &[&str],
) -> (Vec<(holo_core::Request, Completion)>, RolloutRecord) {
    let dir = qwen3_folder("qwen3-arguments");
    let hol = dir.join("contexts.hol");
    std::fs::write(&hol, source).unwrap();
    let holophore = Holophore::from_dir(dir.path()).unwrap();
    let holoware = Arc::new(Holoware::open(&hol, Arc::new(holotypes::registry())).unwrap());
    let config = LoomConfig {
        rollouts_per_row: 1,
        timing: false,
        ..LoomConfig::default()
    };
    let loom =
        Loom::interpreted(holoware, Resources::default(), config).with_holophore(holophore.fork());
    let sampler = Recording {
        inner: Scripted::new(replies.iter().copied()).tokenized(&holophore),
        seen: Mutex::new(Vec::new()),
    };
    let (_, record) = crate::recording::run_row(&loom, r#"{"question": "What is 2+2?"}"#, &sampler);
    (sampler.seen.into_inner().unwrap(), record)
}

/// A context marker's template arguments (`<|+++ enable_thinking=false|>`) render that context as
/// transformers renders the conversation with them; the next context, without arguments, renders
/// with the run's (thinking on: no empty think block).
#[test]
fn a_context_markers_template_arguments_render_that_context() {
    let source = "<|+++ enable_thinking=false|>\n<|x_x|>\nYou are a helpful assistant.\n\n<|o_o|>\n<|question|>\n\n<|@_@:first|>\n\n<|o_o|>\nAnd 3+3?\n\n<|@_@:second|>\n\n<|+++|>\n<|x_x|>\nYou are a helpful assistant.\n\n<|o_o|>\n<|question|>\n\n<|@_@:third|>\n";
    let (seen, record) = loom_on(source, &["4", "6", "<think>\nAdd.\n</think>\n\n4"]);
    assert!(record.error.is_none(), "{:?}", record.error);
    assert_eq!(seen.len(), 3);
    let tok = tokenizer("qwen3");
    let prompt = |i: usize| -> Vec<u32> {
        let Prompt::Tokens(prompt) = &seen[i].0.prompt else {
            panic!("a token prompt")
        };
        prompt.clone()
    };
    assert!(tok
        .decode(&prompt(0), false)
        .unwrap()
        .ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert_eq!(
        prompt(1),
        encode(&tok, &expected("qwen3", "no_thinking_multi_turn"))
    );
    let third = tok.decode(&prompt(2), false).unwrap();
    assert!(
        third.ends_with("<|im_start|>assistant\n") && !third.contains("</think>"),
        "{third:?}"
    );
    // Each context trains on what it sampled: the first context's two turns split where Qwen3 drops
    // the earlier empty think block, then the third context.
    assert_eq!(record.contexts.len(), 3);
    for (context, (request, completion)) in record.contexts.iter().zip(&seen) {
        let Prompt::Tokens(fed) = &request.prompt else {
            unreachable!()
        };
        let tokens = context.tokens.as_ref().expect("token records");
        assert_eq!(tokens.ids[..fed.len()], fed[..]);
        assert_eq!(
            tokens.ids[fed.len()..fed.len() + completion.tokens.len()],
            completion.tokens[..]
        );
    }
}

/// A sampler of chat messages that answers "4" and keeps every request.
struct Chats(Mutex<Vec<holo_core::Request>>);

impl Sampler for Chats {
    fn sample<'a>(&'a self, batch: &'a [holo_core::Request]) -> SampleFuture<'a> {
        Box::pin(async move {
            self.0.lock().unwrap().extend(batch.iter().cloned());
            batch
                .iter()
                .map(|_| {
                    Ok(Completion {
                        text: "4".into(),
                        ..Default::default()
                    })
                })
                .collect()
        })
    }
}

/// With a sampler of chat messages (a server renders them), a context's template arguments go with
/// each of its requests as `chat_template_kwargs`; the next context's requests carry none.
#[test]
fn template_arguments_go_to_a_chat_sampler_with_the_contexts_requests() {
    let source = "<|+++ enable_thinking=false depth=2|>\n<|o_o|>\n<|question|>\n\n<|@_@:first|>\n\n<|o_o|>\nAgain.\n\n<|@_@:second|>\n\n<|+++|>\n<|o_o|>\n<|question|>\n\n<|@_@:third|>\n";
    let dir = Dir::new("chat-arguments");
    let hol = dir.join("contexts.hol");
    std::fs::write(&hol, source).unwrap();
    let holoware = Arc::new(Holoware::open(&hol, Arc::new(holotypes::registry())).unwrap());
    let config = LoomConfig {
        rollouts_per_row: 1,
        timing: false,
        ..LoomConfig::default()
    };
    let loom = Loom::interpreted(holoware, Resources::default(), config);
    let sampler = Chats(Mutex::new(Vec::new()));
    let (_, record) = crate::recording::run_row(&loom, r#"{"question": "What is 2+2?"}"#, &sampler);
    assert!(record.error.is_none(), "{:?}", record.error);
    let requests = sampler.0.into_inner().unwrap();
    let kwargs: Vec<Option<serde_json::Value>> = requests
        .iter()
        .map(|request| {
            assert!(matches!(request.prompt, Prompt::Chat(_)));
            request
                .params
                .chat_template_kwargs
                .clone()
                .map(serde_json::Value::Object)
        })
        .collect();
    let own = serde_json::json!({"enable_thinking": false, "depth": 2});
    assert_eq!(kwargs, [Some(own.clone()), Some(own), None]);
}
