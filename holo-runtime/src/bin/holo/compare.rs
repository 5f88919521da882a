//! `holo compare`: two policies on the same rows and rollout seeds; each metric's means, the difference
//! B − A and its paired bootstrap 95% interval (`holo_runtime::train::compare`), as a table, JSON and a
//! PNG.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use holo_runtime::holophore::Holophore;
use holo_runtime::holotypes::CodeSandbox;
use holo_runtime::interpreter::{read_rows, Holoware, Row};
use holo_runtime::loom::{Jsonl, Loom, LoomConfig};
use holo_runtime::train::export::{self, export, RunInfo};
use holo_runtime::train::report::compare::{compare, RESAMPLES};

use crate::{load, runtime, LocalArgs, SamplerArgs, SamplerKind, EXIT_FAILURES, EXIT_USAGE};

#[derive(Args)]
pub struct CompareArgs {
    file: PathBuf,
    /// Policy A: a model folder (Hugging Face layout), a `.gguf` file, a run folder (`holo train`,
    /// `holo sft`), whose newest checkpoint is exported to OUT/a-model first, one of its
    /// `checkpoint-N` folders, exported the same way, or a PEFT LoRA adapter folder
    /// (`adapter_config.json`, `adapter_model.safetensors`), merged into its base model
    /// (`base_model_name_or_path`, or --adapter-base) in OUT/a-model.
    a: String,
    /// Policy B, as A (a run folder, checkpoint or adapter is written to OUT/b-model).
    b: String,
    /// The base model of an adapter folder given as A or B, when its `base_model_name_or_path` is not a
    /// local folder (a Hub name).
    #[arg(long, value_name = "MODEL")]
    adapter_base: Option<PathBuf>,
    /// Data rows, one JSON object per line.
    #[arg(long)]
    data: PathBuf,
    /// Rollouts per row (G) under each policy.
    #[arg(short = 'n', long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    rollouts: u32,
    /// The run seed: both policies' rollouts get the same seeds from it, the row and the rollout; it
    /// also seeds the bootstrap.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The folder to write: a.jsonl and b.jsonl (the rollouts), compare.json (the table's numbers) and
    /// compare.png (the differences with their intervals).
    #[arg(long, default_value = "compare")]
    out: PathBuf,
    /// Bootstrap resamples of the rows.
    #[arg(long, default_value_t = RESAMPLES, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    resamples: usize,
    /// Rollouts in flight at once: the largest batch.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    concurrency: u32,
    #[command(flatten)]
    local: LocalArgs,
    /// Run model-written code (CodeExecutor) without a sandbox where this machine cannot sandbox it.
    #[arg(long)]
    allow_unsandboxed_code: bool,
    /// Extra arguments of the chat template, a JSON object (`holo eval`'s), for both policies.
    #[arg(long, value_name = "JSON", value_parser = crate::template_kwargs)]
    chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// The reward component whose full credit (>= 1) makes a rollout pass, for pass@k. Default: the
    /// holoware's answer check (ExactAnswer or MathAnswer; the one marked `pass=true` where there are
    /// several); without one, pass@k is not computed.
    #[arg(long, value_name = "NAME")]
    pass_component: Option<String>,
}

/// One policy, ready to roll out.
struct Policy {
    label: &'static str,
    name: String,
    sampler: Box<dyn holo_runtime::Sampler>,
    holophore: Option<Holophore>,
}

