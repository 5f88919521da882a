//! A mixture of experts in place of the MLP (`qwen3_moe`'s sparse blocks, `gpt_oss`'s): a router scores
//! every expert for each token, the `per_token` best run on it, and the layer's output is their SwiGLU
//! outputs weighted by the router's softmax at them (renormalised over the chosen ones where the config
//! says so), as `Qwen3MoeSparseMoeBlock` computes it; or, for gpt-oss, by the softmax of the chosen
//! experts' logits (`GptOssTopKRouter`), the experts' clamped SwiGLU with biases. Qwen3.5's mixture
//! (`Qwen3_5MoeSparseMoeBlock`) routes as Qwen3-MoE's, renormalised, and adds a shared expert every
//! token goes through, scaled by the sigmoid of its own gate ([`SharedExpert`]).
//!
//! The experts run grouped: each expert's tokens are gathered into one matrix product, never a dense
//! loop of every expert over every token. The choice itself is made on the host (a top-k of each
//! token's probabilities) and can be replaced by a recorded one ([`Routing`]): routing replay, so that
//! a trainer computes the log-probabilities of sampled tokens through the experts the sampler used.
//!
//! LoRA reaches the experts as PEFT's `target_parameters` do ([`ExpertLora`]): one low-rank update per
//! expert on transformers 5's stacked `experts.gate_up_proj` and `experts.down_proj`, applied unmerged
//! on every path (sampling included, as the projections' adapters are), merged only by `holo export`.

use std::collections::HashMap;

use super::*;
use crate::balance::Balance;
use crate::config::{Arch, ClampedSwiGlu};
use crate::routing::Routing;

#[derive(Debug, Clone)]
pub struct Mixture {
    /// The router (`mlp.gate`; gpt-oss's `mlp.router`, with a bias): one logit per expert,
    /// `[experts, hidden]`.
    pub router: Linear,
    /// The experts (`mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`; gpt-oss's, with biases, are
    /// held so too and stacked as transformers names them in [`checkpoint_tensors`]).
    pub experts: Vec<Mlp>,
    pub(crate) per_token: usize,
    pub(crate) normalize: bool,
    /// The weights are the softmax of the chosen experts' logits ([`crate::config::Experts`]).
    pub(crate) softmax_over_chosen: bool,
    /// The layer's index, under which [`Routing`] records and replays its choices.
    pub(crate) layer: usize,
    /// LoRA on the expert stacks ([`Model::with_lora`]'s `parameters`), in [`ExpertStack::ALL`]'s order.
    pub adapters: Vec<ExpertLora>,
    /// Qwen3.5's shared expert (boxed: the other families' mixtures, and every dense layer's
    /// [`FeedForward`], do without it).
    pub shared: Option<Box<SharedExpert>>,
}

/// Qwen3.5's shared expert ([`crate::config::Experts::shared`]): an MLP every token goes through
/// (`mlp.shared_expert`), its output multiplied by `σ(gate · x)` (`mlp.shared_expert_gate`, `[1, hidden]`)
/// and added to the routed experts'.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    pub mlp: Mlp,
    pub gate: Linear,
}

impl SharedExpert {
    /// The shared expert of `inner` (`shared_expert_intermediate_size`) under the mixture's `vb`.
    fn load(vb: &VarBuilder, config: &ModelConfig, inner: usize) -> Result<Self> {
        Ok(SharedExpert {
            mlp: Mlp::load(vb.pp("shared_expert"), config, inner)?,
            gate: Linear::load(vb.pp("shared_expert_gate"), config.hidden_size, 1, false)?,
        })
    }

    /// Its gated output for `xs` `[tokens, hidden]`.
    fn forward(&self, xs: &Tensor, ops: Ops) -> Result<Tensor> {
        let gate = super::delta::sigmoid(&self.gate.forward(xs, ops)?)?;
        self.mlp.forward(xs, ops)?.broadcast_mul(&gate)
    }
}

