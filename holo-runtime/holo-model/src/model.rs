//! The decoder shared by Qwen2, Qwen3 and Llama: plain structs per layer, weights named as in Hugging
//! Face checkpoints. The families differ only by what [`ModelConfig`] says (biases, q/k norms, RoPE).
//!
//! One set of weights serves two paths. Sampling ([`Ops::Fast`]) uses candle's fused kernels for RMSNorm,
//! RoPE and softmax, which have no backward. Training ([`Ops::Differentiable`]) builds the same functions
//! from basic tensor ops, so every weight receives its gradient; [`Model::trainable`] moves the weights
//! into [`Var`]s for an optimizer.
//!
//! Every row has its own positions (its real tokens counted from 0), so rows padded differently, or
//! resuming from caches of different lengths, rotate exactly as they would alone.

use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::VarBuilder;

use super::config::{Activation, LayerSpec, ModelConfig, NormPlacement, QkNorm, RopeScaling};
use super::dispatch::{self, Operands, Product};
pub use super::layout::positions_from_mask;
use super::layout::{attention_mask, window_mask, Layout};
pub use crate::kernels::kernel::{Ops, Result};

#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    /// A low-rank update added to the output, trained while `weight` stays frozen.
    pub lora: Option<Lora>,
}

/// LoRA (Hu et al., 2021) as PEFT implements it: `y += scale · dropout(x) Aᵀ Bᵀ`, `A` `[rank, in]`,
/// `B` `[out, rank]`, `scale = alpha / rank`; `B` starts at zero so the adapted model starts as the base
/// one.
#[derive(Debug, Clone)]
pub struct Lora {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
    /// Dropout on the adapter's input, active only in differentiable passes while its seed is set.
    pub dropout: Option<Dropout>,
}

/// LoRA dropout (PEFT's `lora_dropout`): each differentiable forward pass draws its mask from the
/// model's current dropout seed and the adapter's own number, so that a pass run twice with the same seed
/// (activation recomputation) drops the same inputs, and a run repeated from a checkpoint draws the same
/// masks.
#[derive(Debug, Clone)]
pub struct Dropout {
    pub p: f64,
    /// This adapter's number in the model.
    id: u64,
    /// Shared by every adapter of a model; 0 turns dropout off.
    seed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Dropout {
    /// The factors the adapter's input `xs` is multiplied by (0, or `1 / (1 - p)` for a kept entry), or
    /// `None` when the seed is 0; the backward multiplies the input's gradient by the same.
    pub(super) fn mask(&self, xs: &Tensor) -> Result<Option<Tensor>> {
        use rand::{Rng, SeedableRng};

        let seed = self.seed.load(std::sync::atomic::Ordering::Relaxed);
        if seed == 0 || self.p == 0.0 {
            return Ok(None);
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
            seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ self.id,
        );
        let keep = 1.0 / (1.0 - self.p);
        let mask: Vec<f32> = (0..xs.elem_count())
            .map(|_| {
                if rng.random::<f64>() < self.p {
                    0.0
                } else {
                    keep as f32
                }
            })
            .collect();
        Ok(Some(
            Tensor::from_vec(mask, xs.shape(), xs.device())?.to_dtype(xs.dtype())?,
        ))
    }
}

/// Which projections get adapters, and their size.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    /// Projection names: `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`.
    pub targets: Vec<String>,
    pub seed: u64,
    /// Dropout on the adapters' input in training passes (see [`Dropout`]); 0 for none.
    pub dropout: f64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 8,
            alpha: 16.0,
            targets: ["q_proj", "k_proj", "v_proj", "o_proj"]
                .map(String::from)
                .to_vec(),
            seed: 0,
            dropout: 0.0,
        }
    }
}

/// Every projection a LoRA adapter can target, in layer order.
pub const PROJECTIONS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// The fused projections (Phi-3's), which LoRA can target by their own names or by their parts'.
pub const FUSED_PROJECTIONS: [(&str, &[&str]); 2] = [
    ("qkv_proj", &["q_proj", "k_proj", "v_proj"]),
    ("gate_up_proj", &["gate_proj", "up_proj"]),
];

/// Whether LoRA `targets` name the projection `short` (`q_proj`, …): by its name, or, for a fused
/// projection, by the name of any of its parts (so the usual targets adapt Phi-3's `qkv_proj`).
pub fn targets(targets: &[String], short: &str) -> bool {
    targets.iter().any(|target| {
        target == short
            || FUSED_PROJECTIONS
                .iter()
                .any(|(fused, parts)| *fused == short && parts.contains(&target.as_str()))
    })
}

impl Linear {
    fn load(vb: VarBuilder, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        let weight = vb.get((out_dim, in_dim), "weight")?;
        let bias = if bias {
            Some(vb.get(out_dim, "bias")?)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            lora: None,
        })
    }

    /// `xs` is `[.., in]`; the leading dimensions are flattened into one matrix product. With
    /// [`Ops::Fast`], a few rows (decoding) go through our own kernels where they are faster.
    pub fn forward(&self, xs: &Tensor, ops: Ops) -> Result<Tensor> {
        Ok(self.forward_parts(xs, ops)?.0)
    }

    /// [`Linear::forward`], and what its adapter computed on the way (see [`AdapterParts`]).
    pub(super) fn forward_parts(
        &self,
        xs: &Tensor,
        ops: Ops,
    ) -> Result<(Tensor, Option<AdapterParts>)> {
        let dims = xs.dims().to_vec();
        let (leading, in_dim) = dims.split_at(dims.len() - 1);
        let rows: usize = leading.iter().product();
        let flat = xs.reshape((rows, in_dim[0]))?;
        let ys = match dispatch::product(ops, &Operands::of(&flat, &self.weight)) {
            Product::Skinny => crate::kernels::skinny::matmul(&flat, &self.weight)?,
            Product::Weight => crate::kernels::product::matmul(&flat, &self.weight, ops)?,
            Product::Candle => flat.matmul(&self.weight.t()?)?,
        };
        let ys = match &self.bias {
            Some(bias) => ys.broadcast_add(bias)?,
            None => ys,
        };
        let adapter = self.adapter_parts(&flat, ops)?;
        let ys = match (&self.lora, &adapter) {
            (Some(lora), Some(parts)) => {
                let update =
                    (parts.low.matmul(&lora.b.t()?)? * lora.scale)?.to_dtype(ys.dtype())?;
                (ys + update)?
            }
            _ => ys,
        };
        let mut out_dims = leading.to_vec();
        out_dims.push(self.weight.dim(0)?);
        Ok((ys.reshape(out_dims)?, adapter))
    }

    /// The adapter's input and low-rank activations for `flat` `[rows, in]`, `None` without an adapter.
    /// The adapters may be f32 over a bf16 base (see `dispatch::adapter_dtype`): the low-rank path runs
    /// in their type and its output joins the base's in the base's.
    pub(super) fn adapter_parts(&self, flat: &Tensor, ops: Ops) -> Result<Option<AdapterParts>> {
        let Some(lora) = &self.lora else {
            return Ok(None);
        };
        let input = flat.to_dtype(lora.a.dtype())?;
        let keep = match (&lora.dropout, ops) {
            (Some(dropout), Ops::Differentiable) => dropout.mask(&input)?,
            _ => None,
        };
        let input = match &keep {
            Some(keep) => (input * keep)?,
            None => input,
        };
        let low = input.matmul(&lora.a.t()?)?;
        Ok(Some(AdapterParts { input, low, keep }))
    }
}

/// What a LoRA adapter computed in a forward pass, kept for its backward: `input` `[rows, in]` (after
/// dropout, in the adapter's type), `low = input · Aᵀ` `[rows, rank]`, and the dropout factors `keep`.
pub(super) struct AdapterParts {
    pub(super) input: Tensor,
    pub(super) low: Tensor,
    pub(super) keep: Option<Tensor>,
}

#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Tensor,
    eps: f64,
    /// The weight is stored as an offset from one (Gemma's `x̂ · (1 + w)`).
    offset: bool,
}

impl RmsNorm {
    fn load(vb: VarBuilder, size: usize, config: &ModelConfig) -> Result<Self> {
        Ok(RmsNorm {
            weight: vb.get(size, "weight")?,
            eps: config.rms_norm_eps,
            offset: config.variant.norm_offset,
        })
    }

    /// What the normalized input is multiplied by: the weight, or one plus it.
    pub(super) fn scale(&self) -> Result<Tensor> {
        match self.offset {
            true => self.weight.affine(1.0, 1.0),
            false => Ok(self.weight.clone()),
        }
    }

