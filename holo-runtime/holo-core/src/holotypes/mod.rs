//! The built-in holotypes: a tool loop with a registry of Rust tools, Python code execution as a tool,
//! reward holotypes (attractors), and Experiential RL's reflection and retry ([`erl`]).
//!
//! `.hol` files name them like any holotype; [`registry`] makes them available to the interpreter, and
//! `use holo_runtime::holotypes::*;` brings them into scope for `include_holoware!`.

mod code;
pub mod erl;
mod rewards;
mod stats;
mod tools;

pub use code::{
    check_code_sandbox, code_block, network_isolation, run_python, run_python_unsandboxed,
    CodeExecutor, CodeSandbox, Execution, Outcome, PythonConfig,
};
pub use erl::{Feedback, Memory, Reflection, ReflectionMemory, Remember, Retry, Score};
pub use rewards::{
    answer_text, last_number, numbers_equal, ExactAnswer, FormatReward, LengthPenalty, MathAnswer,
};
pub use stats::{ToolCounts, ToolStats};
pub use tools::{Tool, ToolExecutor, ToolRunner, ToolSchema, Tools};

use crate::interpreter::Registry;

/// A registry with every built-in holotype under its own name.
pub fn registry() -> Registry {
    let mut registry = Registry::default();
    registry
        .register::<ToolRunner>("ToolRunner")
        .register::<ToolSchema>("ToolSchema")
        .register::<ToolExecutor>("ToolExecutor")
        .register::<CodeExecutor>("CodeExecutor")
        .register::<ExactAnswer>("ExactAnswer")
        .register::<MathAnswer>("MathAnswer")
        .register::<FormatReward>("FormatReward")
        .register::<LengthPenalty>("LengthPenalty")
        .register::<Retry>("Retry")
        .register::<Feedback>("Feedback")
        .register::<Score>("Score")
        .register::<Memory>("Memory")
        .register::<Remember>("Remember");
    registry
}
