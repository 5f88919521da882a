//! The built-in holotypes, run through the interpreter on small holowares.

use std::time::Duration;

use holo_core::holotypes::{self, last_number, numbers_equal, Tools};
use holo_core::{Resources, Transcript};
use serde_json::json;

use crate::common::rollout::run;

fn rewards(transcript: &Transcript) -> Vec<(&str, f64, f64)> {
    transcript
        .rewards
        .iter()
        .map(|(name, value, weight)| (name.as_str(), *value, *weight))
        .collect()
}

fn calculator() -> Resources {
    tools_with_timeout(Duration::from_secs(10))
}

/// The calculator tools; a panicking tool's backtrace can take long to print, so only the timeout test
/// uses a short timeout.
fn tools_with_timeout(timeout: Duration) -> Resources {
    let tools = Tools::new()
        .with_timeout(timeout)
        .register(
            "add",
            "Adds a and b.",
            json!({"a": "number", "b": "number"}),
            |args| {
                let a = args["a"].as_f64().ok_or("a must be a number")?;
                let b = args["b"].as_f64().ok_or("b must be a number")?;
                Ok((a + b).to_string())
            },
        )
        .register("sleep", "Sleeps.", json!({}), |_| {
            std::thread::sleep(Duration::from_secs(5));
            Ok("woke".to_string())
        })
        .register("boom", "Panics.", json!({}), |_| panic!("boom"));
    let mut resources = Resources::default();
    resources.insert(tools);
    resources
}

const TOOL_LOOP: &str = "<|x_x|>\nTools:\n<|ToolSchema|>\n<|o_o|>\n<|query|>\n<|ToolRunner max_turns=4|>\n    <|@_@:turn stop=\"</tool>\"|>\n    <|o_o|>\n    <|ToolExecutor turn|>\n<|MathAnswer var=turn|>\n";

#[test]
fn tool_loop_runs_tools_until_the_answer() {
    let transcript = run(
        TOOL_LOOP,
        json!({"query": "1.5 + 2?", "expected": "3.5"}),
        &[
            "<tool>{\"name\": \"add\", \"args\": {\"a\": 1.5, \"b\": 2}}</tool>",
            "<answer>3.5</answer>",
        ],
        &calculator(),
    )
    .unwrap();
    let text = transcript.to_string();
    assert!(
        text.contains("{\"name\":\"add\",\"description\":\"Adds a and b.\""),
        "{text}"
    );
    assert!(text.contains("<result>3.5</result>"), "{text}");
    assert_eq!(rewards(&transcript), [("math_answer", 1.0, 1.0)]);
}

#[test]
fn tool_failures_become_messages_to_the_model() {
    let replies = [
        "no call at all",
        "<tool>{\"name\": \"add\", \"args\": {\"a\": 1}</tool>",
        "<tool>{\"name\": \"mul\"}</tool>",
        "<tool>{\"name\": \"add\", \"args\": {\"a\": \"x\", \"b\": 1}}</tool>",
    ];
    let transcript = run(
        TOOL_LOOP,
        json!({"query": "q", "expected": "1"}),
        &replies,
        &calculator(),
    )
    .unwrap();
    let text = transcript.to_string();
    assert!(
        text.contains("<result>error: no <tool> call found"),
        "{text}"
    );
    assert!(
        text.contains("<result>error: the tool call is not valid JSON"),
        "{text}"
    );
    assert!(
        text.contains(
            "<result>error: unknown tool `mul`; the tools are: add, sleep, boom</result>"
        ),
        "{text}"
    );
    assert!(
        text.contains("<result>error: a must be a number</result>"),
        "{text}"
    );
    assert_eq!(rewards(&transcript), [("math_answer", 0.0, 1.0)]);
}

#[test]
fn tool_timeouts_become_messages() {
    let replies = ["<tool>{\"name\": \"sleep\"}</tool>", "<answer>1</answer>"];
    let resources = tools_with_timeout(Duration::from_millis(200));
    let transcript = run(
        TOOL_LOOP,
        json!({"query": "q", "expected": "1"}),
        &replies,
        &resources,
    )
    .unwrap();
    let text = transcript.to_string();
    assert!(
        text.contains("<result>error: tool `sleep` timed out after 200ms</result>"),
        "{text}"
    );
}

