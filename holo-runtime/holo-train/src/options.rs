//! What every trainer's configuration has ([`TrainingConfig`]): the length of the run, checkpoints, AdamW,
//! the schedule and LoRA under TRL's names ([`Shared`], checked in one place), and the errors that name a
//! bad key.

use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A trainer's options: what the shared [`ConfigBuilder`](super::builder::ConfigBuilder), checkpoints,
/// the optimizer, the schedule and LoRA need to know of them.
pub trait TrainingConfig:
    Serialize + DeserializeOwned + Default + Clone + PartialEq + fmt::Debug
{
    /// The trainer's configuration class in TRL, for messages (`GRPOConfig`).
    const NAME: &'static str;
    /// Keys whose default is unset (TOML has no null, so they are absent from a serialized default).
    const UNSET_KEYS: &'static [&'static str];
    /// Keys that may change when a run resumes: they do not change what is computed.
    const RESUMABLE_KEYS: &'static [&'static str];

    /// The values an enumerated option allows.
    fn allowed_values(key: &str) -> Option<&'static [&'static str]>;

    /// Checks every value and the constraints between them.
    fn validate(&self) -> Result<(), ConfigError>;

    /// The options every trainer has.
    fn shared(&self) -> Shared;

    /// Optimizer steps taken in `steps` of the run's steps (AdamW's bias correction counts them).
    fn optimizer_steps(&self, steps: u64) -> u64 {
        steps
    }

    /// The first option that differs from `saved` (a checkpoint's) and would change what the run computes:
    /// `(key, saved value, this value)`.
    fn differs_from(&self, saved: &Self) -> Option<(String, String, String)> {
        let ours = toml::Table::try_from(self).ok()?;
        let theirs = toml::Table::try_from(saved).ok()?;
        let keys: std::collections::BTreeSet<String> =
            ours.keys().chain(theirs.keys()).cloned().collect();
        let show =
            |value: Option<&toml::Value>| value.map_or("unset".to_string(), ToString::to_string);
        let differing = keys
            .into_iter()
            .filter(|key| !Self::RESUMABLE_KEYS.contains(&key.as_str()))
            .find(|key| ours.get(key) != theirs.get(key))?;
        let (saved, now) = (show(theirs.get(&differing)), show(ours.get(&differing)));
        Some((differing, saved, now))
    }

    /// The configuration as a TOML document (what a run folder and its checkpoints keep).
    fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_default()
    }
}

/// The options every trainer has, under the same (TRL's) names.
#[derive(Debug, Clone, PartialEq)]
pub struct Shared {
    pub seed: u64,
    pub max_steps: i64,
    pub num_train_epochs: f64,
    pub save_steps: u64,
    pub save_total_limit: Option<usize>,
    pub per_device_train_batch_size: usize,
    pub gradient_accumulation_steps: usize,
    pub learning_rate: f64,
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    pub max_grad_norm: f64,
    pub lr_scheduler_type: LrSchedulerType,
    pub warmup_ratio: f64,
    pub warmup_steps: u64,
    pub use_peft: bool,
    pub lora_r: usize,
    pub lora_alpha: f64,
    pub lora_dropout: f64,
    pub lora_target_modules: Option<Vec<String>>,
}

impl Shared {
    /// LoRA's target projections.
    pub fn lora_targets(&self) -> Vec<String> {
        self.lora_target_modules
            .clone()
            .unwrap_or_else(|| vec!["q_proj".into(), "v_proj".into()])
    }

    /// The adapters to train, when `use_peft`.
    pub fn lora(&self) -> Option<holo_model::model::LoraConfig> {
        self.use_peft.then(|| holo_model::model::LoraConfig {
            rank: self.lora_r,
            alpha: self.lora_alpha,
            targets: self.lora_targets(),
            seed: self.seed,
            dropout: self.lora_dropout,
        })
    }

