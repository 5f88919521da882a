//! The IR: a checked holoware as a flat state machine, the form that codegen and the runtime's
//! interpreter consume.
//!
//! A [`Program`] is a list of [`Op`]s executed from index 0 with a program counter. Every op but the two
//! holotype ops moves to the next one. Holotype ops decide control flow at run time:
//!
//! - [`OpKind::Holotype`] calls the instance's hook; when the instance has a body (`body_end` is set) the
//!   hook chooses to run it (continue at the next op) or skip it (continue after the `EndBody` at
//!   `body_end`), or to stop the rollout.
//! - [`OpKind::EndBody`] asks the instance whether to repeat the body (jump to `body_start`) or to go on.
//!
//! Message semantics: [`OpKind::Context`] starts a new context (a separate conversation) whose role is
//! system until the first [`OpKind::Role`]; `Role` starts a new message of that role; text, inserts and
//! holotype output append to the current message; [`OpKind::Sample`] appends the model's completion to
//! the current message when it is an assistant message, and otherwise first starts an assistant message.

use std::fmt;

use serde::{Deserialize, Serialize};

pub use crate::ast::Role;
use crate::span::Span;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// Variables that no sampler binds: the data each rollout needs, in order of first use.
    pub inputs: Vec<Input>,
    /// Variables bound by samplers, in order of first binding.
    pub bindings: Vec<Binding>,
    /// One entry per holotype tag in the file; ops refer to them by index.
    pub holotypes: Vec<HolotypeInstance>,
    pub ops: Vec<Op>,
    /// The files the checker read besides the source (a sampler's `json_schema_file`), whose text the
    /// program holds: a build that embeds the program rebuilds when one changes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub read: Vec<std::path::PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Input {
    pub name: String,
    /// False when every use offers an alternative (`<|name|other|>` or `<|name|"default"|>`).
    pub required: bool,
    pub uses: Vec<Span>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Binding {
    pub name: String,
    /// Indices of the `Sample` ops that bind it.
    pub samplers: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HolotypeInstance {
    pub name: String,
    pub args: Vec<HolotypeArg>,
    pub span: Span,
    /// Index of the `Holotype` op that enters this instance.
    pub op: usize,
    /// Whether the name is the runtime's built-in (`holo_runtime::holotypes`), because nothing of the
    /// crate's shadows it.
    #[serde(default)]
    pub builtin: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HolotypeArg {
    /// `None` for a positional argument.
    pub name: Option<String>,
    pub value: ArgValue,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "lowercase")]
pub enum ArgValue {
    /// An unquoted word.
    Word(String),
    Int(i64),
    Float(f64),
    /// A quoted string.
    Str(String),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Op {
    pub kind: OpKind,
    pub span: Span,
}

/// A chat template argument of a context (transformers' `apply_chat_template(**kwargs)`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateArgument {
    pub name: String,
    pub value: TemplateValue,
}

/// A template argument's value: `true`/`false`, a number, or text (a quoted string or another word).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TemplateValue {
    Bool(bool),
    Number(f64),
    Text(String),
}

impl std::fmt::Display for TemplateValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TemplateValue::Bool(value) => write!(f, "{value}"),
            TemplateValue::Number(value) => write!(f, "{value}"),
            TemplateValue::Text(text) => write!(f, "{text:?}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpKind {
    /// Start a new context; trained contexts contribute their sampled tokens to the loss. `template`:
    /// the chat template's arguments for this context (`<|+++ enable_thinking=false|>`), as written.
    Context {
        trained: bool,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        template: Vec<TemplateArgument>,
    },
    /// Start a new message of `role`.
    Role { role: Role },
    /// Append literal text to the current message.
    Text { text: String },
    /// Append the first present alternative. A variable is absent when the data row lacks it (inputs)
    /// or no sampler has bound it yet; a literal is always present. When every alternative is absent
    /// the rollout cannot be rendered: the runtime rejects the data row, naming the row and the
    /// variables, before it starts.
    Insert { alternatives: Vec<Source> },
    /// Ask the model to continue the current assistant message (starting one if the current message has
    /// another role).
    Sample(Sample),
    /// Enter holotype `instance`; `body_end` is the index of its `EndBody` op when it has a body.
    Holotype {
        instance: usize,
        body_end: Option<usize>,
    },
    /// End of the body of `instance`, whose first op is at `body_start`.
    EndBody { instance: usize, body_start: usize },
}

/// One alternative of an insert; serialized as `{"variable": "name"}` or `{"literal": "text"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Variable(String),
    Literal(String),
}

