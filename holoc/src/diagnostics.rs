//! One renderer-independent diagnostic type and the catalogue of error codes.
//!
//! Every check in the front end reports a [`Diagnostic`] with a stable [`Code`]; `holoc explain CODE`
//! prints the catalogue entry. The CLI renders diagnostics with codespan-reporting (see `report`), the
//! proc-macro renders them as plain text inside `compile_error!`.

use std::fmt;

use serde::Serialize;

use crate::span::Span;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Warning,
    Error,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    pub span: Span,
    pub message: String,
    pub primary: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub severity: Severity,
    pub code: Code,
    pub message: String,
    pub labels: Vec<Label>,
    pub help: Option<String>,
    pub notes: Vec<String>,
}

impl Diagnostic {
    /// An error of `code` whose primary label is `label` at `span`.
    pub fn new(
        code: Code,
        message: impl Into<String>,
        span: Span,
        label: impl Into<String>,
    ) -> Self {
        Diagnostic {
            severity: code.severity(),
            code,
            message: message.into(),
            labels: vec![Label {
                span,
                message: label.into(),
                primary: true,
            }],
            help: None,
            notes: Vec::new(),
        }
    }

    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.notes.push(note.into());
        self
    }

    pub fn with_secondary(mut self, span: Span, message: impl Into<String>) -> Self {
        self.labels.push(Label {
            span,
            message: message.into(),
            primary: false,
        });
        self
    }

    /// The span of the primary label.
    pub fn span(&self) -> Span {
        self.labels
            .iter()
            .find(|label| label.primary)
            .map(|label| label.span)
            .unwrap_or_default()
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

macro_rules! codes {
    ($($variant:ident = $id:literal, $severity:ident, $title:literal, $explanation:literal;)*) => {
        /// The catalogue of diagnostics. Codes are stable: a code is never reused for another check.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Code {
            $($variant,)*
        }

        impl Code {
            pub const ALL: &'static [Code] = &[$(Code::$variant,)*];

            /// The stable identifier, such as `H0005`.
            pub fn id(self) -> &'static str {
                match self { $(Code::$variant => $id,)* }
            }

            pub fn severity(self) -> Severity {
                match self { $(Code::$variant => Severity::$severity,)* }
            }

            /// A one-line summary of the check.
            pub fn title(self) -> &'static str {
                match self { $(Code::$variant => $title,)* }
            }

            /// What the check enforces and how to fix it; printed by `holoc explain`.
            pub fn explanation(self) -> &'static str {
                match self { $(Code::$variant => $explanation,)* }
            }
        }
    };
}

