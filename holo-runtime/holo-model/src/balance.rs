//! The load-balancing loss of a mixture-of-experts pass (Switch Transformer's, as transformers'
//! `load_balancing_loss_func` computes it and TRL adds it to GRPO's and SFT's loss with
//! `router_aux_loss_coef`).
//!
//! Over the pass's real tokens `n` (weighted by how many sequences hold each one: a token of a tree's
//! shared prefix stands for every sequence through it, as each sequence's own row would count it) and
//! its `L` mixture layers, with `E` experts:
//!
//! ```text
//! f_e = Σ_l Σ_n w_n · [e in the router's top-k of n at l] / (L · N)    (not differentiated)
//! P_e = Σ_l Σ_n w_n · softmax(router logits of n at l)_e / (L · N)
//! loss = E · Σ_e f_e · P_e,          N = Σ_n w_n
//! ```
//!
//! The top-k is the router's own, whatever routing replay made the pass use. Because `f` is a
//! constant, the loss is a sum of one term per layer, `E · f · P_l / (L·N)` with `P_l` that layer's
//! weighted sum of probabilities: with activation recomputation each layer adds its own term to its
//! recomputed segment once the whole pass has given `f` (`recompute.rs`).

use std::sync::Mutex;

use candle_core::{DType, Tensor};

use crate::kernels::kernel::Result;

/// A pass's load-balancing loss, filled in by its mixture layers (through
/// [`crate::layout::Layout::balance`]), weighted by `coefficient` where it is added to a loss.
#[derive(Debug)]
pub struct Balance {
    /// Per token of the pass (row-major over `[B, T]`): how many sequences hold it; 0 for padding.
    weights: Vec<f64>,
    /// What the term is multiplied by where it is added to a loss (`router_aux_loss_coef`, divided by
    /// the micro-batches it is summed over).
    coefficient: f64,
    layers: Mutex<Vec<Observed>>,
}

/// One mixture layer's share.
#[derive(Debug)]
struct Observed {
    layer: usize,
    /// `[E]`: `Σ_n w_n · softmax(logits_n)`, differentiable when the pass is.
    probabilities: Tensor,
    /// `[E]`: `Σ_n w_n` over the tokens whose top-k holds expert `e`.
    counts: Vec<f64>,
}

/// What the term of each layer needs from the whole pass: the summed counts and the normalizer.
#[derive(Debug, Clone, PartialEq)]
pub struct Totals {
    /// `[E]`: `Σ_l counts_l`.
    counts: Vec<f64>,
    /// `(L · N)²`.
    scale: f64,
}

