//! Tool use: [`Tools`] (a registry of Rust functions with JSON schemas, provided as a resource),
//! [`ToolSchema`] (writes the schemas), [`ToolExecutor`] (runs the call in a turn) and [`ToolRunner`]
//! (repeats its body until the model answers).

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::holotype::{Args, Cx, Enter, Holotype, HolotypeError, Pass};

type Handler = Arc<dyn Fn(&Value) -> Result<String, String> + Send + Sync>;

/// One tool: a name, a description and a JSON schema of its arguments, shown to the model, and the
/// function that runs it.
#[derive(Clone)]
pub struct Tool {
    pub name: String,
    pub description: String,
    pub parameters: Value,
    handler: Handler,
}

/// The tools of an environment. Give them to rollouts as a resource:
/// `resources.insert(Tools::new().register(...))`.
#[derive(Clone)]
pub struct Tools {
    tools: Vec<Tool>,
    timeout: Duration,
}

impl Default for Tools {
    fn default() -> Self {
        Tools {
            tools: Vec::new(),
            timeout: Duration::from_secs(10),
        }
    }
}

impl Tools {
    pub fn new() -> Self {
        Tools::default()
    }

    /// How long a call may run before the model is told it timed out (default 10 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Adds a tool. `handler` gets the call's `args` and returns the result text, or an error message
    /// for the model.
    pub fn register(
        mut self,
        name: &str,
        description: &str,
        parameters: Value,
        handler: impl Fn(&Value) -> Result<String, String> + Send + Sync + 'static,
    ) -> Self {
        self.tools.retain(|tool| tool.name != name);
        self.tools.push(Tool {
            name: name.to_string(),
            description: description.to_string(),
            parameters,
            handler: Arc::new(handler),
        });
        self
    }

    /// Adds `calculator`, which evaluates arithmetic (`+ - * /`, parentheses, decimals): the tool the
    /// standard `hol/tool.hol` is demonstrated with.
    pub fn with_calculator(self) -> Self {
        self.register(
            "calculator",
            "Evaluates an arithmetic expression with + - * / and parentheses.",
            serde_json::json!({"expression": "string"}),
            |args| {
                let expression = args["expression"]
                    .as_str()
                    .ok_or("calculator needs args.expression, a string")?;
                let value = Arithmetic::new(expression).evaluate()?;
                // Whole numbers without `.0`, as a person writes them.
                Ok(if value.fract() == 0.0 && value.abs() < 1e15 {
                    format!("{}", value as i64)
                } else {
                    value.to_string()
                })
            },
        )
    }

    pub fn tools(&self) -> &[Tool] {
        &self.tools
    }

    /// The tools as the model sees them: one JSON object per line.
    pub fn schema(&self) -> String {
        self.tools
            .iter()
            .map(|tool| {
                serde_json::json!({
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                })
                .to_string()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Runs the call written in `turn` (`<tool>{"name": ..., "args": {...}}</tool>`, the last one if
    /// there are several). Every failure is a message for the model: no call, malformed JSON, an unknown
    /// tool, the tool's own error, a timeout, a panic.
    pub fn call(&self, turn: &str) -> Result<String, String> {
        let json = last_tag(turn, "tool").ok_or(
            "no <tool> call found; write one as <tool>{\"name\": ..., \"args\": {...}}</tool>",
        )?;
        let call: Value = serde_json::from_str(json.trim())
            .map_err(|error| format!("the tool call is not valid JSON: {error}"))?;
        let name = call["name"]
            .as_str()
            .ok_or("the tool call needs a \"name\" string")?;
        let tool = self
            .tools
            .iter()
            .find(|tool| tool.name == name)
            .ok_or_else(|| {
                let known: Vec<&str> = self.tools.iter().map(|tool| tool.name.as_str()).collect();
                format!("unknown tool `{name}`; the tools are: {}", known.join(", "))
            })?;
        let args = call
            .get("args")
            .cloned()
            .unwrap_or(Value::Object(Default::default()));
        let handler = Arc::clone(&tool.handler);
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(&args)));
            let _ = sender.send(outcome);
        });
        match receiver.recv_timeout(self.timeout) {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(format!("tool `{name}` crashed")),
            Err(_) => Err(format!("tool `{name}` timed out after {:?}", self.timeout)),
        }
    }
}

/// The content of the last `<tag>...</tag>` in `text`; an unclosed last tag runs to the end.
pub(crate) fn last_tag<'t>(text: &'t str, tag: &str) -> Option<&'t str> {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let start = text.rfind(&open)? + open.len();
    let end = text[start..]
        .find(&close)
        .map_or(text.len(), |end| start + end);
    Some(&text[start..end])
}

fn tools_resource(args: &Args, holotype: &str) -> Result<Arc<Tools>, HolotypeError> {
    args.resources.get::<Tools>().ok_or_else(|| {
        HolotypeError::new(format!("{holotype} needs the environment's tools: give the rollout a `holo_runtime::holotypes::Tools` resource"))
    })
}

/// Writes the schemas of the registered tools, one JSON object per line, each ending with a newline.
pub struct ToolSchema {
    tools: Arc<Tools>,
}

