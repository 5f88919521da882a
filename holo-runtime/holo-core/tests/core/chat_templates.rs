//! Chat templates render byte-identically to transformers' `apply_chat_template(..., tokenize=False)`.
//!
//! The fixtures in `tests/fixtures/chat/` come from `scripts/chat_fixtures.py` (real transformers); see the
//! README there. The other tests cover the fallbacks, errors and the configuration forms.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chrono::NaiveDateTime;
use holo_core::chat::{json_value, ChatTemplate, ChatTemplateError, RenderOptions, Value};
use holo_core::{ChatMessage, Role};

use crate::common::tempdir::Dir;

fn fixtures() -> PathBuf {
    crate::common::fixtures().join("chat")
}

fn load_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    json_value(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn get(value: &Value, key: &str) -> Value {
    value.get_attr(key).unwrap()
}

fn text(value: &Value) -> String {
    value
        .as_str()
        .unwrap_or_else(|| panic!("not a string: {value:?}"))
        .to_string()
}

fn role(name: &str) -> Role {
    match name {
        "system" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        other => panic!("unknown role {other}"),
    }
}

fn msg(role: Role, content: &str) -> ChatMessage {
    ChatMessage {
        role,
        content: content.to_string(),
    }
}

/// Where two strings first differ, for readable failures.
fn first_difference(actual: &str, expected: &str) -> String {
    let at = actual
        .bytes()
        .zip(expected.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    let start = at.saturating_sub(40);
    let context = |s: &str| {
        let start = (0..=start)
            .rev()
            .find(|i| s.is_char_boundary(*i))
            .unwrap_or(0);
        let end = (at + 40).min(s.len());
        let end = (end..=s.len())
            .find(|i| s.is_char_boundary(*i))
            .unwrap_or(s.len());
        format!("{:?}", &s[start..end])
    };
    format!(
        "first difference at byte {at}:\n    rust:         {}\n    transformers: {}",
        context(actual),
        context(expected)
    )
}

#[test]
fn every_fixture_case_renders_like_transformers() {
    let cases = get(&load_json(&fixtures().join("cases.json")), "cases");
    let expected = load_json(&fixtures().join("expected.json"));
    let now =
        NaiveDateTime::parse_from_str(&text(&get(&expected, "now")), "%Y-%m-%dT%H:%M:%S").unwrap();
    let results = get(&expected, "results");

    let mut checked = 0;
    let mut failures = Vec::new();
    let models: Vec<Value> = results.try_iter().unwrap().collect();
    assert!(models.len() >= 2, "fixtures for at least two templates");
    for model in models {
        let model = text(&model);
        let template = ChatTemplate::from_dir(fixtures().join("models").join(&model))
            .unwrap_or_else(|e| panic!("{model}: {e}"));
        let outputs = get(&results, &model);
        for case in cases.try_iter().unwrap() {
            let name = text(&get(&case, "name"));
            let messages: Vec<ChatMessage> = get(&case, "messages")
                .try_iter()
                .unwrap()
                .map(|m| msg(role(&text(&get(&m, "role"))), &text(&get(&m, "content"))))
                .collect();
            let mut options = RenderOptions {
                add_generation_prompt: get(&case, "add_generation_prompt").is_true(),
                continue_final_message: get(&case, "continue_final_message").is_true(),
                now: Some(now),
                ..Default::default()
            };
            let tools = get(&case, "tools");
            if !tools.is_undefined() {
                options.tools = Some(tools.try_iter().unwrap().collect());
            }
            let kwargs = get(&case, "kwargs");
            if !kwargs.is_undefined() {
                for key in kwargs.try_iter().unwrap() {
                    options
                        .variables
                        .insert(text(&key), kwargs.get_item(&key).unwrap());
                }
            }

            let want = get(&outputs, &name);
            let got = template.render(&messages, &options);
            checked += 1;
            match (got, want.as_str()) {
                (Ok(got), Some(want)) if got == want => {}
                (Ok(got), Some(want)) => failures.push(format!(
                    "{model} / {name}: {}",
                    first_difference(&got, want)
                )),
                (Err(error), Some(_)) => {
                    failures.push(format!("{model} / {name}: unexpected error: {error}"))
                }
                (got, None) => {
                    let message = text(&get(&want, "error"));
                    let kind = text(&get(&want, "type"));
                    match got {
                        Err(ChatTemplateError::Raised { message: raised, .. })
                            if kind == "TemplateError" && raised == message => {}
                        Err(ChatTemplateError::Invalid { .. }) if kind == "ValueError" => {}
                        other => failures.push(format!(
                            "{model} / {name}: transformers raised {kind}({message:?}), rust gave {other:?}"
                        )),
                    }
                }
            }
        }
    }
    assert!(checked >= 30, "only {checked} cases checked");
    assert!(
        failures.is_empty(),
        "{} of {checked} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn fixtures_record_their_transformers_version() {
    let expected = load_json(&fixtures().join("expected.json"));
    assert!(!text(&get(&expected, "transformers")).is_empty());
}

#[test]
fn chatml_fallback() {
    let chatml = ChatTemplate::chatml();
    let messages = [
        msg(Role::System, "Be brief."),
        msg(Role::User, "Hi"),
        msg(Role::Assistant, "Hello"),
    ];
    assert_eq!(
        chatml.render(&messages, &RenderOptions::default()).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello<|im_end|>\n"
    );
    assert_eq!(
        chatml.render(&messages[..2], &RenderOptions::generation()).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        chatml.render(&messages, &RenderOptions::continuation()).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
    );
    assert_eq!(chatml.special_token("eos_token"), Some("<|im_end|>"));
}

#[test]
fn plain_fallback() {
    let plain = ChatTemplate::plain();
    let messages = [
        msg(Role::System, "Be brief."),
        msg(Role::User, "Hi"),
        msg(Role::Assistant, "Hello"),
    ];
    assert_eq!(
        plain.render(&messages, &RenderOptions::default()).unwrap(),
        "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello\n\n"
    );
    assert_eq!(
        plain
            .render(&messages[..2], &RenderOptions::generation())
            .unwrap(),
        "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    );
    assert_eq!(
        plain
            .render(&messages, &RenderOptions::continuation())
            .unwrap(),
        "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello"
    );
    assert!(plain.special_tokens().is_empty());
}

#[test]
fn raise_exception_is_an_error_with_the_message() {
    let gemma = ChatTemplate::from_dir(fixtures().join("models/gemma3")).unwrap();
    let error = gemma
        .render(
            &[msg(Role::User, "one"), msg(Role::User, "two")],
            &RenderOptions::generation(),
        )
        .unwrap_err();
    match &error {
        ChatTemplateError::Raised { file, message } => {
            assert_eq!(
                message,
                "Conversation roles must alternate user/assistant/user/assistant/..."
            );
            assert!(file.ends_with("tokenizer_config.json"), "{file}");
        }
        other => panic!("expected Raised, got {other:?}"),
    }
    assert!(
        error
            .to_string()
            .contains("Conversation roles must alternate"),
        "{error}"
    );

    let template = ChatTemplate::from_source(
        "{% if messages | length > 1 %}{{ raise_exception('only ' ~ 'one message') }}{% endif %}ok",
        "inline.jinja",
        BTreeMap::new(),
    )
    .unwrap();
    assert_eq!(
        template
            .render(&[msg(Role::User, "a")], &RenderOptions::default())
            .unwrap(),
        "ok"
    );
    let error = template
        .render(
            &[msg(Role::User, "a"), msg(Role::User, "b")],
            &RenderOptions::default(),
        )
        .unwrap_err();
    assert_eq!(
        error,
        ChatTemplateError::Raised {
            file: "inline.jinja".into(),
            message: "only one message".into()
        }
    );
}

/// A fresh model folder with the given files, removed when dropped.
fn model_dir(files: &[(&str, &str)]) -> Dir {
    let dir = Dir::new("chat");
    for (name, content) in files {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }
    dir
}

#[test]
fn malformed_template_names_the_file() {
    let config = r#"{"chat_template": "{% for message in messages %}{{ message.content }", "eos_token": "</s>"}"#;
    let dir = model_dir(&[("tokenizer_config.json", config)]);
    let error = ChatTemplate::from_dir(&dir).unwrap_err();
    assert!(
        matches!(error, ChatTemplateError::Syntax { .. }),
        "{error:?}"
    );
    assert!(error.file().ends_with("tokenizer_config.json"), "{error:?}");
    assert!(
        error.to_string().contains("tokenizer_config.json"),
        "{error}"
    );
    assert!(error.to_string().contains("syntax error"), "{error}");

    let dir = model_dir(&[
        ("tokenizer_config.json", r#"{"eos_token": "</s>"}"#),
        ("chat_template.jinja", "line one\n{% if %}\n"),
    ]);
    let error = ChatTemplate::from_dir(&dir).unwrap_err();
    assert!(error.to_string().contains("chat_template.jinja"), "{error}");
    assert!(
        matches!(error, ChatTemplateError::Syntax { line: Some(2), .. }),
        "{error:?}"
    );
}

#[test]
fn bad_configs_are_errors_naming_the_file() {
    let dir = model_dir(&[("tokenizer_config.json", "{not json")]);
    let error = ChatTemplate::from_dir(&dir).unwrap_err();
    assert!(
        matches!(error, ChatTemplateError::Config { .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("tokenizer_config.json"),
        "{error}"
    );

    let dir = model_dir(&[("tokenizer_config.json", r#"{"chat_template": 3}"#)]);
    assert!(matches!(
        ChatTemplate::from_dir(&dir),
        Err(ChatTemplateError::Config { .. })
    ));

    let dir = model_dir(&[("tokenizer_config.json", r#"{"eos_token": "</s>"}"#)]);
    let error = ChatTemplate::from_dir(&dir).unwrap_err();
    assert!(
        matches!(error, ChatTemplateError::Missing { .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("tokenizer_config.json"),
        "{error}"
    );

    let error = ChatTemplate::from_dir(model_dir(&[])).unwrap_err();
    assert!(
        matches!(error, ChatTemplateError::Missing { .. }),
        "{error:?}"
    );
}

#[test]
fn missing_template_falls_back_with_the_folder_tokens() {
    let dir = model_dir(&[(
        "tokenizer_config.json",
        r#"{"eos_token": "</s>", "bos_token": {"content": "<s>"}}"#,
    )]);
    let template = ChatTemplate::from_dir_or(&dir, ChatTemplate::chatml()).unwrap();
    assert_eq!(template.special_token("eos_token"), Some("</s>"));
    assert_eq!(template.special_token("bos_token"), Some("<s>"));
    assert_eq!(
        template
            .render(&[msg(Role::User, "Hi")], &RenderOptions::generation())
            .unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    // A folder with a template keeps it.
    let qwen = ChatTemplate::from_dir_or(fixtures().join("models/qwen2.5"), ChatTemplate::plain())
        .unwrap();
    assert!(qwen
        .render(&[msg(Role::User, "Hi")], &RenderOptions::default())
        .unwrap()
        .starts_with("<|im_start|>system\nYou are Qwen"));
}

#[test]
fn list_of_named_templates() {
    let compat = ChatTemplate::from_dir(fixtures().join("models/compat")).unwrap();
    assert_eq!(compat.template_names(), ["default", "tool_use"]);
    let messages = [msg(Role::User, "Hi")];
    let default = compat.render(&messages, &RenderOptions::default()).unwrap();
    assert!(default.starts_with("<s>\n<<USER #1>>"), "{default}");
    let chosen = RenderOptions {
        template: Some("tool_use".into()),
        ..Default::default()
    };
    assert_eq!(compat.render(&messages, &chosen).unwrap(), "[user] Hi");
    let with_tools = RenderOptions {
        tools: Some(vec![json_value(
            r#"{"function": {"name": "f"}, "type": "function"}"#,
        )
        .unwrap()]),
        ..Default::default()
    };
    assert_eq!(
        compat.render(&messages, &with_tools).unwrap(),
        "[user] HiTOOL f: {\"function\": {\"name\": \"f\"}, \"type\": \"function\"}"
    );
    let unknown = RenderOptions {
        template: Some("nope".into()),
        ..Default::default()
    };
    assert!(matches!(
        compat.render(&messages, &unknown),
        Err(ChatTemplateError::Invalid { .. })
    ));

    // Several templates and none named "default": transformers refuses to choose, so do we.
    let config =
        r#"{"chat_template": [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]}"#;
    let both = ChatTemplate::from_dir(model_dir(&[("tokenizer_config.json", config)])).unwrap();
    assert!(matches!(
        both.render(&messages, &RenderOptions::default()),
        Err(ChatTemplateError::Invalid { .. })
    ));
    let b = RenderOptions {
        template: Some("b".into()),
        ..Default::default()
    };
    assert_eq!(both.render(&messages, &b).unwrap(), "B");

    let config = r#"{"chat_template": [{"name": "default"}]}"#;
    let error =
        ChatTemplate::from_dir(model_dir(&[("tokenizer_config.json", config)])).unwrap_err();
    assert!(
        matches!(error, ChatTemplateError::Config { .. }),
        "{error:?}"
    );
}

#[test]
fn added_token_objects_and_named_special_tokens() {
    let compat = ChatTemplate::from_dir(fixtures().join("models/compat")).unwrap();
    assert_eq!(compat.special_token("bos_token"), Some("<s>"));
    assert_eq!(compat.special_token("unk_token"), Some("<unk>"));
    assert_eq!(compat.special_token("eos_token"), Some("</s>"));
    assert_eq!(compat.special_token("image_token"), Some("<image>"));
    assert_eq!(compat.special_token("pad_token"), None);

    let llama = ChatTemplate::from_dir(fixtures().join("models/llama3.2")).unwrap();
    assert_eq!(llama.special_token("bos_token"), Some("<|begin_of_text|>"));
    assert_eq!(llama.special_token("eos_token"), Some("<|eot_id|>"));

    let gemma = ChatTemplate::from_dir(fixtures().join("models/gemma3")).unwrap();
    assert_eq!(gemma.special_token("boi_token"), Some("<start_of_image>"));

    let config = r#"{"bos_token": {"__type": "AddedToken", "content": "<B>", "lstrip": false},
                     "add_bos_token": true, "chat_template": "{{ bos_token }}|{{ eos_token }}|{{ messages[0].content }}"}"#;
    let template = ChatTemplate::from_dir(model_dir(&[("tokenizer_config.json", config)])).unwrap();
    assert_eq!(
        template
            .render(&[msg(Role::User, "x")], &RenderOptions::default())
            .unwrap(),
        "<B>||x"
    );

    let config = r#"{"bos_token": {"lstrip": false}, "chat_template": "x"}"#;
    let error =
        ChatTemplate::from_dir(model_dir(&[("tokenizer_config.json", config)])).unwrap_err();
    assert!(
        matches!(error, ChatTemplateError::Config { .. }),
        "{error:?}"
    );
}

#[test]
fn template_files_take_priority_like_transformers() {
    let dir = model_dir(&[
        (
            "tokenizer_config.json",
            r#"{"chat_template": "from config", "eos_token": "</s>"}"#,
        ),
        ("chat_template.jinja", "from file {{ eos_token }}\n"),
        (
            "additional_chat_templates/tool_use.jinja",
            "tools: {{ tools | length }}",
        ),
    ]);
    let template = ChatTemplate::from_dir(&dir).unwrap();
    assert_eq!(template.template_names(), ["default", "tool_use"]);
    let messages = [msg(Role::User, "x")];
    assert_eq!(
        template
            .render(&messages, &RenderOptions::default())
            .unwrap(),
        "from file </s>"
    );
    let tools = RenderOptions {
        tools: Some(vec![Value::from(1)]),
        ..Default::default()
    };
    assert_eq!(template.render(&messages, &tools).unwrap(), "tools: 1");
}

#[test]
fn invalid_requests_are_errors() {
    let chatml = ChatTemplate::chatml();
    let both = RenderOptions {
        add_generation_prompt: true,
        continue_final_message: true,
        ..Default::default()
    };
    assert!(matches!(
        chatml.render(&[msg(Role::User, "x")], &both),
        Err(ChatTemplateError::Invalid { .. })
    ));
    assert!(matches!(
        chatml.render(&[], &RenderOptions::default()),
        Err(ChatTemplateError::Invalid { .. })
    ));

    // A template that drops the final message cannot be continued.
    let dropping = ChatTemplate::from_source(
        "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}",
        "drop.jinja",
        BTreeMap::new(),
    )
    .unwrap();
    let error = dropping
        .render(
            &[msg(Role::User, "a"), msg(Role::Assistant, "b")],
            &RenderOptions::continuation(),
        )
        .unwrap_err();
    assert!(
        matches!(error, ChatTemplateError::Invalid { .. }),
        "{error:?}"
    );
}

#[test]
fn runtime_errors_name_the_file_and_line() {
    let template = ChatTemplate::from_source(
        "ok\n{{ messages[0].nothing.deeper }}",
        "broken.jinja",
        BTreeMap::new(),
    )
    .unwrap();
    let error = template
        .render(&[msg(Role::User, "x")], &RenderOptions::default())
        .unwrap_err();
    match &error {
        ChatTemplateError::Render { file, line, .. } => {
            assert_eq!(file, "broken.jinja");
            assert_eq!(*line, Some(2));
        }
        other => panic!("expected Render, got {other:?}"),
    }
    assert!(
        error.to_string().starts_with("broken.jinja (line 2): "),
        "{error}"
    );
}

#[test]
fn strftime_now_uses_the_clock_unless_given() {
    let template = ChatTemplate::from_source(
        "{{ strftime_now('%Y') }}|{{ strftime_now('%d %b %Y') }}",
        "date.jinja",
        BTreeMap::new(),
    )
    .unwrap();
    let messages = [msg(Role::User, "x")];
    let rendered = template
        .render(&messages, &RenderOptions::default())
        .unwrap();
    let year = chrono::Local::now().format("%Y").to_string();
    assert!(rendered.starts_with(&year), "{rendered}");
    let fixed = RenderOptions {
        now: Some(
            NaiveDateTime::parse_from_str("2024-07-26 12:00:00", "%Y-%m-%d %H:%M:%S").unwrap(),
        ),
        ..Default::default()
    };
    assert_eq!(
        template.render(&messages, &fixed).unwrap(),
        "2024|26 Jul 2024"
    );
}

#[test]
fn tools_keep_their_json_key_order() {
    let template = ChatTemplate::from_source(
        "{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=1) }}|{{ documents }}",
        "tools.jinja",
        BTreeMap::new(),
    )
    .unwrap();
    let options = RenderOptions {
        tools: Some(vec![
            json_value(r#"{"z": 1, "a": [1.0, "é"], "m": {}}"#).unwrap()
        ]),
        ..Default::default()
    };
    assert_eq!(
        template.render(&[msg(Role::User, "x")], &options).unwrap(),
        "{\"z\": 1, \"a\": [1.0, \"é\"], \"m\": {}}|{\n \"z\": 1,\n \"a\": [\n  1.0,\n  \"é\"\n ],\n \"m\": {}\n}|None"
    );
}

#[test]
fn templates_are_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<ChatTemplate>();
    let template = ChatTemplate::from_dir(fixtures().join("models/qwen3")).unwrap();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let template = template.clone();
            std::thread::spawn(move || {
                template
                    .render(
                        &[msg(Role::User, &format!("n{i}"))],
                        &RenderOptions::generation(),
                    )
                    .unwrap()
            })
        })
        .collect();
    for (i, handle) in handles.into_iter().enumerate() {
        assert_eq!(
            handle.join().unwrap(),
            format!("<|im_start|>user\nn{i}<|im_end|>\n<|im_start|>assistant\n")
        );
    }
}

#[test]
fn builtin_templates_say_so() {
    assert!(ChatTemplate::chatml().is_builtin());
    assert!(ChatTemplate::plain().is_builtin());
    let gemma = ChatTemplate::from_dir(fixtures().join("models/gemma3")).unwrap();
    assert!(!gemma.is_builtin());
    let source = ChatTemplate::chatml()
        .source("default")
        .unwrap()
        .to_string();
    let copied = ChatTemplate::from_source(source, "mine.jinja", BTreeMap::new()).unwrap();
    assert!(!copied.is_builtin());
}
