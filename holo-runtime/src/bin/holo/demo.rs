//! `holo demo`: a random model warmed up on arithmetic, then trained with GRPO; see
//! `holo_runtime::demo`.

use std::path::PathBuf;
use std::process::ExitCode;

use holo_runtime::demo::{self, DemoError, DemoOptions};
use holo_runtime::local::init::Preset;

use super::{EXIT_FAILURES, EXIT_USAGE};

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Seeds the model, the problems, the warm-up and GRPO; the same seed gives the same metrics.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The run folder (default: runs/demo-seed-N); it must not exist or be empty.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// A few seconds through every stage (10 warm-up steps, 2 GRPO steps, 8 held-out problems).
    #[arg(long)]
    pub quick: bool,
    /// Supervised warm-up steps.
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// The warm-up's peak learning rate (it decays linearly to 0).
    #[arg(long)]
    pub warmup_learning_rate: Option<f64>,
    /// GRPO steps.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub grpo_steps: Option<u64>,
    /// Evaluate on the held-out problems every this many GRPO steps.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_steps: Option<u64>,
    /// How often the warm-up's teacher forgets the carry of a sum that carries (0 to 1).
    #[arg(long)]
    pub forget_carry: Option<f64>,
    /// The model's architecture: llama (untied embeddings) or qwen2.
    #[arg(long, value_parser = holo_runtime::local::init::parse_arch)]
    pub arch: Option<holo_runtime::local::Arch>,
    /// The model's size: tiny or small (see `holo init-model`).
    #[arg(long)]
    pub preset: Option<Preset>,
}

impl DemoArgs {
    pub fn options(self) -> DemoOptions {
        let out = self
            .out
            .unwrap_or_else(|| PathBuf::from(format!("runs/demo-seed-{}", self.seed)));
        let mut options = if self.quick {
            DemoOptions::quick(self.seed, out)
        } else {
            DemoOptions::full(self.seed, out)
        };
        options.warmup.steps = self.warmup_steps.unwrap_or(options.warmup.steps);
        options.warmup.learning_rate = self
            .warmup_learning_rate
            .unwrap_or(options.warmup.learning_rate);
        options.grpo_steps = self.grpo_steps.unwrap_or(options.grpo_steps);
        options.eval_steps = self.eval_steps.unwrap_or(options.eval_steps);
        options.preset = self.preset.unwrap_or(options.preset);
        options.arch = self.arch.unwrap_or(options.arch);
        if let Some(forget_carry) = self.forget_carry {
            options.teacher.forget_carry = forget_carry;
        }
        options
    }
}

pub fn run(args: DemoArgs) -> ExitCode {
    let options = args.options();
    let report = match demo::run(&options, &mut |note| eprintln!("{note}")) {
        Ok(report) => report,
        Err(error @ DemoError::Input(_)) => {
            eprintln!("error: {error}");
            return ExitCode::from(EXIT_USAGE);
        }
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(EXIT_FAILURES);
        }
    };
    println!("{}", report.table().trim_end());
    if let Some((before, after)) = report.accuracy() {
        println!(
            "held-out accuracy {before:.3} after the warm-up ({:.0} s), {after:.3} after GRPO ({:.0} s)",
            report.warmup_seconds, report.grpo_seconds
        );
    }
    println!(
        "held-out accuracy is charted in {}; metrics.jsonl, TensorBoard events (tensorboard/), rollouts, \
         the last checkpoint and {} charts (plots/) are in {}",
        report.accuracy_plot.display(),
        report.plots,
        report.run_dir.display()
    );
    ExitCode::SUCCESS
}
