//! The Holophore against transformers' `apply_chat_template(..., tokenize=True)` (fixtures made by
//! `scripts/holophore_fixtures.py`), and token-exactness as a property.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use holo_core::chat::ChatTemplate;
use holo_core::holophore::{FragmentKind, Holophore, HolophoreError, Message};
use holo_core::{Completion, Recorder, Role};
use proptest::prelude::*;
use serde_json::Value;
use tokenizers::Tokenizer;

fn fixtures() -> PathBuf {
    crate::common::fixtures().join("holophore")
}

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_file(fixtures().join("tokenizer.json")).expect("fixture tokenizer"))
}

fn special_tokens() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("bos_token".to_string(), "<|endoftext|>".to_string()),
        ("eos_token".to_string(), "<|im_end|>".to_string()),
        ("pad_token".to_string(), "<|endoftext|>".to_string()),
    ])
}

fn template(name: &str) -> Arc<ChatTemplate> {
    let path = fixtures().join("templates").join(format!("{name}.jinja"));
    let source = std::fs::read_to_string(&path).expect("fixture template");
    Arc::new(ChatTemplate::from_source(source, name, special_tokens()).expect("template parses"))
}

fn holophore(name: &str) -> Holophore {
    Holophore::new(tokenizer(), template(name)).expect("frames derive")
}

fn encode(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
    tokenizer
        .encode(text, false)
        .expect("encodes")
        .get_ids()
        .to_vec()
}

fn role(name: &str) -> Role {
    match name {
        "system" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        other => panic!("role {other}"),
    }
}

fn fake_logprobs(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| -((i + seed) as f32) / 8.0 - 0.01).collect()
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join("cases.json")).expect("cases.json");
    serde_json::from_str::<Value>(&text)
        .expect("json")
        .as_array()
        .expect("a list")
        .clone()
}

fn ids_of(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

/// How the assistant messages of the parity cases are given.
#[derive(Clone, Copy, PartialEq)]
enum Sampled {
    /// Completion tokens = the tokenizer's encoding of the content.
    Tokens,
    /// Completion tokens = content tokens + `<|im_end|>` (a sampler that reports the end-of-turn token).
    TokensWithEos,
    /// Text only: the Holophore re-tokenizes.
    TextOnly,
}

fn check_case(case: &Value, sampled: Sampled) {
    let tok = tokenizer();
    let template_name = case["template"].as_str().unwrap();
    let generation = case["add_generation_prompt"].as_bool().unwrap();
    let expected = ids_of(&case["ids"]);
    let spans: Vec<(usize, usize)> = case["assistant_spans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s[0].as_u64().unwrap() as usize,
                s[1].as_u64().unwrap() as usize,
            )
        })
        .collect();
    let label = format!(
        "{template_name} conversation {} generation {generation}",
        case["conversation"]
    );
    let im_end = tok.token_to_id("<|im_end|>").unwrap();

    let mut h = holophore(template_name);
    h.begin_context(true);
    let mut assistant = 0;
    let mut view = Vec::new();
    for message in case["messages"].as_array().unwrap() {
        let role = role(message["role"].as_str().unwrap());
        let content = message["content"].as_str().unwrap();
        view.push(Message {
            role,
            content: content.to_string(),
            tool: None,
        });
        h.begin_message(role);
        if role == Role::Assistant {
            // The token prompt a sampler would receive: transformers' ids up to the content.
            let (start, _) = spans[assistant];
            assert_eq!(
                h.prompt_ids(),
                expected[..start].to_vec(),
                "{label}: prompt {assistant}"
            );
            let mut tokens = encode(&tok, content);
            if sampled == Sampled::TokensWithEos {
                tokens.push(im_end);
            }
            let logprobs = fake_logprobs(tokens.len(), assistant);
            let completion = match sampled {
                Sampled::TextOnly => Completion {
                    text: content.to_string(),
                    ..Default::default()
                },
                _ => Completion {
                    text: content.to_string(),
                    tokens,
                    logprobs,
                    ..Default::default()
                },
            };
            h.completion(&completion);
            assistant += 1;
        } else {
            h.text(content);
        }
    }
    if generation {
        assert_eq!(h.prompt_ids(), expected, "{label}: generation prompt");
        return;
    }
    let contexts = h.finish().to_vec();
    assert_eq!(contexts.len(), 1);
    let context = &contexts[0];
    assert_eq!(context.ids(), expected, "{label}: ids");
    assert_eq!(
        context.messages(),
        view.as_slice(),
        "{label}: messages view"
    );
    let mask = context.loss_mask();
    let logprobs = context.logprobs();
    assert_eq!(mask.len(), expected.len());
    assert_eq!(logprobs.len(), expected.len());
    let mut want_mask = vec![0u8; expected.len()];
    let mut want_logprobs = vec![0f32; expected.len()];
    for (i, &(start, end)) in spans.iter().enumerate() {
        // With the end-of-turn token sampled, the footer's `<|im_end|>` is the model's: trained.
        let end = if sampled == Sampled::TokensWithEos {
            assert_eq!(
                expected[end], im_end,
                "{label}: the footer starts with <|im_end|>"
            );
            end + 1
        } else {
            end
        };
        want_mask[start..end].fill(1);
        if sampled != Sampled::TextOnly {
            want_logprobs[start..end].copy_from_slice(&fake_logprobs(end - start, i));
        }
    }
    assert_eq!(mask, want_mask, "{label}: mask");
    assert_eq!(logprobs, want_logprobs, "{label}: logprobs");
    assert_eq!(
        context.retokenized(),
        sampled == Sampled::TextOnly && !spans.is_empty()
    );
}

