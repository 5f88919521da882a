//! Drives the machine compiled from hol/tool.hol to the end with a scripted sampler.

use holo_runtime::{Machine, Rollout, RolloutError, Scripted, Step, Transcript};
use tool_agent::{run, tool};

fn input(query: &str) -> tool::Input {
    serde_json::from_value(serde_json::json!({"query": query, "expected": "43"})).unwrap()
}

#[test]
fn tool_call_then_answer() {
    let mut sampler = Scripted::new([
        "<reasoning>I should multiply.</reasoning>\n<tool>{\"name\": \"calculator\", \"args\": {\"expression\": \"6 * 7 + 1\"}}</tool> ignored",
        "<reasoning>The tool says 43.</reasoning>\n<answer>43</answer>",
    ]);
    let transcript = run(input("What is 6 * 7 + 1?"), &mut sampler).unwrap();
    insta::assert_snapshot!(transcript.to_string());
}

#[test]
fn malformed_tool_call_is_reported_to_the_model() {
    let mut sampler = Scripted::new(["<tool>{not json}</tool>", "<answer>?</answer>"]);
    let transcript = run(input("Break it."), &mut sampler).unwrap();
    insta::assert_snapshot!(transcript.to_string());
}

#[test]
fn max_turns_ends_the_loop_without_an_answer() {
    let replies: Vec<String> = (0..10)
        .map(|i| format!("<tool>{{\"name\": \"calculator\", \"args\": {{\"expression\": \"{i} + 1\"}}}}</tool>"))
        .collect();
    let mut sampler = Scripted::new(replies);
    let transcript = run(input("Loop forever."), &mut sampler).unwrap();
    let turns = transcript.contexts[0]
        .messages
        .iter()
        .filter(|message| message.role == holo_runtime::Role::Assistant)
        .count();
    assert_eq!(turns, 8, "hol/tool.hol sets max_turns=8");
    assert_eq!(
        transcript.rewards,
        // `MathAnswer` scores when the loop ends and its tag is reached, before the end hooks run.
        vec![
            ("math_answer".to_string(), 0.0, 1.0),
            ("answered".to_string(), 0.0, 1.0)
        ]
    );
}

#[test]
fn input_deserializes_from_a_data_row() {
    let row: tool::Input =
        serde_json::from_str(r#"{"query": "2+2?", "few_shot": "Q: 1+1? A: 2", "expected": 4}"#)
            .unwrap();
    assert_eq!(row.query.as_str(), "2+2?");
    assert_eq!(
        row.extra["expected"].as_ref().unwrap().as_str(),
        "4",
        "other columns stay visible to holotypes"
    );
    let missing = serde_json::from_str::<tool::Input>(r#"{"few_shot": ""}"#).unwrap_err();
    assert!(
        missing.to_string().contains("missing field `query`"),
        "{missing}"
    );
    let numeric: tool::Input = serde_json::from_str(r#"{"query": 42}"#).unwrap();
    assert_eq!(numeric.query.as_str(), "42");
}

#[test]
fn protocol_misuse_is_an_error() {
    let mut machine = tool::Machine::new(input("x")).unwrap();
    let mut transcript = Transcript::default();
    assert!(matches!(machine.step(&mut transcript), Ok(Step::Sample(_))));
    assert_eq!(
        machine.step(&mut transcript),
        Err(RolloutError::Protocol(
            "step called while a completion is awaited"
        ))
    );
}

#[test]
fn build_script_module_runs() {
    use holo_runtime::Transcript;
    let input = tool_agent::grade::Input {
        query: "Is 2 + 2 = 4?".into(),
        extra: Default::default(),
    };
    let mut machine = tool_agent::grade::Machine::new(input).unwrap();
    let mut transcript = Transcript::default();
    let Step::Sample(request) = machine.step(&mut transcript).unwrap() else {
        panic!("grade.hol samples first");
    };
    assert_eq!(request.stop, ["</answer>"]);
    assert_eq!(request.max_tokens, Some(64));
    let completion = Scripted::new(["4</answer>"]).complete(&request).unwrap();
    machine.resume(completion, &mut transcript).unwrap();
    assert_eq!(machine.step(&mut transcript).unwrap(), Step::Done);
    assert_eq!(machine.vars.answer.as_deref(), Some("4"));
    assert_eq!(transcript.rewards, vec![("exact".to_string(), 1.0, 1.0)]);
}
