//! The optimizer step every backend shares, as torch and transformers define it: the learning-rate
//! schedule ([`learning_rate`]: transformers' `get_scheduler` for `linear`, `cosine`, `constant` and
//! `constant_with_warmup`) and gradient clipping's factor ([`clip_coefficient`]:
//! `torch.nn.utils.clip_grad_norm_`'s `max_norm / (norm + 1e-6)` when below 1). With the `local`
//! feature, `AdamW` and `grad_norm` on candle's tensors (`adamw.rs`), for the model trained in process.

#[cfg(feature = "local")]
mod adamw;

#[cfg(feature = "local")]
pub use adamw::{grad_norm, AdamSettings, AdamW, Result, StateTensor};

use crate::config::{LrSchedulerType, TrainingConfig};

/// What clipping to `max_norm` multiplies gradients of global norm `norm` by: `max_norm / (norm + 1e-6)`
/// when that is below 1, else 1 (also for `max_norm` 0, no clipping).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    let coefficient = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coefficient < 1.0 {
        coefficient
    } else {
        1.0
    }
}

/// Warm-up steps: `warmup_steps`, or `warmup_ratio` of `total` rounded up.
pub fn warmup_steps(config: &impl TrainingConfig, total: u64) -> u64 {
    let config = config.training();
    if config.warmup_steps > 0 {
        config.warmup_steps
    } else {
        (config.warmup_ratio * total as f64).ceil() as u64
    }
}

/// The learning rate of the optimizer step that follows `completed` steps, out of `total`.
pub fn learning_rate(config: &impl TrainingConfig, completed: u64, total: u64) -> f64 {
    let warmup = warmup_steps(config, total);
    let config = config.training();
    let step = completed as f64;
    let base = config.learning_rate;
    let warming = completed < warmup;
    let warm = step / warmup.max(1) as f64;
    let progress = (step - warmup as f64) / total.saturating_sub(warmup).max(1) as f64;
    base * match config.lr_scheduler_type {
        LrSchedulerType::Constant => 1.0,
        LrSchedulerType::ConstantWithWarmup if warming => warm,
        LrSchedulerType::ConstantWithWarmup => 1.0,
        LrSchedulerType::Linear if warming => warm,
        LrSchedulerType::Linear => {
            ((total as f64 - step) / total.saturating_sub(warmup).max(1) as f64).max(0.0)
        }
        LrSchedulerType::Cosine if warming => warm,
        LrSchedulerType::Cosine => (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GrpoConfig, TrainingArguments};

    #[test]
    fn schedules_follow_transformers() {
        let config = |kind, warmup| GrpoConfig {
            training: TrainingArguments {
                lr_scheduler_type: kind,
                warmup_steps: warmup,
                learning_rate: 1.0,
                ..GrpoConfig::default().training
            },
            ..GrpoConfig::default()
        };
        let linear = config(LrSchedulerType::Linear, 2);
        let rates: Vec<f64> = (0..6).map(|s| learning_rate(&linear, s, 6)).collect();
        assert_eq!(rates, vec![0.0, 0.5, 1.0, 0.75, 0.5, 0.25]);
        let cosine = config(LrSchedulerType::Cosine, 0);
        assert!((learning_rate(&cosine, 2, 4) - 0.5).abs() < 1e-12);
        assert_eq!(learning_rate(&cosine, 0, 4), 1.0);
        let constant = config(LrSchedulerType::ConstantWithWarmup, 4);
        assert_eq!(learning_rate(&constant, 1, 10), 0.25);
        assert_eq!(learning_rate(&constant, 7, 10), 1.0);
    }
}
