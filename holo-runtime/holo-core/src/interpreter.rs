//! The IR interpreter: runs any `.hol` file given at run time, with holotypes from a [`Registry`].
//!
//! It executes the same [`holoc::ir::Program`] that codegen compiles, with the same semantics op for
//! op, so a holoware behaves identically whether it is compiled with `include_holoware!` or loaded by
//! `holo` from a path (the differential test in `holo-macros/tests/corpus.rs` holds them to it).

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use holoc::ir::{OpKind, Program, Source, TemplateValue};
use holoc::report::SourceFile;
use holoc::Options;

use crate::constraint::Constraint;
use crate::holotype::{AnswerCheck, Args, Cx, Enter, Holotype, HolotypeError, Pass, Variables};
use crate::machine::{
    Completion, Recorder, Rollout, RolloutError, SampleRequest, Step, TemplateArg,
};
use crate::resources::Resources;
use crate::Role;

/// The object-safe part of [`Holotype`], for holotypes chosen at run time.
pub trait DynHolotype: Send {
    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError>;
    fn end_pass(&mut self, cx: &mut Cx<'_>) -> Result<Pass, HolotypeError>;
    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError>;
}

/// A hook of a holotype; a panic in it becomes its error (`panicked: …`), which the interpreter reports
/// with the tag's location as it reports a returned error.
fn unwinding<R>(hook: impl FnOnce() -> Result<R, HolotypeError>) -> Result<R, HolotypeError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(hook)).unwrap_or_else(|payload| {
        Err(HolotypeError::new(format!(
            "panicked: {}",
            crate::error::panic_message(payload.as_ref())
        )))
    })
}

impl<T: Holotype + Send> DynHolotype for T {
    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        unwinding(|| Holotype::enter(self, cx))
    }

    fn end_pass(&mut self, cx: &mut Cx<'_>) -> Result<Pass, HolotypeError> {
        unwinding(|| Holotype::end_pass(self, cx))
    }

    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
        unwinding(|| Holotype::end(self, cx))
    }
}

type Constructor = Box<dyn Fn(&Args) -> Result<Box<dyn DynHolotype>, HolotypeError> + Send + Sync>;

struct Entry {
    params: &'static [&'static str],
    construct: Constructor,
    needs: fn(&Args) -> Vec<String>,
    answer_check: fn(&Args) -> Option<AnswerCheck>,
    blocks: bool,
}

/// The holotypes an interpreted holoware may name.
#[derive(Default)]
pub struct Registry {
    entries: HashMap<String, Entry>,
}

impl Registry {
    /// Makes `T` available under `name`.
    pub fn register<T: Holotype + Send + 'static>(&mut self, name: &str) -> &mut Self {
        self.entries.insert(
            name.to_string(),
            Entry {
                params: T::PARAMS,
                construct: Box::new(|args| Ok(Box::new(T::new(args)?) as Box<dyn DynHolotype>)),
                needs: T::needs,
                answer_check: T::answer_check,
                blocks: T::BLOCKS,
            },
        );
        self
    }

    /// Every registered name with its keyword parameters, sorted by name.
    pub fn holotypes(&self) -> Vec<(&str, &'static [&'static str])> {
        let mut holotypes: Vec<_> = self
            .entries
            .iter()
            .map(|(name, entry)| (name.as_str(), entry.params))
            .collect();
        holotypes.sort_unstable_by_key(|(name, _)| *name);
        holotypes
    }

    /// The checker's view: every registered name with its parameters.
    fn options(&self) -> Options {
        Options {
            builtin_holotypes: self
                .entries
                .iter()
                .map(|(name, entry)| {
                    let params = entry.params.iter().map(|param| param.to_string()).collect();
                    (name.clone(), Some(params))
                })
                .collect(),
            // Outside a crate scan, a holotype the registry lacks is only a warning from the checker;
            // `Holoware::load` turns it into an error, since nothing could provide it at run time.
            scan: Some(holoc::scan::CrateScan::default()),
            // A registry may hold other types under the built-ins' names; `Holoware::check_holotypes`
            // constructs each instance, which checks its arguments whatever the type.
            check_builtin_arguments: false,
            dir: None,
        }
    }
}

