//! Qwen3.5 as llama.cpp's converter writes it (`general.architecture` `qwen35`, `Qwen3_5TextModel` in its
//! `conversion/qwen.py`), put back as transformers' `qwen3_5_text` holds it; and its mixture of
//! experts (`qwen35moe`, `Qwen3_5MoeTextModel`) as `qwen3_5_moe_text` holds it, under `qwen35moe.*`.
//!
//! The linear-attention sizes are `qwen35.ssm.*`: `conv_kernel` (`linear_conv_kernel_dim`), `state_size`
//! (`linear_key_head_dim`), `group_count` (`linear_num_key_heads`), `time_step_rank`
//! (`linear_num_value_heads`) and `inner_size` (value heads × `linear_value_head_dim`); which layers are
//! linear is `attention.recurrent_layers` (one flag per block) or, without it, every layer but each
//! `full_attention_interval`-th, as llama.cpp reads them; the `nextn_predict_layers`
//! multi-token-prediction layers after the model's are counted out of `block_count` and their tensors
//! left unread. The rotated part of a head is `rope.dimension_count`; `rope.dimension_sections`
//! (interleaved multimodal RoPE's split of the frequencies among a position's time, height and width)
//! changes nothing for text, whose three positions are the same, and is not read.
//!
//! The tensors of a linear-attention layer are renamed (`attn_qkv` is `in_proj_qkv`, `attn_gate`
//! `in_proj_z`, `ssm_beta` `in_proj_b`, `ssm_alpha` `in_proj_a`, `ssm_dt.bias` `dt_bias`, `ssm_norm`
//! `norm`, `ssm_out` `out_proj`) and transformed, which is undone here:
//! - `ssm_a` is `-exp(A_log)`: `A_log` is `ln(-ssm_a)` (to f32 rounding, not bit for bit);
//! - `ssm_conv1d` is the depthwise kernel `[channels, 1, kernel]` squeezed to `[channels, kernel]`;
//! - where there are more value heads than key heads, every value head's rows (or columns of
//!   `ssm_out`, entries of `ssm_a` and `ssm_dt`) are moved from transformers' grouped order (the value
//!   heads of key head 0, then those of key head 1, …) to the tiled order llama.cpp's broadcast reads
//!   (the first value head of every key head, then the second, …): moved back.
//!
//! The other norms are stored as `1 + w`, as Gemma's are ([`crate::config::Variant::norm_offset`]), all
//! but `ssm_norm`, which transformers applies as it is; the gated attention's `attn_q` holds each head's
//! queries and gate as `q_proj` does.
//!
//! The mixture is on every layer: `expert_count` experts of `expert_feed_forward_length`, the
//! `expert_used_count` best per token, weighted by the router's softmax renormalised over them
//! (llama.cpp's graph always renormalises, as `Qwen3_5MoeTopKRouter` does), and a shared expert of
//! `expert_shared_feed_forward_length` scaled by the sigmoid of its gate. Its tensors are Qwen3-MoE's
//! (`ffn_gate_inp` the router, `ffn_{gate,up,down}_exps` the experts stacked in expert order, or gate
//! and up fused by `--fuse-gate-up-exps` into `ffn_gate_up_exps`) and the shared expert's, renamed
//! only: `ffn_{gate,up,down}_shexp` (`shared_expert.*_proj`) and `ffn_gate_inp_shexp`
//! (`shared_expert_gate`, its one row). A file whose keys route otherwise (`expert_weights_norm` false,
//! a scale other than 1, a gating function other than the softmax, more than one shared expert) is
//! refused by key: neither transformers nor llama.cpp's graph computes that model.

use candle_core::quantized::gguf_file::Value;
use candle_core::Tensor;

use super::Gguf;
use crate::config::{Experts, LinearAttention, ModelConfig};
use crate::error::LoadError;

