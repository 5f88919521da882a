holo_macros::include_holoware!("/etc/tool.hol");

fn main() {}
