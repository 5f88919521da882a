//! `holo`: run holowares. `holo dry FILE.hol` runs rollouts with a scripted sampler and prints what
//! would be trained; `holo eval FILE.hol --data rows.jsonl` runs a dataset through the Loom, writes the
//! rollouts as JSONL and prints the mean rewards and pass@k.

mod allocator;
mod atropos_env;
#[cfg(feature = "local")]
mod compare;
#[cfg(feature = "local")]
mod demo;
mod dry;
mod eval;
#[cfg(feature = "local")]
mod export;
mod export_data;
#[cfg(feature = "local")]
mod gym;
#[cfg(feature = "local")]
mod init_model;
#[cfg(feature = "train")]
mod options;
#[cfg(feature = "train")]
mod plot;
#[cfg(feature = "train")]
mod runs;
#[cfg(feature = "local")]
mod serve;
#[cfg(feature = "local")]
mod sft;
#[cfg(feature = "local")]
mod tinker_serve;
#[cfg(feature = "train")]
mod train;
mod view;

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use holo_runtime::holophore::Holophore;
use holo_runtime::holotypes;
use holo_runtime::interpreter::{Holoware, NumberedRow, Row};
use holo_runtime::{OpenAi, OpenAiConfig, Sampler};

#[derive(Parser)]
#[command(name = "holo", version, about = "Run Holoware environments")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run rollouts of a .hol file with scripted replies (or a model) and print each transcript,
    /// sampled text highlighted (what training would learn from).
    Dry(dry::DryArgs),
    /// Run a dataset through the Loom: G rollouts per row, each request sent the moment its rollout needs
    /// it (the local model batches them continuously). Writes each rollout as a JSONL line as it
    /// finishes, then prints the mean of each reward component, the mean total reward and pass@k (k = 1
    /// and G; a rollout passes when it completed with full credit on the holoware's answer check, or
    /// the component --pass-component names). Exit status 1 when a row or a rollout failed.
    Eval(eval::EvalArgs),
    /// Compare two policies (model folders, .gguf files, run folders or their checkpoints, PEFT
    /// adapters) on the same rows, rollout seeds and G: each policy's mean total reward, reward
    /// components, pass@1 and pass@G, and the difference B - A with a paired bootstrap 95% interval
    /// over rows. Prints the table and writes the rollouts (a.jsonl, b.jsonl), compare.json and
    /// compare.png into --out. Exit status 2 for bad input (found before any rollout), 1 when a
    /// rollout failed.
    #[cfg(feature = "local")]
    Compare(compare::CompareArgs),
    /// Write a random-initialised model folder in Hugging Face format (config.json,
    /// model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json) with a
    /// Qwen-style byte-level BPE tokenizer built offline; transformers loads it unchanged.
    #[cfg(feature = "local")]
    InitModel(init_model::InitModelArgs),
    /// Serve a local model folder (Qwen2 / Llama, Hugging Face format) over an OpenAI-compatible HTTP
    /// API: GET /v1/models, POST /v1/completions and /v1/chat/completions (logprobs, n, stop,
    /// max_tokens, temperature, top_p, top_k, seed). Concurrent requests are sampled together in one
    /// batch. Runs until interrupted.
    #[cfg(feature = "local")]
    Serve(serve::ServeArgs),
    /// Train a local model with GRPO on a .hol environment (TRL's GRPOTrainer semantics and option
    /// names), in this process or on a Tinker service (--backend tinker). Writes metrics.jsonl,
    /// TensorBoard events, the rollouts, checkpoints and PNG plots into --out; `--resume` continues a
    /// run from its newest checkpoint.
    #[cfg(feature = "train")]
    #[command(after_long_help = train::options_help())]
    Train(train::TrainArgs),
    /// Supervised fine-tuning of a local model on a JSONL file in TRL's SFT formats (what `holo
    /// export-data --format sft` writes; TRL's SFTTrainer semantics and option names): full or LoRA, the
    /// GRPO trainer's optimizer, schedule, checkpoints and metrics. Writes metrics.jsonl, TensorBoard
    /// events, checkpoints and PNG plots into --out; `--resume` continues a run from its newest
    /// checkpoint. `holo export` turns a checkpoint into a model folder.
    #[cfg(feature = "local")]
    #[command(after_long_help = sft::options_help())]
    Sft(sft::SftArgs),
    /// A model that visibly learns, offline, on a CPU: a random model warmed up by imitating a sloppy
    /// teacher of additions (it forgets half the carries), then trained with GRPO on hol/arithmetic.hol,
    /// evaluated on held-out problems; prints a table of held-out accuracy and writes metrics,
    /// TensorBoard events and plots.
    #[cfg(feature = "local")]
    Demo(demo::DemoArgs),
    /// A holoware as an Atropos environment: registers with the Atropos API (`run-api`), rolls each
    /// row's --group-size rollouts out against the OpenAI-compatible policy at --policy-url, and posts
    /// them as scored groups (tokens, masks, scores, log-probabilities, messages), throttled as
    /// atroposlib's BaseEnv throttles; stops once the trainer's steps are queued. One sequence per
    /// rollout: its trained context, every sampled turn trained (a rollout with several trained
    /// contexts is refused). When the API restarts, registers again and loses no group it held. Exit
    /// status 2 for bad input, 1 when the API failed for good.
    AtroposEnv(atropos_env::AtroposEnvArgs),
    /// A holoware as a NeMo Gym agent server: POST /run rolls a dataset row out against the
    /// OpenAI-compatible policy (--policy-url, or the head server's policy_base_url) and answers the
    /// row with a Responses API `response` (per sampled turn: prompt_token_ids, generation_token_ids,
    /// generation_log_probs exactly as sampled), `reward` and `reward_components`; POST
    /// /aggregate_metrics summarizes rewards. For ng_collect_rollouts, NeMo RL and the trainers that
    /// consume NeMo Gym. Runs until interrupted; exit status 2 for bad options.
    #[cfg(feature = "local")]
    #[command(after_long_help = gym::ROWS_HELP)]
    Gym(gym::GymArgs),
    /// The Tinker training API over a local model folder: the `tinker` SDK (tinker-cookbook,
    /// `holo train --backend tinker`) creates LoRA training clients, runs forward_backward with the
    /// cross_entropy, importance_sampling, ppo, cispo and dro losses, optim_step (AdamW), saves and loads
    /// checkpoints (kept in --store across restarts) and samples with log-probabilities. Point the
    /// SDK at it with TINKER_BASE_URL.
    #[cfg(feature = "local")]
    TinkerServe(tinker_serve::TinkerServeArgs),
    /// Write a run's checkpoint as a Hugging Face model folder (LoRA adapters merged, and also in PEFT's
    /// layout under `adapter/`).
    #[cfg(feature = "local")]
    Export(export::ExportArgs),
    /// Turn rollouts (`holo eval`, `holo train`) into a dataset for TRL's trainers: `sft`
    /// conversations of the good rollouts (rejection sampling), or `dpo` preference pairs from the
    /// rollouts of one row. Failed rollouts are never exported; a rollout with several trained
    /// contexts gives one sft example per trained context, and no dpo pair. Prints on stderr how many
    /// rollouts (and pairs) each filter dropped; a line that is not a rollout record is named and
    /// skipped. Exit status 1 when no example is left, 2 for a usage error or an unreadable PATH.
    ExportData(export_data::ExportDataArgs),
    /// Write rollouts (`holo eval`, `holo train`; or a run folder) as one self-contained HTML page to
    /// read in a browser, or serve it (--serve): the rollouts filtered by row, step, reward, status and
    /// text, each one's contexts token by token with the trained tokens marked, its rewards and inputs,
    /// its group side by side; a run folder's metric curves and completions per step. A line that is not
    /// a record is named and skipped. Exit status 2 when PATH has no rollout to show, 1 when a file
    /// cannot be read or written.
    View(view::ViewArgs),
    /// List the training runs in DIR (or DIR itself): steps, best eval/reward, and what made each run
    /// (holo-runtime's version; the .hol file, data and model with their SHA-256).
    #[cfg(feature = "train")]
    Runs(runs::RunsArgs),
    /// Draw a run's metrics.jsonl as PNG curves in RUN_DIR/plots/.
    #[cfg(feature = "train")]
    Plot(plot::PlotArgs),
}

