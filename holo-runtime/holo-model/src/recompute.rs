//! Activation recomputation ("gradient checkpointing"): gradients of a loss over
//! [`Model::token_logprobs`] that keep one layer's activations alive at a time instead of all of them.
//!
//! candle has no hook to drop and recompute activations inside one graph, so the backward pass is
//! split by layer. A forward pass without a graph keeps only each layer's input. The head (final norm,
//! output projection, log-softmax, the loss) then runs with its graph from the last layer's output, and
//! its backward gives the head's gradients and the gradient at that output. Going down, each layer
//! recomputes its activations from its kept input and gives its weight gradients and the gradient at its
//! input: by its hand-written backward (`backward.rs`) in f32 and f64, or in half precision through
//! candle's autograd, as the backward of `sum(output · upstream gradient)` over the layer's graph. Peak
//! memory is the kept inputs (`layers × B × T × hidden`) plus one layer's activations, at the cost of a
//! second forward pass.
//!
//! The gradients are those of the whole-graph backward, summed in a different order: they agree to
//! rounding.
//!
//! A layout with a [`crate::balance::Balance`] adds the load-balancing loss: its value to the loss's
//! (from the first forward, which gives every layer's expert counts), and each mixture layer's term to
//! that layer's recomputed segment.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::layout::Layout;
use super::model::{Model, Ops, Result};

impl Model {
    /// `loss(token_logprobs)` and its gradients with respect to this model's [`Var`]s (from
    /// [`Model::trainable`] or [`Model::with_lora`]), keyed as `loss.backward()` would key them, so an
    /// optimizer steps on them unchanged. `loss` receives [`Model::token_logprobs`] of `input_ids` under
    /// `key_mask` (differentiable ops) and returns a scalar.
    pub fn backward_recomputed(
        &self,
        input_ids: &Tensor,
        key_mask: &Tensor,
        loss: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, GradStore)> {
        let layout = Layout::causal(key_mask)?;
        self.backward_recomputed_with_head(input_ids, &layout, &[], |hidden| {
            loss(&self.next_token_logprobs(hidden, input_ids, key_mask)?)
        })
    }

    /// [`Model::backward_recomputed`] for a loss of the final hidden states `[B, T, hidden]` (after the
    /// last norm), for heads other than every position's log-probability (the trainer scores only the
    /// trained positions, at its sampling temperature), with the tokens laid out by `layout` (padded
    /// rows, or trees of sequences that share prefixes; see [`Layout`]). The loss may also read
    /// variables of its own (`head`, a value model's head, say): their gradients are returned with the
    /// model's. With [`Layout::balance`], the load-balancing loss times its coefficient is added to
    /// the loss and its gradients to the layers'.
    pub fn backward_recomputed_with_head(
        &self,
        input_ids: &Tensor,
        layout: &Layout,
        head: &[Tensor],
        loss: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, GradStore)> {
        let len = input_ids.dim(1)?;
        if len < 2 {
            candle_core::bail!("a sequence of {len} token(s) has no next token to score");
        }
        let frame = self.frame_of(layout)?;

        // No Var in this pass: nothing is kept but what is pushed here.
        let constant = self.detached();
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut xs = constant.embed(input_ids)?;
        for layer in &constant.layers {
            let output = layer.forward(&xs, &frame, None, Ops::Differentiable)?;
            inputs.push(xs);
            xs = output;
        }

        // The whole pass's expert counts, which every layer's term needs.
        let balance = layout.balance.as_deref();
        let totals = balance.map(|balance| balance.totals());

        let top = Var::from_tensor(&xs)?;
        let hidden = self.norm.forward(top.as_tensor(), Ops::Differentiable)?;
        let mut value = loss(&hidden)?;
        if let Some(weighted) = balance
            .map(|balance| balance.weighted())
            .transpose()?
            .flatten()
        {
            let dtype = value.dtype();
            value = (value + weighted.to_dtype(dtype)?)?;
        }
        let variables = self.variables();
        let mut grads = GradStore::default();
        let top_segment = value.backward()?;
        gather(&mut grads, &top_segment, &variables)?;
        gather(&mut grads, &top_segment, head)?;
        let mut upstream = gradient_at(&top_segment, &top)?;
        drop(top_segment);

        for (index, (layer, input)) in self.layers.iter().zip(inputs).enumerate().rev() {
            if layer.has_backward() {
                upstream = layer.backward(&input, &frame, &upstream, &mut grads)?;
                continue;
            }
            let input = Var::from_tensor(&input)?;
            let output = layer.forward(input.as_tensor(), &frame, None, Ops::Differentiable)?;
            let mut objective = (output * &upstream)?.sum_all()?;
            if let (Some(balance), Some(totals)) = (balance, &totals) {
                // The forward just now left this layer's probabilities, with their graph.
                if let Some(term) = balance.weighted_term(index, totals)? {
                    objective = (objective + term.to_dtype(upstream.dtype())?)?;
                }
            }
            let segment = objective.backward()?;
            gather(&mut grads, &segment, &variables)?;
            upstream = gradient_at(&segment, &input)?;
        }

        let embedded = self.embed(input_ids)?;
        if embedded.track_op() {
            let segment = (embedded * &upstream)?.sum_all()?.backward()?;
            gather(&mut grads, &segment, &variables)?;
        }
        Ok((value.detach(), grads))
    }

    /// The weights and adapters that are [`Var`]s.
    fn variables(&self) -> Vec<Tensor> {
        let adapters = self.named_adapters().into_iter().map(|(_, t)| t.clone());
        self.named_weights()
            .into_iter()
            .map(|(_, t)| t)
            .chain(adapters)
            .filter(Tensor::is_variable)
            .collect()
    }
}

/// Adds `segment`'s gradients of `variables` to `grads`. A backward pass also leaves gradients for the
/// constants it met (masks, rotary tables), which are not kept.
fn gather(grads: &mut GradStore, segment: &GradStore, variables: &[Tensor]) -> Result<()> {
    for variable in variables {
        if let Some(grad) = segment.get(variable) {
            let sum = match grads.remove(variable) {
                Some(earlier) => (earlier + grad)?,
                None => grad.clone(),
            };
            grads.insert(variable, sum);
        }
    }
    Ok(())
}

/// The gradient at `var` (zeros when the loss does not depend on it).
fn gradient_at(grads: &GradStore, var: &Var) -> Result<Tensor> {
    match grads.get(var.as_tensor()) {
        Some(grad) => Ok(grad.clone()),
        None => var.as_tensor().zeros_like(),
    }
}
