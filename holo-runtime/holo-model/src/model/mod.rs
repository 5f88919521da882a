//! The decoder every family runs: plain structs per layer, weights named as in Hugging Face
//! checkpoints. The families differ only by what [`ModelConfig`] says (its `Variant` and `LayerSpec`s):
//! projections in `linear.rs`, norms in `norm.rs`, RoPE in `rotary.rs`, attention in `attention.rs`, a
//! layer in `layer.rs`, keys and values in `cache.rs`, LoRA adapters put on in `lora.rs`; the model and
//! its passes here.
//!
//! One set of weights serves two paths. Sampling ([`Ops::Fast`]) uses candle's fused kernels for RMSNorm,
//! RoPE and softmax, which have no backward. Training ([`Ops::Differentiable`]) builds the same functions
//! from basic tensor ops, so every weight receives its gradient; [`Model::trainable`] moves the weights
//! into [`Var`]s for an optimizer.
//!
//! Every row has its own positions (its real tokens counted from 0), so rows padded differently, or
//! resuming from caches of different lengths, rotate exactly as they would alone.

mod attention;
mod cache;
mod delta;
mod experts;
mod layer;
mod linear;
mod lora;
mod norm;
mod output;
mod rotary;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, TensorId, Var, D};
use candle_nn::VarBuilder;

use super::config::{
    Activation, ClampedSwiGlu, LayerSpec, ModelConfig, NormPlacement, QkNorm, RopeScaling,
};
use super::dispatch::{self, Operands, Product};
pub use super::layout::positions_from_mask;
use super::layout::{held_mask, window_mask, Layout};
pub use crate::kernels::kernel::{Ops, Result};

pub use crate::peft::{LoraConfig, Pattern, Targets, ALL_LINEAR};
pub use crate::routing::{Routes, Routing, RoutingDrift, UNROUTED};
pub use attention::Attention;
pub(crate) use attention::{softcap, softmax};
pub use cache::{starts, trim_block, KvCache, LayerCache, LayerSequence, Segment, SequenceCache};
pub(crate) use delta::state_dtype;
pub use delta::GatedDeltaNet;
pub use experts::{
    checkpoint_tensors, held_tensors, read_by_expert, ExpertLora, ExpertStack, Mixture,
    SharedExpert,
};
use layer::norm;
pub use layer::{DecoderLayer, FeedForward, Mixer, Mlp};
pub(crate) use linear::AdapterParts;
pub use linear::{
    targets, Dropout, Linear, Lora, Split, Weight, FUSED_PROJECTIONS, LINEAR_ATTENTION_PROJECTIONS,
    PROJECTIONS,
};
pub use norm::RmsNorm;
pub use output::{HEAD_ADAPTER, LOGITS_BUDGET};
pub(crate) use rotary::apply_rope;
use rotary::Rope;

/// A causal language model of one of the families of [`crate::config::Arch`].
#[derive(Debug, Clone)]
pub struct Model {
    pub config: ModelConfig,
    pub embed_tokens: Tensor,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    /// `None` when the output projection is tied to `embed_tokens`.
    pub lm_head: Option<Tensor>,
    /// The output projection as a GGUF file's quantized blocks ([`Weight::Quantized`]), which the logits
    /// are computed with instead of the dense head: a sampling-only model, whose dense head stays for
    /// the embeddings (when tied) and the list of weights.
    pub(crate) quantized_head: Option<Linear>,
    /// LoRA on the output head (PEFT's `lm_head` target module), on `lm_head` or, when tied, on the
    /// embeddings' use as the head only: the embeddings of the input are not adapted, as under PEFT.
    pub head_lora: Option<Lora>,
    rope: Rope,
    /// The windowed layers' RoPE, when it is not the others'
    /// ([`crate::config::Variant::local_rope`]).
    local_rope: Option<Rope>,
    /// How many elements of logits the training head holds at once ([`Model::with_head_budget`]).
    head_budget: usize,
}

