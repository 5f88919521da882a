pub struct Plain;

holo_macros::include_holoware!("tests/ui/not_a_holotype.hol");

fn main() {}
