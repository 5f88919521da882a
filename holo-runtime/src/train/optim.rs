//! AdamW, gradient clipping and the learning-rate schedules, as torch and transformers define them.
//!
//! - [`AdamW`]: `torch.optim.AdamW` (decoupled weight decay, bias-corrected moments, `eps` added after
//!   the square root), with its moments kept by name so that checkpoints save and restore them. f32
//!   weights on the CPU and their moments are updated in place by three parallel passes (candle's
//!   elementwise operations would make a full pass and a new tensor per operation, a dozen per weight:
//!   1.9 s of a 0.5B model's step); the result is bit for bit the one of those operations, which other
//!   devices and types still use.
//! - [`clip_grad_norm`]: `torch.nn.utils.clip_grad_norm_`: the global L2 norm of all gradients, scaled
//!   down by `max_norm / (norm + 1e-6)` when that is below 1; returns the norm before clipping.
//! - [`learning_rate`]: transformers' `get_scheduler` for `linear`, `cosine`, `constant` and
//!   `constant_with_warmup`.

use std::collections::HashMap;

use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Tensor, Var};
use rayon::prelude::*;

use super::config::{LrSchedulerType, TrainingConfig};

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
    pub fn new(params: Vec<(String, Var)>, config: &impl TrainingConfig) -> Self {
        let config = config.shared();
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
        let constants = Constants::new(self, lr);
        for ((name, var), grad) in self.params.iter().zip(grads) {
            let Some(grad) = grad else { continue };
            let (m, v) = match self.moments.remove(name) {
                Some(moments) => moments,
                None => (var.zeros_like()?, var.zeros_like()?),
            };
            let moments = if on_host(var.as_tensor()) {
                update_host(var, grad, &m, &v, &constants)?;
                (m, v)
            } else {
                update_tensors(var, grad, m, v, &constants)?
            };
            self.moments.insert(name.clone(), moments);
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

/// Whether `tensor` is updated in place: f32 on the CPU.
fn on_host(tensor: &Tensor) -> bool {
    tensor.device().is_cpu() && tensor.dtype() == DType::F32
}

/// One step's constants, each as candle applies it to f32 tensors (`x * c` multiplies by `c as f32`,
/// `x / c` by `(1 / c) as f32`).
struct Constants {
    beta1: f64,
    beta2: f64,
    eps: f64,
    /// `1 - lr × weight_decay`.
    decay: f64,
    /// `sqrt(1 - beta2^step)`.
    bias2_sqrt: f64,
    /// `lr / (1 - beta1^step)`.
    step_size: f64,
}

impl Constants {
    fn new(adam: &AdamW, lr: f64) -> Self {
        let step = adam.step as i32;
        Constants {
            beta1: adam.beta1,
            beta2: adam.beta2,
            eps: adam.eps,
            decay: 1.0 - lr * adam.weight_decay,
            bias2_sqrt: (1.0 - adam.beta2.powi(step)).sqrt(),
            step_size: lr / (1.0 - adam.beta1.powi(step)),
        }
    }
}

/// The update with candle's operations, for any device and type; returns the new moments.
fn update_tensors(
    var: &Var,
    grad: &Tensor,
    m: Tensor,
    v: Tensor,
    c: &Constants,
) -> Result<(Tensor, Tensor)> {
    let theta = var.as_tensor();
    let m = ((m * c.beta1)? + (grad * (1.0 - c.beta1))?)?;
    let v = ((v * c.beta2)? + (grad.sqr()? * (1.0 - c.beta2))?)?;
    let decayed = (theta * c.decay)?;
    let denominator = ((v.sqrt()? / c.bias2_sqrt)? + c.eps)?;
    let update = ((&m / denominator)? * c.step_size)?;
    var.set(&(decayed - update)?)?;
    Ok((m, v))
}

/// The same update in place on an f32 weight on the CPU and its moments, with no allocation: two
/// parallel passes update the moments, one the weight. Each operation is written as candle computes
/// it (`x * mul + add` for a constant), so the result is the same to the bit, signed zeros included.
fn update_host(var: &Var, grad: &Tensor, m: &Tensor, v: &Tensor, c: &Constants) -> Result<()> {
    let grad = grad.contiguous()?;
    m.inplace_op2(&grad, &MomentUpdate::decaying(c.beta1, false))?;
    v.inplace_op2(&grad, &MomentUpdate::decaying(c.beta2, true))?;
    var.as_tensor().inplace_op3(
        m,
        v,
        &WeightUpdate {
            decay: c.decay as f32,
            inverse_bias2: (1.0 / c.bias2_sqrt) as f32,
            eps: c.eps as f32,
            step_size: c.step_size as f32,
        },
    )
}

/// Elements per task of the parallel passes.
const CHUNK: usize = 1 << 14;

/// The f32 values a contiguous CPU tensor's layout covers.
fn contiguous<'s>(storage: &'s CpuStorage, layout: &Layout) -> Result<&'s [f32]> {
    let (CpuStorage::F32(values), Some((start, end))) = (storage, layout.contiguous_offsets())
    else {
        candle_core::bail!("AdamW updates contiguous f32 tensors in place")
    };
    Ok(&values[start..end])
}