/// Where a local model runs.
#[derive(Args, Clone)]
#[cfg_attr(not(feature = "local"), allow(dead_code))]
struct LocalArgs {
    /// cpu, cuda, cuda:N, metal or metal:N (cuda and metal need holo built with that feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weight precision: f32, f16 or bf16 (on the CPU: bf16 matrices with f32 arithmetic, sampling
    /// only). Default: bf16 on CUDA, f32 elsewhere.
    #[arg(long)]
    dtype: Option<String>,
    /// Keep a `.gguf` file's quantized projections (Q4_0, Q8_0, k-quants) in the file's blocks on the
    /// CPU and multiply them as they are, as llama.cpp does: a decoding step reads 4–7× fewer bytes than
    /// in f32, each row of activations rounded to 8 bits per block. Faster for one sequence at a time,
    /// slower from about eight (benches/README.md). Without it every tensor is expanded to --dtype. Not
    /// with --batch-invariant.
    #[arg(long)]
    quantized: bool,
}

#[cfg(feature = "local")]
impl LocalArgs {
    /// The options for sampling at most `max_num_seqs` sequences at once.
    fn options(&self, max_num_seqs: usize) -> Result<holo_runtime::local::LocalOptions, ExitCode> {
        use holo_runtime::local::{parse_device, parse_dtype, Limits, LocalOptions};
        let parsed = parse_device(&self.device)
            .and_then(|device| Ok((parse_dtype(self.dtype.as_deref(), &device)?, device)));
        match parsed {
            Ok((dtype, device)) => Ok(LocalOptions {
                device,
                dtype,
                limits: Limits {
                    max_num_seqs,
                    ..Limits::default()
                },
                quantized: self.quantized,
                ..LocalOptions::default()
            }),
            Err(message) => {
                eprintln!("error: {message}");
                Err(ExitCode::from(EXIT_USAGE))
            }
        }
    }
}

