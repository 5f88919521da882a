//! Every corpus file, standard holoware and `ok` input compiles through `include_holoware!` into a machine
//! that runs to the end under a scripted sampler; the transcripts are snapshots. The same file run by the
//! runtime's IR interpreter must give the identical transcript (a differential test of codegen against
//! the interpreter).
//!
//! The holotypes are stand-ins: each writes `[Name]` when reached and runs its body once.

use std::sync::Arc;

use holo_runtime::interpreter::{Holoware, Registry, Row};

use holo_runtime::{
    Args, Constraint, Cx, Enter, Holotype, HolotypeError, Machine, Rollout, RolloutError, Scripted,
    Step, Transcript,
};

macro_rules! stand_in_holotypes {
    ($($name:ident),* $(,)?) => {
        fn registry() -> Registry {
            let mut registry = Registry::default();
            $(registry.register::<$name>(stringify!($name));)*
            registry
        }
        $(
        pub struct $name;

        impl Holotype for $name {
            const PARAMS: &'static [&'static str] =
                &[
                    "max_turns", "max", "mode", "label", "timeout", "var", "name", "weight", "untagged", "pass",
                    "score", "threshold", "top_k", "parser",
                ];

            fn new(_: &Args) -> Result<Self, HolotypeError> {
                Ok($name)
            }

            fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
                cx.inject(concat!("[", stringify!($name), "]"));
                Ok(Enter::Run)
            }

            fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
                cx.reward(stringify!($name), 1.0);
                Ok(())
            }
        }
    )*};
}

stand_in_holotypes!(
    Attractor,
    ExactAnswer,
    FormatReward,
    MathAnswer,
    Memory,
    BingoAttractor,
    CodeExecutor,
    CorrectAnswerRule,
    Feedback,
    FidelityAttractor,
    FidelityCritique,
    Inner,
    Judge,
    Loop,
    L,
    Middle,
    Outer,
    Remember,
    Retry,
    Rubric,
    Score,
    Shout,
    SmolaToolAttractor,
    Tool,
    ToolExecutor,
    ToolPrompt,
    ToolRule,
    ToolRunner,
    ToolSchema,
    ToolTurns,
);

/// A data row that gives every input the value `<name>`.
fn row(inputs: &[&str]) -> Row {
    inputs
        .iter()
        .map(|name| {
            (
                name.to_string(),
                serde_json::Value::String(format!("<{name}>")),
            )
        })
        .collect()
}

/// Runs a machine whose data row gives every input the value `<name>`.
fn run<M: Machine<Input = I>, I: serde::de::DeserializeOwned>(inputs: &[&str]) -> String {
    let row = serde_json::Value::Object(row(inputs));
    let input: I = serde_json::from_value(row).expect("the row deserializes");
    let mut machine = M::new(input).expect("the machine builds");
    drive(&mut machine)
}

/// Runs the file through the IR interpreter instead.
fn interpret(path: &str, inputs: &[&str]) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    let holoware = Arc::new(Holoware::open(&path, Arc::new(registry())).expect("the file loads"));
    let row = row(inputs);
    holoware.check_row(&row).expect("the row has every input");
    let mut rollout = holoware.start(&row).expect("the rollout starts");
    drive(&mut rollout)
}

fn drive(rollout: &mut dyn Rollout) -> String {
    let mut transcript = Transcript::default();
    let mut sampler = Scripted::new((1..=20).map(|i| format!("reply {i}")));
    while let Step::Sample(request) = rollout.step(&mut transcript).expect("step") {
        let completion = sampler.complete(&request).expect("enough replies");
        rollout.resume(completion, &mut transcript).expect("resume");
    }
    transcript.to_string()
}

macro_rules! holowares {
    ($($module:ident => $path:literal,)*) => {
        mod compiled {
            $(holo_macros::include_holoware!($module, $path, holotypes = crate);)*
        }

        $(
            #[test]
            fn $module() {
                let transcript = run::<compiled::$module::Machine, _>(compiled::$module::INPUTS);
                let interpreted = interpret($path, compiled::$module::INPUTS);
                assert_eq!(transcript, interpreted, "the interpreter differs from the compiled machine");
                insta::assert_snapshot!(stringify!($module), transcript);
            }
        )*
    };
}

