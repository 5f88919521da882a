holo_macros::include_holoware!("tests/ui/several_errors.hol");

fn main() {}
