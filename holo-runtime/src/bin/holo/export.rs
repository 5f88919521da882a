//! `holo export`: a run's checkpoint as a Hugging Face folder (and PEFT adapters for a LoRA run).

use std::path::PathBuf;
use std::process::ExitCode;

use super::EXIT_USAGE;

pub fn run(run_dir: PathBuf, out: PathBuf, step: Option<u64>) -> ExitCode {
    match holo_runtime::train::export::export(&run_dir, step, &out) {
        Ok(exported) => {
            println!(
                "checkpoint-{} of {} exported to {}",
                exported.step,
                run_dir.display(),
                exported.model_dir.display()
            );
            if let Some(adapter) = exported.adapter_dir {
                println!("LoRA adapters (PEFT) in {}", adapter.display());
            }
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}
