//! The backward pass of a decoder layer written out by hand: the gradients of its weights and of its
//! input, from its input and the gradient at its output.
//!
//! candle's autograd gets the same gradients from the differentiable forward's graph, but at a cost a
//! training step feels: every gradient it reaches starts as a tensor of zeros that the gradient is then
//! added to (three weight-sized buffers per weight), RMSNorm, RoPE and softmax are chains of basic ops
//! each with a backward of several more, and activation recomputation took the backward of
//! `sum(output · upstream)` to reach a layer's graph at all. Here each weight's gradient is one product,
//! the norms, rotary embedding, softmax and SwiGLU have their closed-form derivatives, and the layer's
//! output is not recomputed (only what its backward reads: the down projection's product is skipped).
//!
//! The forward part calls the same functions as [`Ops::Differentiable`] (`RmsNorm::forward_parts`,
//! `Linear::forward_parts`, `apply_rope`, `softmax`), so the activations are those of the
//! differentiable forward; the gradients equal autograd's to rounding (tested below).

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, D};

use super::config::{Activation, QkNorm};
use super::model::{
    apply_rope, softcap, softmax, AdapterParts, DecoderLayer, Frame, Linear, Mixer, Model, Ops,
    Result, RmsNorm, Split, Weight,
};
use crate::kernels::kernel::Real;
use crate::kernels::matrix::multiply;

impl DecoderLayer {
    /// Whether [`DecoderLayer::backward`] applies: ungated softmax attention, f32 or f64 weights (or
    /// quantized blocks, expanded to them) and adapters. Half-precision layers (bf16 training on CUDA) keep candle's autograd, which follows the
    /// forward's casts, as do linear-attention layers (whose delta rule has its own backward, see
    /// `kernels/delta.rs`), Qwen3.5's gated attention and mixtures of experts.
    pub(super) fn has_backward(&self) -> bool {
        let dtype = self.post_attention_layernorm.weight.dtype();
        self.mlp.dense().is_some()
            && self
                .mixer
                .attention()
                .is_some_and(|attention| !attention.gated && attention.sinks.is_none())
            && matches!(dtype, DType::F32 | DType::F64)
            && Model::linears(self)
                .iter()
                .all(|(_, linear)| match &linear.weight {
                    Weight::Dense(weight) => weight.dtype() == dtype,
                    Weight::Quantized(_) => true,
                    Weight::Mxfp4(_) => false,
                })
    }

