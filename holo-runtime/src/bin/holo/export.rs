//! `holo export`: a run's checkpoint as a Hugging Face folder (and PEFT adapters for a LoRA run).

use std::path::PathBuf;
use std::process::ExitCode;

use super::EXIT_USAGE;

/// `holo export`'s arguments.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// The run folder.
    pub run_dir: PathBuf,
    /// The folder to write.
    #[arg(long)]
    pub out: PathBuf,
    /// The checkpoint's step (default: the newest).
    #[arg(long)]
    pub step: Option<u64>,
}

pub fn run(args: ExportArgs) -> ExitCode {
    let ExportArgs { run_dir, out, step } = args;
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
