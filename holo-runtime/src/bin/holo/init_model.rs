//! `holo init-model`: a random-initialised model folder.

use std::path::PathBuf;
use std::process::ExitCode;

use holo_runtime::local::init;

/// `holo init-model`'s arguments.
#[derive(clap::Args)]
pub struct InitModelArgs {
    /// qwen2 (tied embeddings, q/k/v biases), qwen3 (tied embeddings, per-head q/k norms, heads wider
    /// than hidden / heads) or llama.
    #[arg(long, default_value = "qwen2", value_parser = holo_runtime::local::init::parse_arch)]
    pub arch: holo_runtime::local::Arch,
    /// tiny (tests) or small (Qwen2.5-0.5B / Qwen3-0.6B / SmolLM2-135M shapes with a 512-token
    /// vocabulary).
    #[arg(long, default_value = "tiny")]
    pub preset: holo_runtime::local::init::Preset,
    /// Seeds the weights; the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write into a folder that is not empty, replacing the model files in it.
    #[arg(long)]
    pub force: bool,
    /// The folder to write (created when missing).
    pub out_dir: PathBuf,
}

pub fn run(args: InitModelArgs) -> ExitCode {
    let InitModelArgs {
        arch,
        preset,
        seed,
        force,
        out_dir,
    } = args;
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