/// Where completions come from, shared by `dry` and `eval`.
#[derive(Args)]
struct SamplerArgs {
    /// `openai` samples from a server, `local` from a model folder run in process, instead of the
    /// scripted --reply texts.
    #[arg(long, value_enum, default_value_t = SamplerKind::Scripted)]
    sampler: SamplerKind,
    /// The OpenAI-compatible server (`http://host:port`, with or without `/v1`); the API key is read
    /// from OPENAI_API_KEY.
    #[arg(long, required_if_eq("sampler", "openai"))]
    base_url: Option<String>,
    /// The model. With `openai`, the name the server serves. A local model folder (`tokenizer.json`
    /// and a chat template in `chat_template.jinja` or `tokenizer_config.json`) also records every
    /// rollout token by token with its tokenizer and template: prompts are sent as token ids, and
    /// `dry` prints the tokens, each trained one highlighted. With the scripted and the local
    /// sampler it must be such a folder (for `local`, a whole model folder), or a `.gguf` file.
    #[arg(long, required_if_eq_any([("sampler", "openai"), ("sampler", "local")]))]
    model: Option<String>,
    /// A scripted reply; repeat to give several, used in turn (the list repeats).
    #[arg(long = "reply")]
    replies: Vec<String>,
    /// With `--sampler local`.
    #[command(flatten)]
    local: LocalArgs,
    /// Run model-written code (CodeExecutor) without a sandbox where this machine cannot sandbox it
    /// (not Linux, user namespaces disabled). Without it such a run is refused before it starts.
    /// Unsandboxed code can read, change and delete what this user can.
    #[arg(long)]
    allow_unsandboxed_code: bool,
    /// With `openai`: seconds one attempt of a request may take, from connecting to the end of the
    /// answer (default 600). A server that accepts and never answers, stops mid-answer or is stopped
    /// fails the attempt then.
    #[arg(long, value_parser = positive_seconds)]
    request_timeout: Option<f64>,
    /// With `openai`: retries of a failed request (connection refused or dropped, HTTP 5xx, timeout)
    /// before its rollout fails, naming the last failure (default 6).
    #[arg(long)]
    retries: Option<u32>,
    /// Extra arguments of the model's chat template, a JSON object (transformers'
    /// `apply_chat_template(**kwargs)`): `'{"enable_thinking": false}'` turns Qwen3's thinking off.
    /// Every rendering of a rollout gets them; with `openai` and no local tokenizer they go to the
    /// server as `chat_template_kwargs`.
    #[arg(long, value_name = "JSON", value_parser = template_kwargs)]
    chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

/// `--chat-template-kwargs`: a JSON object.
pub fn template_kwargs(text: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    holo_runtime::chat::parse_template_kwargs(text)?;
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        _ => unreachable!("parse_template_kwargs accepts only objects"),
    }
}