#[test]
fn tool_panics_become_messages() {
    let replies = ["<tool>{\"name\": \"boom\"}</tool>", "<answer>1</answer>"];
    let transcript = run(
        TOOL_LOOP,
        json!({"query": "q", "expected": "1"}),
        &replies,
        &calculator(),
    )
    .unwrap();
    let text = transcript.to_string();
    assert!(
        text.contains("<result>error: tool `boom` crashed</result>"),
        "{text}"
    );
}

#[test]
fn tool_holotypes_without_tools_fail_clearly() {
    let error = run(
        TOOL_LOOP,
        json!({"query": "q", "expected": "1"}),
        &[],
        &Resources::default(),
    )
    .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("test.hol:3:1: ToolSchema needs the environment's tools"),
        "{error}"
    );
}

#[test]
fn reward_components_are_named_and_weighted() {
    let source = "<|o_o|>\n<|question|>\n<|@_@:answer|>\n<|ExactAnswer|>\n<|FormatReward tags=\"reasoning answer\" weight=0.5|>\n<|LengthPenalty max=10 name=brevity|>\n";
    let transcript = run(
        source,
        json!({"question": "Capital of France?", "expected": "Paris"}),
        &["<reasoning>It is Paris, of course.</reasoning> <answer> Paris </answer>"],
        &Resources::default(),
    )
    .unwrap();
    assert_eq!(
        rewards(&transcript),
        [
            ("exact_answer", 1.0, 1.0),
            ("format", 1.0, 0.5),
            ("brevity", -1.0, 1.0)
        ]
    );
}

#[test]
fn rewards_give_feedback_and_a_skipped_turn_records_nothing() {
    let source = "<|o_o|>\n<|question|>\n<|@_@:answer|>\n<|MathAnswer name=first pass=true|>\n<|FormatReward tags=\"reasoning answer\"|>\n<|Retry first threshold=1|>\n    <|o_o|>\n    again\n    <|@_@:retry|>\n    <|MathAnswer var=retry name=second|>\n";
    let row = json!({"question": "What is 47+8?", "expected": "55"});
    let passed = run(
        source,
        row.clone(),
        &["<answer>55</answer>"],
        &Resources::default(),
    )
    .unwrap();
    assert_eq!(
        passed.feedback,
        [
            ("first".to_string(), "The answer 55 is correct.".to_string()),
            (
                "format".to_string(),
                "The reply lacks <reasoning>...</reasoning>.".to_string()
            )
        ]
    );
    assert!(
        !passed.rewards.iter().any(|(name, ..)| name == "second"),
        "the gate skipped the retry, so `second` is missing, not 0: {:?}",
        passed.rewards
    );
    let failed = run(
        source,
        row,
        &["I think 45", "<answer>55</answer>"],
        &Resources::default(),
    )
    .unwrap();
    assert_eq!(
        rewards(&failed),
        [
            ("first", 0.0, 1.0),
            ("format", 0.0, 1.0),
            ("second", 1.0, 1.0)
        ]
    );
    assert_eq!(failed.feedback[0].1, "The answer I think 45 is incorrect.");
}

#[test]
fn feedback_score_and_memory_write_what_was_recorded() {
    let source = "<|o_o|>\n<|question|>\n<|@_@:answer|>\n<|MathAnswer name=first|>\n<|o_o|>\n<|Feedback first|> (<|Score first|>) <|Memory top_k=2|>\n<|@_@:plan|>\n<|Remember plan score=first threshold=-1|>\n";
    let memory = holotypes::ReflectionMemory::new(5);
    for lesson in ["carry the one", "check the units", "add the tens"] {
        memory.remember(lesson, 1.0);
    }
    memory.commit();
    let mut resources = Resources::default();
    resources.insert(memory);
    let transcript = run(
        source,
        json!({"question": "What is 47+8?", "expected": "55"}),
        &["<answer>45</answer>", "carry next time"],
        &resources,
    )
    .unwrap();
    let text = transcript.to_string();
    assert!(
        text.contains("The answer 45 is incorrect. (0) check the units\n\ncarry the one"),
        "{text}"
    );
    let memory = resources.get::<holotypes::ReflectionMemory>().unwrap();
    assert_eq!(memory.len(), 3, "remembered, not yet committed");
    memory.commit();
    assert_eq!(memory.recent(1), ["carry next time"]);
}

