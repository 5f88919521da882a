holo_macros::include_holoware!("tests/ui/syntax_error.hol");

fn main() {}
