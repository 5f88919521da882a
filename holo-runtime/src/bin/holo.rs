//! `holo`: run holowares. `holo dry FILE.hol` runs rollouts with a scripted sampler and prints what
//! would be trained; `holo eval FILE.hol --data rows.jsonl` runs a dataset through the Loom, writes the
//! rollouts as JSONL and prints the mean rewards and pass@k.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};
use holo_runtime::holophore::{render_contexts, Holophore, TokenView};
use holo_runtime::holotypes::{self, Tools};
use holo_runtime::interpreter::{Holoware, Row};
use holo_runtime::loom::{Loom, LoomConfig, RolloutRecord, Summary};
use holo_runtime::{
    Completion, OpenAi, OpenAiConfig, Recorder, Resources, Rollout, RolloutError, Sampler,
    Scripted, Step, Transcript,
};

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
    Dry {
        file: PathBuf,
        /// Data rows, one JSON object per line. Without it, one row gives each input the value `<name>`.
        #[arg(long)]
        data: Option<PathBuf>,
        /// Rollouts per row.
        #[arg(short = 'n', long, default_value_t = 1)]
        rollouts: usize,
        #[arg(long, value_enum, default_value_t = Color::Auto)]
        color: Color,
        #[command(flatten)]
        sampler: SamplerArgs,
    },
    /// Run a dataset through the Loom: G rollouts per row, every pending request of a tick sampled in
    /// one batch. Writes each rollout as a JSONL line as it finishes, then prints the mean of each reward
    /// component, the mean total reward and pass@k (k = 1 and G; a rollout passes when it completed with
    /// a total reward > 0). Exit status 1 when a row or a rollout failed.
    Eval {
        file: PathBuf,
        /// Data rows, one JSON object per line; repeat for several datasets (each summarized apart).
        #[arg(long, required = true)]
        data: Vec<PathBuf>,
        /// Rollouts per row (G).
        #[arg(short = 'n', long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        rollouts: u32,
        #[command(flatten)]
        sampler: SamplerArgs,
        /// Where the rollouts are written, one JSON object per line.
        #[arg(long, default_value = "rollouts.jsonl")]
        out: PathBuf,
        /// The run seed; every rollout's sampling seed is derived from it, the row and the rollout.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Rollouts in flight at once: the largest batch, and the most requests sent to a server at
        /// once.
        #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
        concurrency: u32,
        /// Continue an interrupted run: keep the completed rollouts already in --out, run the others
        /// (failed ones again) with the seeds they would have had, and summarize them all. Needs the same
        /// .hol file, data, -n and --seed as the run it continues.
        #[arg(long)]
        resume: bool,
    },
    /// Write a random-initialised model folder in Hugging Face format (config.json,
    /// model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json) with a
    /// Qwen-style byte-level BPE tokenizer built offline; transformers loads it unchanged.
    #[cfg(feature = "local")]
    InitModel {
        /// qwen2 (tied embeddings, q/k/v biases) or llama.
        #[arg(long, default_value = "qwen2", value_parser = holo_runtime::local::init::parse_arch)]
        arch: holo_runtime::local::Arch,
        /// tiny (tests) or small (Qwen2.5-0.5B / SmolLM2-135M shapes with a 512-token vocabulary).
        #[arg(long, default_value = "tiny")]
        preset: holo_runtime::local::init::Preset,
        /// Seeds the weights; the same seed writes the same bytes.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write into a folder that is not empty, replacing the model files in it.
        #[arg(long)]
        force: bool,
        /// The folder to write (created when missing).
        out_dir: PathBuf,
    },
    /// Serve a local model folder (Qwen2 / Llama, Hugging Face format) over an OpenAI-compatible HTTP
    /// API: GET /v1/models, POST /v1/completions and /v1/chat/completions (logprobs, n, stop,
    /// max_tokens, temperature, top_p, top_k, seed). Concurrent requests are sampled together in one
    /// batch. Runs until interrupted.
    #[cfg(feature = "local")]
    Serve {
        /// A Hugging Face model folder: config.json, model.safetensors (or shards), tokenizer.json,
        /// tokenizer_config.json (chat template), generation_config.json.
        model_dir: PathBuf,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// 0 picks a free port (printed on stderr).
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// The most samples in one batch (a request with `n` > 1 counts `n`).
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
        max_batch: u32,
        /// How long a batch waits for more requests after its first one arrives, in milliseconds.
        #[arg(long, default_value_t = 5)]
        batch_wait_ms: u64,
        /// The model id clients send as `model` (default: MODEL_DIR as given, as vLLM does).
        #[arg(long)]
        served_model_name: Option<String>,
        #[command(flatten)]
        local: LocalArgs,
    },
}

