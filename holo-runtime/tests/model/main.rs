//! The local model (holo-model) through the facade: the decoder, GGUF files, the scheduler, real
//! checkpoints, `holo init-model`.
//!
//! One test binary per layer (`cargo test -p holo-runtime --test model`); a file per subject.

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "local")]
mod gguf;
#[cfg(feature = "local")]
mod gguf_converted;
#[cfg(feature = "local")]
mod gguf_families;
#[cfg(feature = "local")]
mod gguf_gpt_oss;
#[cfg(feature = "local")]
mod gguf_llama_cpp;
#[cfg(feature = "local")]
mod gguf_spm;
#[cfg(feature = "local")]
mod init_model;
#[cfg(feature = "local")]
mod local_model;
#[cfg(feature = "local")]
mod longrope;
#[cfg(feature = "local")]
mod qlora;
#[cfg(feature = "local")]
mod real_checkpoint;
#[cfg(feature = "local")]
mod routing;
#[cfg(feature = "local")]
mod schedule;
#[cfg(feature = "local")]
mod template_kwargs;
