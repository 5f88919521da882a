//! Other engines' protocols, so that a Holoware environment and `holo train` work beyond one machine:
//! [`atropos`] (Nous Research's trajectory API, both ways), `gym` (a holoware as a NeMo Gym agent
//! server, `holo gym`; it needs the `local` feature, for its HTTP server) and [`tinker`] (`holo train
//! --backend tinker`: forward/backward passes and optimizer steps on a Tinker service). `docs/scale-out.md` says
//! which engine serves which need.

#![forbid(unsafe_code)]

pub mod atropos;
#[cfg(feature = "local")]
pub mod gym;
pub mod tinker;

/// An error with its sources, `a: b: c` (reqwest keeps the useful part in the sources).
pub(crate) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// A server's text, cut to a readable length.
pub(crate) fn shortened(text: &str) -> String {
    const LIMIT: usize = 600;
    let text = text.trim();
    match text.char_indices().nth(LIMIT) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}
