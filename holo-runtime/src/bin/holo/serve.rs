//! `holo serve`: a local model folder over an OpenAI-compatible HTTP API.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use holo_runtime::serve::ReasoningParser;
use holo_runtime::tools::ToolFormat;

use crate::{LocalArgs, EXIT_FAILURES, EXIT_USAGE};

/// How the local model schedules the sequences of every request (vLLM's flag names).
#[derive(clap::Args, Debug)]
pub struct SchedulerArgs {
    /// Sequences decoded together at most (a request with `n` > 1 counts `n`).
    #[arg(long, alias = "max-batch", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    max_num_seqs: u32,
    /// Prompt tokens prefilled per step at most; longer prompts are prefilled in chunks between
    /// decoding steps.
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(1..))]
    max_num_batched_tokens: u32,
    /// Keys and values of the running batch, in MiB, beyond which no more sequences are admitted
    /// (default: no limit).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    kv_budget_mib: Option<u64>,
    /// Sequences waiting for a place beyond which new requests get 429 with `Retry-After`.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    max_waiting: u32,
    /// A request's tokens and log-probabilities do not depend on what else runs beside it, to the
    /// last bit (CPU, f32 or bf16 weights; prefill is slower).
    #[arg(long)]
    batch_invariant: bool,
}

/// How the server treats connections (uvicorn's defaults where it has them).
#[derive(clap::Args, Debug)]
pub struct ConnectionArgs {
    /// Connections open at once at most; more wait (in the listen backlog) until one closes.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Seconds a request body may take to arrive (then 408), and a client may read nothing of its
    /// response (then it is disconnected).
    #[arg(long, default_value_t = 60.0, value_parser = positive_seconds)]
    timeout: f64,
    /// Seconds a connection may stay open without sending a whole request head (idle between
    /// requests, or slow headers).
    #[arg(long, default_value_t = 5.0, value_parser = positive_seconds)]
    keep_alive_timeout: f64,
    /// No access log line per request on stderr.
    #[arg(long)]
    no_access_log: bool,
}

pub use crate::positive_seconds;

impl ConnectionArgs {
    fn config(&self) -> holo_runtime::serve::ServeConfig {
        holo_runtime::serve::ServeConfig {
            max_connections: self.max_connections as usize,
            timeout: Duration::from_secs_f64(self.timeout),
            keep_alive_timeout: Duration::from_secs_f64(self.keep_alive_timeout),
            ..Default::default()
        }
    }
}

/// `holo serve`'s arguments.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// A Hugging Face model folder: config.json, model.safetensors (or shards), tokenizer.json,
    /// tokenizer_config.json (chat template), generation_config.json; or a `.gguf` file of qwen2,
    /// qwen3, qwen3moe, llama, smollm3, olmo2 (OLMo 2 and 3), gemma2, gemma3 or phi3 (tokenizer and chat
    /// template from its metadata).
    pub model_dir: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (printed on stderr).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    #[command(flatten)]
    pub connections: ConnectionArgs,
    /// The model id clients send as `model` (default: MODEL_DIR as given, as vLLM does).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// How the model writes tool calls, by vLLM's parser names: `hermes` (Qwen 2.5 and 3, Hermes),
    /// `llama3_json` (Llama 3.1 to 3.3), `mistral`, `openai` (gpt-oss's harmony format). Default: the
    /// format the chat template renders tool calls in, when it says; without one, requests with
    /// `tools` are refused.
    #[arg(long, value_parser = tool_call_parser)]
    pub tool_call_parser: Option<ToolFormat>,
    /// How the model marks its reasoning, by vLLM's parser names: `qwen3`, `deepseek_r1`,
    /// `openai_gptoss` (harmony's `analysis` channel). Chat replies then carry the reasoning as
    /// `reasoning`, apart from `content`, and `usage` its tokens. Default: none (replies are left
    /// whole; a gpt-oss reply is still read by its channels, its analysis dropped).
    #[arg(long, value_parser = reasoning_parser)]
    pub reasoning_parser: Option<ReasoningParser>,
    #[command(flatten)]
    pub local: LocalArgs,
}

