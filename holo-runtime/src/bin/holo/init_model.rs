//! `holo init-model`: a random-initialised model folder.

use std::path::PathBuf;
use std::process::ExitCode;

use holo_runtime::local::init;

/// `holo init-model`'s arguments.
#[derive(clap::Args)]
pub struct InitModelArgs {
    /// The family, by its `model_type`: qwen2, qwen3, llama, mistral, ministral, smollm3, olmo2,
    /// olmo3, gemma2, gemma3_text, phi3, qwen3_5_text, qwen3_5_moe_text, qwen3_moe or gpt_oss (what
    /// sets each apart: README, "Local models").
    #[arg(long, default_value = "qwen2", value_parser = holo_runtime::local::init::parse_arch)]
    pub arch: holo_runtime::local::Arch,
    /// tiny (tests) or small (the decoder shapes of the family's small model, e.g. Qwen3-0.6B or
    /// gemma-3-1b, with a 512-token vocabulary).
    #[arg(long, default_value = "tiny")]
    pub preset: holo_runtime::local::init::Preset,
    /// Seeds the weights; the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The vocabulary's size: the offline tokenizer's 512 ids padded with added tokens `<|extra_N|>`
    /// up to it, for benchmarks at a real family's vocabulary (Qwen2.5 and Qwen3: 151936; Llama 3:
    /// 128256; SmolLM2: 49152; Gemma 3: 262144).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// The decoder layers' count instead of the preset's, in its pattern (windows, layers without
    /// RoPE, linear attention): e.g. `--preset small --layers 2` for two of Mistral-7B's layers at
    /// their real width, on a machine the whole model does not fit.
    #[arg(long)]
    pub layers: Option<usize>,
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
        vocab,
        layers,
        force,
        out_dir,
    } = args;
    let options = init::InitOptions {
        arch,
        preset,
        seed,
        force,
        vocab,
        layers,
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
