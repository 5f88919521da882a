//! `holo dry`: rollouts with scripted replies (or a model), each transcript printed.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use holo_runtime::holophore::{render_contexts, Holophore, TokenView};
use holo_runtime::holotypes::CodeSandbox;
use holo_runtime::interpreter::{read_rows, Holoware, NumberedRow, Row};
use holo_runtime::loom::{Loom, LoomConfig, RolloutRecord};
use holo_runtime::{
    Completion, Recorder, Resources, Rollout, RolloutError, Sampler, Scripted, Step, Transcript,
};

use crate::{load, runtime, Color, SamplerArgs, EXIT_FAILURES, EXIT_USAGE};

/// `holo dry`'s arguments.
#[derive(clap::Args)]
pub struct DryArgs {
    pub file: PathBuf,
    /// Data rows, one JSON object per line. Without it, one row gives each input the value `<name>`.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Rollouts per row.
    #[arg(short = 'n', long, default_value_t = 1)]
    pub rollouts: usize,
    #[arg(long, value_enum, default_value_t = Color::Auto)]
    pub color: Color,
    #[command(flatten)]
    pub sampler: SamplerArgs,
}

pub fn run(args: DryArgs) -> ExitCode {
    let DryArgs {
        file,
        data,
        rollouts,
        color,
        sampler: sampler_args,
    } = args;
    let holoware = match load(&file) {
        Ok(holoware) => holoware,
        Err(exit) => return exit,
    };
    let rows = match data.as_deref() {
        Some(path) => match read_rows(path) {
            Ok(rows) => rows,
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
        },
        None => vec![(1, Ok(placeholder_row(&holoware)))],
    };
    let data_name = data.as_deref().map_or_else(
        || "placeholder".to_string(),
        |path| path.display().to_string(),
    );
    let startable = crate::startable(&data_name, &rows, &holoware);
    let sampler = match sampler_args.sampler(128, &holoware, &startable) {
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
        Color::Auto => std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
    };
    let code = CodeSandbox {
        allow_unsandboxed: sampler_args.allow_unsandboxed_code,
        ..CodeSandbox::default()
    };
    dry(
        &holoware,
        &data_name,
        rows,
        rollouts,
        &sampler_args.replies,
        sampler.as_deref(),
        holophore.as_ref(),
        color,
        code,
    )
}

// The command's options, one argument each, as `run` has them.
#[allow(clippy::too_many_arguments)]
fn dry(
    holoware: &Arc<Holoware>,
    data_name: &str,
    rows: Vec<NumberedRow>,
    rollouts: usize,
    replies: &[String],
    sampler: Option<&dyn Sampler>,
    holophore: Option<&Holophore>,
    color: bool,
    code: CodeSandbox,
) -> ExitCode {
    let mut resources = crate::resources();
    if let Err(code) = crate::prepare_rollouts(holoware, &mut resources, code) {
        return code;
    }
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
                    let outcome = run_scripted(holoware, &row, &resources, script, &mut tokens)
                        .map_err(|error| error.to_string());
                    tokens.finish();
                    // As the Loom does: a template that failed to render leaves the tokens short.
                    let outcome = outcome.and_then(|()| match tokens.errors() {
                        [] => Ok(()),
                        errors => Err(format!("the tokens are incomplete: {}", errors.join("; "))),
                    });
                    (outcome, tokens.reward(), tokens.render(color))
                }
                None => {
                    let mut transcript = Transcript::default();
                    let outcome = run_scripted(holoware, &row, &resources, script, &mut transcript)
                        .map_err(|error| error.to_string());
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
            holoware,
            &resources,
            &sampled_rows,
            rollouts,
            sampler,
            holophore,
            color,
            data_name,
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
    let mut records: Vec<RolloutRecord> = Vec::new();
    if let Err(error) = runtime.block_on(loom.run(rows, sampler, &mut records)) {
        eprintln!("error: {error}");
        return Err(ExitCode::from(EXIT_FAILURES));
    }
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
        for (name, text) in &record.feedback {
            Recorder::feedback(&mut transcript, name, text);
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
                render_contexts(
                    holophore.tokenizer(),
                    &views,
                    &transcript.rewards,
                    &transcript.feedback,
                    color,
                )
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

fn run_scripted(
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

/// Every input as `<name>`, and every column a holotype needs (a built-in reward's `target=`, by
/// default `expected`) as `<column>`: enough to see the shape of a holoware without data.
fn placeholder_row(holoware: &Holoware) -> Row {
    holoware
        .program()
        .inputs
        .iter()
        .map(|input| input.name.as_str())
        .chain(holoware.needed_columns())
        .map(|name| {
            let value = serde_json::Value::String(format!("<{name}>"));
            (name.to_string(), value)
        })
        .collect()
}