impl Model {
    /// Builds the model from Hugging Face tensor names under `vb` (`model.*`, `lm_head.weight`).
    pub fn load(vb: VarBuilder, config: &ModelConfig) -> Result<Self> {
        let inner = vb.pp("model");
        let embed_tokens = inner.get(
            (config.vocab_size, config.hidden_size),
            "embed_tokens.weight",
        )?;
        if config.layers.len() != config.num_hidden_layers {
            candle_core::bail!(
                "the config describes {} layers for num_hidden_layers {}",
                config.layers.len(),
                config.num_hidden_layers
            );
        }
        let layers = config
            .layers
            .iter()
            .enumerate()
            .map(|(i, &spec)| DecoderLayer::load(inner.pp(format!("layers.{i}")), config, spec, i))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(inner.pp("norm"), config.hidden_size, config)?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(vb.get((config.vocab_size, config.hidden_size), "lm_head.weight")?)
        };
        let rotated = config.variant.rotary_dim.unwrap_or(config.head_dim);
        let rope =
            |theta: f64, scaling: &RopeScaling| Rope::new(rotated, theta, scaling, vb.device());
        let model = Model {
            config: config.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            quantized_head: None,
            head_lora: None,
            rope: rope(config.rope_theta, &config.rope_scaling)?,
            local_rope: config
                .variant
                .local_rope
                .as_ref()
                .map(|(theta, scaling)| rope(*theta, scaling))
                .transpose()?,
            head_budget: LOGITS_BUDGET,
        };
        if model.embed_tokens.dtype() == DType::BF16 && model.device().is_cpu() {
            // bf16 weights with f32 arithmetic (see `bf16`): the vectors (norms, biases) and the
            // linear-attention layers' convolutions in f32.
            return model.map_weights(|_, tensor| match tensor.rank() {
                1 | 3 => tensor.to_dtype(DType::F32),
                _ => Ok(tensor.clone()),
            });
        }
        Ok(model)
    }

    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    /// The precision of the arithmetic: the weights' own, except for bf16 weights on the CPU, which
    /// run in f32.
    pub fn dtype(&self) -> DType {
        self.norm.weight.dtype()
    }

    /// Refuses what only samples: bf16 matrices with f32 arithmetic, and MXFP4 blocks (whose products
    /// have no backward); with `frozen_blocks`, a GGUF file's quantized blocks too (full fine-tuning
    /// needs every weight's gradient, which blocks have not). LoRA trains over the blocks (QLoRA).
    fn sampling_only(&self, frozen_blocks: bool) -> Result<()> {
        let refused = self
            .layers
            .iter()
            .flat_map(Self::linears)
            .map(|(_, linear)| linear)
            .chain(&self.quantized_head)
            .find_map(|linear| match &linear.weight {
                Weight::Quantized(blocks) if frozen_blocks => Some(candle_core::Error::Msg(format!(
                    "full fine-tuning needs a gradient for every weight, and the {:?} projections \
                     kept as the GGUF file's blocks (`--quantized`) are frozen: train LoRA adapters \
                     over them (`use_peft = true`), or load the file dequantized (without \
                     `--quantized`)",
                    blocks.dtype()
                ))),
                Weight::Mxfp4(_) => linear.weight.dense().err(),
                _ => None,
            });
        if let Some(error) = refused {
            return Err(error);
        }
        if self.embed_tokens.dtype() != self.dtype() {
            candle_core::bail!(
                "this model holds bf16 weights for f32 arithmetic on the CPU, which only samples; load it in f32 to train"
            );
        }
        Ok(())
    }

    /// The type of the logits, log-probabilities and losses: f64 for an f64 model, f32 otherwise (a
    /// half-precision model's logits are cast up).
    pub fn logits_dtype(&self) -> DType {
        match self.dtype() {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }

    /// The projections of a layer under their module names (`self_attn.q_proj`, …; Phi-3's
    /// `self_attn.qkv_proj` and `mlp.gate_up_proj`; Qwen3.5's `linear_attn.in_proj_qkv`, …), in module
    /// order.
    pub fn linears(layer: &DecoderLayer) -> Vec<(String, &Linear)> {
        let module = layer.mixer.module();
        let mixer = match &layer.mixer {
            Mixer::Attention(attention) => {
                let mut named = attention.qkv.named();
                named.push(("o_proj", &attention.o_proj));
                named
            }
            Mixer::Linear(linear) => linear.named(),
        };
        let mlp = layer.mlp.named().into_iter();
        mixer
            .into_iter()
            .map(|(name, linear)| (format!("{module}.{name}"), linear))
            .chain(mlp.map(|(name, linear)| (format!("mlp.{name}"), linear)))
            .collect()
    }

    pub(crate) fn linears_mut<'a>(
        mixer: &'a mut Mixer,
        mlp: &'a mut FeedForward,
    ) -> Vec<(String, &'a mut Linear)> {
        Self::parts_mut(mixer, mlp).0
    }

    /// The projections of a layer under their module names, and its token mixer's other weights under
    /// their full names in the layer (`self_attn.q_norm.weight`, `linear_attn.conv1d.weight`, …).
    #[allow(clippy::type_complexity)]
    fn parts_mut<'a>(
        mixer: &'a mut Mixer,
        mlp: &'a mut FeedForward,
    ) -> (Vec<(String, &'a mut Linear)>, Vec<(String, &'a mut Tensor)>) {
        let module = mixer.module();
        let (linears, others): (Vec<(&str, &mut Linear)>, Vec<(&str, &mut Tensor)>) = match mixer {
            Mixer::Attention(Attention {
                qkv,
                o_proj,
                q_norm,
                k_norm,
                sinks,
                ..
            }) => {
                let mut linears = qkv.named_mut();
                linears.push(("o_proj", o_proj));
                let mut others: Vec<(&str, &mut Tensor)> =
                    [("q_norm.weight", q_norm), ("k_norm.weight", k_norm)]
                        .into_iter()
                        .filter_map(|(name, norm)| Some((name, &mut norm.as_mut()?.weight)))
                        .collect();
                if let Some(sinks) = sinks {
                    others.push(("sinks", sinks));
                }
                (linears, others)
            }
            Mixer::Linear(linear) => {
                let (linears, others) = linear.parts_mut();
                (linears, others.into_iter().collect())
            }
        };
        let mlp = mlp.named_mut().into_iter();
        (
            linears
                .into_iter()
                .map(|(name, linear)| (format!("{module}.{name}"), linear))
                .chain(mlp.map(|(name, linear)| (format!("mlp.{name}"), linear)))
                .collect(),
            others
                .into_iter()
                .map(|(name, tensor)| (format!("{module}.{name}"), tensor))
                .collect(),
        )
    }

    /// Every base weight with its Hugging Face name, in checkpoint order: the one list of the weights.
    /// Projections kept as a GGUF file's blocks are not tensors and are left out: such a model only
    /// samples ([`Model::trainable`] and [`Model::with_lora`] refuse it).
    fn weights_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let mut named = vec![(
            "model.embed_tokens.weight".to_string(),
            &mut self.embed_tokens,
        )];
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let DecoderLayer {
                mixer,
                mlp,
                input_layernorm,
                post_attention_layernorm,
                pre_feedforward_layernorm,
                post_feedforward_layernorm,
                placement: _,
                spec: _,
            } = layer;
            let (linears, others) = Self::parts_mut(mixer, mlp);
            for (name, linear) in linears {
                if let Weight::Dense(weight) = &mut linear.weight {
                    named.push((format!("model.layers.{i}.{name}.weight"), weight));
                }
                if let Some(bias) = &mut linear.bias {
                    named.push((format!("model.layers.{i}.{name}.bias"), bias));
                }
            }
            for (name, tensor) in others {
                named.push((format!("model.layers.{i}.{name}"), tensor));
            }
            for (name, norm) in [
                ("input_layernorm", input_layernorm.as_mut()),
                ("post_attention_layernorm", Some(post_attention_layernorm)),
                (
                    "pre_feedforward_layernorm",
                    pre_feedforward_layernorm.as_mut(),
                ),
                (
                    "post_feedforward_layernorm",
                    post_feedforward_layernorm.as_mut(),
                ),
            ] {
                if let Some(norm) = norm {
                    named.push((format!("model.layers.{i}.{name}.weight"), &mut norm.weight));
                }
            }
        }
        named.push(("model.norm.weight".to_string(), &mut self.norm.weight));
        if let Some(lm_head) = &mut self.lm_head {
            named.push(("lm_head.weight".to_string(), lm_head));
        }
        named
    }

    /// Every base weight with its Hugging Face name (LoRA adapters are in [`Model::named_adapters`]).
    pub fn named_weights(&self) -> Vec<(String, Tensor)> {
        let mut model = self.clone();
        let named = model.weights_mut();
        named
            .into_iter()
            .map(|(name, tensor)| (name, tensor.clone()))
            .collect()
    }

    /// LoRA tensors under PEFT's names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`).
    pub fn named_adapters(&self) -> Vec<(String, &Tensor)> {
        let mut named = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (name, linear) in Self::linears(layer) {
                if let Some(lora) = &linear.lora {
                    let prefix = format!("base_model.model.model.layers.{i}.{name}");
                    named.push((format!("{prefix}.lora_A.weight"), &lora.a));
                    named.push((format!("{prefix}.lora_B.weight"), &lora.b));
                }
            }
            if let FeedForward::Experts(mixture) = &layer.mlp {
                let prefixes = lora::expert_prefixes(i, mixture.adapters.len());
                for (lora, prefix) in mixture.adapters.iter().zip(prefixes) {
                    named.push((format!("{prefix}.lora_A.weight"), &lora.a));
                    named.push((format!("{prefix}.lora_B.weight"), &lora.b));
                }
            }
        }
        if let Some(lora) = &self.head_lora {
            named.push((format!("{HEAD_ADAPTER}.lora_A.weight"), &lora.a));
            named.push((format!("{HEAD_ADAPTER}.lora_B.weight"), &lora.b));
        }
        named
    }

    /// A copy with every base weight of type `dtype`, arithmetic included: a bf16 copy computes in
    /// bf16 on any device, which is how a model loaded in bf16 runs on CUDA (on the CPU,
    /// [`super::files::load_model`] keeps a bf16 model's arithmetic in f32, for sampling).
    pub fn to_dtype(&self, dtype: DType) -> Result<Model> {
        self.map_weights(|_, weight| weight.to_dtype(dtype))
    }

    /// A copy with `f(name, weight)` in place of every base weight (adapters stay).
    fn map_weights(&self, mut f: impl FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<Model> {
        let mut model = self.clone();
        for (name, weight) in model.weights_mut() {
            *weight = f(&name, weight)?;
        }
        Ok(model)
    }

    /// A copy whose experts carry their LoRA updates in their matrices and no adapters (the other
    /// projections' adapters stay): the experts' part of merging an adapted model.
    pub fn with_experts_merged(&self) -> Result<Model> {
        let mut model = self.clone();
        for layer in &mut model.layers {
            if let FeedForward::Experts(mixture) = &mut layer.mlp {
                *mixture = mixture.merged()?;
            }
        }
        Ok(model)
    }

    /// Whether an adapter drops its inputs (LoRA dropout above 0) in differentiable passes whose seed
    /// is set.
    pub fn has_dropout(&self) -> bool {
        let head = self
            .head_lora
            .as_ref()
            .is_some_and(|lora| lora.dropout.is_some());
        head || self.layers.iter().any(|layer| {
            Self::linears(layer).iter().any(|(_, linear)| {
                linear
                    .lora
                    .as_ref()
                    .is_some_and(|lora| lora.dropout.is_some())
            })
        })
    }

    /// Seeds the LoRA dropout masks of the differentiable passes that follow (0 turns dropout off); see
    /// [`Dropout`]. Copies of the model ([`Model::detached`]) share the seed.
    pub fn set_dropout_seed(&self, seed: u64) {
        let dropout = self
            .layers
            .iter()
            .find_map(|layer| {
                Self::linears(layer)
                    .into_iter()
                    .find_map(|(_, linear)| linear.lora.as_ref()?.dropout.as_ref())
            })
            .or_else(|| self.head_lora.as_ref()?.dropout.as_ref());
        if let Some(dropout) = dropout {
            dropout
                .seed
                .store(seed, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A copy whose weights are [`Var`]s (returned with their names, tied weights once), for training.
    pub fn trainable(&self) -> Result<(Model, Vec<(String, Var)>)> {
        self.sampling_only(true)?;
        let mut vars = Vec::new();
        let model = self.map_weights(|name, tensor| {
            let var = Var::from_tensor(tensor)?;
            let tensor = var.as_tensor().clone();
            vars.push((name.to_string(), var));
            Ok(tensor)
        })?;
        Ok((model, vars))
    }

    /// A copy sharing the weights' storage but not tracked by autograd: what sampling runs on, so the
    /// KV cache does not keep a graph alive. Optimizer updates to the [`Var`]s are visible through it.
    pub fn detached(&self) -> Model {
        let Ok(model) =
            self.map_tensors(&mut |tensor| Ok::<_, std::convert::Infallible>(tensor.detach()));
        model
    }

    /// A copy of the weights as they are now: the trained tensors ([`Var`]s: every weight in full
    /// fine-tuning, the adapters under LoRA) copied into storage of their own, the frozen ones shared;
    /// none tracked by autograd. What a trainer's rollouts sample from while its optimizer goes on
    /// updating the [`Var`]s (`max_off_policy_steps`). A tensor used twice (tied embeddings) is copied
    /// once.
    pub fn snapshot(&self) -> Result<Model> {
        let mut copies: HashMap<TensorId, Tensor> = HashMap::new();
        self.map_tensors(&mut |tensor| {
            if !tensor.is_variable() {
                return Ok(tensor.detach());
            }
            if let Some(copy) = copies.get(&tensor.id()) {
                return Ok(copy.clone());
            }
            let copy = tensor.copy()?.detach();
            copies.insert(tensor.id(), copy.clone());
            Ok(copy)
        })
    }

    /// A copy with `f(tensor)` in place of every tensor: embeddings, head, norms, and every layer's.
    fn map_tensors<E>(
        &self,
        f: &mut impl FnMut(&Tensor) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Model, E> {
        let mut model = self.clone();
        model.embed_tokens = f(&model.embed_tokens)?;
        model.norm.weight = f(&model.norm.weight)?;
        model.lm_head = model.lm_head.as_ref().map(&mut *f).transpose()?;
        if let Some(lora) = &mut model.head_lora {
            lora.a = f(&lora.a)?;
            lora.b = f(&lora.b)?;
        }
        for layer in &mut model.layers {
            *layer = layer.map_tensors(f)?;
        }
        Ok(model)
    }

    /// Hidden states `[B, T, hidden]` of `input_ids` `[B, T]` (u32) at `positions` `[B, T]` (u32, each
    /// token's position in its row's sequence). `key_mask` `[B, S]` (u8, 1 for real tokens) covers the
    /// cached columns followed by the `T` new ones; a query sees the real keys up to its own column.
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        key_mask: &Tensor,
        cache: Option<&mut KvCache>,
        ops: Ops,
    ) -> Result<Tensor> {
        let frame = self.frame(positions, key_mask, cache.as_deref(), None)?;
        self.hidden(input_ids, &frame, cache, ops)
    }

    /// Hidden states `[B, T, hidden]` of `input_ids` `[B, T]` (u32) laid out by `layout` (padded rows,
    /// or trees of sequences that share prefixes), without a cache.
    pub fn forward_hidden_in(
        &self,
        input_ids: &Tensor,
        layout: &Layout,
        ops: Ops,
    ) -> Result<Tensor> {
        self.hidden(input_ids, &self.frame_of(layout)?, None, ops)
    }

    /// The final hidden states of `input_ids` through every layer in `frame`.
    fn hidden(
        &self,
        input_ids: &Tensor,
        frame: &Frame,
        mut cache: Option<&mut KvCache>,
        ops: Ops,
    ) -> Result<Tensor> {
        let mut xs = self.embed(input_ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let layer_cache = cache.as_deref_mut().map(|cache| &mut cache.layers[i]);
            xs = layer.forward(&xs, frame, layer_cache, ops)?;
        }
        self.norm.forward(&xs, ops)
    }

    /// Several batches in one sampling pass (`ops` [`Ops::Fast`] or [`Ops::Invariant`]): the position-wise parts (projections, MLP,
    /// norms) run on all their tokens at once, reading each weight once, and attention runs per batch
    /// with its own positions, key mask and cache (see [`Model::forward_hidden`]). A scheduler's decoding
    /// rows and a prompt being prefilled share a pass this way. Returns each batch's final hidden
    /// states `[B, T, hidden]`.
    pub fn forward_segments(&self, segments: &mut [Segment<'_>], ops: Ops) -> Result<Vec<Tensor>> {
        self.forward_segments_routed(segments, ops, None)
    }

    /// [`Model::forward_segments`] with the mixture layers' choices recorded in `routing` (the tokens
    /// of every segment in order, each segment's `[B, T]` row-major).
    pub fn forward_segments_routed(
        &self,
        segments: &mut [Segment<'_>],
        ops: Ops,
        routing: Option<&Routing>,
    ) -> Result<Vec<Tensor>> {
        let mut frames = Vec::with_capacity(segments.len());
        let mut shapes = Vec::with_capacity(segments.len());
        let mut embedded = Vec::with_capacity(segments.len());
        for segment in segments.iter() {
            let (batch, len) = segment.input_ids.dims2()?;
            frames.push(self.frame(
                &segment.positions,
                &segment.key_mask,
                Some(segment.cache),
                segment.lengths.as_deref(),
            )?);
            embedded.push(
                self.embed(&segment.input_ids)?
                    .reshape((batch * len, self.config.hidden_size))?,
            );
            shapes.push((batch, len));
        }
        let mut xs = Tensor::cat(&embedded, 0)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let normed = norm(layer.norms().attention_input, &xs, ops)?;
            let mixed = match &layer.mixer {
                Mixer::Attention(attention) => {
                    self.attend_segments(attention, layer.spec, i, &normed, segments, &frames, ops)?
                }
                Mixer::Linear(linear) => {
                    let projected = linear.projections.forward(&normed, ops)?;
                    let mut cores = Vec::with_capacity(segments.len());
                    let mut offset = 0;
                    for ((segment, frame), &(batch, len)) in
                        segments.iter_mut().zip(&frames).zip(&shapes)
                    {
                        let rows = batch * len;
                        let part = projected
                            .iter()
                            .map(|x| x.narrow(0, offset, rows))
                            .collect::<Result<Vec<_>>>()?;
                        let core = linear.mix(
                            &part,
                            (batch, len),
                            frame.real()?,
                            Some(&mut segment.cache.layers[i]),
                            ops,
                        )?;
                        cores.push(core.reshape((rows, ()))?);
                        offset += rows;
                    }
                    linear.output(&Tensor::cat(&cores, 0)?, &projected[1], ops)?
                }
            };
            xs = layer.finish(&xs, &mixed, ops, routing, None)?;
        }
        let xs = self.norm.forward(&xs, ops)?;
        let mut offset = 0;
        shapes
            .iter()
            .map(|&(batch, len)| {
                let part = xs.narrow(0, offset, batch * len)?;
                offset += batch * len;
                part.reshape((batch, len, self.config.hidden_size))
            })
            .collect()
    }

    /// Attention in [`Model::forward_segments`]: the projections of every segment's tokens `normed`
    /// `[N, hidden]` at once, then each segment's attention over its own cache, then `o_proj` at once.
    #[allow(clippy::too_many_arguments)]
    fn attend_segments(
        &self,
        attention: &Attention,
        spec: LayerSpec,
        layer: usize,
        normed: &Tensor,
        segments: &mut [Segment<'_>],
        frames: &[Frame],
        ops: Ops,
    ) -> Result<Tensor> {
        let [q, k, v]: [Tensor; 3] = attention
            .qkv
            .forward(normed, ops)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("three projections".into()))?;
        let (q, gate) = attention.queries(&q)?;
        let mut outputs = Vec::with_capacity(segments.len());
        let mut offset = 0;
        for (segment, frame) in segments.iter_mut().zip(frames) {
            let (batch, len) = segment.input_ids.dims2()?;
            let rows = batch * len;
            let heads = |x: &Tensor, heads: usize, norm: Option<&RmsNorm>| -> Result<Tensor> {
                attention.split_heads(&x.narrow(0, offset, rows)?, (batch, len, heads), norm, ops)
            };
            let out = attention.attend(
                &heads(&q, attention.heads, attention.q_norm.as_ref())?,
                &heads(&k, attention.kv_heads, attention.k_norm.as_ref())?,
                &heads(&v, attention.kv_heads, None)?,
                frame.rope(spec),
                frame.mask(spec, segment.cache.layers[layer].front())?,
                Some(&mut segment.cache.layers[layer]),
                ops,
            )?;
            outputs.push(out.reshape((rows, attention.heads * attention.head_dim))?);
            offset += rows;
        }
        let attended = Attention::gate(Tensor::cat(&outputs, 0)?, gate.as_ref())?;
        attention.o_proj.forward(&attended, ops)
    }

    /// The embeddings `[B, T, hidden]` of `input_ids` `[B, T]`.
    pub(crate) fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (batch, len) = input_ids.dims2()?;
        let embedded = self
            .embed_tokens
            .index_select(&input_ids.flatten_all()?, 0)?
            .reshape((batch, len, self.config.hidden_size))?;
        let embedded = match self.config.variant.scale_embeddings {
            // √hidden rounded to the weights' type, as Gemma's `embed_scale.to(weight.dtype)`.
            true => {
                let scale = Tensor::new(&[(self.config.hidden_size as f64).sqrt()], self.device())?
                    .to_dtype(self.embed_tokens.dtype())?;
                embedded.broadcast_mul(&scale)?
            }
            false => embedded,
        };
        embedded.to_dtype(self.dtype())
    }

    /// What every layer of one forward pass shares: the attention masks and the rotary tables. The
    /// pass follows `cache`'s columns, if any; each attention layer's mask covers only the columns it
    /// holds there, and is built once for all the layers with the same window that hold the same
    /// columns ([`LayerCache::front`]). LongRoPE's factors are picked per row after a cache, by
    /// `lengths` (each row's whole sequence, see [`Segment::lengths`]) or by the row's last position
    /// here, so that a row's new keys rotate as its cached ones did whatever the other rows' lengths;
    /// without a cache, by the pass's largest position, as transformers picks them for a batch.
    pub(crate) fn frame(
        &self,
        positions: &Tensor,
        key_mask: &Tensor,
        cache: Option<&KvCache>,
        lengths: Option<&[usize]>,
    ) -> Result<Frame> {
        let (batch, len) = positions.dims2()?;
        let cached = cache.map_or(0, KvCache::len);
        let (mask_batch, mask_keys) = key_mask.dims2()?;
        if (mask_batch, mask_keys) != (batch, cached + len) {
            candle_core::bail!(
                "key mask is [{mask_batch}, {mask_keys}], expected [{batch}, {}] ({cached} cached + {len} new)",
                cached + len
            );
        }
        let real = key_mask.to_dtype(DType::U8)?.to_vec2::<u8>()?;
        let queries = positions.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let mut masks: Vec<Mask> = Vec::new();
        for (i, spec) in self.config.layers.iter().enumerate() {
            let front = cache.map_or(0, |cache| cache.layers[i].front());
            let built = masks
                .iter()
                .any(|mask| mask.window == spec.window && mask.front == front);
            if spec.linear || built {
                continue;
            }
            let mask = held_mask(
                &real,
                &queries,
                cached,
                front,
                spec.window,
                key_mask.device(),
            )?;
            masks.push(Mask {
                window: spec.window,
                front,
                mask: mask.to_dtype(self.dtype())?,
            });
        }
        let real = match self.has_linear_attention() {
            true => Some(key_mask.narrow(1, cached, len)?.to_dtype(DType::U8)?),
            false => None,
        };
        let lengths = match (lengths, cache) {
            (Some(lengths), _) => Some(lengths.to_vec()),
            (None, Some(_)) => Some(
                queries
                    .iter()
                    .map(|row| row.iter().max().map_or(0, |&last| last as usize + 1))
                    .collect(),
            ),
            (None, None) => None,
        };
        self.frame_with(masks, positions, lengths.as_deref(), real.as_ref())
    }

    /// LongRoPE's original context, when the model has LongRoPE: a sequence longer than this rotates
    /// every position by the long factors, a shorter one by the short factors.
    pub fn long_rope_context(&self) -> Option<usize> {
        self.rope.original_context()
    }

    /// Whether some layer is a linear-attention layer ([`Mixer::Linear`]): such a model reads sequences,
    /// never trees of them ([`Layout::trees`]), and its cache keeps states.
    pub fn has_linear_attention(&self) -> bool {
        self.config.layers.iter().any(|layer| layer.linear)
    }

    /// The frame of the attention `masks` for queries at `positions` `[B, T]` in sequences of `lengths`
    /// (see [`Model::frame`]): with the rotary tables.
    fn frame_with(
        &self,
        masks: Vec<Mask>,
        positions: &Tensor,
        lengths: Option<&[usize]>,
        real: Option<&Tensor>,
    ) -> Result<Frame> {
        let (cos, sin) = self.rope.tables(positions, lengths)?;
        let local = match &self.local_rope {
            Some(rope) => {
                let (cos, sin) = rope.tables(positions, lengths)?;
                Some((cos.to_dtype(self.dtype())?, sin.to_dtype(self.dtype())?))
            }
            None => None,
        };
        let real = match real {
            Some(real) => Some(real.flatten_all()?.to_vec1::<u8>()?),
            None => None,
        };
        Ok(Frame {
            masks,
            real,
            routing: None,
            balance: None,
            cos: cos.to_dtype(self.dtype())?,
            sin: sin.to_dtype(self.dtype())?,
            local,
        })
    }

    /// The [`Frame`] of a pass without a cache laid out by `layout`: its mask, and the same with each
    /// window the layers use.
    pub(crate) fn frame_of(&self, layout: &Layout) -> Result<Frame> {
        let real = match self.has_linear_attention() {
            true => layout.real.as_ref(),
            false => None,
        };
        let mut masks: Vec<Mask> = Vec::new();
        for spec in &self.config.layers {
            if spec.linear || masks.iter().any(|mask| mask.window == spec.window) {
                continue;
            }
            let mask = match spec.window {
                None => layout.mask.clone(),
                Some(window) => {
                    window_mask(&layout.mask, &layout.positions, &layout.positions, window)?
                }
            };
            masks.push(Mask {
                window: spec.window,
                front: 0,
                mask: mask.to_dtype(self.dtype())?,
            });
        }
        let frame = self.frame_with(masks, &layout.positions, None, real)?;
        Ok(Frame {
            routing: layout.routing.clone(),
            balance: layout.balance.clone(),
            ..frame
        })
    }

    /// Whether some projection is a GGUF file's quantized blocks, which sampling multiplies as ggml does
    /// (each row of activations rounded to 8 bits per block) and training by their exact values.
    pub fn holds_blocks(&self) -> bool {
        self.layers
            .iter()
            .flat_map(Self::linears)
            .any(|(_, linear)| matches!(linear.weight, Weight::Quantized(_)))
    }

    /// The bytes of weights one decoding step reads, but for norms, biases and a mixture's experts: the
    /// layers' projections and the output head (its blocks when kept).
    pub fn decoding_bytes(&self) -> usize {
        let head = match &self.quantized_head {
            Some(blocks) => blocks.weight.bytes(),
            None => {
                let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
                head.elem_count() * head.dtype().size_in_bytes()
            }
        };
        let projections: usize = self
            .layers
            .iter()
            .flat_map(Self::linears)
            .map(|(_, linear)| linear.weight.bytes())
            .sum();
        projections + head
    }

    /// Logits `[.., vocab]` of hidden states `[.., hidden]`, in f32 or f64 (differentiable with
    /// [`Ops::Differentiable`]), soft-capped where the family caps them
    /// ([`crate::config::Variant::final_softcap`]): what sampling draws from and scoring reads.
    pub fn logits(&self, hidden: &Tensor, ops: Ops) -> Result<Tensor> {
        let logits = match &self.quantized_head {
            Some(blocks) => output::widened(blocks.forward(hidden, ops)?)?,
            None => output::project_adapted(hidden, self.head_weight(), &self.head_lora, ops)?,
        };
        match self.config.variant.final_softcap {
            Some(cap) => softcap(&logits, cap),
            None => Ok(logits),
        }
    }

    /// Log-probability of each next token, `[B, T - 1]` (f32, or f64 for an f64 model): entry `t` is `log p(ids[t + 1] | ids[..=t])`,
    /// differentiable with [`Ops::Differentiable`]. `key_mask` `[B, T]` marks real tokens (left or right
    /// padding); entries whose target is padding are 0.
    pub fn token_logprobs(
        &self,
        input_ids: &Tensor,
        key_mask: &Tensor,
        ops: Ops,
    ) -> Result<Tensor> {
        let (batch, len) = input_ids.dims2()?;
        if len < 2 {
            return Tensor::zeros((batch, 0), self.logits_dtype(), self.device());
        }
        let positions = positions_from_mask(key_mask)?;
        let hidden = self.forward_hidden(input_ids, &positions, key_mask, None, ops)?;
        self.next_token_logprobs(&hidden, input_ids, key_mask)
    }

    /// [`Model::token_logprobs`] from the final hidden states `[B, T, hidden]` (after the last norm).
    pub(crate) fn next_token_logprobs(
        &self,
        hidden: &Tensor,
        input_ids: &Tensor,
        key_mask: &Tensor,
    ) -> Result<Tensor> {
        let len = input_ids.dim(1)?;
        let batch = input_ids.dim(0)?;
        let hidden = hidden.narrow(1, 0, len - 1)?;
        let hidden = hidden.reshape((batch * (len - 1), hidden.dim(2)?))?;
        let targets = input_ids.narrow(1, 1, len - 1)?.flatten_all()?;
        let picked = self
            .head_scores(&hidden, &targets, 1.0)?
            .narrow(1, crate::kernels::head::column::LOGPROB, 1)?
            .reshape((batch, len - 1))?;
        let real = key_mask.narrow(1, 1, len - 1)?.to_dtype(picked.dtype())?;
        picked * real
    }
}

/// The per-pass inputs of every layer: the additive attention masks ([`Mask`]) and the rotary tables
/// `[B, T, head_dim / 2]`.
pub(crate) struct Frame {
    pub(crate) masks: Vec<Mask>,
    /// Which of the pass's `B · T` tokens are real (not padding), for linear-attention layers; `None` in
    /// a model without them, and for trees of sequences ([`Layout::trees`]), which they cannot read.
    pub(crate) real: Option<Vec<u8>>,
    /// How the mixture layers route, and where they record it ([`Layout::routing`]); `None` routes by
    /// the routers without a record.
    pub(crate) routing: Option<std::sync::Arc<Routing>>,
    /// Where the mixture layers leave their share of the load-balancing loss ([`Layout::balance`]).
    pub(crate) balance: Option<std::sync::Arc<crate::balance::Balance>>,
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    /// The windowed layers' tables, when their RoPE is their own.
    pub(crate) local: Option<(Tensor, Tensor)>,
}

/// One attention mask of a pass, `[B, 1, T, S - front]` additive (0 or −∞) over the key columns
/// `front..S` that the layers with this `window` (`None`: global) hold.
pub(crate) struct Mask {
    window: Option<usize>,
    front: usize,
    mask: Tensor,
}

impl Frame {
    /// The flags of [`Frame::real`].
    pub(crate) fn real(&self) -> Result<&[u8]> {
        self.real.as_deref().ok_or_else(|| {
            candle_core::Error::Msg(
                "linear attention reads each sequence in order: lay the pass out in rows \
                 (Layout::causal), not trees of sequences"
                    .into(),
            )
        })
    }

    /// The mask of a layer with `spec`'s window that holds the pass's key columns from `front` on
    /// ([`LayerCache::front`]; 0 without a cache).
    pub(crate) fn mask(&self, spec: LayerSpec, front: usize) -> Result<&Tensor> {
        self.masks
            .iter()
            .find(|mask| mask.window == spec.window && mask.front == front)
            .map(|mask| &mask.mask)
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "no attention mask for window {:?} from column {front}",
                    spec.window
                ))
            })
    }

    /// The rotary tables of a layer, `None` for a layer without RoPE.
    pub(crate) fn rope(&self, spec: LayerSpec) -> Option<(&Tensor, &Tensor)> {
        if !spec.rope {
            return None;
        }
        match (&self.local, spec.window) {
            (Some((cos, sin)), Some(_)) => Some((cos, sin)),
            _ => Some((&self.cos, &self.sin)),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use crate::config::Arch;
    use crate::model::{LoraConfig, Targets};
    use crate::testing::{config, max_difference, random_model};

    /// Every trained tensor moved by one, as an optimizer step moves them.
    fn step(vars: &[(String, candle_core::Var)]) {
        for (_, var) in vars {
            var.set(&(var.as_tensor() + 1.0).unwrap()).unwrap();
        }
    }

    #[test]
    fn a_snapshot_keeps_the_weights_of_its_time_while_the_trained_ones_move() {
        let base = random_model(&config(Arch::Qwen2), DType::F32);
        let (trained, vars) = base.trainable().unwrap();
        let snapshot = trained.snapshot().unwrap();
        step(&vars);
        let kept = snapshot.named_weights();
        assert_eq!(kept.len(), base.named_weights().len());
        for (((name, now), (_, kept)), (_, first)) in trained
            .named_weights()
            .iter()
            .zip(&kept)
            .zip(base.named_weights())
        {
            assert_eq!(max_difference(kept, &first), 0.0, "{name}");
            assert!((max_difference(now, &first) - 1.0).abs() < 1e-5, "{name}");
        }

        // LoRA: the adapters are copied, the head's among them; the frozen base is shared, not copied.
        let lora = LoraConfig {
            seed: 3,
            targets: Targets::names(&["q_proj", "v_proj", "lm_head"]),
            ..LoraConfig::default()
        };
        let (adapted, vars) = base.with_lora(&lora).unwrap();
        assert!(adapted
            .named_adapters()
            .iter()
            .any(|(name, _)| name == "base_model.model.lm_head.lora_B.weight"));
        let first: Vec<_> = adapted
            .named_adapters()
            .into_iter()
            .map(|(name, tensor)| (name, tensor.copy().unwrap()))
            .collect();
        let snapshot = adapted.snapshot().unwrap();
        step(&vars);
        for ((name, kept), (_, first)) in snapshot.named_adapters().into_iter().zip(&first) {
            assert_eq!(max_difference(kept, first), 0.0, "{name}");
        }
        for ((name, now), (_, first)) in adapted.named_adapters().into_iter().zip(&first) {
            assert!((max_difference(now, first) - 1.0).abs() < 1e-5, "{name}");
        }
        let shared = |model: &super::Model| {
            model
                .named_weights()
                .into_iter()
                .map(|(_, tensor)| {
                    let (storage, _) = tensor.storage_and_layout();
                    format!("{:p}", &*storage)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(shared(&snapshot), shared(&base));
        assert!(!snapshot.named_weights()[0].1.is_variable());
    }
}
