//! `config.json` of a Hugging Face checkpoint of one of the families in [`Arch`].
//!
//! Both the keys written by transformers 4 (`rope_theta`, `rope_scaling`) and by transformers 5
//! (`rope_parameters`) are read, so folders saved by either load unchanged.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use holo_core::chat::folder::{eos_token_ids, read_json};

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
        }
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
}

impl LayerSpec {
    /// Full attention with RoPE: every layer of Qwen2, Qwen3 and Llama checkpoints.
    pub const FULL: LayerSpec = LayerSpec {
        window: None,
        rope: true,
    };
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
    /// An RMSNorm over each query and key head (`self_attn.q_norm`, `self_attn.k_norm`, `[head_dim]`),
    /// after the projection and before RoPE: Qwen3.
    pub qk_norm: bool,
    /// Each layer's attention window and RoPE, in layer order (`num_hidden_layers` of them).
    pub layers: Vec<LayerSpec>,
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
        let usize_key = |key: &str| -> Result<usize, ConfigError> {
            match json.get(key) {
                Some(value) => value.as_u64().map(|v| v as usize).ok_or_else(|| {
                    ConfigError(format!(
                        "`{key}` must be a non-negative integer, found {value}"
                    ))
                }),
                None => Err(ConfigError(format!("missing `{key}`"))),
            }
        };
        let optional_usize = |key: &str| -> Result<Option<usize>, ConfigError> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(_) => usize_key(key).map(Some),
            }
        };
        let optional_f64 = |key: &str| -> Result<Option<f64>, ConfigError> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(value) => value
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| ConfigError(format!("`{key}` must be a number, found {value}"))),
            }
        };
        let bool_key = |key: &str, default: bool| -> Result<bool, ConfigError> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(value) => value.as_bool().ok_or_else(|| {
                    ConfigError(format!("`{key}` must be true or false, found {value}"))
                }),
            }
        };

        let hidden_act = json
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if hidden_act != "silu" {
            return Err(ConfigError(format!(
                "unsupported `hidden_act` {hidden_act:?}: only \"silu\" is implemented"
            )));
        }
        let hidden_size = usize_key("hidden_size")?;
        let num_attention_heads = usize_key("num_attention_heads")?;
        let num_key_value_heads =
            optional_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_attention_heads == 0 || num_key_value_heads == 0 {
            return Err(ConfigError("attention needs at least one head".into()));
        }
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(ConfigError(format!(
                "`num_attention_heads` ({num_attention_heads}) must be a multiple of \
                 `num_key_value_heads` ({num_key_value_heads})"
            )));
        }
        let head_dim = match optional_usize("head_dim")? {
            Some(head_dim) => head_dim,
            // transformers' `Qwen3Config` defaults it rather than deriving it.
            None if arch == Arch::Qwen3 => 128,
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
        refuse_unimplemented_keys(json)?;

        // transformers 5 folds theta and scaling into `rope_parameters`; earlier versions keep them apart.
        let rope_parameters = json.get("rope_parameters").filter(|value| !value.is_null());
        let rope_theta = match rope_parameters.and_then(|p| p.get("rope_theta")) {
            Some(theta) => theta.as_f64().ok_or_else(|| {
                ConfigError(format!(
                    "`rope_parameters.rope_theta` must be a number, found {theta}"
                ))
            })?,
            None => optional_f64("rope_theta")?.unwrap_or(10_000.0),
        };
        let scaling = rope_parameters.or(json.get("rope_scaling").filter(|value| !value.is_null()));
        let rope_scaling = match scaling {
            None => RopeScaling::None,
            Some(scaling) => rope_scaling(scaling, json)?,
        };

        let eos_token_ids = eos_token_ids(json).map_err(ConfigError)?;
        let (qkv_bias, o_bias) = match arch {
            Arch::Qwen2 => (true, false),
            Arch::Qwen3 => (bool_key("attention_bias", false)?, false),
            Arch::Mistral | Arch::Ministral => (false, false),
            Arch::Llama | Arch::SmolLm3 => {
                let bias = bool_key("attention_bias", false)?;
                (bias, bias)
            }
        };
        let num_hidden_layers = usize_key("num_hidden_layers")?;
        let layers = layer_specs(arch, json, num_hidden_layers)?;
        let config = ModelConfig {
            arch,
            vocab_size: usize_key("vocab_size")?,
            hidden_size,
            intermediate_size: usize_key("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: optional_usize("max_position_embeddings")?.unwrap_or(4096),
            rms_norm_eps: optional_f64("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: bool_key(
                "tie_word_embeddings",
                matches!(arch, Arch::Qwen2 | Arch::SmolLm3),
            )?,
            qkv_bias,
            o_bias,
            mlp_bias: matches!(arch, Arch::Llama | Arch::SmolLm3) && bool_key("mlp_bias", false)?,
            qk_norm: arch == Arch::Qwen3,
            layers,
            bos_token_id: optional_usize("bos_token_id")?.map(|id| id as u32),
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
        object.insert(
            "rope_scaling".into(),
            match &self.rope_scaling {
                RopeScaling::None => Value::Null,
                RopeScaling::Linear { factor } => {
                    serde_json::json!({"rope_type": "linear", "factor": factor})
                }
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                } => serde_json::json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                }),
            },
        );
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

