//! The output head in training: the scores of the trained tokens (log-probability, entropy, top-1; see
//! [`crate::head`]) from the final hidden states, without the whole `[tokens, vocabulary]` logits when
//! those are large.
//!
//! Why: at a real vocabulary the logits, not the model, are what runs out of memory. A micro-batch of
//! 8 completions of 256 tokens under Qwen's 151,936-token vocabulary has 1.2 GB of f32 logits, and the
//! backward as much again for their gradient (TRL's and verl's users meet this as "OOM at the loss").
//! Above [`LOGITS_BUDGET`] elements the forward computes the logits a block of rows at a time and keeps
//! only each row's four scores; the backward recomputes them a block of vocabulary columns at a time
//! (every entry of the logits' gradient needs only its own logit and its row's normalizer and entropy)
//! and turns each block into its rows of the head's gradient and its share of the hidden states'.
//! The price is one more head product, as Liger-Kernel's fused linear cross-entropy pays it; below the
//! budget nothing is recomputed and the logits are computed whole, as before.
//!
//! Rows drawn under a constraint ([`Model::constrained_head_scores`]) are scored under the masked
//! distribution the sampler drew from: their logits (divided by the temperature, as ever) are `-inf`
//! wherever the constraint allowed no token, in the whole head, in each block of rows of the forward and
//! in each block of columns of the backward, so that the log-normalizer and the entropy run over the
//! allowed tokens only and the masked entries get no gradient.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, InplaceOp1, Layout, Shape, Tensor};

use super::{softcap, Linear, Lora, Model, Ops, Result};
use crate::kernels::head::{logits_gradient, target_scores};
use crate::kernels::kernel::contiguous;
use crate::kernels::matrix::multiply;
use holo_core::Allowed;

/// PEFT's module name of the output head's adapter: its tensors are `{HEAD_ADAPTER}.lora_A.weight`
/// and `.lora_B.weight`.
pub const HEAD_ADAPTER: &str = "base_model.model.lm_head";

/// How many elements of logits (f32: 4 bytes each) the training head holds at once: 256 MiB.
pub const LOGITS_BUDGET: usize = 64 << 20;

impl Model {
    /// [`target_scores`] of the logits of `hidden` `[N, hidden]` (f32 or f64, see [`Model::logits`])
    /// for `targets` `[N]`, at `temperature`: `[N, 4]`, differentiable with respect to `hidden` and
    /// to the head's weight when it is trained. Beyond [`LOGITS_BUDGET`] on the CPU the logits are never
    /// whole (this module's doc says how; [`Model::with_head_budget`] sets the budget).
    pub fn head_scores(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        temperature: f64,
    ) -> Result<Tensor> {
        self.constrained_head_scores(hidden, targets, temperature, &[])
    }

    /// [`Model::head_scores`] with row `i` scored under the distribution masked to `allowed[i]` when it
    /// is `Some` (a token drawn under a constraint, [`Grammar::replay`](crate::Grammar::replay)): the
    /// log-probability and entropy over the allowed tokens only, no gradient into the others. `allowed`
    /// has a mask per row, or is empty when no row has one.
    pub fn constrained_head_scores(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        temperature: f64,
        allowed: &[Option<Allowed>],
    ) -> Result<Tensor> {
        let (hidden, weight) = self.head_operands(hidden)?;
        scores_within(
            &hidden,
            &weight,
            (targets, allowed),
            (temperature, self.config.variant.final_softcap),
            self.head_budget,
        )
    }

