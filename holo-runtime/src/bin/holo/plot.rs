//! `holo plot`: PNG curves of a run's metrics.

use std::path::PathBuf;
use std::process::ExitCode;

use super::EXIT_USAGE;

/// `holo plot`'s arguments.
#[derive(clap::Args)]
pub struct PlotArgs {
    /// The run folder.
    pub run_dir: PathBuf,
}

pub fn run(args: PlotArgs) -> ExitCode {
    let PlotArgs { run_dir } = args;
    match holo_runtime::train::report::plot::plot_run(&run_dir) {
        Ok(plots) => {
            for plot in plots {
                println!("{}", plot.display());
            }
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}