fn tool_call_parser(name: &str) -> Result<ToolFormat, String> {
    ToolFormat::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = ToolFormat::NAMES.iter().map(|(name, _)| *name).collect();
        format!(
            "unknown tool-call parser `{name}`; known: {}",
            names.join(", ")
        )
    })
}

fn reasoning_parser(name: &str) -> Result<ReasoningParser, String> {
    ReasoningParser::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = ReasoningParser::NAMES
            .iter()
            .map(|(name, _)| *name)
            .collect();
        format!(
            "unknown reasoning parser `{name}`; known: {}",
            names.join(", ")
        )
    })
}

pub fn run(args: ServeArgs) -> ExitCode {
    log_to_stderr(!args.connections.no_access_log);
    serve(args)
}

/// The server's `tracing` events (the access log, target `holo::access`; accept failures) as lines on
/// stderr.
fn log_to_stderr(access_log: bool) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;

    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_filter(tracing_subscriber::filter::filter_fn(move |metadata| {
            let target = metadata.target();
            let ours = target.starts_with("holo");
            let shown = *metadata.level() <= tracing::Level::INFO;
            ours && shown && (access_log || target != "holo::access")
        }));
    let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer));
}

/// A folder without a chat template is served with ChatML for chat requests: say so, since a model
/// trained on another format would then see prompts it was not trained on.
fn note_builtin_template(dir: &Path, model: &holo_runtime::local::LocalModel) {
    if model.template().is_builtin() {
        eprintln!(
            "note: {} has no chat template (no `chat_template` in tokenizer_config.json, no \
             chat_template.jinja): chat requests are rendered with ChatML",
            dir.display()
        );
    }
}

/// `holo serve`: loads the model folder and serves it until the process is interrupted.
fn serve(args: ServeArgs) -> ExitCode {
    use holo_runtime::local::LocalModel;
    use holo_runtime::serve::{ServedModel, Server};

    let ServeArgs {
        model_dir,
        host,
        port,
        scheduler,
        connections,
        served_model_name,
        tool_call_parser,
        reasoning_parser,
        local,
    } = args;
    let (model_dir, host) = (model_dir.as_path(), host.as_str());

    let mut options = match local.options(scheduler.max_num_seqs as usize) {
        Ok(options) => options,
        Err(code) => return code,
    };
    options.limits.max_num_batched_tokens = scheduler.max_num_batched_tokens as usize;
    options.limits.kv_budget_bytes = scheduler
        .kv_budget_mib
        .map_or(usize::MAX, |mib| (mib as usize).saturating_mul(1 << 20));
    options.max_waiting = scheduler.max_waiting as usize;
    options.limits.batch_invariant = scheduler.batch_invariant;
    if let Err(message) = options.check() {
        eprintln!("error: {message}");
        return ExitCode::from(EXIT_USAGE);
    }
    let config = connections.config();
    let model = match LocalModel::load(model_dir, options) {
        Ok(model) => model,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    note_builtin_template(model_dir, &model);
    let id = served_model_name.unwrap_or_else(|| model_dir.display().to_string());
    let served = ServedModel {
        tool_parser: tool_call_parser,
        reasoning_parser,
        ..ServedModel::local_with_updates(id.clone(), model)
    };
    let runtime = match crate::server_runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    runtime.block_on(async {
        let server = match Server::bind((host, port), served, config).await {
            Ok(server) => server,
            Err(error) => {
                eprintln!("error: cannot listen on {host}:{port}: {error}");
                return ExitCode::from(EXIT_FAILURES);
            }
        };
        eprintln!(
            "serving `{id}` on http://{} (OpenAI API under /v1); Ctrl-C stops",
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
