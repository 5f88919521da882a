//! The value model: a transformer (a copy of the policy, or `value_model`'s folder) with a linear head
//! from its final hidden state to one number, as TRL's value model is a sequence classifier with one
//! label (`score`, no bias). The value of a trained token is the head at the position that predicts it:
//! the state before the token is sampled, as TRL slices `values[:, context_length - 1 : -1]`.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};
use rand::SeedableRng;

use crate::batch::Sequence;
use crate::pack::{pack, Packed};
use crate::score;
use holo_model::{Model, Ops};

/// The standard deviation of a new head's weights: transformers' `initializer_range` default, which is
/// how a sequence classifier's missing `score` is initialized.
const HEAD_INIT_STD: f64 = 0.02;

/// The name of the head's weight (transformers' `*ForSequenceClassification`).
pub const HEAD: &str = "score.weight";

/// The value model and its trained weights.
pub struct Critic {
    pub model: Model,
    pub head: Var,
    /// The trained weights by name: the transformer's (every weight, or LoRA adapters), then [`HEAD`].
    pub vars: Vec<(String, Var)>,
}

impl Critic {
    /// A value model on `backbone` (copied: the policy's weights are not shared), training every weight
    /// or, with `lora`, adapters of its own; the head is `head` (`[1, hidden]`) or a new one drawn from
    /// `seed`.
    pub fn new(
        backbone: &Model,
        head: Option<Tensor>,
        lora: Option<&holo_model::model::LoraConfig>,
        seed: u64,
    ) -> Result<Self> {
        let (model, mut vars) = match lora {
            Some(lora) => backbone.with_lora(lora)?,
            None => backbone.trainable()?,
        };
        // The output projection, and an adapter on it, have no part in a value (tied models train it
        // as the embedding).
        vars.retain(|(name, _)| {
            name != "lm_head.weight" && !name.starts_with(holo_model::model::HEAD_ADAPTER)
        });
        let hidden = model.config.hidden_size;
        let head = match head {
            Some(head) => {
                if head.dims() != [1, hidden] {
                    candle_core::bail!(
                        "the value model's {HEAD} has shape {:?}; a value head is [1, {hidden}]",
                        head.dims()
                    );
                }
                head.to_device(model.device())?.to_dtype(model.dtype())?
            }
            None => normal(hidden, seed)?
                .to_device(model.device())?
                .to_dtype(model.dtype())?,
        };
        let head = Var::from_tensor(&head)?;
        vars.push((HEAD.to_string(), head.clone()));
        Ok(Critic { model, head, vars })
    }

    /// The values `[N]` of `packed`'s trained tokens from the final hidden states `[R, T, hidden]`, in
    /// the type of the logits (f32 over a bf16 model), which the value loss is computed in.
    pub fn head(&self, hidden: &Tensor, packed: &Packed) -> Result<Tensor> {
        score::pick(hidden, packed)?
            .matmul(&self.head.as_tensor().t()?)?
            .squeeze(1)?
            .to_dtype(self.model.logits_dtype())
    }

    /// The values (without gradient) of each sequence's trained tokens, `batch` sequences at a time.
    pub fn values(&self, sequences: &[&Sequence], batch: usize) -> Result<Vec<Vec<f32>>> {
        let mut values = Vec::with_capacity(sequences.len());
        for chunk in sequences.chunks(batch.max(1)) {
            let packed = pack(chunk, &self.model)?;
            let flat = if packed.tokens == 0 {
                Vec::new()
            } else {
                let hidden = score::final_hidden(&self.model, &packed, Ops::Differentiable)?;
                self.head(&hidden.detach(), &packed)?
                    .detach()
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?
            };
            let mut offset = 0;
            for sequence in chunk {
                values.push(flat[offset..offset + sequence.trained.len()].to_vec());
                offset += sequence.trained.len();
            }
        }
        Ok(values)
    }

    /// The gradients of `loss(values)` over `sequences`' trained tokens, with the whole graph kept or
    /// (`recompute`) one layer's at a time.
    pub fn backward(
        &self,
        sequences: &[&Sequence],
        recompute: bool,
        loss: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, GradStore)> {
        let packed = pack(sequences, &self.model)?;
        if recompute {
            self.model.backward_recomputed_with_head(
                &packed.ids,
                &packed.layout,
                &[self.head.as_tensor().clone()],
                |hidden| loss(&self.head(hidden, &packed)?),
            )
        } else {
            let hidden = score::final_hidden(&self.model, &packed, Ops::Differentiable)?;
            let value = loss(&self.head(&hidden, &packed)?)?;
            let grads = value.backward()?;
            Ok((value.detach(), grads))
        }
    }
}

/// A `[1, hidden]` head drawn from N(0, [`HEAD_INIT_STD`]²) (Box–Muller on a seeded ChaCha8).
fn normal(hidden: usize, seed: u64) -> Result<Tensor> {
    use rand::Rng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let values: Vec<f32> = (0..hidden)
        .map(|_| {
            let u1: f64 = rng.random_range(f64::EPSILON..1.0);
            let u2: f64 = rng.random();
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            (z * HEAD_INIT_STD) as f32
        })
        .collect();
    Tensor::from_vec(values, (1, hidden), &candle_core::Device::Cpu)
}