impl Balance {
    /// A collector for a pass whose tokens weigh `weights` (row-major over the pass's `[B, T]`),
    /// added to a loss with `coefficient`.
    pub fn new(weights: Vec<f64>, coefficient: f64) -> Balance {
        Balance {
            weights,
            coefficient,
            layers: Mutex::new(Vec::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Observed>> {
        // A panic elsewhere cannot leave a share half-written that matters more than the panic.
        self.layers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Layer `layer`'s router probabilities `[tokens, E]` (f32 or f64) and its own choice, `k` experts
    /// per token. A layer seen again (recomputed) replaces its earlier share.
    pub(crate) fn observe(
        &self,
        layer: usize,
        probabilities: &Tensor,
        own: &[u32],
        k: usize,
    ) -> Result<()> {
        let (tokens, experts) = probabilities.dims2()?;
        if tokens != self.weights.len() {
            candle_core::bail!(
                "the load-balancing loss weighs {} tokens; layer {layer} routed {tokens}",
                self.weights.len()
            );
        }
        let mut counts = vec![0.0; experts];
        for (chosen, &weight) in own.chunks(k).zip(&self.weights) {
            for &expert in chosen {
                counts[expert as usize] += weight;
            }
        }
        let dtype = probabilities.dtype();
        let weights = Tensor::from_slice(&self.weights, (1, tokens), probabilities.device())?
            .to_dtype(dtype)?;
        let probabilities = weights.matmul(probabilities)?.squeeze(0)?;
        let mut layers = self.lock();
        layers.retain(|observed| observed.layer != layer);
        layers.push(Observed {
            layer,
            probabilities,
            counts,
        });
        Ok(())
    }

    /// The counts and normalizer of every layer seen so far.
    pub fn totals(&self) -> Totals {
        let layers = self.lock();
        let experts = layers.first().map_or(0, |observed| observed.counts.len());
        let mut counts = vec![0.0; experts];
        for observed in layers.iter() {
            for (sum, count) in counts.iter_mut().zip(&observed.counts) {
                *sum += count;
            }
        }
        let rows = layers.len() as f64 * self.weights.iter().sum::<f64>();
        Totals {
            counts,
            scale: rows * rows,
        }
    }

    /// The loss (before its coefficient) of the layers seen so far, `None` when none was (no mixture
    /// layer, or no token).
    pub fn value(&self) -> Result<Option<f64>> {
        let totals = self.totals();
        let layers: Vec<usize> = self.lock().iter().map(|observed| observed.layer).collect();
        if layers.is_empty() || totals.scale == 0.0 {
            return Ok(None);
        }
        let mut sum = 0.0;
        for layer in layers {
            if let Some(term) = self.term(layer, &totals, 1.0)? {
                sum += term.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            }
        }
        Ok(Some(sum))
    }

    /// The whole loss times the coefficient, differentiable where the layers' probabilities are:
    /// what a pass that keeps its graph adds to its loss. `None` when no layer was seen.
    pub fn weighted(&self) -> Result<Option<Tensor>> {
        let totals = self.totals();
        let layers: Vec<usize> = self.lock().iter().map(|observed| observed.layer).collect();
        let mut sum: Option<Tensor> = None;
        for layer in layers {
            if let Some(term) = self.term(layer, &totals, self.coefficient)? {
                sum = Some(match sum {
                    Some(sum) => (sum + term)?,
                    None => term,
                });
            }
        }
        Ok(sum)
    }

    /// Layer `layer`'s term of the loss times the coefficient, given the whole pass's `totals`: what
    /// a recomputed layer adds to its segment. `None` when the layer was not seen.
    pub fn weighted_term(&self, layer: usize, totals: &Totals) -> Result<Option<Tensor>> {
        self.term(layer, totals, self.coefficient)
    }

    /// The coefficient the loss is added with.
    pub fn coefficient(&self) -> f64 {
        self.coefficient
    }

    fn term(&self, layer: usize, totals: &Totals, coefficient: f64) -> Result<Option<Tensor>> {
        let layers = self.lock();
        let Some(observed) = layers.iter().find(|observed| observed.layer == layer) else {
            return Ok(None);
        };
        if totals.scale == 0.0 {
            return Ok(None);
        }
        let experts = totals.counts.len();
        let factor = coefficient * experts as f64 / totals.scale;
        let counts = Tensor::from_slice(&totals.counts, experts, observed.probabilities.device())?
            .to_dtype(observed.probabilities.dtype())?;
        Ok(Some(
            (observed.probabilities.mul(&counts)?.sum_all()? * factor)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// transformers' `load_balancing_loss_func` on two layers of three tokens (one of them padding),
    /// four experts, top-2, worked by hand: the loss, and its gradient at the logits.
    #[test]
    fn the_loss_is_transformers_load_balancing_loss() {
        let device = Device::Cpu;
        let logits = [
            [
                [1.0, 0.5, -0.5, 0.0],
                [0.2, 0.1, 0.3, 0.4],
                [9.0, 9.0, 9.0, 9.0],
            ],
            [
                [-1.0, 2.0, 0.0, 1.5],
                [0.0, 0.0, 1.0, -1.0],
                [3.0, 0.0, 0.0, 0.0],
            ],
        ];
        let weights = vec![1.0, 2.0, 0.0];
        let balance = Balance::new(weights.clone(), 0.5);
        let mut vars = Vec::new();
        for (layer, rows) in logits.iter().enumerate() {
            let flat: Vec<f64> = rows.iter().flatten().copied().collect();
            let var = Var::from_tensor(&Tensor::from_vec(flat, (3, 4), &device).unwrap()).unwrap();
            let probabilities = candle_nn::ops::softmax(var.as_tensor(), 1).unwrap();
            let own = top_2(&probabilities.to_vec2::<f64>().unwrap());
            balance.observe(layer, &probabilities, &own, 2).unwrap();
            vars.push(var);
        }

        // By hand: softmax rows, top-2 counts, then E · Σ_e f_e · P_e over (L · N) = 2 · 3 rows.
        let softmax = |row: &[f64; 4]| {
            let max = row.iter().copied().fold(f64::MIN, f64::max);
            let exps: Vec<f64> = row.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            exps.into_iter().map(|e| e / sum).collect::<Vec<f64>>()
        };
        let (mut f, mut p) = ([0.0; 4], [0.0; 4]);
        for rows in &logits {
            for (row, weight) in rows.iter().zip(&weights) {
                let probabilities = softmax(row);
                for e in top_2(std::slice::from_ref(&probabilities)) {
                    f[e as usize] += weight;
                }
                for e in 0..4 {
                    p[e] += weight * probabilities[e];
                }
            }
        }
        let rows = 2.0 * 3.0;
        let expected: f64 = 4.0 * (0..4).map(|e| f[e] / rows * p[e] / rows).sum::<f64>();
        let value = balance.value().unwrap().unwrap();
        assert!(
            (value - expected).abs() < 1e-12,
            "{value} against {expected}"
        );

        let weighted = balance.weighted().unwrap().unwrap();
        let got = weighted.to_scalar::<f64>().unwrap();
        assert!((got - 0.5 * expected).abs() < 1e-12);
        // d loss / d logit_{n,j} = w_n · p_j · (g_j − Σ_e p_e · g_e), with g_e = c · E · f_e / rows².
        let grads = weighted.backward().unwrap();
        for (rows_of_layer, var) in logits.iter().zip(&vars) {
            let grad = grads
                .get(var.as_tensor())
                .unwrap()
                .to_vec2::<f64>()
                .unwrap();
            for (n, (row, weight)) in rows_of_layer.iter().zip(&weights).enumerate() {
                let probabilities = softmax(row);
                let g: Vec<f64> = (0..4).map(|e| 0.5 * 4.0 * f[e] / (rows * rows)).collect();
                let mean: f64 = (0..4).map(|e| probabilities[e] * g[e]).sum();
                for j in 0..4 {
                    let expected = weight * probabilities[j] * (g[j] - mean);
                    assert!((grad[n][j] - expected).abs() < 1e-12, "{n} {j}");
                }
            }
        }

        // The layer terms add up to the whole, given the totals.
        let totals = balance.totals();
        let by_layer: f64 = (0..2)
            .map(|layer| {
                let term = balance.weighted_term(layer, &totals).unwrap().unwrap();
                term.to_scalar::<f64>().unwrap()
            })
            .sum();
        assert!((by_layer - got).abs() < 1e-12);
    }

    fn top_2(rows: &[Vec<f64>]) -> Vec<u32> {
        let mut chosen = Vec::new();
        for row in rows {
            let mut order: Vec<u32> = (0..row.len() as u32).collect();
            order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            chosen.extend_from_slice(&order[..2]);
        }
        chosen
    }
}
