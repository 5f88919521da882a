//! Gated DeltaNet linear attention (Qwen3.5's `linear_attn`, transformers' `Qwen3_5GatedDeltaNet`):
//! the input projected to queries, keys and values (`in_proj_qkv`), an output gate (`in_proj_z`), write
//! strengths (`in_proj_b`) and decays (`in_proj_a`); a causal depthwise convolution with SiLU over the
//! queries, keys and values; the gated delta rule with a `key_dim × value_dim` state per value head
//! (`kernels/delta.rs` says what it computes); an RMSNorm of each head's output times `silu(z)`; and
//! `out_proj`.
//!
//! A sequence's cache in such a layer is two states of fixed size, not keys and values: the last
//! `K - 1` inputs of the convolution and the rule's state ([`LayerCache`]'s `state`).
//!
//! On the CPU in f32 and f64 the convolution and the rule run as our kernels: the rule as one
//! differentiable operation from a zero state in training, both from and into the cached states, over
//! each row's real tokens, when sampling. Elsewhere (half precision, other devices, a differentiable pass
//! that continues a cache) they are composed of tensor operations, row by row and token by token: slow,
//! and the reference the kernels are tested against.

use super::*;
use crate::config::LinearAttention;
use crate::kernels::delta;

#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    pub projections: Split,
    /// `conv1d.weight` `[channels, 1, kernel]`, as checkpoints store it.
    pub conv1d: Tensor,
    /// `dt_bias` `[value_heads]`: added to the decay projection before softplus.
    pub dt_bias: Tensor,
    /// `A_log` `[value_heads]`: the decay rates' logarithms.
    pub a_log: Tensor,
    /// `norm`: RMSNorm of each value head's output (weights, not offsets from one).
    pub norm: RmsNorm,
    pub out_proj: Linear,
    pub(crate) sizes: LinearAttention,
}

/// A layer's inputs to the rule for `[.., T]` tokens: queries and keys `[.., T, value_heads, key_dim]`
/// (each key head repeated for the value heads it serves, L2-normalised, the queries scaled by
/// `1/√key_dim`), values `[.., T, value_heads, value_dim]`, log decays and strengths
/// `[.., T, value_heads]`.
struct RuleInputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
}

impl GatedDeltaNet {
    pub(super) fn load(vb: VarBuilder, config: &ModelConfig) -> Result<Self> {
        let Some(sizes) = config.linear_attention else {
            candle_core::bail!("a linear-attention layer without `linear_*` sizes in the config");
        };
        let value_width = sizes.value_heads * sizes.value_head_dim;
        let channels = sizes.conv_dim();
        Ok(GatedDeltaNet {
            projections: Split::load(
                &vb,
                config.hidden_size,
                vec![
                    ("in_proj_qkv", channels),
                    ("in_proj_z", value_width),
                    ("in_proj_b", sizes.value_heads),
                    ("in_proj_a", sizes.value_heads),
                ],
                None,
                false,
            )?,
            conv1d: vb.get((channels, 1, sizes.conv_kernel), "conv1d.weight")?,
            dt_bias: vb.get(sizes.value_heads, "dt_bias")?,
            a_log: vb.get(sizes.value_heads, "A_log")?,
            norm: RmsNorm::plain(
                vb.pp("norm").get(sizes.value_head_dim, "weight")?,
                config.rms_norm_eps,
            ),
            out_proj: Linear::load(vb.pp("out_proj"), value_width, config.hidden_size, false)?,
            sizes,
        })
    }

    /// The layer on `xs` `[B, T, hidden]`, whose real tokens `real` marks (`B · T` flags; padding's input
    /// counts as zeros, as transformers masks it), continuing from and updating `cache` when given.
    pub(super) fn forward(
        &self,
        xs: &Tensor,
        real: &[u8],
        cache: Option<&mut LayerCache>,
        ops: Ops,
    ) -> Result<Tensor> {
        let (batch, len, hidden) = xs.dims3()?;
        let projected = self.projections.forward(xs, ops)?;
        let core = self.mix(&projected, (batch, len), real, cache, ops)?;
        self.output(&core, &projected[1], ops)?
            .reshape((batch, len, hidden))
    }