    /// The gradient at this layer's input `xs` `[B, T, hidden]` for `upstream`, the gradient at its
    /// output; the gradients of its [`candle_core::Var`]s (weights, biases, norms, adapters) are added
    /// to `grads`. The forward activations are recomputed from `xs`.
    pub(super) fn backward(
        &self,
        xs: &Tensor,
        frame: &Frame,
        upstream: &Tensor,
        grads: &mut GradStore,
    ) -> Result<Tensor> {
        // The arithmetic runs on weights without autograd (a graph built here would reach the weights
        // through the returned gradient); the gradients are filed under this layer's variables.
        let trained = self;
        let this = &self.detached();
        let ops = Ops::Differentiable;
        let (batch, len, hidden) = xs.dims3()?;
        let rows = batch * len;
        let (Mixer::Attention(attention), Mixer::Attention(trained_attention)) =
            (&this.mixer, &trained.mixer)
        else {
            candle_core::bail!("the written-out backward is softmax attention's");
        };
        let (heads, kv_heads, head_dim) = (attention.heads, attention.kv_heads, attention.head_dim);
        let group = heads / kv_heads;
        let (norms, trained_norms) = (this.norms(), trained.norms());

        // The forward, keeping what the backward reads. Each norm keeps its normalized input and
        // roots (`NormParts`); a norm the family does not have passes its input through.
        let (normed_input, input_parts) = norm_forward(norms.attention_input, xs)?;
        // Each projection as heads `[B, heads, T, head_dim]`, through its q/k norm when the family
        // has one (over each head, or over the whole projection first).
        let (qkv, qkv_adapters) = attention.qkv.forward_parts(&normed_input, ops)?;
        let [q, k, v]: [Tensor; 3] = qkv
            .try_into()
            .map_err(|_| candle_core::Error::Msg("three projections".into()))?;
        let project =
            |ys: Tensor, heads: usize, norm: Option<&RmsNorm>| -> Result<ProjectedHeads> {
                let (ys, whole) = match attention.qk_norm {
                    QkNorm::Projection => norm_forward(norm, &ys)?,
                    _ => (ys, None),
                };
                let split = ys.reshape((batch, len, heads, head_dim))?;
                let (split, per_head) = match attention.qk_norm {
                    QkNorm::Head => norm_forward(norm, &split)?,
                    _ => (split, None),
                };
                Ok((split.transpose(1, 2)?, whole.or(per_head)))
            };
        let (q, q_norm_parts) = project(q, heads, attention.q_norm.as_ref())?;
        let (k, k_norm_parts) = project(k, kv_heads, attention.k_norm.as_ref())?;
        let (v, _) = project(v, kv_heads, None)?;
        let v = v.contiguous()?;
        let rope = frame.rope(self.spec);
        let (q, k) = match rope {
            Some((cos, sin)) => (
                apply_rope(&q, cos, sin, ops)?,
                apply_rope(&k, cos, sin, ops)?,
            ),
            None => (q, k.contiguous()?),
        };
        let q = q
            .contiguous()?
            .reshape((batch, kv_heads, group * len, head_dim))?;
        let scale = attention.scale;
        let scores = (q.matmul(&k.t()?)? * scale)?;
        let capped = attention
            .softcap
            .map(|cap| softcap(&scores, cap))
            .transpose()?;
        let scores = capped
            .as_ref()
            .unwrap_or(&scores)
            .reshape((batch, heads, len, len))?
            .broadcast_add(frame.mask(self.spec, 0)?)?;
        let weights = softmax(&scores, ops)?.reshape((batch, kv_heads, group * len, len))?;
        let attended = weights
            .matmul(&v)?
            .reshape((batch, heads, len, head_dim))?
            .transpose(1, 2)?
            .reshape((batch, len, heads * head_dim))?;
        let (projected, o_adapter) = attention.o_proj.forward_parts(&attended, ops)?;
        let (projected, attention_output_parts) = norm_forward(norms.attention_output, &projected)?;
        let residual = (xs + projected)?;
        let (normed_residual, mlp_input_parts) = norm_forward(norms.mlp_input, &residual)?;
        let (Some(mlp), Some(trained_mlp)) = (this.mlp.dense(), trained.mlp.dense()) else {
            candle_core::bail!(
                "the written-out backward is for a dense MLP, not a mixture of experts"
            );
        };
        let (gate_up, gate_up_adapters) = mlp.gate_up.forward_parts(&normed_residual, ops)?;
        let [gate, up]: [Tensor; 2] = gate_up
            .try_into()
            .map_err(|_| candle_core::Error::Msg("two projections".into()))?;
        let activated = mlp.activate(&gate, ops)?;
        let product = (&activated * &up)?.reshape((rows, ()))?;
        // The down projection's output is needed only by a norm on it; its adapter's activations are.
        let (down_adapter, mlp_output_parts) = match norms.mlp_output {
            Some(norm) => {
                let (down, adapter) = mlp.down_proj.forward_parts(&product, ops)?;
                (adapter, norm_forward(Some(norm), &down)?.1)
            }
            None => (mlp.down_proj.adapter_parts(&product, ops)?, None),
        };

        // MLP: out = residual + norm(down(act(gate) · up)). An upstream gradient from autograd can
        // carry a graph (through the tied output head, say): detached, nothing here extends it.
        let upstream = upstream.detach().reshape((rows, hidden))?;
        let d_down = norm_backward_or(
            trained_norms.mlp_output.zip(norms.mlp_output),
            mlp_output_parts,
            upstream.clone(),
            hidden,
            grads,
        )?;
        let d_product = linear_backward(
            (&trained_mlp.down_proj, &mlp.down_proj),
            &product,
            down_adapter,
            &d_down,
            grads,
        )?
        .reshape((batch, len, ()))?;
        let d_up = (&d_product * &activated)?;
        let d_gate = ((d_product * up)? * activation_derivative(mlp.activation, &gate)?)?;
        let normed_residual = normed_residual.reshape((rows, hidden))?;
        let d_normed_residual = split_backward(
            (&trained_mlp.gate_up, &mlp.gate_up),
            &normed_residual,
            gate_up_adapters,
            vec![d_gate.reshape((rows, ()))?, d_up.reshape((rows, ()))?],
            grads,
        )?;
        let d_residual = (norm_backward_or(
            trained_norms.mlp_input.zip(norms.mlp_input),
            mlp_input_parts,
            d_normed_residual,
            hidden,
            grads,
        )? + upstream)?;

        // Attention: residual = xs + norm(o_proj(softmax(cap(q kᵀ · scale) + mask) v)).
        let d_projected = norm_backward_or(
            trained_norms.attention_output.zip(norms.attention_output),
            attention_output_parts,
            d_residual.clone(),
            hidden,
            grads,
        )?;
        let d_attended = linear_backward(
            (&trained_attention.o_proj, &attention.o_proj),
            &attended.reshape((rows, ()))?,
            o_adapter,
            &d_projected,
            grads,
        )?
        .reshape((batch, len, heads, head_dim))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((batch, kv_heads, group * len, head_dim))?;
        let d_weights = d_attended.matmul(&v.t()?)?;
        let d_v = weights.t()?.matmul(&d_attended)?;
        let d_scores = ((&d_weights
            - (&d_weights * &weights)?
                .sum_keepdim(D::Minus1)?
                .broadcast_as(d_weights.shape())?)?
            * &weights)?;
        // Through the soft-cap: d/ds c · tanh(s / c) = 1 − tanh²(s / c) = 1 − (capped / c)².
        let d_scores = match (attention.softcap, &capped) {
            (Some(cap), Some(capped)) => {
                let slope = (capped / cap)?.sqr()?.affine(-1.0, 1.0)?;
                (d_scores * slope)?
            }
            _ => d_scores,
        };
        let d_scores = (d_scores * scale)?;
        let d_q = rope_backward(
            d_scores
                .matmul(&k)?
                .reshape((batch, heads, len, head_dim))?,
            rope,
        )?;
        let d_k = rope_backward(d_scores.t()?.matmul(&q)?, rope)?;
        let flat = |d: Tensor, heads: usize| -> Result<Tensor> {
            d.transpose(1, 2)?.reshape((rows, heads * head_dim))
        };
        // A per-head norm normalises vectors of `head_dim`, a projection's whole rows.
        let norm_width = |heads: usize| match attention.qk_norm {
            QkNorm::Projection => heads * head_dim,
            _ => head_dim,
        };
        let d_q = norm_backward_or(
            trained_attention
                .q_norm
                .as_ref()
                .zip(attention.q_norm.as_ref()),
            q_norm_parts,
            flat(d_q, heads)?,
            norm_width(heads),
            grads,
        )?;
        let d_k = norm_backward_or(
            trained_attention
                .k_norm
                .as_ref()
                .zip(attention.k_norm.as_ref()),
            k_norm_parts,
            flat(d_k, kv_heads)?,
            norm_width(kv_heads),
            grads,
        )?;
        let normed_input = normed_input.reshape((rows, hidden))?;
        let d_normed_input = split_backward(
            (&trained_attention.qkv, &attention.qkv),
            &normed_input,
            qkv_adapters,
            vec![d_q, d_k, flat(d_v, kv_heads)?],
            grads,
        )?;
        let d_xs = (norm_backward_or(
            trained_norms.attention_input.zip(norms.attention_input),
            input_parts,
            d_normed_input,
            hidden,
            grads,
        )? + d_residual)?;
        d_xs.reshape((batch, len, hidden))
    }
}

