//! Rotary position embeddings: inverse frequencies (default, linear, llama3, LongRoPE, YaRN), per-row
//! tables, and the rotation (of whole heads, or of their first dimensions for a partial rotary
//! embedding).

use super::*;

/// Inverse rotary frequencies of heads of `dim` dimensions for base `theta`, rescaled by `scaling`
/// (transformers' `ROPE_INIT_FUNCTIONS`).
pub(super) fn inverse_frequencies(dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    let base: Vec<f32> = (0..dim)
        .step_by(2)
        .map(|i| 1.0 / (theta as f32).powf(i as f32 / dim as f32))
        .collect();
    match *scaling {
        RopeScaling::None => base,
        RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
            truncate,
            ..
        } => yarn(
            dim,
            theta,
            factor,
            (beta_fast, beta_slow),
            original_max_position_embeddings,
            truncate,
        ),
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor as f32).collect(),
        // The short factors; `Rope::long` holds the long ones.
        RopeScaling::LongRope {
            ref short_factor, ..
        } => base
            .iter()
            .zip(short_factor)
            .map(|(f, factor)| f / *factor as f32)
            .collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old_context = original_max_position_embeddings as f64;
            let low_freq_wavelen = old_context / low_freq_factor;
            let high_freq_wavelen = old_context / high_freq_factor;
            base.iter()
                .map(|&freq| {
                    let freq = freq as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    let scaled = if wavelen > low_freq_wavelen {
                        freq / factor
                    } else {
                        freq
                    };
                    let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                    if medium {
                        let smooth = (old_context / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        ((1.0 - smooth) * scaled / factor + smooth * scaled) as f32
                    } else {
                        scaled as f32
                    }
                })
                .collect()
        }
    }
}

