//! The runtime's built-in holotypes (`holo_runtime::holotypes`) as the checker knows them: their names,
//! their keyword parameters and the values each parameter accepts, and what their positional arguments
//! are. With this table `holoc check` and the macros reject `<|MathAnswer weight=abc|>` where it is
//! written, instead of every rollout failing when the runtime constructs the holotype.
//!
//! The runtime's constructors are the truth: a test in holo-core (`tests/core/holotypes.rs`) constructs
//! every built-in with a range of values for every parameter and positional argument, and requires the
//! checker to accept exactly what the constructor accepts.

use crate::ir::{ArgValue, HolotypeArg};

/// One built-in holotype.
#[derive(Debug, Clone, Copy)]
pub struct Builtin {
    pub name: &'static str,
    /// Its keyword parameters (`Holotype::PARAMS`, in that order) with the values they accept.
    pub params: &'static [Param],
    /// What its positional arguments are.
    pub positional: Positional,
}

/// A keyword parameter and the values it accepts.
#[derive(Debug, Clone, Copy)]
pub struct Param {
    pub name: &'static str,
    pub accepts: Accepts,
}

/// The values a parameter accepts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Accepts {
    /// A word or a quoted string.
    Text,
    /// A word or a quoted string that is not empty.
    NonEmptyText,
    /// A word or a quoted string of one or more space-separated names (`tags="reasoning answer"`).
    Names,
    /// One of these words (or the same text quoted).
    OneOf(&'static [&'static str]),
    /// A number: an integer or a decimal.
    Number,
    /// A number above 0 and at most `max`.
    Positive { max: f64 },
    /// An integer from `min` to 4294967295 (a `u32`).
    Count { min: u32 },
}

/// What a built-in does with positional arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Positional {
    /// It takes none.
    None,
    /// At most one, a word or a quoted string: the variable it reads (`<|ToolExecutor turn|>`); without
    /// one it reads `turn`.
    Variable,
    /// The reward component it reads: one positional word (`<|Retry first|>`) or `score=`; one of them
    /// is required.
    Component,
    /// One positional word, the variable (`<|Remember reflection score=second|>`), and `score=`; both are
    /// required.
    VariableAndScore,
}

const fn param(name: &'static str, accepts: Accepts) -> Param {
    Param { name, accepts }
}

/// The keyword parameters every reward holotype shares.
macro_rules! reward_params {
    ($($extra:expr),*) => {
        &[
            param("var", Accepts::NonEmptyText),
            $($extra,)*
            param("weight", Accepts::Number),
            param("name", Accepts::NonEmptyText),
        ]
    };
}

/// The reward component a gate reads and the value it compares with (`Retry`, `Remember`).
const SCORE_AND_THRESHOLD: &[Param] = &[
    param("score", Accepts::NonEmptyText),
    param("threshold", Accepts::Number),
];

/// Every built-in holotype (the language server documents them in this order).
pub const BUILTINS: &[Builtin] = &[
    Builtin {
        name: "ToolRunner",
        params: &[
            param("max_turns", Accepts::Count { min: 1 }),
            param("var", Accepts::NonEmptyText),
            param("answer", Accepts::NonEmptyText),
        ],
        positional: Positional::None,
    },
    Builtin {
        name: "ToolSchema",
        // vLLM's `--tool-call-parser` names (holo_runtime::tools::ToolFormat::NAMES), or `auto`.
        params: &[param(
            "parser",
            Accepts::OneOf(&["auto", "hermes", "llama3_json", "mistral", "openai"]),
        )],
        positional: Positional::None,
    },
    Builtin {
        name: "ToolExecutor",
        params: &[param("answer", Accepts::NonEmptyText)],
        positional: Positional::Variable,
    },
    Builtin {
        name: "CodeExecutor",
        params: &[
            param("timeout", Accepts::Positive { max: 86_400.0 }),
            param("python", Accepts::NonEmptyText),
            param("max_output", Accepts::Count { min: 1 }),
            param("answer", Accepts::NonEmptyText),
            // The sandbox's limits (holo_runtime::sandbox::Limits::validate): MiB for sizes.
            param("memory", Accepts::Count { min: 16 }),
            param("processes", Accepts::Count { min: 1 }),
            param("cpu_seconds", Accepts::Count { min: 1 }),
            param("file_size", Accepts::Count { min: 1 }),
            param("open_files", Accepts::Count { min: 8 }),
            param("work_size", Accepts::Count { min: 1 }),
        ],
        positional: Positional::Variable,
    },
    Builtin {
        name: "ExactAnswer",
        params: reward_params!(
            param("target", Accepts::NonEmptyText),
            param("tag", Accepts::NonEmptyText),
            param("pass", Accepts::OneOf(&["true", "false"]))
        ),
        positional: Positional::None,
    },
    Builtin {
        name: "MathAnswer",
        params: reward_params!(
            param("target", Accepts::NonEmptyText),
            param("tag", Accepts::NonEmptyText),
            param("untagged", Accepts::OneOf(&["whole", "last_number"])),
            param("pass", Accepts::OneOf(&["true", "false"]))
        ),
        positional: Positional::None,
    },
    Builtin {
        name: "FormatReward",
        params: reward_params!(param("tags", Accepts::Names)),
        positional: Positional::None,
    },
    Builtin {
        name: "LengthPenalty",
        params: reward_params!(param("max", Accepts::Count { min: 1 })),
        positional: Positional::None,
    },
    Builtin {
        name: "Retry",
        params: SCORE_AND_THRESHOLD,
        positional: Positional::Component,
    },
    Builtin {
        name: "Feedback",
        params: &[param("score", Accepts::NonEmptyText)],
        positional: Positional::Component,
    },
    Builtin {
        name: "Score",
        params: &[param("score", Accepts::NonEmptyText)],
        positional: Positional::Component,
    },
    Builtin {
        name: "Memory",
        params: &[
            param("top_k", Accepts::Count { min: 0 }),
            param("empty", Accepts::Text),
        ],
        positional: Positional::None,
    },
    Builtin {
        name: "Remember",
        params: SCORE_AND_THRESHOLD,
        positional: Positional::VariableAndScore,
    },
];

