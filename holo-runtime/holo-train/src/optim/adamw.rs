//! [`AdamW`] on candle's tensors and [`grad_norm`], the local backend's half of [`super`].
//!
//! `torch.optim.AdamW` (decoupled weight decay, bias-corrected moments, `eps` added after the square
//! root), with its moments kept by name so that checkpoints save and restore them. An f32 weight on the
//! CPU and its moments are updated in place in one parallel pass that reads the gradient once (candle's
//! elementwise operations would make a full pass and a new tensor per operation, a dozen per weight: 1.9 s
//! of a 0.5B model's step); the result is bit for bit the one of those operations, which other devices
//! and types still use. A weight stored in a narrower type than f32 (bf16, the precision of training on
//! CUDA) is updated through an f32 master copy with f32 moments, and set to the master rounded after each
//! step (mixed precision as DeepSpeed and Megatron keep it): written straight into bf16, an update below
//! half the spacing of bf16 values near the weight (`|w| × 2⁻⁹`; 2e-6 for a weight of 1e-3) rounded away
//! to nothing, which at TRL's default learning rate (1e-6) was nearly every update.
//!
//! [`grad_norm`] is `torch.nn.utils.clip_grad_norm_`'s global L2 norm of all gradients; the update
//! applies [`super::clip_coefficient`] as it reads each gradient ([`AdamW::step`]'s `grad_scale`), so
//! clipping writes no gradient-sized tensor.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Tensor, Var};
use rayon::prelude::*;
use safetensors::View;

use crate::config::TrainingConfig;

pub type Result<T> = candle_core::Result<T>;

/// AdamW's constants, torch's names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamSettings {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// AdamW over named [`Var`]s.
pub struct AdamW {
    params: Vec<(String, Var)>,
    /// First and second moments by parameter name (created at the first step).
    moments: HashMap<String, Moments>,
    /// The f32 master copies of the weights stored in a narrower type, by name (created at the first
    /// step, from the weight).
    masters: HashMap<String, Var>,
    /// Steps taken.
    pub step: u64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    pub fn new(params: Vec<(String, Var)>, config: &impl TrainingConfig) -> Self {
        let config = config.training();
        AdamW {
            params,
            moments: HashMap::new(),
            masters: HashMap::new(),
            step: 0,
            beta1: config.adam_beta1,
            beta2: config.adam_beta2,
            eps: config.adam_epsilon,
            weight_decay: config.weight_decay,
        }
    }

    /// AdamW over `params` with these settings rather than a trainer configuration's (a service whose
    /// clients send them with each step, as Tinker's `optim_step` does).
    pub fn with_settings(params: Vec<(String, Var)>, settings: AdamSettings) -> Self {
        AdamW {
            params,
            moments: HashMap::new(),
            masters: HashMap::new(),
            step: 0,
            beta1: settings.beta1,
            beta2: settings.beta2,
            eps: settings.eps,
            weight_decay: settings.weight_decay,
        }
    }

    /// Takes the next steps with `settings` (the moments and the step count stay).
    pub fn set_settings(&mut self, settings: AdamSettings) {
        self.beta1 = settings.beta1;
        self.beta2 = settings.beta2;
        self.eps = settings.eps;
        self.weight_decay = settings.weight_decay;
    }

    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// One update with `grads` (one per parameter, in order; `None` leaves a parameter unchanged, as
    /// torch skips parameters without a gradient) multiplied by `grad_scale` (clipping; 1 leaves them) at
    /// learning rate `lr`.
    pub fn step(&mut self, grads: &[Option<Tensor>], lr: f64, grad_scale: f64) -> Result<()> {
        self.step += 1;
        let constants = Constants::new(self, lr);
        for ((name, weight), grad) in self.params.iter().zip(grads) {
            let Some(grad) = grad else { continue };
            // A narrow weight is updated through its master: the update lands on the f32 copy, and the
            // weight is that copy rounded.
            let master = if has_master(weight) {
                let master = match self.masters.remove(name) {
                    Some(master) => master,
                    None => Var::from_tensor(&weight.to_dtype(DType::F32)?)?,
                };
                Some(master)
            } else {
                None
            };
            let var = master.as_ref().unwrap_or(weight);
            let grad = &grad.to_dtype(var.dtype())?;
            let moments = self.moments.remove(name);
            let moments = if on_host(var.as_tensor()) {
                let (mut m, mut v) = match moments {
                    Some(moments) => moments.into_host()?,
                    None => (vec![0.0; var.elem_count()], vec![0.0; var.elem_count()]),
                };
                update_host(var, grad, (&mut m, &mut v), &constants, grad_scale)?;
                Moments::Host(m, v)
            } else {
                let (m, v) = match moments {
                    Some(moments) => moments.into_tensors(var)?,
                    None => (var.zeros_like()?, var.zeros_like()?),
                };
                let grad = if grad_scale == 1.0 {
                    grad.clone()
                } else {
                    (grad * grad_scale)?
                };
                let (m, v) = update_tensors(var, &grad, m, v, &constants)?;
                Moments::Tensors(m, v)
            };
            self.moments.insert(name.clone(), moments);
            if let Some(master) = master {
                weight.set(&master.to_dtype(weight.dtype())?)?;
                self.masters.insert(name.clone(), master);
            }
        }
        Ok(())
    }

