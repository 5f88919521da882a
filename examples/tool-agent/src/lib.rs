//! `hol/tool.hol` as a typed state machine, with three of the holotypes it names implemented here (a
//! calculator tool schema, a turn loop and a tool executor, which shadow the runtime's built-ins of the
//! same names) and the fourth, `MathAnswer`, the runtime's built-in.
//!
//! ```
//! use holo_runtime::{Machine, Rollout, Scripted, Step, Transcript};
//! use tool_agent::{run, tool};
//!
//! let row = serde_json::json!({"query": "What is 6 * 7?", "expected": "42"});
//! let input: tool::Input = serde_json::from_value(row).unwrap();
//! let mut sampler = Scripted::new([
//!     r#"<tool>{"name": "calculator", "args": {"expression": "6 * 7"}}</tool>"#,
//!     "The product is <answer>42</answer>",
//! ]);
//! let transcript = run(input, &mut sampler).unwrap();
//! assert_eq!(
//!     transcript.rewards,
//!     vec![("math_answer".to_string(), 1.0, 1.0), ("answered".to_string(), 1.0, 1.0)]
//! );
//! ```

use holo_runtime::{
    Args, Cx, Enter, Holotype, HolotypeError, Machine, Pass, Rollout, RolloutError, Scripted, Step,
    Transcript,
};

holo_macros::include_holoware!("../../hol/tool.hol");

// hol/grade.hol, compiled by build.rs.
include!(concat!(env!("OUT_DIR"), "/holoware/grade.rs"));

/// Rewards an answer equal to the data row's `expected` column.
pub struct ExactAnswer;

impl Holotype for ExactAnswer {
    const PARAMS: &'static [&'static str] = &[];

    fn new(_: &Args) -> Result<Self, HolotypeError> {
        Ok(ExactAnswer)
    }

    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
        let answer = cx.var("answer").unwrap_or_default().trim().to_string();
        let correct = cx
            .var("query")
            .is_some_and(|query| query.ends_with(&format!("= {answer}?")));
        cx.reward("exact", if correct { 1.0 } else { 0.0 });
        Ok(())
    }
}

/// Writes the JSON schema of the one tool, a calculator.
pub struct ToolSchema;

impl Holotype for ToolSchema {
    const PARAMS: &'static [&'static str] = &[];

    fn new(_: &Args) -> Result<Self, HolotypeError> {
        Ok(ToolSchema)
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        cx.inject(concat!(
            r#"{"name": "calculator", "description": "Evaluates + - * / on integers.", "#,
            r#""args": {"expression": "string"}}"#,
            "\n",
        ));
        Ok(Enter::Run)
    }
}

/// Repeats its body until the model answers or `max_turns` passes have run; rewards an answer.
pub struct ToolRunner {
    max_turns: u32,
}

impl Holotype for ToolRunner {
    const PARAMS: &'static [&'static str] = &["max_turns"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        let max_turns = args.int("max_turns")?.unwrap_or(4);
        let max_turns =
            u32::try_from(max_turns).map_err(|_| HolotypeError::new("max_turns must be >= 0"))?;
        Ok(ToolRunner { max_turns })
    }

    fn end_pass(&mut self, cx: &mut Cx<'_>) -> Result<Pass, HolotypeError> {
        let answered = cx.var("turn").is_some_and(|turn| turn.contains("<answer>"));
        Ok(if answered || cx.pass() >= self.max_turns {
            Pass::Done
        } else {
            Pass::Repeat
        })
    }

    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
        let answered = cx.var("turn").is_some_and(|turn| turn.contains("<answer>"));
        cx.reward("answered", if answered { 1.0 } else { 0.0 });
        Ok(())
    }
}

/// Runs the `<tool>` call found in the variable its argument names, and writes `<result>`.
pub struct ToolExecutor {
    variable: String,
}

impl Holotype for ToolExecutor {
    const PARAMS: &'static [&'static str] = &[];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        let variable = args.words().next().ok_or_else(|| {
            HolotypeError::new("name the variable to read, as in <|ToolExecutor turn|>")
        })?;
        Ok(ToolExecutor {
            variable: variable.to_string(),
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        let turn = cx.var(&self.variable).unwrap_or_default();
        if turn.contains("<answer>") {
            return Ok(Enter::Skip);
        }
        let result = match call(turn) {
            Ok(value) => value,
            Err(message) => format!("error: {message}"),
        };
        cx.inject(&format!("<result>{result}</result>"));
        Ok(Enter::Run)
    }
}

/// Parses `<tool>{"name": ..., "args": {"expression": ...}}</tool>` and evaluates the expression.
fn call(turn: &str) -> Result<String, String> {
    let start = turn.find("<tool>").ok_or("no <tool> call in the turn")? + "<tool>".len();
    let end = turn[start..]
        .find("</tool>")
        .map_or(turn.len(), |end| start + end);
    let call: serde_json::Value = serde_json::from_str(&turn[start..end])
        .map_err(|error| format!("the tool call is not JSON: {error}"))?;
    if call["name"] != "calculator" {
        return Err(format!("unknown tool {}", call["name"]));
    }
    let expression = call["args"]["expression"]
        .as_str()
        .ok_or("calculator needs args.expression, a string")?;
    evaluate(expression).map(|value| value.to_string())
}

/// Evaluates integers joined by `+ - * /`, left to right with `*` and `/` first.
fn evaluate(expression: &str) -> Result<i64, String> {
    let mut sum = 0i64;
    let mut product: Option<i64> = None;
    let mut pending_op = '*';
    let mut sign = 1i64;
    for token in expression.split_whitespace() {
        match token {
            "+" | "-" => {
                sum += sign * product.take().ok_or("operator without an operand")?;
                sign = if token == "+" { 1 } else { -1 };
                pending_op = '*';
            }
            "*" | "/" => pending_op = token.chars().next().unwrap_or('*'),
            number => {
                let value: i64 = number
                    .parse()
                    .map_err(|_| format!("not an integer: {number}"))?;
                product = Some(match (product, pending_op) {
                    (None, _) => value,
                    (Some(left), '*') => left * value,
                    (Some(_), _) if value == 0 => return Err("division by zero".to_string()),
                    (Some(left), _) => left / value,
                });
            }
        }
    }
    Ok(sum + sign * product.ok_or("empty expression")?)
}

/// Drives one rollout to the end with a scripted sampler.
pub fn run(input: tool::Input, sampler: &mut Scripted) -> Result<Transcript, RolloutError> {
    let mut transcript = Transcript::default();
    let mut machine = tool::Machine::new(input)?;
    while let Step::Sample(request) = machine.step(&mut transcript)? {
        let completion = sampler
            .complete(&request)
            .ok_or(RolloutError::Protocol("the script ran out of replies"))?;
        machine.resume(completion, &mut transcript)?;
    }
    Ok(transcript)
}
