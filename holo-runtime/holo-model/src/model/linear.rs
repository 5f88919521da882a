//! Projections: [`Linear`] with its [`Weight`] (dense, or a GGUF file's quantized blocks) and its
//! optional LoRA adapter ([`Lora`], [`Dropout`]; which projections get one is `crate::peft`'s), and [`Split`], the projections of one
//! input that a layer uses apart (q/k/v, gate/up), one matrix per part or fused as Phi-3 keeps them.

use std::sync::Arc;

use candle_core::quantized::QTensor;

use crate::kernels::mxfp4::Mxfp4Matrix;

use super::*;

#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Tensor>,
    /// A low-rank update added to the output, trained while `weight` stays frozen.
    pub lora: Option<Lora>,
}

/// A projection's matrix `[out, in]`.
#[derive(Debug, Clone)]
pub enum Weight {
    /// A tensor of the model's type: what every path multiplies, and what training updates.
    Dense(Tensor),
    /// A GGUF file's blocks (Q8_0, Q4_0, Q4_K, Q6_K, …) as the file holds them, on the CPU. ggml's
    /// kernels (candle's port) multiply them: each row of activations is quantized to 8 bits per block
    /// and the weights are dequantized in registers, so a decoding step reads the blocks' bytes (Q8_0:
    /// 1.06 bytes a weight, Q4_K: 0.56) instead of f32's 4. Frozen: differentiable passes expand the
    /// blocks for each product (`kernels::blocks`), so LoRA trains over them (QLoRA); they get no
    /// gradient, so full fine-tuning refuses them.
    Quantized(Arc<QTensor>),
    /// A GGUF file's MXFP4 blocks (gpt-oss's experts), multiplied as they are by
    /// [`Mxfp4Matrix`](crate::Mxfp4Matrix): exact values, 0.53 bytes a weight.
    /// Sampling only, on the CPU.
    Mxfp4(Arc<Mxfp4Matrix>),
}

impl Weight {
    /// `[out, in]`.
    pub fn dims(&self) -> &[usize] {
        match self {
            Weight::Dense(tensor) => tensor.dims(),
            Weight::Quantized(blocks) => blocks.shape().dims(),
            Weight::Mxfp4(matrix) => matrix.dims(),
        }
    }

    /// The dense tensor; an error for quantized blocks, which neither train nor export.
    pub fn dense(&self) -> Result<&Tensor> {
        match self {
            Weight::Dense(tensor) => Ok(tensor),
            Weight::Quantized(blocks) => candle_core::bail!(
                "a {:?} projection kept as the GGUF file's blocks is frozen (LoRA trains over it); \
                 load the file dequantized (without `--quantized`) to train or export it",
                blocks.dtype()
            ),
            Weight::Mxfp4(_) => candle_core::bail!(
                "an MXFP4 matrix kept as the GGUF file's blocks only samples; load the file \
                 dequantized (without `--quantized`) to train or export it"
            ),
        }
    }

    /// The matrix as a tensor: the dense one, or the blocks expanded to `dtype` for one product (the
    /// backward's `∂y · W`).
    pub(crate) fn expanded(&self, dtype: DType) -> Result<Tensor> {
        match self {
            Weight::Quantized(blocks) => crate::kernels::blocks::expand(blocks, dtype),
            _ => self.dense().cloned(),
        }
    }

    /// The bytes a product reads: the tensor's, or the blocks'.
    pub fn bytes(&self) -> usize {
        match self {
            Weight::Dense(tensor) => tensor.elem_count() * tensor.dtype().size_in_bytes(),
            Weight::Quantized(blocks) => blocks.storage_size_in_bytes(),
            Weight::Mxfp4(matrix) => matrix.bytes(),
        }
    }

