use holo_runtime::{Args, Holotype, HolotypeError};

pub struct Calculator;

impl Holotype for Calculator {
    const PARAMS: &'static [&'static str] = &[];

    fn new(_: &Args) -> Result<Self, HolotypeError> {
        Ok(Calculator)
    }
}

holo_macros::include_holoware!("tests/ui/unknown_holotype.hol");

fn main() {}
