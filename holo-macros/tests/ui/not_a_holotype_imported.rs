// An imported type: the crate scan cannot see its impls, so rustc reports it, naming the tag's line.
use std::time::Duration;

holo_macros::include_holoware!("tests/ui/not_a_holotype_imported.hol");

fn main() {}
