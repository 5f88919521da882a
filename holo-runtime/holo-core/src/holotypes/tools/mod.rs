//! Tool use: [`Tools`] (a registry of Rust functions with JSON schemas, provided as a resource),
//! [`ToolSchema`] (writes the schemas, or with `parser=` offers them to the chat template),
//! [`ToolExecutor`] (runs the calls of a turn) and [`ToolRunner`] (repeats its body until the model
//! answers).
//!
//! Tools are text by default: schemas in the prompt, calls in `<tool>` tags, results in `<result>`
//! tags (errloom's way, for any model). `<|ToolSchema parser=…|>` makes them native ([`native`]): the
//! schemas go to the model's chat template as `tools`, replies are read in the family's call format,
//! and each result is a `tool` message the template renders.

mod arithmetic;
mod native;
mod schema;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::holotype::{Args, Cx, Enter, Holotype, HolotypeError, Pass};
use crate::holotypes::stats::ToolStats;
use crate::tools::ToolFormat;
use arithmetic::Arithmetic;

type Handler = Arc<dyn Fn(&Value) -> Result<String, String> + Send + Sync>;

/// One tool: a name, a description and a JSON schema of its arguments, shown to the model, and the
/// function that runs it. The schema may be the shorthand `{"argument": "type", …}` (the calculator's),
/// which native calls read as an object whose every argument is required with that JSON type.
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

    /// The tools as chat templates take them (OpenAI's tool objects: `{"type": "function", "function":
    /// {"name", "description", "parameters"}}`), each `parameters` a JSON schema.
    pub fn native_schemas(&self) -> Vec<Value> {
        self.tools
            .iter()
            .map(|tool| {
                serde_json::json!({
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": schema::json_schema(&tool.parameters),
                    },
                })
            })
            .collect()
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
        let tool = self.find(name)?;
        let args = call
            .get("args")
            .cloned()
            .unwrap_or(Value::Object(Default::default()));
        self.run(tool, args).map_err(|failure| failure.message)
    }

    /// The tool named `name`, or an error for the model naming the tools there are.
    fn find(&self, name: &str) -> Result<&Tool, String> {
        self.tools
            .iter()
            .find(|tool| tool.name == name)
            .ok_or_else(|| {
                let known: Vec<&str> = self.tools.iter().map(|tool| tool.name.as_str()).collect();
                format!("unknown tool `{name}`; the tools are: {}", known.join(", "))
            })
    }

    /// Runs `tool` on `args` on a thread of its own, so that a timeout or a panic is reported rather
    /// than stalling or ending the rollout.
    fn run(&self, tool: &Tool, args: Value) -> Result<String, Failure> {
        let name = tool.name.clone();
        let handler = Arc::clone(&tool.handler);
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(&args)));
            let _ = sender.send(outcome);
        });
        match receiver.recv_timeout(self.timeout) {
            Ok(Ok(result)) => result.map_err(Failure::new),
            Ok(Err(_)) => Err(Failure::new(format!("tool `{name}` crashed"))),
            Err(_) => Err(Failure {
                message: format!("tool `{name}` timed out after {:?}", self.timeout),
                timed_out: true,
            }),
        }
    }
}

/// Why a tool run failed, in words for the model, and whether it ran out of time (for
/// `tools/timed_out`).
struct Failure {
    message: String,
    timed_out: bool,
}

impl Failure {
    fn new(message: String) -> Self {
        Failure {
            message,
            timed_out: false,
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
/// With `parser=` (a format's vLLM name, or `auto` for the one the chat template writes) it writes
/// nothing and offers the tools to the model's chat template instead: native tool calls.
pub struct ToolSchema {
    tools: Arc<Tools>,
    schemas: Schemas,
}

/// How [`ToolSchema`] shows the tools to the model.
enum Schemas {
    /// Written into the prompt.
    Text,
    /// Offered to the chat template, calls read in this format (`None`: the one the template writes).
    Native(Option<ToolFormat>),
}

impl Holotype for ToolSchema {
    const PARAMS: &'static [&'static str] = &["parser"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        args.no_positional("ToolSchema")?;
        let schemas = match args.name("parser")? {
            None => Schemas::Text,
            Some("auto") => Schemas::Native(None),
            Some(name) => {
                let format = ToolFormat::from_name(name).ok_or_else(|| {
                    let names: Vec<&str> =
                        ToolFormat::NAMES.iter().map(|(name, _)| *name).collect();
                    HolotypeError::new(format!(
                        "argument `parser` must be `auto` or one of {}, found `{name}`",
                        names.join(", ")
                    ))
                })?;
                Schemas::Native(Some(format))
            }
        };
        Ok(ToolSchema {
            tools: tools_resource(args, "ToolSchema")?,
            schemas,
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        match self.schemas {
            Schemas::Text => cx.inject(&format!("{}\n", self.tools.schema())),
            Schemas::Native(format) => {
                cx.offer_tools(&self.tools.native_schemas(), format)
                    .map_err(HolotypeError::new)?;
            }
        }
        Ok(Enter::Run)
    }
}

/// `<|ToolExecutor turn|>`: runs the tool call in the variable `turn` and writes `<result>...</result>`
/// (an error message inside it when the call fails). When the turn holds an answer (`answer=` tag,
/// default `answer`) there is nothing to run: its body, if any, is skipped.
///
/// With native tools offered (`<|ToolSchema parser=…|>`) it runs every call of the turn, read in the
/// offered format, and appends one `tool` message per call; a turn without a call is the model's
/// answer (its body is skipped); see `tools/native.rs`.
pub struct ToolExecutor {
    tools: Arc<Tools>,
    variable: String,
    answer: String,
    /// Counts native calls (calls, failed, timed out) when the driver provides it.
    stats: Option<Arc<ToolStats>>,
    /// The native calls of the rollout so far, which number their ids.
    calls: u64,
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
            stats: args.resources.get::<ToolStats>(),
            calls: 0,
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        let turn = cx.var(&self.variable).unwrap_or_default().to_string();
        if let Some(format) = cx.tool_format() {
            return Ok(native::execute(
                &self.tools,
                self.stats.as_deref(),
                format,
                &turn,
                &mut self.calls,
                cx,
            ));
        }
        if turn.contains(&format!("<{}>", self.answer)) {
            return Ok(Enter::Skip);
        }
        let result = match self.tools.call(&turn) {
            Ok(result) => result,
            Err(message) => format!("error: {message}"),
        };
        cx.inject(&format!("<result>{result}</result>"));
        Ok(Enter::Run)
    }
}

/// Repeats its body until the variable `var` (default `turn`) holds an answer (`<answer>`, or the tag
/// `answer=` names) or `max_turns` passes (default 8) have run. With native tools offered, the answer
/// is a turn that starts no call (a malformed call is answered with what was wrong, and the loop goes
/// on).
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
        let turn = cx.var(&self.variable).unwrap_or_default();
        let answered = match cx.tool_format() {
            Some(format) => matches!(format.read(&cx.written(turn)), Ok(None)),
            None => turn.contains(&format!("<{}>", self.answer)),
        };
        Ok(if answered || cx.pass() >= self.max_turns {
            Pass::Done
        } else {
            Pass::Repeat
        })
    }
}
