// hol/*.hol of this crate become modules in OUT_DIR; src/lib.rs includes them.
fn main() {
    if let Err(error) = holoc::build::compile("hol") {
        eprintln!("{error}");
        std::process::exit(1);
    }
}