/// YaRN's inverse frequencies in f32, operation by operation as `_compute_yarn_parameters` computes
/// them: each blended between extrapolation (`1 / pos`) and interpolation (`1 / (factor · pos)`) by a
/// linear ramp over the dimensions between the corrections of `beta_fast` and `beta_slow` rotations.
fn yarn(
    dim: usize,
    theta: f64,
    factor: f64,
    (beta_fast, beta_slow): (f64, f64),
    original: usize,
    truncate: bool,
) -> Vec<f32> {
    let correction = |rotations: f64| {
        dim as f64 * (original as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        // transformers' guard against a zero-width ramp.
        high += 0.001;
    }
    (0..dim)
        .step_by(2)
        .enumerate()
        .map(|(i, d)| {
            let position_frequency = (theta as f32).powf(d as f32 / dim as f32);
            let extrapolation = 1.0 / position_frequency;
            let interpolation = 1.0 / (factor as f32 * position_frequency);
            let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
            let kept = 1.0 - ramp;
            interpolation * (1.0 - kept) + extrapolation * kept
        })
        .collect()
}

#[derive(Debug, Clone)]
pub(super) struct Rope {
    inverse_frequencies: Tensor,
    /// LongRoPE's frequencies past `original_max_position_embeddings`, and that length.
    long: Option<(Tensor, usize)>,
    /// What cos and sin are multiplied by (LongRoPE's and YaRN's attention factor; 1 otherwise).
    attention_factor: f64,
}

impl Rope {
    /// The RoPE of `dim` rotated dimensions, base `theta`, rescaled by `scaling`.
    pub(super) fn new(
        dim: usize,
        theta: f64,
        scaling: &RopeScaling,
        device: &Device,
    ) -> Result<Rope> {
        let short = Tensor::new(inverse_frequencies(dim, theta, scaling), device)?;
        let (long, attention_factor) = match scaling {
            RopeScaling::LongRope {
                long_factor,
                original_max_position_embeddings,
                attention_factor,
                ..
            } => {
                if long_factor.len() * 2 != dim {
                    candle_core::bail!(
                        "longrope has {} long factors for {dim} rotated dimensions",
                        long_factor.len()
                    );
                }
                let long = RopeScaling::LongRope {
                    short_factor: long_factor.clone(),
                    long_factor: long_factor.clone(),
                    original_max_position_embeddings: *original_max_position_embeddings,
                    attention_factor: *attention_factor,
                };
                let long = Tensor::new(inverse_frequencies(dim, theta, &long), device)?;
                (
                    Some((long, *original_max_position_embeddings)),
                    *attention_factor,
                )
            }
            RopeScaling::Yarn {
                attention_factor, ..
            } => (None, *attention_factor),
            _ => (None, 1.0),
        };
        Ok(Rope {
            inverse_frequencies: short,
            long,
            attention_factor,
        })
    }

    /// LongRoPE's original context: a sequence longer than this takes the long factors.
    pub(super) fn original_context(&self) -> Option<usize> {
        self.long.as_ref().map(|(_, original)| *original)
    }

    /// `cos` and `sin` of shape `[B, T, rotated / 2]` for `positions` `[B, T]` (u32). With LongRoPE the
    /// long frequencies serve the rows whose sequence is longer than the original context, as
    /// transformers' `longrope_frequency_update` decides for each forward pass: row `b`'s sequence is
    /// `lengths[b]` long, or without `lengths` every row's is the pass's largest position + 1.
    pub(super) fn tables(
        &self,
        positions: &Tensor,
        lengths: Option<&[usize]>,
    ) -> Result<(Tensor, Tensor)> {
        let frequencies = match (&self.long, lengths) {
            (None, _) => self.inverse_frequencies.reshape((1, 1, ()))?,
            (Some((long, original)), None) => {
                let last = positions
                    .max_all()?
                    .to_dtype(DType::U32)?
                    .to_scalar::<u32>()?;
                match last as usize + 1 > *original {
                    true => long.reshape((1, 1, ()))?,
                    false => self.inverse_frequencies.reshape((1, 1, ()))?,
                }
            }
            (Some((long, original)), Some(lengths)) => {
                // Row b's frequencies: row 0 (short) or row 1 (long) of the two sets.
                let both = Tensor::stack(&[&self.inverse_frequencies, long], 0)?;
                let picks: Vec<u32> = lengths
                    .iter()
                    .map(|&length| u32::from(length > *original))
                    .collect();
                both.index_select(&Tensor::new(picks.as_slice(), both.device())?, 0)?
                    .unsqueeze(1)?
            }
        };
        let angles = positions
            .to_dtype(DType::F32)?
            .unsqueeze(2)?
            .broadcast_mul(&frequencies)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        if self.attention_factor == 1.0 {
            return Ok((cos, sin));
        }
        Ok((
            (cos * self.attention_factor)?,
            (sin * self.attention_factor)?,
        ))
    }
}

/// Rotates `xs` `[B, heads, T, head_dim]` by per-row tables `[B, T, rotated / 2]` (rotate-half layout
/// over the first `rotated` dimensions of each head; the rest pass unrotated, as Phi-3's partial
/// rotary embedding leaves them).
pub(crate) fn apply_rope(xs: &Tensor, cos: &Tensor, sin: &Tensor, ops: Ops) -> Result<Tensor> {
    let (head_dim, rotated) = (xs.dim(D::Minus1)?, cos.dim(D::Minus1)? * 2);
    if rotated < head_dim {
        let turned = rotate(
            &xs.narrow(D::Minus1, 0, rotated)?.contiguous()?,
            cos,
            sin,
            ops,
        )?;
        let kept = xs.narrow(D::Minus1, rotated, head_dim - rotated)?;
        // Concatenating along the last axis leaves a strided layout; the products need rows.
        return Tensor::cat(&[&turned, &kept], D::Minus1)?.contiguous();
    }
    rotate(xs, cos, sin, ops)
}

/// [`apply_rope`] over every dimension.
pub(super) fn rotate(xs: &Tensor, cos: &Tensor, sin: &Tensor, ops: Ops) -> Result<Tensor> {
    if crate::kernels::kernel::takes(xs, &[cos, sin]) {
        return crate::kernels::rope::rope(xs, cos, sin, ops);
    }
    match ops {
        Ops::Fast | Ops::Invariant => candle_nn::rotary_emb::rope(&xs.contiguous()?, cos, sin),
        Ops::Differentiable => {
            let cos = Tensor::cat(&[cos, cos], D::Minus1)?.unsqueeze(1)?;
            let sin = Tensor::cat(&[sin, sin], D::Minus1)?.unsqueeze(1)?;
            let half = xs.dim(D::Minus1)? / 2;
            let rotated = Tensor::cat(
                &[
                    &xs.narrow(D::Minus1, half, half)?.neg()?,
                    &xs.narrow(D::Minus1, 0, half)?,
                ],
                D::Minus1,
            )?;
            xs.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
        }
    }
}