#[test]
fn erl_holotypes_fail_clearly_without_their_inputs() {
    let gate = "<|o_o|>\nQ\n<|@_@:answer|>\n<|Retry first|>\n    <|@_@:retry|>\n";
    let error = run(gate, json!({}), &["x"], &Resources::default()).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("no reward `first` was recorded before this tag"),
        "{error}"
    );
    let memory = "<|o_o|>\n<|Memory|>\n<|@_@:answer|>\n";
    let error = run(memory, json!({}), &["x"], &Resources::default()).unwrap_err();
    assert!(error.to_string().contains("ReflectionMemory"), "{error}");
    let unnamed = "<|o_o|>\nQ\n<|@_@:answer|>\n<|Feedback|>\n";
    let error = run(unnamed, json!({}), &["x"], &Resources::default()).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("needs the name of a reward component"),
        "{error}"
    );
}

#[test]
fn missing_target_column_is_an_error_naming_it() {
    let source = "<|o_o|>\nQ\n<|@_@:answer|>\n<|ExactAnswer target=gold|>\n";
    let error = run(source, json!({}), &["x"], &Resources::default()).unwrap_err();
    assert!(error.to_string().contains("no `gold` column"), "{error}");
}

#[test]
fn numeric_equivalence() {
    for (a, b) in [
        ("42", "42.0"),
        ("0.75", "3/4"),
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("$1,234,567$", "1234567"),
        ("-2.50", "-5/2"),
        ("50%", "1/2"),
        ("\\boxed{12}.", "12"),
        ("007", "7"),
        ("x + 1", "x  +  1"),
    ] {
        assert!(numbers_equal(a, b), "{a} == {b}");
    }
    for (a, b) in [
        ("1,23", "123"),
        ("0.75", "0.7"),
        ("1/0", "1"),
        ("12", "-12"),
        ("x", "y"),
    ] {
        assert!(!numbers_equal(a, b), "{a} != {b}");
    }
}

#[test]
fn the_last_number_of_a_text() {
    for (text, number) in [
        ("9 x 6 = 54 shells.", Some("54")),
        ("So 54 shells is the answer.", Some("54")),
        ("2+3=5", Some("5")),
        ("The total is (1,024)!", Some("1,024")),
        ("**3/4** of it", Some("3/4")),
        ("It costs $12.50.", Some("$12.50")),
        ("#### 18\nThe answer is", Some("18")),
        ("so \\boxed{18}.", Some("\\boxed{18}")),
        ("no number here", None),
        ("", None),
    ] {
        assert_eq!(last_number(text), number, "{text:?}");
    }
}

#[test]
fn math_answer_reads_the_last_number_of_an_untagged_reply_when_asked() {
    let row = json!({"question": "6 times 9?", "expected": "54"});
    let score = |holotype: &str, reply: &str| {
        let source = format!("<|o_o|>\n<|question|>\n<|@_@:reply|>\n{holotype}\n");
        rewards(&run(&source, row.clone(), &[reply], &Resources::default()).unwrap())[0].1
    };
    let lenient = "<|MathAnswer var=reply untagged=last_number|>";
    assert_eq!(score(lenient, "9 x 6 = 54 shells."), 1.0);
    assert_eq!(score(lenient, "54 is wrong, it is 45."), 0.0);
    // A tag still wins over the numbers around it.
    assert_eq!(score(lenient, "9 x 6 = 54, so <answer>45</answer>"), 0.0);
    assert_eq!(score(lenient, "I think 45. <answer>54</answer> 7"), 1.0);
    assert_eq!(score(lenient, "no idea"), 0.0);
    // By default the whole untagged reply is compared.
    assert_eq!(score("<|MathAnswer var=reply|>", "9 x 6 = 54 shells."), 0.0);
    assert_eq!(
        score("<|MathAnswer var=reply untagged=whole|>", " 54. "),
        1.0
    );

    let source = "<|o_o|>\nQ\n<|@_@:reply|>\n<|MathAnswer var=reply untagged=first|>\n";
    let error = run(source, row, &["54"], &Resources::default()).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("argument `untagged` must be `whole` or `last_number`, found `first`"),
        "{error}"
    );
}

