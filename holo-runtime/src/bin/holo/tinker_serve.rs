//! `holo tinker-serve`: the Tinker training API (the `tinker` SDK's service) over a local model folder.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use holo_runtime::engines::tinker::serve::{TinkerConfig, TinkerServer};

use crate::{EXIT_FAILURES, EXIT_USAGE};

#[derive(Args)]
pub struct TinkerServeArgs {
    /// A Hugging Face model folder (config.json, *.safetensors, tokenizer.json): the base model every
    /// LoRA training client adapts and every sampler samples.
    pub model_dir: PathBuf,
    /// The name clients give as `base_model` (default: MODEL_DIR as given).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Where checkpoints are kept (they survive a restart of the server).
    #[arg(long)]
    pub store: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (printed on stderr).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// cpu, cuda, cuda:N, metal or metal:N (cuda and metal need holo built with that feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Seconds `retrieve_future` waits for a result before telling the SDK to ask again.
    #[arg(long, default_value_t = 20.0, value_parser = crate::positive_seconds)]
    pub poll: f64,
    /// The seed of samples whose request names none.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Request bodies beyond this many MiB are refused (413).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_body_mib: u64,
}

pub fn run(args: TinkerServeArgs) -> ExitCode {
    let device = match holo_runtime::local::parse_device(&args.device) {
        Ok(device) => device,
        Err(message) => {
            eprintln!("error: --device: {message}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let model_name = args
        .served_model_name
        .unwrap_or_else(|| args.model_dir.display().to_string());
    let config = TinkerConfig {
        model_dir: args.model_dir,
        model_name: model_name.clone(),
        store: args.store,
        poll: Duration::from_secs_f64(args.poll),
        max_body_bytes: (args.max_body_mib as usize).saturating_mul(1 << 20),
        seed: args.seed,
        device,
    };
    let runtime = match crate::server_runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    let (host, port) = (args.host, args.port);
    runtime.block_on(async {
        let server = match TinkerServer::bind((host.as_str(), port), config).await {
            Ok(server) => server,
            Err(error) => {
                eprintln!("error: holo tinker-serve on {host}:{port}: {error}");
                return ExitCode::from(EXIT_FAILURES);
            }
        };
        eprintln!(
            "serving `{model_name}` over the Tinker API on http://{} (TINKER_BASE_URL); Ctrl-C stops",
            server.local_addr()
        );
        match server.run().await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("error: {error}");
                ExitCode::from(EXIT_FAILURES)
            }
        }
    })
}