impl Holotype for ToolSchema {
    const PARAMS: &'static [&'static str] = &[];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        args.no_positional("ToolSchema")?;
        Ok(ToolSchema {
            tools: tools_resource(args, "ToolSchema")?,
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        cx.inject(&format!("{}\n", self.tools.schema()));
        Ok(Enter::Run)
    }
}

/// `<|ToolExecutor turn|>`: runs the tool call in the variable `turn` and writes `<result>...</result>`
/// (an error message inside it when the call fails). When the turn holds an answer (`answer=` tag,
/// default `answer`) there is nothing to run: its body, if any, is skipped.
pub struct ToolExecutor {
    tools: Arc<Tools>,
    variable: String,
    answer: String,
}

impl Holotype for ToolExecutor {
    const PARAMS: &'static [&'static str] = &["answer"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        Ok(ToolExecutor {
            tools: tools_resource(args, "ToolExecutor")?,
            variable: args
                .positional_name("ToolExecutor")?
                .unwrap_or("turn")
                .to_string(),
            answer: args.name("answer")?.unwrap_or("answer").to_string(),
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        let turn = cx.var(&self.variable).unwrap_or_default();
        if turn.contains(&format!("<{}>", self.answer)) {
            return Ok(Enter::Skip);
        }
        let result = match self.tools.call(turn) {
            Ok(result) => result,
            Err(message) => format!("error: {message}"),
        };
        cx.inject(&format!("<result>{result}</result>"));
        Ok(Enter::Run)
    }
}

/// Repeats its body until the variable `var` (default `turn`) holds an answer (`<answer>`, or the tag
/// `answer=` names) or `max_turns` passes (default 8) have run.
pub struct ToolRunner {
    max_turns: u32,
    variable: String,
    answer: String,
}

impl Holotype for ToolRunner {
    const PARAMS: &'static [&'static str] = &["max_turns", "var", "answer"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        args.no_positional("ToolRunner")?;
        let max_turns = args.count("max_turns")?.unwrap_or(8);
        if max_turns == 0 {
            return Err(HolotypeError::new("max_turns must be at least 1"));
        }
        Ok(ToolRunner {
            max_turns,
            variable: args.name("var")?.unwrap_or("turn").to_string(),
            answer: args.name("answer")?.unwrap_or("answer").to_string(),
        })
    }

    fn end_pass(&mut self, cx: &mut Cx<'_>) -> Result<Pass, HolotypeError> {
        let answered = cx
            .var(&self.variable)
            .is_some_and(|turn| turn.contains(&format!("<{}>", self.answer)));
        Ok(if answered || cx.pass() >= self.max_turns {
            Pass::Done
        } else {
            Pass::Repeat
        })
    }
}

/// A recursive-descent evaluator for `+ - * /`, unary minus, parentheses and decimal numbers.
struct Arithmetic<'e> {
    text: &'e [u8],
    at: usize,
}

impl<'e> Arithmetic<'e> {
    fn new(expression: &'e str) -> Self {
        Arithmetic {
            text: expression.as_bytes(),
            at: 0,
        }
    }

    fn evaluate(mut self) -> Result<f64, String> {
        let value = self.sum()?;
        self.skip_spaces();
        if self.at < self.text.len() {
            return Err(format!(
                "unexpected `{}` at position {}",
                self.text[self.at] as char,
                self.at + 1
            ));
        }
        if !value.is_finite() {
            return Err("the result is not a finite number (division by zero?)".to_string());
        }
        Ok(value)
    }

    fn skip_spaces(&mut self) {
        while self.text.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_spaces();
        self.text.get(self.at).copied()
    }

    fn sum(&mut self) -> Result<f64, String> {
        let mut value = self.product()?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.at += 1;
            let right = self.product()?;
            value = if op == b'+' {
                value + right
            } else {
                value - right
            };
        }
        Ok(value)
    }

    fn product(&mut self) -> Result<f64, String> {
        let mut value = self.factor()?;
        while let Some(op @ (b'*' | b'/')) = self.peek() {
            self.at += 1;
            let right = self.factor()?;
            value = if op == b'*' {
                value * right
            } else {
                value / right
            };
        }
        Ok(value)
    }

    fn factor(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some(b'-') => {
                self.at += 1;
                Ok(-self.factor()?)
            }
            Some(b'(') => {
                self.at += 1;
                let value = self.sum()?;
                if self.peek() != Some(b')') {
                    return Err("missing `)`".to_string());
                }
                self.at += 1;
                Ok(value)
            }
            Some(c) if c.is_ascii_digit() || c == b'.' => {
                let start = self.at;
                while self
                    .text
                    .get(self.at)
                    .is_some_and(|c| c.is_ascii_digit() || *c == b'.')
                {
                    self.at += 1;
                }
                let number = std::str::from_utf8(&self.text[start..self.at]).unwrap_or_default();
                number
                    .parse()
                    .map_err(|_| format!("`{number}` is not a number"))
            }
            Some(c) => Err(format!(
                "unexpected `{}` at position {}",
                c as char,
                self.at + 1
            )),
            None => Err("the expression ends too early".to_string()),
        }
    }
}