impl SamplerArgs {
    /// The chat-template arguments as template variables.
    fn template_variables(&self) -> std::collections::BTreeMap<String, holo_runtime::chat::Value> {
        self.chat_template_kwargs
            .as_ref()
            .and_then(|map| {
                holo_runtime::chat::template_kwargs(&serde_json::Value::Object(map.clone())).ok()
            })
            .unwrap_or_default()
    }

    /// The holophore of `--model` when it is a model folder (always, for the scripted sampler).
    fn holophore(&self) -> Result<Option<Holophore>, ExitCode> {
        let Some(model) = &self.model else {
            return Ok(None);
        };
        let dir = Path::new(model);
        #[cfg(feature = "local")]
        if holo_runtime::local::gguf::is_gguf(dir) {
            use holo_runtime::local::files::{load_template, load_tokenizer};
            use std::sync::Arc;
            return load_tokenizer(dir)
                .and_then(|tokenizer| Ok((tokenizer, load_template(dir)?)))
                .map_err(|error| error.to_string())
                .and_then(|(tokenizer, template)| {
                    Holophore::with_template_kwargs(
                        Arc::new(tokenizer),
                        Arc::new(template),
                        self.template_variables(),
                    )
                    .map_err(|error| error.to_string())
                })
                .map(Some)
                .map_err(|error| {
                    eprintln!("error: --model `{model}`: {error}");
                    ExitCode::from(EXIT_USAGE)
                });
        }
        if self.sampler == SamplerKind::Openai && !dir.join("tokenizer.json").is_file() {
            return Ok(None);
        }
        Holophore::from_dir_with(dir, self.template_variables())
            .map(Some)
            .map_err(|error| {
                eprintln!("error: --model `{model}`: {error}");
                ExitCode::from(EXIT_USAGE)
            })
    }

