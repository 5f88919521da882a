//! `holo init-model`: a random-initialised model folder.

use std::path::PathBuf;
use std::process::ExitCode;

use holo_runtime::local::init;
use holo_runtime::local::Arch;

pub fn run(arch: Arch, preset: init::Preset, seed: u64, force: bool, out_dir: PathBuf) -> ExitCode {
    let options = init::InitOptions {
        arch,
        preset,
        seed,
        force,
    };
    match init::init_model(&out_dir, &options) {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(error.exit_code())
        }
    }
}