    /// The moments under `<name>.exp_avg` and `<name>.exp_avg_sq` (torch's state names), and the f32
    /// master copies of narrow weights under `<name>.master`, for a checkpoint.
    pub fn state(&self) -> Vec<(String, StateTensor<'_>)> {
        let mut named = Vec::with_capacity(self.moments.len() * 2 + self.masters.len());
        for (name, var) in &self.params {
            if let Some(master) = self.masters.get(name) {
                named.push((
                    format!("{name}.master"),
                    StateTensor::Tensor(master.as_tensor().clone()),
                ));
            }
            let Some(moments) = self.moments.get(name) else {
                continue;
            };
            let (m, v) = match moments {
                Moments::Host(m, v) => {
                    let view = |values| StateTensor::Host {
                        values,
                        shape: var.dims().to_vec(),
                    };
                    (view(m.as_slice()), view(v.as_slice()))
                }
                Moments::Tensors(m, v) => (
                    StateTensor::Tensor(m.clone()),
                    StateTensor::Tensor(v.clone()),
                ),
            };
            named.push((format!("{name}.exp_avg"), m));
            named.push((format!("{name}.exp_avg_sq"), v));
        }
        named
    }

    /// Restores [`AdamW::state`] and the step count; every tensor must match a parameter's shape. A
    /// narrow weight without a master in `tensors` (a checkpoint written before masters were kept) takes
    /// its master from the weight, as the first step does.
    pub fn load_state(&mut self, step: u64, tensors: &HashMap<String, Tensor>) -> Result<()> {
        self.step = step;
        self.moments.clear();
        self.masters.clear();
        for (name, var) in &self.params {
            if let Some(master) = tensors.get(&format!("{name}.master")) {
                if master.dims() != var.dims() || !has_master(var) {
                    candle_core::bail!(
                        "optimizer state has a master copy of {name} of shape {:?}, the weight is {:?} {:?}",
                        master.dims(),
                        var.dtype(),
                        var.dims()
                    );
                }
                let master = master.to_device(var.device())?.to_dtype(DType::F32)?;
                self.masters
                    .insert(name.clone(), Var::from_tensor(&master)?);
            }
            // The moments are kept in the type of what they update: the master's f32 for a narrow weight.
            let dtype = if has_master(var) {
                DType::F32
            } else {
                var.dtype()
            };
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
                        Moments::Tensors(
                            m.to_device(device)?.to_dtype(dtype)?,
                            v.to_device(device)?.to_dtype(dtype)?,
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

/// A parameter's first and second moments: vectors beside an f32 weight on the CPU, updated with it in
/// one pass; tensors of the weight's type and device otherwise (and as a checkpoint restores them).
enum Moments {
    Host(Vec<f32>, Vec<f32>),
    Tensors(Tensor, Tensor),
}

impl Moments {
    fn into_host(self) -> Result<(Vec<f32>, Vec<f32>)> {
        match self {
            Moments::Host(m, v) => Ok((m, v)),
            Moments::Tensors(m, v) => Ok((
                m.flatten_all()?.to_vec1::<f32>()?,
                v.flatten_all()?.to_vec1::<f32>()?,
            )),
        }
    }

    fn into_tensors(self, var: &Var) -> Result<(Tensor, Tensor)> {
        match self {
            Moments::Tensors(m, v) => Ok((m, v)),
            Moments::Host(m, v) => Ok((
                Tensor::from_vec(m, var.shape(), var.device())?,
                Tensor::from_vec(v, var.shape(), var.device())?,
            )),
        }
    }
}

/// One tensor of [`AdamW::state`], as a checkpoint writes it (a safetensors [`View`]): a moment vector
/// borrowed, so that saving does not copy a 0.5B model's 2.9 GB of moments, or a tensor.
pub enum StateTensor<'a> {
    Host {
        values: &'a [f32],
        shape: Vec<usize>,
    },
    Tensor(Tensor),
}

impl StateTensor<'_> {
    /// The values as a tensor (a copy of a borrowed vector), on the CPU.
    pub fn to_tensor(&self) -> Result<Tensor> {
        match self {
            StateTensor::Host { values, shape } => {
                Tensor::from_slice(values, shape.as_slice(), &candle_core::Device::Cpu)
            }
            StateTensor::Tensor(tensor) => Ok(tensor.clone()),
        }
    }
}

impl View for StateTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self {
            StateTensor::Host { .. } => safetensors::Dtype::F32,
            StateTensor::Tensor(tensor) => View::dtype(tensor),
        }
    }