/// pass@k's correctness component: the one answer check, the one marked `pass=true` among several, or
/// the only one not marked `pass=false`; two candidates are refused when the file loads, naming both
/// and where they are; a file without an answer check has none.
#[test]
fn pass_at_k_counts_the_answer_check_the_file_names() {
    use holo_core::interpreter::Holoware;
    let load = |tags: &str| {
        let source = format!("<|o_o|>\nQ\n<|@_@:answer|>\n<|@_@:retry|>\n{tags}");
        Holoware::load(
            "test.hol",
            source.as_bytes(),
            std::sync::Arc::new(holotypes::registry()),
        )
    };
    let component = |tags: &str| {
        let holoware = load(tags).unwrap_or_else(|error| panic!("{tags}: {error}"));
        holoware.pass_component().map(str::to_string)
    };
    let format = "<|FormatReward|>\n<|LengthPenalty|>\n";
    assert_eq!(
        component(&format!("<|MathAnswer|>\n{format}")).as_deref(),
        Some("math_answer")
    );
    assert_eq!(
        component("<|ExactAnswer name=right|>\n").as_deref(),
        Some("right")
    );
    assert_eq!(component(format), None);
    let two = "<|MathAnswer name=first|>\n<|MathAnswer var=retry name=second|>\n";
    let error = load(two)
        .err()
        .expect("two answer checks are ambiguous")
        .message;
    assert!(
        error.contains("`first` (test.hol:5:1), `second` (test.hol:6:1)")
            && error.contains("pass=true"),
        "{error}"
    );
    let marked = "<|MathAnswer name=first|>\n<|MathAnswer var=retry name=second pass=true|>\n";
    assert_eq!(component(marked).as_deref(), Some("second"));
    let excluded = "<|MathAnswer name=first pass=false|>\n<|ExactAnswer var=retry name=second|>\n";
    assert_eq!(component(excluded).as_deref(), Some("second"));
    // The same component checked twice (a loop's turns) is one component.
    let same = "<|MathAnswer name=right|>\n<|MathAnswer var=retry name=right|>\n";
    assert_eq!(component(same).as_deref(), Some("right"));
    let both =
        "<|MathAnswer name=first pass=true|>\n<|MathAnswer var=retry name=second pass=true|>\n";
    let error = load(both).err().expect("two marked").message;
    assert!(error.contains("several are marked `pass=true`"), "{error}");
    // A bad mark is refused where every holotype is constructed, before any rollout.
    let holoware = load("<|MathAnswer pass=yes|>\n").unwrap();
    let error = holoware
        .check_holotypes(&Resources::default())
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("test.hol:5:1")
            && error.contains("argument `pass` must be `true` or `false`, found `yes`"),
        "{error}"
    );
}

#[test]
fn builtins_match_the_checker_table() {
    let table = holoc::sema::builtin_holotypes();
    let registry_names = [
        "ToolRunner",
        "ToolSchema",
        "ToolExecutor",
        "CodeExecutor",
        "ExactAnswer",
        "MathAnswer",
        "FormatReward",
        "LengthPenalty",
        "Retry",
        "Feedback",
        "Score",
        "Memory",
        "Remember",
    ];
    assert_eq!(table.len(), registry_names.len());
    // The interpreter's registry holds exactly the checker's table.
    let registry = holotypes::registry();
    let registered: Vec<(String, Vec<String>)> = registry
        .holotypes()
        .into_iter()
        .map(|(name, params)| {
            let params = params.iter().map(|param| param.to_string()).collect();
            (name.to_string(), params)
        })
        .collect();
    let tabled: Vec<(String, Vec<String>)> = table
        .iter()
        .map(|(name, params)| (name.clone(), params.clone().unwrap_or_default()))
        .collect();
    assert_eq!(registered, tabled);
    for name in registry_names {
        assert!(
            table.contains_key(name),
            "{name} missing from holoc's table"
        );
    }
    let check = |name: &str, params: &[&str]| {
        let expected: Vec<String> = params.iter().map(|param| param.to_string()).collect();
        assert_eq!(table[name].as_ref().unwrap(), &expected, "{name}");
    };
    use holo_core::holotypes::*;
    use holo_core::Holotype;
    check("ToolRunner", ToolRunner::PARAMS);
    check("ToolSchema", ToolSchema::PARAMS);
    check("ToolExecutor", ToolExecutor::PARAMS);
    check("CodeExecutor", CodeExecutor::PARAMS);
    check("ExactAnswer", ExactAnswer::PARAMS);
    check("MathAnswer", MathAnswer::PARAMS);
    check("FormatReward", FormatReward::PARAMS);
    check("LengthPenalty", LengthPenalty::PARAMS);
    check("Retry", Retry::PARAMS);
    check("Feedback", Feedback::PARAMS);
    check("Score", Score::PARAMS);
    check("Memory", Memory::PARAMS);
    check("Remember", Remember::PARAMS);
}

