//! The [`Holotype`] trait: Rust types that a `.hol` file names with a capitalised tag, such as
//! `<|ToolRunner max_turns=8|>`.
//!
//! A machine constructs each holotype tag's instance once per rollout from the tag's arguments
//! ([`Holotype::new`]), calls [`Holotype::enter`] each time execution reaches the tag, [`Holotype::end_pass`]
//! at the end of each pass through its body, and [`Holotype::end`] once when the rollout ends.

pub use holoc::ir::ArgValue;

pub use crate::error::HolotypeError;
use crate::machine::Recorder;
use crate::resources::Resources;
use crate::tools::{ToolFormat, ToolReply};

/// A type usable as a holotype in `.hol` files.
///
/// ```
/// use holo_core::{Args, Cx, Enter, Holotype, HolotypeError, Pass};
///
/// /// Repeats its body up to `max_turns` times.
/// struct Repeat { max_turns: u32 }
///
/// impl Holotype for Repeat {
///     const PARAMS: &'static [&'static str] = &["max_turns"];
///
///     fn new(args: &Args) -> Result<Self, HolotypeError> {
///         Ok(Repeat { max_turns: args.int("max_turns")?.unwrap_or(3) as u32 })
///     }
///
///     fn end_pass(&mut self, cx: &mut Cx<'_>) -> Result<Pass, HolotypeError> {
///         Ok(if cx.pass() < self.max_turns { Pass::Repeat } else { Pass::Done })
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is used as a holotype in a .hol file but does not implement `Holotype`",
    label = "named by a holotype tag of this .hol file",
    note = "implement `holo_runtime::Holotype` for `{Self}`, or fix the name in the .hol file"
)]
pub trait Holotype: Sized {
    /// The keyword arguments the tag may give (`<|Name key=value|>`). The `.hol` file's keywords are
    /// checked against this list when the crate compiles.
    const PARAMS: &'static [&'static str];

    /// Whether `enter`, `end_pass` or `end` may hold the thread for long: run a process, wait on the
    /// network or a lock. The Loom steps the rollouts of a holoware that names such a holotype on
    /// Tokio's blocking pool, so that they run beside each other and never stall the thread that sends
    /// the other rollouts' samples; the others it steps in place, in a deterministic order.
    const BLOCKS: bool = false;

    /// Builds the instance from the tag's arguments, once per rollout.
    fn new(args: &Args) -> Result<Self, HolotypeError>;

    /// Execution reached the tag: write text with [`Cx::inject`], then run or skip the body, or stop.
    /// For a tag without a body, `Run` and `Skip` both go on. The default runs the body.
    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        let _ = cx;
        Ok(Enter::Run)
    }

    /// A pass through the body ended: repeat it, go on after it, or stop. The default runs it once.
    fn end_pass(&mut self, cx: &mut Cx<'_>) -> Result<Pass, HolotypeError> {
        let _ = cx;
        Ok(Pass::Done)
    }

    /// The rollout ended (normally or by a stop): record rewards with [`Cx::reward`].
    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
        let _ = cx;
        Ok(())
    }

    /// The variables a tag with these arguments fails without, such as the data column a reward
    /// compares with (`target=`). Each one that no sampler of the holoware binds must be a column of
    /// every data row, which [`Holoware::check_row`](crate::interpreter::Holoware::check_row) checks
    /// before any rollout. Arguments the constructor refuses may be ignored here. The default needs
    /// none.
    fn needs(args: &Args) -> Vec<String> {
        let _ = args;
        Vec::new()
    }

    /// The reward component a tag with these arguments records when it checks whether the answer is
    /// right (the built-in `ExactAnswer` and `MathAnswer`): pass@k counts a rollout as passing when that
    /// component has full credit (≥ 1), never on the total reward, which format bonuses and length
    /// penalties move. A holoware with several answer checks marks the one pass@k counts with `pass=true`
    /// ([`Holoware::pass_component`](crate::interpreter::Holoware::pass_component)). Arguments the
    /// constructor refuses may be ignored here. The default: the holotype checks no answer.
    fn answer_check(args: &Args) -> Option<AnswerCheck> {
        let _ = args;
        None
    }
}

/// A tag that checks answers ([`Holotype::answer_check`]): the component it records, and its `pass=`
/// mark (`Some(true)`: the one pass@k counts; `Some(false)`: never that one; `None`: unmarked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerCheck {
    pub component: String,
    pub pass: Option<bool>,
}

/// What to do when execution reaches a holotype tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enter {
    /// Run the body (or, without a body, go on).
    Run,
    /// Skip the body.
    Skip,
    /// End the rollout here.
    Stop,
}

