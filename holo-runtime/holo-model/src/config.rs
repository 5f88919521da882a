//! `config.json` of a Hugging Face checkpoint of one of the families in [`Arch`].
//!
//! Both the keys written by transformers 4 (`rope_theta`, `rope_scaling`) and by transformers 5
//! (`rope_parameters`) are read, so folders saved by either load unchanged.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use holo_core::chat::folder::{eos_token_ids, read_json};

mod rope;
pub(crate) use rope::gpt_oss_yarn;
use rope::{rope_json, ropes, rotary_dim, states_rotary_factor};

/// The decoder architectures this runtime implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Qwen2,
    Qwen3,
    Llama,
    Mistral,
    Ministral,
    #[serde(rename = "smollm3")]
    SmolLm3,
    Olmo2,
    Olmo3,
    /// Gemma 2: Gemma 3's decoder without q/k norms, one RoPE for all layers, and both soft-caps.
    Gemma2,
    #[serde(rename = "gemma3_text")]
    Gemma3,
    Phi3,
    /// Qwen3.5's dense text model: Gated DeltaNet linear attention on three layers of four, gated
    /// softmax attention on the fourth.
    #[serde(rename = "qwen3_5_text")]
    Qwen3_5,
    /// Qwen3.5's mixture-of-experts text model: Qwen3.5's layers, each with a routed mixture of SwiGLU
    /// experts and a gated shared expert in place of the MLP ([`Experts::shared`]).
    #[serde(rename = "qwen3_5_moe_text")]
    Qwen3_5Moe,
    /// Qwen3's mixture-of-experts model: Qwen3's attention, a routed mixture of SwiGLU experts in
    /// place of the MLP ([`ModelConfig::experts`]).
    #[serde(rename = "qwen3_moe")]
    Qwen3Moe,
    /// OpenAI's gpt-oss: attention with biases and a learned sink per head, sliding and full layers
    /// alternating, YaRN RoPE, and a mixture of clamped-SwiGLU experts with biases on every layer.
    #[serde(rename = "gpt_oss")]
    GptOss,
}

impl Arch {
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Ministral => "ministral",
            Arch::SmolLm3 => "smollm3",
            Arch::Olmo2 => "olmo2",
            Arch::Olmo3 => "olmo3",
            Arch::Gemma2 => "gemma2",
            Arch::Gemma3 => "gemma3_text",
            Arch::Phi3 => "phi3",
            Arch::Qwen3_5 => "qwen3_5_text",
            Arch::Qwen3_5Moe => "qwen3_5_moe_text",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::GptOss => "gpt_oss",
        }
    }

    pub fn architecture(self) -> &'static str {
        match self {
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Ministral => "MinistralForCausalLM",
            Arch::SmolLm3 => "SmolLM3ForCausalLM",
            Arch::Olmo2 => "Olmo2ForCausalLM",
            Arch::Olmo3 => "Olmo3ForCausalLM",
            Arch::Gemma2 => "Gemma2ForCausalLM",
            Arch::Gemma3 => "Gemma3ForCausalLM",
            Arch::Phi3 => "Phi3ForCausalLM",
            Arch::Qwen3_5 => "Qwen3_5ForCausalLM",
            Arch::Qwen3_5Moe => "Qwen3_5MoeForCausalLM",
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
            Arch::GptOss => "GptOssForCausalLM",
        }
    }
}

impl Arch {
    /// Qwen3.5's hybrid of Gated DeltaNet and gated attention, dense or with experts.
    pub fn is_qwen3_5(self) -> bool {
        matches!(self, Arch::Qwen3_5 | Arch::Qwen3_5Moe)
    }

    /// Gemma 2 and 3: `(1 + w)` norms around attention and the MLP, GeGLU, scaled embeddings, a query
    /// scale of their own, and the soft-cap keys in their configs.
    pub fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.model_type())
    }
}

/// What sets one decoder layer apart from the others of its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// `Some(w)`: sliding-window attention, a query sees the keys of the last `w` positions (itself
    /// included), as transformers' `sliding_window` (`layer_types` `"sliding_attention"`).
    pub window: Option<usize>,
    /// Whether the layer rotates its queries and keys (SmolLM3 leaves RoPE out of every fourth layer).
    pub rope: bool,
    /// Gated DeltaNet linear attention in place of softmax attention (Qwen3.5's `linear_attention`
    /// layers; sizes in [`ModelConfig::linear_attention`]).
    pub linear: bool,
    /// A routed mixture of experts in place of the MLP (sizes in [`ModelConfig::experts`]).
    pub experts: bool,
}

impl LayerSpec {
    /// Full attention with RoPE: every layer of Qwen2, Qwen3 and Llama checkpoints.
    pub const FULL: LayerSpec = LayerSpec {
        window: None,
        rope: true,
        linear: false,
        experts: false,
    };
}

/// Which RMSNorms a layer has, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormPlacement {
    /// Before attention (`input_layernorm`) and before the MLP (`post_attention_layernorm`): Llama,
    /// Qwen, Mistral.
    Pre,
    /// On attention's output (`post_attention_layernorm`) and the MLP's (`post_feedforward_layernorm`),
    /// none on the inputs: OLMo 2 and 3.
    Post,
    /// Before and after each: `input_layernorm`, `post_attention_layernorm`,
    /// `pre_feedforward_layernorm`, `post_feedforward_layernorm`: Gemma 3.
    Sandwich,
}