/// The families this runtime implements, for error messages.
pub const SUPPORTED: &str = "qwen2 (Qwen2ForCausalLM: Qwen2, Qwen2.5, SmolLM), qwen3 \
     (Qwen3ForCausalLM: Qwen3 dense), llama (LlamaForCausalLM: Llama 2/3, SmolLM2), mistral \
     (MistralForCausalLM), ministral (MinistralForCausalLM) and smollm3 (SmolLM3ForCausalLM)";

/// Keys that change what the model computes in ways this runtime does not implement: refused by name
/// rather than loaded into a model that would silently compute something else.
fn refuse_unimplemented_keys(json: &Value) -> Result<(), ConfigError> {
    if let Some(quantization) = json.get("quantization_config").filter(|v| !v.is_null()) {
        let method = quantization
            .get("quant_method")
            .and_then(Value::as_str)
            .unwrap_or("unnamed");
        return Err(ConfigError(format!(
            "`quantization_config` ({method}) is not supported: load the unquantized checkpoint, or a \
             GGUF file of it"
        )));
    }
    Ok(())
}

/// Each layer's window and RoPE, from `layer_types`, `sliding_window` and the family's own keys
/// (`use_sliding_window` and `max_window_layers` for Qwen, `no_rope_layers` for SmolLM3), with the
/// defaults transformers' config classes derive when a key is absent.
fn layer_specs(arch: Arch, json: &Value, count: usize) -> Result<Vec<LayerSpec>, ConfigError> {
    let present = |key: &str| json.get(key).filter(|value| !value.is_null());
    let window = match present("sliding_window") {
        None => None,
        Some(value) => match value.as_u64() {
            Some(window) if window >= 1 => Some(window as usize),
            _ => {
                return Err(ConfigError(format!(
                    "`sliding_window` must be a positive integer or null, found {value}"
                )))
            }
        },
    };
    let flag = |key: &str| -> Result<bool, ConfigError> {
        match present(key) {
            None => Ok(false),
            Some(value) => value.as_bool().ok_or_else(|| {
                ConfigError(format!("`{key}` must be true or false, found {value}"))
            }),
        }
    };
    let integer = |key: &str, default: usize| -> Result<usize, ConfigError> {
        match present(key) {
            None => Ok(default),
            Some(value) => value.as_u64().map(|v| v as usize).ok_or_else(|| {
                ConfigError(format!(
                    "`{key}` must be a non-negative integer, found {value}"
                ))
            }),
        }
    };
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

    let sliding: Vec<bool> = match per_layer("layer_types")? {
        Some(types) => types
            .iter()
            .enumerate()
            .map(|(layer, kind)| match kind.as_str() {
                Some("full_attention") => Ok(false),
                Some("sliding_attention") => Ok(true),
                _ => Err(ConfigError(format!(
                    "`layer_types[{layer}]` is {kind}: supported layer types are \
                     \"full_attention\" and \"sliding_attention\""
                ))),
            })
            .collect::<Result<_, _>>()?,
        None => match arch {
            Arch::Qwen2 | Arch::Qwen3 => {
                let from = integer("max_window_layers", 28)?;
                (0..count).map(|layer| layer >= from).collect()
            }
            Arch::SmolLm3 => rope.iter().map(|&rope| !rope).collect(),
            Arch::Mistral | Arch::Ministral => vec![true; count],
            Arch::Llama => vec![false; count],
        },
    };
    // Where the family's attention reads the window (transformers' modelling code).
    let window = match arch {
        Arch::Qwen2 | Arch::Qwen3 if !flag("use_sliding_window")? => None,
        Arch::Llama => None,
        _ => window,
    };
    Ok(sliding
        .into_iter()
        .zip(rope)
        .map(|(sliding, rope)| LayerSpec {
            window: if arch == Arch::Mistral || sliding {
                window
            } else {
                None
            },
            rope,
        })
        .collect())
}

fn rope_scaling(scaling: &Value, config: &Value) -> Result<RopeScaling, ConfigError> {
    let kind = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| -> Result<f64, ConfigError> {
        scaling
            .get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| ConfigError(format!("rope scaling {kind:?} needs a numeric `{key}`")))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: number("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: scaling
                .get("original_max_position_embeddings")
                .or_else(|| config.get("original_max_position_embeddings"))
                .and_then(Value::as_u64)
                .ok_or_else(|| {
                    ConfigError(
                        "rope scaling \"llama3\" needs `original_max_position_embeddings`".into(),
                    )
                })? as usize,
        }),
        other => Err(ConfigError(format!(
            "unsupported rope scaling type {other:?}; supported: default, linear, llama3"
        ))),
    }
}