/// Where a local model runs.
#[derive(Args)]
#[cfg_attr(not(feature = "local"), allow(dead_code))]
struct LocalArgs {
    /// cpu, cuda, cuda:N, metal or metal:N (cuda and metal need holo built with that feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weight precision: f32, f16 or bf16 (on the CPU: bf16 matrices with f32 arithmetic, sampling
    /// only).
    #[arg(long, default_value = "f32")]
    dtype: String,
}

#[cfg(feature = "local")]
impl LocalArgs {
    fn options(&self, max_batch: usize) -> Result<holo_runtime::local::LocalOptions, ExitCode> {
        use holo_runtime::local::{parse_device, parse_dtype, LocalOptions};
        let parsed =
            parse_device(&self.device).and_then(|device| Ok((parse_dtype(&self.dtype)?, device)));
        match parsed {
            Ok((dtype, device)) => Ok(LocalOptions {
                device,
                dtype,
                max_batch,
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
    /// sampler it must be such a folder (for `local`, a whole model folder).
    #[arg(long, required_if_eq_any([("sampler", "openai"), ("sampler", "local")]))]
    model: Option<String>,
    /// A scripted reply; repeat to give several, used in turn (the list repeats).
    #[arg(long = "reply")]
    replies: Vec<String>,
    /// With `--sampler local`.
    #[command(flatten)]
    local: LocalArgs,
}

impl SamplerArgs {
    /// The holophore of `--model` when it is a model folder (always, for the scripted sampler).
    fn holophore(&self) -> Result<Option<Holophore>, ExitCode> {
        let Some(model) = &self.model else {
            return Ok(None);
        };
        let dir = Path::new(model);
        if self.sampler == SamplerKind::Openai && !dir.join("tokenizer.json").is_file() {
            return Ok(None);
        }
        Holophore::from_dir(dir).map(Some).map_err(|error| {
            eprintln!("error: --model `{model}`: {error}");
            ExitCode::from(EXIT_USAGE)
        })
    }

    /// The model's sampler (`openai` with at most `concurrency` requests in flight, or `local` with
    /// batches of at most `concurrency`), or `None` for the scripted replies.
    fn sampler(&self, concurrency: usize) -> Result<Option<Box<dyn Sampler>>, ExitCode> {
        if self.sampler != SamplerKind::Scripted && !self.replies.is_empty() {
            eprintln!("error: --reply is for the scripted sampler");
            return Err(ExitCode::from(EXIT_USAGE));
        }
        match self.sampler {
            SamplerKind::Scripted => Ok(None),
            SamplerKind::Openai => {
                let config = OpenAiConfig {
                    max_concurrency: concurrency,
                    ..OpenAiConfig::new(
                        self.base_url.clone().unwrap_or_default(),
                        self.model.clone().unwrap_or_default(),
                    )
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
                match LocalModel::load(&dir, options) {
                    Ok(model) => Ok(Some(Box::new(model))),
                    Err(error) => {
                        eprintln!("error: --model `{dir}`: {error}");
                        Err(ExitCode::from(EXIT_USAGE))
                    }
                }
            }
            #[cfg(not(feature = "local"))]
            SamplerKind::Local => {
                eprintln!("error: this holo was built without the `local` feature");
                Err(ExitCode::from(EXIT_USAGE))
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SamplerKind {
    /// Scripted replies (--reply): reproducible, no model.
    Scripted,
    /// An OpenAI-compatible server (--base-url, --model).
    Openai,
    /// A Hugging Face Qwen2 / Llama folder (--model DIR) run in process on the CPU.
    Local,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Color {
    Auto,
    Always,
    Never,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Dry {
            file,
            data,
            rollouts,
            color,
            sampler: sampler_args,
        } => {
            let sampler = match sampler_args.sampler(128) {
                Ok(sampler) => sampler,
                Err(code) => return code,
            };
            let holophore = match sampler_args.holophore() {
                Ok(holophore) => holophore,
                Err(code) => return code,
            };
            let color = match color {
                Color::Always => true,
                Color::Never => false,
                Color::Auto => {
                    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
                }
            };
            dry(
                &file,
                data.as_deref(),
                rollouts,
                &sampler_args.replies,
                sampler.as_deref(),
                holophore.as_ref(),
                color,
            )
        }
        Command::Eval {
            file,
            data,
            rollouts,
            sampler: sampler_args,
            out,
            seed,
            concurrency,
            resume,
        } => {
            let holophore = match sampler_args.holophore() {
                Ok(holophore) => holophore,
                Err(code) => return code,
            };
            let scripted = |script: Scripted| match &holophore {
                Some(holophore) => script.tokenized(holophore),
                None => script,
            };
            let sampler: Box<dyn Sampler> = match sampler_args.sampler(concurrency as usize) {
                Ok(Some(sampler)) => sampler,
                Ok(None) if sampler_args.replies.is_empty() => {
                    Box::new(scripted(Scripted::new(["<answer>42</answer>"])))
                }
                Ok(None) => Box::new(scripted(Scripted::new(sampler_args.replies))),
                Err(code) => return code,
            };
            let config = LoomConfig {
                rollouts_per_row: rollouts as usize,
                seed,
                concurrency: concurrency as usize,
                progress: true,
                ..LoomConfig::default()
            };
            eval(
                &file,
                &data,
                &*sampler,
                holophore.as_ref(),
                config,
                &out,
                resume,
            )
        }
        #[cfg(feature = "local")]
        Command::InitModel {
            arch,
            preset,
            seed,
            force,
            out_dir,
        } => {
            use holo_runtime::local::init;
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
        #[cfg(feature = "local")]
        Command::Serve {
            model_dir,
            host,
            port,
            max_batch,
            batch_wait_ms,
            served_model_name,
            local,
        } => serve(
            &model_dir,
            &host,
            port,
            holo_runtime::serve::ServeConfig {
                max_batch: max_batch as usize,
                batch_wait: std::time::Duration::from_millis(batch_wait_ms),
                ..Default::default()
            },
            served_model_name,
            &local,
        ),
    }
}

const EXIT_FAILURES: u8 = 1;
const EXIT_USAGE: u8 = 2;

fn dry(
    file: &Path,
    data: Option<&Path>,
    rollouts: usize,
    replies: &[String],
    sampler: Option<&dyn Sampler>,
    holophore: Option<&Holophore>,
    color: bool,
) -> ExitCode {
    let holoware = match load(file) {
        Ok(holoware) => holoware,
        Err(exit) => return exit,
    };
    let rows = match data {
        Some(path) => match read_rows(path) {
            Ok(rows) => rows,
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
        },
        None => vec![(1, Ok(placeholder_row(&holoware)))],
    };
    let data_name = data.map_or_else(
        || "placeholder".to_string(),
        |path| path.display().to_string(),
    );
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());
    let replies: Vec<String> = if replies.is_empty() {
        vec!["<answer>42</answer>".to_string()]
    } else {
        replies.to_vec()
    };

    let mut failures = 0;
    let mut stdout = std::io::stdout().lock();
    let mut sampled_rows = Vec::new();
    for (line, row) in rows {
        let row = match row {
            Ok(row) => row,
            Err(message) => {
                eprintln!("error: {data_name}:{line}: {message}");
                failures += 1;
                continue;
            }
        };
        if let Err(missing) = holoware.check_row(&row) {
            eprintln!("error: {data_name}:{line}: {missing}");
            failures += 1;
            continue;
        }
        if sampler.is_some() {
            sampled_rows.push((line, row));
            continue;
        }
        for rollout in 1..=rollouts {
            let mut script = Scripted::new(replies.iter().cycle().take(1000).cloned());
            let (outcome, reward, rendered) = match holophore {
                Some(holophore) => {
                    script = script.tokenized(holophore);
                    let mut tokens = holophore.fork();
                    let outcome = run(&holoware, &row, &resources, script, &mut tokens);
                    tokens.finish();
                    (outcome, tokens.reward(), tokens.render(color))
                }
                None => {
                    let mut transcript = Transcript::default();
                    let outcome = run(&holoware, &row, &resources, script, &mut transcript);
                    (outcome, transcript.reward(), transcript.render(color))
                }
            };
            let header = format!("# row {line}, rollout {rollout}, reward {reward}\n");
            let _ = writeln!(stdout, "{header}{rendered}");
            if let Err(error) = outcome {
                eprintln!("error: {data_name}:{line}: rollout {rollout}: {error}");
                failures += 1;
            }
        }
    }
    if let Some(sampler) = sampler {
        match dry_loom(
            &holoware,
            &resources,
            &sampled_rows,
            rollouts,
            sampler,
            holophore,
            color,
            &data_name,
            &mut stdout,
        ) {
            Ok(failed) => failures += failed,
            Err(code) => return code,
        }
    }
    if failures > 0 {
        ExitCode::from(EXIT_FAILURES)
    } else {
        ExitCode::SUCCESS
    }
}

/// `holo dry` with a model: the rows (indexed by their line) run through the Loom, then each transcript
/// is printed in row and rollout order. Returns how many rollouts failed.
#[allow(clippy::too_many_arguments)]
fn dry_loom(
    holoware: &Arc<Holoware>,
    resources: &Resources,
    rows: &[(usize, Row)],
    rollouts: usize,
    sampler: &dyn Sampler,
    holophore: Option<&Holophore>,
    color: bool,
    data_name: &str,
    stdout: &mut impl Write,
) -> Result<usize, ExitCode> {
    let runtime = runtime()?;
    let mut loom = Loom::interpreted(
        Arc::clone(holoware),
        resources.clone(),
        LoomConfig {
            rollouts_per_row: rollouts.max(1),
            progress: true,
            timing: false,
            ..LoomConfig::default()
        },
    );
    if let Some(holophore) = holophore {
        loom = loom.with_holophore(holophore.fork());
    }
    let mut jsonl = Vec::new();
    if let Err(error) = runtime.block_on(loom.run(rows, sampler, &mut jsonl)) {
        eprintln!("error: {error}");
        return Err(ExitCode::from(EXIT_FAILURES));
    }
    let mut records: Vec<RolloutRecord> = jsonl
        .split(|&byte| byte == b'\n')
        .filter(|line| !line.is_empty())
        .filter_map(|line| serde_json::from_slice(line).ok())
        .collect();
    records.sort_by_key(|record| (record.row_index, record.rollout_index));
    let mut failed = 0;
    for record in &records {
        let mut transcript = Transcript::default();
        for context in &record.contexts {
            transcript.begin_context(context.trained);
            for message in &context.messages {
                transcript.begin_message(message.role);
                for part in &message.parts {
                    if part.sampled {
                        transcript.completion(&Completion {
                            text: part.text.clone(),
                            ..Completion::default()
                        });
                    } else {
                        transcript.text(&part.text);
                    }
                }
            }
        }
        for (name, value) in &record.rewards {
            let weight = record.weights.get(name).copied().unwrap_or(1.0);
            Recorder::reward(&mut transcript, name, *value, weight);
        }
        let (line, rollout) = (record.row_index, record.rollout_index + 1);
        let rendered = match holophore {
            Some(holophore) => {
                let views: Vec<TokenView<'_>> = record
                    .contexts
                    .iter()
                    .filter_map(|context| {
                        let tokens = context.tokens.as_ref()?;
                        Some(TokenView {
                            trained: context.trained,
                            ids: &tokens.ids,
                            loss_mask: &tokens.loss_mask,
                        })
                    })
                    .collect();
                render_contexts(holophore.tokenizer(), &views, &transcript.rewards, color)
            }
            None => transcript.render(color),
        };
        let _ = writeln!(
            stdout,
            "# row {line}, rollout {rollout}, reward {}\n{rendered}",
            record.reward,
        );
        if let Some(error) = &record.error {
            eprintln!(
                "error: {data_name}:{line}: rollout {rollout}: {}",
                error.message
            );
            failed += 1;
        }
    }
    Ok(failed)
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

fn eval(
    file: &Path,
    datasets: &[PathBuf],
    sampler: &dyn Sampler,
    holophore: Option<&Holophore>,
    config: LoomConfig,
    out: &Path,
    resume: bool,
) -> ExitCode {
    let holoware = match load(file) {
        Ok(holoware) => holoware,
        Err(exit) => return exit,
    };
    let mut datasets_rows = Vec::with_capacity(datasets.len());
    for path in datasets {
        match read_rows(path) {
            Ok(rows) => datasets_rows.push((path.display().to_string(), rows)),
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
        }
    }
    let previous = if resume && out.exists() {
        match previous_records(out, &datasets_rows) {
            Ok(previous) => previous,
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
        }
    } else {
        Vec::new()
    };
    if let Err(message) = check_previous(&previous, &datasets_rows, &config) {
        eprintln!("error: --resume: {}: {message}", out.display());
        return ExitCode::from(EXIT_USAGE);
    }
    let mut writer = match start_output(out, &previous) {
        Ok(file) => std::io::BufWriter::new(file),
        Err(error) => {
            eprintln!("error: cannot write `{}`: {error}", out.display());
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());

    let mut failures = 0;
    let mut stdout = std::io::stdout().lock();
    for (data_name, rows) in datasets_rows {
        // Row index: the row's position among the file's non-blank lines (0-based), as in the JSONL.
        let lines: Vec<usize> = rows.iter().map(|(line, _)| *line).collect();
        let mut good = Vec::with_capacity(rows.len());
        for (index, (line, row)) in rows.into_iter().enumerate() {
            match row.and_then(|row| {
                holoware
                    .check_row(&row)
                    .map(|()| row)
                    .map_err(|missing| missing.to_string())
            }) {
                Ok(row) => good.push((index, row)),
                Err(message) => {
                    eprintln!("error: {data_name}:{line}: {message}");
                    failures += 1;
                }
            }
        }
        let mut loom = Loom::interpreted(
            Arc::clone(&holoware),
            resources.clone(),
            LoomConfig {
                dataset: Some(data_name.clone()),
                ..config.clone()
            },
        );
        if let Some(holophore) = holophore {
            loom = loom.with_holophore(holophore.fork());
        }
        let done: Vec<RolloutRecord> = previous
            .iter()
            .filter(|record| record.dataset.as_deref() == Some(data_name.as_str()))
            .cloned()
            .collect();
        let summary = match runtime.block_on(loom.resume(&good, &done, sampler, &mut writer)) {
            Ok(summary) => summary,
            Err(error) if error.kind() == std::io::ErrorKind::InvalidInput => {
                eprintln!("error: --resume: {}: {error}", out.display());
                return ExitCode::from(EXIT_USAGE);
            }
            Err(error) => {
                eprintln!("error: cannot write `{}`: {error}", out.display());
                return ExitCode::from(EXIT_USAGE);
            }
        };
        for failure in &summary.row_failures {
            eprintln!(
                "error: {data_name}:{}: {}",
                lines[failure.row_index], failure.message
            );
        }
        for failure in &summary.failures {
            eprintln!(
                "error: {data_name}:{}: rollout {}: {}",
                lines[failure.row_index], failure.rollout_index, failure.failure.message
            );
        }
        failures += summary.row_failures.len() + summary.failed;
        let _ = write!(
            stdout,
            "{}",
            report(&data_name, config.rollouts_per_row, &summary)
        );
    }
    let _ = writeln!(stdout, "rollouts written to {}", out.display());
    if failures > 0 {
        ExitCode::from(EXIT_FAILURES)
    } else {
        ExitCode::SUCCESS
    }
}

/// The completed records of an interrupted run's JSONL (failed ones are left out, to run again). A last
/// line cut short by the interruption is ignored; any other unreadable line, or a record of a dataset this
/// run does not read, is an error, so that nothing written is lost.
fn previous_records(
    out: &Path,
    datasets: &[(String, Vec<NumberedRow>)],
) -> Result<Vec<RolloutRecord>, String> {
    let text = std::fs::read_to_string(out)
        .map_err(|error| format!("cannot read `{}`: {error}", out.display()))?;
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let mut records = Vec::new();
    let mut failed = 0;
    for (number, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: RolloutRecord = match serde_json::from_str(line) {
            Ok(record) => record,
            Err(_) if number + 1 == lines.len() && !line.ends_with('\n') => {
                eprintln!(
                    "warning: {}:{}: ignoring an unfinished last line (the interrupted write)",
                    out.display(),
                    number + 1
                );
                continue;
            }
            Err(error) => {
                return Err(format!(
                    "{}:{}:{}: not a rollout record: {error}",
                    out.display(),
                    number + 1,
                    error.column()
                ))
            }
        };
        let known = datasets
            .iter()
            .any(|(name, _)| record.dataset.as_deref() == Some(name.as_str()));
        if !known {
            return Err(format!(
                "{}:{}: a record of dataset {:?}, which this run does not read (give the same --data)",
                out.display(),
                number + 1,
                record.dataset.as_deref().unwrap_or("?")
            ));
        }
        if record.error.is_some() {
            failed += 1;
        } else {
            records.push(record);
        }
    }
    eprintln!(
        "resuming {}: {} rollouts done, {failed} failed ones to run again",
        out.display(),
        records.len()
    );
    Ok(records)
}

/// Refuses, before anything is rewritten, records that this run would not have made: another seed,
/// rollout count or data (the Loom checks the same again when it resumes).
fn check_previous(
    previous: &[RolloutRecord],
    datasets: &[(String, Vec<NumberedRow>)],
    config: &LoomConfig,
) -> Result<(), String> {
    for record in previous {
        let (row, rollout) = (record.row_index, record.rollout_index);
        let rows = datasets
            .iter()
            .find(|(name, _)| record.dataset.as_deref() == Some(name.as_str()))
            .map_or(0, |(_, rows)| rows.len());
        let why = if row >= rows {
            Some("the data has no such row".to_string())
        } else {
            config.foreign(record)
        };
        if let Some(why) = why {
            return Err(format!("record of row {row}, rollout {rollout}: {why}"));
        }
    }
    Ok(())
}

/// Opens the output for appending after writing `previous` into it; the old file is replaced only once
/// the new one is complete (written beside it, then renamed), so an interruption loses nothing.
fn start_output(out: &Path, previous: &[RolloutRecord]) -> std::io::Result<std::fs::File> {
    if previous.is_empty() {
        return std::fs::File::create(out);
    }
    let mut staging = out.as_os_str().to_owned();
    staging.push(".resume");
    let staging = PathBuf::from(staging);
    {
        let mut writer = std::io::BufWriter::new(std::fs::File::create(&staging)?);
        for record in previous {
            serde_json::to_writer(&mut writer, record)?;
            writer.write_all(b"\n")?;
        }
        writer
            .into_inner()
            .map_err(|error| error.into_error())?
            .sync_all()?;
    }
    std::fs::rename(&staging, out)?;
    std::fs::OpenOptions::new().append(true).open(out)
}

/// The summary of one dataset, one fact a line.
fn report(data_name: &str, per_row: usize, summary: &Summary) -> String {
    let mut text = format!(
        "== {data_name}: {} rows x {per_row} rollouts: {} rollouts, {} failed, {} batches, {:.1} rollouts/s\n",
        summary.rows,
        summary.rollouts,
        summary.failed,
        summary.batches,
        summary.rollouts_per_second()
    );
    for component in &summary.components {
        text.push_str(&format!(
            "reward {} = {:.4} (mean of {})\n",
            component.name, component.mean, component.count
        ));
    }
    match summary.mean_reward {
        Some(mean) => text.push_str(&format!("mean reward = {mean:.4}\n")),
        None => text.push_str("mean reward = n/a (no rollout completed)\n"),
    }
    for (k, value) in &summary.pass_at_k {
        text.push_str(&format!("pass@{k} = {value:.4}\n"));
    }
    text
}

fn run(
    holoware: &Arc<Holoware>,
    row: &Row,
    resources: &Resources,
    mut sampler: Scripted,
    recorder: &mut dyn Recorder,
) -> Result<(), RolloutError> {
    let mut rollout = holoware.start_with(row, resources)?;
    while let Step::Sample(request) = rollout.step(recorder)? {
        let completion = sampler
            .complete(&request)
            .ok_or(RolloutError::Protocol("the scripted replies ran out"))?;
        rollout.resume(completion, recorder)?;
    }
    Ok(())
}

/// Every input as `<name>`: enough to see the shape of a holoware without data.
/// Reads and checks a `.hol` file: an unreadable file is a usage error (2), diagnostics a failure (1).
fn load(file: &Path) -> Result<Arc<Holoware>, ExitCode> {
    let bytes = std::fs::read(file).map_err(|error| {
        eprintln!("error: cannot read `{}`: {error}", file.display());
        ExitCode::from(EXIT_USAGE)
    })?;
    let name = file.display().to_string();
    match Holoware::load(&name, &bytes, Arc::new(holotypes::registry())) {
        Ok(holoware) => Ok(Arc::new(holoware)),
        Err(error) => {
            eprint!("{error}");
            Err(ExitCode::from(EXIT_FAILURES))
        }
    }
}

/// Every input as `<name>`, and every column a built-in reward compares with (`target=`, by default
/// `expected`) as `<column>`: enough to see the shape of a holoware without data.
fn placeholder_row(holoware: &Holoware) -> Row {
    let program = holoware.program();
    let targets = program
        .holotypes
        .iter()
        .filter(|holotype| {
            holotype.builtin && matches!(holotype.name.as_str(), "ExactAnswer" | "MathAnswer")
        })
        .map(|holotype| {
            holotype
                .args
                .iter()
                .find(|arg| arg.name.as_deref() == Some("target"))
                .map_or_else(
                    || "expected".to_string(),
                    |arg| arg.value.to_string().trim_matches('"').to_string(),
                )
        });
    program
        .inputs
        .iter()
        .map(|input| input.name.clone())
        .chain(targets)
        .map(|name| {
            let value = serde_json::Value::String(format!("<{name}>"));
            (name, value)
        })
        .collect()
}

/// The rows of a JSONL file, each with its line number; a line that is not a JSON object is an error
/// for that row only. Blank lines are skipped.
type NumberedRow = (usize, Result<Row, String>);

fn read_rows(path: &Path) -> Result<Vec<NumberedRow>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| format!("cannot read `{}`: {error}", path.display()))?;
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(index, line)| {
            let row = match serde_json::from_str::<serde_json::Value>(line) {
                Ok(serde_json::Value::Object(row)) => Ok(row),
                Ok(_) => Err("a row must be a JSON object".to_string()),
                Err(error) => {
                    // serde_json's message ends with ` at line 1 column N`; the line is the file's.
                    let message = error.to_string();
                    let message = message
                        .split(" at line ")
                        .next()
                        .unwrap_or(&message)
                        .to_string();
                    Err(format!(
                        "column {}: invalid JSON: {message}",
                        error.column()
                    ))
                }
            };
            (index + 1, row)
        })
        .collect())
}

/// `holo serve`: loads the model folder and serves it until the process is interrupted.
/// A folder without a chat template is served with ChatML for chat requests: say so, since a model
/// trained on another format would then see prompts it was not trained on.
#[cfg(feature = "local")]
fn note_builtin_template(dir: &Path, model: &holo_runtime::local::LocalModel) {
    if model.template().is_builtin() {
        eprintln!(
            "note: {} has no chat template (no `chat_template` in tokenizer_config.json, no \
             chat_template.jinja): chat requests are rendered with ChatML",
            dir.display()
        );
    }
}

#[cfg(feature = "local")]
fn serve(
    model_dir: &Path,
    host: &str,
    port: u16,
    config: holo_runtime::serve::ServeConfig,
    served_model_name: Option<String>,
    local: &LocalArgs,
) -> ExitCode {
    use holo_runtime::local::LocalModel;
    use holo_runtime::serve::{ServedModel, Server};

    let options = match local.options(config.max_batch) {
        Ok(options) => options,
        Err(code) => return code,
    };
    let model = match LocalModel::load(model_dir, options) {
        Ok(model) => model,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    note_builtin_template(model_dir, &model);
    let id = served_model_name.unwrap_or_else(|| model_dir.display().to_string());
    let served = ServedModel::local(id.clone(), model);
    let runtime = match runtime() {
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