holowares! {
    corpus_codemath => "../tests/corpus/errloom/codemath.hol",
    corpus_compressor => "../tests/corpus/errloom/compressor.hol",
    corpus_doublecheck => "../tests/corpus/errloom/doublecheck.hol",
    corpus_qa => "../tests/corpus/errloom/qa.hol",
    corpus_smola => "../tests/corpus/errloom/smola.hol",
    corpus_tool => "../tests/corpus/errloom/tool.hol",
    corpus_compressor_001a04a => "../tests/corpus/errloom/history/compressor-001a04a.hol",
    corpus_compressor_f96f225 => "../tests/corpus/errloom/history/compressor-f96f225.hol",
    corpus_smola_00a96ab => "../tests/corpus/errloom/history/smola-00a96ab.hol",
    hol_arithmetic => "../hol/arithmetic.hol",
    hol_codemath => "../hol/codemath.hol",
    hol_doublecheck => "../hol/doublecheck.hol",
    hol_erl => "../hol/erl.hol",
    hol_qa => "../hol/qa.hol",
    hol_tool => "../hol/tool.hol",
    hol_tool_native => "../hol/tool_native.hol",
    hol_wordproblems => "../hol/wordproblems.hol",
    ok_alternatives => "../holoc/tests/inputs/ok/alternatives.hol",
    ok_blank_lines_around_closing_tag => "../holoc/tests/inputs/ok/blank_lines_around_closing_tag.hol",
    ok_blank_lines_at_end_of_body => "../holoc/tests/inputs/ok/blank_lines_at_end_of_body.hol",
    ok_bodies => "../holoc/tests/inputs/ok/bodies.hol",
    ok_body_starts_with_anything => "../holoc/tests/inputs/ok/body_starts_with_anything.hol",
    ok_byte_order_mark => "../holoc/tests/inputs/ok/byte_order_mark.hol",
    ok_constrained_samplers => "../holoc/tests/inputs/ok/constrained_samplers.hol",
    ok_carriage_return_at_eof => "../holoc/tests/inputs/ok/carriage_return_at_eof.hol",
    ok_context_template_arguments => "../holoc/tests/inputs/ok/context_template_arguments.hol",
    ok_contexts => "../holoc/tests/inputs/ok/contexts.hol",
    ok_crlf => "../holoc/tests/inputs/ok/crlf.hol",
    ok_empty => "../holoc/tests/inputs/ok/empty.hol",
    ok_escapes => "../holoc/tests/inputs/ok/escapes.hol",
    ok_fenced_constraints => "../holoc/tests/inputs/ok/fenced_constraints.hol",
    ok_json_schema_file => "../holoc/tests/inputs/ok/json_schema_file.hol",
    ok_holotype_without_body => "../holoc/tests/inputs/ok/holotype_without_body.hol",
    ok_implicit_context => "../holoc/tests/inputs/ok/implicit_context.hol",
    ok_inline_tags => "../holoc/tests/inputs/ok/inline_tags.hol",
    ok_loop_bindings => "../holoc/tests/inputs/ok/loop_bindings.hol",
    ok_negative_zero_temperature => "../holoc/tests/inputs/ok/negative_zero_temperature.hol",
    ok_nested_bodies => "../holoc/tests/inputs/ok/nested_bodies.hol",
    ok_no_trailing_newline => "../holoc/tests/inputs/ok/no_trailing_newline.hol",
    ok_only_comments => "../holoc/tests/inputs/ok/only_comments.hol",
    ok_only_text => "../holoc/tests/inputs/ok/only_text.hol",
    ok_optional_chain => "../holoc/tests/inputs/ok/optional_chain.hol",
    ok_roles => "../holoc/tests/inputs/ok/roles.hol",
    ok_sampler_arguments => "../holoc/tests/inputs/ok/sampler_arguments.hol",
    ok_unicode => "../holoc/tests/inputs/ok/unicode.hol",
    ok_whitespace => "../holoc/tests/inputs/ok/whitespace.hol",
}