#[test]
fn parity_with_transformers_sampled_tokens() {
    let cases = cases();
    assert_eq!(cases.len(), 24);
    for case in &cases {
        check_case(case, Sampled::Tokens);
    }
}

#[test]
fn parity_when_the_sampler_reports_the_end_of_turn_token() {
    for case in cases() {
        check_case(&case, Sampled::TokensWithEos);
    }
}

#[test]
fn parity_with_retokenized_text_completions() {
    for case in cases() {
        check_case(&case, Sampled::TextOnly);
    }
}

#[test]
fn frames_of_chatml_with_a_default_system_prompt() {
    let tok = tokenizer();
    let h = holophore("qwen_default_system");
    let frames = h.frames().expect("ChatML is cut into frames");
    let text = |ids: &[u32]| tok.decode(ids, false).unwrap();
    assert_eq!(text(&frames.opening[0]), "<|im_start|>system\n");
    assert_eq!(
        text(&frames.opening[1]),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    );
    assert_eq!(
        text(&frames.gap[1][2]),
        "<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(text(&frames.closing[2]), "<|im_end|>\n");
    assert_eq!(
        text(&frames.generation[1]),
        "<|im_end|>\n<|im_start|>assistant\n"
    );
    // The BOS template: BOS is part of every opening.
    let h = holophore("bos_chatml");
    assert_eq!(
        text(&h.frames().unwrap().opening[1]),
        "<|endoftext|><|im_start|>user\n"
    );
    assert_eq!(text(&h.frames().unwrap().closing[1]), "<|im_end|>");
}

#[test]
fn the_template_of_the_model_folder_loads() {
    let template = ChatTemplate::from_dir(fixtures()).expect("fixture folder");
    let h = Holophore::new(tokenizer(), Arc::new(template)).expect("frames");
    assert_eq!(h.frames(), holophore("chatml").frames());
}

#[test]
fn messages_without_content_are_not_emitted_and_text_is_tokenized_once() {
    let tok = tokenizer();
    let mut h = holophore("chatml");
    h.begin_context(true);
    h.begin_message(Role::System);
    h.text("You are ");
    h.text("a helpful assistant.");
    h.begin_message(Role::User);
    h.text("What is 2 + 2?");
    h.begin_message(Role::Assistant);
    let prompt = h.prompt_ids();
    let tokens = encode(&tok, "4");
    h.completion(&Completion {
        text: "4".into(),
        tokens: tokens.clone(),
        ..Default::default()
    });
    // A user turn the machine opens and never writes.
    h.begin_message(Role::User);
    Recorder::reward(&mut h, "exact", 1.0, 2.0);
    Recorder::reward(&mut h, "format", 0.5, 1.0);
    let contexts = h.finish().to_vec();
    let context = &contexts[0];
    assert_eq!(
        context.messages(),
        &[
            Message {
                role: Role::System,
                content: "You are a helpful assistant.".into(),
                tool: None,
            },
            Message {
                role: Role::User,
                content: "What is 2 + 2?".into(),
                tool: None,
            },
            Message {
                role: Role::Assistant,
                content: "4".into(),
                tool: None,
            },
        ]
    );
    let rendered = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n";
    assert_eq!(context.ids(), encode(&tok, rendered));
    assert!(context.ids().starts_with(&prompt));
    assert_eq!(
        context.ids()[prompt.len()..prompt.len() + tokens.len()],
        tokens[..]
    );
    // The system text was buffered and tokenized as one fragment.
    let prompts: Vec<_> = context
        .fragments
        .iter()
        .filter(|f| f.kind == FragmentKind::Prompt)
        .collect();
    assert_eq!(prompts.len(), 2);
    assert_eq!(prompts[0].ids, encode(&tok, "You are a helpful assistant."));
    assert_eq!(h.rewards().len(), 2);
    assert_eq!(h.reward(), 2.5);
}

#[test]
fn untrained_contexts_have_no_loss_and_contexts_close_in_order() {
    let tok = tokenizer();
    let mut h = holophore("chatml");
    h.begin_context(false);
    h.begin_message(Role::User);
    h.text("Check this");
    h.begin_message(Role::Assistant);
    let a = encode(&tok, "ok");
    h.completion(&Completion {
        text: "ok".into(),
        tokens: a.clone(),
        logprobs: vec![-0.5; a.len()],
        ..Default::default()
    });
    h.begin_context(true);
    // Text before any begin_message goes to an implicit system message.
    h.text("sys");
    h.begin_message(Role::Assistant);
    let b = encode(&tok, "yes");
    h.completion(&Completion {
        text: "yes".into(),
        tokens: b.clone(),
        ..Default::default()
    });
    assert!(h.contexts()[0].is_closed());
    assert!(!h.contexts()[1].is_closed());
    let contexts = h.finish().to_vec();
    assert_eq!(contexts.len(), 2);
    assert!(contexts[0].loss_mask().iter().all(|&m| m == 0));
    assert_eq!(contexts[0].sampled_ids(), a);
    assert_eq!(
        contexts[0].logprobs().iter().filter(|&&l| l != 0.0).count(),
        a.len()
    );
    assert_eq!(contexts[1].messages()[0].role, Role::System);
    assert_eq!(
        contexts[1].ids(),
        encode(
            &tok,
            "<|im_start|>system\nsys<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"
        )
    );
    assert_eq!(
        contexts[1]
            .loss_mask()
            .iter()
            .map(|&m| m as usize)
            .sum::<usize>(),
        b.len()
    );
    // No sampler logprobs: zeros.
    assert!(contexts[1].logprobs().iter().all(|&l| l == 0.0));
}

#[test]
fn prefilled_assistant_messages_are_continued() {
    let tok = tokenizer();
    let mut h = holophore("chatml");
    h.begin_context(true);
    h.begin_message(Role::User);
    h.text("Q");
    h.begin_message(Role::Assistant);
    h.text("<think>");
    let prompt = h.prompt_ids();
    assert_eq!(
        prompt,
        encode(
            &tok,
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>"
        )
    );
    let tokens = encode(&tok, "hm</think>");
    h.completion(&Completion {
        text: "hm</think>".into(),
        tokens: tokens.clone(),
        ..Default::default()
    });
    let context = h.finish()[0].clone();
    assert_eq!(context.ids()[..prompt.len()], prompt[..]);
    assert_eq!(context.sampled_ids(), tokens);
    assert_eq!(context.messages()[1].content, "<think>hm</think>");
}

#[test]
fn templates_with_position_dependent_frames_are_re_rendered() {
    // Llama-2 style: the first user message differs from later ones. No frames: each sample request
    // renders the conversation.
    let source = "{%- for message in messages %}{%- if message['role'] == 'system' %}<<SYS>>{{ message['content'] }}<</SYS>>{%- elif loop.index0 == 0 %}[INST] {{ message['content'] }} [/INST]{%- else %}[INST]{{ message['content'] }}[/INST]{%- endif %}{%- endfor %}";
    let template = ChatTemplate::from_source(source, "llama2ish", special_tokens()).unwrap();
    let tok = tokenizer();
    let mut h = Holophore::new(Arc::clone(&tok), Arc::new(template)).unwrap();
    assert!(h.frames().is_none());
    h.begin_context(true);
    h.begin_message(Role::User);
    h.text("hi");
    h.begin_message(Role::Assistant);
    assert_eq!(h.prompt_ids(), encode(&tok, "[INST] hi [/INST]"));
    // Strict alternation: the template raises on some role orders; those it accepts render.
    let source = "{%- for message in messages %}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('alternate') }}{%- endif %}{{ message['content'] }}{%- endfor %}";
    let template = ChatTemplate::from_source(source, "strict", special_tokens()).unwrap();
    let h = Holophore::new(tokenizer(), Arc::new(template)).unwrap();
    assert!(h.frames().is_none());
    // A template that cannot render a user message with a generation prompt is refused.
    let source = "{{ raise_exception('never') }}";
    let template = ChatTemplate::from_source(source, "never", special_tokens()).unwrap();
    let error = Holophore::new(tokenizer(), Arc::new(template)).unwrap_err();
    assert!(matches!(error, HolophoreError::Render { .. }), "{error}");
}

/// One step of a random rollout.
#[derive(Debug, Clone)]
enum Op {
    Context(bool),
    Message(u8),
    Text(String),
    Sample(Vec<u32>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => any::<bool>().prop_map(Op::Context),
        4 => (0u8..3).prop_map(Op::Message),
        4 => "[a-zA-Z0-9 \\n<>/é数🙂]{0,12}".prop_map(Op::Text),
        // Any ids of the vocabulary, special tokens included (the fixture vocabulary has 452).
        4 => proptest::collection::vec(0u32..452, 0..10).prop_map(Op::Sample),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn trained_tokens_are_exactly_the_sampled_tokens(
        ops in proptest::collection::vec(op(), 1..40),
        name in prop_oneof![Just("chatml"), Just("qwen_default_system"), Just("bos_chatml")],
    ) {
        let mut h = holophore(name);
        // Per context: trained flag, sampled ids in order, and the prompts handed to the sampler.
        let mut expected: Vec<(bool, Vec<u32>, Vec<Vec<u32>>)> = Vec::new();
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Context(trained) => {
                    h.begin_context(trained);
                    expected.push((trained, Vec::new(), Vec::new()));
                }
                Op::Message(r) => h.begin_message([Role::System, Role::User, Role::Assistant][r as usize]),
                Op::Text(text) => {
                    if expected.is_empty() && !text.is_empty() {
                        expected.push((true, Vec::new(), Vec::new()));
                    }
                    h.text(&text);
                }
                Op::Sample(tokens) => {
                    if expected.is_empty() {
                        expected.push((true, Vec::new(), Vec::new()));
                    }
                    let prompt = h.prompt_ids();
                    let text = format!("<{i}>");
                    let last = expected.last_mut().unwrap();
                    if tokens.is_empty() {
                        // A text-only completion: the Holophore tokenizes its text.
                        last.1.extend(encode(&tokenizer(), &text));
                    } else {
                        last.1.extend_from_slice(&tokens);
                    }
                    last.2.push(prompt);
                    let logprobs = fake_logprobs(tokens.len(), i);
                    h.completion(&Completion { text, tokens, logprobs, ..Default::default() });
                }
            }
        }
        let contexts = h.finish().to_vec();
        prop_assert_eq!(contexts.len(), expected.len());
        for (context, (trained, sampled, prompts)) in contexts.iter().zip(&expected) {
            prop_assert_eq!(context.trained, *trained);
            let ids = context.ids();
            let mask = context.loss_mask();
            let logprobs = context.logprobs();
            prop_assert_eq!(mask.len(), ids.len());
            prop_assert_eq!(logprobs.len(), ids.len());
            prop_assert_eq!(&context.sampled_ids(), sampled);
            let trained_ids: Vec<u32> = ids.iter().zip(&mask).filter(|(_, &m)| m == 1).map(|(&id, _)| id).collect();
            let sum: usize = mask.iter().map(|&m| m as usize).sum();
            if *trained {
                prop_assert_eq!(&trained_ids, sampled);
                prop_assert_eq!(sum, sampled.len());
            } else {
                prop_assert_eq!(sum, 0);
            }
            // Every prompt a sampler received is a prefix of the context as recorded.
            for prompt in prompts {
                prop_assert!(ids.starts_with(prompt), "prompt {:?} not a prefix of {:?}", prompt, ids);
            }
            // Logprobs are nonzero exactly on sampled tokens (the fake logprobs are never 0).
            let sampled_positions = context.fragments.iter().flat_map(|f| std::iter::repeat_n(f.kind == FragmentKind::Sampled, f.ids.len()));
            for ((&l, is_sampled), _) in logprobs.iter().zip(sampled_positions).zip(&ids) {
                prop_assert_eq!(l != 0.0, is_sampled);
            }
        }
    }
}
