//! [`ConfigBuilder`]: a trainer's configuration from a TOML file and command-line overrides, every key
//! checked before any work starts: an unknown key is named with the closest known one, a bad value with
//! the values the key allows, and the place it came from (the file's line, or the flag).

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use super::config::{error, ConfigError, GrpoConfig, TrainingConfig};
use super::options::Inert;

/// Where a key's value was written: a file's line or a command-line flag.
#[derive(Debug, Clone)]
enum Origin {
    File { path: String, line: usize },
    Flag(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { path, line } => write!(f, "{path}:{line}"),
            Origin::Flag(flag) => f.write_str(flag),
        }
    }
}

/// Builds a trainer's configuration ([`GrpoConfig`] unless named) from a TOML file and `--key value`
/// overrides.
#[derive(Debug)]
pub struct ConfigBuilder<C = GrpoConfig> {
    table: toml::Table,
    origins: BTreeMap<String, Origin>,
    /// Options that do nothing where the configuration is used (a backend that has no use for them),
    /// refused when set, as the configuration's own [`TrainingConfig::inert`] ones are.
    unused: &'static [Inert],
    config: std::marker::PhantomData<C>,
}

impl<C> Default for ConfigBuilder<C> {
    fn default() -> Self {
        ConfigBuilder {
            table: toml::Table::new(),
            origins: BTreeMap::new(),
            unused: &[],
            config: std::marker::PhantomData,
        }
    }
}

impl<C: TrainingConfig> ConfigBuilder<C> {
    /// Every option's name, in the order of the configuration's fields, then the unset ones.
    pub fn keys() -> Vec<String> {
        match toml::Table::try_from(C::default()) {
            Ok(table) => table.keys().cloned().collect(),
            Err(_) => Vec::new(),
        }
        .into_iter()
        .chain(C::UNSET_KEYS.iter().map(|key| key.to_string()))
        .collect()
    }

    /// Reads a TOML file of options.
    pub fn file(mut self, path: &Path) -> Result<Self, ConfigError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|io| ConfigError {
            key: None,
            origin: Some(name.clone()),
            message: format!("cannot read the configuration: {io}"),
        })?;
        let document: toml::Table = text.parse().map_err(|parse: toml::de::Error| {
            let line = parse
                .span()
                .map_or(0, |span| text[..span.start].lines().count().max(1));
            ConfigError {
                key: None,
                origin: Some(format!("{name}:{line}")),
                message: format!("not valid TOML: {}", parse.message()),
            }
        })?;
        for (key, value) in document {
            let line = find_key_line(&text, &key).unwrap_or(0);
            self.origins.insert(
                key.clone(),
                Origin::File {
                    path: name.clone(),
                    line,
                },
            );
            self.table.insert(key, value);
        }
        Ok(self)
    }

    /// Sets `key` (snake or kebab case) from a command-line value: a TOML value (`4`, `1e-5`, `true`,
    /// `["q_proj", "v_proj"]`), or else the text as a string (`--loss-type grpo`).
    pub fn set(mut self, flag: &str, value: &str) -> Self {
        let key = flag.trim_start_matches('-').replace('-', "_");
        let parsed = format!("value = {value}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut table| table.remove("value"))
            .unwrap_or_else(|| toml::Value::String(value.to_string()));
        self.origins.insert(
            key.clone(),
            Origin::Flag(format!("--{}", key.replace('_', "-"))),
        );
        self.table.insert(key, parsed);
        self
    }

    /// Sets `key` to `value` unless the file or a flag set it: what another choice implies (`use_peft`
    /// under `--backend tinker`, whose service trains LoRA adapters only); `cause` names that choice in
    /// messages about the key.
    pub fn imply(mut self, key: &str, value: toml::Value, cause: &str) -> Self {
        if !self.table.contains_key(key) {
            self.origins
                .insert(key.to_string(), Origin::Flag(cause.to_string()));
            self.table.insert(key.to_string(), value);
        }
        self
    }

    /// Refuses the options of `unused` when the file or a flag sets them, with their reason: what the
    /// place the configuration goes has no use for (`lora_dropout` under `--backend tinker`, whose
    /// service chooses it), so that setting them is an error instead of being ignored.
    pub fn unused(mut self, unused: &'static [Inert]) -> Self {
        self.unused = unused;
        self
    }

    /// Whether `flag` (`--num-generations` or `num_generations`) names an option.
    pub fn is_key(flag: &str) -> bool {
        let key = flag.trim_start_matches('-').replace('-', "_");
        Self::keys().contains(&key)
    }

    /// The configuration, every key checked (see [`TrainingConfig::validate`]).
    pub fn build(self) -> Result<C, ConfigError> {
        let known = Self::keys();
        for key in self.table.keys() {
            if !known.contains(key) {
                let mut error = error(key, "unknown option");
                if let Some(close) = closest(key, &known) {
                    error
                        .message
                        .push_str(&format!(" (did you mean `{close}`?)"));
                }
                error.origin = self.origins.get(key).map(ToString::to_string);
                return Err(error);
            }
        }
        // Each key alone first, so that a bad value is blamed on its own key.
        for (key, value) in &self.table {
            let mut single = toml::Table::new();
            single.insert(key.clone(), value.clone());
            if let Err(problem) = C::deserialize(single) {
                let mut error = error(key, describe(&problem, C::allowed_values(key)));
                error.origin = self.origins.get(key).map(ToString::to_string);
                return Err(error);
            }
        }
        let config = C::deserialize(self.table.clone()).map_err(|problem| ConfigError {
            key: None,
            origin: None,
            message: problem.message().to_string(),
        })?;
        config.validate().map_err(|mut error| {
            if let Some(key) = &error.key {
                error.origin = self.origins.get(key).map(ToString::to_string);
            }
            error
        })?;
        for inert in config.inert().iter().chain(self.unused) {
            if let Some(key) = inert.keys.iter().find(|key| self.table.contains_key(**key)) {
                let mut error = error(key, format!("has no effect here: {}", inert.reason));
                error.origin = self.origins.get(*key).map(ToString::to_string);
                return Err(error);
            }
        }
        Ok(config)
    }
}

/// A value error in TRL's words: what the key allows.
fn describe(problem: &toml::de::Error, allowed: Option<&[&str]>) -> String {
    let message = problem.message().trim().to_string();
    match allowed {
        Some(values) if message.contains("unknown variant") => {
            let given = message.split('`').nth(1).map_or(String::new(), |value| {
                format!("{value:?} is not one of them; ")
            });
            format!("{given}allowed values: {}", values.join(", "))
        }
        _ => message,
    }
}

/// The 1-based line of `key = ...` in a TOML text.
fn find_key_line(text: &str, key: &str) -> Option<usize> {
    text.lines()
        .position(|line| {
            let line = line.trim_start();
            line.strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        })
        .map(|index| index + 1)
}

/// The known key nearest to `key`, when it is near enough to be a typo.
fn closest<'a>(key: &str, known: &'a [String]) -> Option<&'a str> {
    known
        .iter()
        .map(|candidate| (strsim::levenshtein(key, candidate), candidate))
        .filter(|(distance, candidate)| *distance <= 3.max(candidate.len() / 4))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate.as_str())
}