/// A sampler tag's constraint reaches its sample request alike from the compiled machine and from the
/// interpreter, as the runtime's `Constraint`.
#[test]
fn constraints_reach_the_sample_requests() {
    fn constraints(rollout: &mut dyn Rollout) -> Vec<Option<Constraint>> {
        let mut transcript = Transcript::default();
        let mut sampler = Scripted::new((1..=20).map(|i| format!("reply {i}")));
        let mut constraints = Vec::new();
        while let Step::Sample(request) = rollout.step(&mut transcript).expect("step") {
            constraints.push(request.constraint.clone());
            let completion = sampler.complete(&request).expect("enough replies");
            rollout.resume(completion, &mut transcript).expect("resume");
        }
        constraints
    }
    let path = "../holoc/tests/inputs/ok/constrained_samplers.hol";
    let input: compiled::ok_constrained_samplers::Input =
        serde_json::from_value(serde_json::json!({})).unwrap();
    let mut machine = compiled::ok_constrained_samplers::Machine::new(input).unwrap();
    let compiled = constraints(&mut machine);
    let holoware = Arc::new(
        Holoware::open(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path),
            Arc::new(registry()),
        )
        .unwrap(),
    );
    let interpreted = constraints(&mut holoware.start(&Row::new()).unwrap());
    assert_eq!(compiled, interpreted);
    assert_eq!(
        compiled,
        [
            Some(Constraint::JsonSchema(serde_json::json!({
                "type": "object",
                "properties": {"rain": {"type": "boolean"}},
                "required": ["rain"],
            }))),
            Some(Constraint::JsonObject),
            Some(Constraint::Choice(vec![
                "yes".into(),
                "no".into(),
                "not sure".into()
            ])),
            Some(Constraint::Regex("[0-9]{1,3}".into())),
            Some(Constraint::Lark(
                "start: KEY \"=\" VALUE\nKEY: /[a-z]+/\nVALUE: /[0-9]+/".into()
            )),
        ]
    );
}

/// A sampler's `json_schema=name` reads its schema from the variable when it runs, alike in the compiled
/// machine and the interpreter: a row's column, then an earlier reply inside a fence; a reply that is no
/// schema ends the rollout with an error at the tag. (Not in the list above, whose rows are no schemas.)
/// The constraint of each sample request a rollout makes, answered by `replies` in turn, and how the
/// rollout ended.
type Requests = (Vec<Option<Constraint>>, Result<(), RolloutError>);

fn constraint_requests(rollout: &mut dyn Rollout, replies: &[&str]) -> Requests {
    let mut transcript = Transcript::default();
    let mut sampler = Scripted::new(replies.iter().copied());
    let mut constraints = Vec::new();
    loop {
        match rollout.step(&mut transcript) {
            Ok(Step::Sample(request)) => {
                constraints.push(request.constraint.clone());
                let completion = sampler.complete(&request).expect("enough replies");
                rollout.resume(completion, &mut transcript).expect("resume");
            }
            Ok(Step::Done) => return (constraints, Ok(())),
            Err(error) => return (constraints, Err(error)),
        }
    }
}

