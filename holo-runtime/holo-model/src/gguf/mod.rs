//! GGUF files (llama.cpp's format) as models: a `.gguf` path loads wherever a model folder does.
//!
//! One file holds everything a model folder holds, as metadata and tensors:
//! - the config: `general.architecture` (`qwen2`, `qwen3`, `qwen3moe`, `qwen35`, `qwen35moe`, `llama`,
//!   `smollm3`, `olmo2`, `gemma2`, `gemma3`, `phi3` or `gpt-oss`) and the `<arch>.*` keys (`embedding_length`,
//!   `block_count`, `feed_forward_length`, `attention.head_count`, `attention.head_count_kv`,
//!   `context_length`, `rope.freq_base`, `attention.layer_norm_rms_epsilon`); the vocabulary size is the
//!   embedding's, and the embeddings are tied when there is no `output.weight`; the windowed layers'
//!   RoPE base from `rope.freq_base_swa` when given. Per family, what llama.cpp's converter writes:
//!   Gemma 3's windows come
//!   from `gemma3.attention.sliding_window` over llama.cpp's fixed pattern (each sixth layer global), and
//!   its norms, which llama.cpp stores as `1 + w`, are taken back to `w`; Gemma 2's likewise, its windows
//!   on every other layer from the first (llama.cpp's `set_swa_pattern(2)`) and its soft-caps from
//!   `gemma2.attn_logit_softcapping` and `gemma2.final_logit_softcapping`; OLMo 3 is written as `olmo2`
//!   with `attention.sliding_window` and one `attention.sliding_window_pattern` flag per layer (an OLMo 2
//!   file has no window); Mistral is written as `llama`, and llama.cpp's converter writes no window
//!   for it (its Llama graph attends fully): a `llama` file without `llama.attention.sliding_window`
//!   attends fully, as llama.cpp runs it (a checkpoint whose `sliding_window` is set, Mistral 7B
//!   v0.1's 4,096, then differs from transformers past that many positions), and one with that key
//!   (gguf-py's name for every architecture's window) is Mistral's, every layer windowed as by its
//!   `sliding_window`, or, with `llama.attention.sliding_window_pattern`, Ministral's, the layers it
//!   flags windowed as by its `layer_types`; SmolLM3's layers without RoPE are llama.cpp's fixed
//!   every fourth (`n_no_rope_layer_step`, transformers' default `no_rope_layer_interval` of 4: neither
//!   llama.cpp nor gguf-py has a key for it, so a checkpoint with another pattern has no GGUF form);
//!   Phi-3's `attn_qkv` and `ffn_up` hold the fused `qkv_proj` and `gate_up_proj`, RoPE rotates
//!   `rope.dimension_count` of each head, LongRoPE's factors are the tensors `rope_factors_long` and
//!   `rope_factors_short` (with `rope.scaling.original_context_length` and `rope.scaling.attn_factor`),
//!   Llama 3.1's rope scaling is the tensor `rope_freqs`, one factor per frequency that divides it,
//!   read as LongRoPE with those factors short and long and an attention factor of 1,
//!   and `attention.sliding_window`, when not 0, windows every layer; Qwen3-MoE's experts from
//!   `expert_count`, `expert_used_count` and `expert_feed_forward_length`, renormalised over the chosen
//!   ones as llama.cpp's graph does (`expert_weights_norm` when given), on the layers that have a router
//!   (`ffn_gate_inp`), whose `ffn_{gate,up,down}_exps` hold every expert's matrix; gpt-oss (`gpt-oss`)
//!   with the same expert keys, the experts' biases (`ffn_*_exps.bias`), the router's (`ffn_gate_inp`,
//!   with a bias), attention sinks (`attn_sinks`), `post_attention_norm` before the experts,
//!   `attention.sliding_window` on every other layer from the first (llama.cpp's `set_swa_pattern(2)`,
//!   or `attention.sliding_window_pattern` when given) and YaRN (see below); its experts' SwiGLU is
//!   clamped at llama.cpp's constants (alpha 1.702, limit 7: no key holds them). gate and up come split
//!   (`ffn_gate_exps`, `ffn_up_exps`) or fused as the converter's `--fuse-gate-up-exps` writes them
//!   (`ffn_gate_up_exps`, gate rows then up rows). YaRN (`rope.scaling.type` `yarn`, any family) takes
//!   `rope.scaling.factor`, `original_context_length`, `yarn_beta_fast`/`yarn_beta_slow` (32 and 1 when
//!   absent) and `yarn_attn_factor` (transformers' `0.1 ln factor + 1` when absent); the corrections'
//!   bounds are rounded as transformers' `truncate` default says, except gpt-oss's, whose checkpoints say
//!   `truncate: false` (llama.cpp always rounds: its gpt-oss logits differ from transformers' there);
//!   Qwen3.5's linear attention as `qwen35.rs` reads it (its sizes from `qwen35.ssm.*`, and the
//!   converter's transformations of its tensors undone), and its mixture (`qwen35moe`) as Qwen3-MoE's
//!   plus a shared expert (`qwen35.rs`);
//! - the weights, under llama.cpp's names (`token_embd`, `blk.N.attn_q`, …), in any tensor type candle
//!   reads (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K … Q6_K) and MXFP4 (ggml type 39, what
//!   gpt-oss files keep their experts in), read by a header reader of this crate ([`header`]) because
//!   candle's refuses the file at MXFP4; a tensor of any other type is refused by name and type when
//!   the model reads it. A mixture's experts are read and dequantized one expert at a time into the
//!   matrices the model holds, so that loading holds one expert's f32 values beside the model, not a
//!   layer's stack. [`Blocks`] says what becomes of
//!   quantized ones: dequantized to f32 and then converted to the requested dtype (what training needs),
//!   or, for the projections of the layers (attention's q, k, v and output, the MLP's gate, up and down)
//!   in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or a k-quant, kept as the file's blocks and multiplied as they are
//!   ([`Weight::Quantized`]), which is what sampling on the CPU reads 4–7× fewer bytes with, and the
//!   output head's (or the tied embeddings') blocks kept beside the dequantized tensor for the logits;
//!   a mixture's experts in MXFP4 are kept as their blocks too ([`Weight::Mxfp4`]); the embeddings,
//!   norms and other experts are dequantized either way. llama.cpp stores a Llama model's q and k rows permuted for its
//!   rotary layout; they are put back in Hugging Face's order as transformers does (Qwen2 files are not
//!   permuted), rows of blocks alike; a layer's q, k and v fused into one `attn_qkv` by the converter's
//!   `--fuse-qkv` (any family but Phi-3, whose `attn_qkv` is its own `qkv_proj`) are split back by rows
//!   (q's heads, then k's, then v's), weights, biases and blocks alike (`rows.rs`);
//! - the tokenizer (`tokenizer.ggml.*`), rebuilt as transformers' `convert_gguf_tokenizer` does:
//!   byte-level BPE for `gpt2` vocabularies (SmolLM2, Qwen2, Llama 3) with the split regex that
//!   `tokenizer.ggml.pre` names, sentencepiece BPE with byte fallback for `llama` ones (Gemma, Llama 2,
//!   Phi-3: merges recovered from the pieces' scores, spaces prefixed as llama.cpp does,
//!   `sentencepiece.rs`); control
//!   tokens become special added tokens, user-defined ones plain added tokens; BOS / EOS are added when
//!   `tokenizer.ggml.add_bos_token` / `add_eos_token` say so (BOS by default for `llama` vocabularies);
//! - the chat template (`tokenizer.chat_template`, ChatML when absent) with `bos_token`, `eos_token`,
//!   `unk_token` and `pad_token` from the token ids of the metadata.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::ops::Range;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use tokenizers::Tokenizer;