/// What a norm's backward reads from its forward: the normalized input (before the weight) and the
/// roots, `[.., width]` and `[.., 1]`.
type NormParts = (Tensor, Tensor);

/// A projection as heads `[B, heads, T, head_dim]`, and its q/k norm's parts.
type ProjectedHeads = (Tensor, Option<NormParts>);

/// The gradient at the input `xs` `[rows, in]` of a [`Split`] for its parts' output gradients `dys`
/// (`[rows, width]` each); the gradients of its matrices go to `grads`.
fn split_backward(
    (trained, split): (&Split, &Split),
    xs: &Tensor,
    adapters: Vec<Option<AdapterParts>>,
    dys: Vec<Tensor>,
    grads: &mut GradStore,
) -> Result<Tensor> {
    let mut dx: Option<Tensor> = None;
    let matrices = trained.linears.iter().zip(&split.linears);
    for ((matrix, adapter), dy) in matrices.zip(adapters).zip(split.join(dys)?) {
        let part = linear_backward(matrix, xs, adapter, &dy, grads)?;
        dx = Some(match dx {
            Some(sum) => (sum + part)?,
            None => part,
        });
    }
    dx.ok_or_else(|| candle_core::Error::Msg("a split with no matrices".into()))
}

/// `xs` through `norm` (differentiable form), with what its backward reads; `xs` itself without one.
fn norm_forward(norm: Option<&RmsNorm>, xs: &Tensor) -> Result<(Tensor, Option<NormParts>)> {
    match norm {
        Some(norm) => {
            let (out, normed, root) = norm.forward_parts(xs)?;
            Ok((out, Some((normed, root))))
        }
        None => Ok((xs.clone(), None)),
    }
}