    fn shape(&self) -> &[usize] {
        match self {
            StateTensor::Host { shape, .. } => shape,
            StateTensor::Tensor(tensor) => tensor.dims(),
        }
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self {
            // safetensors stores little-endian values: on such a CPU, the vector's own bytes.
            #[cfg(target_endian = "little")]
            StateTensor::Host { values, .. } => Cow::Borrowed(unsafe {
                // SAFETY: any f32 is 4 initialized bytes; the slice covers exactly `values`.
                std::slice::from_raw_parts(
                    values.as_ptr().cast::<u8>(),
                    std::mem::size_of_val(*values),
                )
            }),
            #[cfg(not(target_endian = "little"))]
            StateTensor::Host { values, .. } => Cow::Owned(
                values
                    .iter()
                    .flat_map(|value| value.to_le_bytes())
                    .collect(),
            ),
            StateTensor::Tensor(tensor) => View::data(tensor),
        }
    }

    fn data_len(&self) -> usize {
        match self {
            StateTensor::Host { values, .. } => std::mem::size_of_val(*values),
            StateTensor::Tensor(tensor) => View::data_len(tensor),
        }
    }
}

/// Whether `weight` is updated through an f32 master copy: stored in a type narrower than f32.
fn has_master(weight: &Tensor) -> bool {
    matches!(weight.dtype(), DType::BF16 | DType::F16)
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

/// The same update in place on an f32 weight on the CPU and its moments, with no allocation: one
/// parallel pass reads each gradient once, scales it (clipping), and updates the moments and the
/// weight. Each operation is written as candle computes it (`x * mul + add` for a constant), so the
/// result is the same to the bit, signed zeros included.
fn update_host(
    var: &Var,
    grad: &Tensor,
    (m, v): (&mut [f32], &mut [f32]),
    c: &Constants,
    grad_scale: f64,
) -> Result<()> {
    let grad = grad.contiguous()?;
    var.as_tensor().inplace_op2(
        &grad,
        &HostUpdate {
            moments: Mutex::new((m, v)),
            grad_scale: (grad_scale != 1.0).then_some(grad_scale as f32),
            keep1: c.beta1 as f32,
            take1: (1.0 - c.beta1) as f32,
            keep2: c.beta2 as f32,
            take2: (1.0 - c.beta2) as f32,
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

/// With `g` the gradient (times `grad_scale`, as `grad * grad_scale` rounds it):
/// `m = m · β1 + g · (1 − β1)`, `v = v · β2 + g² · (1 − β2)`, and
/// `theta = theta · decay − m / (sqrt(v) / bias2_sqrt + eps) · step_size`.
struct HostUpdate<'a> {
    moments: Mutex<(&'a mut [f32], &'a mut [f32])>,
    grad_scale: Option<f32>,
    keep1: f32,
    take1: f32,
    keep2: f32,
    take2: f32,
    decay: f32,
    inverse_bias2: f32,
    eps: f32,
    step_size: f32,
}

impl InplaceOp2 for HostUpdate<'_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let theta = contiguous_mut(s1, l1)?;
        let grad = contiguous(s2, l2)?;
        let mut moments = self.moments.lock().expect("the update is not shared");
        let (m, v) = &mut *moments;
        if grad.len() != theta.len() || m.len() != theta.len() || v.len() != theta.len() {
            candle_core::bail!(
                "AdamW: {} gradients and moments of {} and {} for {} weights",
                grad.len(),
                m.len(),
                v.len(),
                theta.len()
            );
        }
        let wide = wide_vectors();
        theta
            .par_chunks_mut(CHUNK)
            .zip(grad.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
            .for_each(|((theta, grad), (m, v))| {
                if wide {
                    // SAFETY: `wide_vectors` found AVX-512F on this CPU.
                    unsafe { self.apply_avx512(theta, grad, m, v) }
                } else {
                    self.apply(theta, grad, m, v)
                }
            });
        Ok(())
    }
}

impl HostUpdate<'_> {
    #[inline(always)]
    fn apply(&self, theta: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
        let Self {
            grad_scale,
            keep1,
            take1,
            keep2,
            take2,
            decay,
            inverse_bias2,
            eps,
            step_size,
            ..
        } = *self;
        for (((t, &g), m), v) in theta.iter_mut().zip(grad).zip(m).zip(v) {
            let g = match grad_scale {
                Some(scale) => g * scale + 0.0,
                None => g,
            };
            *m = (*m * keep1 + 0.0) + (g * take1 + 0.0);
            *v = (*v * keep2 + 0.0) + (g * g * take2 + 0.0);
            let decayed = *t * decay + 0.0;
            let denominator = (v.sqrt() * inverse_bias2 + 0.0) * 1.0 + eps;
            *t = decayed - ((*m / denominator) * step_size + 0.0);
        }
    }

    /// [`HostUpdate::apply`] compiled for AVX-512F: 16 lanes instead of the baseline's 4, and, on the
    /// AMD CPUs measured, no slow path for subnormal numbers, which AdamW meets whenever a gradient is
    /// below 1e-19 (its square in `v` is then subnormal): the baseline (SSE2) build took 0.55 s for a
    /// 0.5B model's update, 3× the time of its memory traffic. Each lane computes what the scalar code
    /// does (no fused multiply-add, IEEE square root and division), so the result is the same to the bit.
    ///
    /// # Safety
    /// The CPU must support AVX-512F ([`wide_vectors`]).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn apply_avx512(&self, theta: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
        self.apply(theta, grad, m, v)
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn apply_avx512(&self, theta: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
        self.apply(theta, grad, m, v)
    }
}

/// Whether the CPU runs AVX-512F, for [`HostUpdate::apply_avx512`].
fn wide_vectors() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The global L2 norm of `grads`: an f32 gradient on the CPU summed in f64 without a temporary tensor,
/// others as candle sums their squares.
pub fn grad_norm(grads: &[Option<Tensor>]) -> Result<f64> {
    let mut squares = 0.0f64;
    for grad in grads.iter().flatten() {
        squares += if on_host(grad) {
            let grad = grad.contiguous()?;
            let (storage, layout) = grad.storage_and_layout();
            let candle_core::Storage::Cpu(storage) = &*storage else {
                candle_core::bail!("a CPU gradient outside CPU storage")
            };
            // Chunk sums in parallel, added in order: rayon's own `sum` combines them in whatever
            // order its threads split the work, which made the norm (and through clipping, every
            // weight) differ in the last bits from one run of a seed to the next.
            let wide = wide_vectors();
            contiguous(storage, layout)?
                .par_chunks(CHUNK)
                .map(|chunk| {
                    if wide {
                        // SAFETY: `wide_vectors` found AVX-512F on this CPU.
                        unsafe { sum_of_squares_avx512(chunk) }
                    } else {
                        sum_of_squares(chunk)
                    }
                })
                .collect::<Vec<f64>>()
                .into_iter()
                .sum::<f64>()
        } else {
            grad.sqr()?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?
        };
    }
    Ok(squares.sqrt())
}

/// `Σ g²` of a chunk in f64, over 8 interleaved partial sums added in a fixed order at the end: the
/// same result on every run, and a sum the compiler can vectorize (one running sum waited on each
/// addition: 0.1 s for a 0.5B model's gradients).
#[inline(always)]
fn sum_of_squares(chunk: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let mut groups = chunk.chunks_exact(8);
    for group in &mut groups {
        for (lane, &g) in lanes.iter_mut().zip(group) {
            *lane += (g as f64) * (g as f64);
        }
    }
    let mut total = lanes.iter().sum::<f64>();
    for &g in groups.remainder() {
        total += (g as f64) * (g as f64);
    }
    total
}

/// [`sum_of_squares`] compiled for AVX-512F (the same additions in the same order).
///
/// # Safety
/// The CPU must support AVX-512F ([`wide_vectors`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_of_squares_avx512(chunk: &[f32]) -> f64 {
    sum_of_squares(chunk)
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn sum_of_squares_avx512(chunk: &[f32]) -> f64 {
    sum_of_squares(chunk)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GrpoConfig, TrainingArguments};

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
            training: TrainingArguments {
                weight_decay: 0.1,
                ..GrpoConfig::default().training
            },
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
            // Clipped at the even steps: the fused pass scales as it reads, the plain one first.
            let scale = if step % 2 == 0 { 0.37 } else { 1.0 };
            adam.step(&[Some(grad.clone())], lr, scale).unwrap();
            let constants = Constants::new(&adam, lr);
            let clipped = if scale == 1.0 {
                grad
            } else {
                (grad * scale).unwrap()
            };
            (m, v) = update_tensors(&plain, &clipped, m, v, &constants).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                values.iter().map(|x| x.to_bits()).collect()
            };
            assert!(
                bits(fused.as_tensor()) == bits(plain.as_tensor()),
                "step {step}"
            );
            let state = adam.state();
            let state: Vec<Tensor> = state.iter().map(|(_, t)| t.to_tensor().unwrap()).collect();
            assert!(bits(&state[0]) == bits(&m) && bits(&state[1]) == bits(&v));
        }
        assert_eq!(adam.state()[0].0, "w.exp_avg");
    }

    /// A bf16 weight of 1 taking steps of 1e-3 (Adam's update with a constant gradient is the learning
    /// rate): each alone is below half the spacing of bf16 values under 1 (2⁻⁹ ≈ 2e-3) and rounded away
    /// when written into the weight; the f32 master accumulates them, and the weight follows it.
    #[test]
    fn small_updates_of_a_bf16_weight_accumulate_in_its_master() {
        use candle_core::Device;
        let config = GrpoConfig::default();
        let ones = Tensor::ones(64, DType::BF16, &Device::Cpu).unwrap();
        // What the update did before masters were kept: written straight into the weight.
        let direct = Var::from_tensor(&ones).unwrap();
        let (mut m, mut v) = (direct.zeros_like().unwrap(), direct.zeros_like().unwrap());
        let weight = Var::from_tensor(&ones).unwrap();
        let mut adam = AdamW::new(vec![("w".into(), weight.clone())], &config);
        for _ in 0..8 {
            adam.step(&[Some(ones.clone())], 1e-3, 1.0).unwrap();
            let constants = Constants::new(&adam, 1e-3);
            (m, v) = update_tensors(&direct, &ones, m, v, &constants).unwrap();
        }
        let values = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        assert!(
            values(&direct).iter().all(|&w| w == 1.0),
            "the direct update moved the weight: the test shows nothing"
        );
        let state: HashMap<String, Tensor> = adam
            .state()
            .iter()
            .map(|(name, tensor)| (name.clone(), tensor.to_tensor().unwrap()))
            .collect();
        let master = values(&state["w.master"]);
        for &x in &master {
            assert!((x - (1.0 - 8e-3)).abs() < 1e-5, "master {x}");
        }
        // 0.992 rounds to the bf16 value 0.9921875 (spacing 2⁻⁸ under 1).
        assert!(values(&weight).iter().all(|&w| w == 0.992_187_5));
        assert_eq!(state["w.exp_avg"].dtype(), DType::F32);

        // A resumed optimizer continues from the master, bit for bit.
        let resumed_weight = Var::from_tensor(weight.as_tensor()).unwrap();
        let mut resumed = AdamW::new(vec![("w".into(), resumed_weight.clone())], &config);
        resumed.load_state(adam.step, &state).unwrap();
        for _ in 0..3 {
            adam.step(&[Some(ones.clone())], 1e-3, 1.0).unwrap();
            resumed.step(&[Some(ones.clone())], 1e-3, 1.0).unwrap();
        }
        let bits = |t: &Tensor| -> Vec<u32> { values(t).iter().map(|x| x.to_bits()).collect() };
        assert_eq!(bits(&weight), bits(&resumed_weight));
        let master_of = |adam: &AdamW| adam.state()[0].1.to_tensor().unwrap();
        assert_eq!(bits(&master_of(&adam)), bits(&master_of(&resumed)));
    }

    #[test]
    fn the_norm_adds_its_chunks_in_order_whatever_the_threads_do() {
        use candle_core::Device;
        let values: Vec<f32> = (0..40 * CHUNK)
            .map(|i| ((i as f32) * 0.618).sin() * 10f32.powi((i % 9) as i32 - 4))
            .collect();
        let in_order = values.chunks(CHUNK).map(sum_of_squares).sum::<f64>().sqrt();
        let plain = values
            .iter()
            .map(|&g| (g as f64) * (g as f64))
            .sum::<f64>()
            .sqrt();
        assert!((in_order - plain).abs() <= 1e-12 * plain);
        let grad = Tensor::from_vec(values, 40 * CHUNK, &Device::Cpu).unwrap();
        for _ in 0..20 {
            let norm = grad_norm(&[Some(grad.clone())]).unwrap();
            assert_eq!(norm.to_bits(), in_order.to_bits());
        }
    }
}
