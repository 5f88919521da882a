//! Semantic checks and lowering: [`crate::ast::Document`] → [`crate::ir::Program`].
//!
//! Checks sampler and tag arguments, variables bound before use in execution order (bodies may run zero
//! or many times), holotype names against the known set; lowers to the flat IR, inserting the implicit
//! first context and trimming layout newlines at message boundaries (docs/holoware.md, "Whitespace").

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::ast::{self, Alternative, Arg, Body, Document, Head, Node, Role, Tag, Value};
use crate::builtins::{self, Problem, BUILTINS};
use crate::diagnostics::{Code, Diagnostic};
use crate::ir::{
    regex_problem, schema_problem, ArgValue, Binding, Constraint, ConstraintArgument,
    ConstraintVariable, HolotypeArg, HolotypeInstance, Input, Op, OpKind, Program, Sample, Source,
    TemplateArgument, TemplateValue,
};
use crate::scan::{CrateScan, Resolution};
use crate::span::{Span, Spanned};

/// The generation arguments a sampler accepts.
pub const SAMPLER_ARGUMENTS: [&str; 11] = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "json",
    "json_schema",
    "json_schema_file",
    "regex",
    "choice",
    "grammar",
];

/// The sampler arguments that constrain the sampled text; a sampler takes one of them (`choice`
/// repeated counts as one).
const CONSTRAINTS: [&str; 6] = [
    "json",
    "json_schema",
    "json_schema_file",
    "regex",
    "choice",
    "grammar",
];

/// The sampler arguments that may be repeated, each giving one more value.
const REPEATABLE: [&str; 2] = ["stop", "choice"];

/// [`BUILTINS`] in the form [`Options::builtin_holotypes`] takes: each name with its keyword parameters.
pub fn builtin_holotypes() -> BTreeMap<String, Option<Vec<String>>> {
    BUILTINS
        .iter()
        .map(|builtin| {
            let params = builtin
                .params
                .iter()
                .map(|param| param.name.to_string())
                .collect();
            (builtin.name.to_string(), Some(params))
        })
        .collect()
}

/// What the checker knows beyond the file itself.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Holotypes that always resolve (the runtime's built-ins), with their keyword parameters when known.
    pub builtin_holotypes: BTreeMap<String, Option<Vec<String>>>,
    /// The scan of the crate the file belongs to. Without one, holotypes that are not built-ins are only
    /// warned about (H0100); with one, an unknown holotype or argument is an error.
    pub scan: Option<CrateScan>,
    /// Whether a name that resolves to a built-in is the runtime's own holotype, whose argument values
    /// the checker then checks against [`BUILTINS`] (H0029, H0030). An interpreter's registry may
    /// register other types under those names, and checks its arguments by constructing them instead.
    pub check_builtin_arguments: bool,
    /// The folder of the file compiled, which a sampler's `json_schema_file` path is relative to; the
    /// file is read at compile time, so a program embeds the schema itself. `None` for text that comes
    /// from no file, where such an argument is an error.
    pub dir: Option<PathBuf>,
}

impl Options {
    /// The runtime's built-in holotypes, and the scan of a crate when there is one.
    pub fn with_builtins(scan: Option<CrateScan>) -> Self {
        Options {
            builtin_holotypes: builtin_holotypes(),
            scan,
            check_builtin_arguments: true,
            dir: None,
        }
    }

    /// These options for the file at `file`: its folder as [`Options::dir`].
    pub fn for_file(&self, file: &Path) -> Self {
        Options {
            dir: file.parent().map(Path::to_path_buf),
            ..self.clone()
        }
    }
}

/// Checks a parsed document and lowers it to IR. The program is `None` when there are errors.
pub fn analyze(document: &Document, options: &Options) -> (Option<Program>, Vec<Diagnostic>) {
    let mut bound_anywhere = HashMap::new();
    collect_bindings(&document.nodes, &mut |name, span| {
        bound_anywhere.entry(name.to_string()).or_insert(span);
    });
    let mut lowering = Lowering {
        options,
        bound_anywhere,
        ops: Vec::new(),
        diagnostics: Vec::new(),
        definitely: HashSet::new(),
        definitely_log: Vec::new(),
        possibly: HashSet::new(),
        role: None,
        in_context: false,
        inputs: Vec::new(),
        input_index: HashMap::new(),
        bindings: Vec::new(),
        binding_index: HashMap::new(),
        holotypes: Vec::new(),
        unresolved: HashSet::new(),
        read: Vec::new(),
    };
    lowering.nodes(&document.nodes);
    lowering.trim_message_end();
    let Lowering {
        ops,
        mut diagnostics,
        inputs,
        bindings,
        holotypes,
        read,
        ..
    } = lowering;
    diagnostics.sort_by_key(|diagnostic| diagnostic.span().start);
    if diagnostics.iter().any(Diagnostic::is_error) {
        return (None, diagnostics);
    }
    let program = Program {
        inputs,
        bindings,
        holotypes,
        ops,
        read,
    };
    (Some(program), diagnostics)
}

/// Calls `found` for every well-formed sampler binding, bodies included.
fn collect_bindings(nodes: &[Node], found: &mut impl FnMut(&str, Span)) {
    for node in nodes {
        let Node::Tag(tag) = node else { continue };
        if let Head::Role {
            role,
            binding: Some(binding),
        } = &tag.node.head
        {
            if role.node == Role::Assistant && ast::is_variable_name(&binding.node) {
                found(&binding.node, binding.span);
            }
        }
        if let Some(body) = &tag.node.body {
            collect_bindings(&body.nodes, found);
        }
    }
}