/// What to do after a pass through a holotype's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Repeat,
    Done,
    /// End the rollout here.
    Stop,
}

/// Variables visible to holotypes: the data row's inputs and what samplers have bound so far.
pub trait Variables {
    fn get(&self, name: &str) -> Option<&str>;
}

/// What a holotype hook can see and do.
pub struct Cx<'a> {
    recorder: &'a mut dyn Recorder,
    variables: &'a dyn Variables,
    pass: u32,
}

impl<'a> Cx<'a> {
    pub fn new(recorder: &'a mut dyn Recorder, variables: &'a dyn Variables, pass: u32) -> Self {
        Cx {
            recorder,
            variables,
            pass,
        }
    }

    /// The value of a variable: an input, or the text a sampler bound.
    pub fn var(&self, name: &str) -> Option<&str> {
        self.variables.get(name)
    }

    /// Appends text to the current message, as if the `.hol` file had it in place of the tag.
    pub fn inject(&mut self, text: &str) {
        self.recorder.text(text);
    }

    /// Offers `tools` to the model through its chat template ([`Recorder::offer_tools`]).
    pub fn offer_tools(
        &mut self,
        tools: &[serde_json::Value],
        format: Option<ToolFormat>,
    ) -> Result<ToolFormat, String> {
        self.recorder.offer_tools(tools, format)
    }

    /// The format of the native tool calls offered, if any: `None` while tools are text.
    pub fn tool_format(&self) -> Option<ToolFormat> {
        self.recorder.tool_format()
    }

    /// Marks the last assistant message as making the calls of `reply` ([`Recorder::tool_calls`]).
    pub fn tool_calls(&mut self, reply: &ToolReply) {
        self.recorder.tool_calls(reply);
    }

    /// Appends a `tool` message with the result of a call of `name` whose id is `id`
    /// ([`Recorder::tool_result`]).
    pub fn tool_result(&mut self, name: &str, id: Option<&str>, content: &str) {
        self.recorder.tool_result(name, id, content);
    }

    /// `text`, a completion's text, as the model wrote it: with the special tokens its sampler's text
    /// lacks, when the recorder holds its tokens ([`Recorder::written`]); else `text` itself.
    pub fn written(&self, text: &str) -> String {
        self.recorder
            .written(text)
            .unwrap_or_else(|| text.to_string())
    }

    /// Records the reward component `name` of this rollout, with weight 1.
    pub fn reward(&mut self, name: &str, value: f64) {
        self.recorder.reward(name, value, 1.0);
    }

    /// Records the reward component `name` with a weight: the rollout's reward is the weighted sum.
    pub fn weighted_reward(&mut self, name: &str, value: f64, weight: f64) {
        self.recorder.reward(name, value, weight);
    }

    /// Records why reward component `name` got its value, in words a model can read: `<|Feedback name|>`
    /// writes it into a later prompt (ERL's reflection), and the rollout's record keeps it.
    pub fn feedback(&mut self, name: &str, text: &str) {
        self.recorder.feedback(name, text);
    }

    /// The value recorded so far for reward component `name` (by a reward holotype reached earlier).
    pub fn recorded_reward(&self, name: &str) -> Option<f64> {
        self.recorder.recorded_reward(name)
    }

    /// The feedback recorded so far for reward component `name`.
    pub fn recorded_feedback(&self, name: &str) -> Option<&str> {
        self.recorder.recorded_feedback(name)
    }

    /// Passes through the body completed so far, counting the one that just ended (in `end_pass`).
    pub fn pass(&self) -> u32 {
        self.pass
    }
}

/// The arguments of a holotype tag: positional values in order, and keyword values by name, with the
/// resources the driver provides.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Args {
    /// Where the tag is, as `file.hol:line:col`, for error messages.
    pub location: &'static str,
    pub positional: Vec<ArgValue>,
    pub keywords: Vec<(&'static str, ArgValue)>,
    pub resources: Resources,
}

impl Args {
    pub fn get(&self, name: &str) -> Option<&ArgValue> {
        self.keywords
            .iter()
            .find(|(key, _)| *key == name)
            .map(|(_, value)| value)
    }

    /// A keyword argument as an integer; an error if it is given with another type.
    pub fn int(&self, name: &str) -> Result<Option<i64>, HolotypeError> {
        match self.get(name) {
            None => Ok(None),
            Some(ArgValue::Int(value)) => Ok(Some(*value)),
            Some(other) => Err(self.type_error(name, "an integer", other)),
        }
    }

