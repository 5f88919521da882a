//! What every trainer's configuration has ([`TrainingConfig`]): the length of the run, checkpoints, AdamW,
//! the schedule and LoRA under transformers' and TRL's names ([`TrainingArguments`], one struct that every
//! trainer's configuration flattens into its own keys, checked in one place), and the errors that name a
//! bad key.

use std::fmt;

use serde::de::{self, DeserializeOwned, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use holo_core::peft::{Pattern, Targets};

/// What `holo train` and `holo sft` do when the memory plan's peak exceeds the memory available
/// (`memory_check`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryCheck {
    /// Refuse the run before loading the weights, naming the term that overflows and the largest value
    /// of its option that fits.
    Refuse,
    /// Print the same message as a warning and run.
    Warn,
    /// Neither plan nor check.
    Off,
}

/// The values `memory_check` allows.
pub const MEMORY_CHECK_VALUES: &[&str] = &["refuse", "warn", "off"];

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
    fn training(&self) -> &TrainingArguments;

    /// TRL's `router_aux_loss_coef`, where the trainer has it (unset: the model config's).
    fn router_aux_loss_coef(&self) -> Option<f64> {
        None
    }

    /// Options that change nothing in this configuration, in groups with the reason: a user who sets
    /// one (`--lora-r 8` without `--use-peft true`) is told so before any work, instead of a run that
    /// silently does something else than asked ([`ConfigBuilder::build`](super::builder::ConfigBuilder::build)).
    fn inert(&self) -> Vec<Inert> {
        self.training().inert()
    }

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

/// Options that have no effect in a configuration, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inert {
    pub keys: &'static [&'static str],
    pub reason: &'static str,
}

/// The options every trainer has, under transformers' `TrainingArguments` names (LoRA's under TRL's
/// `ModelConfig` names). A trainer's configuration holds them in its `training` field and flattens them
/// into its own keys: `learning_rate = 1e-5` in a TOML file, `config.training.learning_rate` in Rust.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingArguments {
    /// Optimizer steps; -1 runs `num_train_epochs` over the data instead.
    pub max_steps: i64,
    /// Passes over the data when `max_steps` is -1.
    pub num_train_epochs: f64,
    pub seed: u64,
    /// Save a checkpoint every this many steps (and at the end).
    pub save_steps: u64,
    /// Keep only the newest this many checkpoints.
    pub save_total_limit: Option<usize>,
    /// When checkpoints are written (transformers' `save_strategy`): `steps`, every `save_steps` and at
    /// the end; or `no`, none (the run leaves its metrics and plots, not its weights).
    pub save_strategy: SaveStrategy,
    /// Checkpoints hold the weights (or adapters) without the optimizer's state (transformers'
    /// `save_only_model`): a third of a full fine-tuning checkpoint's size, but no run resumes from them.
    pub save_only_model: bool,
    /// Examples (GRPO: completions) per micro-batch, one forward and backward pass.
    pub per_device_train_batch_size: usize,
    /// Micro-batches whose gradients one optimizer step sums.
    pub gradient_accumulation_steps: usize,

    // --- Optimizer (AdamW) ---
    pub learning_rate: f64,
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    /// Clip the gradients' global L2 norm to this; 0 disables.
    pub max_grad_norm: f64,
    pub lr_scheduler_type: LrSchedulerType,
    /// Warm-up as a fraction of the steps (used when `warmup_steps` is 0).
    pub warmup_ratio: f64,
    pub warmup_steps: u64,

    // --- LoRA (TRL's ModelConfig names) ---
    /// Train LoRA adapters instead of every weight.
    pub use_peft: bool,
    pub lora_r: usize,
    pub lora_alpha: f64,
    /// Dropout on the adapters' input in the training passes.
    pub lora_dropout: f64,
    /// Projections that get adapters, as PEFT's `target_modules` takes them: a list of names, matched as
    /// PEFT matches a list (a name or a dotted suffix of the module's), or `["all-linear"]`; or one
    /// string, a regular expression the module's whole name must match (`".*\\.(q_proj|v_proj)"`,
    /// `'model\.layers\.1\.self_attn\.q_proj'`), or `"all-linear"`. PEFT's default for Qwen2 and
    /// Llama (`q_proj`, `v_proj`) when unset. On Qwen3-MoE, PEFT turns `gate_proj` with `up_proj`,
    /// `down_proj` and the router's `gate` into target parameters (holo-model's `peft` module), and a
    /// regular expression first into the names it matches. `lm_head` adapts the output head (on a
    /// model with tied embeddings, the head's use of them only, as PEFT's), which `"all-linear"`
    /// leaves out as PEFT's does.
    pub lora_target_modules: Option<Targets>,
    /// Expert stacks and routers that get adapters (PEFT's `target_parameters`):
    /// `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, `mlp.gate.weight` (gpt-oss:
    /// `mlp.router.weight`), on a mixture-of-experts model; none when unset.
    pub lora_target_parameters: Option<Vec<String>>,
    /// PEFT's `rank_pattern`: `{"PATTERN" = RANK}`, the rank of the adapters whose PEFT name
    /// (`model.layers.0.self_attn.q_proj`) the pattern matches as PEFT matches it (`q_proj` is every
    /// `…q_proj`), in place of `lora_r`; the first matching key in the table's order wins, and a TOML
    /// table's keys are read sorted.
    pub lora_rank_pattern: Pattern<usize>,
    /// PEFT's `alpha_pattern`: the same for `lora_alpha`.
    pub lora_alpha_pattern: Pattern<f64>,

    // --- Memory plan (holo's own: `plan/`) ---
    /// What a run whose predicted peak memory exceeds the memory available does: `refuse` (before
    /// loading the weights), `warn`, or `off` (no plan).
    pub memory_check: MemoryCheck,
    /// The memory available to the run, in GiB, instead of the cgroup's limit or `MemAvailable`.
    pub memory_limit: Option<f64>,
}

