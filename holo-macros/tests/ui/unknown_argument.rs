use holo_runtime::{Args, Holotype, HolotypeError};

pub struct Repeat;

impl Holotype for Repeat {
    const PARAMS: &'static [&'static str] = &["max_turns"];

    fn new(_: &Args) -> Result<Self, HolotypeError> {
        Ok(Repeat)
    }
}

holo_macros::include_holoware!("tests/ui/unknown_argument.hol");

fn main() {}