codes! {
    InvalidUtf8 = "H0001", Error, "file is not valid UTF-8",
        "A .hol file must be UTF-8 text. The diagnostic points at the first byte that is not valid UTF-8; \
         re-save the file as UTF-8.";
    UnclosedTag = "H0002", Error, "unclosed tag",
        "Every `<|` opens a tag that must be closed by `|>` on the same line. To write a literal `<|` in \
         text, escape it as `\\<|`.";
    UnbalancedQuote = "H0003", Error, "unbalanced quote inside a tag",
        "A quoted argument inside a tag must end on the same line with the quote that opened it: \
         `stop=\"</answer>\"`. Inside double quotes, `\\\"` and `\\\\` are escapes.";
    UnexpectedCharacter = "H0004", Error, "unexpected character inside a tag",
        "Inside `<|...|>` only names, numbers, quoted strings and the punctuation `= : | <> /` may appear. \
         Quote values that contain other characters: `stop=\"</answer>\"`.";
    Syntax = "H0005", Error, "syntax error in a tag",
        "The tag does not follow the grammar of docs/holoware.md: a head (a role such as `@_@`, a context \
         marker such as `+++`, a holotype name, variable names separated by `|`, or `/Name`) followed by \
         arguments (`key=value`, `<>fence`, or a positional value).";
    StrayClosingTag = "H0006", Error, "closing tag without a body to close",
        "A closing tag `<|/Name|>` may only follow, on its own line and at the same indentation as the opening \
         tag, the indented body of a `<|Name|>` tag. Bodies are delimited by indentation; the closing tag only \
         marks the end explicitly.";
    MismatchedClosingTag = "H0007", Error, "closing tag does not match the body it follows",
        "The closing tag names a different holotype than the body that ends just before it. Bodies are \
         delimited by indentation: check that the body of the holotype you meant ends here.";
    TabIndentation = "H0008", Error, "tab in body indentation",
        "Bodies are indented with spaces only, because a tab has no agreed width. Replace the tabs in the \
         line's indentation with spaces.";
    InconsistentIndentation = "H0009", Error, "inconsistent indentation",
        "A line that ends a body must return exactly to the indentation of an enclosing level. This line is \
         indented less than the body before it but more than the tag that opened that body.";
    SamplerRole = "H0010", Error, "only the assistant role samples",
        "A binding (`:name`), a fence (`<>name`) or generation arguments make a tag a sampler, and only the \
         assistant role `@_@` is sampled from the model. Use `<|@_@:name|>`.";
    MultipleFences = "H0011", Error, "sampler has more than one fence",
        "A sampler takes at most one fence: `<|@_@:answer <>think|>` wraps the sampled text in \
         `<think>...</think>`.";
    InvalidFence = "H0012", Error, "fence name is not an identifier",
        "A fence name is an identifier (letters, digits and `_`, not starting with a digit), used as the \
         XML-like tag around the sampled text.";
    InvalidBinding = "H0013", Error, "binding name is not a variable name",
        "The name after `@_@:` is the variable that receives the sampled text. It must be an identifier that \
         starts with a lowercase letter or `_`, because a capitalised name is a holotype.";
    UnknownSamplerArgument = "H0014", Error, "unknown sampler argument",
        "Samplers accept exactly these generation arguments: max_tokens (integer >= 1), temperature \
         (number >= 0), top_p (0 < p <= 1), top_k (integer >= 0) and stop (string, repeatable).";
    InvalidSamplerArgument = "H0015", Error, "invalid value for a sampler argument",
        "max_tokens is an integer >= 1, temperature a number >= 0, top_p a number in (0, 1], top_k an \
         integer >= 0 (0 disables it), stop a string; json_schema a quoted JSON schema (an object or a \
         boolean), regex a quoted regular expression that parses, grammar a quoted Lark grammar, each \
         of the three or the name of the variable that holds it.";
    PositionalSamplerArgument = "H0016", Error, "positional argument on a sampler",
        "Sampler arguments are written `key=value`; a bare word is not an argument. A fence is written \
         `<>name`.";
    DuplicateArgument = "H0017", Error, "argument given twice",
        "Each argument may be given once per tag, except a sampler's `stop`, which may be repeated to give \
         several stop strings.";
    UnexpectedArguments = "H0018", Error, "this tag takes no arguments",
        "Role switches (`o_o`, `x_x` and a bare `@_@`), closing tags and variables take no arguments. \
         Arguments on `@_@` make it a sampler; a binding, a fence or generation arguments on `o_o` or \
         `x_x` are H0010. Context markers (`+++`, `===` and its aliases) take only the chat template's \
         arguments for their context, `name=value` with a finite number, `true`/`false` or text \
         (`<|+++ enable_thinking=false|>`): a bare value or a fence on one is H0018.";
    InvalidVariable = "H0019", Error, "invalid variable name",
        "A variable name is an identifier that starts with a lowercase letter or `_`. Names that start with \
         an uppercase letter are holotypes.";
    HolotypeAlternative = "H0020", Error, "holotype used as an alternative",
        "`<|a|b|>` lists variables (or quoted defaults) of which the first present is inserted. Holotypes \
         cannot be alternatives; give the holotype its own tag.";
    UseBeforeBind = "H0021", Error, "variable used before it is bound",
        "A variable bound by a sampler (`<|@_@:name|>`) can only be used after that sampler has run, in \
         execution order. A body may run zero times, so a variable bound only inside a body is not bound \
         after it; and on the first pass through a body, variables bound later in the body are not bound \
         yet. Use an alternative with a default, `<|name|\"\"|>`, where absence is expected. A sampler's \
         `json_schema=name`, `regex=name` or `grammar=name` is a use too, and has no default: the \
         sampler that binds `name` runs before it.";
    MisplacedFence = "H0022", Error, "fence on a holotype",
        "A fence `<>name` belongs to a sampler (`<|@_@ <>name|>`); holotypes take no fence. (On a variable, \
         a context marker or a closing tag, any argument is H0018.)";
    InvalidArgumentName = "H0023", Error, "argument name is not an identifier",
        "Keyword arguments are written `name=value` where name is an identifier.";
    NestingTooDeep = "H0024", Error, "bodies nested too deeply",
        "Bodies may be nested at most 64 levels deep.";
    InvalidHolotypeName = "H0025", Error, "holotype name is not an identifier",
        "A capitalised head names a holotype, which is a Rust type: letters, digits and `_` only.";
    UnknownHolotype = "H0026", Error, "unknown holotype",
        "No type of this name implements `Holotype` in the crate that holds the .hol file (its build.rs, src/, \
         examples/, tests/ and benches/ were scanned), and it is not a built-in. Check the spelling, or define it.";
    NotAHolotype = "H0027", Error, "type does not implement Holotype",
        "The crate declares a type of this name, but no `impl Holotype for` it was found.";
    UnknownHolotypeArgument = "H0028", Error, "unknown holotype argument",
        "Keyword arguments of a holotype tag must be among the names its `Holotype::PARAMS` declares.";
    InvalidHolotypeArgument = "H0029", Error, "invalid argument for a built-in holotype",
        "An argument of one of the runtime's built-in holotypes has a value its constructor refuses, or is a \
         positional argument it does not take; every rollout would fail where the holotype starts. What each \
         accepts: ToolRunner max_turns (an integer >= 1), var, answer (names); ToolExecutor answer, one \
         positional variable name; CodeExecutor timeout (seconds, above 0, at most 86400), python (a \
         command), max_output (an integer >= 1), answer, memory (MiB, >= 16), processes (>= 1), cpu_seconds \
         (>= 1), file_size (MiB, >= 1), open_files (>= 8), work_size (MiB, >= 1), one positional variable \
         name; ExactAnswer, MathAnswer, FormatReward, LengthPenalty var, target, tag, name (names), weight (a \
         number), ExactAnswer and MathAnswer pass (`true` or `false`), MathAnswer untagged (`whole` or `last_number`), FormatReward tags (one or more names), \
         LengthPenalty max (an integer >= 1); Retry, Feedback, Score one positional component name or score \
         (a name), Retry threshold (a number); Memory top_k (an integer >= 0), empty (text); Remember one \
         positional variable name, score (a name), threshold (a number). A name is a word or a non-empty \
         quoted string. A holotype of the crate with the same name shadows the built-in and is not checked \
         here.";
    MissingHolotypeArgument = "H0030", Error, "missing argument for a built-in holotype",
        "Retry, Feedback and Score read a reward component that an earlier reward holotype recorded: name it, \
         as in `<|Retry first|>` or `<|Retry score=first|>`. Remember needs the variable it remembers and the \
         component that decides: `<|Remember reflection score=second|>`.";
    ConflictingConstraints = "H0031", Error, "sampler has more than one constraint",
        "A sampler's text can be held to one language: `json=object`, `json_schema=\"...\"` (or \
         `json_schema_file=\"path.json\"`), `regex=\"...\"`, `choice=...` (repeatable: one text per argument) or `grammar=\"...\"` (Lark). Keep one of them; to \
         allow several forms, write them as one regex or grammar.";
    UnresolvedHolotype = "H0100", Warning, "unresolved holotype",
        "The holotype is not one of the runtime's built-ins, and the file is not inside a crate (no Cargo.toml \
         with a [package] above it; a virtual workspace root does not count), so no crate could be scanned. The crate build (include_holoware!) \
         checks it. Pass --deny-warnings to make this fail the check.";
    UnreachableAlternative = "H0101", Warning, "unreachable alternative",
        "A quoted default is always present, so alternatives after it in `<|a|\"default\"|b|>` are never used.";
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id())
    }
}

impl Code {
    pub fn from_id(id: &str) -> Option<Code> {
        Code::ALL
            .iter()
            .copied()
            .find(|code| code.id().eq_ignore_ascii_case(id))
    }
}