use super::config::{
    Arch, ClampedSwiGlu, ConfigError, Experts, LayerSpec, ModelConfig, RopeScaling, Variant,
};
use super::error::LoadError;
use super::model::{Linear, Model, Weight};
use crate::kernels::mxfp4::Mxfp4Matrix;
use header::{Header, TensorInfo, TensorType};
use holo_core::chat::ChatTemplate;
use rows::{
    block_rows, fused_qkv, qkv_parts, rotary_heads, unpermute_rotary, unpermute_rotary_blocks,
};

pub mod header;
mod qwen35;
mod rows;
mod sentencepiece;
mod tokenizer;

/// Whether `path` names a GGUF file: it ends in `.gguf` and is not a folder.
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|ext| ext == "gguf") && !path.is_dir()
}

/// A GGUF file's header: its metadata and where its tensors lie.
pub struct Gguf {
    path: PathBuf,
    header: Header,
}

/// What [`Gguf::model`] does with a file's quantized tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocks {
    /// Every tensor dequantized to f32, then converted to the model's type: a model that trains.
    Dequantize,
    /// The layers' projections kept as the file's blocks ([`Weight::Quantized`], CPU only), and MXFP4
    /// experts as theirs ([`Weight::Mxfp4`]), the rest dequantized: a model that samples, reading the
    /// blocks' bytes per token.
    Keep,
}

/// llama.cpp's names of the layers' projections, whose quantized blocks [`Blocks::Keep`] keeps (Phi-3's
/// `attn_qkv` and `ffn_up` hold its fused projections; Qwen3.5's shared expert is `ffn_*_shexp`).
const PROJECTIONS: [&str; 11] = [
    "attn_qkv",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
];

/// The `general.architecture` values this runtime implements.
const ARCHITECTURES: &str = "qwen2, qwen3, qwen3moe, qwen35, qwen35moe, llama, smollm3, olmo2 \
     (OLMo 2 and 3), gemma2, gemma3, phi3, gpt-oss";

/// llama.cpp's gpt-oss graph clamps the experts' SwiGLU with these (`swiglu_oai` in `build_moe_ffn`),
/// constants of its code rather than keys of the file; they are also `GptOssConfig`'s defaults.
const OAI_SWIGLU: ClampedSwiGlu = ClampedSwiGlu {
    alpha: 1.702,
    limit: 7.0,
};

/// llama.cpp's per-frequency RoPE factors (see [`Gguf::rope_freqs`]).
const ROPE_FREQS: &str = "rope_freqs.weight";

/// llama.cpp's SmolLM3 graph leaves RoPE out of every layer `l` with `(l + 1) % 4 == 0`
/// (`n_no_rope_layer_step`), a constant of its code rather than a key of the file.
const SMOLLM3_NO_ROPE_STEP: usize = 4;

