//! The environments' layer (holo-core, holo-sandbox): holotypes, the sandbox, chat templates, the
//! Holophore, the Loom, the OpenAI sampler.
//!
//! The layer's own test binary (`cargo test -p holo-core --test core`), a file per subject: it links
//! holo-core and what holo-core links, never the model, the trainer or the server, so Cargo holds these
//! tests to the layer's invariant ("holo-core never sees candle or HTTP serving").

#[path = "../../../tests/support/mod.rs"]
mod common;

mod chat_templates;
mod code_executor;
mod holophore;
mod holophore_rendered;
mod holotypes;
mod loom;
mod loom_holophore;
mod native_tools;
mod openai;
mod recording;
mod sandbox;
mod tool_loops;
