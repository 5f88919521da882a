//! What a run leaves for people to read: PNG charts of its metrics ([`plot`]) and the comparison of
//! checkpoints on held-out data ([`compare`]).

pub mod compare;
pub mod plot;
