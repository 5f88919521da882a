//! Each mistake in a `.hol` file fails the build with an error that names the file, line and column.

#[test]
fn ui() {
    // trybuild builds a copy of this crate under target/; .hol paths stay relative to this crate.
    std::env::set_var("HOLOWARE_MANIFEST_DIR", env!("CARGO_MANIFEST_DIR"));
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}