impl Gguf {
    /// Reads the header of `path` (metadata and tensor descriptions, not the tensors).
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let fail = |message: String| LoadError::Weights {
            file: path.to_path_buf(),
            message,
        };
        if !path.is_file() {
            return Err(fail("no such file".into()));
        }
        let mut reader = BufReader::new(
            File::open(path).map_err(|error| fail(format!("cannot open: {error}")))?,
        );
        let header = Header::read(&mut reader)
            .map_err(|error| fail(format!("not a readable GGUF file: {error}")))?;
        Ok(Gguf {
            path: path.to_path_buf(),
            header,
        })
    }

    fn config_error(&self, message: String) -> LoadError {
        LoadError::Config(ConfigError(format!("{}: {message}", self.path.display())))
    }

    fn value(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }

    fn u64_key(&self, key: &str) -> Result<Option<u64>, LoadError> {
        let Some(value) = self.value(key) else {
            return Ok(None);
        };
        let number = match value {
            Value::U8(v) => Some(*v as u64),
            Value::U16(v) => Some(*v as u64),
            Value::U32(v) => Some(*v as u64),
            Value::U64(v) => Some(*v),
            Value::I8(v) => u64::try_from(*v).ok(),
            Value::I16(v) => u64::try_from(*v).ok(),
            Value::I32(v) => u64::try_from(*v).ok(),
            Value::I64(v) => u64::try_from(*v).ok(),
            _ => None,
        };
        number.map(Some).ok_or_else(|| {
            self.config_error(format!(
                "metadata `{key}` must be a non-negative integer, found {:?}",
                value.value_type()
            ))
        })
    }

    fn required_usize(&self, key: &str) -> Result<usize, LoadError> {
        self.u64_key(key)?
            .map(|v| v as usize)
            .ok_or_else(|| self.config_error(format!("missing metadata `{key}`")))
    }

    fn f64_key(&self, key: &str) -> Result<Option<f64>, LoadError> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::F32(v)) => Ok(Some(*v as f64)),
            Some(Value::F64(v)) => Ok(Some(*v)),
            Some(_) => self.u64_key(key).map(|v| v.map(|v| v as f64)),
        }
    }

    fn str_key(&self, key: &str) -> Result<Option<&str>, LoadError> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text)),
            Some(other) => Err(self.config_error(format!(
                "metadata `{key}` must be a string, found {:?}",
                other.value_type()
            ))),
        }
    }

    fn bool_key(&self, key: &str) -> Result<Option<bool>, LoadError> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Bool(v)) => Ok(Some(*v)),
            Some(other) => Err(self.config_error(format!(
                "metadata `{key}` must be true or false, found {:?}",
                other.value_type()
            ))),
        }
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<&str>>, LoadError> {
        let Some(value) = self.value(key) else {
            return Ok(None);
        };
        let invalid = || self.config_error(format!("metadata `{key}` must be a list of strings"));
        let Value::Array(items) = value else {
            return Err(invalid());
        };
        items
            .iter()
            .map(|item| match item {
                Value::String(text) => Ok(text.as_str()),
                _ => Err(invalid()),
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }

    fn token_types(&self) -> Result<Vec<i64>, LoadError> {
        let key = "tokenizer.ggml.token_type";
        let Some(value) = self.value(key) else {
            return Ok(Vec::new());
        };
        let invalid = || self.config_error(format!("metadata `{key}` must be a list of integers"));
        let Value::Array(items) = value else {
            return Err(invalid());
        };
        items
            .iter()
            .map(|item| match item {
                Value::I32(v) => Ok(*v as i64),
                Value::U32(v) => Ok(*v as i64),
                Value::I64(v) => Ok(*v),
                Value::U8(v) => Ok(*v as i64),
                Value::I8(v) => Ok(*v as i64),
                _ => Err(invalid()),
            })
            .collect()
    }

    /// The architecture named by `general.architecture`.
    pub fn arch(&self) -> Result<(Arch, &str), LoadError> {
        let name = self
            .str_key("general.architecture")?
            .ok_or_else(|| self.config_error("missing metadata `general.architecture`".into()))?;
        match name {
            "qwen2" => Ok((Arch::Qwen2, name)),
            "qwen3" => Ok((Arch::Qwen3, name)),
            "qwen3moe" => Ok((Arch::Qwen3Moe, name)),
            "qwen35" => Ok((Arch::Qwen3_5, name)),
            "qwen35moe" => Ok((Arch::Qwen3_5Moe, name)),
            // llama.cpp writes Mistral as Llama, and its converter writes no window for it: a file
            // that has one (the key every other architecture's window goes under) is Mistral's, or,
            // with a flag per layer, Ministral's.
            "llama" if self.u64_key("llama.attention.sliding_window")?.unwrap_or(0) > 0 => {
                match self.value("llama.attention.sliding_window_pattern") {
                    Some(_) => Ok((Arch::Ministral, name)),
                    None => Ok((Arch::Mistral, name)),
                }
            }
            "llama" => Ok((Arch::Llama, name)),
            "smollm3" => Ok((Arch::SmolLm3, name)),
            // llama.cpp writes OLMo 3 as OLMo 2 with windows.
            "olmo2" if self.u64_key("olmo2.attention.sliding_window")?.unwrap_or(0) > 0 => {
                Ok((Arch::Olmo3, name))
            }
            "olmo2" => Ok((Arch::Olmo2, name)),
            "gemma2" => Ok((Arch::Gemma2, name)),
            "gemma3" => Ok((Arch::Gemma3, name)),
            "phi3" => Ok((Arch::Phi3, name)),
            "gpt-oss" => Ok((Arch::GptOss, name)),
            other => Err(self.config_error(format!(
                "unsupported architecture {other:?} (`general.architecture`); supported: {ARCHITECTURES}"
            ))),
        }
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.header.tensors.contains_key(name)
    }

    /// The token id stored under `tokenizer.ggml.<key>`.
    fn token_id(&self, key: &str) -> Result<Option<u32>, LoadError> {
        Ok(self
            .u64_key(&format!("tokenizer.ggml.{key}"))?
            .map(|id| id as u32))
    }

    /// Each tensor's name and element count, as the header describes them (the data is not read).
    pub fn tensor_elements(&self) -> Vec<(String, u64)> {
        self.header
            .tensors
            .values()
            .map(|info| (info.name.clone(), info.shape.elem_count() as u64))
            .collect()
    }

    /// What a model loaded with [`Blocks::Keep`] holds as the file's blocks, read off the header as
    /// [`Gguf::model`] decides it (the data is not read).
    pub fn kept_blocks(&self) -> Result<KeptBlocks, LoadError> {
        let config = self.config()?;
        let mut kept = KeptBlocks::default();
        for (name, info) in &self.header.tensors {
            let bytes = info.stored_bytes().unwrap_or(0);
            let elements = info.shape.elem_count() as u64;
            if layer_of(name).is_some_and(|layer| layer >= config.num_hidden_layers) {
                continue;
            }
            let projection = match expert_tensor(name) {
                Some(_) => info.kind == TensorType::Mxfp4,
                None => qwen35::linear_tensor(&config, name).is_none() && keeps(name, info),
            };
            if projection {
                kept.projections += elements;
                kept.projection_bytes += bytes;
                // MXFP4 experts have no backward: only the blocks LoRA trains over are expanded.
                if info.kind != TensorType::Mxfp4 {
                    kept.largest = kept.largest.max(elements);
                }
            } else if name == head_name(&config) && keeps_type(info) {
                kept.head_bytes = bytes;
            }
        }
        Ok(kept)
    }

    /// The model config the metadata describes.
    pub fn config(&self) -> Result<ModelConfig, LoadError> {
        let (arch, name) = self.arch()?;
        let key = |suffix: &str| format!("{name}.{suffix}");
        let hidden_size = self.required_usize(&key("embedding_length"))?;
        let num_attention_heads = self.required_usize(&key("attention.head_count"))?;
        let num_key_value_heads = self
            .u64_key(&key("attention.head_count_kv"))?
            .map_or(num_attention_heads, |v| v as usize);
        if num_attention_heads == 0
            || num_key_value_heads == 0
            || num_attention_heads % num_key_value_heads != 0
        {
            return Err(self.config_error(format!(
                "`{}` ({num_attention_heads}) must be a positive multiple of `{}` ({num_key_value_heads})",
                key("attention.head_count"),
                key("attention.head_count_kv")
            )));
        }
        let head_dim = match self.u64_key(&key("attention.key_length"))? {
            Some(length) => length as usize,
            None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            None => {
                return Err(self.config_error(format!(
                    "`{}` ({hidden_size}) is not a multiple of `{}` ({num_attention_heads})",
                    key("embedding_length"),
                    key("attention.head_count")
                )))
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(self.config_error(format!("head dimension {head_dim} must be even")));
        }
        // The model's values are as wide as its keys.
        if let Some(values) = self.u64_key(&key("attention.value_length"))? {
            if values as usize != head_dim {
                return Err(self.config_error(format!(
                    "`{}` ({values}) differs from the heads' key width ({head_dim}): values as wide \
                     as keys are supported only",
                    key("attention.value_length")
                )));
            }
        }
        let rotary_dim = match self.u64_key(&key("rope.dimension_count"))? {
            Some(rotary) if rotary as usize == head_dim => None,
            // Phi-3 (Phi-4-mini) and Qwen3.5 rotate the first part of each head.
            Some(rotary)
                if (arch == Arch::Phi3 || arch.is_qwen3_5())
                    && rotary > 0
                    && rotary % 2 == 0
                    && (rotary as usize) < head_dim =>
            {
                Some(rotary as usize)
            }
            Some(rotary) => {
                return Err(self.config_error(format!(
                    "`{}` is {rotary}, but the heads have {head_dim} dimensions: partial rotary \
                     embeddings are supported for phi3, qwen35 and qwen35moe only (an even part of \
                     the head)",
                    key("rope.dimension_count")
                )))
            }
            None => None,
        };
        let rope_scaling = match self.str_key(&key("rope.scaling.type"))? {
            None | Some("none") if arch == Arch::Phi3 => self.long_rope(name)?,
            None | Some("none") if self.has_tensor(ROPE_FREQS) => {
                self.rope_freqs(name, rotary_dim.unwrap_or(head_dim))?
            }
            Some(kind) if self.has_tensor(ROPE_FREQS) => {
                return Err(self.config_error(format!(
                    "tensor {ROPE_FREQS} (one RoPE factor per frequency) with `{}` {kind:?}: \
                     two rescalings of the same frequencies",
                    key("rope.scaling.type")
                )))
            }
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear {
                factor: self.f64_key(&key("rope.scaling.factor"))?.ok_or_else(|| {
                    self.config_error(format!("missing metadata `{}`", key("rope.scaling.factor")))
                })?,
            },
            Some("yarn") => self.yarn(arch, name)?,
            Some(other) => {
                return Err(self.config_error(format!(
                    "unsupported `{}` {other:?}; supported: none, linear, yarn",
                    key("rope.scaling.type")
                )))
            }
        };
        let embedding = self
            .header
            .tensors
            .get("token_embd.weight")
            .ok_or_else(|| self.weights_error("missing tensor token_embd.weight".into()))?;
        let vocab_size = match embedding.shape.dims() {
            [vocab, hidden] if *hidden == hidden_size => *vocab,
            dims => {
                return Err(self.weights_error(format!(
                    "tensor token_embd.weight has shape {dims:?}, expected [vocab, {hidden_size}]"
                )))
            }
        };
        let blocks = self.required_usize(&key("block_count"))?;
        // llama.cpp counts the multi-token-prediction layers (Qwen3.5's, unless converted with
        // `--no-mtp`) among the blocks, after the model's; they predict tokens further ahead, which
        // this runtime does not, so their tensors are left unread (as transformers leaves `mtp.*`).
        let predictors = self.u64_key(&key("nextn_predict_layers"))?.unwrap_or(0) as usize;
        let Some(block_count) = blocks.checked_sub(predictors).filter(|&layers| layers > 0) else {
            return Err(self.config_error(format!(
                "`{}` ({predictors}) leaves none of the `{}` ({blocks}) blocks to the model",
                key("nextn_predict_layers"),
                key("block_count")
            )));
        };
        let linear = match arch {
            Arch::Qwen3_5 | Arch::Qwen3_5Moe => self.recurrent_layers(name, blocks, block_count)?,
            _ => vec![false; block_count],
        };
        // Attention's biases, on its first layer (Qwen3.5's first is linear attention, whose
        // `attn_qkv` is its own projection).
        let first = linear.iter().position(|&linear| !linear).unwrap_or(0);
        let attention_bias = |module: &str| self.has_tensor(&format!("blk.{first}.{module}.bias"));
        // Separate, or fused by the converter's `--fuse-qkv`.
        let qkv_bias = attention_bias("attn_q") || attention_bias("attn_qkv");
        let (qkv_bias, o_bias, mlp_bias) = match arch {
            Arch::Qwen2 => (true, false, false),
            Arch::Phi3 => (
                self.has_tensor("blk.0.attn_qkv.bias"),
                self.has_tensor("blk.0.attn_output.bias"),
                self.has_tensor("blk.0.ffn_up.bias"),
            ),
            Arch::Qwen3 => (qkv_bias, false, false),
            // `attention_bias`, on every projection of attention; the MLP has none.
            Arch::Qwen3_5 | Arch::Qwen3_5Moe => (qkv_bias, attention_bias("attn_output"), false),
            _ => (
                qkv_bias,
                self.has_tensor("blk.0.attn_output.bias"),
                self.has_tensor("blk.0.ffn_up.bias"),
            ),
        };
        let mut eos_token_ids = Vec::new();
        for name in ["eos_token_id", "eot_token_id", "eom_token_id"] {
            if let Some(id) = self.token_id(name)? {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        let config = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: match arch {
                // Every layer's feed-forward is a mixture: the converter writes no dense length.
                Arch::Qwen3_5Moe => 0,
                _ => self.required_usize(&key("feed_forward_length"))?,
            },
            num_hidden_layers: block_count,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: self.required_usize(&key("context_length"))?,
            rms_norm_eps: self
                .f64_key(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-6),
            rope_theta: self.f64_key(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            rope_scaling,
            tie_word_embeddings: !self.has_tensor("output.weight"),
            qkv_bias,
            o_bias,
            mlp_bias,
            variant: Variant {
                // llama.cpp scales Gemma 3's queries by 1/√head_dim (all but the 27B model).
                query_pre_attn_scalar: arch.is_gemma().then_some(head_dim as f64),
                // llama.cpp's converter writes Gemma 2's caps; a file without them has none.
                attention_softcap: self.f64_key(&key("attn_logit_softcapping"))?,
                final_softcap: self.f64_key(&key("final_logit_softcapping"))?,
                local_rope: match self.f64_key(&key("rope.freq_base_swa"))? {
                    Some(base) => Some((base, RopeScaling::None)),
                    None => Variant::of(arch).local_rope,
                },
                rotary_dim,
                ..Variant::of(arch)
            },
            layers: self
                .layer_specs(arch, name, block_count)?
                .into_iter()
                .zip(&linear)
                .map(|(layer, &linear)| LayerSpec { linear, ..layer })
                .collect(),
            linear_attention: match arch {
                Arch::Qwen3_5 | Arch::Qwen3_5Moe => Some(self.linear_attention(name)?),
                _ => None,
            },
            experts: match arch {
                Arch::Qwen3Moe => Some(Experts {
                    count: self.required_usize(&key("expert_count"))?,
                    per_token: self.required_usize(&key("expert_used_count"))?,
                    intermediate_size: self.required_usize(&key("expert_feed_forward_length"))?,
                    normalize: self.bool_key(&key("expert_weights_norm"))?.unwrap_or(true),
                    aux_loss_coef: 0.001,
                    aux_loss: false,
                    softmax_over_chosen: false,
                    clamped: None,
                    shared: None,
                }),
                // `GptOssTopKRouter`: the softmax of the chosen experts' logits, which llama.cpp's
                // graph computes too (`SOFTMAX_WEIGHT`).
                Arch::GptOss => Some(Experts {
                    count: self.required_usize(&key("expert_count"))?,
                    per_token: self.required_usize(&key("expert_used_count"))?,
                    intermediate_size: self.required_usize(&key("expert_feed_forward_length"))?,
                    normalize: false,
                    aux_loss_coef: 0.001,
                    aux_loss: false,
                    softmax_over_chosen: true,
                    clamped: Some(OAI_SWIGLU),
                    shared: None,
                }),
                Arch::Qwen3_5Moe => Some(self.shared_experts(name)?),
                _ => None,
            },
            bos_token_id: self.token_id("bos_token_id")?,
            eos_token_ids,
        };
        if config.num_hidden_layers == 0 || config.vocab_size == 0 {
            return Err(self.config_error("the model has no layers or no vocabulary".into()));
        }
        Ok(config)
    }

    /// Each layer's window and RoPE: Gemma 3's every layer but each sixth slides over
    /// `gemma3.attention.sliding_window` positions (llama.cpp's fixed pattern); OLMo 3's and Ministral's
    /// layers that `attention.sliding_window_pattern` flags; Mistral's every layer; Phi-3's every layer
    /// when its window is not 0; SmolLM3's every fourth layer has no RoPE. The others attend fully, with
    /// RoPE.
    fn layer_specs(
        &self,
        arch: Arch,
        name: &str,
        count: usize,
    ) -> Result<Vec<LayerSpec>, LoadError> {
        if arch == Arch::Qwen3Moe {
            return Ok((0..count)
                .map(|layer| LayerSpec {
                    experts: self.has_tensor(&format!("blk.{layer}.ffn_gate_inp.weight")),
                    ..LayerSpec::FULL
                })
                .collect());
        }
        let key = format!("{name}.attention.sliding_window");
        let window = self.u64_key(&key)?.map(|window| window as usize);
        let windowed: Vec<bool> = match arch {
            Arch::Gemma2 | Arch::Gemma3 | Arch::Olmo3 | Arch::GptOss if window.is_none() => {
                return Err(self.config_error(format!("missing metadata `{key}`")))
            }
            Arch::Gemma3 => (0..count).map(|layer| (layer + 1) % 6 != 0).collect(),
            // llama.cpp's `set_swa_pattern(2)`: windowed, full, windowed, … as `Gemma2Config` has it.
            Arch::Gemma2 => (0..count).map(|layer| layer % 2 == 0).collect(),
            Arch::Olmo3 | Arch::Ministral => self.window_pattern(name, count)?,
            // Mistral's `sliding_window` windows every layer.
            Arch::Mistral => vec![true; count],
            Arch::Phi3 => vec![window.unwrap_or(0) > 0; count],
            // llama.cpp's `set_swa_pattern(2)`: windowed, full, windowed, … as `GptOssConfig` has it.
            Arch::GptOss
                if self
                    .value(&format!("{name}.attention.sliding_window_pattern"))
                    .is_none() =>
            {
                (0..count).map(|layer| layer % 2 == 0).collect()
            }
            Arch::GptOss => self.window_pattern(name, count)?,
            _ => vec![false; count],
        };
        Ok(windowed
            .into_iter()
            .enumerate()
            .map(|(layer, windowed)| LayerSpec {
                window: window.filter(|_| windowed),
                rope: arch != Arch::SmolLm3 || (layer + 1) % SMOLLM3_NO_ROPE_STEP != 0,
                experts: matches!(arch, Arch::GptOss | Arch::Qwen3_5Moe),
                ..LayerSpec::FULL
            })
            .collect())
    }

    /// Which layers `<arch>.attention.sliding_window_pattern` windows: one flag per layer, or, as
    /// llama.cpp's `set_swa_pattern` reads a number `n`, every layer but each `n`-th.
    fn window_pattern(&self, name: &str, count: usize) -> Result<Vec<bool>, LoadError> {
        let key = format!("{name}.attention.sliding_window_pattern");
        match self.value(&key) {
            None => Err(self.config_error(format!(
                "missing metadata `{key}` (which layers `{name}.attention.sliding_window` windows)"
            ))),
            Some(Value::Array(flags)) => {
                let flags = flags
                    .iter()
                    .map(|flag| match flag {
                        Value::Bool(flag) => Some(*flag),
                        _ => None,
                    })
                    .collect::<Option<Vec<bool>>>();
                match flags {
                    Some(flags) if flags.len() == count => Ok(flags),
                    _ => Err(self.config_error(format!(
                        "metadata `{key}` must be {count} true or false flags, one per layer"
                    ))),
                }
            }
            Some(_) => {
                let period = self.required_usize(&key)?;
                Ok((0..count)
                    .map(|layer| period == 0 || layer % period < period - 1)
                    .collect())
            }
        }
    }

    /// YaRN as `rope.scaling.*` states it, with transformers' defaults where a key is absent (see the
    /// module's documentation for `truncate`).
    fn yarn(&self, arch: Arch, name: &str) -> Result<RopeScaling, LoadError> {
        let key = |suffix: &str| format!("{name}.rope.scaling.{suffix}");
        if self.value(&key("yarn_log_multiplier")).is_some() {
            return Err(self.config_error(format!(
                "`{}` (DeepSeek's YaRN attention scaling) is not supported",
                key("yarn_log_multiplier")
            )));
        }
        let required = |suffix: &str| -> Result<f64, LoadError> {
            self.f64_key(&key(suffix))?
                .ok_or_else(|| self.config_error(format!("missing metadata `{}`", key(suffix))))
        };
        let factor = required("factor")?;
        if !(factor > 0.0 && factor.is_finite()) {
            return Err(self.config_error(format!(
                "`{}` must be a positive number, found {factor}",
                key("factor")
            )));
        }
        let original = self.required_usize(&key("original_context_length"))?;
        let beta = |suffix: &str, default: f64| -> Result<f64, LoadError> {
            Ok(self
                .f64_key(&key(suffix))?
                .filter(|beta| *beta != 0.0)
                .unwrap_or(default))
        };
        let attention_factor = match self.f64_key(&key("yarn_attn_factor"))? {
            Some(given) => given,
            None if factor <= 1.0 => 1.0,
            None => 0.1 * factor.ln() + 1.0,
        };
        Ok(RopeScaling::Yarn {
            factor,
            beta_fast: beta("yarn_beta_fast", 32.0)?,
            beta_slow: beta("yarn_beta_slow", 1.0)?,
            original_max_position_embeddings: original,
            truncate: arch != Arch::GptOss,
            attention_factor,
        })
    }

    /// Phi-3's LongRoPE, when the file has its factors (`rope_factors_long` and `rope_factors_short`,
    /// one per rotated pair): transformers' `longrope` with the original context length and attention
    /// factor of the metadata.
    fn long_rope(&self, name: &str) -> Result<RopeScaling, LoadError> {
        let (long, short) = ("rope_factors_long.weight", "rope_factors_short.weight");
        match (self.has_tensor(long), self.has_tensor(short)) {
            (false, false) => return Ok(RopeScaling::None),
            (true, true) => {}
            _ => {
                return Err(
                    self.weights_error(format!("one of {long} and {short} without the other"))
                )
            }
        }
        let key = format!("{name}.rope.scaling.original_context_length");
        let original = self.required_usize(&key)?;
        let context = self.required_usize(&format!("{name}.context_length"))?;
        let factor = context as f64 / original as f64;
        let attention_factor = match self.f64_key(&format!("{name}.rope.scaling.attn_factor"))? {
            Some(given) => given,
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
        };
        Ok(RopeScaling::LongRope {
            short_factor: self.vector(short)?,
            long_factor: self.vector(long)?,
            original_max_position_embeddings: original,
            attention_factor,
        })
    }

    /// llama.cpp's `rope_freqs`: one factor per rotated pair that divides its frequency, which the
    /// converter computes from Llama 3.1's `llama3` rope scaling (`LlamaModel.generate_extra_tensors`)
    /// and writes instead of its parameters (too few of the factors fall between the bands to recover
    /// them in general). transformers computes the same frequencies from LongRoPE with these factors as
    /// both its short and long ones and an attention factor of 1, which is how `holo export` writes the
    /// model's `config.json`.
    fn rope_freqs(&self, name: &str, rotated: usize) -> Result<RopeScaling, LoadError> {
        let factors = self.vector(ROPE_FREQS)?;
        if factors.len() != rotated / 2 {
            return Err(self.weights_error(format!(
                "tensor {ROPE_FREQS} has {} factors, but RoPE rotates {} pairs of each head",
                factors.len(),
                rotated / 2
            )));
        }
        Ok(RopeScaling::LongRope {
            short_factor: factors.clone(),
            long_factor: factors,
            original_max_position_embeddings: self
                .required_usize(&format!("{name}.context_length"))?,
            attention_factor: 1.0,
        })
    }

    /// The values of the one-dimensional tensor `name`, read from the file.
    fn vector(&self, name: &str) -> Result<Vec<f64>, LoadError> {
        let fail =
            |error: candle_core::Error| self.weights_error(format!("tensor {name}: {error}"));
        let mut reader = BufReader::new(
            File::open(&self.path)
                .map_err(|error| self.weights_error(format!("cannot open: {error}")))?,
        );
        self.header.tensors[name]
            .read(&mut reader, self.header.data_offset)
            .and_then(|tensor| tensor.dequantize(&Device::Cpu))
            .and_then(|tensor| tensor.flatten_all()?.to_dtype(DType::F64)?.to_vec1())
            .map_err(fail)
    }

    fn weights_error(&self, message: String) -> LoadError {
        LoadError::Weights {
            file: self.path.clone(),
            message,
        }
    }

    /// The Hugging Face name of a GGUF tensor of an `arch` model, or `None` for a name this runtime does
    /// not know.
    fn hf_name(arch: Arch, name: &str) -> Option<String> {
        let fixed = match name {
            "token_embd.weight" => Some("model.embed_tokens.weight"),
            "output_norm.weight" => Some("model.norm.weight"),
            "output.weight" => Some("lm_head.weight"),
            _ => None,
        };
        if let Some(fixed) = fixed {
            return Some(fixed.to_string());
        }
        let rest = name.strip_prefix("blk.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let (module, kind) = rest.rsplit_once('.')?;
        if kind != "weight" && kind != "bias" {
            return None;
        }
        let module = match module {
            "attn_norm" => "input_layernorm",
            // Gemma's `ffn_norm` is before the MLP as Llama's is, but Gemma also normalises attention's
            // output (`post_attention_norm`).
            "ffn_norm" if arch.is_gemma() => "pre_feedforward_layernorm",
            "ffn_norm" => "post_attention_layernorm",
            "post_attention_norm" => "post_attention_layernorm",
            "post_ffw_norm" => "post_feedforward_layernorm",
            // Phi-3's queries, keys and values, side by side.
            "attn_qkv" if arch == Arch::Phi3 => "self_attn.qkv_proj",
            "attn_q" => "self_attn.q_proj",
            "attn_k" => "self_attn.k_proj",
            "attn_v" => "self_attn.v_proj",
            "attn_output" => "self_attn.o_proj",
            "attn_q_norm" => "self_attn.q_norm",
            "attn_k_norm" => "self_attn.k_norm",
            "ffn_gate" => "mlp.gate_proj",
            // Phi-3's gate and up projections, side by side.
            "ffn_up" if arch == Arch::Phi3 => "mlp.gate_up_proj",
            "ffn_up" => "mlp.up_proj",
            "ffn_down" => "mlp.down_proj",
            // A mixture's router (its experts are [`expert_tensor`]'s).
            "ffn_gate_inp" if arch == Arch::GptOss => "mlp.router",
            "ffn_gate_inp" => "mlp.gate",
            // Qwen3.5's shared expert and its gate.
            "ffn_gate_shexp" => "mlp.shared_expert.gate_proj",
            "ffn_up_shexp" => "mlp.shared_expert.up_proj",
            "ffn_down_shexp" => "mlp.shared_expert.down_proj",
            "ffn_gate_inp_shexp" => "mlp.shared_expert_gate",
            // gpt-oss's sinks, a parameter of attention without a `.weight` of its own.
            "attn_sinks" if kind == "weight" => {
                return Some(format!("model.layers.{layer}.self_attn.sinks"))
            }
            _ => return None,
        };
        Some(format!("model.layers.{layer}.{module}.{kind}"))
    }

    /// The model, its tensors in `dtype` on `device`; quantized ones dequantized to f32 first, or with
    /// [`Blocks::Keep`] the projections' kept as they are (on the CPU only: the blocks' kernels are
    /// candle's CPU ones).
    pub fn model(&self, dtype: DType, device: &Device, blocks: Blocks) -> Result<Model, LoadError> {
        if blocks == Blocks::Keep && !device.is_cpu() {
            return Err(self.weights_error(format!(
                "quantized blocks are multiplied on the CPU only, not on {:?}; load the file \
                 dequantized (without `--quantized`)",
                device.location()
            )));
        }
        let config = self.config()?;
        let mut reader = BufReader::new(
            File::open(&self.path)
                .map_err(|error| self.weights_error(format!("cannot open: {error}")))?,
        );
        let mut names: Vec<&String> = self.header.tensors.keys().collect();
        names.sort_by_key(|name| self.header.tensors[*name].offset);
        let mut target = Target {
            dtype,
            device,
            tensors: HashMap::new(),
            kept: HashMap::new(),
        };
        let head_name = head_name(&config);
        let mut head_blocks = None;
        for name in names {
            if (name.starts_with("rope_factors_") && config.arch == Arch::Phi3)
                || name == ROPE_FREQS
            {
                // RoPE's factors, in the config already.
                continue;
            }
            if layer_of(name).is_some_and(|layer| layer >= config.num_hidden_layers) {
                // A multi-token-prediction layer (`nextn_predict_layers`), which the model does not run.
                continue;
            }
            let info = &self.header.tensors[name];
            let fail = |error: candle_core::Error| {
                self.weights_error(format!(
                    "tensor {name} ({}, shape {:?}): {error}",
                    info.kind,
                    info.shape.dims()
                ))
            };
            if let Some(stack) = expert_tensor(name) {
                // With [`Blocks::Keep`], MXFP4 matrices stay as their blocks for the sampler's products.
                let keep = blocks == Blocks::Keep && info.kind == TensorType::Mxfp4;
                target
                    .experts(info, stack, &mut reader, self.header.data_offset, keep)
                    .map_err(fail)?;
                continue;
            }
            if let (Some(sizes), Some((layer, hf))) = (
                &config.linear_attention,
                qwen35::linear_tensor(&config, name),
            ) {
                // Qwen3.5's linear attention, dequantized either way: its value heads' rows move.
                let tensor = info
                    .read(&mut reader, self.header.data_offset)
                    .and_then(|tensor| tensor.dequantize(&Device::Cpu))
                    .and_then(|tensor| qwen35::restore(sizes, hf, tensor))
                    .and_then(|tensor| tensor.to_dtype(dtype)?.to_device(device))
                    .map_err(fail)?;
                let hf = format!("model.layers.{layer}.linear_attn.{hf}");
                target.tensors.insert(hf, tensor);
                continue;
            }
            if let Some((layer, kind)) = fused_qkv(config.arch, name) {
                let parts = qkv_parts(&config);
                let rows = parts[2].1.end;
                if info.shape.dims().first() != Some(&rows) {
                    return Err(self.weights_error(format!(
                        "tensor {name} has shape {:?}: q, k and v fused take {rows} rows",
                        info.shape.dims()
                    )));
                }
                let quantized = info
                    .read(&mut reader, self.header.data_offset)
                    .map_err(fail)?;
                let keep = blocks == Blocks::Keep && keeps(name, info);
                let dense = match keep {
                    true => None,
                    false => Some(quantized.dequantize(&Device::Cpu).map_err(fail)?),
                };
                for (projection, rows, heads) in parts {
                    let hf = format!("model.layers.{layer}.self_attn.{projection}.{kind}");
                    let Some(dense) = &dense else {
                        let part = block_rows(&quantized, rows).map_err(fail)?;
                        let part = match heads {
                            Some(heads) => unpermute_rotary_blocks(&part, heads).map_err(fail)?,
                            None => part,
                        };
                        target
                            .keep(hf, Weight::Quantized(Arc::new(part)))
                            .map_err(fail)?;
                        continue;
                    };
                    let mut part = dense.narrow(0, rows.start, rows.len()).map_err(fail)?;
                    if let Some(heads) = heads {
                        part = unpermute_rotary(&part, heads).map_err(fail)?;
                    }
                    let part = part
                        .to_dtype(dtype)
                        .and_then(|part| part.to_device(device))
                        .map_err(fail)?;
                    target.tensors.insert(hf, part);
                }
                continue;
            }
            let hf = Self::hf_name(config.arch, name).ok_or_else(|| {
                self.weights_error(format!(
                    "tensor {name}: not a tensor of a {} model",
                    config.arch
                ))
            })?;
            let quantized = info
                .read(&mut reader, self.header.data_offset)
                .map_err(fail)?;
            if blocks == Blocks::Keep && keeps(name, info) {
                let heads = rotary_heads(&config, name);
                let quantized = match heads {
                    Some(heads) => unpermute_rotary_blocks(&quantized, heads).map_err(fail)?,
                    None => quantized,
                };
                target
                    .keep(hf, Weight::Quantized(Arc::new(quantized)))
                    .map_err(fail)?;
                continue;
            }
            let mut tensor = quantized.dequantize(&Device::Cpu).map_err(fail)?;
            if blocks == Blocks::Keep && name == head_name && keeps_type(info) {
                head_blocks = Some(quantized);
            }
            if config.variant.norm_offset && name.ends_with("norm.weight") {
                // llama.cpp stores Gemma's `1 + w`; transformers' GGUF loader takes the one back off.
                tensor = tensor.affine(1.0, -1.0).map_err(fail)?;
            }
            if let Some(heads) = rotary_heads(&config, name) {
                tensor = unpermute_rotary(&tensor, heads).map_err(fail)?;
            }
            let tensor = tensor
                .to_dtype(dtype)
                .and_then(|tensor| tensor.to_device(device))
                .map_err(fail)?;
            target.tensors.insert(hf, tensor);
        }
        let Target {
            tensors, mut kept, ..
        } = target;
        let vb = VarBuilder::from_tensors(tensors, dtype, device);
        let mut model = Model::load(vb, &config).map_err(|error| {
            self.weights_error(format!(
                "{} tensors do not fit the metadata: {error}",
                config.arch
            ))
        })?;
        for (i, layer) in model.layers.iter_mut().enumerate() {
            for (name, linear) in Model::linears_mut(&mut layer.mixer, &mut layer.mlp) {
                if let Some(weight) = kept.remove(&format!("model.layers.{i}.{name}.weight")) {
                    linear.weight = weight;
                }
            }
        }
        model.quantized_head = head_blocks.map(|blocks| Linear {
            weight: Weight::Quantized(Arc::new(blocks)),
            bias: None,
            lora: None,
        });
        // Every stand-in must have been replaced: one left would multiply by zeros.
        if let Some(name) = kept.keys().next() {
            return Err(self.weights_error(format!(
                "tensor {name} was kept quantized but no projection of the model took it"
            )));
        }
        Ok(model)
    }
}

/// What a model loaded with [`Blocks::Keep`] holds as a GGUF file's blocks ([`Gguf::kept_blocks`]),
/// for a memory plan: the projections held as blocks instead of dense tensors, and the output head's
/// blocks held beside its dense tensor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeptBlocks {
    /// Elements of the projections kept as blocks (a fused `attn_qkv` split by rows counts whole).
    pub projections: u64,
    /// Their blocks' bytes.
    pub projection_bytes: u64,
    /// The largest projection LoRA trains over, in elements: what a training pass expands to f32 for
    /// one product at a time (`kernels/blocks.rs`).
    pub largest: u64,
    /// The output head's (or the tied embeddings') blocks, kept for the sampler's logits beside the
    /// dense tensor the embeddings and the training head use; 0 when not kept.
    pub head_bytes: u64,
}

/// The tensor the output head multiplies by: the embeddings when tied.
fn head_name(config: &ModelConfig) -> &'static str {
    match config.tie_word_embeddings {
        true => "token_embd.weight",
        false => "output.weight",
    }
}

/// What [`Gguf::model`] gathers for `Model::load`: tensors by Hugging Face name, in the model's type on
/// its device, and the weights kept as the file's blocks until the model takes them.
struct Target<'a> {
    dtype: DType,
    device: &'a Device,
    tensors: HashMap<String, Tensor>,
    kept: HashMap<String, Weight>,
}

impl Target<'_> {
    /// Keeps `weight` (blocks) as `name`; the layer loads a broadcast zero of its shape in its place,
    /// which holds no memory and is swapped for the blocks after.
    fn keep(&mut self, name: String, weight: Weight) -> candle_core::Result<()> {
        let stand_in =
            Tensor::zeros((), self.dtype, self.device)?.broadcast_as(weight.dims().to_vec())?;
        self.tensors.insert(name.clone(), stand_in);
        self.kept.insert(name, weight);
        Ok(())
    }

    /// A `blk.N.ffn_*_exps` tensor (`[experts, out, in]` weights or `[experts, out]` biases) as each
    /// expert's projections (`model.layers.N.mlp.experts.E.gate_proj.weight`, …), read one expert at a
    /// time: dequantized, or with `keep` (an MXFP4 tensor) its matrices kept as their blocks.
    fn experts<R: std::io::Read + std::io::Seek>(
        &mut self,
        info: &TensorInfo,
        (layer, stack, kind): (usize, ExpertStack, &str),
        reader: &mut R,
        data_offset: u64,
        keep: bool,
    ) -> candle_core::Result<()> {
        let (count, slice) = info.expert_shape()?;
        for e in 0..count {
            let prefix = format!("model.layers.{layer}.mlp.experts.{e}");
            if keep && kind == "weight" && slice.len() == 2 {
                let bytes = info.expert_bytes(reader, data_offset, e)?;
                let row_bytes = bytes.len() / slice[0];
                for (projection, rows) in stack.parts(slice[0]) {
                    let part = bytes[rows.start * row_bytes..rows.end * row_bytes].to_vec();
                    let matrix = Mxfp4Matrix::new(rows.len(), slice[1], part)?;
                    let name = format!("{prefix}.{projection}.weight");
                    self.keep(name, Weight::Mxfp4(Arc::new(matrix)))?;
                }
                continue;
            }
            let expert = info
                .expert(reader, data_offset, e)?
                .to_dtype(self.dtype)?
                .to_device(self.device)?;
            for (projection, rows) in stack.parts(expert.dim(0)?) {
                let part = expert.narrow(0, rows.start, rows.len())?.contiguous()?;
                self.tensors
                    .insert(format!("{prefix}.{projection}.{kind}"), part);
            }
        }
        Ok(())
    }
}

/// A stack of a mixture's expert tensors in a GGUF file (`blk.N.ffn_{gate,up,down,gate_up}_exps`,
/// `[experts, out, in]` weights and `[experts, out]` biases).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExpertStack {
    Gate,
    Up,
    Down,
    /// The converter's `--fuse-gate-up-exps`: each expert's gate rows, then its up rows.
    GateUp,
}