impl Default for TrainingArguments {
    /// transformers' and TRL's defaults; each trainer's configuration sets its own `learning_rate` (TRL's
    /// `GRPOConfig` 1e-6, `SFTConfig` 2e-5) as TRL's do.
    fn default() -> Self {
        TrainingArguments {
            max_steps: -1,
            num_train_epochs: 3.0,
            seed: 42,
            save_steps: 500,
            save_total_limit: None,
            save_strategy: SaveStrategy::Steps,
            save_only_model: false,
            per_device_train_batch_size: 8,
            gradient_accumulation_steps: 1,
            learning_rate: 5e-5,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            lr_scheduler_type: LrSchedulerType::Linear,
            warmup_ratio: 0.0,
            warmup_steps: 0,
            use_peft: false,
            lora_r: 16,
            lora_alpha: 32.0,
            lora_dropout: 0.05,
            lora_target_modules: None,
            lora_target_parameters: None,
            lora_rank_pattern: Pattern::default(),
            lora_alpha_pattern: Pattern::default(),
            memory_check: MemoryCheck::Refuse,
            memory_limit: None,
        }
    }
}

impl TrainingArguments {
    /// Every key, in the order of the fields.
    pub const KEYS: &'static [&'static str] = &[
        "max_steps",
        "num_train_epochs",
        "seed",
        "save_steps",
        "save_total_limit",
        "save_strategy",
        "save_only_model",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "learning_rate",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "max_grad_norm",
        "lr_scheduler_type",
        "warmup_ratio",
        "warmup_steps",
        "use_peft",
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
        "lora_target_parameters",
        "lora_rank_pattern",
        "lora_alpha_pattern",
        "memory_check",
        "memory_limit",
    ];

    /// The keys a trainer's configuration flattens: its entries of [`TrainingArguments::KEYS`] over
    /// `defaults` (the trainer's own defaults; serde's flattening would take this struct's). Used as
    /// `#[serde(flatten, deserialize_with = "...")]` on a configuration's `training` field.
    pub fn deserialize_over<'de, D: Deserializer<'de>>(
        defaults: TrainingArguments,
        deserializer: D,
    ) -> Result<TrainingArguments, D::Error> {
        struct Over(TrainingArguments);
        impl<'de> Visitor<'de> for Over {
            type Value = TrainingArguments;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("training arguments")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut table = toml::Table::try_from(&self.0).map_err(de::Error::custom)?;
                while let Some((key, value)) = map.next_entry::<String, toml::Value>()? {
                    table.insert(key, value);
                }
                TrainingArguments::deserialize(table)
                    .map_err(|error| de::Error::custom(error.message()))
            }
        }
        deserializer.deserialize_struct("TrainingArguments", Self::KEYS, Over(defaults))
    }

    /// LoRA's target projections.
    pub fn lora_targets(&self) -> Targets {
        self.lora_target_modules
            .clone()
            .unwrap_or_else(|| Targets::names(&["q_proj", "v_proj"]))
    }

    /// The adapters to train, when `use_peft`.
    #[cfg(feature = "local")]
    pub fn lora(&self) -> Option<holo_model::model::LoraConfig> {
        self.use_peft.then(|| holo_model::model::LoraConfig {
            rank: self.lora_r,
            alpha: self.lora_alpha,
            targets: self.lora_targets(),
            seed: self.seed,
            dropout: self.lora_dropout,
            parameters: self.lora_target_parameters.clone().unwrap_or_default(),
            rank_pattern: self.lora_rank_pattern.clone(),
            alpha_pattern: self.lora_alpha_pattern.clone(),
        })
    }

    /// The shared options that change nothing here: LoRA's without LoRA.
    pub fn inert(&self) -> Vec<Inert> {
        let mut inert = Vec::new();
        if self.save_strategy == SaveStrategy::No {
            inert.push(Inert {
                keys: &["save_steps", "save_total_limit", "save_only_model"],
                reason: "with `save_strategy = \"no\"` no checkpoint is written",
            });
        }
        if self.memory_check == MemoryCheck::Off {
            inert.push(Inert {
                keys: &["memory_limit"],
                reason: "with `memory_check = \"off\"` no memory plan is checked",
            });
        }
        if !self.use_peft {
            inert.push(Inert {
                keys: &[
                    "lora_r",
                    "lora_alpha",
                    "lora_dropout",
                    "lora_target_modules",
                    "lora_target_parameters",
                    "lora_rank_pattern",
                    "lora_alpha_pattern",
                ],
                reason: "LoRA's options do nothing without `use_peft = true` (every weight is trained); set \
                         use_peft to train adapters",
            });
        }
        inert
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
        if let Some(limit) = self.memory_limit {
            if !(limit > 0.0 && limit.is_finite()) {
                return Err(error("memory_limit", "must be a positive number of GiB"));
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
        // The names LoRA can target are the local model's (holo-model's); a build without it trains
        // only on a Tinker service, which chooses what its adapters train and refuses both keys.
        // A regular expression: what it matches is known once the model is loaded.
        if let Some(targets @ Targets::Regex(_)) = &self.lora_target_modules {
            targets
                .check()
                .map_err(|message| error("lora_target_modules", message))?;
        }
        // A layer's projection has a dotted name, which its short name alone never matches whole
        // (`lm_head`, undotted, does): the list was meant.
        #[cfg(feature = "local")]
        if let Some(Targets::Regex(regex)) = &self.lora_target_modules {
            if holo_model::model::PROJECTIONS.contains(&regex.as_str()) {
                return Err(error(
                    "lora_target_modules",
                    format!(
                        "the string {regex:?} is a regular expression the whole module name must \
                         match, as PEFT reads it, and no module is named just that; write \
                         [\"{regex}\"] for every {regex}, or \".*\\\\.{regex}\""
                    ),
                ));
            }
        }
        #[cfg(feature = "local")]
        if let Some(Targets::Names(targets)) = &self.lora_target_modules {
            let fused = holo_model::model::FUSED_PROJECTIONS.map(|(name, _)| name);
            // A mixture's router (`gate`) is PEFT's target parameter on Qwen3-MoE; Qwen3.5's shared
            // expert has a gate of its own; `lm_head` is the output head (never in all-linear, as
            // PEFT's).
            let projections: Vec<&str> = holo_model::model::PROJECTIONS
                .into_iter()
                .chain(fused)
                .chain(holo_model::model::LINEAR_ATTENTION_PROJECTIONS)
                .chain(["gate", "shared_expert_gate", "lm_head"])
                .collect();
            if targets.is_empty() {
                return Err(error("lora_target_modules", "names no projection"));
            }
            let all_linear = holo_model::model::ALL_LINEAR;
            if targets.len() > 1 && targets.iter().any(|t| t.eq_ignore_ascii_case(all_linear)) {
                return Err(error(
                    "lora_target_modules",
                    format!("{all_linear:?} names every projection and stands alone"),
                ));
            }
            // A name, or a dotted suffix of a module's name (`self_attn.q_proj`), as PEFT matches.
            if let Some(unknown) = targets.iter().find(|target| {
                let short = target.rsplit('.').next().unwrap_or(target);
                !target.eq_ignore_ascii_case(all_linear) && !projections.contains(&short)
            }) {
                return Err(error(
                    "lora_target_modules",
                    format!(
                        "{unknown:?} is not a projection; allowed values: {all_linear} or {}",
                        projections.join(", ")
                    ),
                ));
            }
        }
        #[cfg(feature = "local")]
        if let Some(parameters) = &self.lora_target_parameters {
            let stacks = holo_model::model::ExpertStack::ALL.map(|stack| stack.name());
            let routers = ["mlp.gate.weight", "mlp.router.weight"];
            if parameters.is_empty() {
                return Err(error("lora_target_parameters", "names no parameter"));
            }
            let router = |target: &str| {
                target.contains('.')
                    && routers
                        .iter()
                        .any(|name| *name == target || name.ends_with(&format!(".{target}")))
            };
            if let Some(unknown) = parameters.iter().find(|target| {
                holo_model::model::ExpertStack::named(target).is_none() && !router(target)
            }) {
                return Err(error(
                    "lora_target_parameters",
                    format!(
                        "{unknown:?} is not an expert stack or a router; allowed values: {}, {}",
                        stacks.map(|name| format!("mlp.experts.{name}")).join(", "),
                        routers.join(", ")
                    ),
                ));
            }
            // PEFT's `ParamWrapper` refuses dropout: its input is the parameter's product's, not the
            // module's.
            if self.use_peft && self.lora_dropout != 0.0 {
                return Err(error(
                    "lora_dropout",
                    "must be 0 with lora_target_parameters (PEFT's adapters on parameters take no \
                     dropout)",
                ));
            }
        }
        for (key, check) in [
            ("lora_rank_pattern", self.lora_rank_pattern.check()),
            ("lora_alpha_pattern", self.lora_alpha_pattern.check()),
        ] {
            check.map_err(|message| error(key, message))?;
        }
        if let Some((key, _)) = self
            .lora_rank_pattern
            .entries()
            .iter()
            .find(|(_, r)| *r == 0)
        {
            return Err(error(
                "lora_rank_pattern",
                format!("{key:?}: a rank must be at least 1"),
            ));
        }
        if let Some((key, _)) = self
            .lora_alpha_pattern
            .entries()
            .iter()
            .find(|(_, alpha)| !alpha.is_finite())
        {
            return Err(error(
                "lora_alpha_pattern",
                format!("{key:?}: must be a finite number"),
            ));
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

/// `router_aux_loss_coef`, where set, is a weight: finite and not negative.
pub(crate) fn check_router_aux_loss_coef(value: Option<f64>) -> Result<(), ConfigError> {
    match value {
        Some(coef) if !coef.is_finite() || coef < 0.0 => Err(error(
            "router_aux_loss_coef",
            format!("must be a finite number ≥ 0 (0 adds no load-balancing loss), not {coef}"),
        )),
        _ => Ok(()),
    }
}

/// The values of the enumerated [`TrainingArguments`].
pub(crate) fn shared_allowed_values(key: &str) -> Option<&'static [&'static str]> {
    match key {
        "lr_scheduler_type" => Some(&["linear", "cosine", "constant", "constant_with_warmup"]),
        "save_strategy" => Some(&["steps", "no"]),
        "memory_check" => Some(MEMORY_CHECK_VALUES),
        _ => None,
    }
}

/// When checkpoints are written (transformers' `save_strategy`; its `epoch` and `best` are not offered).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SaveStrategy {
    /// Every `save_steps` steps and at the last one.
    Steps,
    /// Never.
    No,
}

impl TrainingArguments {
    /// Whether a checkpoint is written after `step` (`last`: the run's last step, or a stop).
    pub fn saves_after(&self, step: u64, last: bool) -> bool {
        self.save_strategy == SaveStrategy::Steps && (step.is_multiple_of(self.save_steps) || last)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(feature = "local")]
    use crate::sft::SftConfig;
    use crate::{ConfigBuilder, GrpoConfig};

    #[test]
    fn keys_are_the_fields_in_order() {
        let every = TrainingArguments {
            save_total_limit: Some(2),
            lora_target_modules: Some(Targets::names(&["q_proj"])),
            lora_target_parameters: Some(vec!["mlp.experts.down_proj".into()]),
            memory_limit: Some(8.0),
            ..TrainingArguments::default()
        };
        let table = toml::Table::try_from(&every).unwrap();
        let keys: Vec<&str> = table.keys().map(String::as_str).collect();
        let mut sorted = TrainingArguments::KEYS.to_vec();
        sorted.sort_unstable();
        assert_eq!(keys, sorted);
        // The configurations list them among their own keys, in their place.
        let grpo = ConfigBuilder::<GrpoConfig>::keys();
        for key in TrainingArguments::KEYS {
            assert!(grpo.iter().any(|known| known == key), "{key}");
        }
    }

    #[test]
    #[cfg(feature = "local")]
    fn each_trainer_keeps_its_own_defaults_under_the_flattened_keys() {
        let grpo: GrpoConfig = toml::from_str("beta = 0.1\nseed = 3").unwrap();
        assert_eq!(grpo.training.learning_rate, 1e-6);
        assert_eq!(grpo.training.seed, 3);
        assert_eq!(grpo.beta, 0.1);
        let sft: SftConfig = toml::from_str("seed = 3").unwrap();
        assert_eq!(sft.training.learning_rate, 2e-5);
        assert_eq!(sft, {
            let mut expected = SftConfig::default();
            expected.training.seed = 3;
            expected
        });
        // An integer where a float is expected, an unset option set, and the round trip through the
        // TOML a run folder keeps.
        let grpo: GrpoConfig =
            toml::from_str("learning_rate = 1\nsave_total_limit = 2\nnum_generations = 4").unwrap();
        assert_eq!(grpo.training.learning_rate, 1.0);
        assert_eq!(grpo.training.save_total_limit, Some(2));
        let again: GrpoConfig = toml::from_str(&grpo.to_toml()).unwrap();
        assert_eq!(again, grpo);
    }

    #[test]
    fn unknown_and_bad_keys_are_refused_by_name() {
        let error = toml::from_str::<GrpoConfig>("seed = 3\nlearning_rat = 1e-5").unwrap_err();
        assert!(
            error.message().contains("unknown field `learning_rat`"),
            "{error}"
        );
        let error = ConfigBuilder::<GrpoConfig>::default()
            .set("--seed", "three")
            .build()
            .unwrap_err();
        assert_eq!(error.key.as_deref(), Some("seed"));
        assert_eq!(error.origin.as_deref(), Some("--seed"));
        assert!(
            error.message.contains("expected u64") && !error.message.contains('\n'),
            "{error}"
        );
        let error = ConfigBuilder::<GrpoConfig>::default()
            .set("--lr-scheduler-type", "cubic")
            .build()
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "--lr-scheduler-type: `lr_scheduler_type`: \"cubic\" is not one of them; allowed values: linear, cosine, constant, constant_with_warmup"
        );
    }
    /// Qwen3.5's linear-attention projections and its shared expert's gate are targets by name, as
    /// the loader adapts them; a name no family has is refused.
    #[test]
    #[cfg(feature = "local")]
    fn qwen3_5_s_projections_are_targets_by_name() {
        let targets = |names: &str| {
            ConfigBuilder::<GrpoConfig>::default()
                .set("--use-peft", "true")
                .set("--lora-target-modules", names)
                .build()
        };
        for names in [
            r#"["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]"#,
            r#"["linear_attn.in_proj_qkv", "q_proj"]"#,
            r#"["shared_expert_gate", "mlp.shared_expert.down_proj"]"#,
        ] {
            targets(names).unwrap_or_else(|error| panic!("{names}: {error}"));
        }
        let error = targets(r#"["in_proj_x"]"#).unwrap_err();
        assert!(
            error.message.contains("\"in_proj_x\" is not a projection"),
            "{error}"
        );
    }

    #[test]
    #[cfg(feature = "local")]
    fn rank_and_alpha_patterns_are_read_as_peft_s_and_checked() {
        let lora = |flags: &[(&str, &str)]| {
            flags
                .iter()
                .fold(
                    ConfigBuilder::<GrpoConfig>::default().set("--use-peft", "true"),
                    |builder, (flag, value)| builder.set(flag, value),
                )
                .build()
        };
        let config = lora(&[
            ("--lora-target-modules", "[\"all-linear\"]"),
            (
                "--lora-rank-pattern",
                "{\"layers.0.self_attn.q_proj\" = 8, q_proj = 4}",
            ),
            ("--lora-alpha-pattern", "{v_proj = 2}"),
        ])
        .unwrap()
        .training
        .lora()
        .unwrap();
        assert!(config.all_linear());
        assert_eq!(
            config.size_at("model.layers.0.self_attn.q_proj"),
            Ok((8, 32.0))
        );
        assert_eq!(
            config.size_at("model.layers.1.self_attn.q_proj"),
            Ok((4, 32.0))
        );
        assert_eq!(
            config.size_at("model.layers.1.self_attn.v_proj"),
            Ok((16, 2.0))
        );
        for (flag, value, key, message) in [
            (
                "--lora-rank-pattern",
                "{\"(?=q)\" = 4}",
                "lora_rank_pattern",
                "(?=q)",
            ),
            (
                "--lora-rank-pattern",
                "{q_proj = 0}",
                "lora_rank_pattern",
                "at least 1",
            ),
            (
                "--lora-alpha-pattern",
                "{q_proj = \"x\"}",
                "lora_alpha_pattern",
                "expected",
            ),
            (
                "--lora-target-modules",
                "[\"all-linear\", \"q_proj\"]",
                "lora_target_modules",
                "stands alone",
            ),
            (
                "--lora-target-modules",
                "[\"self_attn.qq_proj\"]",
                "lora_target_modules",
                "qq_proj",
            ),
            (
                "--lora-target-modules",
                "q_proj",
                "lora_target_modules",
                "write [\"q_proj\"] for every q_proj",
            ),
            (
                "--lora-target-modules",
                "'(?=q)_proj'",
                "lora_target_modules",
                "not a regular expression",
            ),
            (
                "--lora-target-parameters",
                "[\"weight\"]",
                "lora_target_parameters",
                "mlp.gate.weight",
            ),
        ] {
            let error = lora(&[(flag, value)]).unwrap_err();
            assert_eq!(error.key.as_deref(), Some(key), "{error}");
            assert!(error.message.contains(message), "{error}");
        }
        // PEFT's module names as suffixes, and the routers as target parameters.
        lora(&[
            (
                "--lora-target-modules",
                "[\"self_attn.q_proj\", \"gate\", \"lm_head\"]",
            ),
            ("--lora-target-parameters", "[\"mlp.router.weight\"]"),
            ("--lora-dropout", "0"),
        ])
        .unwrap();
        // A string is PEFT's regular expression, from a flag (TOML's literal string, or the bare
        // text) as from a file.
        for value in [r"'.*\.(q|v)_proj'", r".*\.(q|v)_proj"] {
            let lora = lora(&[("--lora-target-modules", value)])
                .unwrap()
                .training
                .lora()
                .unwrap();
            assert_eq!(lora.targets, Targets::Regex(r".*\.(q|v)_proj".into()));
        }
    }

    #[test]
    #[cfg(feature = "local")]
    fn sft_options_that_change_nothing_are_refused_with_their_file_line() {
        let dir = std::env::temp_dir().join(format!("holo-inert-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("sft.toml");
        std::fs::write(&file, "seed = 1\nlora_alpha = 32\n").unwrap();
        let error = ConfigBuilder::<SftConfig>::default()
            .file(&file)
            .unwrap()
            .build()
            .unwrap_err();
        assert_eq!(error.key.as_deref(), Some("lora_alpha"));
        assert_eq!(error.origin, Some(format!("{}:2", file.display())));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn options_that_change_nothing_are_refused_where_they_were_written() {
        // `holo train --lora-r 8` without `--use-peft true` trained every weight without a word.
        let error = ConfigBuilder::<GrpoConfig>::default()
            .set("--lora-r", "8")
            .build()
            .unwrap_err();
        assert_eq!(error.key.as_deref(), Some("lora_r"));
        assert_eq!(error.origin.as_deref(), Some("--lora-r"));
        assert!(
            error.message.contains("has no effect here") && error.message.contains("use_peft"),
            "{error}"
        );
        let lora: GrpoConfig = ConfigBuilder::default()
            .set("--use-peft", "true")
            .set("--lora-r", "8")
            .build()
            .unwrap();
        assert_eq!(lora.training.lora_r, 8);
        // PPO's options under GRPO, a loss's options under another loss, the guard rails' without them.
        for (flag, value, set_too) in [
            ("--vf-coef", "0.2", None),
            ("--sapo-temperature-pos", "2.0", None),
            ("--early-stopping-threshold", "0.1", None),
            ("--rollback-window", "3", None),
            ("--curriculum-window", "8", None),
            ("--vf-coef", "0.2", Some(("--algorithm", "ppo"))),
            (
                "--sapo-temperature-pos",
                "2.0",
                Some(("--loss-type", "sapo")),
            ),
            (
                "--curriculum-window",
                "8",
                Some(("--difficulty-column", "level")),
            ),
        ] {
            let mut builder = ConfigBuilder::<GrpoConfig>::default().set(flag, value);
            if let Some((other, value)) = set_too {
                builder = builder.set(other, value);
            }
            let built = builder.build();
            assert_eq!(
                built.is_ok(),
                set_too.is_some(),
                "{flag} with {set_too:?}: {built:?}"
            );
        }
    }

    #[test]
    fn chat_template_kwargs_from_a_table_or_json_text() {
        let path = std::env::temp_dir().join(format!("holo-kwargs-{}.toml", std::process::id()));
        std::fs::write(
            &path,
            "chat_template_kwargs = { enable_thinking = false }\n",
        )
        .unwrap();
        let from_file: GrpoConfig = ConfigBuilder::default()
            .file(&path)
            .unwrap()
            .build()
            .unwrap();
        let from_flag: GrpoConfig = ConfigBuilder::default()
            .set("--chat-template-kwargs", r#"{"enable_thinking": false}"#)
            .build()
            .unwrap();
        assert_eq!(from_file, from_flag);
        let kwargs = from_flag.chat_template_kwargs.as_ref().unwrap().variables();
        assert!(!kwargs["enable_thinking"].is_true());
        assert!(kwargs["enable_thinking"].kind() == minijinja::value::ValueKind::Bool);
        // The flag overrides the file; the run folder's TOML keeps them.
        let both: GrpoConfig = ConfigBuilder::default()
            .file(&path)
            .unwrap()
            .set(
                "--chat-template-kwargs",
                r#"{"enable_thinking": true, "n": [1, 2]}"#,
            )
            .build()
            .unwrap();
        let again: GrpoConfig = toml::from_str(&both.to_toml()).unwrap();
        assert_eq!(again, both);
        assert_ne!(both, from_file);
        std::fs::remove_file(&path).unwrap();
        for (value, said) in [
            ("[1]", "must be a JSON object"),
            ("3", "got a number"),
            ("{bad", "not valid JSON"),
            (r#"{"a": null}"#, "`a` holds null"),
        ] {
            let error = ConfigBuilder::<GrpoConfig>::default()
                .set("--chat-template-kwargs", value)
                .build()
                .unwrap_err()
                .to_string();
            assert!(
                error.starts_with("--chat-template-kwargs: `chat_template_kwargs`: ")
                    && error.contains(said),
                "{value}: {error}"
            );
        }
    }
}
