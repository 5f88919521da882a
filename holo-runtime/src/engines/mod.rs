//! Other engines' protocols, so that a Holoware environment and `holo train` work beyond one machine:
//! [`atropos`] (Nous Research's trajectory API, both ways). `docs/scale-out.md` says which engine serves
//! which need.

pub mod atropos;
