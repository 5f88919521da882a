//! The environments' layer (holo-core, holo-sandbox) through the facade: holotypes, the sandbox, chat
//! templates, the Holophore, the Loom, the OpenAI sampler.
//!
//! One test binary per layer (`cargo test -p holo-runtime --test core`); a file per subject.

#[path = "../common/mod.rs"]
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
