//! Mixture-of-experts routing of one pass: the experts each token went to ([`Routes`]), and how a
//! pass routes ([`Routing`]): by each layer's router, recording the choice, or replaying a sampler's
//! choice (routing replay), counting where the router would have chosen otherwise ([`RoutingDrift`]).
//! A pass's [`crate::layout::Layout`] carries it to every mixture layer (`model/experts.rs`).

use std::sync::Mutex;

use crate::config::ModelConfig;
use crate::kernels::kernel::Result;

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
    pub(crate) fn choose(&self, layer: usize, own: Vec<u32>, k: usize) -> Result<Vec<u32>> {
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