fn contiguous_mut<'s>(storage: &'s mut CpuStorage, layout: &Layout) -> Result<&'s mut [f32]> {
    let (CpuStorage::F32(values), Some((start, end))) = (storage, layout.contiguous_offsets())
    else {
        candle_core::bail!("AdamW updates contiguous f32 tensors in place")
    };
    Ok(&mut values[start..end])
}

/// `moment = moment * keep + g * take`, `g` the gradient or its square.
struct MomentUpdate {
    keep: f32,
    take: f32,
    square: bool,
}

impl MomentUpdate {
    /// The moment of decay `beta`, of the gradient or (`square`) of its square.
    fn decaying(beta: f64, square: bool) -> Self {
        MomentUpdate {
            keep: beta as f32,
            take: (1.0 - beta) as f32,
            square,
        }
    }
}

impl InplaceOp2 for MomentUpdate {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let moment = contiguous_mut(s1, l1)?;
        let grad = contiguous(s2, l2)?;
        if moment.len() != grad.len() {
            candle_core::bail!(
                "AdamW: {} moments for {} gradients",
                moment.len(),
                grad.len()
            );
        }
        let Self { keep, take, square } = *self;
        moment
            .par_chunks_mut(CHUNK)
            .zip(grad.par_chunks(CHUNK))
            .for_each(|(moment, grad)| {
                for (m, &g) in moment.iter_mut().zip(grad) {
                    let g = if square { g * g } else { g };
                    *m = (*m * keep + 0.0) + (g * take + 0.0);
                }
            });
        Ok(())
    }
}

/// `theta = theta * decay - m / (sqrt(v) / bias2_sqrt + eps) * step_size`.
struct WeightUpdate {
    decay: f32,
    inverse_bias2: f32,
    eps: f32,
    step_size: f32,
}

impl InplaceOp3 for WeightUpdate {
    fn name(&self) -> &'static str {
        "adamw-weight"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        let theta = contiguous_mut(s1, l1)?;
        let (m, v) = (contiguous(s2, l2)?, contiguous(s3, l3)?);
        if m.len() != theta.len() || v.len() != theta.len() {
            candle_core::bail!(
                "AdamW: moments of {} and {} for {} weights",
                m.len(),
                v.len(),
                theta.len()
            );
        }
        let Self {
            decay,
            inverse_bias2,
            eps,
            step_size,
        } = *self;
        theta
            .par_chunks_mut(CHUNK)
            .zip(m.par_chunks(CHUNK).zip(v.par_chunks(CHUNK)))
            .for_each(|(theta, (m, v))| {
                for ((t, &m), &v) in theta.iter_mut().zip(m).zip(v) {
                    let decayed = *t * decay + 0.0;
                    let denominator = (v.sqrt() * inverse_bias2 + 0.0) * 1.0 + eps;
                    *t = decayed - ((m / denominator) * step_size + 0.0);
                }
            });
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
pub fn warmup_steps(config: &impl TrainingConfig, total: u64) -> u64 {
    let config = config.shared();
    if config.warmup_steps > 0 {
        config.warmup_steps
    } else {
        (config.warmup_ratio * total as f64).ceil() as u64
    }
}

/// The learning rate of the optimizer step that follows `completed` steps, out of `total`.
pub fn learning_rate(config: &impl TrainingConfig, completed: u64, total: u64) -> f64 {
    let warmup = warmup_steps(config, total);
    let config = config.shared();
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
    use crate::train::GrpoConfig;

    #[test]
    fn the_in_place_update_is_candles_to_the_bit() {
        use candle_core::Device;
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        // Values with zeros of both signs, tiny and large magnitudes.
        let mut values = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|i| match i % 7 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => rng.random_range(-1e-30f32..1e-30),
                    _ => rng.random_range(-3.0f32..3.0),
                })
                .collect()
        };
        let shape = (3, 50_000);
        let config = GrpoConfig {
            weight_decay: 0.1,
            ..GrpoConfig::default()
        };
        let start = Tensor::from_vec(values(150_000), shape, &Device::Cpu).unwrap();
        let fused = Var::from_tensor(&start).unwrap();
        let plain = Var::from_tensor(&start).unwrap();
        let mut adam = AdamW::new(vec![("w".into(), fused.clone())], &config);
        let (mut m, mut v) = (plain.zeros_like().unwrap(), plain.zeros_like().unwrap());
        for step in 1..=4 {
            let grad = Tensor::from_vec(values(150_000), shape, &Device::Cpu).unwrap();
            let lr = 1e-3 / step as f64;
            adam.step(&[Some(grad.clone())], lr).unwrap();
            let constants = Constants::new(&adam, lr);
            (m, v) = update_tensors(&plain, &grad, m, v, &constants).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                values.iter().map(|x| x.to_bits()).collect()
            };
            assert!(
                bits(fused.as_tensor()) == bits(plain.as_tensor()),
                "step {step}"
            );
            let state = adam.state();
            assert!(bits(&state[0].1) == bits(&m) && bits(&state[1].1) == bits(&v));
        }
        assert_eq!(adam.state()[0].0, "w.exp_avg");
    }

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
