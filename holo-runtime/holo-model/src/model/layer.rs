//! A decoder layer: its norms by role, attention, the MLP and the residuals.

use super::*;
use crate::balance::Balance;

#[derive(Debug, Clone)]
pub struct Mlp {
    /// The gate and up projections (`gate_proj`, `up_proj`, or Phi-3's `gate_up_proj`).
    pub gate_up: Split,
    pub down_proj: Linear,
    pub(crate) activation: Activation,
    /// gpt-oss's experts: the clamped SwiGLU in place of `activation(gate) · up`.
    pub(crate) clamped: Option<ClampedSwiGlu>,
}

impl Mlp {
    /// An MLP of inner size `inner` (`intermediate_size`, or an expert's `moe_intermediate_size`).
    pub(super) fn load(vb: VarBuilder, config: &ModelConfig, inner: usize) -> Result<Self> {
        let (hidden, bias) = (config.hidden_size, config.mlp_bias);
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
            clamped: None,
        })
    }

    pub(super) fn forward(&self, xs: &Tensor, ops: Ops) -> Result<Tensor> {
        let [gate, up]: [Tensor; 2] = self
            .gate_up
            .forward(xs, ops)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("two projections".into()))?;
        self.down_proj.forward(&self.gated(&gate, &up, ops)?, ops)
    }

    /// The down projection's input from the gate's and up projection's outputs.
    pub(crate) fn gated(&self, gate: &Tensor, up: &Tensor, ops: Ops) -> Result<Tensor> {
        match self.clamped {
            Some(clamped) => Self::clamped(clamped, gate, up),
            None => self.activate(gate, ops)? * up,
        }
    }

    /// gpt-oss's `(up + 1) · gate · σ(alpha · gate)`, `gate` clamped above at the limit and `up` on
    /// both sides (`GptOssExperts._apply_gate`).
    fn clamped(clamped: ClampedSwiGlu, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let limit = clamped.limit;
        let gate = gate.minimum(limit)?;
        let up = up.clamp(-limit, limit)?;
        let glu = (&gate * super::delta::sigmoid(&(&gate * clamped.alpha)?)?)?;
        (up + 1.0)? * glu
    }

    /// The gate's activation.
    pub(crate) fn activate(&self, gate: &Tensor, ops: Ops) -> Result<Tensor> {
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

/// What a layer runs on each token after attention (`mlp`).
#[derive(Debug, Clone)]
pub enum FeedForward {
    /// One MLP for every token.
    Dense(Mlp),
    /// Routed experts ([`Mixture`]).
    Experts(Mixture),
}

impl FeedForward {
    /// The dense MLP, when this is one.
    pub fn dense(&self) -> Option<&Mlp> {
        match self {
            FeedForward::Dense(mlp) => Some(mlp),
            FeedForward::Experts(_) => None,
        }
    }

    pub(crate) fn forward(
        &self,
        xs: &Tensor,
        ops: Ops,
        routing: Option<&Routing>,
        balance: Option<&Balance>,
    ) -> Result<Tensor> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(xs, ops),
            FeedForward::Experts(mixture) => mixture.forward(xs, ops, routing, balance),
        }
    }

    /// The projections under their names in the layer's `mlp` (`gate_proj`, …; `gate` and
    /// `experts.{e}.gate_proj`, … for a mixture, then Qwen3.5's `shared_expert.gate_proj`, … and
    /// `shared_expert_gate`).
    pub(crate) fn named(&self) -> Vec<(String, &Linear)> {
        fn mlp_named<'a>(mlp: &'a Mlp, prefix: &str) -> Vec<(String, &'a Linear)> {
            let mut named: Vec<(String, &Linear)> = mlp
                .gate_up
                .named()
                .into_iter()
                .map(|(name, linear)| (format!("{prefix}{name}"), linear))
                .collect();
            named.push((format!("{prefix}down_proj"), &mlp.down_proj));
            named
        }
        match self {
            FeedForward::Dense(mlp) => mlp_named(mlp, ""),
            FeedForward::Experts(mixture) => {
                let mut named = vec![(mixture.router_name().to_string(), &mixture.router)];
                for (e, expert) in mixture.experts.iter().enumerate() {
                    named.extend(mlp_named(expert, &format!("experts.{e}.")));
                }
                if let Some(shared) = &mixture.shared {
                    named.extend(mlp_named(&shared.mlp, "shared_expert."));
                    named.push(("shared_expert_gate".to_string(), &shared.gate));
                }
                named
            }
        }
    }

    pub(crate) fn named_mut(&mut self) -> Vec<(String, &mut Linear)> {
        fn mlp_named<'a>(mlp: &'a mut Mlp, prefix: &str) -> Vec<(String, &'a mut Linear)> {
            let Mlp {
                gate_up, down_proj, ..
            } = mlp;
            let mut named: Vec<(String, &mut Linear)> = gate_up
                .named_mut()
                .into_iter()
                .map(|(name, linear)| (format!("{prefix}{name}"), linear))
                .collect();
            named.push((format!("{prefix}down_proj"), down_proj));
            named
        }
        match self {
            FeedForward::Dense(mlp) => mlp_named(mlp, ""),
            FeedForward::Experts(mixture) => {
                let router = mixture.router_name().to_string();
                let Mixture {
                    router: router_linear,
                    experts,
                    shared,
                    ..
                } = mixture;
                let mut named = vec![(router, router_linear)];
                for (e, expert) in experts.iter_mut().enumerate() {
                    named.extend(mlp_named(expert, &format!("experts.{e}.")));
                }
                if let Some(SharedExpert { mlp, gate }) = shared.as_deref_mut() {
                    named.extend(mlp_named(mlp, "shared_expert."));
                    named.push(("shared_expert_gate".to_string(), gate));
                }
                named
            }
        }
    }
}

