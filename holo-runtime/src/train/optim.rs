//! AdamW, gradient clipping and the learning-rate schedules, as torch and transformers define them.
//!
//! - [`AdamW`]: `torch.optim.AdamW` (decoupled weight decay, bias-corrected moments, `eps` added after
//!   the square root), with its moments kept by name so that checkpoints save and restore them.
//! - [`clip_grad_norm`]: `torch.nn.utils.clip_grad_norm_`: the global L2 norm of all gradients, scaled
//!   down by `max_norm / (norm + 1e-6)` when that is below 1; returns the norm before clipping.
//! - [`learning_rate`]: transformers' `get_scheduler` for `linear`, `cosine`, `constant` and
//!   `constant_with_warmup`.

use std::collections::HashMap;

use candle_core::{DType, Tensor, Var};

use super::config::{GrpoConfig, LrSchedulerType};

pub type Result<T> = candle_core::Result<T>;

/// AdamW over named [`Var`]s.
pub struct AdamW {
    params: Vec<(String, Var)>,
    /// First and second moments by parameter name (created at the first step).
    moments: HashMap<String, (Tensor, Tensor)>,
    /// Steps taken.
    pub step: u64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    pub fn new(params: Vec<(String, Var)>, config: &GrpoConfig) -> Self {
        AdamW {
            params,
            moments: HashMap::new(),
            step: 0,
            beta1: config.adam_beta1,
            beta2: config.adam_beta2,
            eps: config.adam_epsilon,
            weight_decay: config.weight_decay,
        }
    }

    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// One update with `grads` (one per parameter, in order; `None` leaves a parameter unchanged, as
    /// torch skips parameters without a gradient) at learning rate `lr`.
    pub fn step(&mut self, grads: &[Option<Tensor>], lr: f64) -> Result<()> {
        self.step += 1;
        let step = self.step as i32;
        let bias1 = 1.0 - self.beta1.powi(step);
        let bias2_sqrt = (1.0 - self.beta2.powi(step)).sqrt();
        for ((name, var), grad) in self.params.iter().zip(grads) {
            let Some(grad) = grad else { continue };
            let theta = var.as_tensor();
            let (m, v) = match self.moments.remove(name) {
                Some(moments) => moments,
                None => (theta.zeros_like()?, theta.zeros_like()?),
            };
            let m = ((m * self.beta1)? + (grad * (1.0 - self.beta1))?)?;
            let v = ((v * self.beta2)? + (grad.sqr()? * (1.0 - self.beta2))?)?;
            let decayed = (theta * (1.0 - lr * self.weight_decay))?;
            let denominator = ((v.sqrt()? / bias2_sqrt)? + self.eps)?;
            let update = ((&m / denominator)? * (lr / bias1))?;
            var.set(&(decayed - update)?)?;
            self.moments.insert(name.clone(), (m, v));
        }
        Ok(())
    }

    /// The moments under `<name>.exp_avg` and `<name>.exp_avg_sq` (torch's state names), for a
    /// checkpoint.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut named = Vec::with_capacity(self.moments.len() * 2);
        for (name, _) in &self.params {
            if let Some((m, v)) = self.moments.get(name) {
                named.push((format!("{name}.exp_avg"), m.clone()));
                named.push((format!("{name}.exp_avg_sq"), v.clone()));
            }
        }
        named
    }

    /// Restores [`AdamW::state`] and the step count; every tensor must match a parameter's shape.
    pub fn load_state(&mut self, step: u64, tensors: &HashMap<String, Tensor>) -> Result<()> {
        self.step = step;
        self.moments.clear();
        for (name, var) in &self.params {
            let m = tensors.get(&format!("{name}.exp_avg"));
            let v = tensors.get(&format!("{name}.exp_avg_sq"));
            match (m, v) {
                (Some(m), Some(v)) => {
                    for moment in [m, v] {
                        if moment.dims() != var.dims() {
                            candle_core::bail!(
                                "optimizer state of {name} has shape {:?}, the weight {:?}",
                                moment.dims(),
                                var.dims()
                            );
                        }
                    }
                    let device = var.device();
                    self.moments.insert(
                        name.clone(),
                        (
                            m.to_device(device)?.to_dtype(var.dtype())?,
                            v.to_device(device)?.to_dtype(var.dtype())?,
                        ),
                    );
                }
                (None, None) if step == 0 => {}
                _ => candle_core::bail!("the optimizer state has no moments for {name}"),
            }
        }
        Ok(())
    }
}

/// Scales `grads` so that their global L2 norm is at most `max_norm` (0 leaves them); returns the norm
/// before clipping.
pub fn clip_grad_norm(grads: &mut [Option<Tensor>], max_norm: f64) -> Result<f64> {
    let mut squares = 0.0f64;
    for grad in grads.iter().flatten() {
        squares += grad
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
    }
    let norm = squares.sqrt();
    if max_norm > 0.0 {
        let coefficient = max_norm / (norm + 1e-6);
        if coefficient < 1.0 {
            for grad in grads.iter_mut().flatten() {
                *grad = (&*grad * coefficient)?;
            }
        }
    }
    Ok(norm)
}

/// Warm-up steps: `warmup_steps`, or `warmup_ratio` of `total` rounded up.
pub fn warmup_steps(config: &GrpoConfig, total: u64) -> u64 {
    if config.warmup_steps > 0 {
        config.warmup_steps
    } else {
        (config.warmup_ratio * total as f64).ceil() as u64
    }
}

/// The learning rate of the optimizer step that follows `completed` steps, out of `total`.
pub fn learning_rate(config: &GrpoConfig, completed: u64, total: u64) -> f64 {
    let warmup = warmup_steps(config, total);
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

    #[test]
    fn schedules_follow_transformers() {
        let config = |kind, warmup| GrpoConfig {
            lr_scheduler_type: kind,
            warmup_steps: warmup,
            learning_rate: 1.0,
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
