//! `holo runs DIR`: the training runs in a folder, with what made them and their best evaluation.

use std::path::PathBuf;
use std::process::ExitCode;

use holo_runtime::train::provenance;

use super::EXIT_USAGE;

/// `holo runs`'s arguments.
#[derive(clap::Args)]
pub struct RunsArgs {
    /// A run folder, or a folder of run folders.
    pub dir: PathBuf,
}

pub fn run(args: RunsArgs) -> ExitCode {
    let RunsArgs { dir } = args;
    let runs = match provenance::runs(&dir) {
        Ok(runs) => runs,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if runs.is_empty() {
        eprintln!(
            "error: `{}` holds no run (a folder with metrics.jsonl or provenance.json)",
            dir.display()
        );
        return ExitCode::from(EXIT_USAGE);
    }
    for run in &runs {
        let best = run
            .best_eval
            .map_or("no evaluation".to_string(), |(step, value)| {
                format!("best eval/reward {value:.4} at step {step}")
            });
        println!("{}: {} steps, {best}", run.dir.display(), run.steps);
        match &run.provenance {
            Some(provenance) => {
                println!("  holo-runtime {}", provenance.holo_runtime);
                if let Some(build) = provenance.current_build() {
                    println!("  built from {build}");
                }
                for input in provenance.current() {
                    println!("  {input}");
                }
                for change in &provenance.changes {
                    println!(
                        "  resumed at step {} with changes: {}",
                        change.step, change.message
                    );
                }
            }
            None => println!("  no provenance.json (made before provenance was recorded)"),
        }
    }
    ExitCode::SUCCESS
}