pub fn run(args: CompareArgs) -> ExitCode {
    let usage = |message: String| {
        eprintln!("error: {message}");
        ExitCode::from(EXIT_USAGE)
    };
    // Everything is checked before the first rollout: the holoware, every row, both models.
    let holoware = match load(&args.file) {
        Ok(holoware) => holoware,
        Err(exit) => return exit,
    };
    let (rows, lines) = match checked_rows(&holoware, &args.data) {
        Ok(checked) => checked,
        Err(message) => return usage(message),
    };
    for (label, model) in [("A", &args.a), ("B", &args.b)] {
        if let Err(message) = check_policy(model, args.adapter_base.as_deref()) {
            return usage(format!("policy {label}: {message}"));
        }
    }
    let mut resources = crate::resources();
    let sandbox = CodeSandbox {
        allow_unsandboxed: args.allow_unsandboxed_code,
        ..CodeSandbox::default()
    };
    if let Err(code) = crate::prepare_rollouts(&holoware, &mut resources, sandbox) {
        return code;
    }
    if let Err(error) = std::fs::create_dir_all(&args.out) {
        return usage(format!("cannot create `{}`: {error}", args.out.display()));
    }
    let data = args.data.display();
    let labelled: Vec<(String, &Row)> = rows
        .iter()
        .map(|(index, row)| (format!("{data}:{}", lines[*index]), row))
        .collect();
    let mut policies = Vec::with_capacity(2);
    for (label, model) in [("a", &args.a), ("b", &args.b)] {
        match policy(label, model, &args, &holoware, &labelled) {
            Ok(policy) => policies.push(policy),
            Err(code) => return code,
        }
    }
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };

    let config = LoomConfig {
        rollouts_per_row: args.rollouts as usize,
        seed: args.seed,
        concurrency: args.concurrency as usize,
        dataset: Some(args.data.display().to_string()),
        progress: true,
        ..LoomConfig::default()
    };
    let mut records = Vec::with_capacity(2);
    let mut failed = 0;
    for policy in &policies {
        let mut loom = Loom::interpreted(Arc::clone(&holoware), resources.clone(), config.clone());
        if let Some(holophore) = &policy.holophore {
            loom = loom.with_holophore(holophore.fork());
        }
        let path = args.out.join(format!("{}.jsonl", policy.label));
        let cannot_write =
            |error: std::io::Error| usage(format!("cannot write `{}`: {error}", path.display()));
        // Written as the rollouts finish, as `holo eval` does, and kept for the statistics.
        let mut sink = match std::fs::File::create(&path) {
            Ok(file) => (Jsonl(file), Vec::new()),
            Err(error) => return cannot_write(error),
        };
        let summary = match runtime.block_on(loom.run(&rows, &*policy.sampler, &mut sink)) {
            Ok(summary) => summary,
            Err(error) => return cannot_write(error),
        };
        let label = policy.label.to_uppercase();
        for failure in &summary.row_failures {
            let line = lines[failure.row_index];
            eprintln!("error: policy {label}: {data}:{line}: {}", failure.message);
        }
        for failure in &summary.failures {
            let line = lines[failure.row_index];
            eprintln!(
                "error: policy {label}: {data}:{line}: rollout {}: {}",
                failure.rollout_index, failure.failure.message
            );
        }
        failed += summary.failed + summary.row_failures.len();
        records.push(sink.1);
    }

    let pass_component = args.pass_component.as_deref().or(holoware.pass_component());
    let comparison = match compare(
        (&policies[0].name, &records[0]),
        (&policies[1].name, &records[1]),
        (args.rollouts as usize, pass_component),
        args.resamples,
        args.seed,
    ) {
        Ok(comparison) => comparison,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(EXIT_FAILURES);
        }
    };
    print!("{}", comparison.table());
    let json_path = args.out.join("compare.json");
    let json = serde_json::to_string_pretty(&comparison).expect("numbers and strings serialize");
    if let Err(error) = std::fs::write(&json_path, json + "\n") {
        return usage(format!("cannot write `{}`: {error}", json_path.display()));
    }
    if let Err(message) = comparison.plot(&args.out.join("compare.png")) {
        return usage(message);
    }
    println!("written to {}", args.out.display());
    if failed > 0 {
        ExitCode::from(EXIT_FAILURES)
    } else {
        ExitCode::SUCCESS
    }
}

/// The rows of `data` (`(row index, row)`, the index among its non-blank lines, as in the records) and
/// each one's line number, every row checked against the holoware's inputs; every bad row is named.
type CheckedRows = (Vec<(usize, Row)>, Vec<usize>);

fn checked_rows(holoware: &Holoware, data: &Path) -> Result<CheckedRows, String> {
    let mut good = Vec::new();
    let mut lines = Vec::new();
    let mut bad = Vec::new();
    for (index, (line, row)) in read_rows(data)?.into_iter().enumerate() {
        lines.push(line);
        let checked = row.and_then(|row| {
            holoware
                .check_row(&row)
                .map(|()| row)
                .map_err(|missing| missing.to_string())
        });
        match checked {
            Ok(row) => good.push((index, row)),
            Err(message) => bad.push(format!("{}:{line}: {message}", data.display())),
        }
    }
    if !bad.is_empty() {
        return Err(bad.join("\nerror: "));
    }
    if good.is_empty() {
        return Err(format!("`{}` has no rows", data.display()));
    }
    Ok((good, lines))
}