    /// The training head's operands for `hidden` `[N, hidden]`: the hidden states and the head's
    /// weight, or with a head adapter ([`Model::head_lora`]) PEFT's `x Wᵀ + scale · (x Aᵀ) Bᵀ` as one
    /// product `[x, scale · x Aᵀ] [W, B]ᵀ` (in the adapter's type), whose weight gradient the chunked
    /// head produces block by block and autograd hands on to `B` (its last `rank` columns) and through
    /// `x Aᵀ` to `A`. `B A` is never formed: the cost is a copy of the head with `rank` more columns,
    /// and its gradient, for the step (at Qwen2.5-0.5B's 151,936 × 896 in f32, 545 MB each; measured,
    /// `examples/head_bench.rs --tokens 256 --head-lora 8`: a peak of 2.42 GB in the head's passes
    /// against 1.14 GB with the head frozen).
    fn head_operands(&self, hidden: &Tensor) -> Result<(Tensor, Tensor)> {
        let weight = self.head_weight();
        let Some(lora) = &self.head_lora else {
            return Ok((hidden.clone(), weight.clone()));
        };
        let dtype = lora.a.dtype();
        let hidden = hidden.to_dtype(dtype)?;
        // The adapter's input after its dropout, as a projection's adapter drops it (`Linear`).
        let keep = match &lora.dropout {
            Some(dropout) => dropout.mask(&hidden)?,
            None => None,
        };
        let input = match keep {
            Some(keep) => (&hidden * keep)?,
            None => hidden.clone(),
        };
        let low = (input.matmul(&lora.a.t()?)? * lora.scale)?;
        Ok((
            Tensor::cat(&[&hidden, &low], 1)?,
            Tensor::cat(&[&weight.to_dtype(dtype)?, &lora.b], 1)?,
        ))
    }

    /// The model whose training head holds at most about `elements` logits at once (default
    /// [`LOGITS_BUDGET`]); the models made from it ([`Model::trainable`], [`Model::with_lora`],
    /// [`Model::detached`]) keep it.
    pub fn with_head_budget(mut self, elements: usize) -> Self {
        self.head_budget = elements.max(1);
        self
    }

    /// The output projection's weight `[vocab, hidden]`: `lm_head`, or the embeddings it is tied to.
    pub(crate) fn head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }
}

/// The logits of `hidden` `[N, hidden]` under the output projection `weight` `[V, hidden]`, in f32 (f64
/// for an f64 model): half-precision products are widened after the product, as `Model::logits` does.
pub(crate) fn project(hidden: &Tensor, weight: &Tensor, ops: Ops) -> Result<Tensor> {
    widened(Linear::dense(weight.clone()).forward(hidden, ops)?)
}

/// [`project`] with the head's adapter applied as PEFT applies it, `x Wᵀ + scale · (x Aᵀ) Bᵀ`, never
/// forming `B A`: what sampling computes.
pub(crate) fn project_adapted(
    hidden: &Tensor,
    weight: &Tensor,
    lora: &Option<Lora>,
    ops: Ops,
) -> Result<Tensor> {
    let head = Linear {
        lora: lora.clone(),
        ..Linear::dense(weight.clone())
    };
    widened(head.forward(hidden, ops)?)
}

/// [`project`] soft-capped when the family caps its logits
/// ([`crate::config::Variant::final_softcap`]).
fn capped_projection(hidden: &Tensor, weight: &Tensor, cap: Option<f64>) -> Result<Tensor> {
    let logits = project(hidden, weight, Ops::Differentiable)?;
    match cap {
        Some(cap) => softcap(&logits, cap),
        None => Ok(logits),
    }
}

/// Half-precision logits in f32; f32 and f64 ones as they are.
pub(crate) fn widened(logits: Tensor) -> Result<Tensor> {
    match logits.dtype() {
        DType::F16 | DType::BF16 => logits.to_dtype(DType::F32),
        _ => Ok(logits),
    }
}

/// [`Model::constrained_head_scores`] holding at most about `budget` elements of logits at once, the
/// logits soft-capped by `cap` (before the temperature divides them) when it is `Some`.
pub(crate) fn scores_within(
    hidden: &Tensor,
    weight: &Tensor,
    (targets, allowed): (&Tensor, &[Option<Allowed>]),
    (temperature, cap): (f64, Option<f64>),
    budget: usize,
) -> Result<Tensor> {
    let (rows, vocab) = (hidden.dim(0)?, weight.dim(0)?);
    let allowed = match allowed.iter().any(Option::is_some) {
        true if allowed.len() != rows => {
            candle_core::bail!("{} masks for {rows} rows of the head", allowed.len())
        }
        true => allowed,
        false => &[],
    };
    if rows.saturating_mul(vocab) <= budget || !hidden.device().is_cpu() {
        let logits = capped_projection(hidden, weight, cap)?;
        return target_scores(&masked(logits, 0, allowed)?, targets, temperature);
    }
    let targets = targets.to_dtype(DType::U32)?;
    let (hidden_values, weight_values) = (hidden.detach(), weight.detach());
    let block = (budget / vocab).max(1);
    let mut scores = Vec::with_capacity(rows.div_ceil(block));
    for start in (0..rows).step_by(block) {
        let len = block.min(rows - start);
        let logits = capped_projection(&hidden_values.narrow(0, start, len)?, &weight_values, cap)?;
        let rows_allowed = allowed.get(start..start + len).unwrap_or(&[]);
        scores.push(target_scores(
            &masked(logits, 0, rows_allowed)?,
            &targets.narrow(0, start, len)?,
            temperature,
        )?);
    }
    let scores = Tensor::cat(&scores, 0)?;
    if !hidden.track_op() && !weight.track_op() {
        return Ok(scores);
    }
    hidden.apply_op3(
        weight,
        &scores,
        ChunkedHead {
            targets: targets.to_vec1()?,
            allowed: allowed.to_vec(),
            temperature,
            cap,
            budget,
        },
    )
}