/// The gradient at the input of a norm over vectors of `width` for `dy` (any shape whose elements are
/// whole vectors; returned in that shape), given its [`NormParts`]; `dy` itself without a norm.
fn norm_backward_or(
    norms: Option<(&RmsNorm, &RmsNorm)>,
    parts: Option<NormParts>,
    dy: Tensor,
    width: usize,
    grads: &mut GradStore,
) -> Result<Tensor> {
    let (Some(norms), Some((normed, root))) = (norms, parts) else {
        return Ok(dy);
    };
    let shape = dy.shape().clone();
    let vectors = dy.elem_count() / width;
    norm_backward(
        norms,
        &normed.reshape((vectors, width))?,
        &root.reshape((vectors, 1))?,
        &dy.reshape((vectors, width))?,
        grads,
    )?
    .reshape(shape)
}

/// The derivative of the gate's activation at `gate`.
fn activation_derivative(activation: Activation, gate: &Tensor) -> Result<Tensor> {
    match activation {
        // silu'(g) = σ(g) · (1 + g · (1 − σ(g)))
        Activation::Silu => {
            let sigmoid = candle_nn::ops::sigmoid(gate)?;
            &sigmoid * ((gate * (1.0 - &sigmoid)?)? + 1.0)?
        }
        // gelu(g) = g/2 · (1 + tanh(u)), u = √(2/π) · (g + 0.044715 g³):
        // gelu'(g) = (1 + tanh u)/2 + g/2 · (1 − tanh² u) · √(2/π) · (1 + 3 · 0.044715 g²)
        Activation::GeluTanh => {
            let root = (2.0 / std::f64::consts::PI).sqrt();
            let cubed = (gate.sqr()? * gate)?;
            let tanh = ((gate + (cubed * 0.044715)?)? * root)?.tanh()?;
            let slope = ((gate.sqr()? * (3.0 * 0.044715))? + 1.0)? * root;
            let half_one_plus = ((&tanh + 1.0)? * 0.5)?;
            let sech2 = (1.0 - tanh.sqr()?)?;
            half_one_plus + ((gate * 0.5)? * sech2)? * slope?
        }
    }
}

