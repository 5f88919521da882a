//! Rows of a file's attention tensors as llama.cpp's converter lays them out, put back in Hugging Face's:
//! the q / k rows of the families it writes as `llama` or `smollm3` permuted for its rotary layout, and q,
//! k and v fused into one `attn_qkv` (its `--fuse-qkv`, for every family whose graph takes one), dense
//! tensors and matrices of quantized blocks alike.

use std::borrow::Cow;
use std::ops::Range;

use candle_core::quantized::{QStorage, QTensor};
use candle_core::{Device, Tensor};

use crate::config::{Arch, ModelConfig};

/// Whether llama.cpp's converter permutes the q / k rows of an `arch` model (`LlamaModel.permute`): every
/// family it writes as `llama` (Mistral's and Ministral's included) or as `smollm3`.
fn permuted(arch: Arch) -> bool {
    matches!(
        arch,
        Arch::Llama | Arch::Mistral | Arch::Ministral | Arch::SmolLm3
    )
}

/// The layer and kind (`weight` or `bias`) of a fused `blk.N.attn_qkv` of an `arch` model other than
/// Phi-3 (whose `qkv_proj` it is, whole), or `None` for any other tensor.
pub(super) fn fused_qkv(arch: Arch, name: &str) -> Option<(usize, &str)> {
    if arch == Arch::Phi3 {
        return None;
    }
    let (layer, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    let kind = rest.strip_prefix("attn_qkv.")?;
    matches!(kind, "weight" | "bias").then_some((layer.parse().ok()?, kind))
}

/// A fused `attn_qkv`'s parts, as the converter concatenates them: the projection each is, its rows, and
/// the heads whose rows were permuted in it ([`rotary_heads`]'s), if any. A gated attention's `q_proj`
/// holds each head's gate beside its queries.
pub(super) fn qkv_parts(config: &ModelConfig) -> [(&'static str, Range<usize>, Option<usize>); 3] {
    let gates = if config.variant.attention_gate { 2 } else { 1 };
    let q = config.num_attention_heads * config.head_dim * gates;
    let kv = config.num_key_value_heads * config.head_dim;
    let rotary = |heads: usize| permuted(config.arch).then_some(heads);
    [
        ("q_proj", 0..q, rotary(config.num_attention_heads)),
        ("k_proj", q..q + kv, rotary(config.num_key_value_heads)),
        ("v_proj", q + kv..q + 2 * kv, None),
    ]
}

/// The rows `rows` of a matrix of blocks: a row's blocks lie along its inputs, so rows are whole runs of
/// bytes.
pub(super) fn block_rows(blocks: &QTensor, rows: Range<usize>) -> candle_core::Result<QTensor> {
    let (count, columns) = blocks.shape().dims2()?;
    if rows.end > count {
        candle_core::bail!("rows {rows:?} of a matrix of {count} rows");
    }
    let bytes = blocks.data()?;
    let row_bytes = bytes.len() / count;
    let part = bytes[rows.start * row_bytes..rows.end * row_bytes].to_vec();
    let storage = QStorage::from_data(Cow::Owned(part), &Device::Cpu, blocks.dtype())?;
    QTensor::new(storage, (rows.len(), columns))
}

/// Undoes llama.cpp's q / k row permutation (transformers' `reverse_permute_weights`): within each
/// head, rows `[0, 2, 4, …, 1, 3, 5, …]` as llama.cpp stores them go back to Hugging Face's
/// `[0, 1, 2, …]` half-rotation order. Works on weights `[rows, in]` and biases `[rows]`.
pub(super) fn unpermute_rotary(tensor: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let dims = tensor.dims().to_vec();
    let rows = dims[0];
    if !rows.is_multiple_of(2 * heads) {
        candle_core::bail!("{rows} rows do not split into {heads} heads of rotary pairs");
    }
    let half = rows / heads / 2;
    let mut shape = vec![heads, half, 2];
    shape.extend_from_slice(&dims[1..]);
    tensor
        .reshape(shape)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// The heads whose q / k rows llama.cpp permuted in the tensor `name` (the `attn_q` and `attn_k` of a
/// model written as `llama`, Mistral's and Ministral's included, or as `smollm3`), or `None`.
pub(super) fn rotary_heads(config: &ModelConfig, name: &str) -> Option<usize> {
    if !permuted(config.arch) {
        None
    } else if name.contains(".attn_q.") {
        Some(config.num_attention_heads)
    } else if name.contains(".attn_k.") {
        Some(config.num_key_value_heads)
    } else {
        None
    }
}

/// [`unpermute_rotary`] on a matrix of blocks: a row's blocks lie along its inputs, so each row's bytes
/// move whole.
pub(super) fn unpermute_rotary_blocks(
    blocks: &QTensor,
    heads: usize,
) -> candle_core::Result<QTensor> {
    let (rows, _) = blocks.shape().dims2()?;
    if !rows.is_multiple_of(2 * heads) {
        candle_core::bail!("{rows} rows do not split into {heads} heads of rotary pairs");
    }
    let half = rows / heads / 2;
    let bytes = blocks.data()?;
    let row_bytes = bytes.len() / rows;
    let mut out = vec![0u8; bytes.len()];
    for head in 0..heads {
        for pair in 0..2 {
            for i in 0..half {
                // Row `(head, pair, i)` in Hugging Face's order is row `(head, i, pair)` in the file's.
                let to = head * 2 * half + pair * half + i;
                let from = head * 2 * half + i * 2 + pair;
                out[to * row_bytes..(to + 1) * row_bytes]
                    .copy_from_slice(&bytes[from * row_bytes..(from + 1) * row_bytes]);
            }
        }
    }
    let storage = QStorage::from_data(Cow::Owned(out), &Device::Cpu, blocks.dtype())?;
    QTensor::new(storage, blocks.shape().clone())
}
