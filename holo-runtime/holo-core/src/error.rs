//! The error a holotype raises, below both the holotypes and the machines that report it.

use std::fmt;

/// An error raised by a holotype; it ends the rollout and is reported with the holotype's location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolotypeError {
    pub message: String,
}

impl HolotypeError {
    pub fn new(message: impl Into<String>) -> Self {
        HolotypeError {
            message: message.into(),
        }
    }
}

impl fmt::Display for HolotypeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for HolotypeError {}

/// The message of a panic's payload (a `&str` or a `String`, as `panic!` makes them).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|text| text.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_string())
}
