//! What a Holoware environment is made of, and what turns it into token-exact records: the layer of
//! `holo-runtime` that needs neither a model nor an HTTP server. Users reach it through
//! `holo_runtime`, which re-exports every item here at the same path.
//!
//! - [`Holotype`]: the trait user types implement to inject text, run tools, loop over bodies and give
//!   rewards; the `.hol` file refers to them by name.
//! - [`Machine`]: the sans-IO state machine that `include_holoware!` generates for a `.hol` file. It
//!   returns sample requests and never calls a model itself.
//! - [`Recorder`]: where a machine writes what happens (contexts, messages, text, completions, rewards);
//!   [`Transcript`] is the readable one used by tests and dry runs.
//! - [`interpreter`]: the same machines from a `.hol` file read at run time; [`holophore`]: a rollout
//!   in token space; [`loom`]: many rollouts at once against one [`Sampler`].
//! - [`Constraint`]: what a completion must match (structured output), enforced by the samplers that
//!   can; [`tools`]: the formats in which models write native tool calls.

pub mod chat;
pub mod constraint;
mod error;
pub mod export;
pub mod holophore;
pub mod holotype;
pub mod holotypes;
pub mod interpreter;
#[doc(hidden)]
pub mod json;
pub mod loom;
pub mod machine;
pub mod openai;
pub mod peft;
pub mod resources;
pub mod sampler;
pub mod scripted;
pub mod stop;
pub mod text;
pub mod tools;
pub mod transcript;
pub mod trim;

pub use holo_sandbox as sandbox;
pub use holoc::ir::{ArgValue, Role};
pub use holotype::{AnswerCheck, Args, Cx, Enter, Holotype, HolotypeError, Pass, Variables};
pub use machine::{
    Completion, Finish, Machine, Recorder, Rollout, RolloutError, SampleRequest, Step, TemplateArg,
};
pub use openai::{OpenAi, OpenAiConfig};
pub use resources::Resources;
pub use sampler::{
    Allowed, ChatMessage, Constraint, Prompt, Request, SampleParams, Sampler, SamplerError,
    TokenSink,
};
pub use scripted::Scripted;
pub use text::Text;
pub use transcript::Transcript;

/// This crate's version: the built-in holotypes' (a training run's provenance records it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Re-exported for generated code, so user crates need no direct serde dependency.
pub use serde;

/// Items generated code refers to; not part of the stable API.
#[doc(hidden)]
pub mod __private {
    pub use crate::holotype::{assert_holotype, has_param};

    /// A sampler tag's `json_schema=` argument, as holoc checked it.
    pub fn json_schema(text: &str) -> crate::Constraint {
        crate::Constraint::from(&holoc::ir::Constraint::JsonSchema(text.to_string()))
    }

    pub use holoc::ir::ConstraintArgument;

    /// A sampler tag's `json_schema=name`, `regex=name` or `grammar=name`, with the variable's value
    /// when the sampler runs.
    pub fn constraint_of(
        argument: ConstraintArgument,
        variable: &str,
        value: Option<&str>,
        fence: Option<&str>,
        location: &'static str,
    ) -> Result<crate::Constraint, crate::RolloutError> {
        crate::Constraint::of_variable(argument, variable, value, fence)
            .map_err(|error| crate::RolloutError::Constraint { location, error })
    }
}
