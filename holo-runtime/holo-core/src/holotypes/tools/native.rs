//! Native tool calls: a turn read in the offered format ([`ToolFormat::read`]) from the completion as
//! the model wrote it ([`Cx::written`]: with the special tokens that Mistral's and harmony's calls start
//! with), every call checked against its tool's schema and run, and each result appended as a `tool`
//! message ([`Cx::tool_result`]), which the Holophore renders with the model's chat template and never
//! trains. What the model got wrong (a call that is not well-formed, an unknown tool, arguments that do
//! not fit the schema) is a `tool` message too, and a failed call in [`ToolStats`] (`tools/failed`).

use super::{schema, Tools};
use crate::holotype::{Cx, Enter};
use crate::holotypes::stats::ToolStats;
use crate::tools::{ToolCall, ToolFormat, ToolReply};

/// Runs the calls of `turn`; [`Enter::Skip`] when it makes none (the model answered). `numbered`
/// counts the rollout's calls, which number their ids.
pub(super) fn execute(
    tools: &Tools,
    stats: Option<&ToolStats>,
    format: ToolFormat,
    turn: &str,
    numbered: &mut u64,
    cx: &mut Cx<'_>,
) -> Enter {
    let record = |succeeded: bool, timed_out: bool| {
        if let Some(stats) = stats {
            stats.record(succeeded, timed_out);
        }
    };
    let written = cx.written(turn);
    let mut reply = match format.read(&written) {
        Ok(None) => {
            // The model answered: a format that writes the answer's content and reasoning apart
            // (harmony) has the message rendered and recorded from them.
            if let Some(answer) = format.answer(&written) {
                cx.tool_calls(&answer);
            }
            return Enter::Skip;
        }
        Ok(Some(reply)) => reply,
        Err(malformed) if format.results_follow_calls() => {
            // The template shows a result only after its call: the turn is a call of what could be
            // read, answered with what was wrong.
            record(false, false);
            let mut call = malformed.call;
            call.id = Some(call_id(numbered, &call));
            let id = call.id.clone();
            cx.tool_calls(&ToolReply {
                content: malformed.content,
                calls: vec![call.clone()],
                reasoning: malformed.reasoning,
            });
            cx.tool_result(
                &call.name,
                id.as_deref(),
                &format!("error: {}", malformed.message),
            );
            return Enter::Run;
        }
        Err(malformed) => {
            record(false, false);
            // No call was read, so the result answers no function: templates that show a result's
            // name get the format's.
            cx.tool_result(
                format.name(),
                None,
                &format!("error: {}", malformed.message),
            );
            return Enter::Run;
        }
    };
    for call in &mut reply.calls {
        call.id = Some(call_id(numbered, call));
    }
    cx.tool_calls(&reply);
    for call in &reply.calls {
        let outcome = tools.find(&call.name).and_then(|tool| {
            schema::check(
                &schema::json_schema(&tool.parameters),
                &call.arguments,
                "arguments",
            )
            .map(|()| tool)
        });
        let result = match outcome {
            Err(message) => {
                record(false, false);
                format!("error: {message}")
            }
            Ok(tool) => match tools.run(tool, call.arguments.clone()) {
                Ok(result) => {
                    record(true, false);
                    result
                }
                Err(failure) => {
                    record(false, failure.timed_out);
                    format!("error: {}", failure.message)
                }
            },
        };
        cx.tool_result(&call.name, call.id.as_deref(), &result);
    }
    Enter::Run
}

