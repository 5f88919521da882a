//! `holo sft`'s options: TRL's `SFTConfig` names, defaults and meanings (with transformers'
//! `TrainingArguments` underneath), plus LoRA's under TRL's `ModelConfig` names. Built, checked and kept
//! in a run like GRPO's ([`ConfigBuilder`](crate::ConfigBuilder)`<SftConfig>`).

use serde::{Deserialize, Serialize};

use crate::config::{
    check_router_aux_loss_coef, error, shared_allowed_values, ConfigError, TrainingArguments,
    TrainingConfig,
};

/// Which end of a sequence longer than `max_length` is kept (TRL's `truncation_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TruncationMode {
    KeepStart,
    KeepEnd,
}

/// The per-token loss (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SftLossType {
    /// Minus the log-probability of each trained token.
    Nll,
    /// Dynamic fine-tuning: the negative log-likelihood weighted by the token's probability (detached).
    Dft,
}

/// Every option of a supervised fine-tuning run. Field names are TRL's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    /// The options every trainer has (transformers' `TrainingArguments`), flattened into this
    /// configuration's keys.
    #[serde(flatten, deserialize_with = "sft_training")]
    pub training: TrainingArguments,

    // --- Length of the run, checkpoints ---
    /// Seeds the data order; `seed` when unset.
    pub data_seed: Option<u64>,

    // --- Batches ---
    /// Activation recomputation: one layer's activations alive at a time in the backward pass.
    pub gradient_checkpointing: bool,
    /// The load-balancing loss of a mixture-of-experts model (transformers' `aux_loss`), added to the
    /// loss with this weight, divided by the micro-batches of a step, as TRL adds it
    /// (`router_aux_loss_coef`). Unset takes the model config's `router_aux_loss_coef` (0.001 for
    /// Qwen3-MoE and gpt-oss); 0 adds none; set on a model without experts, the run is refused.
    pub router_aux_loss_coef: Option<f64>,

    // --- The data ---
    /// The most tokens of an example (longer ones are cut); unset keeps every token.
    pub max_length: Option<usize>,
    pub truncation_mode: TruncationMode,
    /// Train only the prompt/completion rows' completion (unset: for prompt/completion data).
    pub completion_only_loss: Option<bool>,
    /// Train only the assistant turns of conversations (the chat template's `{% generation %}` blocks).
    pub assistant_only_loss: bool,
    /// Packing several examples into one sequence: not supported (each example is its own sequence).
    pub packing: bool,
    /// What a `text` row's text ends with (added when missing); the model's `eos_token` when unset.
    pub eos_token: Option<String>,

    // --- The loss ---
    pub loss_type: SftLossType,
}

/// SFTConfig's [`TrainingArguments`]: transformers' defaults with a learning rate of 2e-5.
fn sft_training_defaults() -> TrainingArguments {
    TrainingArguments {
        learning_rate: 2e-5,
        ..TrainingArguments::default()
    }
}

fn sft_training<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<TrainingArguments, D::Error> {
    TrainingArguments::deserialize_over(sft_training_defaults(), deserializer)
}

impl Default for SftConfig {
    fn default() -> Self {
        SftConfig {
            training: sft_training_defaults(),
            data_seed: None,
            gradient_checkpointing: false,
            router_aux_loss_coef: None,
            max_length: Some(1024),
            truncation_mode: TruncationMode::KeepStart,
            completion_only_loss: None,
            assistant_only_loss: false,
            packing: false,
            eos_token: None,
            loss_type: SftLossType::Nll,
        }
    }
}

impl SftConfig {
    /// The data seed.
    pub fn data_seed(&self) -> u64 {
        self.data_seed.unwrap_or(self.training.seed)
    }
}

impl TrainingConfig for SftConfig {
    const NAME: &'static str = "SFTConfig";
    const UNSET_KEYS: &'static [&'static str] = &[
        "data_seed",
        "memory_limit",
        "save_total_limit",
        "completion_only_loss",
        "eos_token",
        "lora_target_modules",
        "lora_target_parameters",
        "router_aux_loss_coef",
    ];
    const RESUMABLE_KEYS: &'static [&'static str] = &[
        "save_steps",
        "memory_check",
        "memory_limit",
        "save_total_limit",
        "save_strategy",
        "save_only_model",
    ];

    fn allowed_values(key: &str) -> Option<&'static [&'static str]> {
        match key {
            "truncation_mode" => Some(&["keep_start", "keep_end"]),
            "loss_type" => Some(&["nll", "dft"]),
            _ => shared_allowed_values(key),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.training.validate()?;
        check_router_aux_loss_coef(self.router_aux_loss_coef)?;
        if self.max_length == Some(0) {
            return Err(error(
                "max_length",
                "must be at least 1 (leave it unset to keep every token)",
            ));
        }
        if self.packing {
            return Err(error(
                "packing",
                "packing is not supported: each example trains as its own sequence (packing = false)",
            ));
        }
        Ok(())
    }

    fn training(&self) -> &TrainingArguments {
        &self.training
    }

    fn router_aux_loss_coef(&self) -> Option<f64> {
        self.router_aux_loss_coef
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ConfigBuilder;

    #[test]
    fn options_are_checked_and_named_by_key() {
        let config: SftConfig = ConfigBuilder::default()
            .set("--assistant-only-loss", "true")
            .set("--max-length", "64")
            .build()
            .unwrap();
        assert!(config.assistant_only_loss);
        assert_eq!(config.max_length, Some(64));
        let error = ConfigBuilder::<SftConfig>::default()
            .set("--loss-type", "mse")
            .build()
            .unwrap_err();
        assert_eq!(error.key.as_deref(), Some("loss_type"));
        assert!(
            error.to_string().contains("allowed values: nll, dft"),
            "{error}"
        );
        let error = ConfigBuilder::<SftConfig>::default()
            .set("--packing", "true")
            .build()
            .unwrap_err();
        assert!(
            error.to_string().starts_with("--packing: `packing`"),
            "{error}"
        );
        let error = ConfigBuilder::<SftConfig>::default()
            .set("--num-generations", "4")
            .build()
            .unwrap_err();
        assert!(error.to_string().contains("unknown option"), "{error}");
        let error = ConfigBuilder::<SftConfig>::default()
            .set("--learning-rate", "-1")
            .build()
            .unwrap_err();
        assert_eq!(error.key.as_deref(), Some("learning_rate"));
    }
}