/// `logits` `[N, C]`, the vocabulary's columns `first..first + C`, with row `i`'s entries at `-inf`
/// where `allowed[i]` allows no token (rows without a mask, and all rows when `allowed` is empty, as
/// they are). Logits the graph tracks get the mask added, so that the masked entries' gradient is the
/// zero the head's backward gives a `-inf` logit; a block the chunked head owns is masked in place.
fn masked(logits: Tensor, first: usize, allowed: &[Option<Allowed>]) -> Result<Tensor> {
    if allowed.is_empty() {
        return Ok(logits);
    }
    let mask = Mask { first, allowed };
    if logits.device().is_cpu() && !logits.track_op() {
        let logits = logits.contiguous()?;
        logits.inplace_op1(&mask)?;
        return Ok(logits);
    }
    let (rows, width) = logits.dims2()?;
    // In f32 whatever the logits' dtype: 0 and -inf are exact in all of them, at half f64's size.
    let mut bias = vec![0f32; rows * width];
    mask.apply(&mut bias, width);
    let bias = Tensor::from_vec(bias, (rows, width), logits.device())?.to_dtype(logits.dtype())?;
    logits + bias
}

/// [`masked`]'s mask: rows' entries at `-inf` where their constraint allows no token.
struct Mask<'a> {
    first: usize,
    allowed: &'a [Option<Allowed>],
}

impl Mask<'_> {
    /// Writes `-inf` over the disallowed entries of `values`, rows of `width`.
    fn apply<T: Copy + From<f32>>(&self, values: &mut [T], width: usize) {
        for (row, allowed) in values.chunks_mut(width).zip(self.allowed) {
            let Some(allowed) = allowed else { continue };
            for (column, value) in row.iter_mut().enumerate() {
                if !allowed.contains(self.first + column) {
                    *value = T::from(f32::NEG_INFINITY);
                }
            }
        }
    }
}

impl InplaceOp1 for Mask<'_> {
    fn name(&self) -> &'static str {
        "constraint-mask"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let width = layout.shape().dims2()?.1;
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("constraint-mask of a non-contiguous tensor");
        };
        match storage {
            CpuStorage::F32(values) => self.apply(&mut values[start..end], width),
            CpuStorage::F64(values) => self.apply(&mut values[start..end], width),
            other => candle_core::bail!("constraint-mask: logits are {:?}", other.dtype()),
        }
        Ok(())
    }
}

/// The scores of [`scores_within`] as an operation of the hidden states and the head's weight: its
/// forward hands on the scores computed block by block (its third operand), its backward recomputes
/// the logits a block of columns at a time.
struct ChunkedHead {
    targets: Vec<u32>,
    /// Each row's mask, or none when no row has one.
    allowed: Vec<Option<Allowed>>,
    temperature: f64,
    /// The logits' soft-cap, whose derivative `1 − (capped / cap)²` each block's gradient is
    /// multiplied by.
    cap: Option<f64>,
    budget: usize,
}

