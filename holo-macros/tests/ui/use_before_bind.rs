holo_macros::include_holoware!("tests/ui/use_before_bind.hol");

fn main() {
    // The skeleton module keeps this from adding errors of its own.
    let _ = use_before_bind::Vars::default();
}