    /// The model's sampler (`openai` with at most `concurrency` requests in flight, or `local` with at
    /// most `concurrency` sequences decoding together), or `None` for the scripted replies. A local
    /// model compiles every constraint of `holoware` first, and those that `rows` give it (a
    /// `json_schema=name` of an input), as `holo train` does, so that one it refuses stops the command
    /// before any rollout, naming the row by its label and the tag's `file.hol:line:col`, instead of
    /// failing each rollout that reaches it (a server compiles them itself; scripted replies are not
    /// held to them).
    #[cfg_attr(not(feature = "local"), allow(unused_variables))]
    fn sampler(
        &self,
        concurrency: usize,
        holoware: &Holoware,
        rows: &[(String, &Row)],
    ) -> Result<Option<Box<dyn Sampler>>, ExitCode> {
        if self.sampler != SamplerKind::Scripted && !self.replies.is_empty() {
            eprintln!("error: --reply is for the scripted sampler");
            return Err(ExitCode::from(EXIT_USAGE));
        }
        if self.sampler != SamplerKind::Openai {
            let given = [
                ("--request-timeout", self.request_timeout.is_some()),
                ("--retries", self.retries.is_some()),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, given)| *given) {
                eprintln!("error: {flag} is for the openai sampler (--sampler openai)");
                return Err(ExitCode::from(EXIT_USAGE));
            }
        }
        match self.sampler {
            SamplerKind::Scripted => Ok(None),
            SamplerKind::Openai => {
                let defaults = OpenAiConfig::new(
                    self.base_url.clone().unwrap_or_default(),
                    self.model.clone().unwrap_or_default(),
                );
                let config = OpenAiConfig {
                    max_concurrency: concurrency,
                    request_timeout: self
                        .request_timeout
                        .map_or(defaults.request_timeout, Duration::from_secs_f64),
                    max_retries: self.retries.unwrap_or(defaults.max_retries),
                    chat_template_kwargs: self.chat_template_kwargs.clone(),
                    ..defaults
                };
                match OpenAi::new(config) {
                    Ok(server) => Ok(Some(Box::new(server))),
                    Err(error) => {
                        eprintln!("error: {error}");
                        Err(ExitCode::from(EXIT_USAGE))
                    }
                }
            }
            #[cfg(feature = "local")]
            SamplerKind::Local => {
                use holo_runtime::local::LocalModel;
                let dir = self.model.clone().unwrap_or_default();
                let options = self.local.options(concurrency)?;
                let model = LocalModel::load(&dir, options).map_err(|error| {
                    eprintln!("error: --model `{dir}`: {error}");
                    ExitCode::from(EXIT_USAGE)
                })?;
                model.grammars().check(holoware).map_err(|error| {
                    eprintln!("error: {error}");
                    ExitCode::from(EXIT_USAGE)
                })?;
                let labelled = rows.iter().map(|(label, row)| (label, *row));
                model
                    .grammars()
                    .check_rows(holoware, labelled)
                    .map_err(|errors| {
                        for error in errors {
                            eprintln!("error: {error}");
                        }
                        ExitCode::from(EXIT_USAGE)
                    })?;
                Ok(Some(Box::new(model)))
            }
            #[cfg(not(feature = "local"))]
            SamplerKind::Local => {
                eprintln!("error: this holo was built without the `local` feature");
                Err(ExitCode::from(EXIT_USAGE))
            }
        }
    }
}