/// The built-in named `name`.
pub fn builtin(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|builtin| builtin.name == name)
}

impl Accepts {
    /// Why `value` is not accepted (completing "must be ..."), or `None` when it is.
    pub fn refuses(&self, value: &ArgValue) -> Option<String> {
        let text = match value {
            ArgValue::Word(text) | ArgValue::Str(text) => Some(text.as_str()),
            ArgValue::Int(_) | ArgValue::Float(_) => None,
        };
        let number = match value {
            ArgValue::Int(int) => Some(*int as f64),
            ArgValue::Float(float) => Some(*float),
            ArgValue::Word(_) | ArgValue::Str(_) => None,
        };
        let accepted = match *self {
            Accepts::Text => text.is_some(),
            Accepts::NonEmptyText => text.is_some_and(|text| !text.is_empty()),
            Accepts::Names => text.is_some_and(|text| text.split_whitespace().next().is_some()),
            Accepts::OneOf(words) => text.is_some_and(|text| words.contains(&text)),
            Accepts::Number => number.is_some(),
            Accepts::Positive { max } => number.is_some_and(|number| number > 0.0 && number <= max),
            Accepts::Count { min } => matches!(value,
                ArgValue::Int(int) if *int >= i64::from(min) && *int <= i64::from(u32::MAX)),
        };
        (!accepted).then(|| self.description())
    }

    /// What it accepts, as in "`weight` must be a number".
    pub fn description(&self) -> String {
        match *self {
            Accepts::Text => "a word or a quoted string".into(),
            Accepts::NonEmptyText => "a word or a non-empty quoted string".into(),
            Accepts::Names => "one or more names, as in `\"reasoning answer\"`".into(),
            Accepts::OneOf(words) => words
                .iter()
                .map(|word| format!("`{word}`"))
                .collect::<Vec<_>>()
                .join(" or "),
            Accepts::Number => "a number".into(),
            Accepts::Positive { max } => format!("a number above 0 and at most {max}"),
            Accepts::Count { min } => format!("an integer from {min} to {}", u32::MAX),
        }
    }
}

/// A problem with a built-in's arguments, found by [`check`].
#[derive(Debug, Clone, PartialEq)]
pub enum Problem {
    /// The argument at `index` of the tag's arguments has a value its parameter refuses.
    Invalid { index: usize, expected: String },
    /// The positional argument at `index` is one too many, or one the holotype does not take.
    ExtraPositional { index: usize },
    /// A required argument is missing; the text says which, as in "the name of a reward component".
    Missing {
        what: &'static str,
        example: &'static str,
    },
}

/// Checks a built-in's arguments (keyword names already checked against [`Builtin::params`]).
pub fn check(builtin: &Builtin, args: &[HolotypeArg]) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut positional = 0;
    for (index, arg) in args.iter().enumerate() {
        match &arg.name {
            Some(name) => {
                let Some(param) = builtin.params.iter().find(|param| param.name == name) else {
                    continue;
                };
                if let Some(expected) = param.accepts.refuses(&arg.value) {
                    problems.push(Problem::Invalid { index, expected });
                }
            }
            None => {
                positional += 1;
                if builtin.positional == Positional::None || positional > 1 {
                    problems.push(Problem::ExtraPositional { index });
                } else if let Some(expected) = Accepts::NonEmptyText.refuses(&arg.value) {
                    problems.push(Problem::Invalid { index, expected });
                }
            }
        }
    }
    let has_score = args.iter().any(|arg| arg.name.as_deref() == Some("score"));
    match builtin.positional {
        Positional::Component if positional == 0 && !has_score => problems.push(Problem::Missing {
            what: "the name of a reward component",
            example: "first",
        }),
        Positional::VariableAndScore => {
            if positional == 0 {
                problems.push(Problem::Missing {
                    what: "the variable to remember",
                    example: "reflection score=second",
                });
            }
            if !has_score {
                problems.push(Problem::Missing {
                    what: "`score=`, the reward component that decides",
                    example: "reflection score=second",
                });
            }
        }
        _ => {}
    }
    problems
}
