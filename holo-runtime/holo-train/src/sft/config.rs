//! `holo sft`'s options: TRL's `SFTConfig` names, defaults and meanings (with transformers'
//! `TrainingArguments` underneath), plus LoRA's under TRL's `ModelConfig` names. Built, checked and kept
//! in a run like GRPO's ([`ConfigBuilder`](crate::ConfigBuilder)`<SftConfig>`).

use serde::{Deserialize, Serialize};

use crate::config::LrSchedulerType;
use crate::config::{
    error, shared_allowed_values, shared_options, ConfigError, Shared, TrainingConfig,
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
    // --- Length of the run, checkpoints ---
    /// Optimizer steps; -1 runs `num_train_epochs` over the data instead.
    pub max_steps: i64,
    /// Passes over the data when `max_steps` is -1.
    pub num_train_epochs: f64,
    pub seed: u64,
    /// Seeds the data order; `seed` when unset.
    pub data_seed: Option<u64>,
    /// Save a checkpoint every this many steps (and at the end).
    pub save_steps: u64,
    /// Keep only the newest this many checkpoints.
    pub save_total_limit: Option<usize>,

    // --- Batches ---
    /// Examples per micro-batch (one forward and backward pass).
    pub per_device_train_batch_size: usize,
    /// Micro-batches whose gradients are summed into one optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Activation recomputation: one layer's activations alive at a time in the backward pass.
    pub gradient_checkpointing: bool,

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
    /// Projections that get adapters; PEFT's default for Qwen2 and Llama (`q_proj`, `v_proj`) when unset.
    pub lora_target_modules: Option<Vec<String>>,
}

impl Default for SftConfig {
    fn default() -> Self {
        SftConfig {
            max_steps: -1,
            num_train_epochs: 3.0,
            seed: 42,
            data_seed: None,
            save_steps: 500,
            save_total_limit: None,
            per_device_train_batch_size: 8,
            gradient_accumulation_steps: 1,
            gradient_checkpointing: false,
            max_length: Some(1024),
            truncation_mode: TruncationMode::KeepStart,
            completion_only_loss: None,
            assistant_only_loss: false,
            packing: false,
            eos_token: None,
            loss_type: SftLossType::Nll,
            learning_rate: 2e-5,
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
        }
    }
}

impl SftConfig {
    /// The data seed.
    pub fn data_seed(&self) -> u64 {
        self.data_seed.unwrap_or(self.seed)
    }
}

impl TrainingConfig for SftConfig {
    const NAME: &'static str = "SFTConfig";
    const UNSET_KEYS: &'static [&'static str] = &[
        "data_seed",
        "save_total_limit",
        "completion_only_loss",
        "eos_token",
        "lora_target_modules",
    ];
    const RESUMABLE_KEYS: &'static [&'static str] = &["save_steps", "save_total_limit"];

    fn allowed_values(key: &str) -> Option<&'static [&'static str]> {
        match key {
            "truncation_mode" => Some(&["keep_start", "keep_end"]),
            "loss_type" => Some(&["nll", "dft"]),
            _ => shared_allowed_values(key),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.shared().validate()?;
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

    fn shared(&self) -> Shared {
        shared_options!(self)
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