impl ExpertStack {
    /// The projections the model holds (`gate_proj`, `up_proj`, `down_proj`) in one expert's slice of
    /// `rows` outputs, by their rows: a fused slice splits in half.
    fn parts(self, rows: usize) -> Vec<(&'static str, Range<usize>)> {
        match self {
            ExpertStack::Gate => vec![("gate_proj", 0..rows)],
            ExpertStack::Up => vec![("up_proj", 0..rows)],
            ExpertStack::Down => vec![("down_proj", 0..rows)],
            ExpertStack::GateUp => vec![("gate_proj", 0..rows / 2), ("up_proj", rows / 2..rows)],
        }
    }
}

/// The layer, stack and kind (`weight` or `bias`) of a GGUF tensor that holds every expert's matrices
/// or biases of a layer, or `None` for any other tensor.
fn expert_tensor(name: &str) -> Option<(usize, ExpertStack, &str)> {
    let (layer, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let stack = match module {
        "ffn_gate_exps" => ExpertStack::Gate,
        "ffn_up_exps" => ExpertStack::Up,
        "ffn_down_exps" => ExpertStack::Down,
        "ffn_gate_up_exps" => ExpertStack::GateUp,
        _ => return None,
    };
    matches!(kind, "weight" | "bias").then_some((layer.parse().ok()?, stack, kind))
}

/// The layer of a GGUF tensor `blk.N.…`, or `None` for a tensor outside the layers.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split_once('.')?.0.parse().ok()
}