/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX`, the value of `expert_gating_func` for a router
/// whose weights are the softmax of its logits.
const GATING_SOFTMAX: u64 = 1;

impl Gguf {
    /// The mixture of a `qwen35moe` file (see the module's documentation), from `<name>.expert_*`.
    pub(super) fn shared_experts(&self, name: &str) -> Result<Experts, LoadError> {
        let key = |suffix: &str| format!("{name}.{suffix}");
        let size = |suffix: &str| -> Result<usize, LoadError> {
            match self.required_usize(&key(suffix))? {
                0 => {
                    Err(self.config_error(format!("metadata `{}` must be at least 1", key(suffix))))
                }
                size => Ok(size),
            }
        };
        let count = size("expert_count")?;
        let per_token = size("expert_used_count")?;
        if per_token > count {
            return Err(self.config_error(format!(
                "`{}` ({per_token}) is more than `{}` ({count})",
                key("expert_used_count"),
                key("expert_count")
            )));
        }
        let refused = |suffix: &str, found: String, why: &str| {
            self.config_error(format!(
                "metadata `{}` is {found}: {why}, as transformers' `qwen3_5_moe` and llama.cpp's \
                 graph compute it",
                key(suffix)
            ))
        };
        if self.bool_key(&key("expert_weights_norm"))? == Some(false) {
            return Err(refused(
                "expert_weights_norm",
                "false".into(),
                "Qwen3.5's router renormalises the chosen experts' weights",
            ));
        }
        if let Some(scale) = self.f64_key(&key("expert_weights_scale"))? {
            if scale != 0.0 && scale != 1.0 {
                return Err(refused(
                    "expert_weights_scale",
                    scale.to_string(),
                    "Qwen3.5's experts' weights are not scaled",
                ));
            }
        }
        if let Some(gating) = self.u64_key(&key("expert_gating_func"))? {
            if gating != GATING_SOFTMAX {
                return Err(refused(
                    "expert_gating_func",
                    gating.to_string(),
                    "Qwen3.5's router weighs its experts by the softmax (1)",
                ));
            }
        }
        if let Some(shared) = self.u64_key(&key("expert_shared_count"))? {
            if shared != 1 {
                return Err(refused(
                    "expert_shared_count",
                    shared.to_string(),
                    "Qwen3.5 has one shared expert",
                ));
            }
        }
        Ok(Experts {
            count,
            per_token,
            intermediate_size: size("expert_feed_forward_length")?,
            normalize: true,
            aux_loss_coef: 0.001,
            aux_loss: false,
            softmax_over_chosen: false,
            clamped: None,
            shared: Some(size("expert_shared_feed_forward_length")?),
        })
    }

    /// The linear-attention sizes from `<name>.ssm.*`.
    pub(super) fn linear_attention(&self, name: &str) -> Result<LinearAttention, LoadError> {
        let size = |suffix: &str| -> Result<usize, LoadError> {
            let key = format!("{name}.ssm.{suffix}");
            match self.required_usize(&key)? {
                0 => Err(self.config_error(format!("metadata `{key}` must be at least 1"))),
                size => Ok(size),
            }
        };
        let key_heads = size("group_count")?;
        let value_heads = size("time_step_rank")?;
        let inner = size("inner_size")?;
        let sizes = LinearAttention {
            key_heads,
            value_heads,
            key_head_dim: size("state_size")?,
            value_head_dim: inner / value_heads,
            conv_kernel: size("conv_kernel")?,
        };
        if !inner.is_multiple_of(value_heads) || !value_heads.is_multiple_of(key_heads) {
            return Err(self.config_error(format!(
                "`{name}.ssm.inner_size` ({inner}) must be a multiple of `{name}.ssm.time_step_rank` \
                 ({value_heads}), itself a multiple of `{name}.ssm.group_count` ({key_heads})"
            )));
        }
        if sizes.conv_kernel < 2 {
            return Err(self.config_error(format!(
                "`{name}.ssm.conv_kernel` must be at least 2, found {}",
                sizes.conv_kernel
            )));
        }
        Ok(sizes)
    }

    /// Which of the model's `count` layers are linear attention: `<name>.attention.recurrent_layers`
    /// (one flag per block of the file's `blocks`, the multi-token-prediction layers after the model's
    /// included), or every layer but each `<name>.full_attention_interval`-th (4 when absent), as
    /// llama.cpp reads them.
    pub(super) fn recurrent_layers(
        &self,
        name: &str,
        blocks: usize,
        count: usize,
    ) -> Result<Vec<bool>, LoadError> {
        let key = format!("{name}.attention.recurrent_layers");
        let linear = match self.value(&key) {
            Some(Value::Array(flags)) => flags
                .iter()
                .map(|flag| match flag {
                    Value::Bool(flag) => Some(*flag),
                    _ => None,
                })
                .collect::<Option<Vec<bool>>>()
                .filter(|flags| flags.len() == blocks)
                .map(|flags| flags[..count].to_vec())
                .ok_or_else(|| {
                    self.config_error(format!(
                        "metadata `{key}` must be {blocks} true or false flags, one per block"
                    ))
                })?,
            Some(_) => {
                return Err(self.config_error(format!(
                    "metadata `{key}` must be {blocks} true or false flags, one per block"
                )))
            }
            None => {
                let key = format!("{name}.full_attention_interval");
                let interval = self.u64_key(&key)?.unwrap_or(4).max(1) as usize;
                (0..count)
                    .map(|layer| (layer + 1) % interval != 0)
                    .collect()
            }
        };
        if linear.iter().all(|&linear| linear) {
            return Err(self.config_error(format!(
                "metadata `{key}` makes every layer linear attention: the cache counts positions by \
                 the attention layers' keys, so at least one full-attention layer is needed"
            )));
        }
        Ok(linear)
    }
}

/// The layer and Hugging Face name (under `model.layers.N.linear_attn.`) of a tensor of a `qwen35`
/// file's linear-attention layer, or `None` for any other tensor (the norms and MLP of such a layer,
/// named as every family's).
pub(super) fn linear_tensor(config: &ModelConfig, name: &str) -> Option<(usize, &'static str)> {
    let (layer, module) = name.strip_prefix("blk.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if !config.layers.get(layer)?.linear {
        return None;
    }
    let hf = match module {
        "attn_qkv.weight" => "in_proj_qkv.weight",
        "attn_gate.weight" => "in_proj_z.weight",
        "ssm_beta.weight" => "in_proj_b.weight",
        "ssm_alpha.weight" => "in_proj_a.weight",
        "ssm_a" => "A_log",
        "ssm_dt.bias" => "dt_bias",
        "ssm_conv1d.weight" => "conv1d.weight",
        "ssm_norm.weight" => "norm.weight",
        "ssm_out.weight" => "out_proj.weight",
        _ => return None,
    };
    Some((layer, hf))
}

/// The tensor `hf` ([`linear_tensor`]'s name) of a linear-attention layer as transformers holds it,
/// from the file's `tensor`: the converter's transformations undone (see the module's documentation).
pub(super) fn restore(
    sizes: &LinearAttention,
    hf: &str,
    tensor: Tensor,
) -> candle_core::Result<Tensor> {
    let key_width = sizes.key_heads * sizes.key_head_dim;
    let value_width = sizes.value_heads * sizes.value_head_dim;
    match hf {
        "in_proj_qkv.weight" | "conv1d.weight" => {
            let rows = tensor.dim(0)?;
            if rows != 2 * key_width + value_width {
                candle_core::bail!(
                    "{rows} rows, but queries, keys and values take {}",
                    2 * key_width + value_width
                );
            }
            let queries_keys = tensor.narrow(0, 0, 2 * key_width)?;
            let values = tensor.narrow(0, 2 * key_width, value_width)?;
            let values = grouped(&values, 0, sizes, sizes.value_head_dim)?;
            let tensor = Tensor::cat(&[queries_keys, values], 0)?;
            match hf {
                "conv1d.weight" => tensor.unsqueeze(1),
                _ => Ok(tensor),
            }
        }
        "in_proj_z.weight" => grouped(&tensor, 0, sizes, sizes.value_head_dim),
        "in_proj_b.weight" | "in_proj_a.weight" | "dt_bias" => grouped(&tensor, 0, sizes, 1),
        "A_log" => grouped(&tensor, 0, sizes, 1)?.neg()?.log(),
        "out_proj.weight" => grouped(&tensor, 1, sizes, sizes.value_head_dim),
        _ => Ok(tensor),
    }
}

/// The value heads along `dim` (each `head_dim` wide) put back from llama.cpp's tiled order (value head
/// `v` of every key head, for `v` = 0, 1, …) into transformers' grouped one (every value head of key
/// head `k`, for `k` = 0, 1, …): `_LinearAttentionVReorderBase._reorder_v_heads` undone.
fn grouped(
    tensor: &Tensor,
    dim: usize,
    sizes: &LinearAttention,
    head_dim: usize,
) -> candle_core::Result<Tensor> {
    let dims = tensor.dims().to_vec();
    let per_key = sizes.value_heads / sizes.key_heads;
    if dims.get(dim) != Some(&(sizes.value_heads * head_dim)) {
        candle_core::bail!(
            "shape {dims:?}: {} value heads of {head_dim} along dimension {dim}",
            sizes.value_heads
        );
    }
    let mut split = dims[..dim].to_vec();
    split.extend([per_key, sizes.key_heads, head_dim]);
    split.extend_from_slice(&dims[dim + 1..]);
    tensor
        .reshape(split)?
        .transpose(dim, dim + 1)?
        .contiguous()?
        .reshape(dims)
}