impl CustomOp3 for ChunkedHead {
    fn name(&self) -> &'static str {
        "chunked-head"
    }

    fn cpu_fwd(
        &self,
        _hidden: &CpuStorage,
        _hidden_layout: &Layout,
        _weight: &CpuStorage,
        _weight_layout: &Layout,
        scores: &CpuStorage,
        scores_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const WHAT: &str = "chunked-head";
        let copy = match scores.dtype() {
            DType::F32 => CpuStorage::F32(contiguous::<f32>(scores, scores_layout, WHAT)?.to_vec()),
            DType::F64 => CpuStorage::F64(contiguous::<f64>(scores, scores_layout, WHAT)?.to_vec()),
            other => candle_core::bail!("{WHAT}: scores are {other:?}"),
        };
        Ok((copy, scores_layout.shape().clone()))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        scores: &Tensor,
        _result: &Tensor,
        grad_scores: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let trained = weight.track_op();
        let (hidden, weight) = (hidden.detach().contiguous()?, weight.detach());
        let (rows, vocab) = (hidden.dim(0)?, weight.dim(0)?);
        let (scores, grad_scores) = (scores.contiguous()?, grad_scores.contiguous()?);
        let columns = (self.budget / rows.max(1)).max(1);
        let mut grad_hidden: Option<Tensor> = None;
        let mut grad_weight = Vec::with_capacity(if trained { vocab.div_ceil(columns) } else { 0 });
        for first in (0..vocab).step_by(columns) {
            let width = columns.min(vocab - first);
            let block = weight.narrow(0, first, width)?;
            let logits = capped_projection(&hidden, &block, self.cap)?;
            // Before the mask, which may write into the logits in place.
            let slope = match self.cap {
                Some(cap) => Some((&logits / cap)?.sqr()?.affine(-1.0, 1.0)?),
                None => None,
            };
            let grad_logits = logits_gradient(
                masked(logits, first, &self.allowed)?,
                first,
                &self.targets,
                &scores,
                &grad_scores,
                self.temperature,
            )?;
            let grad_logits = match slope {
                Some(slope) => (grad_logits * slope)?,
                None => grad_logits,
            };
            // The products run in the weight's type, as the whole head's backward runs them.
            let grad_logits = grad_logits.to_dtype(block.dtype())?;
            let share = multiply(&grad_logits, &block.contiguous()?)?.to_dtype(scores.dtype())?;
            grad_hidden = Some(match grad_hidden {
                Some(sum) => (sum + share)?,
                None => share,
            });
            if trained {
                grad_weight.push(multiply(&grad_logits.t()?, &hidden)?);
            }
        }
        let grad_hidden = match grad_hidden {
            Some(grad) => grad.to_dtype(hidden.dtype())?,
            None => hidden.zeros_like()?,
        };
        let grad_weight = if trained {
            Some(Tensor::cat(&grad_weight, 0)?)
        } else {
            None
        };
        Ok((Some(grad_hidden), grad_weight, None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::kernels::head::column;
    use crate::testing::{max_difference, sines};

    /// `Σ a · logprob + Σ b · entropy`, with seeded weights per row (the top-1 column must carry none).
    fn loss(scores: &Tensor) -> Tensor {
        let rows = scores.dim(0).unwrap();
        let weights = sines((rows, column::COUNT), 0.61, scores.dtype())
            .broadcast_mul(
                &Tensor::new(&[1.0f64, 0.5, 7.0, 0.0], &Device::Cpu)
                    .unwrap()
                    .to_dtype(scores.dtype())
                    .unwrap(),
            )
            .unwrap();
        (scores * weights).unwrap().sum_all().unwrap()
    }

    fn targets(rows: usize, vocab: usize) -> Tensor {
        let ids: Vec<u32> = (0..rows).map(|i| ((i * 37 + 11) % vocab) as u32).collect();
        Tensor::new(ids.as_slice(), &Device::Cpu).unwrap()
    }

    /// Scores and both gradients in blocks (rows in the forward, columns in the backward, with uneven
    /// last blocks) equal those of the whole logits, in f64 and f32, the head trained or frozen, at two
    /// temperatures, with and without a soft-cap of the logits.
    #[test]
    fn blocks_give_the_whole_heads_scores_and_gradients() {
        let (rows, hidden_size, vocab) = (23, 16, 101);
        for dtype in [DType::F64, DType::F32] {
            let tolerance = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
            for (temperature, cap) in [(1.0, None), (0.7, None), (1.0, Some(2.0)), (0.7, Some(2.0))]
            {
                for trained in [true, false] {
                    let hidden =
                        Var::from_tensor(&sines((rows, hidden_size), 0.37, dtype)).unwrap();
                    let weight =
                        Var::from_tensor(&sines((vocab, hidden_size), 0.11, dtype)).unwrap();
                    let weight_tensor = if trained {
                        weight.as_tensor().clone()
                    } else {
                        weight.as_tensor().detach()
                    };
                    let targets = targets(rows, vocab);
                    let whole = scores_within(
                        hidden.as_tensor(),
                        &weight_tensor,
                        (&targets, &[]),
                        (temperature, cap),
                        usize::MAX,
                    )
                    .unwrap();
                    // 7 · 101 elements: blocks of 7 rows forward, of 30 columns backward.
                    let blocked = scores_within(
                        hidden.as_tensor(),
                        &weight_tensor,
                        (&targets, &[]),
                        (temperature, cap),
                        7 * vocab + 3,
                    )
                    .unwrap();
                    assert!(max_difference(&whole, &blocked) <= tolerance);
                    let whole_grads = loss(&whole).backward().unwrap();
                    let blocked_grads = loss(&blocked).backward().unwrap();
                    let grad = |grads: &candle_core::backprop::GradStore, var: &Var| {
                        grads.get(var.as_tensor()).cloned()
                    };
                    let (a, b) = (
                        grad(&whole_grads, &hidden).unwrap(),
                        grad(&blocked_grads, &hidden).unwrap(),
                    );
                    assert!(
                        max_difference(&a, &b) <= tolerance,
                        "{dtype:?} t={temperature} cap {cap:?} hidden: {}",
                        max_difference(&a, &b)
                    );
                    match (grad(&whole_grads, &weight), grad(&blocked_grads, &weight)) {
                        (Some(a), Some(b)) => {
                            assert!(trained);
                            assert!(
                                max_difference(&a, &b) <= tolerance,
                                "{dtype:?} t={temperature} cap {cap:?} weight: {}",
                                max_difference(&a, &b)
                            );
                        }
                        (None, None) => assert!(!trained),
                        other => panic!("weight gradients differ in presence: {other:?}"),
                    }
                }
            }
        }
    }

    /// A bf16 head: the blocks' products run in bf16 as the whole head's do; results agree to bf16's
    /// precision.
    #[test]
    fn a_half_precision_head_in_blocks() {
        let (rows, hidden_size, vocab) = (9, 16, 64);
        let hidden = Var::from_tensor(&sines((rows, hidden_size), 0.37, DType::BF16)).unwrap();
        let weight = Var::from_tensor(&sines((vocab, hidden_size), 0.11, DType::BF16)).unwrap();
        let targets = targets(rows, vocab);
        let score = |budget| {
            scores_within(
                hidden.as_tensor(),
                weight.as_tensor(),
                (&targets, &[]),
                (1.0, None),
                budget,
            )
            .unwrap()
        };
        let (whole, blocked) = (score(usize::MAX), score(2 * vocab));
        assert_eq!(blocked.dtype(), DType::F32);
        assert!(max_difference(&whole, &blocked) <= 1e-6);
        let (a, b) = (
            loss(&whole).backward().unwrap(),
            loss(&blocked).backward().unwrap(),
        );
        for var in [&hidden, &weight] {
            let (x, y) = (
                a.get(var.as_tensor())
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap(),
                b.get(var.as_tensor())
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap(),
            );
            assert!(max_difference(&x, &y) <= 2e-2 * crate::testing::max_abs(&x).max(1.0));
        }
    }

    /// The masked head against a reference that scores each row over its allowed tokens alone (the
    /// head's rows picked out, soft-capped or not, a log-softmax over them, in f64 through candle's ops):
    /// scores and both gradients agree to 1e-6 whole and in blocks, at two temperatures; a token no row
    /// allows gets no gradient in the head's weight; unmasked rows score as the plain head scores them.
    #[test]
    fn masked_rows_score_and_train_over_their_allowed_tokens_only() {
        let (rows, hidden_size, vocab) = (11, 8, 41);
        let targets_of = targets(rows, vocab);
        let target_ids: Vec<u32> = targets_of.to_vec1().unwrap();
        // Rows 2, 5 and 9 are drawn whole; the others under a mask that holds their target.
        let allowed: Vec<Option<Allowed>> = (0..rows)
            .map(|row| {
                (![2, 5, 9].contains(&row)).then(|| {
                    let mut ids: Vec<u32> = (0..vocab as u32)
                        .filter(|id| (id * 7 + row as u32).is_multiple_of(5) && *id != 39)
                        .collect();
                    ids.push(target_ids[row]);
                    Allowed::of(&ids, vocab)
                })
            })
            .collect();
        for (temperature, cap) in [(1.0, None), (0.6, None), (0.6, Some(0.5))] {
            let hidden = Var::from_tensor(&sines((rows, hidden_size), 0.37, DType::F64)).unwrap();
            let weight = Var::from_tensor(&sines((vocab, hidden_size), 0.11, DType::F64)).unwrap();
            // The reference: row by row, the allowed rows of the head, a log-softmax over them.
            let mut reference = Vec::new();
            for row in 0..rows {
                let ids: Vec<u32> = match &allowed[row] {
                    Some(allowed) => (0..vocab as u32)
                        .filter(|&id| allowed.contains(id as usize))
                        .collect(),
                    None => (0..vocab as u32).collect(),
                };
                let position = ids.iter().position(|&id| id == target_ids[row]).unwrap();
                let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
                let logits = hidden
                    .as_tensor()
                    .narrow(0, row, 1)
                    .unwrap()
                    .matmul(&weight.index_select(&ids, 0).unwrap().t().unwrap())
                    .unwrap();
                let logits = match cap {
                    Some(cap) => ((logits / cap).unwrap().tanh().unwrap() * cap).unwrap(),
                    None => logits,
                };
                let logits = logits.affine(1.0 / temperature, 0.0).unwrap();
                let logprobs =
                    candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1).unwrap();
                let entropy = (logprobs.exp().unwrap() * &logprobs)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .neg()
                    .unwrap();
                let chosen = logprobs.narrow(1, position, 1).unwrap().sum_all().unwrap();
                reference.push(Tensor::stack(&[chosen, entropy], 0).unwrap());
            }
            let reference = Tensor::stack(&reference, 0).unwrap();
            let weights = sines((rows, 2), 0.61, DType::F64);
            let reference_loss = (&reference * &weights).unwrap().sum_all().unwrap();
            let reference_grads = reference_loss.backward().unwrap();
            for budget in [usize::MAX, 3 * vocab + 1] {
                let scores = scores_within(
                    hidden.as_tensor(),
                    weight.as_tensor(),
                    (&targets_of, &allowed),
                    (temperature, cap),
                    budget,
                )
                .unwrap();
                let two = scores.narrow(1, 0, 2).unwrap();
                assert!(
                    max_difference(&two, &reference) <= 1e-6,
                    "budget {budget} t={temperature} cap {cap:?}: {two} vs {reference}"
                );
                let grads = (&two * &weights)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                for var in [&hidden, &weight] {
                    let (a, b) = (
                        grads.get(var.as_tensor()).unwrap(),
                        reference_grads.get(var.as_tensor()).unwrap(),
                    );
                    assert!(
                        max_difference(a, b) <= 1e-6,
                        "budget {budget} t={temperature} cap {cap:?}: {}",
                        max_difference(a, b)
                    );
                }
                // Token 39 is allowed by no masked row; the unmasked rows still train it.
                let unmasked = scores_within(
                    hidden.as_tensor(),
                    weight.as_tensor(),
                    (&targets_of, &[]),
                    (temperature, cap),
                    budget,
                )
                .unwrap();
                for row in [2, 5, 9] {
                    let (a, b) = (
                        scores.narrow(0, row, 1).unwrap(),
                        unmasked.narrow(0, row, 1).unwrap(),
                    );
                    assert!(max_difference(&a, &b) <= 1e-12);
                }
                let masked_rows = (0..rows)
                    .filter(|row| allowed[*row].is_some())
                    .collect::<Vec<_>>();
                let masked_only = Tensor::new(
                    masked_rows
                        .iter()
                        .map(|&row| row as u32)
                        .collect::<Vec<_>>()
                        .as_slice(),
                    &Device::Cpu,
                )
                .unwrap();
                let grads = two
                    .contiguous()
                    .unwrap()
                    .index_select(&masked_only, 0)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let grad_39: Vec<f64> = grads
                    .get(weight.as_tensor())
                    .unwrap()
                    .narrow(0, 39, 1)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert!(grad_39.iter().all(|g| *g == 0.0), "{grad_39:?}");
            }
        }
    }
}