/// The RMSNorm of queries and keys before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over each head (`[head_dim]` weights): Qwen3, Gemma 3.
    Head,
    /// Over the whole projection (`[heads · head_dim]` weights): OLMo 2 and 3.
    Projection,
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu`: SwiGLU.
    Silu,
    /// `gelu_pytorch_tanh`: GeGLU with the tanh approximation (Gemma).
    GeluTanh,
}

/// How a family's decoder differs from Llama's, beyond sizes and biases. [`Variant::default`] is
/// Llama's (and Qwen2's, Mistral's, SmolLM3's).
#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    pub qk_norm: QkNorm,
    pub norms: NormPlacement,
    /// RMSNorm weights stored as offsets from one, `x̂ · (1 + w)` (Gemma).
    pub norm_offset: bool,
    pub activation: Activation,
    /// Embeddings multiplied by √hidden (in the weights' type), as Gemma's are.
    pub scale_embeddings: bool,
    /// Attention scores scaled by `1/√query_pre_attn_scalar` instead of `1/√head_dim` (Gemma).
    pub query_pre_attn_scalar: Option<f64>,
    /// The RoPE of the windowed (`sliding_attention`) layers when it is not the others' (Gemma 3's
    /// `rope_local_base_freq`, transformers 5's `rope_parameters.sliding_attention`): base and scaling.
    pub local_rope: Option<(f64, RopeScaling)>,
    /// Queries, keys and values from one matrix (`qkv_proj`), gate and up from one (`gate_up_proj`):
    /// Phi-3.
    pub fused_projections: bool,
    /// How many of each head's dimensions RoPE rotates (the first ones; `partial_rotary_factor` ×
    /// `head_dim`), `None` for all.
    pub rotary_dim: Option<usize>,
    /// Attention's output multiplied by a sigmoid gate before `o_proj`, the gate projected with the
    /// queries (`q_proj` twice as wide, each head's query then its gate): Qwen3.5.
    pub attention_gate: bool,
    /// A learned logit per head (`self_attn.sinks`) joins each row of scores in the softmax, and its
    /// weight is dropped after: attention may give part of its mass to nothing (gpt-oss).
    pub attention_sinks: bool,
    /// Attention scores soft-capped to `c · tanh(s / c)` after their scaling, before the mask and the
    /// softmax (`attn_logit_softcapping`: Gemma 2; transformers' Gemma 3 reads the key but applies no
    /// cap, and neither does this runtime).
    pub attention_softcap: Option<f64>,
    /// The output logits soft-capped to `c · tanh(z / c)` (`final_logit_softcapping`: Gemma 2, and
    /// Gemma 3 where the config sets it), before sampling's temperature and the training head's
    /// log-softmax.
    pub final_softcap: Option<f64>,
}

impl Variant {
    /// A family's variant with transformers' defaults (what `config.json` may override).
    pub fn of(arch: Arch) -> Variant {
        match arch {
            Arch::Qwen3 | Arch::Qwen3Moe => Variant {
                qk_norm: QkNorm::Head,
                ..Variant::default()
            },
            Arch::Olmo2 | Arch::Olmo3 => Variant {
                qk_norm: QkNorm::Projection,
                norms: NormPlacement::Post,
                ..Variant::default()
            },
            Arch::Gemma3 => Variant {
                qk_norm: QkNorm::Head,
                norms: NormPlacement::Sandwich,
                norm_offset: true,
                activation: Activation::GeluTanh,
                scale_embeddings: true,
                query_pre_attn_scalar: Some(256.0),
                local_rope: Some((10_000.0, RopeScaling::None)),
                ..Variant::default()
            },
            Arch::Gemma2 => Variant {
                norms: NormPlacement::Sandwich,
                norm_offset: true,
                activation: Activation::GeluTanh,
                scale_embeddings: true,
                query_pre_attn_scalar: Some(256.0),
                attention_softcap: Some(50.0),
                final_softcap: Some(30.0),
                ..Variant::default()
            },
            Arch::Phi3 => Variant {
                fused_projections: true,
                ..Variant::default()
            },
            Arch::Qwen3_5 | Arch::Qwen3_5Moe => Variant {
                qk_norm: QkNorm::Head,
                norm_offset: true,
                attention_gate: true,
                ..Variant::default()
            },
            Arch::GptOss => Variant {
                attention_sinks: true,
                ..Variant::default()
            },
            Arch::Qwen2 | Arch::Llama | Arch::Mistral | Arch::Ministral | Arch::SmolLm3 => {
                Variant::default()
            }
        }
    }
}

impl Default for Variant {
    fn default() -> Self {
        Variant {
            qk_norm: QkNorm::None,
            norms: NormPlacement::Pre,
            norm_offset: false,
            activation: Activation::Silu,
            scale_embeddings: false,
            query_pre_attn_scalar: None,
            local_rope: None,
            fused_projections: false,
            rotary_dim: None,
            attention_gate: false,
            attention_sinks: false,
            attention_softcap: None,
            final_softcap: None,
        }
    }
}

/// How rotary frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1's band-wise rescaling of the inverse frequencies.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Phi-3's LongRoPE: each frequency divided by its short factor, or by its long factor in a pass
    /// whose positions reach past `original_max_position_embeddings` (as transformers decides per
    /// forward pass); cos and sin multiplied by `attention_factor`.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
    /// YaRN (`_compute_yarn_parameters`): each frequency blended between itself and itself divided by
    /// `factor`, by a ramp over the dimensions between the corrections of `beta_fast` and `beta_slow`
    /// rotations in `original_max_position_embeddings` (rounded outwards with `truncate`); cos and sin
    /// multiplied by `attention_factor`.
    Yarn {
        factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: usize,
        truncate: bool,
        attention_factor: f64,
    },
}

/// The sizes of Gated DeltaNet linear attention (Qwen3.5's `linear_*` keys): each value head keeps a
/// `key_head_dim × value_head_dim` state; key heads serve `value_heads / key_heads` value heads each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearAttention {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    /// The width of the causal depthwise convolution over the projected queries, keys and values.
    pub conv_kernel: usize,
}

impl LinearAttention {
    /// Channels of the convolution: queries, keys, values.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim
    }
}

/// A mixture of experts (`qwen3_moe`'s keys): each token goes to the `per_token` experts its router
/// scores highest, and the layer's output is their SwiGLU outputs weighted by the router's softmax.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Experts {
    /// `num_experts` (`num_local_experts` as transformers 5 writes it).
    pub count: usize,
    /// `num_experts_per_tok`.
    pub per_token: usize,
    /// Each expert's inner size (`moe_intermediate_size`).
    pub intermediate_size: usize,
    /// Whether the chosen experts' weights are renormalised to sum to one (`norm_topk_prob`).
    pub normalize: bool,
    /// The load-balancing loss's weight in training (`router_aux_loss_coef`), added only when
    /// `output_router_logits` is set, as transformers adds it.
    pub aux_loss_coef: f64,
    /// `output_router_logits`: whether training adds the load-balancing loss.
    pub aux_loss: bool,
    /// The weights are the softmax of the chosen experts' logits (top-k first, as gpt-oss routes),
    /// rather than the softmax over all experts at the chosen ones.
    pub softmax_over_chosen: bool,
    /// gpt-oss's experts: biases, gate and up interleaved in one product, the clamped SwiGLU.
    pub clamped: Option<ClampedSwiGlu>,
    /// Qwen3.5's shared expert, by its inner size (`shared_expert_intermediate_size`): a SwiGLU MLP
    /// every token goes through beside its chosen experts, its output scaled by the sigmoid of a gate of
    /// its own (`shared_expert_gate`, one logit per token) and added to theirs.
    pub shared: Option<usize>,
}

/// gpt-oss's expert activation: `gate` clamped above at `limit`, `up` to `[-limit, limit]`, then
/// `(up + 1) · gate · σ(alpha · gate)` (`GptOssExperts._apply_gate`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClampedSwiGlu {
    /// `swiglu_alpha`.
    pub alpha: f64,
    /// `swiglu_limit`.
    pub limit: f64,
}

/// What the model code needs from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections (always for Qwen2; `attention_bias` for Llama, which also
    /// puts one on o).
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Norms, activation and scales that set the family apart.
    pub variant: Variant,
    /// Each layer's attention window and RoPE, in layer order (`num_hidden_layers` of them).
    pub layers: Vec<LayerSpec>,
    /// The sizes of the linear-attention layers, when some layer is one ([`LayerSpec::linear`]).
    pub linear_attention: Option<LinearAttention>,
    /// The mixture of experts, when some layer has one ([`LayerSpec::experts`]).
    pub experts: Option<Experts>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// A `config.json` this runtime cannot use; says which key and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        read_json(path)
            .map_err(ConfigError)
            .and_then(|json| Self::from_json(&json))
            .map_err(|ConfigError(message)| ConfigError(format!("{}: {message}", path.display())))
    }

    pub fn from_json(json: &Value) -> Result<Self, ConfigError> {
        if let Some(text) = text_tower(json) {
            return Self::from_json(&text);
        }
        let model_type = json.get("model_type").and_then(Value::as_str).unwrap_or("");
        let architectures: Vec<&str> = json
            .get("architectures")
            .and_then(Value::as_array)
            .map(|names| names.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let arch = match model_type {
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "ministral" => Arch::Ministral,
            "smollm3" => Arch::SmolLm3,
            "olmo2" => Arch::Olmo2,
            "olmo3" => Arch::Olmo3,
            "gemma2" => Arch::Gemma2,
            "gemma3_text" => Arch::Gemma3,
            "phi3" => Arch::Phi3,
            "qwen3_5_text" => Arch::Qwen3_5,
            "qwen3_5_moe_text" => Arch::Qwen3_5Moe,
            "qwen3_moe" => Arch::Qwen3Moe,
            "gpt_oss" => Arch::GptOss,
            _ => {
                let named = if architectures.is_empty() {
                    format!("model_type {model_type:?}")
                } else {
                    format!("model_type {model_type:?} ({})", architectures.join(", "))
                };
                return Err(ConfigError(format!(
                    "unsupported architecture: {named}; supported: {SUPPORTED}"
                )));
            }
        };
        let keys = Keys(json);

        // Gemma names it `hidden_activation` (and defaults it), the others `hidden_act`.
        let (activation_key, default_activation) = match arch {
            Arch::Gemma2 | Arch::Gemma3 => ("hidden_activation", "gelu_pytorch_tanh"),
            _ => ("hidden_act", "silu"),
        };
        let activation = match json.get(activation_key).and_then(Value::as_str) {
            None => default_activation,
            Some(name) => name,
        };
        let activation = match activation {
            "silu" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_new" => Activation::GeluTanh,
            other => {
                return Err(ConfigError(format!(
                    "unsupported `{activation_key}` {other:?}: implemented are \"silu\" and \
                     \"gelu_pytorch_tanh\""
                )))
            }
        };
        let hidden_size = keys.usize("hidden_size")?;
        let num_attention_heads = keys.usize("num_attention_heads")?;
        let num_key_value_heads = keys
            .optional_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        if num_attention_heads == 0 || num_key_value_heads == 0 {
            return Err(ConfigError("attention needs at least one head".into()));
        }
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(ConfigError(format!(
                "`num_attention_heads` ({num_attention_heads}) must be a multiple of \
                 `num_key_value_heads` ({num_key_value_heads})"
            )));
        }
        let head_dim = match keys.optional_usize("head_dim")? {
            Some(head_dim) => head_dim,
            // transformers' `Qwen3Config` and `Gemma3TextConfig` default it rather than derive it.
            None if arch == Arch::Qwen3 => 128,
            None if arch.is_gemma() || arch.is_qwen3_5() => 256,
            None if arch == Arch::GptOss => 64,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(ConfigError(format!(
                        "`hidden_size` ({hidden_size}) is not a multiple of `num_attention_heads` \
                         ({num_attention_heads}) and no `head_dim` is given"
                    )));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(ConfigError(format!(
                "`head_dim` ({head_dim}) must be even for RoPE"
            )));
        }
        refuse_unimplemented_keys(arch, json)?;

        let ((rope_theta, rope_scaling), local_rope) = ropes(arch, json)?;
        let family = Variant::of(arch);
        let variant = Variant {
            activation,
            query_pre_attn_scalar: match family.query_pre_attn_scalar {
                Some(default) => Some(
                    keys.optional_f64("query_pre_attn_scalar")?
                        .unwrap_or(default),
                ),
                None => None,
            },
            local_rope,
            rotary_dim: match rotary_dim(json, head_dim)? {
                // `Qwen3_5TextConfig` (and the mixture's) default `partial_rotary_factor` to 0.25.
                None if arch.is_qwen3_5() && !states_rotary_factor(json) => Some(head_dim / 4),
                rotated => rotated,
            },
            // transformers' Gemma 3 keeps `attn_logit_softcapping` in its config but never passes it
            // to attention (its q/k norms took the cap's place): a Gemma 3 config that sets it computes
            // what one without does, here as there.
            attention_softcap: match arch {
                Arch::Gemma2 => softcap(json, "attn_logit_softcapping", family.attention_softcap)?,
                _ => family.attention_softcap,
            },
            final_softcap: match arch.is_gemma() {
                true => softcap(json, "final_logit_softcapping", family.final_softcap)?,
                false => family.final_softcap,
            },
            ..family
        };
        if arch.is_gemma() && keys.flag("use_bidirectional_attention", false)? {
            return Err(ConfigError(
                "`use_bidirectional_attention: true` (an embedding model) is not supported".into(),
            ));
        }

        let eos_token_ids = eos_token_ids(json).map_err(ConfigError)?;
        let (qkv_bias, o_bias) = match arch {
            Arch::Qwen2 => (true, false),
            Arch::Qwen3 | Arch::Qwen3Moe => (keys.flag("attention_bias", false)?, false),
            Arch::GptOss => {
                let bias = keys.flag("attention_bias", true)?;
                (bias, bias)
            }
            Arch::Mistral | Arch::Ministral | Arch::Phi3 => (false, false),
            Arch::Llama
            | Arch::SmolLm3
            | Arch::Olmo2
            | Arch::Olmo3
            | Arch::Gemma2
            | Arch::Gemma3
            | Arch::Qwen3_5
            | Arch::Qwen3_5Moe => {
                let bias = keys.flag("attention_bias", false)?;
                (bias, bias)
            }
        };
        let num_hidden_layers = keys.usize("num_hidden_layers")?;
        let layers = layer_specs(arch, json, num_hidden_layers)?;
        let linear_attention = match layers.iter().any(|layer| layer.linear) {
            true => Some(linear_attention(&keys)?),
            false => None,
        };
        if linear_attention.is_some() && layers.iter().all(|layer| layer.linear) {
            return Err(ConfigError(
                "`layer_types` has no \"full_attention\" layer: the cache counts positions by the \
                 attention layers' keys, so at least one is needed"
                    .into(),
            ));
        }
        let experts = match layers.iter().any(|layer| layer.experts) {
            true => Some(experts(arch, &keys)?),
            false => None,
        };
        let config = ModelConfig {
            arch,
            vocab_size: keys.usize("vocab_size")?,
            hidden_size,
            intermediate_size: match arch {
                // `Qwen3_5MoeTextConfig` has no dense MLP, and no key for one: every layer has experts.
                Arch::Qwen3_5Moe => 0,
                _ => keys.usize("intermediate_size")?,
            },
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: keys
                .optional_usize("max_position_embeddings")?
                .unwrap_or(4096),
            rms_norm_eps: keys.optional_f64("rms_norm_eps")?.unwrap_or(match arch {
                Arch::Olmo2 | Arch::Olmo3 | Arch::Phi3 | Arch::GptOss => 1e-5,
                _ => 1e-6,
            }),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: keys.flag(
                "tie_word_embeddings",
                matches!(
                    arch,
                    Arch::Qwen2 | Arch::SmolLm3 | Arch::Gemma2 | Arch::Gemma3
                ),
            )?,
            qkv_bias,
            o_bias,
            mlp_bias: matches!(arch, Arch::Llama | Arch::SmolLm3)
                && keys.flag("mlp_bias", false)?,
            variant,
            layers,
            linear_attention,
            experts,
            bos_token_id: keys.optional_usize("bos_token_id")?.map(|id| id as u32),
            eos_token_ids,
        };
        if config.vocab_size == 0 || config.hidden_size == 0 || config.num_hidden_layers == 0 {
            return Err(ConfigError(
                "`vocab_size`, `hidden_size` and `num_hidden_layers` must be at least 1".into(),
            ));
        }
        Ok(config)
    }

    /// `config.json` as transformers writes it (transformers 4 keys, which transformers 5 also reads).
    pub fn to_json(&self) -> Value {
        let mut json = serde_json::json!({
            "architectures": [self.arch.architecture()],
            "model_type": self.arch.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "use_cache": true,
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            // Stated, because some families default it to an id past a small vocabulary (SmolLM3's
            // 128004); the padding token is the tokenizer's.
            "pad_token_id": Value::Null,
            "eos_token_id": match self.eos_token_ids.as_slice() {
                [one] => Value::from(*one),
                ids => Value::from(ids.to_vec()),
            },
        });
        let object = json.as_object_mut().expect("an object");
        if self.arch.is_gemma() {
            object.remove("hidden_act");
            object.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
        }
        if self.arch.is_qwen3_5() || self.arch == Arch::GptOss {
            // transformers 5's `rope_parameters`, which carries the rotated fraction (and stands for
            // gpt-oss's default YaRN, which a missing one would bring back).
            let mut rope = rope_json(&(self.rope_theta, self.rope_scaling.clone()));
            if self.arch.is_qwen3_5() {
                let rotated = self.variant.rotary_dim.unwrap_or(self.head_dim);
                rope["partial_rotary_factor"] = (rotated as f64 / self.head_dim as f64).into();
            }
            object.remove("rope_theta");
            object.insert("rope_parameters".into(), rope);
        } else if matches!(self.arch, Arch::Gemma3 | Arch::Olmo3) {
            // transformers 5's RoPE per layer type.
            let global = (self.rope_theta, self.rope_scaling.clone());
            let local = self.variant.local_rope.clone().unwrap_or(global.clone());
            object.remove("rope_theta");
            object.insert(
                "rope_parameters".into(),
                serde_json::json!({
                    "full_attention": rope_json(&global),
                    "sliding_attention": rope_json(&local),
                }),
            );
        } else {
            let mut scaling = rope_json(&(self.rope_theta, self.rope_scaling.clone()));
            let scaling = match &self.rope_scaling {
                RopeScaling::None => Value::Null,
                _ => {
                    scaling
                        .as_object_mut()
                        .expect("an object")
                        .remove("rope_theta");
                    scaling
                }
            };
            object.insert("rope_scaling".into(), scaling);
        }
        let window = self.layers.iter().find_map(|layer| layer.window);
        let layer_types: Vec<&str> = self
            .layers
            .iter()
            .map(|layer| match layer.window {
                Some(_) => "sliding_attention",
                None => "full_attention",
            })
            .collect();
        match self.arch {
            Arch::GptOss => {
                object.insert("attention_bias".into(), self.qkv_bias.into());
                object.insert("sliding_window".into(), window.into());
                object.insert("layer_types".into(), layer_types.into());
                if let Some(experts) = self.experts {
                    for (key, value) in [
                        ("num_local_experts", Value::from(experts.count)),
                        ("num_experts_per_tok", experts.per_token.into()),
                        ("router_aux_loss_coef", experts.aux_loss_coef.into()),
                        ("output_router_logits", experts.aux_loss.into()),
                    ] {
                        object.insert(key.into(), value);
                    }
                    if let Some(clamped) = experts.clamped {
                        object.insert("swiglu_alpha".into(), clamped.alpha.into());
                        object.insert("swiglu_limit".into(), clamped.limit.into());
                    }
                }
            }
            Arch::Qwen3Moe => {
                object.insert("attention_bias".into(), self.qkv_bias.into());
                object.insert("use_sliding_window".into(), window.is_some().into());
                object.insert("sliding_window".into(), window.into());
                if let Some(experts) = self.experts {
                    let dense: Vec<usize> = (0..self.num_hidden_layers)
                        .filter(|&layer| !self.layers[layer].experts)
                        .collect();
                    for (key, value) in [
                        ("num_experts", Value::from(experts.count)),
                        ("num_experts_per_tok", experts.per_token.into()),
                        ("moe_intermediate_size", experts.intermediate_size.into()),
                        ("norm_topk_prob", experts.normalize.into()),
                        ("router_aux_loss_coef", experts.aux_loss_coef.into()),
                        ("output_router_logits", experts.aux_loss.into()),
                        ("decoder_sparse_step", 1.into()),
                        ("mlp_only_layers", dense.into()),
                    ] {
                        object.insert(key.into(), value);
                    }
                }
            }
            Arch::Qwen2 | Arch::Qwen3 => {
                // Sliding layers are the last ones, from `max_window_layers` on.
                let first_sliding = self.layers.iter().position(|layer| layer.window.is_some());
                object.insert("use_sliding_window".into(), window.is_some().into());
                object.insert("sliding_window".into(), window.into());
                object.insert(
                    "max_window_layers".into(),
                    first_sliding.unwrap_or(self.num_hidden_layers).into(),
                );
                object.insert("layer_types".into(), layer_types.into());
                if self.arch == Arch::Qwen3 {
                    object.insert("attention_bias".into(), self.qkv_bias.into());
                }
            }
            Arch::Llama => {
                object.insert("attention_bias".into(), self.qkv_bias.into());
                object.insert("mlp_bias".into(), self.mlp_bias.into());
                object.insert("pretraining_tp".into(), 1.into());
            }
            Arch::Mistral => {
                object.insert("sliding_window".into(), window.into());
            }
            Arch::Ministral => {
                object.insert("sliding_window".into(), window.into());
                object.insert("layer_types".into(), layer_types.into());
            }
            Arch::Olmo2 | Arch::Olmo3 | Arch::Gemma2 | Arch::Gemma3 => {
                object.insert("attention_bias".into(), self.qkv_bias.into());
                if self.arch != Arch::Olmo2 {
                    object.insert("sliding_window".into(), window.into());
                    object.insert("layer_types".into(), layer_types.clone().into());
                }
                if let Some(scalar) = self.variant.query_pre_attn_scalar {
                    // An integer in transformers' config class, which refuses a float.
                    let scalar = match scalar.fract() == 0.0 {
                        true => Value::from(scalar as u64),
                        false => Value::from(scalar),
                    };
                    object.insert("query_pre_attn_scalar".into(), scalar);
                    let cap = |cap: Option<f64>| cap.map_or(Value::Null, Value::from);
                    object.insert(
                        "attn_logit_softcapping".into(),
                        cap(self.variant.attention_softcap),
                    );
                    object.insert(
                        "final_logit_softcapping".into(),
                        cap(self.variant.final_softcap),
                    );
                }
            }
            Arch::Phi3 => {
                object.insert("sliding_window".into(), window.into());
                let rotated = self.variant.rotary_dim.unwrap_or(self.head_dim);
                object.insert(
                    "partial_rotary_factor".into(),
                    (rotated as f64 / self.head_dim as f64).into(),
                );
                if let RopeScaling::LongRope {
                    original_max_position_embeddings,
                    ..
                } = self.rope_scaling
                {
                    object.insert(
                        "original_max_position_embeddings".into(),
                        original_max_position_embeddings.into(),
                    );
                }
            }
            Arch::Qwen3_5 | Arch::Qwen3_5Moe => {
                object.insert("attention_bias".into(), self.qkv_bias.into());
                let layer_types: Vec<&str> = self
                    .layers
                    .iter()
                    .map(|layer| match layer.linear {
                        true => "linear_attention",
                        false => "full_attention",
                    })
                    .collect();
                object.insert("layer_types".into(), layer_types.into());
                if let Some(linear) = self.linear_attention {
                    for (key, value) in [
                        ("linear_num_key_heads", linear.key_heads),
                        ("linear_num_value_heads", linear.value_heads),
                        ("linear_key_head_dim", linear.key_head_dim),
                        ("linear_value_head_dim", linear.value_head_dim),
                        ("linear_conv_kernel_dim", linear.conv_kernel),
                    ] {
                        object.insert(key.into(), value.into());
                    }
                }
                if let Some(experts) = self.experts {
                    object.remove("intermediate_size");
                    for (key, value) in [
                        ("num_experts", Value::from(experts.count)),
                        ("num_experts_per_tok", experts.per_token.into()),
                        ("moe_intermediate_size", experts.intermediate_size.into()),
                        (
                            "shared_expert_intermediate_size",
                            experts.shared.unwrap_or(0).into(),
                        ),
                        ("router_aux_loss_coef", experts.aux_loss_coef.into()),
                        ("output_router_logits", experts.aux_loss.into()),
                    ] {
                        object.insert(key.into(), value);
                    }
                }
            }
            Arch::SmolLm3 => {
                object.insert("attention_bias".into(), self.qkv_bias.into());
                object.insert("mlp_bias".into(), self.mlp_bias.into());
                let no_rope_layers: Vec<u8> = self
                    .layers
                    .iter()
                    .map(|layer| u8::from(layer.rope))
                    .collect();
                object.insert("no_rope_layers".into(), no_rope_layers.into());
                object.insert("use_sliding_window".into(), window.is_some().into());
                object.insert("sliding_window".into(), window.into());
                object.insert("layer_types".into(), layer_types.into());
            }
        }
        json
    }
}

/// The text model's config of a multimodal checkpoint whose text tower is a family of [`Arch`] (Gemma 3's
/// `gemma3`, `Gemma3ForConditionalGeneration`): its `text_config`, with the token ids and the tying the
/// wrapper states when the text config does not.
fn text_tower(json: &Value) -> Option<Value> {
    let model_type = json.get("model_type").and_then(Value::as_str)?;
    let text_type = match model_type {
        "gemma3" => "gemma3_text",
        "qwen3_5" => "qwen3_5_text",
        "qwen3_5_moe" => "qwen3_5_moe_text",
        _ => return None,
    };
    let mut text = json.get("text_config")?.as_object()?.clone();
    text.insert("model_type".into(), text_type.into());
    for key in [
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
    ] {
        if let (false, Some(value)) = (text.contains_key(key), json.get(key)) {
            text.insert(key.into(), value.clone());
        }
    }
    Some(Value::Object(text))
}

/// Whether `json` is a multimodal checkpoint's config whose text tower this runtime runs (the tensors
/// are then under the tower's names, see `files::text_tower_tensors`).
pub fn is_text_tower(json: &Value) -> bool {
    text_tower(json).is_some()
}

/// The families this runtime implements, for error messages.
pub const SUPPORTED: &str = "qwen2 (Qwen2ForCausalLM: Qwen2, Qwen2.5, SmolLM), qwen3 \
     (Qwen3ForCausalLM: Qwen3 dense), llama (LlamaForCausalLM: Llama 2/3, SmolLM2), mistral \
     (MistralForCausalLM), ministral (MinistralForCausalLM), smollm3 (SmolLM3ForCausalLM), olmo2 \
     (Olmo2ForCausalLM), olmo3 (Olmo3ForCausalLM), gemma2 (Gemma2ForCausalLM: Gemma 2 2B, 9B, 27B) \
     and gemma3_text (Gemma3ForCausalLM: Gemma 3 270M \
     and 1B; the text tower of gemma3 Gemma3ForConditionalGeneration checkpoints, 4B to 27B), phi3 \
     (Phi3ForCausalLM: Phi-3, Phi-3.5, Phi-4-mini), qwen3_5_text (Qwen3_5ForCausalLM: Qwen3.5 dense; \
     the text tower of qwen3_5 Qwen3_5ForConditionalGeneration checkpoints), qwen3_5_moe_text \
     (Qwen3_5MoeForCausalLM: Qwen3.5's mixtures of experts, 35B-A3B, 122B-A10B, 397B-A17B; the text \
     tower of qwen3_5_moe Qwen3_5MoeForConditionalGeneration checkpoints), qwen3_moe \
     (Qwen3MoeForCausalLM: Qwen3's mixtures of experts, 30B-A3B, 235B-A22B) and gpt_oss \
     (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b, bf16 or MXFP4 experts)";

/// Keys that change what the model computes in ways this runtime does not implement: refused by name
/// rather than loaded into a model that would silently compute something else.
fn refuse_unimplemented_keys(arch: Arch, json: &Value) -> Result<(), ConfigError> {
    if let Some(quantization) = json.get("quantization_config").filter(|v| !v.is_null()) {
        let method = quantization
            .get("quant_method")
            .and_then(Value::as_str)
            .unwrap_or("unnamed");
        // gpt-oss ships its experts in MXFP4, dequantized at load (`crate::mxfp4`).
        if arch == Arch::GptOss && method == "mxfp4" {
            return Ok(());
        }
        return Err(ConfigError(format!(
            "`quantization_config` ({method}) is not supported: load the unquantized checkpoint, or a \
             GGUF file of it"
        )));
    }
    Ok(())
}

/// Reads the keys of a `config.json` object, each error naming its key. An absent key and a null one
/// are the same: the default.
struct Keys<'a>(&'a Value);

impl Keys<'_> {
    fn present(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|value| !value.is_null())
    }

    /// A required non-negative integer.
    fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        self.optional_usize(key)?
            .ok_or_else(|| ConfigError(format!("missing `{key}`")))
    }

    fn optional_usize(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        self.present(key)
            .map(|value| {
                value.as_u64().map(|v| v as usize).ok_or_else(|| {
                    ConfigError(format!(
                        "`{key}` must be a non-negative integer, found {value}"
                    ))
                })
            })
            .transpose()
    }

    fn optional_f64(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        self.present(key)
            .map(|value| {
                value
                    .as_f64()
                    .ok_or_else(|| ConfigError(format!("`{key}` must be a number, found {value}")))
            })
            .transpose()
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.present(key) {
            None => Ok(default),
            Some(value) => value.as_bool().ok_or_else(|| {
                ConfigError(format!("`{key}` must be true or false, found {value}"))
            }),
        }
    }
}

/// A soft-cap of the config: a positive number, `null` for none, or absent for the family's `default`.
/// Only Gemma's config classes have the keys; the other families ignore them, as transformers does.
fn softcap(json: &Value, key: &str, default: Option<f64>) -> Result<Option<f64>, ConfigError> {
    match json.get(key) {
        None => Ok(default),
        Some(Value::Null) => Ok(None),
        Some(value) => match value.as_f64() {
            Some(cap) if cap > 0.0 && cap.is_finite() => Ok(Some(cap)),
            _ => Err(ConfigError(format!(
                "`{key}` must be a positive number or null, found {value}"
            ))),
        },
    }
}

/// Each layer's window and RoPE, from `layer_types`, `sliding_window` and the family's own keys
/// (`use_sliding_window` and `max_window_layers` for Qwen, `no_rope_layers` for SmolLM3), with the
/// defaults transformers' config classes derive when a key is absent.
fn layer_specs(arch: Arch, json: &Value, count: usize) -> Result<Vec<LayerSpec>, ConfigError> {
    let present = |key: &str| json.get(key).filter(|value| !value.is_null());
    let window = match json.get("sliding_window") {
        // The config classes' default, when the key is absent (an explicit null is no window).
        None => match arch {
            Arch::Qwen2
            | Arch::Qwen3
            | Arch::Qwen3Moe
            | Arch::Mistral
            | Arch::Ministral
            | Arch::Olmo3
            | Arch::Gemma2
            | Arch::Gemma3 => Some(4096),
            Arch::GptOss => Some(128),
            _ => None,
        },
        Some(Value::Null) => None,
        Some(value) => match value.as_u64() {
            Some(window) if window >= 1 => Some(window as usize),
            _ => {
                return Err(ConfigError(format!(
                    "`sliding_window` must be a positive integer or null, found {value}"
                )))
            }
        },
    };
    let keys = Keys(json);
    let flag = |key: &str| keys.flag(key, false);
    let integer = |key: &str, default: usize| Ok(keys.optional_usize(key)?.unwrap_or(default));
    let per_layer = |key: &str| -> Result<Option<&Vec<Value>>, ConfigError> {
        match present(key) {
            None => Ok(None),
            Some(Value::Array(values)) if values.len() == count => Ok(Some(values)),
            Some(value) => Err(ConfigError(format!(
                "`{key}` must list the {count} layers, found {value}"
            ))),
        }
    };

    let rope: Vec<bool> = match (arch, per_layer("no_rope_layers")?) {
        (Arch::SmolLm3, Some(flags)) => flags
            .iter()
            .enumerate()
            .map(|(layer, flag)| match flag.as_u64() {
                Some(0) => Ok(false),
                Some(1) => Ok(true),
                _ => Err(ConfigError(format!(
                    "`no_rope_layers[{layer}]` must be 0 (no RoPE) or 1, found {flag}"
                ))),
            })
            .collect::<Result<_, _>>()?,
        (Arch::SmolLm3, None) => {
            let interval = integer("no_rope_layer_interval", 4)?.max(1);
            (0..count)
                .map(|layer| (layer + 1) % interval != 0)
                .collect()
        }
        _ => vec![true; count],
    };

    // Qwen3.5 names its layers linear or full; the others full or sliding.
    let second_kind = match arch.is_qwen3_5() {
        true => "linear_attention",
        false => "sliding_attention",
    };
    let second: Vec<bool> = match per_layer("layer_types")? {
        Some(types) => types
            .iter()
            .enumerate()
            .map(|(layer, kind)| match kind.as_str() {
                Some("full_attention") => Ok(false),
                Some(name) if name == second_kind => Ok(true),
                _ => Err(ConfigError(format!(
                    "`layer_types[{layer}]` is {kind}: supported layer types for {arch} are \
                     \"full_attention\" and \"{second_kind}\""
                ))),
            })
            .collect::<Result<_, _>>()?,
        None => match arch {
            Arch::Qwen3_5 | Arch::Qwen3_5Moe => {
                let interval = integer("full_attention_interval", 4)?.max(1);
                (0..count)
                    .map(|layer| (layer + 1) % interval != 0)
                    .collect()
            }
            Arch::Qwen2 | Arch::Qwen3 => {
                let from = integer("max_window_layers", 28)?;
                (0..count).map(|layer| layer >= from).collect()
            }
            Arch::SmolLm3 => rope.iter().map(|&rope| !rope).collect(),
            Arch::Mistral | Arch::Ministral | Arch::Phi3 | Arch::Qwen3Moe => vec![true; count],
            Arch::Olmo3 => (0..count).map(|layer| (layer + 1) % 4 != 0).collect(),
            // Sliding, full, sliding, … (`GptOssConfig.__post_init__`).
            Arch::GptOss => (0..count).map(|layer| layer % 2 == 0).collect(),
            // Sliding, full, sliding, … (`Gemma2Config.__post_init__`).
            Arch::Gemma2 => (0..count).map(|layer| layer % 2 == 0).collect(),
            Arch::Gemma3 => {
                let pattern = integer("sliding_window_pattern", 6)?.max(1);
                (0..count).map(|layer| (layer + 1) % pattern != 0).collect()
            }
            Arch::Llama | Arch::Olmo2 => vec![false; count],
        },
    };
    // Where the family's attention reads the window (transformers' modelling code).
    let window = match arch {
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe if !flag("use_sliding_window")? => None,
        Arch::Llama | Arch::Olmo2 | Arch::Qwen3_5 | Arch::Qwen3_5Moe => None,
        _ => window,
    };
    let linear = arch.is_qwen3_5();
    let experts = expert_layers(arch, &keys, count)?;
    Ok(second
        .into_iter()
        .zip(rope)
        .zip(experts)
        .map(|((second, rope), experts)| LayerSpec {
            window: if matches!(arch, Arch::Mistral | Arch::Phi3) || (second && !linear) {
                window
            } else {
                None
            },
            rope,
            linear: linear && second,
            experts,
        })
        .collect())
}

/// Which layers have a mixture of experts, as `Qwen3MoeDecoderLayer` decides: every
/// `decoder_sparse_step`-th layer that `mlp_only_layers` does not name, when there are experts.
fn expert_layers(arch: Arch, keys: &Keys, count: usize) -> Result<Vec<bool>, ConfigError> {
    // gpt-oss's and Qwen3.5's mixtures are on every layer.
    if matches!(arch, Arch::GptOss | Arch::Qwen3_5Moe) {
        if expert_count(arch, keys)? == 0 {
            let key = match arch {
                Arch::GptOss => "num_local_experts",
                _ => "num_experts",
            };
            return Err(ConfigError(format!("`{key}` must be at least 1")));
        }
        return Ok(vec![true; count]);
    }
    if arch != Arch::Qwen3Moe || expert_count(arch, keys)? == 0 {
        return Ok(vec![false; count]);
    }
    let step = match keys.optional_usize("decoder_sparse_step")?.unwrap_or(1) {
        0 => {
            return Err(ConfigError(
                "`decoder_sparse_step` must be at least 1".into(),
            ))
        }
        step => step,
    };
    let dense: Vec<usize> = match keys.present("mlp_only_layers") {
        None => Vec::new(),
        Some(Value::Array(layers)) => layers
            .iter()
            .map(|layer| match layer.as_u64() {
                Some(layer) if (layer as usize) < count => Ok(layer as usize),
                _ => Err(ConfigError(format!(
                    "`mlp_only_layers` must list layer indices below {count}, found {layer}"
                ))),
            })
            .collect::<Result<_, _>>()?,
        Some(value) => {
            return Err(ConfigError(format!(
                "`mlp_only_layers` must be a list of layer indices, found {value}"
            )))
        }
    };
    Ok((0..count)
        .map(|layer| !dense.contains(&layer) && (layer + 1) % step == 0)
        .collect())
}

/// `num_experts`, or `num_local_experts` as transformers 5 writes it (when neither is given, 0, or
/// gpt-oss's 128, or Qwen3.5's 256).
fn expert_count(arch: Arch, keys: &Keys) -> Result<usize, ConfigError> {
    let default = match arch {
        Arch::GptOss => 128,
        Arch::Qwen3_5Moe => 256,
        _ => 0,
    };
    match keys.optional_usize("num_experts")? {
        Some(count) => Ok(count),
        None => Ok(keys.optional_usize("num_local_experts")?.unwrap_or(default)),
    }
}

/// The mixture's sizes and routing, with `Qwen3MoeConfig`'s defaults (`GptOssConfig`'s for gpt-oss,
/// whose experts are `intermediate_size` wide; `Qwen3_5MoeTextConfig`'s for Qwen3.5, whose router
/// always renormalises the chosen experts' weights and which has a shared expert).
fn experts(arch: Arch, keys: &Keys) -> Result<Experts, ConfigError> {
    let count = expert_count(arch, keys)?;
    if arch == Arch::GptOss {
        return oss_experts(keys, count);
    }
    let qwen3_5 = arch == Arch::Qwen3_5Moe;
    let per_token = keys.optional_usize("num_experts_per_tok")?.unwrap_or(8);
    if per_token == 0 || per_token > count {
        return Err(ConfigError(format!(
            "`num_experts_per_tok` ({per_token}) must be between 1 and the number of experts ({count})"
        )));
    }
    let size = |key: &str, default: usize| match keys.optional_usize(key)?.unwrap_or(default) {
        0 => Err(ConfigError(format!("`{key}` must be at least 1"))),
        size => Ok(size),
    };
    Ok(Experts {
        count,
        per_token,
        intermediate_size: size("moe_intermediate_size", if qwen3_5 { 512 } else { 768 })?,
        // `Qwen3_5MoeTopKRouter` renormalises whatever the config says; it has no `norm_topk_prob`.
        normalize: qwen3_5 || keys.flag("norm_topk_prob", false)?,
        aux_loss_coef: keys.optional_f64("router_aux_loss_coef")?.unwrap_or(0.001),
        aux_loss: keys.flag("output_router_logits", false)?,
        softmax_over_chosen: false,
        clamped: None,
        shared: match qwen3_5 {
            true => Some(size("shared_expert_intermediate_size", 512)?),
            false => None,
        },
    })
}

/// gpt-oss's experts (`GptOssConfig`'s keys and defaults): `num_local_experts` of `intermediate_size`,
/// `num_experts_per_tok` per token weighted by the softmax of their logits, the SwiGLU clamped at
/// `swiglu_limit`.
fn oss_experts(keys: &Keys, count: usize) -> Result<Experts, ConfigError> {
    let per_token = keys.optional_usize("num_experts_per_tok")?.unwrap_or(4);
    if per_token == 0 || per_token > count {
        return Err(ConfigError(format!(
            "`num_experts_per_tok` ({per_token}) must be between 1 and the number of experts ({count})"
        )));
    }
    let intermediate_size = keys.usize("intermediate_size")?;
    if intermediate_size == 0 {
        return Err(ConfigError("`intermediate_size` must be at least 1".into()));
    }
    let positive = |key: &str, default: f64| -> Result<f64, ConfigError> {
        match keys.optional_f64(key)?.unwrap_or(default) {
            value if value > 0.0 && value.is_finite() => Ok(value),
            value => Err(ConfigError(format!(
                "`{key}` must be a positive number, found {value}"
            ))),
        }
    };
    Ok(Experts {
        count,
        per_token,
        intermediate_size,
        normalize: false,
        aux_loss_coef: keys.optional_f64("router_aux_loss_coef")?.unwrap_or(0.001),
        aux_loss: keys.flag("output_router_logits", false)?,
        softmax_over_chosen: true,
        clamped: Some(ClampedSwiGlu {
            alpha: positive("swiglu_alpha", 1.702)?,
            limit: positive("swiglu_limit", 7.0)?,
        }),
        shared: None,
    })
}

/// The linear-attention sizes, with `Qwen3_5TextConfig`'s defaults.
fn linear_attention(keys: &Keys) -> Result<LinearAttention, ConfigError> {
    let size = |key: &str, default: usize| -> Result<usize, ConfigError> {
        match keys.optional_usize(key)?.unwrap_or(default) {
            0 => Err(ConfigError(format!("`{key}` must be at least 1"))),
            size => Ok(size),
        }
    };
    let sizes = LinearAttention {
        key_heads: size("linear_num_key_heads", 16)?,
        value_heads: size("linear_num_value_heads", 32)?,
        key_head_dim: size("linear_key_head_dim", 128)?,
        value_head_dim: size("linear_value_head_dim", 128)?,
        conv_kernel: size("linear_conv_kernel_dim", 4)?,
    };
    if sizes.conv_kernel < 2 {
        return Err(ConfigError(format!(
            "`linear_conv_kernel_dim` must be at least 2, found {}",
            sizes.conv_kernel
        )));
    }
    if !sizes.value_heads.is_multiple_of(sizes.key_heads) {
        return Err(ConfigError(format!(
            "`linear_num_value_heads` ({}) must be a multiple of `linear_num_key_heads` ({})",
            sizes.value_heads, sizes.key_heads
        )));
    }
    Ok(sizes)
}