    /// Checks the shared options (transformers' `TrainingArguments` and PEFT's checks).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = |key: &str, value: usize| {
            if value == 0 {
                Err(error(key, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        positive(
            "per_device_train_batch_size",
            self.per_device_train_batch_size,
        )?;
        positive(
            "gradient_accumulation_steps",
            self.gradient_accumulation_steps,
        )?;
        positive("lora_r", self.lora_r)?;
        if self.max_steps == 0 || self.max_steps < -1 {
            return Err(error(
                "max_steps",
                "must be at least 1, or -1 to run num_train_epochs",
            ));
        }
        if self.max_steps == -1
            && !(self.num_train_epochs > 0.0 && self.num_train_epochs.is_finite())
        {
            return Err(error("num_train_epochs", "must be a positive number"));
        }
        if self.save_steps == 0 {
            return Err(error("save_steps", "must be at least 1"));
        }
        if self.save_total_limit == Some(0) {
            return Err(error("save_total_limit", "must be at least 1"));
        }
        for (key, value) in [
            ("learning_rate", self.learning_rate),
            ("weight_decay", self.weight_decay),
            ("max_grad_norm", self.max_grad_norm),
            ("lora_alpha", self.lora_alpha),
        ] {
            if !value.is_finite() {
                return Err(error(key, "must be a finite number"));
            }
        }
        if self.learning_rate < 0.0 {
            return Err(error("learning_rate", "must be at least 0"));
        }
        if !(self.adam_beta1 >= 0.0 && self.adam_beta1 < 1.0) {
            return Err(error("adam_beta1", "must be in [0, 1)"));
        }
        if !(self.adam_beta2 >= 0.0 && self.adam_beta2 < 1.0) {
            return Err(error("adam_beta2", "must be in [0, 1)"));
        }
        if !(self.adam_epsilon > 0.0 && self.adam_epsilon.is_finite()) {
            return Err(error("adam_epsilon", "must be above 0"));
        }
        if self.max_grad_norm < 0.0 {
            return Err(error(
                "max_grad_norm",
                "must be at least 0 (0 disables clipping)",
            ));
        }
        if !(0.0..1.0).contains(&self.warmup_ratio) {
            return Err(error("warmup_ratio", "must be in [0, 1)"));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(error("lora_dropout", "must be in [0, 1)"));
        }
        if let Some(targets) = &self.lora_target_modules {
            let projections = holo_model::model::PROJECTIONS;
            if targets.is_empty() {
                return Err(error("lora_target_modules", "names no projection"));
            }
            if let Some(unknown) = targets
                .iter()
                .find(|target| !projections.contains(&target.as_str()))
            {
                return Err(error(
                    "lora_target_modules",
                    format!(
                        "{unknown:?} is not a projection; allowed values: {}",
                        projections.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A bad configuration: what is wrong and where it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The key, when one is to blame.
    pub key: Option<String>,
    /// `train.toml:3` or `--loss-type`, when known.
    pub origin: Option<String>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.origin, &self.key) {
            (Some(origin), Some(key)) => write!(f, "{origin}: `{key}`: {}", self.message),
            (Some(origin), None) => write!(f, "{origin}: {}", self.message),
            (None, Some(key)) => write!(f, "`{key}`: {}", self.message),
            (None, None) => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// An error blamed on `key`.
pub(crate) fn error(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: Some(key.to_string()),
        origin: None,
        message: message.into(),
    }
}

/// The values of the shared enumerated options.
pub(crate) fn shared_allowed_values(key: &str) -> Option<&'static [&'static str]> {
    match key {
        "lr_scheduler_type" => Some(&["linear", "cosine", "constant", "constant_with_warmup"]),
        _ => None,
    }
}

/// The [`Shared`] options of a trainer's configuration, whose fields have the shared options' names:
/// `fn shared(&self) -> Shared { shared_options!(self) }`.
macro_rules! shared_options {
    ($config:expr) => {
        Shared {
            seed: $config.seed,
            max_steps: $config.max_steps,
            num_train_epochs: $config.num_train_epochs,
            save_steps: $config.save_steps,
            save_total_limit: $config.save_total_limit,
            per_device_train_batch_size: $config.per_device_train_batch_size,
            gradient_accumulation_steps: $config.gradient_accumulation_steps,
            learning_rate: $config.learning_rate,
            weight_decay: $config.weight_decay,
            adam_beta1: $config.adam_beta1,
            adam_beta2: $config.adam_beta2,
            adam_epsilon: $config.adam_epsilon,
            max_grad_norm: $config.max_grad_norm,
            lr_scheduler_type: $config.lr_scheduler_type,
            warmup_ratio: $config.warmup_ratio,
            warmup_steps: $config.warmup_steps,
            use_peft: $config.use_peft,
            lora_r: $config.lora_r,
            lora_alpha: $config.lora_alpha,
            lora_dropout: $config.lora_dropout,
            lora_target_modules: $config.lora_target_modules.clone(),
        }
    };
}
pub(crate) use shared_options;

/// The learning-rate schedule (transformers' `lr_scheduler_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedulerType {
    /// Linear warm-up, then linear decay to 0 at the last step.
    Linear,
    /// Linear warm-up, then a half cosine down to 0 at the last step.
    Cosine,
    /// The learning rate throughout (no warm-up).
    Constant,
    /// Linear warm-up, then constant.
    ConstantWithWarmup,
}
