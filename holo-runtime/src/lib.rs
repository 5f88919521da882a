//! The runtime that compiled holowares link against.
//!
//! - [`Holotype`]: the trait user types implement to inject text, run tools, loop over bodies and give
//!   rewards; the `.hol` file refers to them by name.
//! - [`Machine`]: the sans-IO state machine that `include_holoware!` generates for a `.hol` file. It
//!   returns sample requests and never calls a model itself.
//! - [`Recorder`]: where a machine writes what happens (contexts, messages, text, completions, rewards);
//!   [`Transcript`] is the readable one used by tests and dry runs.

pub mod chat;
#[cfg(feature = "local")]
pub mod demo;
pub mod engines;
pub mod export;
pub mod holophore;
pub mod holotype;
pub mod holotypes;
pub mod interpreter;
mod json;
#[cfg(feature = "local")]
pub mod local;
pub mod loom;
pub mod machine;
pub mod memory;
pub mod openai;
pub mod resources;
pub mod sampler;
pub mod sandbox;
pub mod scripted;
#[cfg(feature = "local")]
pub mod serve;
pub mod text;
#[cfg(feature = "local")]
pub mod train;
pub mod transcript;
pub mod view;

pub use holoc::ir::{ArgValue, Role};
pub use holotype::{Args, Cx, Enter, Holotype, HolotypeError, Pass, Variables};
pub use machine::{
    Completion, Finish, Machine, Recorder, Rollout, RolloutError, SampleRequest, Step,
};
pub use openai::{OpenAi, OpenAiConfig};
pub use resources::Resources;
pub use sampler::{ChatMessage, Prompt, Request, SampleParams, Sampler, SamplerError, TokenSink};
pub use scripted::Scripted;
pub use text::Text;
pub use transcript::Transcript;

/// Re-exported for generated code, so user crates need no direct serde dependency.
pub use serde;

/// Items generated code refers to; not part of the stable API.
#[doc(hidden)]
pub mod __private {
    pub use crate::holotype::{assert_holotype, has_param};
}