    /// A keyword argument as a number (integers are accepted).
    pub fn float(&self, name: &str) -> Result<Option<f64>, HolotypeError> {
        match self.get(name) {
            None => Ok(None),
            Some(ArgValue::Int(value)) => Ok(Some(*value as f64)),
            Some(ArgValue::Float(value)) => Ok(Some(*value)),
            Some(other) => Err(self.type_error(name, "a number", other)),
        }
    }

    /// A keyword argument as a non-negative integer.
    pub fn count(&self, name: &str) -> Result<Option<u32>, HolotypeError> {
        match self.int(name)? {
            None => Ok(None),
            Some(value) => u32::try_from(value).map(Some).map_err(|_| {
                HolotypeError::new(format!(
                    "argument `{name}` must be between 0 and {}, found {value}",
                    u32::MAX
                ))
            }),
        }
    }

    /// A keyword argument as text: a word or a quoted string.
    pub fn text(&self, name: &str) -> Result<Option<&str>, HolotypeError> {
        match self.get(name) {
            None => Ok(None),
            Some(ArgValue::Word(text) | ArgValue::Str(text)) => Ok(Some(text)),
            Some(other) => Err(self.type_error(name, "a word or a quoted string", other)),
        }
    }

    /// A keyword argument as a name: a word or a non-empty quoted string.
    pub fn name(&self, name: &str) -> Result<Option<&str>, HolotypeError> {
        match self.get(name) {
            Some(empty @ ArgValue::Str(text)) if text.is_empty() => {
                Err(self.type_error(name, "a word or a non-empty quoted string", empty))
            }
            _ => self.text(name),
        }
    }

    /// The one positional argument of a holotype that takes at most one, a name (a word or a non-empty
    /// quoted string), as the variable of `<|ToolExecutor turn|>`; an error naming `holotype` for any
    /// other value, or a second one.
    pub fn positional_name(&self, holotype: &str) -> Result<Option<&str>, HolotypeError> {
        match self.positional.as_slice() {
            [] => Ok(None),
            [ArgValue::Word(text) | ArgValue::Str(text)] if !text.is_empty() => Ok(Some(text)),
            [other] => Err(HolotypeError::new(format!(
                "the positional argument of {holotype} must be a word or a non-empty quoted string, found `{other}`"
            ))),
            [_, extra, ..] => Err(HolotypeError::new(format!(
                "{holotype} takes one positional argument, found a second: `{extra}`"
            ))),
        }
    }

    /// An error naming `holotype` when it was given a positional argument (it takes none: a stray word
    /// such as `<|MathAnswer guess|>` would otherwise be ignored in silence).
    pub fn no_positional(&self, holotype: &str) -> Result<(), HolotypeError> {
        match self.positional.first() {
            None => Ok(()),
            Some(value) => Err(HolotypeError::new(format!(
                "{holotype} takes no positional argument, found `{value}`"
            ))),
        }
    }

    /// The positional arguments that are words or strings, such as the variable names of
    /// `<|ToolExecutor turn|>`.
    pub fn words(&self) -> impl Iterator<Item = &str> {
        self.positional.iter().filter_map(|value| match value {
            ArgValue::Word(text) | ArgValue::Str(text) => Some(text.as_str()),
            _ => None,
        })
    }

    fn type_error(&self, name: &str, expected: &str, found: &ArgValue) -> HolotypeError {
        HolotypeError::new(format!(
            "argument `{name}` must be {expected}, found `{found}`"
        ))
    }
}

/// Whether holotype `T` declares the keyword parameter `name`. A `const fn`, so generated code can
/// assert it when the crate compiles.
pub const fn has_param<T: Holotype>(name: &str) -> bool {
    let params = T::PARAMS;
    let mut i = 0;
    while i < params.len() {
        if str_eq(params[i], name) {
            return true;
        }
        i += 1;
    }
    false
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// `T` used as a holotype at `LINE`:`COL` of a `.hol` file. Generated code asserts it for every holotype
/// tag, so that rustc's error for a type that is not a holotype names the tag's line and column.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is used as a holotype at line {LINE}, column {COL} of the .hol file, but does not implement `Holotype`",
    label = "the .hol file named by this literal uses it as a holotype",
    note = "implement `holo_runtime::Holotype` for `{Self}`, or fix the name in the .hol file"
)]
pub trait HolotypeAt<const LINE: u32, const COL: u32> {}

impl<T: Holotype, const LINE: u32, const COL: u32> HolotypeAt<LINE, COL> for T {}

/// Compiles only when `T` is a holotype; see [`HolotypeAt`].
pub const fn assert_holotype<T: HolotypeAt<LINE, COL>, const LINE: u32, const COL: u32>() {}