/// Whether [`Blocks::Keep`] keeps the tensor `name` as it is: a layer's projection matrix in a quantized
/// type.
fn keeps(name: &str, info: &TensorInfo) -> bool {
    let module = name
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(_, rest)| rest.strip_suffix(".weight"));
    module.is_some_and(|module| PROJECTIONS.contains(&module)) && keeps_type(info)
}

/// Whether the tensor is a matrix of quantized blocks multiplied with vector instructions: Q4_0, Q4_1,
/// Q5_0, Q5_1 and Q8_0 by `kernels::quant`, the k-quants by candle. Other types are dequantized at
/// load.
fn keeps_type(info: &TensorInfo) -> bool {
    info.shape.rank() == 2
        && matches!(
            info.kind,
            TensorType::Candle(
                GgmlDType::Q4_0
                    | GgmlDType::Q4_1
                    | GgmlDType::Q5_0
                    | GgmlDType::Q5_1
                    | GgmlDType::Q8_0
                    | GgmlDType::Q2K
                    | GgmlDType::Q3K
                    | GgmlDType::Q4K
                    | GgmlDType::Q5K
                    | GgmlDType::Q6K
            )
        )
}

/// [`files::load_model`](super::files::load_model) for a GGUF file: every tensor dequantized.
pub fn load_model(path: &Path, dtype: DType, device: &Device) -> Result<Model, LoadError> {
    Gguf::open(path)?.model(dtype, device, Blocks::Dequantize)
}

/// [`load_model`], the layers' projections kept as the file's quantized blocks ([`Blocks::Keep`]).
pub fn load_quantized(path: &Path, dtype: DType, device: &Device) -> Result<Model, LoadError> {
    Gguf::open(path)?.model(dtype, device, Blocks::Keep)
}

/// [`files::load_tokenizer`](super::files::load_tokenizer) for a GGUF file.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, LoadError> {
    Gguf::open(path)?.tokenizer()
}

/// [`files::load_template`](super::files::load_template) for a GGUF file.
pub fn load_template(path: &Path) -> Result<ChatTemplate, LoadError> {
    Gguf::open(path)?.template()
}