/// A sample request: generation arguments left `None` take the sampler's defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The variable that receives the sampled text (inside the fence, when there is one).
    pub binding: Option<String>,
    /// `think` for `<>think`: the runtime writes `<think>`, the model generates until `</think>`.
    pub fence: Option<String>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u32>,
    pub stop: Vec<String>,
    /// What the sampled text must match (constrained decoding), from the tag's `json`, `json_schema`,
    /// `regex`, `choice` or `grammar` argument.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constraint: Option<Constraint>,
    /// `json_schema=name`, `regex=name` or `grammar=name`: the variable whose value, when the sampler
    /// runs, is the schema, regular expression or grammar the text is held to (a data row's column, or
    /// an earlier sampler's text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constraint_variable: Option<ConstraintVariable>,
}

/// A sampler constraint whose text a variable holds: `regex=pattern` reads the regular expression from
/// `pattern` when the sampler runs. The runtime checks the value and lowers it as the checker lowers the
/// same text written in the tag ([`ConstraintArgument::constraint`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConstraintVariable {
    pub argument: ConstraintArgument,
    /// The variable's name.
    pub name: String,
}

/// The sampler arguments whose text a variable can give.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConstraintArgument {
    JsonSchema,
    Regex,
    Grammar,
}

impl ConstraintArgument {
    /// The argument as written in a tag.
    pub fn name(self) -> &'static str {
        match self {
            ConstraintArgument::JsonSchema => "json_schema",
            ConstraintArgument::Regex => "regex",
            ConstraintArgument::Grammar => "grammar",
        }
    }

    /// What its text is, for messages.
    pub fn what(self) -> &'static str {
        match self {
            ConstraintArgument::JsonSchema => "a JSON schema",
            ConstraintArgument::Regex => "a regular expression",
            ConstraintArgument::Grammar => "a Lark grammar",
        }
    }

    /// The constraint of this argument given `text`, in `fence` (followed by its closing tag) when the
    /// sampler has one, exactly as for the same text written in the tag; or why `text` is not what the
    /// argument takes, by the checks the checker makes of written text ([`schema_problem`],
    /// [`regex_problem`], a grammar not empty). What only a sampler can refuse (a schema's external
    /// `$ref`, a grammar's undefined rule) it refuses when it compiles the constraint.
    pub fn constraint(self, text: &str, fence: Option<&str>) -> Result<Constraint, String> {
        let constraint = match self {
            ConstraintArgument::JsonSchema => match schema_problem(text) {
                None => Constraint::JsonSchema(text.to_string()),
                Some(problem) => return Err(problem),
            },
            ConstraintArgument::Regex => match regex_problem(text) {
                None => Constraint::Regex(text.to_string()),
                Some(problem) => return Err(problem),
            },
            ConstraintArgument::Grammar if text.trim().is_empty() => {
                return Err("the text is empty".into())
            }
            ConstraintArgument::Grammar => Constraint::Grammar(text.to_string()),
        };
        Ok(match fence {
            Some(fence) => constraint.fenced(fence),
            None => constraint,
        })
    }
}

/// A sampler's constraint as written; the runtime turns it into its `Constraint` and the sampler
/// enforces it token by token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// `json=object`: any JSON object.
    JsonObject,
    /// `json_schema="{...}"`: JSON valid under the schema, held as the JSON text the tag gave (checked
    /// to parse as a JSON object or boolean).
    JsonSchema(String),
    /// `regex="..."`: text the regular expression matches whole (checked to parse).
    Regex(String),
    /// `choice=a choice=b`: one of these texts exactly.
    Choice(Vec<String>),
    /// `grammar="..."`: a Lark grammar as llguidance reads it (checked when the sampler compiles it,
    /// before any rollout).
    Grammar(String),
}