/// A stack of the experts' matrices that LoRA can target by its parameter name in transformers 5's
/// experts module (PEFT's `target_parameters`, e.g. `mlp.experts.gate_up_proj`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertStack {
    /// `gate_up_proj`: hidden → the gate's and up projection's outputs side by side (Qwen3-MoE: gate
    /// rows then up rows; gpt-oss: interleaved, gate first).
    GateUp,
    /// `down_proj`: inner → hidden.
    Down,
}

impl ExpertStack {
    /// In the order of the experts module's parameters, which is the order PEFT wraps them in: with
    /// both targeted, `gate_up_proj`'s wrapper is the inner one (`experts.base_layer.lora_A`).
    pub const ALL: [ExpertStack; 2] = [ExpertStack::GateUp, ExpertStack::Down];

    /// The parameter's name in the experts module.
    pub fn name(self) -> &'static str {
        match self {
            ExpertStack::GateUp => "gate_up_proj",
            ExpertStack::Down => "down_proj",
        }
    }

    /// The stack a PEFT `target_parameters` entry names: the parameter's name, alone or under
    /// `experts.`/`mlp.experts.` (PEFT matches a parameter's full name or any dotted suffix of it).
    pub fn named(target: &str) -> Option<ExpertStack> {
        ExpertStack::ALL.into_iter().find(|stack| {
            let full = format!("mlp.experts.{}", stack.name());
            full == target || full.ends_with(&format!(".{target}"))
        })
    }
}

/// LoRA on one stack of expert matrices as PEFT's `ParamWrapper` holds it: one `A` `[experts · rank,
/// in]` whose rows `e·rank ..` are expert `e`'s, and one `B` `[out, rank · experts]` whose columns
/// `j·experts + e` are expert `e`'s (PEFT reshapes `B` to `[out, rank, experts]`). Expert `e`'s matrix,
/// taken as `[out, in]`, gains `scale · Bₑ Aₑ` (`in`/`out` are the projection's whichever way the family
/// stores the stack); its bias is untouched.
#[derive(Debug, Clone)]
pub struct ExpertLora {
    pub stack: ExpertStack,
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
}

impl ExpertLora {
    /// Expert `e`'s `Aₑ` `[rank, in]` and `Bₑ` `[out, rank]` of `experts`.
    fn factors(&self, e: usize, experts: usize) -> Result<(Tensor, Tensor)> {
        let rank = self.a.dim(0)? / experts;
        let out = self.b.dim(0)?;
        let a = self.a.narrow(0, e * rank, rank)?;
        let b = self
            .b
            .reshape((out, rank, experts))?
            .narrow(2, e, 1)?
            .squeeze(2)?
            .contiguous()?;
        Ok((a, b))
    }

    /// `scale · (xs Aₑᵀ) Bₑᵀ` for `xs` `[rows, in]`, in the adapter's type and returned in `xs`'s.
    fn update(&self, xs: &Tensor, e: usize, experts: usize) -> Result<Tensor> {
        let (a, b) = self.factors(e, experts)?;
        let low = xs.to_dtype(a.dtype())?.matmul(&a.t()?)?;
        (low.matmul(&b.t()?)? * self.scale)?.to_dtype(xs.dtype())
    }

    /// `scale · Bₑ Aₑ` `[out, in]`: what merging adds to expert `e`'s matrix.
    fn delta(&self, e: usize, experts: usize) -> Result<Tensor> {
        let (a, b) = self.factors(e, experts)?;
        b.matmul(&a)? * self.scale
    }
}