/// How a layer mixes information across tokens.
#[derive(Debug, Clone)]
pub enum Mixer {
    /// Softmax attention over the keys and values of earlier tokens (`self_attn`).
    Attention(Attention),
    /// Gated DeltaNet linear attention, a fixed-size state per sequence (`linear_attn`).
    Linear(GatedDeltaNet),
}

impl Mixer {
    /// The module name its weights are under.
    pub fn module(&self) -> &'static str {
        match self {
            Mixer::Attention(_) => "self_attn",
            Mixer::Linear(_) => "linear_attn",
        }
    }

    /// The softmax attention, when this is one.
    pub fn attention(&self) -> Option<&Attention> {
        match self {
            Mixer::Attention(attention) => Some(attention),
            Mixer::Linear(_) => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub mixer: Mixer,
    pub mlp: FeedForward,
    /// Before attention (none in OLMo 2 and 3).
    pub input_layernorm: Option<RmsNorm>,
    /// Before the MLP with [`NormPlacement::Pre`], on attention's output otherwise.
    pub post_attention_layernorm: RmsNorm,
    /// Before the MLP (Gemma 3).
    pub pre_feedforward_layernorm: Option<RmsNorm>,
    /// On the MLP's output (OLMo 2 and 3, Gemma 3).
    pub post_feedforward_layernorm: Option<RmsNorm>,
    pub(crate) placement: NormPlacement,
    /// Its attention window and whether it rotates ([`ModelConfig::layers`]).
    pub spec: LayerSpec,
}

/// A layer's norms by what they normalise: attention's input and output, the MLP's input and output.
pub(crate) struct LayerNorms<'a> {
    pub(crate) attention_input: Option<&'a RmsNorm>,
    pub(crate) attention_output: Option<&'a RmsNorm>,
    pub(crate) mlp_input: Option<&'a RmsNorm>,
    pub(crate) mlp_output: Option<&'a RmsNorm>,
}

impl DecoderLayer {
    /// A copy whose weights, biases, norms and adapters share this layer's storage but are not tracked
    /// by autograd.
    pub(crate) fn detached(&self) -> DecoderLayer {
        let Ok(layer) =
            self.map_tensors(&mut |tensor| Ok::<_, std::convert::Infallible>(tensor.detach()));
        layer
    }