/// A number of seconds above 0 (and at most 1e9), for the options that take one.
pub fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && seconds > 0.0 && seconds <= 1e9 => Ok(seconds),
        Ok(_) => Err(format!("{text} is not a number of seconds above 0")),
        Err(error) => Err(format!("{text} is not a number of seconds: {error}")),
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SamplerKind {
    /// Scripted replies (--reply): reproducible, no model.
    Scripted,
    /// An OpenAI-compatible server (--base-url, --model).
    Openai,
    /// A model folder or `.gguf` file (--model) run in process (README, "Local models").
    Local,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Color {
    Auto,
    Always,
    Never,
}

fn main() -> ExitCode {
    #[cfg(feature = "local")]
    holo_runtime::local::threads::settle();
    allocator::install();
    let args: Vec<String> = std::env::args().collect();
    // The trainers' `--key value` options are split off before clap sees the rest.
    #[cfg(feature = "train")]
    let (args, trainer_options) = {
        let split = match args.get(1).map(String::as_str) {
            #[cfg(feature = "local")]
            Some("sft") => {
                options::split_options::<holo_runtime::train::sft::SftConfig>(args, "sft")
            }
            _ => options::split_options::<holo_runtime::train::GrpoConfig>(args, "train"),
        };
        match split {
            Ok(split) => split,
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
        }
    };
    match Cli::parse_from(args).command {
        Command::Dry(args) => dry::run(args),
        Command::Eval(args) => eval::run(args),
        #[cfg(feature = "local")]
        Command::Compare(args) => compare::run(args),
        #[cfg(feature = "local")]
        Command::InitModel(args) => init_model::run(args),
        #[cfg(feature = "local")]
        Command::Serve(args) => serve::run(args),
        #[cfg(feature = "train")]
        Command::Train(args) => {
            allocator::keep_freed_memory();
            train::run(args, trainer_options)
        }
        #[cfg(feature = "local")]
        Command::Sft(args) => {
            allocator::keep_freed_memory();
            sft::run(args, trainer_options)
        }
        #[cfg(feature = "local")]
        Command::Demo(args) => {
            allocator::keep_freed_memory();
            demo::run(args)
        }
        #[cfg(feature = "local")]
        Command::Export(args) => export::run(args),
        #[cfg(feature = "train")]
        Command::Plot(args) => plot::run(args),
        #[cfg(feature = "train")]
        Command::Runs(args) => runs::run(args),
        Command::ExportData(args) => export_data::run(args),
        Command::AtroposEnv(args) => atropos_env::run(args),
        #[cfg(feature = "local")]
        Command::Gym(args) => gym::run(args),
        #[cfg(feature = "local")]
        Command::TinkerServe(args) => tinker_serve::run(args),
        Command::View(args) => view::run(args),
    }
}

const EXIT_FAILURES: u8 = 1;
const EXIT_USAGE: u8 = 2;

/// The resources `holo` gives every rollout: the `calculator` tool and ERL's reflection memory (the
/// trainer sizes it from its configuration).
fn resources() -> holo_runtime::Resources {
    let mut resources = holo_runtime::Resources::default();
    resources.insert(holotypes::Tools::new().with_calculator());
    resources.insert(holotypes::ReflectionMemory::default());
    resources
}

/// Gives the rollouts the code sandbox's policy, and checks before anything runs that the holoware's
/// code can run here (by default, refuses where the machine cannot sandbox it) and that every holotype
/// takes its arguments (`<|MathAnswer weight=abc|>` would otherwise fail every rollout).
fn prepare_rollouts(
    holoware: &Holoware,
    resources: &mut holo_runtime::Resources,
    policy: holotypes::CodeSandbox,
) -> Result<(), ExitCode> {
    resources.insert(policy);
    holotypes::check_code_sandbox(holoware.program(), resources).map_err(|message| {
        eprintln!("error: {message}");
        ExitCode::from(EXIT_USAGE)
    })?;
    holoware.check_holotypes(resources).map_err(|error| {
        eprintln!("error: {error}");
        ExitCode::from(EXIT_USAGE)
    })
}

/// A runtime with a worker per core (at least 2), for the servers: a request or a rollout that holds
/// a worker (parsing a large body, stepping holotypes) does not hold the others.
#[cfg(feature = "local")]
fn server_runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().max(2));
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .map_err(|error| {
            eprintln!("error: cannot start the async runtime: {error}");
            ExitCode::from(EXIT_FAILURES)
        })
}

fn runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| {
            eprintln!("error: cannot start the async runtime: {error}");
            ExitCode::from(EXIT_USAGE)
        })
}

/// The rows of `data` that `holoware` can start on (they parse and give its inputs), each labelled
/// `data:line`, as the commands name rows: those whose constraints a local model compiles before any
/// rollout ([`SamplerArgs::sampler`]). The others are the commands' own errors.
fn startable<'r>(
    data: &str,
    rows: &'r [NumberedRow],
    holoware: &Holoware,
) -> Vec<(String, &'r Row)> {
    rows.iter()
        .filter_map(|(line, row)| {
            let row = row.as_ref().ok()?;
            holoware.check_row(row).ok()?;
            Some((format!("{data}:{line}"), row))
        })
        .collect()
}

/// Reads and checks a `.hol` file: an unreadable file is a usage error (2), diagnostics a failure (1).
fn load(file: &Path) -> Result<Arc<Holoware>, ExitCode> {
    let bytes = std::fs::read(file).map_err(|error| {
        eprintln!("error: cannot read `{}`: {error}", file.display());
        ExitCode::from(EXIT_USAGE)
    })?;
    let name = file.display().to_string();
    match Holoware::load_file(&name, file, &bytes, Arc::new(holotypes::registry())) {
        Ok(holoware) => Ok(Arc::new(holoware)),
        Err(error) => {
            eprint!("{error}");
            Err(ExitCode::from(EXIT_FAILURES))
        }
    }
}
