//! Other engines' protocols, so that a Holoware environment and `holo train` work beyond one machine:
//! [`atropos`] (Nous Research's trajectory API, both ways) and `gym` (a holoware as a NeMo Gym agent
//! server, `holo gym`; it needs the `local` feature, for its HTTP server). `docs/scale-out.md` says
//! which engine serves which need.

pub mod atropos;
#[cfg(feature = "local")]
pub mod gym;
