holo_macros::include_holoware!("tests/ui/no_such_file.hol");

fn main() {}