#[test]
fn schemas_from_variables_reach_the_sample_requests() {
    mod compiled {
        holo_macros::include_holoware!(
            ok_schema_variable,
            "../holoc/tests/inputs/ok/schema_variable.hol",
            holotypes = crate
        );
    }

    fn requests(rollout: &mut dyn Rollout, own: &str) -> Requests {
        constraint_requests(rollout, &["42", own, "\"x\"</again>"])
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../holoc/tests/inputs/ok/schema_variable.hol");
    let holoware = Arc::new(Holoware::open(&path, Arc::new(registry())).unwrap());
    let row = serde_json::json!({"schema": "{\"type\": \"integer\"}"});
    for (own, fails) in [("{\"type\": \"string\"}", false), ("not a schema", true)] {
        let input = serde_json::from_value(row.clone()).unwrap();
        let mut machine = compiled::ok_schema_variable::Machine::new(input).unwrap();
        let compiled = requests(&mut machine, own);
        let row = row.as_object().unwrap().clone();
        let interpreted = requests(&mut holoware.start(&row).unwrap(), own);
        assert_eq!(compiled.0, interpreted.0);
        assert_eq!(
            compiled.0[0],
            Some(Constraint::JsonSchema(
                serde_json::json!({"type": "integer"})
            ))
        );
        match (&compiled.1, &interpreted.1) {
            (Err(first), Err(second)) if fails => {
                for error in [first, second] {
                    let message = error.to_string();
                    assert!(
                        message.contains("schema_variable.hol:7:1: `own`, the sampler's json_schema, is not a JSON schema: not JSON"),
                        "{message}"
                    );
                }
                assert_eq!(compiled.0.len(), 2);
            }
            (Ok(()), Ok(())) if !fails => {
                // In the fence: the schema from the reply, then the closing tag, one Lark grammar.
                let Some(Constraint::Lark(grammar)) = &compiled.0[2] else {
                    panic!("{:?}", compiled.0)
                };
                assert!(
                    grammar.contains(r#"{"type":"string""#) && grammar.ends_with("\"</again>\"\n"),
                    "{grammar}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}

/// A sampler's `regex=name` and `grammar=name` read their text from the variable when they run, alike in
/// the compiled machine and the interpreter: a row's column, then an earlier reply inside a fence, then
/// the column inside a fence. Each lowers exactly as the same text written in the tag does (fenced: the
/// closing tag one terminal with the regex, the grammar nested whole); a text that is none ends the
/// rollout with an error at the tag.
#[test]
fn regexes_and_grammars_from_variables_reach_the_sample_requests() {
    mod compiled {
        holo_macros::include_holoware!(
            ok_constraint_variable,
            "../holoc/tests/inputs/ok/constraint_variable.hol",
            holotypes = crate
        );
    }

    const RULES: &str = r#"start: "yes" | "no""#;
    fn requests(rollout: &mut dyn Rollout, rules: &str) -> Requests {
        constraint_requests(rollout, &["42", rules, "yes</sentence>", "7</code>"])
    }
    let both = |pattern: &str, rules: &str| -> (Requests, Requests) {
        let row = serde_json::json!({ "pattern": pattern });
        let input = serde_json::from_value(row.clone()).unwrap();
        let mut machine = compiled::ok_constraint_variable::Machine::new(input).unwrap();
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../holoc/tests/inputs/ok/constraint_variable.hol");
        let holoware = Arc::new(Holoware::open(&path, Arc::new(registry())).unwrap());
        let row = row.as_object().unwrap().clone();
        let interpreted = requests(&mut holoware.start(&row).unwrap(), rules);
        (requests(&mut machine, rules), interpreted)
    };

    // The same samplers with the same texts written in their tags.
    let written = format!(
        "<|o_o|>\n<|@_@:digits regex=\"[0-9]+\"|>\n<|@_@:sentence <>sentence grammar='{RULES}'|>\n\
         <|@_@:code <>code regex=\"[0-9]+\"|>\n"
    );
    let written = Holoware::load("written.hol", written.as_bytes(), Arc::new(registry())).unwrap();
    let written: Vec<Option<Constraint>> = written
        .constraints()
        .into_iter()
        .map(|(_, constraint)| Some(constraint))
        .collect();
    let (compiled, interpreted) = both("[0-9]+", RULES);
    assert_eq!(compiled.0, interpreted.0);
    assert!(compiled.1.is_ok() && interpreted.1.is_ok());
    let [digits, rules, sentence, code] = compiled.0.as_slice() else {
        panic!("{:?}", compiled.0)
    };
    assert_eq!(rules, &None);
    assert_eq!([digits, sentence, code].map(Clone::clone).to_vec(), written);
    assert_eq!(digits, &Some(Constraint::Regex("[0-9]+".into())));
    let Some(Constraint::Lark(grammar)) = sentence else {
        panic!("{sentence:?}")
    };
    assert!(
        grammar.contains(&format!("%lark {{\n{RULES}\n}}")),
        "{grammar}"
    );

    // A row's text that is no regular expression, a reply that is no grammar.
    for ((pattern, rules), at, error) in [
        (
            ("(", RULES),
            "3:1",
            "`pattern`, the sampler's regex, is not a regular expression: ",
        ),
        (
            ("[0-9]+", " "),
            "7:1",
            "`rules`, the sampler's grammar, is not a Lark grammar: the text is empty",
        ),
    ] {
        let (compiled, interpreted) = both(pattern, rules);
        assert_eq!(compiled.0, interpreted.0);
        for outcome in [compiled.1, interpreted.1] {
            let message = outcome.unwrap_err().to_string();
            assert!(
                message.contains(&format!("constraint_variable.hol:{at}: {error}")),
                "{message}"
            );
        }
    }
}

/// A row with none of `<|question|prompt|>` is rejected before the rollout starts, by both.
#[test]
fn row_without_any_alternative_is_rejected_up_front() {
    let empty = serde_json::Value::Object(Row::new());
    let input: compiled::ok_optional_chain::Input = serde_json::from_value(empty).unwrap();
    let error = compiled::ok_optional_chain::Machine::new(input)
        .err()
        .expect("rejected");
    assert_eq!(
        error,
        holo_runtime::RolloutError::MissingVariable {
            location: "../holoc/tests/inputs/ok/optional_chain.hol:2:1",
            alternatives: &["question", "prompt"],
        }
    );
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../holoc/tests/inputs/ok/optional_chain.hol");
    let holoware = Holoware::open(&path, Arc::new(registry())).unwrap();
    let missing = holoware.check_row(&Row::new()).unwrap_err();
    assert_eq!(missing.columns, ["question", "prompt"]);
    assert!(
        missing.to_string().contains("optional_chain.hol:2:1"),
        "{missing}"
    );
}

holo_macros::holoware!(
    shadowing,
    r#"<|o_o|>
Go.
<|Loop|>
    <|o_o|>
    Previous: <|turn|"none"|>
    <|@_@:turn|>
"#,
    holotypes = crate
);

/// A row column named like a binding never stands in for it, compiled or interpreted; other columns
/// (even arrays and nulls) do not stop the row.
#[test]
fn row_columns_never_shadow_bindings() {
    let row = serde_json::json!({"turn": "FROM-ROW", "tags": ["a", 1], "note": null});
    let input: shadowing::Input = serde_json::from_value(row.clone()).unwrap();
    assert_eq!(input.extra["tags"].as_ref().unwrap().as_str(), r#"["a",1]"#);
    let compiled = drive(&mut shadowing::Machine::new(input).unwrap());
    assert!(compiled.contains("Previous: none"), "{compiled}");

    let source =
        "<|o_o|>\nGo.\n<|Loop|>\n    <|o_o|>\n    Previous: <|turn|\"none\"|>\n    <|@_@:turn|>\n";
    let holoware =
        Arc::new(Holoware::load("shadowing.hol", source.as_bytes(), Arc::new(registry())).unwrap());
    let interpreted = drive(&mut holoware.start(row.as_object().unwrap()).unwrap());
    assert_eq!(compiled, interpreted);
}

/// A test per file above: a new `ok` input or corpus file must be added to the list.
#[test]
fn every_holoware_is_listed() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let listed = include_str!("corpus.rs");
    let mut missing = Vec::new();
    for dir in [
        "tests/corpus/errloom",
        "tests/corpus/errloom/history",
        "hol",
        "holoc/tests/inputs/ok",
    ] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|extension| extension == "hol") {
                let relative = format!(
                    "\"../{dir}/{}\"",
                    path.file_name().unwrap().to_string_lossy()
                );
                if !listed.contains(&relative) {
                    missing.push(relative);
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "add to the holowares! list: {missing:?}"
    );
}
