//! Attention: the projections into heads (with their q/k norms), RoPE, the scores over cached and new
//! keys, and the output projection.

use super::*;

/// The attention weights of `xs` over the last axis, computed in f32 for half-precision scores and
/// returned in their type, as transformers computes them (`softmax(..., dtype=torch.float32)`).
pub(crate) fn softmax(xs: &Tensor, ops: Ops) -> Result<Tensor> {
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

/// `cap · tanh(xs / cap)`: Gemma's soft-cap of attention scores and output logits, which bounds them to
/// `(-cap, cap)` and leaves small ones nearly as they are. Differentiable (candle's `tanh` has a
/// backward); the written-out backward multiplies by its derivative `1 − (capped / cap)²`.
pub(crate) fn softcap(xs: &Tensor, cap: f64) -> Result<Tensor> {
    (xs / cap)?.tanh()? * cap
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
    pub(crate) qk_norm: QkNorm,
    /// What the scores `q · k` are multiplied by: `1/√head_dim`, or Gemma's `1/√query_pre_attn_scalar`.
    pub(crate) scale: f64,
    /// The soft-cap of the scaled scores, before the mask ([`crate::config::Variant::attention_softcap`]).
    pub(crate) softcap: Option<f64>,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    /// The output is multiplied by the sigmoid of a gate projected with the queries
    /// ([`crate::config::Variant::attention_gate`]).
    pub(crate) gated: bool,
    /// A logit per head (`sinks` `[heads]`) joined to each row of scores in the softmax, its weight
    /// dropped after ([`crate::config::Variant::attention_sinks`]).
    pub sinks: Option<Tensor>,
}

impl Attention {
    pub(super) fn load(vb: VarBuilder, config: &ModelConfig) -> Result<Self> {
        let (hidden, head_dim) = (config.hidden_size, config.head_dim);
        let (heads, kv_heads) = (config.num_attention_heads, config.num_key_value_heads);
        let gated = config.variant.attention_gate;
        let query_width = heads * head_dim * if gated { 2 } else { 1 };
        Ok(Attention {
            qkv: Split::load(
                &vb,
                hidden,
                vec![
                    ("q_proj", query_width),
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
            softcap: config.variant.attention_softcap,
            heads,
            kv_heads,
            head_dim,
            gated,
            sinks: config
                .variant
                .attention_sinks
                .then(|| vb.get(heads, "sinks"))
                .transpose()?,
        })
    }

    /// The queries `[.., heads · head_dim]` of the query projection's output, and the output gate when
    /// the layer has one (each head's query, then its gate, as transformers' Qwen3.5 lays them out).
    pub(crate) fn queries(&self, projected: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        if !self.gated {
            return Ok((projected.clone(), None));
        }
        let dims = projected.dims();
        let leading = &dims[..dims.len() - 1];
        let shape = |last: &[usize]| -> Vec<usize> { [leading, last].concat() };
        let per_head = projected.reshape(shape(&[self.heads, 2 * self.head_dim]))?;
        let part = |start: usize| -> Result<Tensor> {
            per_head
                .narrow(D::Minus1, start, self.head_dim)?
                .contiguous()?
                .reshape(shape(&[self.heads * self.head_dim]))
        };
        Ok((part(0)?, Some(part(self.head_dim)?)))
    }

    /// Attention's output `[.., heads · head_dim]` times the sigmoid of its `gate`, when it has one.
    pub(crate) fn gate(output: Tensor, gate: Option<&Tensor>) -> Result<Tensor> {
        match gate {
            Some(gate) => output * super::delta::sigmoid(gate)?,
            None => Ok(output),
        }
    }

    /// `xs` `[B, T, hidden]`; `mask` `[B, 1, T, S]` additive (0 or -inf) over the `S` keys the layer
    /// reads, cached keys first (those `cache` holds, past its [`LayerCache::front`]).
    pub(super) fn forward(
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
        let (q, gate) = self.queries(&q)?;
        let q = heads(&q, self.heads, self.q_norm.as_ref())?;
        let k = heads(&k, self.kv_heads, self.k_norm.as_ref())?;
        let v = heads(&v, self.kv_heads, None)?;
        let out = self.attend(&q, &k, &v, rope, mask, cache, ops)?;
        self.o_proj.forward(&Self::gate(out, gate.as_ref())?, ops)
    }

    /// A projection's output `[B, T, heads · head_dim]` (or `[B · T, ..]`) as heads
    /// `[B, heads, T, head_dim]`, normalised by `norm` when the family has one (over each head, or over
    /// the whole projection first).
    pub(crate) fn split_heads(
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
    pub(super) fn attend(
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
            return crate::kernels::invariant::attention(
                &q,
                &k,
                &v,
                mask,
                (scale, self.softcap),
                self.sinks.as_ref(),
            );
        }
        // A prefill's queries in blocks against tiles of keys: neither its scores nor copies of keys per
        // query head are held whole, and the keys its mask hides are not visited.
        if ops == Ops::Fast
            && q.dtype() == DType::F32
            && crate::kernels::kernel::takes(&q, &[&k, &v, mask])
        {
            return crate::kernels::flash::attention(
                &q,
                &k,
                &v,
                mask,
                (scale, self.softcap),
                self.sinks.as_ref(),
            );
        }
        let keys = k.dim(2)?;
        // Query head h reads key head h / group: grouping the query heads of one key head along the
        // sequence axis makes one matrix product per key head, without copying keys.
        let group = self.heads / self.kv_heads;
        let q = q
            .contiguous()?
            .reshape((batch, self.kv_heads, group * len, self.head_dim))?;
        let scores = (q.matmul(&k.t()?)? * scale)?;
        let scores = match self.softcap {
            Some(cap) => softcap(&scores, cap)?,
            None => scores,
        };
        let scores = scores
            .reshape((batch, self.heads, len, keys))?
            .broadcast_add(mask)?;
        let weights = match &self.sinks {
            None => softmax(&scores, ops)?,
            // Each row's sink as one more key, whose weight is then dropped (transformers'
            // `eager_attention_forward` of gpt-oss).
            Some(sinks) => {
                let sinks = sinks
                    .to_dtype(scores.dtype())?
                    .reshape((1, self.heads, 1, 1))?
                    .broadcast_as((batch, self.heads, len, 1))?;
                let joined = Tensor::cat(&[&scores, &sinks], 3)?;
                softmax(&joined, ops)?.narrow(3, 0, keys)?
            }
        };
        let weights = weights
            .contiguous()?
            .reshape((batch, self.kv_heads, group * len, keys))?;
        weights
            .matmul(&v)?
            .reshape((batch, self.heads, len, self.head_dim))?
            .transpose(1, 2)?
            .reshape((batch, len, self.heads * self.head_dim))
    }
}