/// The checker's table of what each built-in's arguments accept (`holoc::builtins`, H0029/H0030)
/// against the runtime's constructors: every parameter and the positional arguments of every built-in,
/// with values of every kind and at every bound, are refused by the checker exactly when constructing
/// the holotype (`Holoware::check_holotypes`) fails.
#[test]
fn the_checker_refuses_exactly_the_arguments_the_constructors_refuse() {
    use holo_core::holotypes::{CodeSandbox, ReflectionMemory};
    use holo_core::interpreter::Holoware;
    use holoc::builtins::{Positional, BUILTINS};

    let mut resources = calculator();
    resources.insert(ReflectionMemory::default());
    resources.insert(CodeSandbox {
        allow_unsandboxed: true,
        ..CodeSandbox::default()
    });
    let registry = std::sync::Arc::new(holotypes::registry());
    let values = [
        "abc",
        "auto",
        "hermes",
        "mistral",
        "last_number",
        "whole",
        "\"\"",
        "\"x y\"",
        "\" \"",
        "0",
        "1",
        "7",
        "8",
        "15",
        "16",
        "-1",
        "0.5",
        "-0.5",
        "86400",
        "86400.5",
        "4294967295",
        "4294967296",
        "1e999",
    ];
    let positionals = ["", "turn", "\"x\"", "\"\"", "5", "0.5", "a b"];
    let mut sources = Vec::new();
    for builtin in BUILTINS {
        // The arguments the holotype needs besides the one under test.
        let required = |without_score: bool| -> String {
            match builtin.positional {
                Positional::Component if without_score => "first".into(),
                Positional::VariableAndScore if without_score => "reflection score=second".into(),
                Positional::VariableAndScore => "reflection".into(),
                _ => String::new(),
            }
        };
        for param in builtin.params {
            for value in values {
                let base = required(param.name != "score");
                sources.push(format!(
                    "<|{} {base} {}={value}|>",
                    builtin.name, param.name
                ));
            }
        }
        for positional in positionals {
            let keywords = match builtin.positional {
                Positional::VariableAndScore => "score=second",
                _ => "",
            };
            sources.push(format!("<|{} {positional} {keywords}|>", builtin.name));
        }
    }
    let options = holoc::sema::Options::with_builtins(None);
    let mut disagreements = Vec::new();
    for source in &sources {
        let output = holoc::compile(source.as_bytes(), &options);
        let checker = output
            .diagnostics
            .iter()
            .find(|diagnostic| diagnostic.is_error())
            .map(|diagnostic| diagnostic.message.clone());
        let runtime = Holoware::load("case.hol", source.as_bytes(), registry.clone())
            .map_err(|error| error.to_string())
            .and_then(|holoware| {
                holoware
                    .check_holotypes(&resources)
                    .map_err(|error| error.to_string())
            })
            .err();
        if checker.is_some() != runtime.is_some() {
            disagreements.push(format!(
                "{source}\n    checker: {checker:?}\n    runtime: {runtime:?}"
            ));
        }
    }
    assert!(
        disagreements.is_empty(),
        "{} of {} cases disagree:\n{}",
        disagreements.len(),
        sources.len(),
        disagreements.join("\n")
    );
    // Every parameter and positional shape of every built-in was tried (911 cases today).
    assert!(sources.len() > 500, "{}", sources.len());
}