impl Mixture {
    /// Loads the experts as transformers saves them (one module per expert, `experts.{e}.gate_proj`),
    /// or fused as transformers 5 holds them in memory (`experts.gate_up_proj` `[E, 2I, H]`, each
    /// expert's gate rows then its up rows, and `experts.down_proj` `[E, H, I]`).
    pub(super) fn load(vb: VarBuilder, config: &ModelConfig, layer: usize) -> Result<Self> {
        let Some(sizes) = config.experts else {
            candle_core::bail!("layer {layer} has experts but the config gives no expert sizes");
        };
        let (hidden, inner) = (config.hidden_size, sizes.intermediate_size);
        if let Some(clamped) = sizes.clamped {
            return Ok(Mixture {
                router: Linear::load(vb.pp("router"), hidden, sizes.count, true)?,
                experts: interleaved(vb.pp("experts"), config, clamped)?,
                per_token: sizes.per_token,
                normalize: sizes.normalize,
                softmax_over_chosen: sizes.softmax_over_chosen,
                layer,
                adapters: Vec::new(),
                shared: None,
            });
        }
        let router = Linear::load(vb.pp("gate"), hidden, sizes.count, false)?;
        let experts = vb.pp("experts");
        let experts = if experts.contains_tensor("gate_up_proj") {
            let gate_up = experts.get((sizes.count, 2 * inner, hidden), "gate_up_proj")?;
            let down = experts.get((sizes.count, hidden, inner), "down_proj")?;
            let linear =
                |weight: Tensor| -> Result<Linear> { Ok(Linear::dense(weight.contiguous()?)) };
            (0..sizes.count)
                .map(|e| {
                    let gate_up = gate_up.get(e)?;
                    Ok(Mlp {
                        gate_up: Split::of(
                            vec![("gate_proj", inner), ("up_proj", inner)],
                            vec![
                                linear(gate_up.narrow(0, 0, inner)?)?,
                                linear(gate_up.narrow(0, inner, inner)?)?,
                            ],
                        ),
                        down_proj: linear(down.get(e)?)?,
                        activation: config.variant.activation,
                        clamped: None,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..sizes.count)
                .map(|e| Mlp::load(experts.pp(e.to_string()), config, inner))
                .collect::<Result<Vec<_>>>()?
        };
        let shared = sizes
            .shared
            .map(|inner| SharedExpert::load(&vb, config, inner).map(Box::new))
            .transpose()?;
        Ok(Mixture {
            router,
            experts,
            per_token: sizes.per_token,
            normalize: sizes.normalize,
            softmax_over_chosen: sizes.softmax_over_chosen,
            layer,
            adapters: Vec::new(),
            shared,
        })
    }

    /// The router's module name in the layer's `mlp`: gpt-oss's (the family whose experts are clamped)
    /// is `router`, Qwen3-MoE's `gate`.
    pub(crate) fn router_name(&self) -> &'static str {
        match self
            .experts
            .first()
            .is_some_and(|expert| expert.clamped.is_some())
        {
            true => "router",
            false => "gate",
        }
    }

    /// The output `[.., hidden]` for `xs` `[.., hidden]`: each token through its chosen experts (by the
    /// router, or replayed from `routing`), which `routing` records. The router's probabilities and
    /// own choice go to `balance`, if given.
    pub(crate) fn forward(
        &self,
        xs: &Tensor,
        ops: Ops,
        routing: Option<&Routing>,
        balance: Option<&Balance>,
    ) -> Result<Tensor> {
        let hidden = xs.dim(D::Minus1)?;
        let flat = xs.reshape(((), hidden))?;
        let tokens = flat.dim(0)?;
        let k = self.per_token;
        // transformers takes the softmax in float32 whatever the model's type; an f64 model keeps f64.
        let logits = self.router.forward(&flat, ops)?;
        let logits = match logits.dtype() {
            DType::F64 => logits,
            _ => logits.to_dtype(DType::F32)?,
        };
        // gpt-oss chooses by the logits themselves (the same order, without the softmax's rounding).
        let scores = match self.softmax_over_chosen {
            true => logits.clone(),
            false => softmax(&logits, ops)?,
        };
        let own = top_k(&scores.to_dtype(DType::F64)?.to_vec2::<f64>()?, k);
        if let Some(balance) = balance {
            // transformers' loss takes the softmax over every expert, gpt-oss's included, and the
            // top-k of it: the order of the logits, so `own` is that choice for both.
            let probabilities = match self.softmax_over_chosen {
                true => softmax(&logits, ops)?,
                false => scores.clone(),
            };
            balance.observe(self.layer, &probabilities, &own, k)?;
        }
        let chosen = match routing {
            Some(routing) => routing.choose(self.layer, own, k)?,
            None => own,
        };
        if let Some(&expert) = chosen.iter().find(|&&e| e as usize >= self.experts.len()) {
            candle_core::bail!(
                "routing replay names expert {expert} in layer {}, which has {}",
                self.layer,
                self.experts.len()
            );
        }

        let index = Tensor::from_vec(chosen.clone(), (tokens, k), xs.device())?;
        let mut weights = match self.softmax_over_chosen {
            true => softmax(&logits.gather(&index, 1)?, ops)?,
            false => scores.gather(&index, 1)?,
        };
        if self.normalize {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        let weights = weights.to_dtype(xs.dtype())?.flatten_all()?;

        // Each expert's (token, slot) pairs, experts in order, tokens in order within each.
        let mut slots: Vec<Vec<u32>> = vec![Vec::new(); self.experts.len()];
        for (slot, &expert) in chosen.iter().enumerate() {
            slots[expert as usize].push(slot as u32);
        }
        let mut outputs = Vec::new();
        let mut rows = Vec::with_capacity(tokens * k);
        for (expert, slots) in slots.iter().enumerate() {
            if slots.is_empty() {
                continue;
            }
            let tokens_of: Vec<u32> = slots.iter().map(|&slot| slot / k as u32).collect();
            let at = Tensor::from_vec(tokens_of.clone(), tokens_of.len(), xs.device())?;
            let slot_at = Tensor::from_vec(slots.clone(), slots.len(), xs.device())?;
            let output = self.expert_forward(expert, &flat.index_select(&at, 0)?, ops)?;
            let weight = weights.index_select(&slot_at, 0)?.unsqueeze(1)?;
            outputs.push(output.broadcast_mul(&weight)?);
            rows.extend(tokens_of);
        }
        // One sum into the output, each token's experts added in expert order (as transformers adds
        // them).
        let rows = Tensor::from_vec(rows, tokens * k, xs.device())?;
        let summed = flat
            .zeros_like()?
            .index_add(&rows, &Tensor::cat(&outputs, 0)?, 0)?;
        let summed = match &self.shared {
            Some(shared) => (summed + shared.forward(&flat, ops)?)?,
            None => summed,
        };
        summed.reshape(xs.shape())
    }

    /// Expert `e`'s output for its tokens `xs` `[rows, hidden]`, through its adapters if it has any.
    fn expert_forward(&self, e: usize, xs: &Tensor, ops: Ops) -> Result<Tensor> {
        let expert = &self.experts[e];
        if self.adapters.is_empty() {
            return expert.forward(xs, ops);
        }
        let count = self.experts.len();
        let [mut gate, mut up]: [Tensor; 2] = expert
            .gate_up
            .forward(xs, ops)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("two projections".into()))?;
        if let Some(lora) = self.adapter(ExpertStack::GateUp) {
            let [gate_update, up_update] = self.halves(&lora.update(xs, e, count)?, 1)?;
            gate = (gate + gate_update)?;
            up = (up + up_update)?;
        }
        let gated = expert.gated(&gate, &up, ops)?;
        let output = expert.down_proj.forward(&gated, ops)?;
        match self.adapter(ExpertStack::Down) {
            Some(lora) => output + lora.update(&gated, e, count)?,
            None => Ok(output),
        }
    }

    fn adapter(&self, stack: ExpertStack) -> Option<&ExpertLora> {
        self.adapters.iter().find(|lora| lora.stack == stack)
    }

    /// The gate's and the up projection's halves of `fused` along `axis` (its `2·inner` side):
    /// interleaved for gpt-oss (the family whose experts are clamped), gate then up for Qwen3-MoE.
    fn halves(&self, fused: &Tensor, axis: usize) -> Result<[Tensor; 2]> {
        let inner = fused.dim(axis)? / 2;
        let interleaved = self.experts.first().is_some_and(|e| e.clamped.is_some());
        let half = |which: usize| -> Result<Tensor> {
            match interleaved {
                true => {
                    let mut dims = fused.dims().to_vec();
                    dims[axis] = inner;
                    dims.insert(axis + 1, 2);
                    fused
                        .reshape(dims)?
                        .narrow(axis + 1, which, 1)?
                        .squeeze(axis + 1)?
                        .contiguous()
                }
                false => fused.narrow(axis, which * inner, inner)?.contiguous(),
            }
        };
        Ok([half(0)?, half(1)?])
    }

    /// The same mixture with its adapters' updates added to the experts' matrices and no adapters:
    /// what `holo export` writes for an adapted model.
    pub fn merged(&self) -> Result<Mixture> {
        let mut merged = self.clone();
        merged.adapters.clear();
        let count = self.experts.len();
        for (e, expert) in merged.experts.iter_mut().enumerate() {
            for lora in &self.adapters {
                let delta = lora.delta(e, count)?;
                let add = |linear: &mut Linear, delta: Tensor| -> Result<()> {
                    let weight = linear.weight.dense()?;
                    linear.weight = Weight::Dense((weight + delta.to_dtype(weight.dtype())?)?);
                    Ok(())
                };
                match lora.stack {
                    ExpertStack::GateUp => {
                        let [gate, up] = self.halves(&delta, 0)?;
                        for (linear, delta) in expert.gate_up.linears.iter_mut().zip([gate, up]) {
                            add(linear, delta)?;
                        }
                    }
                    ExpertStack::Down => add(&mut expert.down_proj, delta)?,
                }
            }
        }
        Ok(merged)
    }
}

/// The `k` largest entries' indices of each row, largest first (the lower index first among equals).
fn top_k(rows: &[Vec<f64>], k: usize) -> Vec<u32> {
    let mut chosen = Vec::with_capacity(rows.len() * k);
    let mut order: Vec<u32> = Vec::new();
    for row in rows {
        order.clear();
        order.extend(0..row.len() as u32);
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        chosen.extend_from_slice(&order[..k]);
    }
    chosen
}

/// gpt-oss's experts: one [`Mlp`] per expert, with biases and the clamped SwiGLU, from the per-expert
/// tensors [`held_tensors`] splits a checkpoint's stacks into (what a folder loads through), or from
/// transformers' stacks themselves.
fn interleaved(vb: VarBuilder, config: &ModelConfig, clamped: ClampedSwiGlu) -> Result<Vec<Mlp>> {
    let Some(sizes) = config.experts else {
        candle_core::bail!("gpt-oss experts without sizes");
    };
    let (count, hidden, inner) = (sizes.count, config.hidden_size, sizes.intermediate_size);
    let linear = |weight: Tensor, bias: Tensor| Linear {
        bias: Some(bias),
        ..Linear::dense(weight)
    };
    let mlp = |[gate, gate_bias, up, up_bias, down, down_bias]: [Tensor; 6]| Mlp {
        gate_up: Split::of(
            vec![("gate_proj", inner), ("up_proj", inner)],
            vec![linear(gate, gate_bias), linear(up, up_bias)],
        ),
        down_proj: linear(down, down_bias),
        activation: config.variant.activation,
        clamped: Some(clamped),
    };
    if vb.contains_tensor("gate_up_proj") {
        let stacks = [
            vb.get((count, hidden, 2 * inner), "gate_up_proj")?,
            vb.get((count, 2 * inner), "gate_up_proj_bias")?,
            vb.get((count, inner, hidden), "down_proj")?,
            vb.get((count, hidden), "down_proj_bias")?,
        ];
        return (0..count)
            .map(|e| {
                let [gate_up, gate_up_bias, down, down_bias] = &stacks;
                let parts = [
                    gate_up.get(e)?,
                    gate_up_bias.get(e)?,
                    down.get(e)?,
                    down_bias.get(e)?,
                ];
                Ok(mlp(unstack(&parts)?))
            })
            .collect();
    }
    (0..count)
        .map(|e| {
            let vb = vb.pp(e.to_string());
            let part = |name: &str, shape: &[usize]| vb.get(shape, name);
            Ok(mlp([
                part("gate_proj.weight", &[inner, hidden])?,
                part("gate_proj.bias", &[inner])?,
                part("up_proj.weight", &[inner, hidden])?,
                part("up_proj.bias", &[inner])?,
                part("down_proj.weight", &[hidden, inner])?,
                part("down_proj.bias", &[hidden])?,
            ]))
        })
        .collect()
}

/// One expert's parts of transformers' stacks (`gate_up_proj[e]` `[hidden, 2·inner]`, its gate and up
/// columns interleaved, gate first; `gate_up_proj_bias[e]` `[2·inner]`; `down_proj[e]` `[inner, hidden]`;
/// `down_proj_bias[e]` `[hidden]`, all multiplied from the left) as contiguous `[out, in]` weights and
/// their biases: gate, up, down. Each expert's product then reads only its own weights, and trains only
/// its own.
fn unstack([gate_up, gate_up_bias, down, down_bias]: &[Tensor; 4]) -> Result<[Tensor; 6]> {
    let (hidden, columns) = gate_up.dims2()?;
    let pairs = gate_up.reshape((hidden, columns / 2, 2))?;
    let biases = gate_up_bias.reshape((columns / 2, 2))?;
    let weight = |which: usize| pairs.narrow(2, which, 1)?.squeeze(2)?.t()?.contiguous();
    let bias = |which: usize| biases.narrow(1, which, 1)?.squeeze(1)?.contiguous();
    Ok([
        weight(0)?,
        bias(0)?,
        weight(1)?,
        bias(1)?,
        down.t()?.contiguous()?,
        down_bias.contiguous()?,
    ])
}

/// transformers' stacks of a gpt-oss layer's experts, in [`unstack`]'s order.
const STACKS: [&str; 4] = [
    "gate_up_proj",
    "gate_up_proj_bias",
    "down_proj",
    "down_proj_bias",
];

/// Whether the checkpoint's tensor `name` is one of gpt-oss's expert stacks, which a folder's loader
/// reads one expert at a time as `{name}.{e}` (and `crate::mxfp4` dequantizes so): [`held_tensors`]
/// then splits and drops one expert's parts after another, and loading holds one expert twice at
/// most, not a layer's experts (three of gpt-oss-20b's GiB in f32).
pub fn read_by_expert(config: &ModelConfig, name: &str) -> bool {
    config.arch == Arch::GptOss
        && name
            .rsplit_once(".mlp.experts.")
            .is_some_and(|(_, stack)| STACKS.contains(&stack))
}

/// A checkpoint's tensors with gpt-oss's expert stacks, as the loader reads them one expert at a time
/// (`{layer}.mlp.experts.gate_up_proj.{e}`, …, [`read_by_expert`]), split into the per-expert tensors
/// the model holds (`mlp.experts.{e}.gate_proj.weight`, …; [`checkpoint_tensors`] stacks them back),
/// each expert's parts dropped once split. Other families' tensors come back as they are.
pub fn held_tensors(
    config: &ModelConfig,
    mut tensors: HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
    if config.arch != Arch::GptOss {
        return Ok(tensors);
    }
    let Some(sizes) = config.experts else {
        candle_core::bail!("gpt-oss experts without sizes");
    };
    let layers: std::collections::BTreeSet<String> = tensors
        .keys()
        .filter_map(|name| {
            let (layer, stack) = name.rsplit_once(".mlp.experts.")?;
            (stack.split('.').next() == Some(STACKS[0])).then(|| layer.to_string())
        })
        .collect();
    for layer in layers {
        for e in 0..sizes.count {
            let mut part = |stack: &str| -> Result<Tensor> {
                let name = format!("{layer}.mlp.experts.{stack}.{e}");
                tensors
                    .remove(&name)
                    .ok_or_else(|| candle_core::Error::Msg(format!("cannot find tensor {name}")))
            };
            let parts = [
                part(STACKS[0])?,
                part(STACKS[1])?,
                part(STACKS[2])?,
                part(STACKS[3])?,
            ];
            let names = [
                "gate_proj.weight",
                "gate_proj.bias",
                "up_proj.weight",
                "up_proj.bias",
                "down_proj.weight",
                "down_proj.bias",
            ];
            for (name, tensor) in names.into_iter().zip(unstack(&parts)?) {
                tensors.insert(format!("{layer}.mlp.experts.{e}.{name}"), tensor);
            }
        }
    }
    Ok(tensors)
}

/// Tensors named as the model holds them (`named_weights`, a trainer's variables or their gradients)
/// under the names and layouts of the family's checkpoints: gpt-oss's per-expert
/// `mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}` stacked into transformers'
/// `mlp.experts.gate_up_proj` (gate and up interleaved), `gate_up_proj_bias`, `down_proj` and
/// `down_proj_bias`. Other families' tensors, and gpt-oss's others, come back as they are.
pub fn checkpoint_tensors(
    config: &ModelConfig,
    named: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    if config.arch != Arch::GptOss {
        return Ok(named);
    }
    let mut out = Vec::with_capacity(named.len());
    // (layer prefix) → expert → (part name → tensor).
    let mut layers: std::collections::BTreeMap<String, HashMap<usize, HashMap<String, Tensor>>> =
        Default::default();
    for (name, tensor) in named {
        let split = name.split_once(".mlp.experts.").and_then(|(layer, rest)| {
            let (e, part) = rest.split_once('.')?;
            Some((
                layer.to_string(),
                e.parse::<usize>().ok()?,
                part.to_string(),
            ))
        });
        match split {
            Some((layer, e, part)) => {
                layers
                    .entry(layer)
                    .or_default()
                    .entry(e)
                    .or_default()
                    .insert(part, tensor);
            }
            None => out.push((name, tensor)),
        }
    }
    for (layer, experts) in layers {
        let mut parts: [Vec<Tensor>; 4] = Default::default();
        for e in 0..experts.len() {
            let Some(expert) = experts.get(&e) else {
                candle_core::bail!("{layer}: expert {e} of {} is missing", experts.len());
            };
            let part = |name: &str| -> Result<&Tensor> {
                expert.get(name).ok_or_else(|| {
                    candle_core::Error::Msg(format!("{layer}.mlp.experts.{e}: no {name}"))
                })
            };
            // Columns gate₀ up₀ gate₁ up₁ …: the `[inner, 2]` pairs of the transposed weights.
            let pair = |gate: &Tensor, up: &Tensor, axis: usize| -> Result<Tensor> {
                Tensor::stack(&[gate, up], axis + 1)?.flatten(axis, axis + 1)
            };
            parts[0].push(pair(
                &part("gate_proj.weight")?.t()?,
                &part("up_proj.weight")?.t()?,
                1,
            )?);
            parts[1].push(pair(part("gate_proj.bias")?, part("up_proj.bias")?, 0)?);
            parts[2].push(part("down_proj.weight")?.t()?.contiguous()?);
            parts[3].push(part("down_proj.bias")?.clone());
        }
        for (name, stack) in [
            "gate_up_proj",
            "gate_up_proj_bias",
            "down_proj",
            "down_proj_bias",
        ]
        .into_iter()
        .zip(parts)
        {
            out.push((
                format!("{layer}.mlp.experts.{name}"),
                Tensor::stack(&stack, 0)?,
            ));
        }
    }
    Ok(out)
}