/// Whether executing `nodes` can change the current role.
fn changes_role(nodes: &[Node]) -> bool {
    nodes.iter().any(|node| match node {
        Node::Text(_) => false,
        Node::Tag(tag) => {
            matches!(tag.node.head, Head::Role { .. } | Head::Context(_))
                || tag
                    .node
                    .body
                    .as_ref()
                    .is_some_and(|body| changes_role(&body.nodes))
        }
    })
}

/// Whether running `nodes` with the current message of role `role` starts a new message before any
/// content: a role tag, a context marker, or a sampler after a message that is not the assistant's.
fn starts_message(nodes: &[Node], role: Option<Role>) -> bool {
    let first = nodes.iter().find(|node| match node {
        Node::Text(text) => !text.node.trim().is_empty(),
        Node::Tag(_) => true,
    });
    let Some(Node::Tag(tag)) = first else {
        return false;
    };
    match &tag.node.head {
        Head::Context(_) => true,
        Head::Role {
            role: tag_role,
            binding,
        } => {
            let sampler = binding.is_some() || !tag.node.args.is_empty();
            // As for a sampler outside a body: only a role known to differ makes a boundary.
            !sampler
                || (tag_role.node == Role::Assistant
                    && role.is_some_and(|role| role != Role::Assistant))
        }
        Head::Holotype(_) => tag
            .node
            .body
            .as_ref()
            .is_some_and(|body| starts_message(&body.nodes, role)),
        Head::Value(_) | Head::Close(_) => false,
    }
}

/// How a holotype name resolved: its keyword parameters when known, and whether it is the runtime's
/// built-in.
struct Resolved {
    params: Option<Vec<String>>,
    builtin: bool,
}

impl Resolved {
    fn local(params: Option<Vec<String>>) -> Self {
        Resolved {
            params,
            builtin: false,
        }
    }
}

struct Lowering<'a> {
    options: &'a Options,
    /// Every variable some sampler binds, with its first binding.
    bound_anywhere: HashMap<String, Span>,
    ops: Vec<Op>,
    diagnostics: Vec<Diagnostic>,
    /// Variables bound on every path to the current point.
    definitely: HashSet<String>,
    /// Names in the order they entered `definitely`, so leaving a body can undo what it added.
    definitely_log: Vec<String>,
    /// Variables bound on some path to the current point (later iterations of enclosing bodies too).
    possibly: HashSet<String>,
    /// The role of the current message when it is known statically.
    role: Option<Role>,
    in_context: bool,
    inputs: Vec<Input>,
    input_index: HashMap<String, usize>,
    bindings: Vec<Binding>,
    binding_index: HashMap<String, usize>,
    holotypes: Vec<HolotypeInstance>,
    unresolved: HashSet<String>,
    /// The schema files read, for [`Program::read`].
    read: Vec<PathBuf>,
}

