// PARAMS is not a literal list, so the crate scan cannot read it: rustc's const assertion catches the
// misspelt argument instead.
use holo_runtime::{Args, Holotype, HolotypeError};

const JUDGE_PARAMS: &[&str] = &["rubric", "weight"];

pub struct Judge;

impl Holotype for Judge {
    const PARAMS: &'static [&'static str] = JUDGE_PARAMS;

    fn new(_: &Args) -> Result<Self, HolotypeError> {
        Ok(Judge)
    }
}

holo_macros::include_holoware!("tests/ui/unknown_argument_checked_by_rustc.hol");

fn main() {}