    /// This weight with `f(tensor)` in place of a dense tensor; blocks are shared as they are.
    pub(super) fn map_dense<E>(
        &self,
        f: &mut impl FnMut(&Tensor) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Weight, E> {
        Ok(match self {
            Weight::Dense(tensor) => Weight::Dense(f(tensor)?),
            Weight::Quantized(blocks) => Weight::Quantized(Arc::clone(blocks)),
            Weight::Mxfp4(matrix) => Weight::Mxfp4(Arc::clone(matrix)),
        })
    }
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
    pub(super) id: u64,
    /// Shared by every adapter of a model; 0 turns dropout off.
    pub(super) seed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Dropout {
    /// The factors the adapter's input `xs` is multiplied by (0, or `1 / (1 - p)` for a kept entry), or
    /// `None` when the seed is 0; the backward multiplies the input's gradient by the same.
    pub(crate) fn mask(&self, xs: &Tensor) -> Result<Option<Tensor>> {
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
/// Qwen3.5's linear-attention (Gated DeltaNet) projections, as its layers name them beside
/// `self_attn`'s: queries, keys and values together, the output gate, the write strength, the decay,
/// and the output.
pub const LINEAR_ATTENTION_PROJECTIONS: [&str; 5] = [
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
];

pub const FUSED_PROJECTIONS: [(&str, &[&str]); 2] = [
    ("qkv_proj", &["q_proj", "k_proj", "v_proj"]),
    ("gate_up_proj", &["gate_proj", "up_proj"]),
];

/// Whether LoRA `targets` name the projection at `key`, PEFT's name of the module
/// (`model.layers.0.self_attn.q_proj`): as PEFT matches a list of names, by the name or a dotted
/// suffix of it (`q_proj`, `self_attn.q_proj`, `layers.0.self_attn.q_proj`), a fused projection also
/// by its parts' names (so the usual targets adapt Phi-3's `qkv_proj`); as PEFT matches a regular
/// expression, by the whole name (Phi-3's `qkv_proj` by its own).
pub fn targets(targets: &Targets, key: &str) -> bool {
    if let Targets::Regex(_) = targets {
        return targets.matches(key);
    }
    let (module, short) = key.rsplit_once('.').unwrap_or(("", key));
    targets.matches(key)
        || FUSED_PROJECTIONS.iter().any(|(fused, parts)| {
            *fused == short
                && parts
                    .iter()
                    .any(|part| targets.matches(&format!("{module}.{part}")))
        })
}

impl Linear {
    pub(super) fn load(vb: VarBuilder, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        let weight = vb.get((out_dim, in_dim), "weight")?;
        let bias = if bias {
            Some(vb.get(out_dim, "bias")?)
        } else {
            None
        };
        Ok(Linear {
            weight: Weight::Dense(weight),
            bias,
            lora: None,
        })
    }

    /// A projection without bias or adapter over the dense `weight` `[out, in]`.
    pub fn dense(weight: Tensor) -> Self {
        Linear {
            weight: Weight::Dense(weight),
            bias: None,
            lora: None,
        }
    }

    /// `xs` is `[.., in]`; the leading dimensions are flattened into one matrix product. With
    /// [`Ops::Fast`], a few rows (decoding) go through our own kernels where they are faster.
    pub fn forward(&self, xs: &Tensor, ops: Ops) -> Result<Tensor> {
        Ok(self.forward_parts(xs, ops)?.0)
    }

    /// [`Linear::forward`], and what its adapter computed on the way (see [`AdapterParts`]).
    pub(crate) fn forward_parts(
        &self,
        xs: &Tensor,
        ops: Ops,
    ) -> Result<(Tensor, Option<AdapterParts>)> {
        let dims = xs.dims().to_vec();
        let (leading, in_dim) = dims.split_at(dims.len() - 1);
        let rows: usize = leading.iter().product();
        let flat = xs.reshape((rows, in_dim[0]))?;
        let ys = match &self.weight {
            // Training's passes multiply the blocks' exact values, with a backward to the input;
            // sampling multiplies them as ggml does.
            Weight::Quantized(blocks) if ops == Ops::Differentiable => {
                crate::kernels::blocks::matmul(&flat, blocks)?
            }
            // Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 blocks through our kernels, which reuse each block
            // across the rows; the k-quants through candle's.
            Weight::Quantized(blocks) if crate::kernels::quant::suits(blocks, &flat) => {
                crate::kernels::quant::matmul(&flat, blocks)?
            }
            Weight::Quantized(blocks) => flat.contiguous()?.apply_op1_no_bwd(blocks.as_ref())?,
            Weight::Mxfp4(matrix) => matrix.matmul(&flat)?,
            Weight::Dense(weight) => match dispatch::product(ops, &Operands::of(&flat, weight)) {
                Product::Skinny => crate::kernels::skinny::matmul(&flat, weight)?,
                Product::Weight => crate::kernels::product::matmul(&flat, weight, ops)?,
                Product::Candle => flat.matmul(&weight.t()?)?,
            },
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
        out_dims.push(self.weight.dims()[0]);
        Ok((ys.reshape(out_dims)?, adapter))
    }

    /// The adapter's input and low-rank activations for `flat` `[rows, in]`, `None` without an adapter.
    /// The adapters may be f32 over a bf16 base (see `dispatch::adapter_dtype`): the low-rank path runs
    /// in their type and its output joins the base's in the base's.
    pub(crate) fn adapter_parts(&self, flat: &Tensor, ops: Ops) -> Result<Option<AdapterParts>> {
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
pub(crate) struct AdapterParts {
    pub(crate) input: Tensor,
    pub(crate) low: Tensor,
    pub(crate) keep: Option<Tensor>,
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
    pub(crate) linears: Vec<Linear>,
}

impl Split {
    pub(super) fn load(
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

    /// Parts kept as matrices of their own, from the matrices.
    pub(super) fn of(parts: Vec<(&'static str, usize)>, linears: Vec<Linear>) -> Self {
        Split {
            parts,
            fused: None,
            linears,
        }
    }

    /// The matrices under their module names.
    pub fn named(&self) -> Vec<(&'static str, &Linear)> {
        self.names().into_iter().zip(&self.linears).collect()
    }

    pub(super) fn named_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        self.names().into_iter().zip(&mut self.linears).collect()
    }

    pub(super) fn names(&self) -> Vec<&'static str> {
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
    pub(crate) fn forward(&self, xs: &Tensor, ops: Ops) -> Result<Vec<Tensor>> {
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
    pub(crate) fn forward_parts(
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
    pub(super) fn cut(&self, ys: &Tensor) -> Result<Vec<Tensor>> {
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
    pub(crate) fn join(&self, grads: Vec<Tensor>) -> Result<Vec<Tensor>> {
        match self.fused {
            Some(_) => Ok(vec![Tensor::cat(&grads, D::Minus1)?]),
            None => Ok(grads),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::*;
    use crate::testing::{max_abs, max_difference, sines};

    /// A projection over quantized blocks computes what the same blocks dequantized compute, up to the
    /// rounding of the activations to 8 bits per block (at most 1/254 of a block's largest value, so an
    /// output moves by at most that fraction of `|x| · |w|ᵀ`; these errors partly cancel, and the limit
    /// is a quarter of that bound, twice the largest difference measured, while a wrong product misses
    /// by the outputs' own size, 15 times the limit), for each type llama.cpp quantizes models to, at
    /// decoding's few rows and at prefill's many.
    #[test]
    fn quantized_blocks_multiply_as_their_dequantized_matrix() {
        let (out, inputs) = (48, 512);
        let weight = sines((out, inputs), 0.37, DType::F32);
        for dtype in [
            GgmlDType::Q8_0,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let blocks = QTensor::quantize(&weight, dtype).unwrap();
            let dense = Linear::dense(blocks.dequantize(&Device::Cpu).unwrap());
            let quantized = Linear {
                weight: Weight::Quantized(Arc::new(blocks)),
                bias: None,
                lora: None,
            };
            assert!(
                quantized.weight.bytes() < dense.weight.bytes() / 3,
                "{dtype:?}"
            );
            for rows in [1, 3, 8, 40] {
                let xs = sines((1, rows, inputs), 0.11, DType::F32);
                let expected = dense.forward(&xs, Ops::Fast).unwrap();
                let got = quantized.forward(&xs, Ops::Fast).unwrap();
                assert_eq!(got.dims(), [1, rows, out]);
                let dequantized = dense.weight.dense().unwrap();
                let bound = xs
                    .abs()
                    .unwrap()
                    .broadcast_matmul(&dequantized.abs().unwrap().t().unwrap())
                    .unwrap();
                let (difference, scale) = (max_difference(&got, &expected), max_abs(&bound));
                assert!(
                    difference > 0.0 && difference < scale / (4.0 * 254.0),
                    "{dtype:?} rows {rows}: max |Δ| {difference} of {scale}"
                );
            }
        }
    }

    #[test]
    fn quantized_blocks_refuse_to_be_trained() {
        let blocks = QTensor::quantize(&sines((4, 32), 0.3, DType::F32), GgmlDType::Q8_0).unwrap();
        let error = Weight::Quantized(Arc::new(blocks)).dense().unwrap_err();
        assert!(error.to_string().contains("--quantized"), "{error}");
    }
}