impl Lowering<'_> {
    fn nodes(&mut self, nodes: &[Node]) {
        for node in nodes {
            match node {
                Node::Text(text) => self.text(text),
                Node::Tag(tag) => self.tag(&tag.node, tag.span),
            }
        }
    }

    fn error(&mut self, diagnostic: Diagnostic) {
        self.diagnostics.push(diagnostic);
    }

    fn push(&mut self, kind: OpKind, span: Span) -> usize {
        self.ops.push(Op { kind, span });
        self.ops.len() - 1
    }

    /// Content outside any context opens the implicit first context, which is trained.
    fn ensure_context(&mut self, span: Span) {
        if !self.in_context {
            self.in_context = true;
            self.role = Some(Role::System);
            let at = Span {
                start: span.start,
                end: span.start,
            };
            self.push(
                OpKind::Context {
                    trained: true,
                    template: Vec::new(),
                },
                at,
            );
        }
    }

    /// Starts a message: the newlines that end the previous one are layout, not content.
    fn boundary(&mut self, kind: OpKind, span: Span) {
        self.trim_message_end();
        self.push(kind, span);
    }

    fn trim_message_end(&mut self) {
        if let Some(Op {
            kind: OpKind::Text { text },
            ..
        }) = self.ops.last_mut()
        {
            text.truncate(text.trim_end_matches('\n').len());
            if text.is_empty() {
                self.ops.pop();
            }
        }
    }

    fn text(&mut self, text: &Spanned<String>) {
        if let Some(Op {
            kind: OpKind::Text { text: previous },
            span,
        }) = self.ops.last_mut()
        {
            previous.push_str(&text.node);
            *span = span.to(text.span);
            return;
        }
        let at_message_start = match self.ops.last() {
            None => true,
            Some(op) => matches!(op.kind, OpKind::Context { .. } | OpKind::Role { .. }),
        };
        let content = if at_message_start {
            text.node.trim_start_matches('\n')
        } else {
            text.node.as_str()
        };
        if content.is_empty() {
            return;
        }
        self.ensure_context(text.span);
        self.push(
            OpKind::Text {
                text: content.to_string(),
            },
            text.span,
        );
    }

    fn tag(&mut self, tag: &Tag, span: Span) {
        match &tag.head {
            Head::Context(marker) => {
                let template = self.template_arguments(tag, marker.node.marker);
                self.in_context = true;
                self.role = Some(Role::System);
                self.boundary(
                    OpKind::Context {
                        trained: marker.node.trained(),
                        template,
                    },
                    span,
                );
            }
            Head::Role { role, binding } => self.role_tag(tag, role, binding.as_ref(), span),
            Head::Holotype(name) => self.holotype(tag, name, span),
            Head::Value(alternatives) => self.insert(tag, alternatives, span),
            Head::Close(_) => unreachable!("the parser attaches closing tags to bodies"),
        }
    }

    /// A context marker's arguments: the chat template's, `name=value` each, once each.
    fn template_arguments(&mut self, tag: &Tag, marker: &str) -> Vec<TemplateArgument> {
        let mut arguments = Vec::new();
        let mut seen: HashMap<String, Span> = HashMap::new();
        for arg in &tag.args {
            let Arg::Keyword { name, value } = &arg.node else {
                self.error(
                    Diagnostic::new(
                        Code::UnexpectedArguments,
                        "a context marker takes only chat template arguments",
                        arg.span,
                        "not `name=value`",
                    )
                    .with_help(format!(
                        "write `<|{marker} enable_thinking=false|>`, or `<|{marker}|>`"
                    )),
                );
                continue;
            };
            if let Some(first) = seen.insert(name.node.clone(), name.span) {
                self.given_twice(&name.node, name.span, first);
                continue;
            }
            let value = match &value.node {
                Value::Word(word) if word == "true" => TemplateValue::Bool(true),
                Value::Word(word) if word == "false" => TemplateValue::Bool(false),
                Value::Number(number) => match number.parse::<f64>() {
                    Ok(number) if number.is_finite() => TemplateValue::Number(number),
                    _ => {
                        self.error(Diagnostic::new(
                            Code::UnexpectedArguments,
                            format!("`{number}` is not a finite number"),
                            value.span,
                            "a template argument's number",
                        ));
                        continue;
                    }
                },
                Value::Word(text) | Value::Str(text) => TemplateValue::Text(text.clone()),
            };
            arguments.push(TemplateArgument {
                name: name.node.clone(),
                value,
            });
        }
        arguments
    }

    /// H0017: argument `name` given again at `again`, first at `first`.
    fn given_twice(&mut self, name: &str, again: Span, first: Span) {
        self.error(
            Diagnostic::new(
                Code::DuplicateArgument,
                format!("`{name}` is given twice"),
                again,
                "given again here",
            )
            .with_secondary(first, "first given here")
            .with_help("keep one of them"),
        );
    }

    fn no_arguments(&mut self, tag: &Tag, what: &str, written: &str) {
        if let Some(first) = tag.args.first() {
            let span = first.span.to(tag.args.last().expect("non-empty").span);
            self.error(
                Diagnostic::new(
                    Code::UnexpectedArguments,
                    format!("{what} takes no arguments"),
                    span,
                    "unexpected arguments",
                )
                .with_help(format!("write `{written}`")),
            );
        }
    }

    fn role_tag(
        &mut self,
        tag: &Tag,
        role: &Spanned<Role>,
        binding: Option<&Spanned<String>>,
        span: Span,
    ) {
        let is_sampler = binding.is_some() || !tag.args.is_empty();
        if !is_sampler {
            self.ensure_context(span);
            self.role = Some(role.node);
            self.boundary(OpKind::Role { role: role.node }, span);
            return;
        }
        if role.node != Role::Assistant {
            let fence = tag
                .args
                .iter()
                .find(|arg| matches!(arg.node, Arg::Fence(_)));
            let generation = tag.args.iter().find(|arg| {
                matches!(&arg.node, Arg::Keyword { name, .. } if SAMPLER_ARGUMENTS.contains(&name.node.as_str()))
            });
            let what = match (binding, fence, generation) {
                (Some(binding), _, _) => (binding.span, "a binding"),
                (None, Some(fence), _) => (fence.span, "a fence"),
                (None, None, Some(argument)) => (argument.span, "a generation argument"),
                (None, None, None) => {
                    let glyph = role.node.glyph();
                    self.no_arguments(tag, "a role switch", &format!("<|{glyph}|>"));
                    return;
                }
            };
            self.error(
                Diagnostic::new(
                    Code::SamplerRole,
                    format!("the {} role cannot be sampled", role.node.name()),
                    what.0,
                    format!("{} makes this tag a sampler", what.1),
                )
                .with_secondary(role.span, format!("`{}` is the {} role", role.node.glyph(), role.node.name()))
                .with_help(format!(
                    "only the assistant samples: write `<|@_@...|>`, or `<|{}|>` to switch to the {} role",
                    role.node.glyph(),
                    role.node.name()
                )),
            );
            return;
        }
        let sample = self.sample_arguments(tag, binding);
        self.ensure_context(span);
        if self.role.is_some_and(|role| role != Role::Assistant) {
            // The sample starts an assistant message, so the previous message ends here.
            self.trim_message_end();
        }
        self.role = Some(Role::Assistant);
        let index = self.push(OpKind::Sample(sample.clone()), span);
        if let Some(name) = &sample.binding {
            if self.definitely.insert(name.clone()) {
                self.definitely_log.push(name.clone());
            }
            self.possibly.insert(name.clone());
            match self.binding_index.get(name) {
                Some(&at) => self.bindings[at].samplers.push(index),
                None => {
                    self.binding_index.insert(name.clone(), self.bindings.len());
                    self.bindings.push(Binding {
                        name: name.clone(),
                        samplers: vec![index],
                    });
                }
            }
        }
    }

    fn sample_arguments(&mut self, tag: &Tag, binding: Option<&Spanned<String>>) -> Sample {
        let mut sample = Sample::default();
        if let Some(binding) = binding {
            if ast::is_variable_name(&binding.node) {
                sample.binding = Some(binding.node.clone());
            } else {
                let reason = if ast::is_identifier(&binding.node) {
                    "starts with an uppercase letter, which names a holotype"
                } else {
                    "is not an identifier"
                };
                self.error(
                    Diagnostic::new(
                        Code::InvalidBinding,
                        format!("binding name `{}` {reason}", binding.node),
                        binding.span,
                        "not a variable name",
                    )
                    .with_help(format!(
                        "name the variable with lowercase letters, digits and `_`, such as `{}`",
                        ast::to_snake_identifier(&binding.node)
                    )),
                );
            }
        }
        let mut fence_span: Option<Span> = None;
        let mut seen: HashMap<&str, Span> = HashMap::new();
        // The first constraint argument: its name and where it is.
        let mut constrained: Option<(&str, Span)> = None;
        for arg in &tag.args {
            match &arg.node {
                Arg::Fence(name) => {
                    if let Some(first) = fence_span {
                        self.error(
                            Diagnostic::new(
                                Code::MultipleFences,
                                "a sampler takes one fence",
                                arg.span,
                                "second fence",
                            )
                            .with_secondary(first, "first fence")
                            .with_help("remove one of the fences"),
                        );
                        continue;
                    }
                    fence_span = Some(arg.span);
                    if ast::is_identifier(&name.node) {
                        sample.fence = Some(name.node.clone());
                    } else {
                        self.error(
                            Diagnostic::new(
                                Code::InvalidFence,
                                format!("fence name `{}` is not an identifier", name.node),
                                name.span,
                                "not an identifier",
                            )
                            .with_help(format!(
                                "fence names use letters, digits and `_`, such as `<>{}`",
                                ast::to_snake_identifier(&name.node)
                            )),
                        );
                    }
                }
                Arg::Positional(value) => {
                    let word = value.text();
                    let help = if SAMPLER_ARGUMENTS.contains(&word) {
                        format!("give it a value: `{word}=...`")
                    } else {
                        format!(
                            "sampler arguments are written key=value ({}); a fence is written `<>name`",
                            SAMPLER_ARGUMENTS.join(", ")
                        )
                    };
                    self.error(
                        Diagnostic::new(
                            Code::PositionalSamplerArgument,
                            format!("unexpected positional argument `{word}` on a sampler"),
                            arg.span,
                            "samplers take no positional arguments",
                        )
                        .with_help(help),
                    );
                }
                Arg::Keyword { name, value } => {
                    let Some(known) = SAMPLER_ARGUMENTS.iter().find(|known| **known == name.node)
                    else {
                        let mut diagnostic = Diagnostic::new(
                            Code::UnknownSamplerArgument,
                            format!("unknown sampler argument `{}`", name.node),
                            name.span,
                            "unknown argument",
                        );
                        diagnostic = match did_you_mean(&name.node, &SAMPLER_ARGUMENTS) {
                            Some(suggestion) => {
                                diagnostic.with_help(format!("did you mean `{suggestion}`?"))
                            }
                            None => diagnostic.with_help(format!(
                                "samplers accept {}",
                                SAMPLER_ARGUMENTS.join(", ")
                            )),
                        };
                        self.error(diagnostic);
                        continue;
                    };
                    if !REPEATABLE.contains(known) {
                        if let Some(first) = seen.insert(known, name.span) {
                            self.given_twice(known, name.span, first);
                            continue;
                        }
                    }
                    if CONSTRAINTS.contains(known) {
                        match constrained {
                            Some((first, span)) if first != *known => {
                                self.error(
                                    Diagnostic::new(
                                        Code::ConflictingConstraints,
                                        format!(
                                            "`{known}` and `{first}` both constrain this sampler"
                                        ),
                                        arg.span,
                                        "second constraint",
                                    )
                                    .with_secondary(span, "first constraint")
                                    .with_help(
                                        "keep one; several forms can be one regex or grammar",
                                    ),
                                );
                                continue;
                            }
                            Some(_) => {}
                            None => constrained = Some((known, arg.span)),
                        }
                    }
                    self.sampler_value(&mut sample, known, value);
                }
            }
        }
        if let (Some(constraint), Some(fence)) = (&sample.constraint, &sample.fence) {
            // In a fence the sampled text is the constrained text and then the closing tag.
            sample.constraint = Some(constraint.fenced(fence));
        }
        sample
    }

    fn sampler_value(&mut self, sample: &mut Sample, name: &str, value: &Spanned<Value>) {
        let number = match &value.node {
            Value::Number(number) => Some(number.as_str()),
            _ => None,
        };
        let invalid = |expected: &str| {
            let found = match &value.node {
                Value::Number(number) => format!("`{number}`"),
                Value::Word(word) => format!("the word `{word}`"),
                Value::Str(text) => format!("the string {text:?}"),
            };
            Diagnostic::new(
                Code::InvalidSamplerArgument,
                format!("`{name}` must be {expected}"),
                value.span,
                format!("found {found}"),
            )
        };
        match name {
            "max_tokens" => match number
                .and_then(|n| n.parse::<u32>().ok())
                .filter(|n| *n >= 1)
            {
                Some(n) => sample.max_tokens = Some(n),
                None => {
                    self.error(invalid("an integer >= 1").with_help("for example max_tokens=256"))
                }
            },
            "top_k" => match number.and_then(|n| n.parse::<u32>().ok()) {
                Some(n) => sample.top_k = Some(n),
                None => self.error(
                    invalid("an integer >= 0")
                        .with_help("for example top_k=50; top_k=0 disables top-k"),
                ),
            },
            "temperature" => match parse_float(number).filter(|t| *t >= 0.0) {
                // `+ 0.0` turns -0 into 0.
                Some(t) => sample.temperature = Some(t + 0.0),
                None => self.error(
                    invalid("a number >= 0")
                        .with_help("for example temperature=0.7; 0 samples greedily"),
                ),
            },
            "top_p" => match parse_float(number).filter(|p| *p > 0.0 && *p <= 1.0) {
                Some(p) => sample.top_p = Some(p),
                None => self.error(
                    invalid("a number greater than 0 and at most 1")
                        .with_help("for example top_p=0.95"),
                ),
            },
            "stop" => match &value.node {
                Value::Str(text) | Value::Word(text) if !text.is_empty() => {
                    sample.stop.push(text.clone())
                }
                _ => self.error(
                    invalid("a non-empty string")
                        .with_help("quote the stop string: stop=\"</answer>\""),
                ),
            },
            "json" => match &value.node {
                Value::Word(word) if word == "object" => {
                    sample.constraint = Some(Constraint::JsonObject)
                }
                _ => self.error(invalid("`object`").with_help(
                    "json=object allows any JSON object; json_schema=\"{...}\" gives a schema",
                )),
            },
            "json_schema" => match &value.node {
                Value::Str(text) => match schema_problem(text) {
                    None => sample.constraint = Some(Constraint::JsonSchema(text.clone())),
                    Some(problem) => self.error(
                        invalid("a JSON schema")
                            .with_note(problem)
                            .with_help("single quotes keep JSON's double quotes: json_schema='{\"type\": \"object\"}'"),
                    ),
                },
                Value::Word(variable) => {
                    self.constraint_variable(sample, ConstraintArgument::JsonSchema, variable, value.span)
                }
                Value::Number(_) => self.error(invalid("a quoted JSON schema or a variable").with_help(
                    "single quotes keep JSON's double quotes: json_schema='{\"type\": \"object\"}'; a bare name reads a variable: json_schema=schema",
                )),
            },
            "json_schema_file" => match &value.node {
                Value::Str(path) if !path.is_empty() => match self.schema_file(path) {
                    Ok(text) => sample.constraint = Some(Constraint::JsonSchema(text)),
                    Err(problem) => self.error(
                        invalid("a file that holds a JSON schema")
                            .with_note(problem)
                            .with_help(SCHEMA_FILE_HELP),
                    ),
                },
                _ => self.error(invalid("a quoted path").with_help(SCHEMA_FILE_HELP)),
            },
            "regex" => match &value.node {
                Value::Str(text) => match regex_problem(text) {
                    None => sample.constraint = Some(Constraint::Regex(text.clone())),
                    Some(problem) => self.error(
                        invalid("a regular expression")
                            .with_note(problem)
                            .with_help("the whole sampled text must match it: regex=\"(yes|no)\""),
                    ),
                },
                Value::Word(variable) => {
                    self.constraint_variable(sample, ConstraintArgument::Regex, variable, value.span)
                }
                Value::Number(_) => self.error(
                    invalid("a quoted regular expression or a variable")
                        .with_help("the whole sampled text must match it: regex=\"(yes|no)\"; a bare name reads a variable: regex=pattern"),
                ),
            },
            "choice" => match &value.node {
                Value::Str(text) | Value::Word(text) | Value::Number(text) if !text.is_empty() => {
                    match &mut sample.constraint {
                        Some(Constraint::Choice(choices)) => choices.push(text.clone()),
                        _ => sample.constraint = Some(Constraint::Choice(vec![text.clone()])),
                    }
                }
                _ => self.error(
                    invalid("a non-empty text")
                        .with_help("one text per argument: choice=yes choice=\"not sure\""),
                ),
            },
            "grammar" => match &value.node {
                Value::Str(text) if !text.trim().is_empty() => {
                    sample.constraint = Some(Constraint::Grammar(text.clone()))
                }
                Value::Word(variable) => {
                    self.constraint_variable(sample, ConstraintArgument::Grammar, variable, value.span)
                }
                _ => self.error(invalid("a quoted Lark grammar or a variable").with_help(
                    "a grammar with a `start` rule: grammar=\"start: /[0-9]+/\"; a bare name reads a variable: grammar=rules",
                )),
            },
            _ => unreachable!("only known sampler arguments reach here"),
        }
    }

    /// `argument=variable`: the constraint's text is the variable's value when the sampler runs, a use
    /// of the variable like any other (an input, or bound by an earlier sampler), without a default.
    fn constraint_variable(
        &mut self,
        sample: &mut Sample,
        argument: ConstraintArgument,
        variable: &str,
        span: Span,
    ) {
        if self.variable(variable, span, Use::Constraint(argument)) {
            sample.constraint_variable = Some(ConstraintVariable {
                argument,
                name: variable.to_string(),
            });
        }
    }

    /// The text of the schema file at `path`, relative to [`Options::dir`], or why it is not a schema
    /// (no folder to read from, a file that cannot be read, text that is not a JSON schema).
    fn schema_file(&mut self, path: &str) -> Result<String, String> {
        let Some(dir) = &self.options.dir else {
            return Err(format!(
                "`{path}` is relative to the .hol file's folder, and this text comes from no file"
            ));
        };
        // Named as written: the help says what it is relative to.
        let file = dir.join(path);
        let text = std::fs::read_to_string(&file)
            .map_err(|error| format!("cannot read `{path}`: {error}"))?;
        if !self.read.contains(&file) {
            self.read.push(file);
        }
        match schema_problem(&text) {
            None => Ok(text),
            Some(problem) => Err(format!("`{path}`: {problem}")),
        }
    }

    fn holotype(&mut self, tag: &Tag, name: &Spanned<String>, span: Span) {
        if !ast::is_identifier(&name.node) {
            self.error(
                Diagnostic::new(
                    Code::InvalidHolotypeName,
                    format!("holotype name `{}` is not an identifier", name.node),
                    name.span,
                    "not an identifier",
                )
                .with_help(format!(
                    "holotype names are Rust type names: letters, digits and `_`, such as `{}`",
                    suggest_type_name(&name.node)
                )),
            );
            return;
        }
        let Resolved { params, builtin } = self.resolve_holotype(name);
        let mut args = Vec::new();
        let mut seen: HashMap<&str, Span> = HashMap::new();
        for arg in &tag.args {
            match &arg.node {
                Arg::Fence(fence) => self.error(
                    Diagnostic::new(
                        Code::MisplacedFence,
                        format!("holotype `{}` takes no fence", name.node),
                        arg.span,
                        "a fence belongs to a sampler",
                    )
                    .with_help(format!(
                        "to sample into a fence, write `<|@_@ <>{}|>`",
                        fence.node
                    )),
                ),
                Arg::Positional(value) => args.push(HolotypeArg {
                    name: None,
                    value: arg_value(value),
                    span: arg.span,
                }),
                Arg::Keyword { name: key, value } => {
                    if !ast::is_identifier(&key.node) {
                        self.error(
                            Diagnostic::new(
                                Code::InvalidArgumentName,
                                format!("argument name `{}` is not an identifier", key.node),
                                key.span,
                                "not an identifier",
                            )
                            .with_help(format!(
                                "write `{}=...`",
                                ast::to_snake_identifier(&key.node)
                            )),
                        );
                        continue;
                    }
                    if let Some(params) = &params {
                        if !params.contains(&key.node) {
                            self.unknown_holotype_argument(name, key, params);
                            continue;
                        }
                    }
                    if let Some(first) = seen.insert(&key.node, key.span) {
                        self.given_twice(&key.node, key.span, first);
                        continue;
                    }
                    args.push(HolotypeArg {
                        name: Some(key.node.clone()),
                        value: arg_value(&value.node),
                        span: arg.span,
                    });
                }
            }
        }
        if builtin && self.options.check_builtin_arguments {
            if let Some(spec) = builtins::builtin(&name.node) {
                self.builtin_arguments(name, spec, &args, span);
            }
        }
        self.ensure_context(span);
        if tag
            .body
            .as_ref()
            .is_some_and(|body| starts_message(&body.nodes, self.role))
        {
            // The body's first pass opens a message, so the newlines before the tag end the current one.
            self.trim_message_end();
        }
        let instance = self.holotypes.len();
        let op = self.push(
            OpKind::Holotype {
                instance,
                body_end: None,
            },
            span,
        );
        self.holotypes.push(HolotypeInstance {
            name: name.node.clone(),
            args,
            span,
            op,
            builtin,
        });
        if let Some(body) = &tag.body {
            self.body(instance, op, body, span);
        }
    }

    /// Reports a holotype the checker cannot resolve; returns its parameters when they are known.
    ///
    /// A built-in is used when the crate has nothing of that name: a type, an import or a macro
    /// argument of the crate shadows it.
    fn resolve_holotype(&mut self, name: &Spanned<String>) -> Resolved {
        let options = self.options;
        let in_crate = options.scan.as_ref().map(|scan| scan.resolve(&name.node));
        if let Some(Resolution::Holotype(decl)) = &in_crate {
            return Resolved::local(decl.params.clone());
        }
        if let Some(params) = options.builtin_holotypes.get(&name.node) {
            if matches!(in_crate, None | Some(Resolution::Unknown)) {
                return Resolved {
                    params: params.clone(),
                    builtin: true,
                };
            }
        }
        let Some(scan) = &options.scan else {
            if self.unresolved.insert(name.node.clone()) {
                self.error(
                    Diagnostic::new(
                        Code::UnresolvedHolotype,
                        format!("holotype `{}` is not known to the checker", name.node),
                        name.span,
                        "not a built-in holotype",
                    )
                    .with_help(
                        "run the check inside your crate (a folder with Cargo.toml) so that its holotypes \
                         can be found",
                    ),
                );
            }
            return Resolved::local(None);
        };
        match scan.resolve(&name.node) {
            Resolution::Holotype(decl) => Resolved::local(decl.params.clone()),
            Resolution::Undecided => Resolved::local(None),
            Resolution::NotAHolotype => {
                self.error(
                    Diagnostic::new(
                        Code::NotAHolotype,
                        format!("`{}` does not implement `Holotype`", name.node),
                        name.span,
                        "used as a holotype here",
                    )
                    .with_help(format!(
                        "implement `holo_runtime::Holotype` for `{}`, or fix the name",
                        name.node
                    )),
                );
                Resolved::local(None)
            }
            Resolution::Unknown => {
                let candidates: Vec<&str> = scan
                    .holotypes
                    .keys()
                    .chain(options.builtin_holotypes.keys())
                    .map(String::as_str)
                    .collect();
                let mut diagnostic = Diagnostic::new(
                    Code::UnknownHolotype,
                    format!("unknown holotype `{}`", name.node),
                    name.span,
                    "no type of this name implements `Holotype`",
                );
                diagnostic = match did_you_mean(&name.node, &candidates) {
                    Some(suggestion) => {
                        diagnostic.with_help(format!("did you mean `{suggestion}`?"))
                    }
                    None if candidates.is_empty() => diagnostic.with_help(format!(
                        "define it: `struct {0};` and `impl holo_runtime::Holotype for {0}`",
                        name.node
                    )),
                    None => {
                        diagnostic.with_help(format!("known holotypes: {}", candidates.join(", ")))
                    }
                };
                self.error(diagnostic);
                Resolved::local(None)
            }
        }
    }

    fn unknown_holotype_argument(
        &mut self,
        holotype: &Spanned<String>,
        key: &Spanned<String>,
        params: &[String],
    ) {
        let candidates: Vec<&str> = params.iter().map(String::as_str).collect();
        let help = match did_you_mean(&key.node, &candidates) {
            Some(suggestion) => format!("did you mean `{suggestion}`?"),
            None if params.is_empty() => format!("`{}` takes no keyword arguments", holotype.node),
            None => format!("`{}` takes {}", holotype.node, params.join(", ")),
        };
        self.error(
            Diagnostic::new(
                Code::UnknownHolotypeArgument,
                format!(
                    "holotype `{}` has no parameter `{}`",
                    holotype.node, key.node
                ),
                key.span,
                "unknown argument",
            )
            .with_secondary(holotype.span, "its `PARAMS` do not list this name")
            .with_help(help),
        );
    }

    /// Reports the values and positional arguments a built-in's constructor would refuse.
    fn builtin_arguments(
        &mut self,
        name: &Spanned<String>,
        builtin: &builtins::Builtin,
        args: &[HolotypeArg],
        span: Span,
    ) {
        for problem in builtins::check(builtin, args) {
            let diagnostic = match problem {
                Problem::Invalid { index, expected } => {
                    let arg = &args[index];
                    let what = match &arg.name {
                        Some(key) => format!("`{key}`"),
                        None => "the positional argument".to_string(),
                    };
                    Diagnostic::new(
                        Code::InvalidHolotypeArgument,
                        format!(
                            "{what} of `{}` must be {expected}, found `{}`",
                            name.node, arg.value
                        ),
                        arg.span,
                        "invalid value",
                    )
                    .with_secondary(name.span, "the runtime's built-in holotype")
                    .with_help(format!(
                        "`holoc explain H0029` lists what each argument of `{}` accepts",
                        name.node
                    ))
                }
                Problem::ExtraPositional { index } => {
                    let holotype = builtin.name;
                    let (message, help) = if builtin.positional == builtins::Positional::None {
                        let keywords: Vec<&str> =
                            builtin.params.iter().map(|param| param.name).collect();
                        let help = match &args[index].value {
                            ArgValue::Word(word) if keywords.contains(&"var") => {
                                format!("to read the variable `{word}`, write `var={word}`")
                            }
                            _ if keywords.is_empty() => format!("`{holotype}` takes no arguments"),
                            _ => format!(
                                "`{holotype}` takes only keyword arguments: {}",
                                keywords.join(", ")
                            ),
                        };
                        (format!("`{holotype}` takes no positional arguments"), help)
                    } else {
                        (
                            format!("`{holotype}` takes one positional argument, not more"),
                            format!("`{holotype}` takes one positional argument"),
                        )
                    };
                    Diagnostic::new(
                        Code::InvalidHolotypeArgument,
                        message,
                        args[index].span,
                        "unexpected positional argument",
                    )
                    .with_secondary(name.span, "the runtime's built-in holotype")
                    .with_help(help)
                }
                Problem::Missing { what, example } => Diagnostic::new(
                    Code::MissingHolotypeArgument,
                    format!("`{}` needs {what}", name.node),
                    span,
                    "missing argument",
                )
                .with_help(format!("write it as in `<|{} {example}|>`", name.node)),
            };
            self.error(diagnostic);
        }
    }

    fn body(&mut self, instance: usize, op: usize, body: &Body, span: Span) {
        let definitely_before = self.definitely_log.len();
        let role_before = self.role;
        // Later passes through the body see what earlier passes bound.
        collect_bindings(&body.nodes, &mut |name, _| {
            self.possibly.insert(name.to_string());
        });
        if changes_role(&body.nodes) {
            self.role = None;
        }
        self.nodes(&body.nodes);
        let end_span = body.close.unwrap_or(Span {
            start: span.end,
            end: span.end,
        });
        let end = self.push(
            OpKind::EndBody {
                instance,
                body_start: op + 1,
            },
            end_span,
        );
        if let OpKind::Holotype { body_end, .. } = &mut self.ops[op].kind {
            *body_end = Some(end);
        }
        // The body may run zero times.
        for name in self.definitely_log.drain(definitely_before..) {
            self.definitely.remove(&name);
        }
        if self.role != role_before {
            self.role = None;
        }
    }

    fn insert(&mut self, tag: &Tag, alternatives: &[Spanned<Alternative>], span: Span) {
        let written: Vec<String> = alternatives
            .iter()
            .map(|alternative| match &alternative.node {
                Alternative::Variable(name) => name.clone(),
                Alternative::Literal(text) => format!("{text:?}"),
            })
            .collect();
        self.no_arguments(tag, "a variable", &format!("<|{}|>", written.join("|")));
        let mut sources = Vec::new();
        let mut literal_at: Option<Span> = None;
        for alternative in alternatives {
            if let Some(literal) = literal_at {
                self.error(
                    Diagnostic::new(
                        Code::UnreachableAlternative,
                        "this alternative is never used",
                        alternative.span,
                        "unreachable",
                    )
                    .with_secondary(literal, "this default is always present")
                    .with_help("put the quoted default last"),
                );
            }
            match &alternative.node {
                Alternative::Literal(text) => {
                    literal_at.get_or_insert(alternative.span);
                    sources.push(Source::Literal(text.clone()));
                }
                Alternative::Variable(name) => {
                    let used = match alternatives.len() {
                        1 => Use::Sole,
                        _ => Use::Alternative,
                    };
                    if self.variable(name, alternative.span, used) {
                        sources.push(Source::Variable(name.clone()));
                    }
                }
            }
        }
        self.ensure_context(span);
        self.push(
            OpKind::Insert {
                alternatives: sources,
            },
            span,
        );
    }

    /// Checks one variable use; returns whether it is well-formed.
    fn variable(&mut self, name: &str, span: Span, used: Use) -> bool {
        // A sole use needs the variable; one of several alternatives needs one of them.
        let sole = used != Use::Alternative;
        if name.starts_with(|c: char| c.is_ascii_uppercase()) && ast::is_identifier(name) {
            self.error(
                Diagnostic::new(
                    Code::HolotypeAlternative,
                    format!("holotype `{name}` cannot be an alternative"),
                    span,
                    "capitalised names are holotypes",
                )
                .with_help(format!(
                    "give it its own tag, `<|{name}|>`, or use a lowercase variable name"
                )),
            );
            return false;
        }
        if !ast::is_variable_name(name) {
            self.error(
                Diagnostic::new(
                    Code::InvalidVariable,
                    format!("`{name}` is not a valid variable name"),
                    span,
                    "not an identifier",
                )
                .with_help(format!(
                    "variable names use lowercase letters, digits and `_`, such as `{}`",
                    ast::to_snake_identifier(name)
                )),
            );
            return false;
        }
        let Some(&bound_at) = self.bound_anywhere.get(name) else {
            match self.input_index.get(name) {
                Some(&at) => {
                    self.inputs[at].required |= sole;
                    self.inputs[at].uses.push(span);
                }
                None => {
                    self.input_index.insert(name.to_string(), self.inputs.len());
                    self.inputs.push(Input {
                        name: name.to_string(),
                        required: sole,
                        uses: vec![span],
                    });
                }
            }
            return true;
        };
        let available = if sole {
            self.definitely.contains(name)
        } else {
            self.possibly.contains(name)
        };
        if !available {
            let maybe = self.possibly.contains(name);
            let message = if maybe {
                format!("`{name}` may not be bound yet when this runs")
            } else {
                format!("`{name}` is used before the sampler that binds it")
            };
            let mut diagnostic = Diagnostic::new(Code::UseBeforeBind, message, span, "used here")
                .with_secondary(bound_at, "bound here");
            if maybe {
                diagnostic = diagnostic.with_note(
                    "a body may run zero times, and on the first pass through a body the samplers later in it \
                     have not run",
                );
            }
            let help = match used {
                Use::Sole => {
                    format!("move the use after the sampler, or give a default: `<|{name}|\"\"|>`")
                }
                Use::Alternative => format!("move the sampler that binds `{name}` before this use"),
                Use::Constraint(argument) => format!(
                    "move the sampler that binds `{name}` before this one, whose {} it holds",
                    argument.name()
                ),
            };
            self.error(diagnostic.with_help(help));
        }
        true
    }
}

