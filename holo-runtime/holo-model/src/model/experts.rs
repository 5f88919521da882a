//! A mixture of experts in place of the MLP (`qwen3_moe`'s sparse blocks): a router scores every
//! expert for each token, the `per_token` best run on it, and the layer's output is their SwiGLU
//! outputs weighted by the router's softmax at them (renormalised over the chosen ones where the config
//! says so), as `Qwen3MoeSparseMoeBlock` computes it.
//!
//! The experts run grouped: each expert's tokens are gathered into one matrix product, never a dense
//! loop of every expert over every token. The choice itself is made on the host (a top-k of each
//! token's probabilities) and can be replaced by a recorded one ([`Routing`]): routing replay, so that
//! a trainer computes the log-probabilities of sampled tokens through the experts the sampler used.

use std::sync::Mutex;

use super::*;

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
            let linear = |weight: Tensor| -> Result<Linear> {
                Ok(Linear {
                    weight: weight.contiguous()?,
                    bias: None,
                    lora: None,
                })
            };
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

/// In replayed routes, a token whose experts were not recorded: the router chooses for it.
pub const UNROUTED: u32 = u32::MAX;

/// The experts a pass routed its tokens to: for each layer (by index; empty for a layer without
/// experts), `per_token` expert ids per token, the tokens in the pass's order (row-major over
/// `[B, T]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routes(pub Vec<Vec<u32>>);

impl Routes {
    /// Each token's experts, every mixture layer's `per_token` ids in layer order (what a sampler
    /// records per token), for a pass of `tokens` tokens.
    pub fn per_token(&self, tokens: usize) -> Vec<Vec<u32>> {
        let mut out = vec![Vec::new(); tokens];
        for layer in self.0.iter().filter(|layer| !layer.is_empty()) {
            let k = layer.len() / tokens.max(1);
            for (token, ids) in out.iter_mut().zip(layer.chunks(k.max(1))) {
                token.extend_from_slice(ids);
            }
        }
        out
    }

    /// The routes of a pass over `tokens` (in the pass's order) from each token's as
    /// [`Routes::per_token`] gives them, [`UNROUTED`] for a token without (an empty list) in a model
    /// of `config`.
    pub fn from_tokens<'a>(
        tokens: impl ExactSizeIterator<Item = &'a [u32]>,
        config: &ModelConfig,
    ) -> Result<Routes> {
        let Some(experts) = config.experts else {
            return Ok(Routes::default());
        };
        let k = experts.per_token;
        let mixtures: Vec<usize> = (0..config.layers.len())
            .filter(|&layer| config.layers[layer].experts)
            .collect();
        let width = mixtures.len() * k;
        let count = tokens.len();
        let mut layers = vec![Vec::new(); config.layers.len()];
        for &layer in &mixtures {
            layers[layer].reserve(count * k);
        }
        for (t, ids) in tokens.enumerate() {
            match ids.len() {
                0 => {
                    for &layer in &mixtures {
                        layers[layer].extend(std::iter::repeat_n(UNROUTED, k));
                    }
                }
                n if n == width => {
                    for (&layer, ids) in mixtures.iter().zip(ids.chunks(k)) {
                        layers[layer].extend_from_slice(ids);
                    }
                }
                n => candle_core::bail!(
                    "token {t} has {n} recorded expert ids; this model routes each token to {k} \
                     experts in each of {} layers ({width})",
                    mixtures.len()
                ),
            }
        }
        Ok(Routes(layers))
    }
}

/// A pass's routing: the choices it replays, if any, and what it chose. Shared by the pass's layers
/// (through [`crate::layout::Layout::routing`]); a layer run twice (activation recomputation) records
/// the same choices again.
#[derive(Debug, Default)]
pub struct Routing {
    replay: Option<Routes>,
    record: Mutex<Record>,
}

#[derive(Debug, Default)]
struct Record {
    taken: Routes,
    /// Per layer: (tokens whose replayed experts differ from the router's own choice, tokens compared).
    differ: Vec<(usize, usize)>,
}

/// How often replayed routes differ from the router's own choices.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RoutingDrift {
    /// Token × layer pairs whose replayed set of experts is not the one the router would choose.
    pub differ: usize,
    /// Token × layer pairs replayed.
    pub compared: usize,
}

impl RoutingDrift {
    /// The fraction of replayed choices the router would have made differently (0 when none were
    /// replayed).
    pub fn fraction(&self) -> f64 {
        match self.compared {
            0 => 0.0,
            n => self.differ as f64 / n as f64,
        }
    }
}

impl Routing {
    /// Routing by each layer's router, recording its choices.
    pub fn record() -> Routing {
        Routing::default()
    }

    /// Routing that replays `routes` (as [`Routing::taken`] returned them for the same tokens;
    /// [`UNROUTED`] where the router is to choose).
    pub fn replay(routes: Routes) -> Routing {
        Routing {
            replay: Some(routes),
            record: Mutex::default(),
        }
    }

    /// The choices the pass made, per layer.
    pub fn taken(&self) -> Routes {
        self.lock().taken.clone()
    }

    /// How often the replayed choices differ from what the routers would have chosen.
    pub fn drift(&self) -> RoutingDrift {
        let record = self.lock();
        record
            .differ
            .iter()
            .fold(RoutingDrift::default(), |sum, &(differ, compared)| {
                RoutingDrift {
                    differ: sum.differ + differ,
                    compared: sum.compared + compared,
                }
            })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        // A panic elsewhere cannot leave a record half-written that matters more than the panic.
        self.record
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The experts layer `layer` uses, `k` per token: the replayed ones where there are, else the
    /// router's `own`; recorded either way.
    fn choose(&self, layer: usize, own: Vec<u32>, k: usize) -> Result<Vec<u32>> {
        let len = own.len();
        let replayed = match &self.replay {
            None => None,
            Some(Routes(layers)) => {
                let replayed = layers.get(layer).filter(|routes| !routes.is_empty());
                let Some(replayed) = replayed else {
                    candle_core::bail!(
                        "routing replay has no routes for layer {layer}, which has experts"
                    );
                };
                if replayed.len() != len {
                    candle_core::bail!(
                        "routing replay gives {} expert ids for layer {layer}, where the pass \
                         routes {len}",
                        replayed.len()
                    );
                }
                Some(replayed)
            }
        };
        let (chosen, differ) = match replayed {
            None => (own, (0, 0)),
            Some(replayed) => {
                let mut chosen = own.clone();
                let (mut differ, mut compared) = (0, 0);
                for ((chosen, own), replayed) in chosen
                    .chunks_mut(k)
                    .zip(own.chunks(k))
                    .zip(replayed.chunks(k))
                {
                    if replayed.contains(&UNROUTED) {
                        continue;
                    }
                    compared += 1;
                    let (mut a, mut b) = (own.to_vec(), replayed.to_vec());
                    a.sort_unstable();
                    b.sort_unstable();
                    differ += usize::from(a != b);
                    chosen.copy_from_slice(replayed);
                }
                (chosen, (differ, compared))
            }
        };
        let mut record = self.lock();
        if record.taken.0.len() <= layer {
            record.taken.0.resize(layer + 1, Vec::new());
            record.differ.resize(layer + 1, (0, 0));
        }
        record.differ[layer] = differ;
        record.taken.0[layer] = chosen.clone();
        Ok(chosen)
    }
}
