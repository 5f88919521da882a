//! A mixture of experts in place of the MLP (`qwen3_moe`'s sparse blocks): a router scores every
//! expert for each token, the `per_token` best run on it, and the layer's output is their SwiGLU
//! outputs weighted by the router's softmax at them (renormalised over the chosen ones where the config
//! says so), as `Qwen3MoeSparseMoeBlock` computes it.
//!
//! The experts run grouped: each expert's tokens are gathered into one matrix product, never a dense
//! loop of every expert over every token. The choice itself is made on the host (a top-k of each
//! token's probabilities) and can be replaced by a recorded one ([`Routing`]): routing replay, so that
//! a trainer computes the log-probabilities of sampled tokens through the experts the sampler used.

use super::*;
use crate::routing::Routing;

#[derive(Debug, Clone)]
pub struct Mixture {
    /// The router (`mlp.gate`): one logit per expert, `[experts, hidden]`.
    pub router: Linear,
    /// The experts (`mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`).
    pub experts: Vec<Mlp>,
    pub(crate) per_token: usize,
    pub(crate) normalize: bool,
    /// The layer's index, under which [`Routing`] records and replays its choices.
    pub(crate) layer: usize,
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
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..sizes.count)
                .map(|e| Mlp::load(experts.pp(e.to_string()), config, inner))
                .collect::<Result<Vec<_>>>()?
        };
        Ok(Mixture {
            router,
            experts,
            per_token: sizes.per_token,
            normalize: sizes.normalize,
            layer,
        })
    }

    /// The output `[.., hidden]` for `xs` `[.., hidden]`: each token through its chosen experts (by the
    /// router, or replayed from `routing`), which `routing` records.
    pub(crate) fn forward(
        &self,
        xs: &Tensor,
        ops: Ops,
        routing: Option<&Routing>,
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
        let probabilities = softmax(&logits, ops)?;
        let own = top_k(&probabilities.to_dtype(DType::F64)?.to_vec2::<f64>()?, k);
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
        let mut weights = probabilities.gather(&index, 1)?;
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
        for (expert, slots) in self.experts.iter().zip(&slots) {
            if slots.is_empty() {
                continue;
            }
            let tokens_of: Vec<u32> = slots.iter().map(|&slot| slot / k as u32).collect();
            let at = Tensor::from_vec(tokens_of.clone(), tokens_of.len(), xs.device())?;
            let slot_at = Tensor::from_vec(slots.clone(), slots.len(), xs.device())?;
            let output = expert.forward(&flat.index_select(&at, 0)?, ops)?;
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
        summed.reshape(xs.shape())
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