/// How a variable is used: alone in an insert, as one of its alternatives, or as the text of a sampler's
/// constraint (`json_schema=name`, `regex=name`, `grammar=name`), which has no default.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Use {
    Sole,
    Alternative,
    Constraint(ConstraintArgument),
}

fn arg_value(value: &Value) -> ArgValue {
    match value {
        Value::Word(word) => ArgValue::Word(word.clone()),
        Value::Str(text) => ArgValue::Str(text.clone()),
        Value::Number(number) => match number.parse::<i64>() {
            Ok(int) => ArgValue::Int(int),
            Err(_) => parse_float(Some(number))
                .map_or_else(|| ArgValue::Word(number.clone()), ArgValue::Float),
        },
    }
}

/// How a `json_schema_file` path is written.
const SCHEMA_FILE_HELP: &str =
    "a path relative to the .hol file's folder: json_schema_file=\"schemas/plan.json\"";

fn parse_float(number: Option<&str>) -> Option<f64> {
    number?
        .parse::<f64>()
        .ok()
        .filter(|value| value.is_finite())
}

/// The closest of `candidates` to `name`, if any is close enough to be a likely misspelling.
pub fn did_you_mean<'c>(name: &str, candidates: &[&'c str]) -> Option<&'c str> {
    candidates
        .iter()
        .map(|candidate| (strsim::jaro_winkler(name, candidate), *candidate))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, candidate)| candidate)
}

/// `name` turned into a CamelCase identifier, for help messages.
fn suggest_type_name(name: &str) -> String {
    name.split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|part| !part.is_empty())
        .map(|part| {
            let mut chars = part.chars();
            let first = chars.next().expect("non-empty").to_ascii_uppercase();
            std::iter::once(first).chain(chars).collect::<String>()
        })
        .collect()
}