/// A call's id: the one the model wrote when it is nine ASCII letters and digits (the only ids
/// Mistral's templates take), else nine drawn from the rollout's count of calls and the function's
/// name, so that a rollout's ids are the same whenever it is run (vLLM draws them at random).
fn call_id(numbered: &mut u64, call: &ToolCall) -> String {
    *numbered += 1;
    if let Some(id) = call
        .id
        .as_ref()
        .filter(|id| id.len() == 9 && id.bytes().all(|byte| byte.is_ascii_alphanumeric()))
    {
        return id.clone();
    }
    // FNV-1a over the count and the name, written in base 62.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in numbered.to_le_bytes().iter().chain(call.name.as_bytes()) {
        hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
    }
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    (0..9)
        .map(|_| {
            let digit = DIGITS[(hash % 62) as usize] as char;
            hash /= 62;
            digit
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::Mutex;
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::holotype::Variables;
    use crate::machine::Recorder;
    use crate::transcript::{Part, Transcript};
    use crate::Role;

    struct NoVariables;

    impl Variables for NoVariables {
        fn get(&self, _: &str) -> Option<&str> {
            None
        }
    }

    /// Every way a call ends, counted: a result, the model's mistakes, the tool's error, a panic and a
    /// timeout (a tool that waits on a channel the test holds open until the call has timed out, so
    /// the timeout is certain; the other tools have the default 10 s).
    #[test]
    fn every_call_is_answered_and_counted() {
        let (hold, wait) = mpsc::channel::<()>();
        let wait = Mutex::new(wait);
        let tools = Tools::new().with_calculator().register(
            "crash",
            "Panics.",
            json!({"type": "object"}),
            |_| panic!("the tool's bug"),
        );
        let waiting = Tools::new()
            .with_timeout(Duration::from_millis(20))
            .register("wait", "Waits.", json!({"type": "object"}), move |_| {
                let _ = wait.lock().unwrap().recv();
                Ok("late".into())
            });
        let stats = ToolStats::default();
        let mut transcript = Transcript::default();
        transcript
            .offer_tools(&[], Some(ToolFormat::Hermes))
            .unwrap();
        let call = |name: &str, arguments: &str| {
            format!(
                "<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {arguments}}}\n</tool_call>"
            )
        };
        let turns = [
            call("calculator", r#"{"expression": "2 * 21"}"#),
            call("calculator", r#"{"expression": "2 *"}"#),
            call("calculator", r#"{"expression": ["2"]}"#),
            call("search", "{}"),
            "<tool_call>\n{\"name\": \"calculator\"\n</tool_call>".to_string(),
            call("crash", "{}"),
        ];
        for turn in &turns {
            let mut cx = Cx::new(&mut transcript, &NoVariables, 0);
            assert_eq!(
                execute(
                    &tools,
                    Some(&stats),
                    ToolFormat::Hermes,
                    turn,
                    &mut 0,
                    &mut cx
                ),
                Enter::Run
            );
        }
        let mut cx = Cx::new(&mut transcript, &NoVariables, 0);
        let wait_call = call("wait", "{}");
        assert_eq!(
            execute(
                &waiting,
                Some(&stats),
                ToolFormat::Hermes,
                &wait_call,
                &mut 0,
                &mut cx
            ),
            Enter::Run
        );
        drop(hold);
        let mut cx = Cx::new(&mut transcript, &NoVariables, 0);
        assert_eq!(
            execute(
                &tools,
                Some(&stats),
                ToolFormat::Hermes,
                "42.",
                &mut 0,
                &mut cx
            ),
            Enter::Skip
        );
        let results: Vec<String> = transcript.contexts[0]
            .messages
            .iter()
            .filter(|message| message.role == Role::User)
            .map(|message| match &message.parts[..] {
                [Part::Prompt(text)] => text.clone(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(results.len(), turns.len() + 1);
        assert_eq!(results[0], "42");
        assert_eq!(results[1], "error: the expression ends too early");
        assert_eq!(
            results[2],
            "error: `arguments.expression` must be a string, got an array"
        );
        assert_eq!(
            results[3],
            "error: unknown tool `search`; the tools are: calculator, crash"
        );
        assert!(
            results[4].starts_with("error: the tool call is not valid JSON: "),
            "{}",
            results[4]
        );
        assert_eq!(results[5], "error: tool `crash` crashed");
        assert_eq!(results[6], "error: tool `wait` timed out after 20ms");
        let counts = stats.counts();
        assert_eq!((counts.calls, counts.failed, counts.timed_out), (7, 6, 1));
    }
}