    /// The rule's output `[B, T, value_heads, value_dim]` from the projections `[B, T, ..]` (or
    /// `[B · T, ..]`) of `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    pub(crate) fn mix(
        &self,
        projected: &[Tensor],
        (batch, len): (usize, usize),
        real: &[u8],
        cache: Option<&mut LayerCache>,
        ops: Ops,
    ) -> Result<Tensor> {
        let [mixed, _, b, a] = projected else {
            candle_core::bail!("four projections");
        };
        let channels = self.sizes.conv_dim();
        let mixed = mixed.reshape((batch, len, channels))?;
        let (b, a) = (
            b.reshape((batch, len, self.sizes.value_heads))?,
            a.reshape((batch, len, self.sizes.value_heads))?,
        );
        if real.len() != batch * len {
            candle_core::bail!("{} real-token flags for {batch} × {len} tokens", real.len());
        }
        if len == 0 {
            let (heads, dv) = (self.sizes.value_heads, self.sizes.value_head_dim);
            return Tensor::zeros((batch, 0, heads, dv), mixed.dtype(), mixed.device());
        }
        let kernels = crate::kernels::kernel::takes(&mixed, &[&self.conv1d, &b, &a]);
        match (ops, cache) {
            (Ops::Differentiable, None) if kernels => {
                self.mix_from_zero(&mixed, &b, &a, (batch, len), real)
            }
            (Ops::Fast | Ops::Invariant, cache) if kernels => {
                self.mix_sampling(&mixed, &b, &a, (batch, len), real, cache)
            }
            (_, cache) => self.mix_by_ops(&mixed, &b, &a, real, cache),
        }
    }

    /// Training from a zero state: padding's inputs zeroed, the convolution composed of tensor operations
    /// (zeros before the first column), the rule as one differentiable operation.
    fn mix_from_zero(
        &self,
        mixed: &Tensor,
        b: &Tensor,
        a: &Tensor,
        (batch, len): (usize, usize),
        real: &[u8],
    ) -> Result<Tensor> {
        let mask = Tensor::from_vec(
            real.iter().map(|&r| f64::from(r)).collect::<Vec<_>>(),
            (batch, len, 1),
            mixed.device(),
        )?
        .to_dtype(mixed.dtype())?;
        let (mixed, b, a) = (
            mixed.broadcast_mul(&mask)?,
            b.broadcast_mul(&mask)?,
            a.broadcast_mul(&mask)?,
        );
        let kept = self.sizes.conv_kernel - 1;
        let front = Tensor::zeros(
            (batch, kept, self.sizes.conv_dim()),
            mixed.dtype(),
            mixed.device(),
        )?;
        let convolved = self.convolve(&Tensor::cat(&[&front, &mixed], 1)?, len)?;
        let inputs = self.rule_inputs(&convolved, &b, &a)?;
        let heads = self.sizes.value_heads;
        let series = |x: &Tensor| as_series(x, batch * heads, len);
        let out = delta::rule(
            &series(&inputs.q)?,
            &series(&inputs.k)?,
            &series(&inputs.v)?,
            &series(&inputs.g)?,
            &series(&inputs.beta)?,
            true,
        )?;
        out.reshape((batch, heads, len, self.sizes.value_head_dim))?
            .transpose(1, 2)
    }

    /// Sampling on the CPU: the convolution and the rule over each row's real tokens, from the cached
    /// states (zeros without a cache), which are updated.
    fn mix_sampling(
        &self,
        mixed: &Tensor,
        b: &Tensor,
        a: &Tensor,
        (batch, len): (usize, usize),
        real: &[u8],
        cache: Option<&mut LayerCache>,
    ) -> Result<Tensor> {
        let (conv_state, rule_state) = match cache.as_ref().and_then(|cache| cache.state.clone()) {
            Some(states) => states,
            None => self.zero_states(batch, mixed.dtype(), mixed.device())?,
        };
        let (kernel, channels) = (self.sizes.conv_kernel, self.sizes.conv_dim());
        let weight = self.conv1d.reshape((channels, kernel))?;
        let (convolved, conv_state) = delta::conv_from(mixed, &weight, &conv_state, real)?;
        let inputs = self.rule_inputs(&convolved, b, a)?;
        let heads = self.sizes.value_heads;
        let series = |x: &Tensor| as_series(x, batch * heads, len);
        // Each row's flags for each of its heads.
        let series_real: Vec<u8> = (0..batch)
            .flat_map(|row| {
                let row = &real[row * len..][..len];
                std::iter::repeat_n(row, heads).flatten().copied()
            })
            .collect();
        let (dk, dv) = (self.sizes.key_head_dim, self.sizes.value_head_dim);
        let (out, rule_state) = delta::rule_from(
            &series(&inputs.q)?,
            &series(&inputs.k)?,
            &series(&inputs.v)?,
            &series(&inputs.g)?,
            &series(&inputs.beta)?,
            &rule_state.reshape((batch * heads, dk, dv))?,
            &series_real,
        )?;
        if let Some(cache) = cache {
            cache.state = Some((conv_state, rule_state.reshape((batch, heads, dk, dv))?));
        }
        out.reshape((batch, heads, len, dv))?.transpose(1, 2)
    }

    /// The reference: row by row over each row's real tokens, token by token, from the cached states,
    /// composed of tensor operations (differentiable, on any device).
    fn mix_by_ops(
        &self,
        mixed: &Tensor,
        b: &Tensor,
        a: &Tensor,
        real: &[u8],
        cache: Option<&mut LayerCache>,
    ) -> Result<Tensor> {
        let (batch, len, _) = mixed.dims3()?;
        let (heads, dk, dv) = (
            self.sizes.value_heads,
            self.sizes.key_head_dim,
            self.sizes.value_head_dim,
        );
        let kept = self.sizes.conv_kernel - 1;
        // Half precision computes the convolution and the rule in f32, as transformers does the rule.
        let dtype = mixed.dtype();
        let work = state_dtype(dtype);
        let (mixed, b, a) = (
            &mixed.to_dtype(work)?,
            &b.to_dtype(work)?,
            &a.to_dtype(work)?,
        );
        let (conv_states, rule_states) = match cache.as_ref().and_then(|cache| cache.state.clone())
        {
            Some(states) => states,
            None => self.zero_states(batch, mixed.dtype(), mixed.device())?,
        };
        let (mut outputs, mut next_conv, mut next_rule) = (Vec::new(), Vec::new(), Vec::new());
        for row in 0..batch {
            let columns: Vec<u32> = (0..len as u32)
                .filter(|&t| real[row * len + t as usize] != 0)
                .collect();
            let conv_state = conv_states.narrow(0, row, 1)?;
            let mut state = rule_states.narrow(0, row, 1)?.squeeze(0)?;
            if columns.is_empty() {
                outputs.push(Tensor::zeros(
                    (1, len, heads, dv),
                    mixed.dtype(),
                    mixed.device(),
                )?);
                next_conv.push(conv_state);
                next_rule.push(state.unsqueeze(0)?);
                continue;
            }
            let count = columns.len();
            let index = Tensor::new(columns.as_slice(), mixed.device())?;
            let pick = |x: &Tensor| x.narrow(0, row, 1)?.index_select(&index, 1);
            // The row's last inputs, then its real tokens: [1, K - 1 + n, C].
            let history = conv_state.transpose(1, 2)?;
            let inputs = Tensor::cat(&[&history, &pick(mixed)?], 1)?;
            let convolved = self.convolve(&inputs, count)?;
            next_conv.push(
                inputs
                    .narrow(1, count, kept)?
                    .transpose(1, 2)?
                    .contiguous()?,
            );
            let rule = self.rule_inputs(&convolved, &pick(b)?, &pick(a)?)?;
            let mut tokens = Vec::with_capacity(count);
            for t in 0..count {
                let at = |x: &Tensor| x.narrow(1, t, 1)?.squeeze(1)?.squeeze(0);
                let (q, k, v) = (at(&rule.q)?, at(&rule.k)?, at(&rule.v)?);
                let (g, beta) = (at(&rule.g)?, at(&rule.beta)?);
                // [H, dk, dv]
                state = state.broadcast_mul(&g.exp()?.reshape((heads, 1, 1))?)?;
                let k = k.reshape((heads, dk, 1))?;
                let remembered = state.broadcast_mul(&k)?.sum(1)?;
                let delta = (v - remembered)?.broadcast_mul(&beta.reshape((heads, 1))?)?;
                state = (state + k.broadcast_mul(&delta.reshape((heads, 1, dv))?)?)?;
                let q = q.reshape((heads, dk, 1))?;
                tokens.push(state.broadcast_mul(&q)?.sum(1)?);
            }
            let written = Tensor::stack(&tokens, 0)?;
            let out = Tensor::zeros((len, heads, dv), written.dtype(), written.device())?
                .index_add(&index, &written, 0)?;
            outputs.push(out.unsqueeze(0)?);
            next_rule.push(state.unsqueeze(0)?);
        }
        if let Some(cache) = cache {
            cache.state = Some((Tensor::cat(&next_conv, 0)?, Tensor::cat(&next_rule, 0)?));
        }
        Tensor::cat(&outputs, 0)?.to_dtype(dtype)
    }

    /// Zero states for `batch` rows of a model computing in `dtype`: the convolution's `[B, C, K - 1]`
    /// and the rule's `[B, value_heads, key_dim, value_dim]`, in [`state_dtype`].
    pub(crate) fn zero_states(
        &self,
        batch: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let (sizes, dtype) = (self.sizes, state_dtype(dtype));
        Ok((
            Tensor::zeros(
                (batch, sizes.conv_dim(), sizes.conv_kernel - 1),
                dtype,
                device,
            )?,
            Tensor::zeros(
                (
                    batch,
                    sizes.value_heads,
                    sizes.key_head_dim,
                    sizes.value_head_dim,
                ),
                dtype,
                device,
            )?,
        ))
    }

    /// The causal convolution with SiLU of `inputs` `[B, K - 1 + T, C]` (the `K - 1` inputs before the
    /// first output, then the `T` tokens): `[B, T, C]`.
    fn convolve(&self, inputs: &Tensor, len: usize) -> Result<Tensor> {
        let (kernel, channels) = (self.sizes.conv_kernel, self.sizes.conv_dim());
        let weight = self
            .conv1d
            .reshape((channels, kernel))?
            .to_dtype(inputs.dtype())?;
        let mut sum = inputs
            .narrow(1, 0, len)?
            .broadcast_mul(&weight.narrow(1, 0, 1)?.squeeze(1)?)?;
        for tap in 1..kernel {
            let shifted = inputs.narrow(1, tap, len)?;
            sum = (sum + shifted.broadcast_mul(&weight.narrow(1, tap, 1)?.squeeze(1)?)?)?;
        }
        sum.silu()
    }

    /// The rule's inputs from the convolution's output `[.., T, C]` and the strength and decay
    /// projections `[.., T, value_heads]`.
    fn rule_inputs(&self, convolved: &Tensor, b: &Tensor, a: &Tensor) -> Result<RuleInputs> {
        let sizes = self.sizes;
        let (dk, dv) = (sizes.key_head_dim, sizes.value_head_dim);
        let key_width = sizes.key_heads * dk;
        let dims = convolved.dims().to_vec();
        let leading = &dims[..dims.len() - 1];
        let shape = |heads: usize, width: usize| -> Vec<usize> {
            let mut shape = leading.to_vec();
            shape.extend([heads, width]);
            shape
        };
        let group = sizes.value_heads / sizes.key_heads;
        // Key head h serves value heads h · group .. (h + 1) · group (transformers' repeat_interleave).
        let repeat = |x: Tensor| -> Result<Tensor> {
            if group == 1 {
                return Ok(x);
            }
            let rank = x.rank();
            let mut expanded = x.dims().to_vec();
            expanded.insert(rank - 1, group);
            x.unsqueeze(rank - 1)?
                .broadcast_as(expanded)?
                .contiguous()?
                .reshape(shape(sizes.value_heads, dk))
        };
        let q = convolved
            .narrow(D::Minus1, 0, key_width)?
            .reshape(shape(sizes.key_heads, dk))?;
        let k = convolved
            .narrow(D::Minus1, key_width, key_width)?
            .reshape(shape(sizes.key_heads, dk))?;
        let v = convolved
            .narrow(D::Minus1, 2 * key_width, sizes.value_heads * dv)?
            .reshape(shape(sizes.value_heads, dv))?;
        let q = (l2_normalise(&q)? * (dk as f64).powf(-0.5))?;
        let k = l2_normalise(&k)?;
        let beta = sigmoid(b)?;
        // g = −exp(A_log) · softplus(a + dt_bias).
        let rate = self.a_log.to_dtype(a.dtype())?.exp()?;
        let g = softplus(&a.broadcast_add(&self.dt_bias.to_dtype(a.dtype())?)?)?
            .broadcast_mul(&rate)?
            .neg()?;
        Ok(RuleInputs {
            q: repeat(q)?,
            k: repeat(k)?,
            v,
            g,
            beta,
        })
    }

    /// The normalised, gated output `[.., hidden]` of the rule's `core` `[.., value_heads, value_dim]` with
    /// the gate projection `z` `[.., value_heads · value_dim]`.
    pub(crate) fn output(&self, core: &Tensor, z: &Tensor, ops: Ops) -> Result<Tensor> {
        let (heads, dv) = (self.sizes.value_heads, self.sizes.value_head_dim);
        let rows = core.elem_count() / (heads * dv);
        let core = core.reshape((rows, heads, dv))?;
        let gate = z.reshape((rows, heads, dv))?.silu()?;
        let normed = (self.norm.forward(&core, ops)? * gate)?;
        self.out_proj
            .forward(&normed.reshape((rows, heads * dv))?, ops)
    }

    /// The layer's projections under their module names, in module order.
    pub(crate) fn named(&self) -> Vec<(&'static str, &Linear)> {
        let mut named = self.projections.named();
        named.push(("out_proj", &self.out_proj));
        named
    }

    /// The layer's projections under their module names, and its other weights: the convolution, the
    /// decay's parameters and the norm.
    #[allow(clippy::type_complexity)]
    pub(super) fn parts_mut(
        &mut self,
    ) -> (
        Vec<(&'static str, &mut Linear)>,
        [(&'static str, &mut Tensor); 4],
    ) {
        let GatedDeltaNet {
            projections,
            conv1d,
            dt_bias,
            a_log,
            norm,
            out_proj,
            sizes: _,
        } = self;
        let mut named = projections.named_mut();
        named.push(("out_proj", out_proj));
        (
            named,
            [
                ("conv1d.weight", conv1d),
                ("dt_bias", dt_bias),
                ("A_log", a_log),
                ("norm.weight", &mut norm.weight),
            ],
        )
    }
}

/// The type of the linear-attention states of a model computing in `dtype`: f32 for half precision
/// (the rule accumulates over every token; transformers runs it in f32 too), the model's own otherwise.
pub(crate) fn state_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    }
}

