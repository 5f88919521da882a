//! Other engines' protocols (holo-engines): Atropos both ways, NeMo Gym, Tinker.
//!
//! One test binary per layer (`cargo test -p holo-runtime --test engines`); a file per subject.

#[path = "../common/mod.rs"]
mod common;

#[cfg(all(feature = "local", feature = "cli"))]
mod atropos;
#[cfg(all(feature = "local", feature = "cli"))]
mod cookbook;
#[cfg(all(feature = "local", feature = "cli"))]
mod gym;
mod tinker;
#[cfg(all(feature = "local", feature = "cli"))]
mod tinker_serve;