/// Refuses what is not a model folder, a `.gguf` file, a run folder, a checkpoint of one or a PEFT
/// adapter folder whose base model is found (`adapter_base`, else its `base_model_name_or_path`).
fn check_policy(model: &str, adapter_base: Option<&Path>) -> Result<(), String> {
    let path = Path::new(model);
    if !path.exists() {
        return Err(format!(
            "`{model}`: no such model folder, .gguf file, run folder, checkpoint or adapter"
        ));
    }
    if export::is_adapter(path) {
        return match adapter_base {
            Some(base) if base.exists() => Ok(()),
            Some(base) => Err(format!(
                "--adapter-base `{}`: no such model",
                base.display()
            )),
            None => export::adapter_base(path)
                .map(drop)
                .map_err(|message| format!("{message} (--adapter-base names the base model)")),
        };
    }
    if !path.is_dir()
        || path.join("config.json").is_file()
        || path.join(RunInfo::FILE).is_file()
        || checkpoint(path).is_some()
    {
        return Ok(());
    }
    if path.join("trainer_state.json").is_file() {
        return Err(format!(
            "`{model}` looks like a training checkpoint, but its folder is not named checkpoint-N or is \
             not inside a run folder (no {} beside it)",
            RunInfo::FILE
        ));
    }
    Err(format!(
        "`{model}` is not a model folder (no config.json), a run folder (no {}) nor a checkpoint",
        RunInfo::FILE
    ))
}

/// `(run folder, step)` when `path` is a run's `checkpoint-N` folder.
fn checkpoint(path: &Path) -> Option<(&Path, u64)> {
    let step = path
        .file_name()?
        .to_str()?
        .strip_prefix("checkpoint-")?
        .parse()
        .ok()?;
    let run = path.parent()?;
    (path.join("trainer_state.json").is_file() && run.join(RunInfo::FILE).is_file())
        .then_some((run, step))
}

/// The sampler and holophore of policy `label`; a run folder's newest checkpoint is exported to
/// `OUT/<label>-model` first.
fn policy(
    label: &'static str,
    model: &str,
    args: &CompareArgs,
    holoware: &Holoware,
    rows: &[(String, &Row)],
) -> Result<Policy, ExitCode> {
    let mut dir = model.to_string();
    let mut name = model.to_string();
    let path = Path::new(model);
    // A run folder's newest checkpoint, or the checkpoint given, as a model folder.
    let exported = if path.join(RunInfo::FILE).is_file() {
        Some((path, None))
    } else {
        checkpoint(path).map(|(run, step)| (run, Some(step)))
    };
    if export::is_adapter(path) {
        let out = args.out.join(format!("{label}-model"));
        let base = match &args.adapter_base {
            Some(base) => Ok(base.clone()),
            None => export::adapter_base(path),
        };
        let merged = base.and_then(|base| {
            export::merge_adapter(path, &base, &out)?;
            Ok(base)
        });
        match merged {
            Ok(base) => {
                eprintln!(
                    "policy {}: the adapter {model} merged into {} in {}",
                    label.to_uppercase(),
                    base.display(),
                    out.display()
                );
                dir = out.display().to_string();
            }
            Err(message) => {
                eprintln!("error: policy {}: {message}", label.to_uppercase());
                return Err(ExitCode::from(EXIT_USAGE));
            }
        }
    } else if let Some((run, step)) = exported {
        let out = args.out.join(format!("{label}-model"));
        match export(run, step, &out) {
            Ok(exported) => {
                eprintln!(
                    "policy {}: checkpoint-{} of {model} exported to {}",
                    label.to_uppercase(),
                    exported.step,
                    out.display()
                );
                name = format!("{} (checkpoint-{})", run.display(), exported.step);
                dir = out.display().to_string();
            }
            Err(message) => {
                eprintln!("error: policy {}: {message}", label.to_uppercase());
                return Err(ExitCode::from(EXIT_USAGE));
            }
        }
    }
    let sampler_args = SamplerArgs {
        sampler: SamplerKind::Local,
        base_url: None,
        model: Some(dir),
        replies: Vec::new(),
        local: args.local.clone(),
        allow_unsandboxed_code: args.allow_unsandboxed_code,
        request_timeout: None,
        retries: None,
        chat_template_kwargs: args.chat_template_kwargs.clone(),
    };
    let holophore = sampler_args.holophore()?;
    let sampler = sampler_args
        .sampler(args.concurrency as usize, holoware, rows)?
        .expect("the local sampler");
    Ok(Policy {
        label,
        name,
        sampler,
        holophore,
    })
}