    /// A copy with `f(tensor)` in place of every weight, bias, norm and adapter tensor.
    pub(crate) fn map_tensors<E>(
        &self,
        f: &mut impl FnMut(&Tensor) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<DecoderLayer, E> {
        let mut layer = self.clone();
        for norm in [
            layer.input_layernorm.as_mut(),
            Some(&mut layer.post_attention_layernorm),
            layer.pre_feedforward_layernorm.as_mut(),
            layer.post_feedforward_layernorm.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            norm.weight = f(&norm.weight)?;
        }
        for (_, tensor) in Model::parts_mut(&mut layer.mixer, &mut layer.mlp).1 {
            *tensor = f(tensor)?;
        }
        for (_, linear) in Model::linears_mut(&mut layer.mixer, &mut layer.mlp) {
            linear.weight = linear.weight.map_dense(f)?;
            linear.bias = linear.bias.as_ref().map(&mut *f).transpose()?;
            if let Some(lora) = &mut linear.lora {
                lora.a = f(&lora.a)?;
                lora.b = f(&lora.b)?;
            }
        }
        if let FeedForward::Experts(mixture) = &mut layer.mlp {
            for lora in &mut mixture.adapters {
                lora.a = f(&lora.a)?;
                lora.b = f(&lora.b)?;
            }
        }
        Ok(layer)
    }

    /// The layer's norms by what they normalise, as its family places them.
    pub(crate) fn norms(&self) -> LayerNorms<'_> {
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

    pub(super) fn load(
        vb: VarBuilder,
        config: &ModelConfig,
        spec: LayerSpec,
        index: usize,
    ) -> Result<Self> {
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
            mixer: match spec.linear {
                true => Mixer::Linear(GatedDeltaNet::load(vb.pp("linear_attn"), config)?),
                false => Mixer::Attention(Attention::load(vb.pp("self_attn"), config)?),
            },
            mlp: match spec.experts {
                true => FeedForward::Experts(Mixture::load(vb.pp("mlp"), config, index)?),
                false => {
                    FeedForward::Dense(Mlp::load(vb.pp("mlp"), config, config.intermediate_size)?)
                }
            },
            post_attention_layernorm: RmsNorm::load(
                vb.pp("post_attention_layernorm"),
                hidden,
                config,
            )?,
        })
    }

    pub(crate) fn forward(
        &self,
        xs: &Tensor,
        frame: &Frame,
        cache: Option<&mut LayerCache>,
        ops: Ops,
    ) -> Result<Tensor> {
        let norms = self.norms();
        let normed = norm(norms.attention_input, xs, ops)?;
        let mixed = match &self.mixer {
            Mixer::Attention(attention) => attention.forward(
                &normed,
                frame.rope(self.spec),
                frame.mask(self.spec, cache.as_ref().map_or(0, |cache| cache.front()))?,
                cache,
                ops,
            )?,
            Mixer::Linear(linear) => linear.forward(&normed, frame.real()?, cache, ops)?,
        };
        self.finish(
            xs,
            &mixed,
            ops,
            frame.routing.as_deref(),
            frame.balance.as_deref(),
        )
    }

    /// The rest of the layer after attention: `attended` (after `o_proj`) normalised where the family
    /// does, added to the input `xs`, then the MLP (experts routed by `routing`, if given) and its
    /// residual; a mixture's router probabilities go to `balance`, if given.
    pub(crate) fn finish(
        &self,
        xs: &Tensor,
        attended: &Tensor,
        ops: Ops,
        routing: Option<&Routing>,
        balance: Option<&Balance>,
    ) -> Result<Tensor> {
        let norms = self.norms();
        let xs = (xs + norm(norms.attention_output, attended, ops)?)?;
        let mlp = self
            .mlp
            .forward(&norm(norms.mlp_input, &xs, ops)?, ops, routing, balance)?;
        xs + norm(norms.mlp_output, &mlp, ops)?
    }
}

/// `xs` through `norm`, or unchanged without one.
pub(super) fn norm(norm: Option<&RmsNorm>, xs: &Tensor, ops: Ops) -> Result<Tensor> {
    match norm {
        Some(norm) => norm.forward(xs, ops),
        None => Ok(xs.clone()),
    }
}