/// Why a holoware could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    /// The diagnostics, rendered as `holoc check` renders them.
    pub message: String,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for LoadError {}

/// A checked holoware, ready to start rollouts.
pub struct Holoware {
    name: String,
    program: Program,
    registry: Arc<Registry>,
    /// `file.hol:line:col` of each op.
    locations: Vec<&'static str>,
    /// The arguments of each holotype tag.
    args: Vec<Args>,
    /// The variable names of each insert op (empty for other ops), for errors.
    alternatives: Vec<&'static [&'static str]>,
    /// The binding and fence of each sample op.
    samples: Vec<(Option<&'static str>, Option<&'static str>)>,
    binding_names: Arc<[String]>,
    /// The columns holotypes need ([`Holotype::needs`]) that no sampler binds, each with the tag's
    /// location.
    needed_columns: Vec<(String, &'static str)>,
    /// The reward component pass@k counts ([`Holoware::pass_component`]).
    pass_component: Option<String>,
}

/// A data row: column name → value. Strings are taken verbatim; numbers and booleans as JSON writes them;
/// `null` counts as absent.
pub type Row = serde_json::Map<String, serde_json::Value>;

/// A row of a data file with its line number (from 1): the row, or why that line is not one.
pub type NumberedRow = (usize, Result<Row, String>);

/// The rows of a JSONL file, each with its line number; a line that is not a JSON object is an error
/// for that row only (its column and serde's message). Blank lines are skipped.
pub fn read_rows(path: &Path) -> Result<Vec<NumberedRow>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| format!("cannot read `{}`: {error}", path.display()))?;
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(index, line)| {
            let row = match serde_json::from_str::<serde_json::Value>(line) {
                Ok(serde_json::Value::Object(row)) => Ok(row),
                Ok(_) => Err("a row must be a JSON object".to_string()),
                Err(error) => {
                    // serde_json's message ends with ` at line 1 column N`; the line is the file's.
                    let message = error.to_string();
                    let message = message
                        .split(" at line ")
                        .next()
                        .unwrap_or(&message)
                        .to_string();
                    Err(format!(
                        "column {}: invalid JSON: {message}",
                        error.column()
                    ))
                }
            };
            (index + 1, row)
        })
        .collect())
}

/// A data row that lacks what the holoware needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingInput {
    /// The columns of which one is needed (one name for a required input).
    pub columns: Vec<String>,
    /// Where the holoware uses them.
    pub location: String,
}

impl fmt::Display for MissingInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.columns.as_slice() {
            [one] => write!(f, "missing column `{one}` (used at {})", self.location),
            many => write!(
                f,
                "missing all of the columns {} (one is needed at {})",
                many.iter()
                    .map(|column| format!("`{column}`"))
                    .collect::<Vec<_>>()
                    .join(", "),
                self.location
            ),
        }
    }
}

impl std::error::Error for MissingInput {}

