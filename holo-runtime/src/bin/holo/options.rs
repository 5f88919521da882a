//! Trainer options on the command line (`holo train`, `holo sft`): TRL's option names as `--kebab-case`
//! flags beside the command's own arguments, over a `--config` TOML file.

use clap::CommandFactory;
use holo_runtime::train::{ConfigBuilder, ConfigError, Inert, TrainingConfig};

use super::Cli;

/// The help text after a trainer command's arguments: every option with its default.
pub fn options_help<C: TrainingConfig>(note: &str) -> String {
    let defaults = C::default().to_toml();
    let mut text = format!(
        "Options (TRL's {} names, as --kebab-case flags or keys of --config{note}):\n",
        C::NAME
    );
    for key in ConfigBuilder::<C>::keys() {
        let default = defaults
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{key} = ")))
            .unwrap_or("unset");
        text.push_str(&format!("  --{:<40} {default}\n", key.replace('_', "-")));
    }
    text
}

/// Configuration flags and their values, in order.
pub type Options = Vec<(String, String)>;

/// Splits the configuration flags of the trainer subcommand `command` (`--num-generations 4`,
/// `--beta=0.04`, a bare boolean `--use-peft`) from the arguments clap parses; arguments of other
/// subcommands pass through. A flag that is neither the command's nor an option is an error naming it,
/// with the nearest option.
pub fn split_options<C: TrainingConfig>(
    args: Vec<String>,
    command: &str,
) -> Result<(Vec<String>, Options), String> {
    if args.get(1).map(String::as_str) != Some(command) {
        return Ok((args, Vec::new()));
    }
    let cli = Cli::command();
    let subcommand = cli
        .find_subcommand(command)
        .ok_or_else(|| format!("no subcommand {command}"))?;
    let own: Vec<String> = subcommand
        .get_arguments()
        .filter_map(|arg| arg.get_long().map(|long| format!("--{long}")))
        .chain(["--help".to_string(), "-h".to_string()])
        .collect();
    let mut kept = Vec::with_capacity(args.len());
    let mut options = Vec::new();
    let mut rest = args.into_iter().peekable();
    while let Some(arg) = rest.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_string(), Some(value.to_string()))
            }
            _ => (arg.clone(), None),
        };
        let name = if flag == "--recompute" {
            "--gradient-checkpointing".to_string()
        } else {
            flag.clone()
        };
        if !name.starts_with("--") || own.contains(&flag) {
            kept.push(arg);
            continue;
        }
        if !ConfigBuilder::<C>::is_key(&name) {
            let key = name.trim_start_matches('-').replace('-', "_");
            let known = ConfigBuilder::<C>::keys();
            let hint = known
                .iter()
                .min_by_key(|candidate| strsim::levenshtein(&key, candidate))
                .filter(|candidate| strsim::levenshtein(&key, candidate) <= 3)
                .map_or(String::new(), |close| {
                    format!(" (did you mean --{}?)", close.replace('_', "-"))
                });
            return Err(format!(
                "unknown option {flag}{hint}; `holo {command} --help` lists them"
            ));
        }
        let value = match inline {
            Some(value) => value,
            None => match rest.peek() {
                Some(next) if !next.starts_with("--") => rest.next().expect("peeked"),
                // A bare flag switches a boolean option on.
                _ => "true".to_string(),
            },
        };
        options.push((name, value));
    }
    Ok((kept, options))
}

/// The configuration of `--config FILE` (when given) and the flags, every key checked; `implied`
/// (`(key, value, cause)`) sets what the file and the flags leave unset, and the keys of `unused` are
/// refused when set (what the chosen backend has no use for).
pub fn build<C: TrainingConfig>(
    file: Option<&std::path::Path>,
    options: &Options,
    implied: &[(&str, toml::Value, &str)],
    unused: &'static [Inert],
) -> Result<C, ConfigError> {
    let mut builder = ConfigBuilder::<C>::default().unused(unused);
    if let Some(path) = file {
        builder = builder.file(path)?;
    }
    for (flag, value) in options {
        builder = builder.set(flag, value);
    }
    for (key, value, cause) in implied {
        builder = builder.imply(key, value.clone(), cause);
    }
    builder.build()
}

/// The model folder `model` loaded for training on `device` (`--device`) in `dtype` (`--dtype`, or the
/// device's training precision), or with `quantized` (`--quantized`) a GGUF file's projections kept
/// in its blocks, in f32 on the CPU: `holo train`'s and `holo sft`'s policy, or the message for a bad
/// one.
#[cfg(feature = "local")]
pub fn training_policy(
    model: &std::path::Path,
    device: &str,
    dtype: Option<&str>,
    quantized: bool,
) -> Result<holo_runtime::train::Policy, String> {
    use holo_runtime::train::Policy;
    let device = holo_runtime::local::parse_device(device)?;
    if quantized {
        if !device.is_cpu() || dtype.is_some_and(|dtype| dtype != "f32") {
            return Err(
                "--quantized: the blocks are multiplied on the CPU in f32 arithmetic; leave --device \
                 and --dtype out"
                    .to_string(),
            );
        }
        return Policy::load_quantized(model, &device).map_err(|error| error.to_string());
    }
    let dtype = holo_runtime::local::parse_training_dtype(dtype, &device)?;
    Policy::load_as(model, &device, dtype).map_err(|error| error.to_string())
}