impl Constraint {
    /// The constraint on a fenced sampler's text, which ends with the closing tag `</fence>`: this
    /// constraint's text, then the tag, as a Lark grammar. The grammar decides where the text ends, so a
    /// closing tag inside it (in a JSON string, in a regex's or choice's text, in a grammar's sentence)
    /// is text and does not end the fence.
    ///
    /// A regex or choice becomes one terminal with the tag (llguidance's lexemes are greedy: written as
    /// two, a regex that can go on with `<`, such as `.*`, would never let the tag start); JSON is a
    /// nested grammar whose end its own syntax marks; a Lark grammar is nested whole (`%lark { ... }`),
    /// so its rule names, its `start` included, stay its own.
    pub fn fenced(&self, fence: &str) -> Constraint {
        let literal = |text: &str| serde_json::Value::from(text).to_string();
        let close = literal(&format!("</{fence}>"));
        let terminal = |inner: String| format!("{FENCED_TERMINAL}{inner} {close}\n");
        Constraint::Grammar(match self {
            Constraint::JsonObject => {
                let schema = json_layout(serde_json::json!({"type": "object"}));
                format!("{FENCED_JSON}{schema} {close}\n")
            }
            Constraint::JsonSchema(text) => match serde_json::from_str(text) {
                Ok(schema) => format!("{FENCED_JSON}{} {close}\n", json_layout(schema)),
                // Checked to parse before it gets here; llguidance says what is wrong otherwise.
                Err(_) => format!("{FENCED_JSON}{text} {close}\n"),
            },
            Constraint::Regex(regex) => terminal(format!("/{}/", lark_regex(regex))),
            Constraint::Choice(choices) => {
                let choices: Vec<String> = choices.iter().map(|choice| literal(choice)).collect();
                terminal(format!("({})", choices.join(" | ")))
            }
            // The newline before `}` ends a comment on the grammar's last line.
            Constraint::Grammar(grammar) => format!("{FENCED_LARK}{grammar}\n}} {close}\n"),
        })
    }
}

/// How each of [`Constraint::fenced`]'s three forms of grammar begins: JSON, a terminal (a regex or a
/// choice), a nested Lark grammar.
const FENCED_JSON: &str = "start: %json ";
const FENCED_TERMINAL: &str = "start: FENCED\nFENCED: ";
const FENCED_LARK: &str = "start: %lark {\n";

/// Whether `grammar` is one that [`Constraint::fenced`] wrote for a fence whose closing tag is `close`
/// (`</answer>`): a constraint on the text inside the fence, then the tag, so that every sentence of
/// it ends with the tag. A server that checks stop strings on the text whatever the grammar (vLLM)
/// needs no stop string to end such a reply: its structured output ends the sequence where the
/// grammar is complete.
pub fn is_fenced(grammar: &str, close: &str) -> bool {
    let literal = serde_json::Value::from(close).to_string();
    grammar
        .strip_suffix(&format!(" {literal}\n"))
        .is_some_and(|head| {
            head.starts_with(FENCED_JSON)
                || head.starts_with(FENCED_TERMINAL)
                || (head.starts_with(FENCED_LARK) && head.ends_with("\n}"))
        })
}

/// Why `text` is not a JSON schema, if it is not: JSON that parses, and an object or a boolean (JSON
/// Schema's two forms). What a sampler cannot compile beyond that (an external `$ref`) is refused when
/// the sampler compiles it.
pub fn schema_problem(text: &str) -> Option<String> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(_) | serde_json::Value::Bool(_)) => None,
        Ok(_) => Some("a schema is a JSON object or a boolean".into()),
        Err(error) => Some(format!("not JSON: {error}")),
    }
}

/// Why `text` is not a regular expression, if it is not: regex-syntax, whose syntax llguidance reads,
/// refuses to parse it.
pub fn regex_problem(text: &str) -> Option<String> {
    regex_syntax::Parser::new()
        .parse(text)
        .err()
        .map(|error| error.to_string())
}

/// `schema` with Python's `json.dumps` layout (`", "` between items, `": "` after keys, no other
/// whitespace) unless it sets its own (llguidance's `x-guidance`): the JSON a constrained reply is held
/// to. llguidance's default lets whitespace run between any two tokens, and a model that keeps choosing
/// it never closes its object.
pub fn json_layout(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "item_separator": ", ",
                "key_separator": ": ",
                "whitespace_flexible": false,
            })
        });
    }
    schema
}

/// `regex` as the body of a Lark `/.../` literal: each `/` that is not already escaped gets a
/// backslash (llguidance reads `\/` as `/`).
fn lark_regex(regex: &str) -> String {
    let mut body = String::with_capacity(regex.len());
    let mut chars = regex.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                body.push(c);
                body.extend(chars.next());
            }
            '/' => body.push_str("\\/"),
            c => body.push(c),
        }
    }
    body
}