/// The columns the holotype tags need ([`Holotype::needs`]) that no sampler binds, each with its tag's
/// location, in the file's order.
fn needed_columns(
    program: &Program,
    registry: &Registry,
    args: &[Args],
    bound: &[String],
) -> Vec<(String, &'static str)> {
    let mut needed: Vec<(String, &'static str)> = Vec::new();
    for (holotype, args) in program.holotypes.iter().zip(args) {
        let Some(entry) = registry.entries.get(&holotype.name) else {
            continue;
        };
        for column in (entry.needs)(args) {
            if !bound.contains(&column) && !needed.iter().any(|(name, _)| *name == column) {
                needed.push((column, args.location));
            }
        }
    }
    needed
}

/// The component of the holoware's answer checks ([`Holotype::answer_check`]) that pass@k counts: the
/// one marked `pass=true`, else the only one not marked `pass=false`; `None` without answer checks. Two
/// candidates are refused, naming them and where they are recorded.
fn pass_component(
    program: &Program,
    registry: &Registry,
    args: &[Args],
) -> Result<Option<String>, String> {
    let mut checks: Vec<(AnswerCheck, &'static str)> = Vec::new();
    for (holotype, args) in program.holotypes.iter().zip(args) {
        let Some(entry) = registry.entries.get(&holotype.name) else {
            continue;
        };
        if let Some(check) = (entry.answer_check)(args) {
            checks.push((check, args.location));
        }
    }
    let marked: Vec<_> = checks
        .iter()
        .filter(|(c, _)| c.pass == Some(true))
        .collect();
    let candidates = if marked.is_empty() {
        checks.iter().filter(|(c, _)| c.pass.is_none()).collect()
    } else {
        marked
    };
    let mut components: Vec<(&str, &str)> = Vec::new();
    for (check, location) in candidates {
        if !components.iter().any(|(c, _)| *c == check.component) {
            components.push((&check.component, location));
        }
    }
    match components.as_slice() {
        [] => Ok(None),
        [(component, _)] => Ok(Some(component.to_string())),
        several => {
            let list: Vec<String> = several
                .iter()
                .map(|(component, location)| format!("`{component}` ({location})"))
                .collect();
            let marked = checks.iter().any(|(c, _)| c.pass == Some(true));
            Err(format!(
                "{}: error: pass@k counts one answer check, and {} {}; {}\n",
                several[0].1,
                if marked {
                    "several are marked `pass=true`:"
                } else {
                    "this file has several:"
                },
                list.join(", "),
                if marked {
                    "keep `pass=true` on one"
                } else {
                    "mark the one pass@k counts with `pass=true` (or the others with `pass=false`)"
                }
            ))
        }
    }
}

impl Holoware {
    /// Whether a holotype tag names a holotype that may block ([`Holotype::BLOCKS`]).
    pub fn blocks(&self) -> bool {
        self.program.holotypes.iter().any(|holotype| {
            self.registry
                .entries
                .get(&holotype.name)
                .is_some_and(|entry| entry.blocks)
        })
    }

    /// Checks `.hol` source; every error (or a holotype the registry lacks) fails the load. The source
    /// comes from no file, so a `json_schema_file` in it is an error ([`Holoware::load_file`] reads it).
    pub fn load(name: &str, bytes: &[u8], registry: Arc<Registry>) -> Result<Self, LoadError> {
        Self::compile(name, bytes, registry.options(), registry)
    }

    /// [`Holoware::load`] for the bytes of the file at `file`, whose folder a `json_schema_file` path is
    /// relative to; `name` is how diagnostics and locations name it.
    pub fn load_file(
        name: &str,
        file: &Path,
        bytes: &[u8],
        registry: Arc<Registry>,
    ) -> Result<Self, LoadError> {
        Self::compile(name, bytes, registry.options().for_file(file), registry)
    }

    fn compile(
        name: &str,
        bytes: &[u8],
        options: Options,
        registry: Arc<Registry>,
    ) -> Result<Self, LoadError> {
        let output = holoc::compile(bytes, &options);
        let file = SourceFile::new(name, &output.source);
        let fatal: Vec<String> = output
            .diagnostics
            .iter()
            .filter(|diagnostic| diagnostic.is_error())
            .map(|diagnostic| file.plain(diagnostic))
            .collect();
        let Some(program) = output.program.filter(|_| fatal.is_empty()) else {
            return Err(LoadError {
                message: fatal.concat(),
            });
        };
        let location = |span: holoc::span::Span| {
            leak(format!("{name}:{}:{}", span.start.line, span.start.col))
        };
        let locations = program.ops.iter().map(|op| location(op.span)).collect();
        let args: Vec<Args> = program
            .holotypes
            .iter()
            .map(|holotype| Args {
                location: location(holotype.span),
                positional: holotype
                    .args
                    .iter()
                    .filter(|arg| arg.name.is_none())
                    .map(|arg| arg.value.clone())
                    .collect(),
                keywords: holotype
                    .args
                    .iter()
                    .filter_map(|arg| Some((leak(arg.name.clone()?), arg.value.clone())))
                    .collect(),
                resources: Resources::default(),
            })
            .collect();
        let alternatives = program
            .ops
            .iter()
            .map(|op| match &op.kind {
                OpKind::Insert { alternatives } => {
                    let names: Vec<&'static str> = alternatives
                        .iter()
                        .filter_map(|source| match source {
                            Source::Variable(name) => Some(leak(name.clone())),
                            Source::Literal(_) => None,
                        })
                        .collect();
                    &*Box::leak(names.into_boxed_slice())
                }
                _ => &[],
            })
            .collect();
        let samples = program
            .ops
            .iter()
            .map(|op| match &op.kind {
                OpKind::Sample(sample) => (
                    sample.binding.clone().map(leak),
                    sample.fence.clone().map(leak),
                ),
                _ => (None, None),
            })
            .collect();
        let binding_names: Arc<[String]> = program
            .bindings
            .iter()
            .map(|binding| binding.name.clone())
            .collect();
        let needed_columns = needed_columns(&program, &registry, &args, &binding_names);
        let pass_component =
            pass_component(&program, &registry, &args).map_err(|message| LoadError { message })?;
        Ok(Holoware {
            needed_columns,
            pass_component,
            binding_names,
            name: name.to_string(),
            program,
            registry,
            locations,
            args,
            alternatives,
            samples,
        })
    }

    /// Reads and checks a `.hol` file.
    pub fn open(path: &Path, registry: Arc<Registry>) -> Result<Self, LoadError> {
        let bytes = std::fs::read(path).map_err(|error| LoadError {
            message: format!("cannot read `{}`: {error}", path.display()),
        })?;
        Self::load_file(&path.display().to_string(), path, &bytes, registry)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Each sampler tag's constraint with the tag's `file.hol:line:col`, in the file's order: what a
    /// sampler can compile before any rollout, to refuse one there rather than in every rollout.
    pub fn constraints(&self) -> Vec<(&'static str, Constraint)> {
        self.program
            .ops
            .iter()
            .zip(&self.locations)
            .filter_map(|(op, &location)| match &op.kind {
                OpKind::Sample(sample) => sample
                    .constraint
                    .as_ref()
                    .map(|constraint| (location, Constraint::from(constraint))),
                _ => None,
            })
            .collect()
    }

    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The data columns the holotype tags need ([`Holotype::needs`], a built-in reward's `target=`) that
    /// no sampler binds, in the file's order; [`Holoware::check_row`] requires each.
    pub fn needed_columns(&self) -> impl Iterator<Item = &str> {
        self.needed_columns
            .iter()
            .map(|(column, _)| column.as_str())
    }

    /// The reward component whose full credit (≥ 1) makes a rollout pass, for pass@k: the component of
    /// the file's answer check (`ExactAnswer`, `MathAnswer`, [`Holotype::answer_check`]), the one marked
    /// `pass=true` where there are several. `None` when the file checks no answer: pass@k is then not
    /// computed, unless [`LoomConfig::pass_component`](crate::loom::LoomConfig::pass_component) names one.
    pub fn pass_component(&self) -> Option<&str> {
        self.pass_component.as_deref()
    }

    /// Checks that `row` has every input the holoware needs: each required input, every column a
    /// holotype needs that no sampler binds (a reward's `target=`, [`Holotype::needs`]), and one of
    /// every group of alternatives that only inputs can satisfy.
    pub fn check_row(&self, row: &Row) -> Result<(), MissingInput> {
        let present = |name: &str| row.get(name).is_some_and(|value| !value.is_null());
        for input in self.program.inputs.iter().filter(|input| input.required) {
            if !present(&input.name) {
                let at = input.uses[0];
                return Err(MissingInput {
                    columns: vec![input.name.clone()],
                    location: format!("{}:{}:{}", self.name, at.start.line, at.start.col),
                });
            }
        }
        if let Some((column, location)) = self
            .needed_columns
            .iter()
            .find(|(column, _)| !present(column))
        {
            return Err(MissingInput {
                columns: vec![column.clone()],
                location: location.to_string(),
            });
        }
        let is_input = |name: &str| self.program.inputs.iter().any(|input| input.name == name);
        for (index, op) in self.program.ops.iter().enumerate() {
            let OpKind::Insert { alternatives } = &op.kind else {
                continue;
            };
            let only_inputs = alternatives.iter().all(|source| match source {
                Source::Variable(name) => is_input(name),
                Source::Literal(_) => false,
            });
            let satisfied = alternatives.iter().any(|source| match source {
                Source::Variable(name) => present(name),
                Source::Literal(_) => true,
            });
            if only_inputs && !satisfied {
                return Err(MissingInput {
                    columns: alternatives
                        .iter()
                        .filter_map(|source| match source {
                            Source::Variable(name) => Some(name.clone()),
                            Source::Literal(_) => None,
                        })
                        .collect(),
                    location: self.locations[index].to_string(),
                });
            }
        }
        Ok(())
    }

    /// The constraints that `row` gives the samplers that read their schema, regular expression or
    /// grammar from an input (`json_schema=name`, `regex=name`, `grammar=name`), with their tags'
    /// `file.hol:line:col`: what a row's rollouts will sample under, checked before any of them. An
    /// error says which tag's variable holds none. (A variable a sampler binds is read when the sampler
    /// runs.)
    pub fn row_constraints(&self, row: &Row) -> Result<Vec<(&'static str, Constraint)>, String> {
        let mut constraints = Vec::new();
        for (op, &location) in self.program.ops.iter().zip(&self.locations) {
            let OpKind::Sample(sample) = &op.kind else {
                continue;
            };
            let Some(variable) = &sample.constraint_variable else {
                continue;
            };
            if self.binding_names.contains(&variable.name) {
                continue;
            }
            let value = row.get(&variable.name).and_then(column_text);
            let constraint = Constraint::of_variable(
                variable.argument,
                &variable.name,
                value.as_deref(),
                sample.fence.as_deref(),
            )
            .map_err(|error| format!("{location}: {error}"))?;
            constraints.push((location, constraint));
        }
        Ok(constraints)
    }

    /// Starts one rollout on a data row.
    pub fn start(self: &Arc<Self>, row: &Row) -> Result<Interpreter, RolloutError> {
        self.start_with(row, &Resources::default())
    }

    /// Constructs every holotype instance once with `resources`, as each rollout will: an argument its
    /// type refuses, or a resource it needs and lacks, is found before any rollout runs rather than at
    /// every one. Returns the first error, with its `file.hol:line:col`.
    pub fn check_holotypes(&self, resources: &Resources) -> Result<(), RolloutError> {
        self.instances(resources).map(drop)
    }

    fn instances(&self, resources: &Resources) -> Result<Vec<Box<dyn DynHolotype>>, RolloutError> {
        let mut instances = Vec::with_capacity(self.program.holotypes.len());
        for (holotype, args) in self.program.holotypes.iter().zip(&self.args) {
            let args = &Args {
                resources: resources.clone(),
                ..args.clone()
            };
            let location = args.location;
            let entry = self.registry.entries.get(&holotype.name).ok_or_else(|| {
                RolloutError::Holotype {
                    location,
                    error: HolotypeError::new(format!(
                        "holotype `{}` is not registered",
                        holotype.name
                    )),
                }
            })?;
            let instance = (entry.construct)(args)
                .map_err(|error| RolloutError::Holotype { location, error })?;
            instances.push(instance);
        }
        Ok(instances)
    }

    /// Starts one rollout on a data row, with resources for its holotypes.
    pub fn start_with(
        self: &Arc<Self>,
        row: &Row,
        resources: &Resources,
    ) -> Result<Interpreter, RolloutError> {
        let instances = self.instances(resources)?;
        let inputs = row
            .iter()
            .filter_map(|(name, value)| Some((name.clone(), column_text(value)?)))
            .collect();
        Ok(Interpreter {
            holoware: Arc::clone(self),
            variables: Vars {
                inputs,
                bound: HashMap::new(),
                bindings: Arc::clone(&self.binding_names),
            },
            pc: 0,
            awaiting: false,
            finished: false,
            role: None,
            passes: vec![0; self.program.holotypes.len()],
            instances,
        })
    }
}

/// A row's column as a variable's text: a string as it is, other JSON as JSON text; null is absent.
fn column_text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::Null => None,
        serde_json::Value::String(text) => Some(text.clone()),
        other => Some(other.to_string()),
    }
}

/// Locations and names in [`Args`] and [`SampleRequest`] are `&'static str` so that generated code can use
/// literals; the interpreter makes them once per loaded holoware.
fn leak(text: String) -> &'static str {
    Box::leak(text.into_boxed_str())
}

struct Vars {
    inputs: HashMap<String, String>,
    bound: HashMap<String, String>,
    /// Every variable a sampler binds: never read from the row, as in generated code.
    bindings: Arc<[String]>,
}

impl Variables for Vars {
    fn get(&self, name: &str) -> Option<&str> {
        if self.bindings.iter().any(|binding| binding == name) {
            return self.bound.get(name).map(String::as_str);
        }
        self.inputs.get(name).map(String::as_str)
    }
}

/// One interpreted rollout.
pub struct Interpreter {
    holoware: Arc<Holoware>,
    variables: Vars,
    pc: usize,
    awaiting: bool,
    finished: bool,
    role: Option<Role>,
    passes: Vec<u32>,
    instances: Vec<Box<dyn DynHolotype>>,
}

impl Interpreter {
    /// The text each sampler has bound so far.
    pub fn bindings(&self) -> &HashMap<String, String> {
        &self.variables.bound
    }

    fn holotype_error(&self, instance: usize, error: HolotypeError) -> RolloutError {
        RolloutError::Holotype {
            location: self.holoware.args[instance].location,
            error,
        }
    }

    fn finish(&mut self, recorder: &mut dyn Recorder) -> Result<Step, RolloutError> {
        self.finished = true;
        for instance in 0..self.instances.len() {
            let mut cx = Cx::new(recorder, &self.variables, self.passes[instance]);
            self.instances[instance]
                .end(&mut cx)
                .map_err(|error| self.holotype_error(instance, error))?;
        }
        Ok(Step::Done)
    }
}

impl Rollout for Interpreter {
    fn step(&mut self, recorder: &mut dyn Recorder) -> Result<Step, RolloutError> {
        if self.awaiting {
            return Err(RolloutError::Protocol(
                "step called while a completion is awaited",
            ));
        }
        if self.finished {
            return Ok(Step::Done);
        }
        let holoware = Arc::clone(&self.holoware);
        let ops = &holoware.program.ops;
        while let Some(op) = ops.get(self.pc) {
            let next = self.pc + 1;
            match &op.kind {
                OpKind::Context { trained, template } => {
                    recorder.begin_context(*trained);
                    if !template.is_empty() {
                        let arguments: Vec<(&str, TemplateArg<'_>)> = template
                            .iter()
                            .map(|argument| {
                                let value = match &argument.value {
                                    TemplateValue::Bool(value) => TemplateArg::Bool(*value),
                                    TemplateValue::Number(value) => TemplateArg::Number(*value),
                                    TemplateValue::Text(text) => TemplateArg::Text(text),
                                };
                                (argument.name.as_str(), value)
                            })
                            .collect();
                        recorder.template_arguments(&arguments).map_err(|error| {
                            RolloutError::Template {
                                location: holoware.locations[self.pc],
                                error,
                            }
                        })?;
                    }
                    self.role = None;
                    self.pc = next;
                }
                OpKind::Role { role } => {
                    recorder.begin_message(*role);
                    self.role = Some(*role);
                    self.pc = next;
                }
                OpKind::Text { text } => {
                    recorder.text(text);
                    self.pc = next;
                }
                OpKind::Insert { alternatives } => {
                    let value = alternatives.iter().find_map(|source| match source {
                        Source::Literal(text) => Some(text.as_str()),
                        Source::Variable(name) => self.variables.get(name),
                    });
                    let Some(value) = value else {
                        return Err(RolloutError::MissingVariable {
                            location: holoware.locations[self.pc],
                            alternatives: holoware.alternatives[self.pc],
                        });
                    };
                    recorder.text(value);
                    self.pc = next;
                }
                OpKind::Sample(sample) => {
                    if self.role != Some(Role::Assistant) {
                        recorder.begin_message(Role::Assistant);
                        self.role = Some(Role::Assistant);
                    }
                    if let Some(fence) = &sample.fence {
                        recorder.text(&format!("<{fence}>"));
                    }
                    self.awaiting = true;
                    let stop = sample
                        .fence
                        .iter()
                        .map(|fence| format!("</{fence}>"))
                        .chain(sample.stop.iter().cloned())
                        .collect();
                    let (binding, fence) = holoware.samples[self.pc];
                    let location = holoware.locations[self.pc];
                    let constraint = match &sample.constraint_variable {
                        Some(variable) => Some(
                            Constraint::of_variable(
                                variable.argument,
                                &variable.name,
                                self.variables.get(&variable.name),
                                fence,
                            )
                            .map_err(|error| RolloutError::Constraint { location, error })?,
                        ),
                        None => sample.constraint.as_ref().map(Constraint::from),
                    };
                    return Ok(Step::Sample(SampleRequest {
                        binding,
                        fence,
                        max_tokens: sample.max_tokens,
                        temperature: sample.temperature,
                        top_p: sample.top_p,
                        top_k: sample.top_k,
                        stop,
                        constraint,
                        location,
                    }));
                }
                OpKind::Holotype { instance, body_end } => {
                    let instance = *instance;
                    if body_end.is_some() {
                        self.passes[instance] = 0;
                    }
                    let mut cx = Cx::new(recorder, &self.variables, self.passes[instance]);
                    let enter = self.instances[instance]
                        .enter(&mut cx)
                        .map_err(|error| self.holotype_error(instance, error))?;
                    self.pc = match (enter, body_end) {
                        (Enter::Stop, _) => return self.finish(recorder),
                        (Enter::Skip, Some(end)) => end + 1,
                        _ => next,
                    };
                }
                OpKind::EndBody {
                    instance,
                    body_start,
                } => {
                    let instance = *instance;
                    self.passes[instance] += 1;
                    let mut cx = Cx::new(recorder, &self.variables, self.passes[instance]);
                    let pass = self.instances[instance]
                        .end_pass(&mut cx)
                        .map_err(|error| self.holotype_error(instance, error))?;
                    self.pc = match pass {
                        Pass::Repeat => *body_start,
                        Pass::Done => next,
                        Pass::Stop => return self.finish(recorder),
                    };
                }
            }
        }
        self.finish(recorder)
    }

    fn resume(
        &mut self,
        completion: Completion,
        recorder: &mut dyn Recorder,
    ) -> Result<(), RolloutError> {
        if !self.awaiting {
            return Err(RolloutError::Protocol(
                "resume called without a pending sample request",
            ));
        }
        let Some(OpKind::Sample(sample)) =
            self.holoware.program.ops.get(self.pc).map(|op| &op.kind)
        else {
            return Err(RolloutError::Protocol(
                "resume called in a state that does not sample",
            ));
        };
        self.awaiting = false;
        recorder.completion(&completion);
        if let Some(fence) = &sample.fence {
            if !completion.closes_fence(fence) {
                recorder.text(&format!("</{fence}>"));
            }
        }
        if let Some(binding) = &sample.binding {
            let text = completion.bound_text(sample.fence.as_deref()).to_string();
            self.variables.bound.insert(binding.clone(), text);
        }
        self.pc += 1;
        Ok(())
    }
}