/// Adds `grad` to `tensor`'s gradient in `grads` when `tensor` is a variable.
fn accumulate(
    grads: &mut GradStore,
    tensor: &Tensor,
    grad: impl FnOnce() -> Result<Tensor>,
) -> Result<()> {
    if !tensor.is_variable() {
        return Ok(());
    }
    let grad = grad()?;
    let sum = match grads.remove(tensor) {
        Some(earlier) => (earlier + grad)?,
        None => grad,
    };
    grads.insert(tensor, sum);
    Ok(())
}

/// The gradient at the input `xs` `[rows, in]` of `linear` for `dy` `[rows, out]` at its output; the
/// gradients of its weight, bias and adapter go to `grads`.
fn linear_backward(
    (trained, linear): (&Linear, &Linear),
    xs: &Tensor,
    adapter: Option<AdapterParts>,
    dy: &Tensor,
    grads: &mut GradStore,
) -> Result<Tensor> {
    // Quantized blocks (QLoRA's frozen base) are expanded for this product only, and get no gradient.
    let dx = multiply(dy, &linear.weight.expanded(dy.dtype())?)?;
    if let Weight::Dense(weight) = &trained.weight {
        accumulate(grads, weight, || multiply(&dy.t()?, xs))?;
    }
    if let Some(bias) = &trained.bias {
        accumulate(grads, bias, || row_sum(dy, None))?;
    }
    let (Some(lora), Some(keys), Some(parts)) = (&linear.lora, &trained.lora, adapter) else {
        return Ok(dx);
    };
    // y += scale · low · Bᵀ, low = input · Aᵀ, input = dropout(xs).
    let d_update = (dy.to_dtype(lora.b.dtype())? * lora.scale)?;
    accumulate(grads, &keys.b, || multiply(&d_update.t()?, &parts.low))?;
    let d_low = multiply(&d_update, &lora.b)?;
    accumulate(grads, &keys.a, || multiply(&d_low.t()?, &parts.input))?;
    let d_input = multiply(&d_low, &lora.a)?;
    let d_input = match &parts.keep {
        Some(keep) => (d_input * keep)?,
        None => d_input,
    };
    let d_input = d_input.to_dtype(dx.dtype())?;
    dx + d_input
}

/// `Σ_rows a` (`[rows, n]` → `[n]`), or `Σ_rows a · b`: a bias's or a norm weight's gradient. On the
/// CPU one pass adds the rows in order; candle's sum over the first dimension walked the tensor element
/// by element (as much time as a 64-wide layer's products at a small model's shapes), and the product
/// was a tensor of its own.
fn row_sum(a: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if !crate::kernels::kernel::takes(a, &b.into_iter().collect::<Vec<_>>()) || a.rank() != 2 {
        return match b {
            Some(b) => (a * b)?.sum(0),
            None => a.sum(0),
        };
    }
    let width = a.dim(1)?;
    match a.dtype() {
        DType::F64 => Tensor::new(sum_rows::<f64>(a, b, width)?, a.device()),
        _ => Tensor::new(sum_rows::<f32>(a, b, width)?, a.device()),
    }
}

fn sum_rows<T: Real>(a: &Tensor, b: Option<&Tensor>, width: usize) -> Result<Vec<T>> {
    let a = a.contiguous()?.flatten_all()?.to_vec1::<T>()?;
    let b = match b {
        Some(b) => Some(b.contiguous()?.flatten_all()?.to_vec1::<T>()?),
        None => None,
    };
    let mut sums = vec![T::ZERO; width];
    for (row, a) in a.chunks(width.max(1)).enumerate() {
        match &b {
            Some(b) => {
                for ((sum, &a), &b) in sums.iter_mut().zip(a).zip(&b[row * width..]) {
                    *sum += a * b;
                }
            }
            None => {
                for (sum, &a) in sums.iter_mut().zip(a) {
                    *sum += a;
                }
            }
        }
    }
    Ok(sums)
}

