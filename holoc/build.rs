fn main() {
    lalrpop::process_src().expect("the lalrpop grammar must generate");
}