impl fmt::Display for Program {
    /// A readable listing: inputs, bindings, then one line per op.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for input in &self.inputs {
            let need = if input.required {
                "required"
            } else {
                "optional"
            };
            writeln!(
                f,
                "input {} ({need}, {} uses)",
                input.name,
                input.uses.len()
            )?;
        }
        for binding in &self.bindings {
            let ops: Vec<String> = binding.samplers.iter().map(|op| format!("#{op}")).collect();
            writeln!(f, "binding {} (by {})", binding.name, ops.join(", "))?;
        }
        for (index, op) in self.ops.iter().enumerate() {
            let at = format!("{}:{}", op.span.start.line, op.span.start.col);
            write!(f, "{index:>4} {at:>7}  ")?;
            match &op.kind {
                OpKind::Context { trained, template } => {
                    let arguments: String = template
                        .iter()
                        .map(|argument| format!(" {}={}", argument.name, argument.value))
                        .collect();
                    writeln!(
                        f,
                        "context {}{arguments}",
                        if *trained { "trained" } else { "untrained" }
                    )?
                }
                OpKind::Role { role } => writeln!(f, "role {}", role.name())?,
                OpKind::Text { text } => writeln!(f, "text {text:?}")?,
                OpKind::Insert { alternatives } => {
                    let shown: Vec<String> = alternatives
                        .iter()
                        .map(|source| match source {
                            Source::Variable(name) => name.clone(),
                            Source::Literal(text) => format!("{text:?}"),
                        })
                        .collect();
                    writeln!(f, "insert {}", shown.join(" | "))?
                }
                OpKind::Sample(sample) => writeln!(f, "sample{}", SampleArgs(sample))?,
                OpKind::Holotype { instance, body_end } => {
                    let holotype = &self.holotypes[*instance];
                    write!(f, "holotype {} #{instance}", holotype.name)?;
                    for arg in &holotype.args {
                        match &arg.name {
                            Some(name) => write!(f, " {name}={}", arg.value)?,
                            None => write!(f, " {}", arg.value)?,
                        }
                    }
                    match body_end {
                        Some(end) => writeln!(f, " body..#{end}")?,
                        None => writeln!(f)?,
                    }
                }
                OpKind::EndBody {
                    instance,
                    body_start,
                } => writeln!(
                    f,
                    "end {} #{instance} repeat->#{body_start}",
                    self.holotypes[*instance].name
                )?,
            }
        }
        Ok(())
    }
}

struct SampleArgs<'a>(&'a Sample);

impl fmt::Display for SampleArgs<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sample = self.0;
        if let Some(binding) = &sample.binding {
            write!(f, " -> {binding}")?;
        }
        if let Some(fence) = &sample.fence {
            write!(f, " <>{fence}")?;
        }
        if let Some(max_tokens) = sample.max_tokens {
            write!(f, " max_tokens={max_tokens}")?;
        }
        if let Some(temperature) = sample.temperature {
            write!(f, " temperature={temperature}")?;
        }
        if let Some(top_p) = sample.top_p {
            write!(f, " top_p={top_p}")?;
        }
        if let Some(top_k) = sample.top_k {
            write!(f, " top_k={top_k}")?;
        }
        for stop in &sample.stop {
            write!(f, " stop={stop:?}")?;
        }
        match &sample.constraint {
            None => {}
            Some(Constraint::JsonObject) => write!(f, " json=object")?,
            Some(Constraint::JsonSchema(schema)) => write!(f, " json_schema={schema:?}")?,
            Some(Constraint::Regex(regex)) => write!(f, " regex={regex:?}")?,
            Some(Constraint::Choice(choices)) => {
                for choice in choices {
                    write!(f, " choice={choice:?}")?;
                }
            }
            Some(Constraint::Grammar(grammar)) => write!(f, " grammar={grammar:?}")?,
        }
        if let Some(variable) = &sample.constraint_variable {
            write!(f, " {}={}", variable.argument.name(), variable.name)?;
        }
        Ok(())
    }
}

impl fmt::Display for ArgValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgValue::Word(word) => f.write_str(word),
            ArgValue::Int(int) => write!(f, "{int}"),
            ArgValue::Float(float) => write!(f, "{float:?}"),
            ArgValue::Str(text) => write!(f, "{text:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every form a fence wraps is recognized with its own closing tag, and nothing else is.
    #[test]
    fn fenced_grammars_are_recognized_by_their_closing_tag() {
        let constraints = [
            Constraint::JsonObject,
            Constraint::JsonSchema(r#"{"enum": ["</answer>"]}"#.into()),
            Constraint::Regex("[0-9]+".into()),
            Constraint::Choice(vec!["a | b".into(), "c".into()]),
            Constraint::Grammar("start: X\nX: /[a-z]+/ # a comment".into()),
        ];
        for constraint in &constraints {
            let Constraint::Grammar(grammar) = constraint.fenced("answer") else {
                unreachable!("a fence makes a grammar")
            };
            assert!(is_fenced(&grammar, "</answer>"), "{grammar}");
            assert!(!is_fenced(&grammar, "</other>"), "{grammar}");
        }
        // A grammar written in a tag that ends with the tag is not one a fence wrote.
        assert!(!is_fenced(
            "start: \"a\" | \"b\" \"</answer>\"\n",
            "</answer>"
        ));
    }
}