/// The gradient at the input of `norm` (`normed · weight`, `normed = x / root`) for `dy`; `normed` and
/// `root` are `[rows, hidden]` and `[rows, 1]`. The weight's gradient goes to `grads`.
fn norm_backward(
    (trained, norm): (&RmsNorm, &RmsNorm),
    normed: &Tensor,
    root: &Tensor,
    dy: &Tensor,
    grads: &mut GradStore,
) -> Result<Tensor> {
    accumulate(grads, &trained.weight, || row_sum(dy, Some(normed)))?;
    // ∂x = (∂normed − normed · mean(∂normed · normed)) / root
    let d_normed = dy.broadcast_mul(&norm.scale()?)?;
    let projection = (&d_normed * normed)?.mean_keepdim(D::Minus1)?;
    (d_normed - normed.broadcast_mul(&projection)?)?.broadcast_div(root)
}

/// The gradient at the input of [`apply_rope`] for `dy` `[B, heads, T, head_dim]`: the rotation
/// transposed, `∂x = ∂y · cos + Rᵀ(∂y · sin)` with `Rᵀ(a, b) = (b, −a)` over the two halves; `dy`
/// itself for a layer without RoPE.
fn rope_backward(dy: Tensor, rope: Option<(&Tensor, &Tensor)>) -> Result<Tensor> {
    let Some((cos, sin)) = rope else {
        return Ok(dy);
    };
    // A partial rotary embedding: the unrotated dimensions pass their gradient through.
    let (head_dim, rotated) = (dy.dim(D::Minus1)?, cos.dim(D::Minus1)? * 2);
    if rotated < head_dim {
        let turned = rope_backward(
            dy.narrow(D::Minus1, 0, rotated)?.contiguous()?,
            Some((cos, sin)),
        )?;
        let kept = dy.narrow(D::Minus1, rotated, head_dim - rotated)?;
        return Tensor::cat(&[&turned, &kept], D::Minus1)?.contiguous();
    }
    let dy = &dy;
    if crate::kernels::kernel::takes(dy, &[cos, sin]) {
        return crate::kernels::rope::rope_backward(dy, cos, sin);
    }
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?.unsqueeze(1)?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?.unsqueeze(1)?;
    let half = dy.dim(D::Minus1)? / 2;
    let rotated = dy.broadcast_mul(&sin)?;
    let transposed = Tensor::cat(
        &[
            &rotated.narrow(D::Minus1, half, half)?,
            &rotated.narrow(D::Minus1, 0, half)?.neg()?,
        ],
        D::Minus1,
    )?;
    dy.broadcast_mul(&cos)? + transposed
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::config::Arch;
    use crate::model::{positions_from_mask, LoraConfig, Targets, PROJECTIONS};
    use crate::testing::{config, max_abs, random_model};

    /// The layer's gradients, and the input's, against candle's autograd through the differentiable
    /// forward: full fine-tuning and LoRA with dropout, Qwen2 (q/k/v biases), Qwen3 (q/k norms), Llama
    /// (o and MLP biases), Mistral (a window of 3), SmolLM3 (no RoPE), OLMo 2 (norms after attention and
    /// the MLP, q/k norms over the projections) and Gemma 3 (four offset norms, GeGLU, its own query
    /// scale, a window with its own RoPE) and Phi-3 (fused projections, half of each head rotated),
    /// rows of different lengths (right padding), in f64 and f32.
    #[test]
    fn the_layer_backward_is_autograd_s() {
        let device = Device::Cpu;
        // Two rows, the second padded: 6 and 4 real tokens.
        let mask =
            Tensor::from_vec(vec![1u8, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], (2, 6), &device).unwrap();
        for (dtype, tolerance) in [(DType::F64, 1e-10), (DType::F32, 1e-4)] {
            // Gemma 3 twice: as its checkpoints are, and with a soft-cap on the attention scores small
            // enough that tanh bends them all.
            let capped = {
                let mut capped = config(Arch::Gemma3);
                capped.variant.attention_softcap = Some(0.5);
                capped
            };
            for config in [
                Arch::Qwen2,
                Arch::Qwen3,
                Arch::Llama,
                Arch::Mistral,
                Arch::SmolLm3,
                Arch::Olmo2,
                Arch::Gemma3,
                Arch::Phi3,
            ]
            .map(config)
            .into_iter()
            .chain([capped.clone()])
            {
                let arch = match config.variant.attention_softcap {
                    Some(_) => format!("{} (attention soft-cap)", config.arch),
                    None => config.arch.to_string(),
                };
                let base = random_model(&config, dtype);
                let lora = LoraConfig {
                    targets: Targets::names(&PROJECTIONS),
                    dropout: 0.3,
                    ..LoraConfig::default()
                };
                let (adapted, adapters) = base.with_lora(&lora).unwrap();
                for (name, var) in &adapters {
                    if name.contains("lora_B") {
                        let shape = var.as_tensor().shape().clone();
                        var.set(
                            &Tensor::randn(0f64, 0.3, shape, &device)
                                .unwrap()
                                .to_dtype(dtype)
                                .unwrap(),
                        )
                        .unwrap();
                    }
                }
                adapted.set_dropout_seed(5);
                for (label, (model, vars)) in [
                    ("full", base.trainable().unwrap()),
                    ("lora", (adapted, adapters)),
                ] {
                    let positions = positions_from_mask(&mask).unwrap();
                    let frame = model.frame(&positions, &mask, None, None).unwrap();
                    let layer = &model.layers[0];
                    assert!(layer.has_backward());
                    let xs = Tensor::randn(0f64, 1.0, (2, 6, 16), &device)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    // Non-contiguous, as autograd's gradients can be.
                    let upstream = Tensor::randn(0f64, 1.0, (2, 16, 6), &device)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                        .transpose(1, 2)
                        .unwrap();
                    let input = Var::from_tensor(&xs).unwrap();
                    let output = layer
                        .forward(input.as_tensor(), &frame, None, Ops::Differentiable)
                        .unwrap();
                    let expected = (output * &upstream)
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let mut grads = GradStore::default();
                    let d_xs = layer.backward(&xs, &frame, &upstream, &mut grads).unwrap();
                    // No graph: a later backward (the embeddings') must not reach the weights through it.
                    assert!(!d_xs.track_op());
                    let mut checked = vec![(
                        "input".to_string(),
                        expected.get(input.as_tensor()).unwrap().clone(),
                        d_xs,
                    )];
                    for (name, var) in &vars {
                        if !name.contains("layers.0") {
                            assert!(
                                grads.get(var.as_tensor()).is_none(),
                                "{name} is not the layer's"
                            );
                            continue;
                        }
                        let got = grads
                            .get(var.as_tensor())
                            .unwrap_or_else(|| panic!("{label}: no gradient for {name}"));
                        checked.push((
                            name.clone(),
                            expected.get(var.as_tensor()).unwrap().clone(),
                            got.clone(),
                        ));
                    }
                    for (name, expected, got) in checked {
                        let scale = max_abs(&expected);
                        assert!(
                            scale > 0.0,
                            "{arch} {label} {dtype:?}: {name} has a zero gradient"
                        );
                        let diff = max_abs(&(&expected - &got).unwrap());
                        assert!(
                            diff <= tolerance * scale.max(1.0),
                            "{arch} {label} {dtype:?}: {name} differs by {diff} (scale {scale})"
                        );
                    }
                }
            }
        }
    }
}