/// `x` `[B, T, H, ..]` as one series per row and head, `[B · H, T, ..]`.
fn as_series(x: &Tensor, series: usize, len: usize) -> Result<Tensor> {
    let x = x.transpose(1, 2)?.contiguous()?;
    match x.rank() {
        4 => {
            let width = x.dim(3)?;
            x.reshape((series, len, width))
        }
        _ => x.reshape((series, len)),
    }
}

/// `x / √(Σx² + 1e-6)` over the last axis, as transformers' `l2norm` (the fla kernels' epsilon).
fn l2_normalise(x: &Tensor) -> Result<Tensor> {
    let norm = (x.sqr()?.sum_keepdim(D::Minus1)? + 1e-6)?.sqrt()?;
    x.broadcast_div(&norm)
}

/// `1 / (1 + e⁻ˣ)`, composed of operations with a backward.
pub(super) fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// `ln(1 + eˣ)`, as `max(x, 0) + ln(1 + e^−|x|)` so that large inputs do not overflow.
fn softplus(x: &Tensor) -> Result<Tensor> {
    x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::*;
    use crate::config::Arch;
    use crate::init::preset_config;
    use crate::testing::{max_difference, random_model};

    /// The tiny Qwen3.5's first layer (linear attention), its weights [`Var`]s.
    fn layer(dtype: DType) -> (GatedDeltaNet, Vec<(String, Var)>) {
        let config = preset_config(Arch::Qwen3_5, crate::init::Preset::Tiny, 41, 1, 2);
        let (model, vars) = random_model(&config, dtype).trainable().unwrap();
        let Mixer::Linear(linear) = model.layers[0].mixer.clone() else {
            panic!("the first layer is linear attention");
        };
        (linear, vars)
    }

    fn inputs(batch: usize, len: usize, dtype: DType) -> Tensor {
        let values: Vec<f64> = (0..batch * len * 64)
            .map(|i| (i as f64 * 0.37).sin() * 1.5)
            .collect();
        Tensor::from_vec(values, (batch, len, 64), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    /// `x` `[B, T, ..]` with the tokens `real` marks 0 zeroed.
    fn real_only(x: &Tensor, real: &[u8]) -> Tensor {
        let (batch, len) = (x.dim(0).unwrap(), x.dim(1).unwrap());
        let mask: Vec<f64> = real.iter().map(|&r| f64::from(r)).collect();
        let mut shape = vec![batch, len];
        shape.extend(std::iter::repeat_n(1, x.rank() - 2));
        let mask = Tensor::from_vec(mask, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(x.dtype())
            .unwrap();
        x.broadcast_mul(&mask).unwrap()
    }

    /// Training's kernel (from a zero state, its backward written out) and sampling's (over real tokens,
    /// from states) compute the reference composed of tensor operations, on left- and right-padded rows;
    /// the backward gives autograd's gradients of every weight and of the input.
    #[test]
    fn the_kernels_and_their_backward_are_the_reference() {
        for (dtype, tolerance) in [(DType::F64, 1e-10), (DType::F32, 2e-5)] {
            let (layer, vars) = layer(dtype);
            let (batch, len) = (3, 70);
            let mut real = vec![1u8; batch * len];
            real[len..len + 5].fill(0); // row 1: left padding
            real[3 * len - 9..].fill(0); // row 2: right padding
            let xs = Var::from_tensor(&inputs(batch, len, dtype)).unwrap();
            let upstream = real_only(
                &inputs(batch, len, dtype)
                    .cos()
                    .unwrap()
                    .narrow(2, 0, 16)
                    .unwrap()
                    .reshape((batch, len, 4, 4))
                    .unwrap()
                    .repeat((1, 1, 1, 4))
                    .unwrap(),
                &real,
            );
            let run = |mix: &dyn Fn(&[Tensor]) -> Result<Tensor>| {
                let projected = layer
                    .projections
                    .forward(xs.as_tensor(), Ops::Differentiable)
                    .unwrap();
                let core = real_only(&mix(&projected).unwrap(), &real);
                let grads = (&core * &upstream)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                (core, grads)
            };
            let (reference, reference_grads) = run(&|p| {
                layer
                    .mix(p, (batch, len), &real, None, Ops::Differentiable)
                    .and_then(|_| {
                        // The reference itself, not the kernel `mix` picks on the CPU.
                        let (mixed, b, a) = (
                            p[0].reshape((batch, len, ())).unwrap(),
                            p[2].reshape((batch, len, ())).unwrap(),
                            p[3].reshape((batch, len, ())).unwrap(),
                        );
                        layer.mix_by_ops(&mixed, &b, &a, &real, None)
                    })
            });
            let (trained, trained_grads) =
                run(&|p| layer.mix(p, (batch, len), &real, None, Ops::Differentiable));
            let (sampled, _) = run(&|p| {
                layer
                    .mix(p, (batch, len), &real, None, Ops::Fast)
                    .map(|t| t.detach())
            });
            assert!(
                max_difference(&trained, &reference) < tolerance,
                "{dtype:?} training: {}",
                max_difference(&trained, &reference)
            );
            assert!(
                max_difference(&sampled, &reference) < tolerance,
                "{dtype:?} sampling: {}",
                max_difference(&sampled, &reference)
            );
            let scale = reference_grads
                .get(xs.as_tensor())
                .map(crate::testing::max_abs)
                .unwrap();
            for (name, var) in vars
                .iter()
                .map(|(name, var)| (name.as_str(), var))
                .filter(|(name, _)| name.starts_with("model.layers.0.linear_attn"))
                .chain([("input", &xs)])
            {
                let (ours, theirs) = (
                    trained_grads.get(var.as_tensor()),
                    reference_grads.get(var.as_tensor()),
                );
                // `mix` stops before the gate, the norm and `out_proj`.
                let (ours, theirs) = match (ours, theirs) {
                    (Some(ours), Some(theirs)) => (ours, theirs),
                    (None, None)
                        if ["in_proj_z", "norm", "out_proj"]
                            .iter()
                            .any(|part| name.contains(part)) =>
                    {
                        continue
                    }
                    _ => panic!("{name}: a gradient is missing"),
                };
                let difference = max_difference(ours, theirs);
                assert!(
                    difference < tolerance * scale.max(1.0),
                    "{dtype:?} {name}: {difference}"
                );
            }
        }
    }

    /// In half precision the convolution and the rule run in f32 and the states are f32: the output is
    /// the f64 layer's to f16's rounding of the projections.
    #[test]
    fn half_precision_runs_the_rule_in_f32() {
        let (exact, _) = layer(DType::F64);
        let (half, _) = layer(DType::F16);
        let (batch, len) = (2, 9);
        let real = vec![1u8; batch * len];
        let run = |layer: &GatedDeltaNet, dtype: DType| {
            let xs = inputs(batch, len, dtype);
            let projected = layer.projections.forward(&xs, Ops::Fast).unwrap();
            let mut cache = LayerCache::default();
            let core = layer
                .mix(&projected, (batch, len), &real, Some(&mut cache), Ops::Fast)
                .unwrap();
            (core, cache.state.unwrap())
        };
        let (expected, _) = run(&exact, DType::F64);
        let (core, (conv, rule)) = run(&half, DType::F16);
        assert_eq!(core.dtype(), DType::F16);
        assert_eq!((conv.dtype(), rule.dtype()), (DType::F32, DType::F32));
        let scale = crate::testing::max_abs(&expected);
        let difference = max_difference(&core.to_dtype(DType::F64).unwrap(), &expected);
        assert!(difference < 2e-2 * scale, "{difference} of {scale}");
    }

    /// Sampling continues from the cached states exactly: a prompt run in chunks, with padding between
    /// them (a row's cached tokens, then the padding of a batch whose other rows have more new tokens),
    /// gives the outputs and states of one pass; the reference agrees.
    #[test]
    fn sampling_in_chunks_continues_from_the_states() {
        let dtype = DType::F64;
        let (layer, _) = layer(dtype);
        let (batch, len) = (2, 12);
        let xs = inputs(batch, len, dtype);
        let projected = layer.projections.forward(&xs, Ops::Fast).unwrap();
        let all = vec![1u8; batch * len];
        let mut whole = LayerCache::default();
        let expected = layer
            .mix(&projected, (batch, len), &all, Some(&mut whole), Ops::Fast)
            .unwrap();
        for by_ops in [false, true] {
            let mut cache = LayerCache::default();
            let mut outputs = Vec::new();
            let mut start = 0;
            for chunk in [5, 1, 6] {
                // Row 1 takes its chunk's tokens one column late, after a padding column.
                let width = chunk + 1;
                let pick = |x: &Tensor, row: usize, from: usize, n: usize| {
                    x.reshape((batch, len, ()))
                        .unwrap()
                        .narrow(0, row, 1)
                        .unwrap()
                        .narrow(1, from, n)
                        .unwrap()
                };
                let mut part = Vec::new();
                for x in &projected {
                    let zero = pick(x, 1, 0, 1).zeros_like().unwrap();
                    let row0 = Tensor::cat(&[&pick(x, 0, start, chunk), &zero], 1).unwrap();
                    let row1 = Tensor::cat(&[&zero, &pick(x, 1, start, chunk)], 1).unwrap();
                    part.push(Tensor::cat(&[&row0, &row1], 0).unwrap());
                }
                let mut real = vec![1u8; chunk];
                real.push(0);
                real.push(0);
                real.extend(std::iter::repeat_n(1u8, chunk));
                let out = match by_ops {
                    false => layer
                        .mix(&part, (batch, width), &real, Some(&mut cache), Ops::Fast)
                        .unwrap(),
                    true => layer
                        .mix_by_ops(&part[0], &part[2], &part[3], &real, Some(&mut cache))
                        .unwrap(),
                };
                outputs.push((
                    out.narrow(0, 0, 1).unwrap().narrow(1, 0, chunk).unwrap(),
                    out.narrow(0, 1, 1).unwrap().narrow(1, 1, chunk).unwrap(),
                ));
                start += chunk;
            }
            let rows: Vec<Tensor> = (0..2)
                .map(|row| {
                    let parts: Vec<&Tensor> = outputs
                        .iter()
                        .map(|(a, b)| if row == 0 { a } else { b })
                        .collect();
                    Tensor::cat(&parts, 1).unwrap()
                })
                .collect();
            let chunked = Tensor::cat(&rows, 0).unwrap();
            assert!(
                max_difference(&chunked, &expected) < 1e-12,
                "by ops {by_ops}: {}",
                max_difference(&chunked, &expected)
            );
            let (conv, rule) = cache.state.clone().unwrap();
            let (whole_conv, whole_rule) = whole.state.clone().unwrap();
            assert!(
                max_difference(&conv, &whole_conv) < 1e-12,
                "by ops {by_ops}"
            );
            assert!(
                max_difference(&rule, &whole_rule) < 1e-12,
                "by ops {by_ops}"
            );
        }
    }
}
