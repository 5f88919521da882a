//! Native tool calls (`<|ToolSchema parser=…|>`): the tools handed to the model's own chat template,
//! replies read in the family's format, results as `tool` messages, and the Holophore token-exact
//! through it all. Renderings are compared with transformers' (`tests/fixtures/chat/tool_calls.json`,
//! written by `scripts/tool_call_fixtures.py` with the real templates of `tests/fixtures/chat/models/`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use holo_core::chat::{json_value, template_kwargs, ChatTemplate, RenderOptions};
use holo_core::export;
use holo_core::holophore::{Context, Holophore, ToolTurn};
use holo_core::holotypes::{self, ToolStats, Tools};
use holo_core::interpreter::{Holoware, Row};
use holo_core::loom::{Loom, LoomConfig, ToolCallRecord, ToolRecord};
use holo_core::tools::ToolFormat;
use holo_core::{Completion, Prompt, Recorder, Resources, Role, Scripted};
use serde_json::Value;
use tokenizers::{AddedToken, Tokenizer};

use crate::common::tempdir::Dir;
use crate::recording::Recording;

fn fixtures() -> PathBuf {
    crate::common::fixtures()
}

fn tool_calls_fixture() -> Value {
    let text = std::fs::read_to_string(fixtures().join("chat/tool_calls.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The byte-level BPE tokenizer of the Holophore fixtures (ChatML's special tokens) with the tokens
/// the family adds: Qwen's `<think>` and `<tool_call>` tags (added, not special, as Qwen ships them),
/// Llama 3's headers and end of turn (special).
fn tokenizer(model: &str) -> Tokenizer {
    let mut tokenizer = Tokenizer::from_file(fixtures().join("holophore/tokenizer.json"))
        .expect("fixture tokenizer");
    if model.starts_with("qwen") {
        let tags = ["<think>", "</think>", "<tool_call>", "</tool_call>"];
        let added = tokenizer.add_tokens(tags.map(|tag| AddedToken::from(tag, false)));
        assert_eq!(added.unwrap(), 4);
    } else {
        let tokens = [
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ];
        let added = tokenizer.add_special_tokens(tokens.map(|token| AddedToken::from(token, true)));
        assert_eq!(added.unwrap(), 4);
    }
    tokenizer
}

fn encode(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
    tokenizer.encode(text, false).unwrap().get_ids().to_vec()
}

fn decode(tokenizer: &Tokenizer, ids: &[u32]) -> String {
    tokenizer.decode(ids, false).unwrap()
}

/// The ids of `context` where its loss mask is 1.
fn trained(context: &Context) -> Vec<u32> {
    context
        .ids()
        .into_iter()
        .zip(context.loss_mask())
        .filter(|(_, mask)| *mask == 1)
        .map(|(id, _)| id)
        .collect()
}

/// A native tool loop recorded by a Holophore, step by step as a holoware drives it, against
/// transformers' renderings of the same conversation: the prompt before the calls, the prompt after
/// the results, and the whole conversation. Where the template renders the calling turn as the model
/// wrote it, the context grows; where it does not (Qwen3 drops an empty think block from history), the
/// context is split and each part is trained on exactly what was sampled in it.
#[test]
fn native_tool_loops_render_as_transformers_renders_them() {
    let fixture = tool_calls_fixture();
    let tools: Vec<Value> = fixture["tools"].as_array().unwrap().clone();
    let cases = [
        ("qwen3", "thinking", ToolFormat::Hermes, "<|im_end|>", 1),
        (
            "qwen3",
            "empty_thinking",
            ToolFormat::Hermes,
            "<|im_end|>",
            2,
        ),
        ("qwen2.5", "plain", ToolFormat::Hermes, "<|im_end|>", 1),
        ("llama3.2", "plain", ToolFormat::Llama3Json, "<|eot_id|>", 1),
    ];
    for (model, case, format, end_of_turn, contexts_expected) in cases {
        let at = format!("{model}/{case}");
        let conversation = &fixture[model]["conversations"][case];
        let tok = Arc::new(tokenizer(model));
        let template =
            Arc::new(ChatTemplate::from_dir(fixtures().join("chat/models").join(model)).unwrap());
        let kwargs = template_kwargs(&conversation["kwargs"]).unwrap();
        let mut h = Holophore::with_template_kwargs(Arc::clone(&tok), template, kwargs).unwrap();
        let text = |key: &str| conversation[key].as_str().unwrap().to_string();

        h.begin_context(true);
        h.begin_message(Role::System);
        h.text("You are a helpful assistant.");
        h.begin_message(Role::User);
        h.text("Weather and time in Paris?");
        assert_eq!(h.offer_tools(&tools, None), Ok(format), "{at}");
        h.begin_message(Role::Assistant);
        let first = h.prompt_ids();
        assert_eq!(decode(&tok, &first), text("first_prompt"), "{at}");
        assert_eq!(first, encode(&tok, &text("first_prompt")), "{at}");

        let reply = text("reply");
        let calling = [encode(&tok, &reply), encode(&tok, end_of_turn)].concat();
        h.completion(&Completion {
            text: reply.clone(),
            tokens: calling.clone(),
            ..Completion::default()
        });
        let read = format.read(&reply).unwrap().expect("the reply makes calls");
        h.tool_calls(&read);
        let results = conversation["results"].as_array().unwrap();
        assert_eq!(read.calls.len(), results.len(), "{at}");
        for (call, result) in read.calls.iter().zip(results) {
            h.tool_result(&call.name, None, result.as_str().unwrap());
        }
        h.begin_message(Role::Assistant);
        let second = h.prompt_ids();
        assert_eq!(decode(&tok, &second), text("second_prompt"), "{at}");

        let answer = [encode(&tok, &text("answer")), encode(&tok, end_of_turn)].concat();
        h.completion(&Completion {
            text: text("answer"),
            tokens: answer.clone(),
            ..Completion::default()
        });
        let contexts = h.finish().to_vec();
        assert!(h.errors().is_empty(), "{at}: {:?}", h.errors());
        assert_eq!(contexts.len(), contexts_expected, "{at}");
        let tool_message = &contexts.last().unwrap().messages()[3];
        assert_eq!(
            tool_message.tool,
            Some(ToolTurn::Result {
                name: read.calls[0].name.clone(),
                id: None,
            }),
            "{at}"
        );
        if contexts_expected == 1 {
            // The context grew: the second prompt extends the first and the sampled tokens.
            let context = &contexts[0];
            assert_eq!(second[..first.len()], first[..], "{at}");
            assert_eq!(
                second[first.len()..first.len() + calling.len()],
                calling[..],
                "{at}"
            );
            assert_eq!(trained(context), [calling, answer].concat(), "{at}");
            assert_eq!(decode(&tok, &context.ids()), text("whole"), "{at}");
        } else {
            // The template dropped the empty think block from history: the first context ends with the
            // calling turn as sampled, the second starts with the whole rendering (results included).
            assert_eq!(contexts[0].ids()[..first.len()], first[..], "{at}");
            assert_eq!(trained(&contexts[0]), calling, "{at}");
            assert_eq!(second, encode(&tok, &text("second_prompt")), "{at}");
            assert_eq!(contexts[1].ids()[..second.len()], second[..], "{at}");
            assert_eq!(trained(&contexts[1]), answer, "{at}");
            assert_eq!(decode(&tok, &contexts[1].ids()), text("whole"), "{at}");
        }
        // The results are in the last context, as prompt: what is trained is what was sampled (above).
        let last = decode(&tok, &contexts.last().unwrap().ids());
        assert!(last.contains("18 degrees and sunny"), "{at}");
    }
}

#[test]
fn offering_tools_says_why_it_cannot() {
    let fixture = tool_calls_fixture();
    let tools: Vec<Value> = fixture["tools"].as_array().unwrap().clone();
    let tok = Arc::new(tokenizer("qwen3"));
    // ChatML renders no tools.
    let mut chatml = Holophore::new(Arc::clone(&tok), Arc::new(ChatTemplate::chatml())).unwrap();
    chatml.begin_context(true);
    let error = chatml.offer_tools(&tools, None).unwrap_err();
    assert!(error.contains("does not render `tools`"), "{error}");
    // After the model's first turn the tools come too late for this context.
    let qwen3 = Arc::new(ChatTemplate::from_dir(fixtures().join("chat/models/qwen3")).unwrap());
    let mut late = Holophore::new(Arc::clone(&tok), qwen3).unwrap();
    late.begin_context(true);
    late.begin_message(Role::User);
    late.text("Hi");
    late.prompt_ids();
    late.completion(&Completion {
        text: "Hello".into(),
        tokens: encode(&tok, "Hello"),
        ..Completion::default()
    });
    let error = late.offer_tools(&tools, None).unwrap_err();
    assert!(error.contains("before the model's first turn"), "{error}");
    assert_eq!(late.tool_format(), None);
}

/// A run's `tool_call_parser` (`Holophore::with_tool_format`) names the format where the holoware
/// leaves it open: over a template that does not say, and over the one a template writes; a format the
/// holoware names still wins.
#[test]
fn a_runs_tool_format_reads_calls_where_the_holoware_leaves_it_open() {
    let tools: Vec<Value> = tool_calls_fixture()["tools"].as_array().unwrap().clone();
    let tok = Arc::new(tokenizer("qwen3"));
    let silent = ChatTemplate::from_source(
        "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n\
         {{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\
         {% endif %}",
        "silent.jinja",
        BTreeMap::from([("eos_token".to_string(), "<|im_end|>".to_string())]),
    )
    .unwrap();
    let silent = Arc::new(silent);
    let offered = |template: &Arc<ChatTemplate>, run: Option<ToolFormat>, named| {
        let mut holophore = Holophore::new(Arc::clone(&tok), Arc::clone(template)).unwrap();
        if let Some(format) = run {
            holophore = holophore.with_tool_format(format);
        }
        // Forks (one per rollout) keep the run's format.
        let mut fork = holophore.fork();
        fork.begin_context(true);
        fork.offer_tools(&tools, named)
    };
    let error = offered(&silent, None, None).unwrap_err();
    assert!(
        error.contains("does not say how the model writes tool calls"),
        "{error}"
    );
    assert_eq!(
        offered(&silent, Some(ToolFormat::Llama3Json), None),
        Ok(ToolFormat::Llama3Json)
    );
    let qwen3 = Arc::new(ChatTemplate::from_dir(fixtures().join("chat/models/qwen3")).unwrap());
    assert_eq!(offered(&qwen3, None, None), Ok(ToolFormat::Hermes));
    assert_eq!(
        offered(&qwen3, Some(ToolFormat::Llama3Json), None),
        Ok(ToolFormat::Llama3Json)
    );
    assert_eq!(
        offered(
            &qwen3,
            Some(ToolFormat::Llama3Json),
            Some(ToolFormat::Hermes)
        ),
        Ok(ToolFormat::Hermes)
    );
}

/// A native-tool holoware: the calculator offered to the template, a tool loop, a math answer.
const NATIVE_HOL: &str = "<|+++|>\n<|x_x|>\nYou are a helpful assistant.<|ToolSchema parser=auto|>\n\n<|o_o|>\n<|question|>\n\n<|ToolRunner max_turns=6|>\n    <|@_@:turn|>\n    <|ToolExecutor turn|>\n<|MathAnswer var=turn|>\n";

/// A Qwen3 model folder: the fixture tokenizer with Qwen's added tags, Qwen3's real template.
fn qwen3_folder(dir: &Dir) {
    tokenizer("qwen3")
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    std::fs::copy(
        fixtures().join("chat/models/qwen3/tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
}

fn call(arguments: &str, name: &str, thought: &str) -> String {
    format!(
        "<think>\n{thought}\n</think>\n\n<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {arguments}}}\n</tool_call>"
    )
}

#[test]
fn a_native_tool_rollout_through_the_loom_trains_exactly_what_was_sampled() {
    let dir = Dir::new("native-tools");
    qwen3_folder(&dir);
    let hol = dir.join("native.hol");
    std::fs::write(&hol, NATIVE_HOL).unwrap();
    let holophore = Holophore::from_dir(dir.path()).unwrap();
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
    // A good call, three the model gets wrong (bad JSON, an unknown tool, a number where the schema
    // says string), then the answer.
    let replies = [
        call(r#"{"expression": "17 * 23"}"#, "calculator", "Multiply."),
        "<think>\nAgain.\n</think>\n\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\n</tool_call>".to_string(),
        call(r#"{"query": "17 * 23"}"#, "search", "Search."),
        call(r#"{"expression": 17}"#, "calculator", "A number."),
        "<think>\nDone.\n</think>\n\nThe product is <answer>391</answer>.".to_string(),
    ];
    let sampler = Recording {
        inner: Scripted::new(replies.clone()).tokenized(&holophore),
        seen: Mutex::new(Vec::new()),
    };
    let (summary, record) = crate::recording::run_row(
        &loom,
        r#"{"question": "What is 17 * 23?", "expected": "391"}"#,
        &sampler,
    );
    assert_eq!(summary.failed, 0, "{summary:?}");
    assert!(record.error.is_none(), "{:?}", record.error);
    let seen = sampler.seen.into_inner().unwrap();
    assert_eq!(seen.len(), replies.len());
    let tok = holophore.tokenizer();
    let prompts: Vec<&Vec<u32>> = seen
        .iter()
        .map(|(request, _)| match &request.prompt {
            Prompt::Tokens(ids) => ids,
            other => panic!("a token prompt, not {other:?}"),
        })
        .collect();
    // Every turn, the next prompt starts with what the model saw and sampled before.
    for k in 1..seen.len() {
        let before = [prompts[k - 1].as_slice(), &seen[k - 1].1.tokens].concat();
        assert_eq!(prompts[k][..before.len()], before[..], "turn {k}");
    }
    // The template renders every turn as sampled (reasoning after the last user turn is kept): one
    // context, trained on exactly the sampled tokens.
    assert_eq!(record.contexts.len(), 1);
    let tokens = record.contexts[0].tokens.as_ref().unwrap();
    let sampled: Vec<u32> = seen
        .iter()
        .flat_map(|(_, completion)| completion.tokens.clone())
        .collect();
    let trained: Vec<u32> = tokens
        .ids
        .iter()
        .zip(&tokens.loss_mask)
        .filter(|(_, mask)| **mask == 1)
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(trained, sampled);
    // The tools reached the template (the system turn lists them), the results came back as tool
    // messages, never trained.
    let first = decode(tok, prompts[0]);
    assert!(
        first.starts_with("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n"),
        "{first}"
    );
    assert!(first.contains("\"name\": \"calculator\""), "{first}");
    let last = decode(tok, prompts[4]);
    for result in [
        "<tool_response>\n391\n</tool_response>",
        "<tool_response>\nerror: the tool call is not valid JSON: ",
        "<tool_response>\nerror: unknown tool `search`; the tools are: calculator\n</tool_response>",
        "<tool_response>\nerror: `arguments.expression` must be a string, got the number 17\n</tool_response>",
    ] {
        assert!(last.contains(result), "{result} in {last}");
    }
    assert!(!decode(tok, &trained).contains("<tool_response>"));
    assert_eq!(record.rewards.get("math_answer"), Some(&1.0));
    let counts = stats.counts();
    assert_eq!((counts.calls, counts.failed, counts.timed_out), (4, 3, 0));

    // The record keeps what each message was to the tools: the first turn's call, its result.
    let context = &record.contexts[0];
    assert_eq!(context.tools.len(), 1);
    assert_eq!(context.tools[0]["function"]["name"], "calculator");
    let turns: Vec<&ToolRecord> = context
        .messages
        .iter()
        .filter_map(|message| message.tool.as_ref())
        .collect();
    // Each call has an id (nine letters and digits, as Mistral's templates need), which its result
    // names.
    let id = match turns[0] {
        ToolRecord::ToolCalls { calls, .. } => calls[0].id.clone().unwrap(),
        other => panic!("{other:?}"),
    };
    assert!(id.len() == 9 && id.bytes().all(|byte| byte.is_ascii_alphanumeric()));
    assert_eq!(
        turns[..2],
        [
            &ToolRecord::ToolCalls {
                content: Some("<think>\nMultiply.\n</think>\n\n".into()),
                calls: vec![ToolCallRecord {
                    name: "calculator".into(),
                    arguments: serde_json::json!({"expression": "17 * 23"}),
                    id: Some(id.clone()),
                }],
                reasoning: None,
            },
            &ToolRecord::Result {
                name: "calculator".into(),
                id: Some(id),
            },
        ]
    );
    let results = turns
        .iter()
        .filter(|turn| matches!(turn, ToolRecord::Result { .. }))
        .count();
    assert_eq!(results, 4);
    // Exported as TRL's conversational tool format (`tool_calls`, `tool` messages, a `tools` column),
    // the conversation renders through the model's template to exactly the tokens it was trained on.
    let conversation = export::conversation(context).unwrap();
    let messages: Vec<_> = conversation
        .prompt
        .iter()
        .chain(&conversation.completion)
        .map(|message| serde_json::to_value(message).unwrap())
        .collect();
    assert!(messages
        .iter()
        .any(|message| message["role"] == "tool" && message["name"] == "calculator"));
    let values = |values: &[Value]| {
        values
            .iter()
            .map(|value| json_value(&value.to_string()).unwrap())
            .collect::<Vec<_>>()
    };
    let rendered = ChatTemplate::from_dir(dir.path())
        .unwrap()
        .render_values(
            values(&messages),
            &RenderOptions {
                tools: Some(values(&conversation.tools)),
                ..RenderOptions::default()
            },
        )
        .unwrap();
    assert_eq!(rendered, decode(tok, &tokens.ids));
}

#[test]
fn a_sampler_of_chat_messages_refuses_native_tools() {
    let dir = Dir::new("native-chat");
    let hol = dir.join("native.hol");
    std::fs::write(&hol, NATIVE_HOL).unwrap();
    let holoware = Arc::new(Holoware::open(&hol, Arc::new(holotypes::registry())).unwrap());
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());
    let loom = Loom::interpreted(holoware, resources, LoomConfig::default());
    let sampler = Scripted::new(["<answer>1</answer>"]);
    let (_, record) =
        crate::recording::run_row(&loom, r#"{"question": "1?", "expected": "1"}"#, &sampler);
    let error = record.error.as_ref().expect("the rollout fails");
    let message = format!("{error:?}");
    assert!(message.contains("native.hol:3:"), "{message}");
    assert!(
        message.contains("need the model's chat template"),
        "{message}"
    );
}

/// Without a model there is no template to read the format from: `parser=` names it, and the text
/// view shows each result as a user message, the next turn as the assistant's.
#[test]
fn a_text_transcript_takes_native_tools_with_the_format_named() {
    use holo_core::transcript::Part;
    use holo_core::{Rollout, Step, Transcript};

    let named = NATIVE_HOL.replace("parser=auto", "parser=hermes");
    let registry = Arc::new(holotypes::registry());
    let holoware =
        Arc::new(Holoware::load("named.hol", named.as_bytes(), Arc::clone(&registry)).unwrap());
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());
    let row: Row =
        serde_json::from_str(r#"{"question": "What is 17 * 23?", "expected": "391"}"#).unwrap();
    let mut script = Scripted::new([
        call(r#"{"expression": "17 * 23"}"#, "calculator", "Multiply."),
        "<answer>391</answer>".to_string(),
    ]);
    let mut transcript = Transcript::default();
    let mut rollout = holoware.start_with(&row, &resources).unwrap();
    while let Step::Sample(request) = rollout.step(&mut transcript).unwrap() {
        let completion = script.complete(&request).unwrap();
        rollout.resume(completion, &mut transcript).unwrap();
    }
    let messages = &transcript.contexts[0].messages;
    let roles: Vec<Role> = messages.iter().map(|message| message.role).collect();
    assert_eq!(
        roles,
        [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::User,
            Role::Assistant
        ]
    );
    assert_eq!(messages[3].parts, [Part::Prompt("391".into())]);
    assert_eq!(
        messages[4].parts,
        [Part::Sampled("<answer>391</answer>".into(), None)]
    );
    assert_eq!(transcript.reward(), 1.0);
    // `auto` needs a template.
    let error = Arc::new(Holoware::load("auto.hol", NATIVE_HOL.as_bytes(), registry).unwrap())
        .start_with(&row, &resources)
        .and_then(|mut rollout| rollout.step(&mut Transcript::default()).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(
        error.starts_with("auto.hol:3:") && error.contains("name it with `parser=`"),
        "{error}"
    );
}