    pub(super) fn forward(&self, xs: &Tensor, ops: Ops) -> Result<Tensor> {
        match ops {
            // One row at a time, each summed in order: the same bits whatever the batch.
            Ops::Fast | Ops::Invariant => {
                candle_nn::ops::rms_norm(&xs.contiguous()?, &self.scale()?, self.eps as f32)
            }
            Ops::Differentiable => Ok(self.forward_parts(xs)?.0),
        }
    }

    /// The differentiable forward, with what its backward reads: the normalized input (before the
    /// weight, in f32 or f64) and each row's root mean square `[.., 1]`.
    pub(super) fn forward_parts(&self, xs: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let dtype = xs.dtype();
        let xs = match dtype {
            DType::F16 | DType::BF16 => xs.to_dtype(DType::F32)?,
            _ => xs.clone(),
        };
        let variance = xs.sqr()?.mean_keepdim(D::Minus1)?;
        let root = (variance + self.eps)?.sqrt()?;
        let normed = xs.broadcast_div(&root)?;
        let out = normed.to_dtype(dtype)?.broadcast_mul(&self.scale()?)?;
        Ok((out, normed, root))
    }
}

/// Inverse rotary frequencies of heads of `dim` dimensions for base `theta`, rescaled by `scaling`
/// (transformers' `ROPE_INIT_FUNCTIONS`).
fn inverse_frequencies(dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    let base: Vec<f32> = (0..dim)
        .step_by(2)
        .map(|i| 1.0 / (theta as f32).powf(i as f32 / dim as f32))
        .collect();
    match *scaling {
        RopeScaling::None => base,
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

#[derive(Debug, Clone)]
struct Rope {
    inverse_frequencies: Tensor,
    /// LongRoPE's frequencies past `original_max_position_embeddings`, and that length.
    long: Option<(Tensor, usize)>,
    /// What cos and sin are multiplied by (LongRoPE's attention factor; 1 otherwise).
    attention_factor: f64,
}

impl Rope {
    /// The RoPE of `dim` rotated dimensions, base `theta`, rescaled by `scaling`.
    fn new(dim: usize, theta: f64, scaling: &RopeScaling, device: &Device) -> Result<Rope> {
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
            _ => (None, 1.0),
        };
        Ok(Rope {
            inverse_frequencies: short,
            long,
            attention_factor,
        })
    }

    /// `cos` and `sin` of shape `[B, T, rotated / 2]` for `positions` `[B, T]` (u32). With LongRoPE the
    /// long frequencies serve a pass whose positions reach past the original context, as transformers'
    /// `longrope_frequency_update` decides per forward pass.
    fn tables(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let frequencies = match &self.long {
            Some((long, original)) => {
                let last = positions
                    .max_all()?
                    .to_dtype(DType::U32)?
                    .to_scalar::<u32>()?;
                if last as usize + 1 > *original {
                    long
                } else {
                    &self.inverse_frequencies
                }
            }
            None => &self.inverse_frequencies,
        };
        let angles = positions
            .to_dtype(DType::F32)?
            .unsqueeze(2)?
            .broadcast_mul(&frequencies.reshape((1, 1, ()))?)?;
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
pub(super) fn apply_rope(xs: &Tensor, cos: &Tensor, sin: &Tensor, ops: Ops) -> Result<Tensor> {
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
fn rotate(xs: &Tensor, cos: &Tensor, sin: &Tensor, ops: Ops) -> Result<Tensor> {
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

/// The attention weights of `xs` over the last axis, computed in f32 for half-precision scores and
/// returned in their type, as transformers computes them (`softmax(..., dtype=torch.float32)`).
pub(super) fn softmax(xs: &Tensor, ops: Ops) -> Result<Tensor> {
    let dtype = xs.dtype();
    let xs = match dtype {
        DType::F16 | DType::BF16 => xs.to_dtype(DType::F32)?,
        _ => xs.clone(),
    };
    let weights = if crate::kernels::kernel::takes(&xs, &[]) {
        crate::kernels::softmax::softmax(&xs, ops)?
    } else {
        match ops {
            Ops::Fast | Ops::Invariant => candle_nn::ops::softmax_last_dim(&xs)?,
            Ops::Differentiable => candle_nn::ops::softmax(&xs, D::Minus1)?,
        }
    };
    weights.to_dtype(dtype)
}

/// Projections of one input whose outputs the layer uses apart: queries, keys and values, or the MLP's
/// gate and up projections. Most families keep one matrix per part (`q_proj`, `k_proj`, `v_proj`);
/// Phi-3 keeps one matrix whose output is the parts side by side (`qkv_proj`, `gate_up_proj`), and is
/// trained (LoRA included) as that one matrix, as PEFT does.
#[derive(Debug, Clone)]
pub struct Split {
    /// The parts' module names and output widths, in order.
    parts: Vec<(&'static str, usize)>,
    /// The fused matrix's module name, when there is one.
    fused: Option<&'static str>,
    /// One per part, or the fused one.
    pub(super) linears: Vec<Linear>,
}

impl Split {
    fn load(
        vb: &VarBuilder,
        in_dim: usize,
        parts: Vec<(&'static str, usize)>,
        fused: Option<&'static str>,
        bias: bool,
    ) -> Result<Self> {
        let linears = match fused {
            Some(name) => {
                let out_dim = parts.iter().map(|(_, width)| width).sum();
                vec![Linear::load(vb.pp(name), in_dim, out_dim, bias)?]
            }
            None => parts
                .iter()
                .map(|&(name, width)| Linear::load(vb.pp(name), in_dim, width, bias))
                .collect::<Result<_>>()?,
        };
        Ok(Split {
            parts,
            fused,
            linears,
        })
    }

    /// The matrices under their module names.
    pub fn named(&self) -> Vec<(&'static str, &Linear)> {
        self.names().into_iter().zip(&self.linears).collect()
    }

    fn named_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        self.names().into_iter().zip(&mut self.linears).collect()
    }

    fn names(&self) -> Vec<&'static str> {
        match self.fused {
            Some(name) => vec![name],
            None => self.parts.iter().map(|(name, _)| *name).collect(),
        }
    }

    /// The part `name` (`q_proj`, …) of a family that keeps it as a matrix of its own.
    pub fn part(&self, name: &str) -> Option<&Linear> {
        self.named()
            .into_iter()
            .find_map(|(part, linear)| (part == name).then_some(linear))
    }

    /// Each part's output for `xs` `[.., in]`.
    pub(super) fn forward(&self, xs: &Tensor, ops: Ops) -> Result<Vec<Tensor>> {
        match self.fused {
            Some(_) => self.cut(&self.linears[0].forward(xs, ops)?),
            None => self
                .linears
                .iter()
                .map(|linear| linear.forward(xs, ops))
                .collect(),
        }
    }

    /// [`Split::forward`], with what each matrix's adapter computed (one entry per matrix).
    pub(super) fn forward_parts(
        &self,
        xs: &Tensor,
        ops: Ops,
    ) -> Result<(Vec<Tensor>, Vec<Option<AdapterParts>>)> {
        let mut outputs = Vec::with_capacity(self.linears.len());
        let mut adapters = Vec::with_capacity(self.linears.len());
        for linear in &self.linears {
            let (ys, adapter) = linear.forward_parts(xs, ops)?;
            outputs.push(ys);
            adapters.push(adapter);
        }
        match self.fused {
            Some(_) => Ok((self.cut(&outputs[0])?, adapters)),
            None => Ok((outputs, adapters)),
        }
    }

    /// A fused output `[.., Σ widths]` cut into the parts' outputs.
    fn cut(&self, ys: &Tensor) -> Result<Vec<Tensor>> {
        let mut offset = 0;
        self.parts
            .iter()
            .map(|&(_, width)| {
                let part = ys.narrow(D::Minus1, offset, width)?;
                offset += width;
                part.contiguous()
            })
            .collect()
    }

    /// The parts' output gradients `[rows, width]` as each matrix's (concatenated for a fused one).
    pub(super) fn join(&self, grads: Vec<Tensor>) -> Result<Vec<Tensor>> {
        match self.fused {
            Some(_) => Ok(vec![Tensor::cat(&grads, D::Minus1)?]),
            None => Ok(grads),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Attention {
    /// The query, key and value projections (`q_proj`, `k_proj`, `v_proj`, or Phi-3's `qkv_proj`).
    pub qkv: Split,
    pub o_proj: Linear,
    /// RMSNorms of the queries and keys, before RoPE, over each head or the whole projection
    /// ([`QkNorm`]).
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub(super) qk_norm: QkNorm,
    /// What the scores `q · k` are multiplied by: `1/√head_dim`, or Gemma's `1/√query_pre_attn_scalar`.
    pub(super) scale: f64,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
}

impl Attention {
    fn load(vb: VarBuilder, config: &ModelConfig) -> Result<Self> {
        let (hidden, head_dim) = (config.hidden_size, config.head_dim);
        let (heads, kv_heads) = (config.num_attention_heads, config.num_key_value_heads);
        Ok(Attention {
            qkv: Split::load(
                &vb,
                hidden,
                vec![
                    ("q_proj", heads * head_dim),
                    ("k_proj", kv_heads * head_dim),
                    ("v_proj", kv_heads * head_dim),
                ],
                config.variant.fused_projections.then_some("qkv_proj"),
                config.qkv_bias,
            )?,
            o_proj: Linear::load(vb.pp("o_proj"), heads * head_dim, hidden, config.o_bias)?,
            q_norm: match config.variant.qk_norm {
                QkNorm::None => None,
                QkNorm::Head => Some(RmsNorm::load(vb.pp("q_norm"), head_dim, config)?),
                QkNorm::Projection => {
                    Some(RmsNorm::load(vb.pp("q_norm"), heads * head_dim, config)?)
                }
            },
            k_norm: match config.variant.qk_norm {
                QkNorm::None => None,
                QkNorm::Head => Some(RmsNorm::load(vb.pp("k_norm"), head_dim, config)?),
                QkNorm::Projection => {
                    Some(RmsNorm::load(vb.pp("k_norm"), kv_heads * head_dim, config)?)
                }
            },
            qk_norm: config.variant.qk_norm,
            scale: 1.0
                / config
                    .variant
                    .query_pre_attn_scalar
                    .unwrap_or(head_dim as f64)
                    .sqrt(),
            heads,
            kv_heads,
            head_dim,
        })
    }

    /// `xs` `[B, T, hidden]`; `mask` `[B, 1, T, S]` additive (0 or -inf) over the `S` keys, cached keys
    /// first.
    fn forward(
        &self,
        xs: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
        mask: &Tensor,
        cache: Option<&mut LayerCache>,
        ops: Ops,
    ) -> Result<Tensor> {
        let (batch, len, _) = xs.dims3()?;
        let heads = |projected: &Tensor, heads: usize, norm: Option<&RmsNorm>| -> Result<Tensor> {
            self.split_heads(projected, (batch, len, heads), norm, ops)
        };
        let [q, k, v]: [Tensor; 3] = self
            .qkv
            .forward(xs, ops)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("three projections".into()))?;
        let q = heads(&q, self.heads, self.q_norm.as_ref())?;
        let k = heads(&k, self.kv_heads, self.k_norm.as_ref())?;
        let v = heads(&v, self.kv_heads, None)?;
        let out = self.attend(&q, &k, &v, rope, mask, cache, ops)?;
        self.o_proj.forward(&out, ops)
    }

    /// A projection's output `[B, T, heads · head_dim]` (or `[B · T, ..]`) as heads
    /// `[B, heads, T, head_dim]`, normalised by `norm` when the family has one (over each head, or over
    /// the whole projection first).
    pub(super) fn split_heads(
        &self,
        projected: &Tensor,
        (batch, len, heads): (usize, usize, usize),
        norm: Option<&RmsNorm>,
        ops: Ops,
    ) -> Result<Tensor> {
        let projected = match (norm, self.qk_norm) {
            (Some(norm), QkNorm::Projection) => norm.forward(projected, ops)?,
            _ => projected.clone(),
        };
        let split = projected.reshape((batch, len, heads, self.head_dim))?;
        let split = match (norm, self.qk_norm) {
            (Some(norm), QkNorm::Head) => norm.forward(&split, ops)?,
            _ => split,
        };
        split.transpose(1, 2)
    }

    /// The attention of queries `q` `[B, heads, T, head_dim]` over the cached keys and values and `k`,
    /// `v` `[B, kv_heads, T, head_dim]` (before rotary, which layers without RoPE skip),
    /// `[B, T, heads * head_dim]` before `o_proj`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
        mask: &Tensor,
        cache: Option<&mut LayerCache>,
        ops: Ops,
    ) -> Result<Tensor> {
        let (batch, _, len, _) = q.dims4()?;
        let (q, k) = match rope {
            Some((cos, sin)) => (apply_rope(q, cos, sin, ops)?, apply_rope(k, cos, sin, ops)?),
            None => (q.clone(), k.contiguous()?),
        };
        let (k, v) = match cache {
            Some(cache) => cache.append(k, v.contiguous()?)?,
            None => (k, v.contiguous()?),
        };
        let scale = self.scale;
        // A decoding step's single query per row visits its own keys faster than the padded products
        // below read every row's padding.
        let decoding = ops == Ops::Fast
            && len == 1
            && q.dtype() == DType::F32
            && crate::kernels::kernel::takes(&q, &[&k, &v, mask]);
        if ops == Ops::Invariant || decoding {
            return crate::kernels::invariant::attention(&q, &k, &v, mask, scale);
        }
        let keys = k.dim(2)?;
        // Query head h reads key head h / group: grouping the query heads of one key head along the
        // sequence axis makes one matrix product per key head, without copying keys.
        let group = self.heads / self.kv_heads;
        let q = q
            .contiguous()?
            .reshape((batch, self.kv_heads, group * len, self.head_dim))?;
        let scores = (q.matmul(&k.t()?)? * scale)?
            .reshape((batch, self.heads, len, keys))?
            .broadcast_add(mask)?;
        let weights = softmax(&scores, ops)?.reshape((batch, self.kv_heads, group * len, keys))?;
        weights
            .matmul(&v)?
            .reshape((batch, self.heads, len, self.head_dim))?
            .transpose(1, 2)?
            .reshape((batch, len, self.heads * self.head_dim))
    }
}

#[derive(Debug, Clone)]
pub struct Mlp {
    /// The gate and up projections (`gate_proj`, `up_proj`, or Phi-3's `gate_up_proj`).
    pub gate_up: Split,
    pub down_proj: Linear,
    pub(super) activation: Activation,
}

impl Mlp {
    fn load(vb: VarBuilder, config: &ModelConfig) -> Result<Self> {
        let (hidden, inner, bias) = (
            config.hidden_size,
            config.intermediate_size,
            config.mlp_bias,
        );
        Ok(Mlp {
            gate_up: Split::load(
                &vb,
                hidden,
                vec![("gate_proj", inner), ("up_proj", inner)],
                config.variant.fused_projections.then_some("gate_up_proj"),
                bias,
            )?,
            down_proj: Linear::load(vb.pp("down_proj"), inner, hidden, bias)?,
            activation: config.variant.activation,
        })
    }

    fn forward(&self, xs: &Tensor, ops: Ops) -> Result<Tensor> {
        let [gate, up]: [Tensor; 2] = self
            .gate_up
            .forward(xs, ops)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("two projections".into()))?;
        let gate = self.activate(&gate, ops)?;
        self.down_proj.forward(&(gate * up)?, ops)
    }

    /// The gate's activation.
    pub(super) fn activate(&self, gate: &Tensor, ops: Ops) -> Result<Tensor> {
        match (self.activation, ops) {
            (Activation::Silu, _) => gate.silu(),
            // candle's `gelu` is the tanh approximation, as `gelu_pytorch_tanh`; its backward rounds
            // the constants to six digits, so training builds it from ops with exact derivatives.
            (Activation::GeluTanh, Ops::Fast | Ops::Invariant) => gate.gelu(),
            (Activation::GeluTanh, Ops::Differentiable) => {
                let root = (2.0 / std::f64::consts::PI).sqrt();
                let inner = ((gate + ((gate.sqr()? * gate)? * 0.044715)?)? * root)?;
                (gate * 0.5)? * (inner.tanh()? + 1.0)?
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub self_attn: Attention,
    pub mlp: Mlp,
    /// Before attention (none in OLMo 2 and 3).
    pub input_layernorm: Option<RmsNorm>,
    /// Before the MLP with [`NormPlacement::Pre`], on attention's output otherwise.
    pub post_attention_layernorm: RmsNorm,
    /// Before the MLP (Gemma 3).
    pub pre_feedforward_layernorm: Option<RmsNorm>,
    /// On the MLP's output (OLMo 2 and 3, Gemma 3).
    pub post_feedforward_layernorm: Option<RmsNorm>,
    pub(super) placement: NormPlacement,
    /// Its attention window and whether it rotates ([`ModelConfig::layers`]).
    pub spec: LayerSpec,
}

/// A layer's norms by what they normalise: attention's input and output, the MLP's input and output.
pub(super) struct LayerNorms<'a> {
    pub(super) attention_input: Option<&'a RmsNorm>,
    pub(super) attention_output: Option<&'a RmsNorm>,
    pub(super) mlp_input: Option<&'a RmsNorm>,
    pub(super) mlp_output: Option<&'a RmsNorm>,
}

impl DecoderLayer {
    /// A copy whose weights, biases, norms and adapters share this layer's storage but are not tracked
    /// by autograd.
    pub(super) fn detached(&self) -> DecoderLayer {
        let mut layer = self.clone();
        let attention = &mut layer.self_attn;
        for norm in [
            layer.input_layernorm.as_mut(),
            Some(&mut layer.post_attention_layernorm),
            layer.pre_feedforward_layernorm.as_mut(),
            layer.post_feedforward_layernorm.as_mut(),
            attention.q_norm.as_mut(),
            attention.k_norm.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            norm.weight = norm.weight.detach();
        }
        for (_, linear) in Model::linears_mut(&mut layer.self_attn, &mut layer.mlp) {
            linear.weight = linear.weight.detach();
            linear.bias = linear.bias.as_ref().map(Tensor::detach);
            if let Some(lora) = &mut linear.lora {
                lora.a = lora.a.detach();
                lora.b = lora.b.detach();
            }
        }
        layer
    }

    /// The layer's norms by what they normalise, as its family places them.
    pub(super) fn norms(&self) -> LayerNorms<'_> {
        let post_attention = Some(&self.post_attention_layernorm);
        let (attention_output, mlp_input) = match self.placement {
            NormPlacement::Pre => (None, post_attention),
            NormPlacement::Post => (post_attention, None),
            NormPlacement::Sandwich => (post_attention, self.pre_feedforward_layernorm.as_ref()),
        };
        LayerNorms {
            attention_input: self.input_layernorm.as_ref(),
            attention_output,
            mlp_input,
            mlp_output: self.post_feedforward_layernorm.as_ref(),
        }
    }

    fn load(vb: VarBuilder, config: &ModelConfig, spec: LayerSpec) -> Result<Self> {
        let hidden = config.hidden_size;
        let placement = config.variant.norms;
        let norm = |name: &str, present: bool| -> Result<Option<RmsNorm>> {
            present
                .then(|| RmsNorm::load(vb.pp(name), hidden, config))
                .transpose()
        };
        Ok(DecoderLayer {
            spec,
            placement,
            input_layernorm: norm("input_layernorm", placement != NormPlacement::Post)?,
            pre_feedforward_layernorm: norm(
                "pre_feedforward_layernorm",
                placement == NormPlacement::Sandwich,
            )?,
            post_feedforward_layernorm: norm(
                "post_feedforward_layernorm",
                placement != NormPlacement::Pre,
            )?,
            self_attn: Attention::load(vb.pp("self_attn"), config)?,
            mlp: Mlp::load(vb.pp("mlp"), config)?,
            post_attention_layernorm: RmsNorm::load(
                vb.pp("post_attention_layernorm"),
                hidden,
                config,
            )?,
        })
    }

    pub(super) fn forward(
        &self,
        xs: &Tensor,
        frame: &Frame,
        cache: Option<&mut LayerCache>,
        ops: Ops,
    ) -> Result<Tensor> {
        let norms = self.norms();
        let attended = self.self_attn.forward(
            &norm(norms.attention_input, xs, ops)?,
            frame.rope(self.spec),
            frame.mask(self.spec),
            cache,
            ops,
        )?;
        self.finish(xs, &attended, ops)
    }

    /// The rest of the layer after attention: `attended` (after `o_proj`) normalised where the family
    /// does, added to the input `xs`, then the MLP and its residual.
    pub(super) fn finish(&self, xs: &Tensor, attended: &Tensor, ops: Ops) -> Result<Tensor> {
        let norms = self.norms();
        let xs = (xs + norm(norms.attention_output, attended, ops)?)?;
        let mlp = self.mlp.forward(&norm(norms.mlp_input, &xs, ops)?, ops)?;
        xs + norm(norms.mlp_output, &mlp, ops)?
    }
}

/// `xs` through `norm`, or unchanged without one.
fn norm(norm: Option<&RmsNorm>, xs: &Tensor, ops: Ops) -> Result<Tensor> {
    match norm {
        Some(norm) => norm.forward(xs, ops),
        None => Ok(xs.clone()),
    }
}

/// Keys and values of one layer, `[B, kv_heads, S, head_dim]`.
#[derive(Debug, Default)]
pub struct LayerCache {
    keys_values: Option<(Tensor, Tensor)>,
    /// Buffers `[B, kv_heads, capacity, head_dim]` whose first `S` columns are `keys_values` (views of
    /// them), so that a decoding step writes its column in place: concatenating copied the whole cache
    /// at every step, for every layer. Only this cache writes into them; a clone starts without.
    /// [`KvCache::capacity`] counts them.
    room: Option<(Tensor, Tensor)>,
}

impl Clone for LayerCache {
    fn clone(&self) -> Self {
        LayerCache {
            keys_values: self.keys_values.clone(),
            room: None,
        }
    }
}

impl LayerCache {
    fn append(&mut self, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let joined = match self.keys_values.take() {
            None => (k.contiguous()?, v.contiguous()?),
            // A differentiable pass keeps its graph through the cached keys: no writes in place. (On a
            // GPU, where nothing here has been measured, the cache concatenates too.)
            Some((old_k, old_v)) if k.track_op() || v.track_op() || !k.device().is_cpu() => {
                self.room = None;
                (
                    Tensor::cat(&[&old_k, &k], 2)?,
                    Tensor::cat(&[&old_v, &v], 2)?,
                )
            }
            Some((old_k, old_v)) => self.write_in_place((&old_k, &old_v), (&k, &v))?,
        };
        self.keys_values = Some(joined.clone());
        Ok(joined)
    }

    /// `old` followed by `new`, as views of the buffers, which `new` is written into (grown first when
    /// they have no room for it).
    fn write_in_place(
        &mut self,
        (old_k, old_v): (&Tensor, &Tensor),
        (k, v): (&Tensor, &Tensor),
    ) -> Result<(Tensor, Tensor)> {
        let cached = old_k.dim(2)?;
        let needed = cached + k.dim(2)?;
        let (room_k, room_v) = match self.room.take() {
            Some((room_k, room_v)) if room_k.dim(2)? >= needed => (room_k, room_v),
            _ => {
                // Room for an eighth more (at least 16 columns): a sequence's cache is copied once
                // every `needed / 8` steps instead of at every step, and no more than an eighth of it
                // is allocated unused.
                let capacity = (needed + needed / 8).next_multiple_of(16);
                let grown = |old: &Tensor| -> Result<Tensor> {
                    let (batch, heads, _, dim) = old.dims4()?;
                    let room =
                        Tensor::zeros((batch, heads, capacity, dim), old.dtype(), old.device())?;
                    room.slice_set(&old.contiguous()?, 2, 0)?;
                    Ok(room)
                };
                (grown(old_k)?, grown(old_v)?)
            }
        };
        room_k.slice_set(&k.contiguous()?, 2, cached)?;
        room_v.slice_set(&v.contiguous()?, 2, cached)?;
        let joined = (room_k.narrow(2, 0, needed)?, room_v.narrow(2, 0, needed)?);
        self.room = Some((room_k, room_v));
        Ok(joined)
    }

    /// Replaces the cached keys and values (the buffers no longer hold them).
    fn set(&mut self, keys_values: Option<(Tensor, Tensor)>) {
        self.keys_values = keys_values;
        self.room = None;
    }

    /// Keeps the given rows, in that order, with the buffers' spare columns when there are buffers.
    fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        let Some((k, v)) = self.keys_values.take() else {
            return Ok(());
        };
        match self.room.take() {
            Some((room_k, room_v)) => {
                let cached = k.dim(2)?;
                let (room_k, room_v) =
                    (room_k.index_select(rows, 0)?, room_v.index_select(rows, 0)?);
                self.keys_values =
                    Some((room_k.narrow(2, 0, cached)?, room_v.narrow(2, 0, cached)?));
                self.room = Some((room_k, room_v));
            }
            None => self.set(Some((k.index_select(rows, 0)?, v.index_select(rows, 0)?))),
        }
        Ok(())
    }
}

/// Keys and values of one sequence, per layer `[1, kv_heads, n, head_dim]`.
pub type SequenceCache = Vec<(Tensor, Tensor)>;

/// One batch of [`Model::forward_segments`]: token ids and positions `[B, T]`, the key mask over its
/// cached columns and the `T` new ones, and its cache.
pub struct Segment<'c> {
    pub input_ids: Tensor,
    pub positions: Tensor,
    pub key_mask: Tensor,
    pub cache: &'c mut KvCache,
}

/// The key/value cache of a batch, one entry per layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerCache>,
}

impl KvCache {
    pub fn new(config: &ModelConfig) -> Self {
        KvCache {
            layers: vec![LayerCache::default(); config.num_hidden_layers],
        }
    }

    /// Columns allocated per row: [`KvCache::len`] and the spare columns that decoding steps write into.
    pub fn capacity(&self) -> usize {
        self.layers
            .first()
            .and_then(|layer| layer.room.as_ref().or(layer.keys_values.as_ref()))
            .map_or(0, |(keys, _)| keys.dim(2).unwrap_or(0))
    }

    /// Cached positions (columns).
    pub fn len(&self) -> usize {
        self.layers
            .first()
            .and_then(|layer| layer.keys_values.as_ref())
            .map_or(0, |(k, _)| k.dim(2).unwrap_or(0))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts the cache from earlier sequences: row `b` gets `reused[b]`'s keys and values (each layer
    /// `[1, kv_heads, n, head_dim]`), right-aligned in `width` columns (zeros before, masked by the caller),
    /// or only zeros.
    pub fn prefill(
        &mut self,
        reused: &[Option<(usize, SequenceCache)>],
        width: usize,
        model: &Model,
    ) -> Result<()> {
        let config = &model.config;
        let shape = |n: usize| (1, config.num_key_value_heads, n, config.head_dim);
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let mut keys = Vec::with_capacity(reused.len());
            let mut values = Vec::with_capacity(reused.len());
            for row in reused {
                let (length, k, v) = match row {
                    Some((length, layers)) => (*length, Some(&layers[l].0), Some(&layers[l].1)),
                    None => (0, None, None),
                };
                let zeros = Tensor::zeros(shape(width - length), model.dtype(), model.device())?;
                let aligned = |part: Option<&Tensor>| match part {
                    Some(part) if length < width => Tensor::cat(&[&zeros, part], 2),
                    Some(part) => Ok(part.clone()),
                    None => Ok(zeros.clone()),
                };
                keys.push(aligned(k)?);
                values.push(aligned(v)?);
            }
            layer.set(Some((Tensor::cat(&keys, 0)?, Tensor::cat(&values, 0)?)));
        }
        Ok(())
    }

    /// Row `row`'s keys and values at the columns its `key_mask` marks real, per layer
    /// `[1, kv_heads, n, head_dim]`.
    pub fn row(&self, row: usize, key_mask: &[u8]) -> Result<SequenceCache> {
        let columns: Vec<u32> = (0..key_mask.len() as u32)
            .filter(|&column| key_mask[column as usize] != 0)
            .collect();
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let Some((k, v)) = &layer.keys_values else {
                candle_core::bail!("the cache holds nothing yet");
            };
            let columns = Tensor::new(columns.as_slice(), k.device())?;
            let pick = |t: &Tensor| -> Result<Tensor> {
                t.narrow(0, row, 1)?
                    .contiguous()?
                    .index_select(&columns, 2)?
                    .contiguous()
            };
            layers.push((pick(k)?, pick(v)?));
        }
        Ok(layers)
    }

    /// Adds `other`'s rows after this cache's, right-aligned: the narrower of the two gets zero columns in
    /// front (which the callers' key masks must mark as padding).
    pub fn append_rows(&mut self, other: KvCache) -> Result<()> {
        let (width, other_width) = (self.len(), other.len());
        for (layer, other) in self.layers.iter_mut().zip(other.layers) {
            let joined = match (layer.keys_values.take(), other.keys_values) {
                (None, theirs) => theirs,
                (ours, None) => ours,
                (Some((k, v)), Some((other_k, other_v))) => {
                    let front = |t: Tensor, n: usize| -> Result<Tensor> {
                        if n == 0 {
                            return Ok(t);
                        }
                        let (b, heads, _, dim) = t.dims4()?;
                        let zeros = Tensor::zeros((b, heads, n, dim), t.dtype(), t.device())?;
                        Tensor::cat(&[&zeros, &t], 2)
                    };
                    let pad = other_width.saturating_sub(width);
                    let other_pad = width.saturating_sub(other_width);
                    Some((
                        Tensor::cat(&[front(k, pad)?, front(other_k, other_pad)?], 0)?,
                        Tensor::cat(&[front(v, pad)?, front(other_v, other_pad)?], 0)?,
                    ))
                }
            };
            layer.set(joined);
        }
        Ok(())
    }

    /// Drops the first `columns` columns of every row (padding that no row needs any more).
    pub fn drop_front(&mut self, columns: usize) -> Result<()> {
        if columns == 0 {
            return Ok(());
        }
        for layer in &mut self.layers {
            if let Some((k, v)) = layer.keys_values.take() {
                let kept = k.dim(2)? - columns;
                layer.set(Some((
                    k.narrow(2, columns, kept)?,
                    v.narrow(2, columns, kept)?,
                )));
            }
        }
        Ok(())
    }

    /// Keeps only the given rows of the batch, in that order.
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        for layer in &mut self.layers {
            layer.select_rows(rows)?;
        }
        Ok(())
    }
}

/// A causal language model of one of the families of [`crate::config::Arch`].
#[derive(Debug, Clone)]
pub struct Model {
    pub config: ModelConfig,
    pub embed_tokens: Tensor,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    /// `None` when the output projection is tied to `embed_tokens`.
    pub lm_head: Option<Tensor>,
    rope: Rope,
    /// The windowed layers' RoPE, when it is not the others'
    /// ([`crate::config::Variant::local_rope`]).
    local_rope: Option<Rope>,
}

impl Model {
    /// Builds the model from Hugging Face tensor names under `vb` (`model.*`, `lm_head.weight`).
    pub fn load(vb: VarBuilder, config: &ModelConfig) -> Result<Self> {
        let inner = vb.pp("model");
        let embed_tokens = inner.get(
            (config.vocab_size, config.hidden_size),
            "embed_tokens.weight",
        )?;
        if config.layers.len() != config.num_hidden_layers {
            candle_core::bail!(
                "the config describes {} layers for num_hidden_layers {}",
                config.layers.len(),
                config.num_hidden_layers
            );
        }
        let layers = config
            .layers
            .iter()
            .enumerate()
            .map(|(i, &spec)| DecoderLayer::load(inner.pp(format!("layers.{i}")), config, spec))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(inner.pp("norm"), config.hidden_size, config)?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(vb.get((config.vocab_size, config.hidden_size), "lm_head.weight")?)
        };
        let rotated = config.variant.rotary_dim.unwrap_or(config.head_dim);
        let rope =
            |theta: f64, scaling: &RopeScaling| Rope::new(rotated, theta, scaling, vb.device());
        let model = Model {
            config: config.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope: rope(config.rope_theta, &config.rope_scaling)?,
            local_rope: config
                .variant
                .local_rope
                .as_ref()
                .map(|(theta, scaling)| rope(*theta, scaling))
                .transpose()?,
        };
        if model.embed_tokens.dtype() == DType::BF16 && model.device().is_cpu() {
            // bf16 weights with f32 arithmetic (see `bf16`): the vectors (norms, biases) in f32.
            return model.map_weights(|_, tensor| match tensor.rank() {
                1 => tensor.to_dtype(DType::F32),
                _ => Ok(tensor.clone()),
            });
        }
        Ok(model)
    }

    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    /// The precision of the arithmetic: the weights' own, except for bf16 weights on the CPU, which
    /// run in f32.
    pub fn dtype(&self) -> DType {
        self.norm.weight.dtype()
    }

    /// bf16 matrices with f32 arithmetic: a sampling precision, with no backward through the matrix
    /// products.
    fn sampling_only(&self) -> Result<()> {
        if self.embed_tokens.dtype() != self.dtype() {
            candle_core::bail!(
                "this model holds bf16 weights for f32 arithmetic on the CPU, which only samples; load it in f32 to train"
            );
        }
        Ok(())
    }

    /// The type of the logits, log-probabilities and losses: f64 for an f64 model, f32 otherwise (a
    /// half-precision model's logits are cast up).
    pub fn logits_dtype(&self) -> DType {
        match self.dtype() {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }

    /// The projections of a layer under their module names (`self_attn.q_proj`, …; Phi-3's
    /// `self_attn.qkv_proj` and `mlp.gate_up_proj`), in module order.
    pub fn linears(layer: &DecoderLayer) -> Vec<(String, &Linear)> {
        let attention = layer.self_attn.qkv.named().into_iter();
        let attention = attention.chain([("o_proj", &layer.self_attn.o_proj)]);
        let mlp = layer.mlp.gate_up.named().into_iter();
        let mlp = mlp.chain([("down_proj", &layer.mlp.down_proj)]);
        attention
            .map(|(name, linear)| (format!("self_attn.{name}"), linear))
            .chain(mlp.map(|(name, linear)| (format!("mlp.{name}"), linear)))
            .collect()
    }

    fn linears_mut<'a>(
        attention: &'a mut Attention,
        mlp: &'a mut Mlp,
    ) -> Vec<(String, &'a mut Linear)> {
        Self::parts_mut(attention, mlp).0
    }

    /// The projections of a layer under their module names, and its q/k norms (`q_norm`, `k_norm`).
    #[allow(clippy::type_complexity)]
    fn parts_mut<'a>(
        attention: &'a mut Attention,
        mlp: &'a mut Mlp,
    ) -> (
        Vec<(String, &'a mut Linear)>,
        [(&'static str, Option<&'a mut RmsNorm>); 2],
    ) {
        let Attention {
            qkv,
            o_proj,
            q_norm,
            k_norm,
            ..
        } = attention;
        let Mlp {
            gate_up, down_proj, ..
        } = mlp;
        let attention = qkv.named_mut().into_iter().chain([("o_proj", o_proj)]);
        let mlp = gate_up
            .named_mut()
            .into_iter()
            .chain([("down_proj", down_proj)]);
        (
            attention
                .map(|(name, linear)| (format!("self_attn.{name}"), linear))
                .chain(mlp.map(|(name, linear)| (format!("mlp.{name}"), linear)))
                .collect(),
            [("q_norm", q_norm.as_mut()), ("k_norm", k_norm.as_mut())],
        )
    }

    /// Every base weight with its Hugging Face name, in checkpoint order: the one list of the weights.
    fn weights_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let mut named = vec![(
            "model.embed_tokens.weight".to_string(),
            &mut self.embed_tokens,
        )];
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let DecoderLayer {
                self_attn,
                mlp,
                input_layernorm,
                post_attention_layernorm,
                pre_feedforward_layernorm,
                post_feedforward_layernorm,
                placement: _,
                spec: _,
            } = layer;
            let (linears, qk_norms) = Self::parts_mut(self_attn, mlp);
            for (name, linear) in linears {
                named.push((
                    format!("model.layers.{i}.{name}.weight"),
                    &mut linear.weight,
                ));
                if let Some(bias) = &mut linear.bias {
                    named.push((format!("model.layers.{i}.{name}.bias"), bias));
                }
            }
            for (name, norm) in qk_norms {
                if let Some(norm) = norm {
                    named.push((
                        format!("model.layers.{i}.self_attn.{name}.weight"),
                        &mut norm.weight,
                    ));
                }
            }
            for (name, norm) in [
                ("input_layernorm", input_layernorm.as_mut()),
                ("post_attention_layernorm", Some(post_attention_layernorm)),
                (
                    "pre_feedforward_layernorm",
                    pre_feedforward_layernorm.as_mut(),
                ),
                (
                    "post_feedforward_layernorm",
                    post_feedforward_layernorm.as_mut(),
                ),
            ] {
                if let Some(norm) = norm {
                    named.push((format!("model.layers.{i}.{name}.weight"), &mut norm.weight));
                }
            }
        }
        named.push(("model.norm.weight".to_string(), &mut self.norm.weight));
        if let Some(lm_head) = &mut self.lm_head {
            named.push(("lm_head.weight".to_string(), lm_head));
        }
        named
    }

    /// Every base weight with its Hugging Face name (LoRA adapters are in [`Model::named_adapters`]).
    pub fn named_weights(&self) -> Vec<(String, Tensor)> {
        let mut model = self.clone();
        let named = model.weights_mut();
        named
            .into_iter()
            .map(|(name, tensor)| (name, tensor.clone()))
            .collect()
    }

    /// LoRA tensors under PEFT's names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`).
    pub fn named_adapters(&self) -> Vec<(String, &Tensor)> {
        let mut named = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (name, linear) in Self::linears(layer) {
                if let Some(lora) = &linear.lora {
                    let prefix = format!("base_model.model.model.layers.{i}.{name}");
                    named.push((format!("{prefix}.lora_A.weight"), &lora.a));
                    named.push((format!("{prefix}.lora_B.weight"), &lora.b));
                }
            }
        }
        named
    }

    /// A copy with every base weight of type `dtype`, arithmetic included: a bf16 copy computes in
    /// bf16 on any device, which is how a model loaded in bf16 runs on CUDA (on the CPU,
    /// [`super::files::load_model`] keeps a bf16 model's arithmetic in f32, for sampling).
    pub fn to_dtype(&self, dtype: DType) -> Result<Model> {
        self.map_weights(|_, weight| weight.to_dtype(dtype))
    }

    /// A copy with `f(name, weight)` in place of every base weight (adapters stay).
    fn map_weights(&self, mut f: impl FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<Model> {
        let mut model = self.clone();
        for (name, weight) in model.weights_mut() {
            *weight = f(&name, weight)?;
        }
        Ok(model)
    }

    /// A copy with LoRA adapters on the target projections of every layer and its base weights frozen
    /// (detached); returns the adapters' [`Var`]s under PEFT's names. `A` is drawn as PEFT does
    /// (Kaiming-uniform, bound `1/sqrt(in)`), `B` is zero; both in f32 over a bf16 or f16 base
    /// ([`dispatch::adapter_dtype`]).
    pub fn with_lora(&self, config: &LoraConfig) -> Result<(Model, Vec<(String, Var)>)> {
        use rand::{Rng, SeedableRng};

        if config.rank == 0 {
            candle_core::bail!("LoRA rank must be at least 1");
        }
        if !(0.0..1.0).contains(&config.dropout) {
            candle_core::bail!("LoRA dropout must be in [0, 1), got {}", config.dropout);
        }
        let names: Vec<String> = self.layers.first().map_or(Vec::new(), |layer| {
            Self::linears(layer)
                .into_iter()
                .map(|(name, _)| name.rsplit('.').next().unwrap_or(&name).to_string())
                .collect()
        });
        if let Some(unknown) = config.targets.iter().find(|&target| {
            !names
                .iter()
                .any(|name| targets(std::slice::from_ref(target), name))
        }) {
            candle_core::bail!(
                "unknown LoRA target {unknown:?}; the projections of this {} model are {}",
                self.config.arch,
                names.join(", ")
            );
        }
        self.sampling_only()?;
        let mut model = self.detached();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(config.seed);
        let (dtype, device) = (dispatch::adapter_dtype(self.dtype()), self.device().clone());
        let mut vars = Vec::new();
        let seed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        for (i, layer) in model.layers.iter_mut().enumerate() {
            for (name, linear) in Self::linears_mut(&mut layer.self_attn, &mut layer.mlp) {
                let short = name.rsplit('.').next().unwrap_or(&name);
                if !targets(&config.targets, short) {
                    continue;
                }
                let (out_dim, in_dim) = linear.weight.dims2()?;
                let bound = 1.0 / (in_dim as f64).sqrt();
                let a: Vec<f32> = (0..config.rank * in_dim)
                    .map(|_| rng.random_range(-bound..bound) as f32)
                    .collect();
                let a = Var::from_tensor(
                    &Tensor::from_vec(a, (config.rank, in_dim), &device)?.to_dtype(dtype)?,
                )?;
                let b = Var::zeros((out_dim, config.rank), dtype, &device)?;
                let prefix = format!("base_model.model.model.layers.{i}.{name}");
                linear.lora = Some(Lora {
                    a: a.as_tensor().clone(),
                    b: b.as_tensor().clone(),
                    scale: config.alpha / config.rank as f64,
                    dropout: (config.dropout > 0.0).then(|| Dropout {
                        p: config.dropout,
                        id: vars.len() as u64,
                        seed: std::sync::Arc::clone(&seed),
                    }),
                });
                vars.push((format!("{prefix}.lora_A.weight"), a));
                vars.push((format!("{prefix}.lora_B.weight"), b));
            }
        }
        Ok((model, vars))
    }

    /// Whether an adapter drops its inputs (LoRA dropout above 0) in differentiable passes whose seed
    /// is set.
    pub fn has_dropout(&self) -> bool {
        self.layers.iter().any(|layer| {
            Self::linears(layer).iter().any(|(_, linear)| {
                linear
                    .lora
                    .as_ref()
                    .is_some_and(|lora| lora.dropout.is_some())
            })
        })
    }

    /// Seeds the LoRA dropout masks of the differentiable passes that follow (0 turns dropout off); see
    /// [`Dropout`]. Copies of the model ([`Model::detached`]) share the seed.
    pub fn set_dropout_seed(&self, seed: u64) {
        let dropout = self.layers.iter().find_map(|layer| {
            Self::linears(layer)
                .into_iter()
                .find_map(|(_, linear)| linear.lora.as_ref()?.dropout.as_ref())
        });
        if let Some(dropout) = dropout {
            dropout
                .seed
                .store(seed, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A copy whose weights are [`Var`]s (returned with their names, tied weights once), for training.
    pub fn trainable(&self) -> Result<(Model, Vec<(String, Var)>)> {
        self.sampling_only()?;
        let mut vars = Vec::new();
        let model = self.map_weights(|name, tensor| {
            let var = Var::from_tensor(tensor)?;
            let tensor = var.as_tensor().clone();
            vars.push((name.to_string(), var));
            Ok(tensor)
        })?;
        Ok((model, vars))
    }

    /// A copy sharing the weights' storage but not tracked by autograd: what sampling runs on, so the
    /// KV cache does not keep a graph alive. Optimizer updates to the [`Var`]s are visible through it.
    pub fn detached(&self) -> Model {
        let mut model = self.clone();
        model.embed_tokens = model.embed_tokens.detach();
        model.norm.weight = model.norm.weight.detach();
        model.lm_head = model.lm_head.as_ref().map(Tensor::detach);
        for layer in &mut model.layers {
            *layer = layer.detached();
        }
        model
    }

    /// Hidden states `[B, T, hidden]` of `input_ids` `[B, T]` (u32) at `positions` `[B, T]` (u32, each
    /// token's position in its row's sequence). `key_mask` `[B, S]` (u8, 1 for real tokens) covers the
    /// cached columns followed by the `T` new ones; a query sees the real keys up to its own column.
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        key_mask: &Tensor,
        cache: Option<&mut KvCache>,
        ops: Ops,
    ) -> Result<Tensor> {
        let cached = cache.as_ref().map_or(0, |cache| cache.len());
        let frame = self.frame(positions, key_mask, cached)?;
        self.hidden(input_ids, &frame, cache, ops)
    }

    /// Hidden states `[B, T, hidden]` of `input_ids` `[B, T]` (u32) laid out by `layout` (padded rows,
    /// or trees of sequences that share prefixes), without a cache.
    pub fn forward_hidden_in(
        &self,
        input_ids: &Tensor,
        layout: &Layout,
        ops: Ops,
    ) -> Result<Tensor> {
        self.hidden(input_ids, &self.frame_of(layout)?, None, ops)
    }

    /// The final hidden states of `input_ids` through every layer in `frame`.
    fn hidden(
        &self,
        input_ids: &Tensor,
        frame: &Frame,
        mut cache: Option<&mut KvCache>,
        ops: Ops,
    ) -> Result<Tensor> {
        let mut xs = self.embed(input_ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let layer_cache = cache.as_deref_mut().map(|cache| &mut cache.layers[i]);
            xs = layer.forward(&xs, frame, layer_cache, ops)?;
        }
        self.norm.forward(&xs, ops)
    }

    /// Several batches in one sampling pass (`ops` [`Ops::Fast`] or [`Ops::Invariant`]): the position-wise parts (projections, MLP,
    /// norms) run on all their tokens at once, reading each weight once, and attention runs per batch
    /// with its own positions, key mask and cache (see [`Model::forward_hidden`]). A scheduler's decoding
    /// rows and a prompt being prefilled share a pass this way. Returns each batch's final hidden
    /// states `[B, T, hidden]`.
    pub fn forward_segments(&self, segments: &mut [Segment<'_>], ops: Ops) -> Result<Vec<Tensor>> {
        let mut frames = Vec::with_capacity(segments.len());
        let mut shapes = Vec::with_capacity(segments.len());
        let mut embedded = Vec::with_capacity(segments.len());
        for segment in segments.iter() {
            let (batch, len) = segment.input_ids.dims2()?;
            frames.push(self.frame(&segment.positions, &segment.key_mask, segment.cache.len())?);
            embedded.push(
                self.embed(&segment.input_ids)?
                    .reshape((batch * len, self.config.hidden_size))?,
            );
            shapes.push((batch, len));
        }
        let mut xs = Tensor::cat(&embedded, 0)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let attention = &layer.self_attn;
            let normed = norm(layer.norms().attention_input, &xs, ops)?;
            let [q, k, v]: [Tensor; 3] = attention
                .qkv
                .forward(&normed, ops)?
                .try_into()
                .map_err(|_| candle_core::Error::Msg("three projections".into()))?;
            let mut outputs = Vec::with_capacity(segments.len());
            let mut offset = 0;
            for ((segment, frame), &(batch, len)) in segments.iter_mut().zip(&frames).zip(&shapes) {
                let rows = batch * len;
                let heads = |x: &Tensor, heads: usize, norm: Option<&RmsNorm>| -> Result<Tensor> {
                    attention.split_heads(
                        &x.narrow(0, offset, rows)?,
                        (batch, len, heads),
                        norm,
                        ops,
                    )
                };
                let out = attention.attend(
                    &heads(&q, attention.heads, attention.q_norm.as_ref())?,
                    &heads(&k, attention.kv_heads, attention.k_norm.as_ref())?,
                    &heads(&v, attention.kv_heads, None)?,
                    frame.rope(layer.spec),
                    frame.mask(layer.spec),
                    Some(&mut segment.cache.layers[i]),
                    ops,
                )?;
                outputs.push(out.reshape((rows, attention.heads * attention.head_dim))?);
                offset += rows;
            }
            let attended = attention.o_proj.forward(&Tensor::cat(&outputs, 0)?, ops)?;
            xs = layer.finish(&xs, &attended, ops)?;
        }
        let xs = self.norm.forward(&xs, ops)?;
        let mut offset = 0;
        shapes
            .iter()
            .map(|&(batch, len)| {
                let part = xs.narrow(0, offset, batch * len)?;
                offset += batch * len;
                part.reshape((batch, len, self.config.hidden_size))
            })
            .collect()
    }

    /// The embeddings `[B, T, hidden]` of `input_ids` `[B, T]`.
    pub(super) fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (batch, len) = input_ids.dims2()?;
        let embedded = self
            .embed_tokens
            .index_select(&input_ids.flatten_all()?, 0)?
            .reshape((batch, len, self.config.hidden_size))?;
        let embedded = match self.config.variant.scale_embeddings {
            // √hidden rounded to the weights' type, as Gemma's `embed_scale.to(weight.dtype)`.
            true => {
                let scale = Tensor::new(&[(self.config.hidden_size as f64).sqrt()], self.device())?
                    .to_dtype(self.embed_tokens.dtype())?;
                embedded.broadcast_mul(&scale)?
            }
            false => embedded,
        };
        embedded.to_dtype(self.dtype())
    }

    /// What every layer of one forward pass shares: the attention mask and the rotary tables.
    pub(super) fn frame(
        &self,
        positions: &Tensor,
        key_mask: &Tensor,
        cached: usize,
    ) -> Result<Frame> {
        let (batch, len) = positions.dims2()?;
        let mask = attention_mask(key_mask, batch, cached, len, self.dtype())?;
        let key_positions = positions_from_mask(key_mask)?;
        self.frame_with(mask, positions, &key_positions)
    }

    /// The frame of the additive `mask` `[B, 1, T, S]` over keys at `key_positions` `[B, S]`, for
    /// queries at `positions` `[B, T]`: the rotary tables, and the mask of each attention window the
    /// layers use.
    fn frame_with(
        &self,
        mask: Tensor,
        positions: &Tensor,
        key_positions: &Tensor,
    ) -> Result<Frame> {
        let (cos, sin) = self.rope.tables(positions)?;
        let local = match &self.local_rope {
            Some(rope) => {
                let (cos, sin) = rope.tables(positions)?;
                Some((cos.to_dtype(self.dtype())?, sin.to_dtype(self.dtype())?))
            }
            None => None,
        };
        let mut windows: Vec<usize> = self
            .layers
            .iter()
            .filter_map(|layer| layer.spec.window)
            .collect();
        windows.sort_unstable();
        windows.dedup();
        let windowed = windows
            .into_iter()
            .map(|window| {
                Ok((
                    window,
                    window_mask(&mask, positions, key_positions, window)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(Frame {
            mask,
            windowed,
            cos: cos.to_dtype(self.dtype())?,
            sin: sin.to_dtype(self.dtype())?,
            local,
        })
    }

    /// The [`Frame`] of a pass without a cache laid out by `layout`.
    pub(super) fn frame_of(&self, layout: &Layout) -> Result<Frame> {
        self.frame_with(
            layout.mask.to_dtype(self.dtype())?,
            &layout.positions,
            &layout.positions,
        )
    }

    /// Logits `[.., vocab]` of hidden states `[.., hidden]`, in f32 or f64 (differentiable with
    /// [`Ops::Differentiable`]).
    pub fn logits(&self, hidden: &Tensor, ops: Ops) -> Result<Tensor> {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let linear = Linear {
            weight: head.clone(),
            bias: None,
            lora: None,
        };
        let logits = linear.forward(hidden, ops)?;
        match logits.dtype() {
            DType::F16 | DType::BF16 => logits.to_dtype(DType::F32),
            _ => Ok(logits),
        }
    }

    /// Log-probability of each next token, `[B, T - 1]` (f32, or f64 for an f64 model): entry `t` is `log p(ids[t + 1] | ids[..=t])`,
    /// differentiable with [`Ops::Differentiable`]. `key_mask` `[B, T]` marks real tokens (left or right
    /// padding); entries whose target is padding are 0.
    pub fn token_logprobs(
        &self,
        input_ids: &Tensor,
        key_mask: &Tensor,
        ops: Ops,
    ) -> Result<Tensor> {
        let (batch, len) = input_ids.dims2()?;
        if len < 2 {
            return Tensor::zeros((batch, 0), self.logits_dtype(), self.device());
        }
        let positions = positions_from_mask(key_mask)?;
        let hidden = self.forward_hidden(input_ids, &positions, key_mask, None, ops)?;
        self.next_token_logprobs(&hidden, input_ids, key_mask)
    }

    /// [`Model::token_logprobs`] from the final hidden states `[B, T, hidden]` (after the last norm).
    pub(super) fn next_token_logprobs(
        &self,
        hidden: &Tensor,
        input_ids: &Tensor,
        key_mask: &Tensor,
    ) -> Result<Tensor> {
        let len = input_ids.dim(1)?;
        let batch = input_ids.dim(0)?;
        let hidden = hidden.narrow(1, 0, len - 1)?;
        let hidden = hidden.reshape((batch * (len - 1), hidden.dim(2)?))?;
        let logits = self.logits(&hidden, Ops::Differentiable)?;
        let targets = input_ids.narrow(1, 1, len - 1)?.flatten_all()?;
        let picked = crate::kernels::head::target_scores(&logits, &targets, 1.0)?
            .narrow(1, crate::kernels::head::column::LOGPROB, 1)?
            .reshape((batch, len - 1))?;
        let real = key_mask.narrow(1, 1, len - 1)?.to_dtype(picked.dtype())?;
        picked * real
    }
}

/// The per-pass inputs of every layer: the additive attention mask `[B, 1, T, S]`, the same for each
/// attention window the layers use, and the rotary tables `[B, T, head_dim / 2]`.
pub(super) struct Frame {
    pub(super) mask: Tensor,
    pub(super) windowed: Vec<(usize, Tensor)>,
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    /// The windowed layers' tables, when their RoPE is their own.
    pub(super) local: Option<(Tensor, Tensor)>,
}

impl Frame {
    /// The mask of a layer: the window's when it has one.
    pub(super) fn mask(&self, spec: LayerSpec) -> &Tensor {
        spec.window
            .and_then(|window| self.windowed.iter().find(|(w, _)| *w == window))
            .map_or(&self.mask, |(_, mask)| mask)
    }

    /// The rotary tables of a layer, `None` for a layer without RoPE.
    pub(super) fn rope(&self, spec: LayerSpec) -> Option<(&Tensor, &Tensor)> {
        if !spec.rope {
            return None;
        }
        match (&self.local, spec.window) {
            (Some((cos, sin)), Some(_)) => Some((cos, sin)),
            _ => Some((&self.cos, &self.sin)),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    /// `[batch, 2 heads, columns, 3]` with values that say where they are, offset by `start`.
    fn columns(batch: usize, count: usize, start: usize) -> Tensor {
        let values: Vec<f32> = (0..batch * 2 * count * 3)
            .map(|i| (start * 1000 + i) as f32)
            .collect();
        Tensor::from_vec(values, (batch, 2, count, 3), &Device::Cpu).unwrap()
    }

    fn same(a: &Tensor, b: &Tensor) -> bool {
        a.dims() == b.dims()
            && a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                == b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Appends in place hold what concatenation would, across growth, row selection, dropped columns
    /// and clones, and never change what an earlier step was given.
    #[test]
    fn appending_in_place_holds_what_concatenating_would() {
        let mut cache = LayerCache::default();
        let mut expected = columns(3, 5, 0);
        cache.append(expected.clone(), expected.clone()).unwrap();
        let mut earlier: Vec<(Tensor, Tensor)> = Vec::new();
        for step in 1..40 {
            let new = columns(expected.dim(0).unwrap(), 1, step);
            let (k, v) = cache.append(new.clone(), new.clone()).unwrap();
            expected = Tensor::cat(&[&expected, &new], 2).unwrap();
            assert!(same(&k, &expected) && same(&v, &expected), "step {step}");
            earlier.push((k.copy().unwrap(), k));
            if step == 20 {
                // A clone appends on its own: the original's buffers are not its to write (nor the
                // clone's the original's, which writes the same column next).
                let mut clone = cache.clone();
                let other = columns(3, 1, 999);
                let (theirs, _) = clone.append(other.clone(), other).unwrap();
                earlier.push((theirs.copy().unwrap(), theirs));
            }
            if step == 25 {
                let rows = Tensor::new(&[2u32, 0], &Device::Cpu).unwrap();
                for (copy, view) in earlier.drain(..) {
                    assert!(
                        same(&copy, &view),
                        "a later step changed an earlier step's keys"
                    );
                }
                cache.select_rows(&rows).unwrap();
                expected = expected.index_select(&rows, 0).unwrap();
            }
            if step == 30 {
                let kept = expected.dim(2).unwrap() - 4;
                let (k, v) = cache.keys_values.take().unwrap();
                cache.set(Some((
                    k.narrow(2, 4, kept).unwrap(),
                    v.narrow(2, 4, kept).unwrap(),
                )));
                expected = expected.narrow(2, 4, kept).unwrap();
            }
        }
        for (copy, view) in &earlier {
            assert!(
                same(copy, view),
                "a later step changed an earlier step's keys"
            );
        }
        assert!(cache.room.is_some(), "decoding steps write in place");
        let capacity = cache.room.as_ref().unwrap().0.dim(2).unwrap();
        let cached = expected.dim(2).unwrap();
        assert!(
            capacity >= cached && capacity <= cached + cached / 8 + 16,
            "{capacity} for {cached}"
        );
        let tracked = candle_core::Var::from_tensor(&columns(2, 1, 0)).unwrap();
        let mut cache = LayerCache::default();
        cache.append(columns(2, 2, 0), columns(2, 2, 0)).unwrap();
        let (k, _) = cache
            .append(tracked.as_tensor().clone(), columns(2, 1, 0))
            .unwrap();
        assert!(k.track_op() && cache.room.is_none(), "a graph is kept");
        assert_eq!(k.dtype(), DType::F32);
    }
}
