//! MXFP4 weights: blocks of 32 values, each a 4-bit E2M1 code times the block's power of two (an E8M0
//! byte biased by 127). Two layouts of the same numbers are read:
//! - OpenAI's, as it ships gpt-oss's experts (`quantization_config.quant_method = "mxfp4"`):
//!   `{name}_blocks` `[.., rows, G, 16]` bytes each holding two consecutive values (low nibble first),
//!   and `{name}_scales` `[.., rows, G]`. Dequantized at load one expert at a time into `{name}.{e}`,
//!   value for value as transformers' `convert_moe_packed_tensors` does (the products of a 4-bit value
//!   and a power of two are exact), then transposed as it transposes them: `gate_up_proj[e]`
//!   `[hidden, 2·inner]`, `down_proj[e]` `[inner, hidden]`.
//! - ggml's (`block_mxfp4`, GGUF type 39), as llama.cpp's converter repacks OpenAI's: 17 bytes a block,
//!   the scale byte first, then 16 bytes whose low nibbles are values 0–15 and high nibbles values
//!   16–31 ([`dequantize_ggml`]). ggml multiplies its doubled codes `{0, 1, 2, 3, 4, 6, 8, 12, …}` by
//!   half the scale (`ggml_e8m0_to_fp32_half`): the same products.

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use crate::kernels::kernel::Result;

/// The sixteen values of a 4-bit E2M1 code (`FP4_VALUES`).
const VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Values in one block.
pub const BLOCK_VALUES: usize = 32;
/// Bytes of one of ggml's blocks: the scale, then the codes.
pub const BLOCK_BYTES: usize = 1 + BLOCK_VALUES / 2;

/// The block's power of two, in f64: 2^-127 is below f32's normal range, and every product of it with a
/// code is still exact in f32 (a subnormal at worst).
fn power(scale: u8) -> f64 {
    2f64.powi(scale as i32 - 127)
}

/// ggml's MXFP4 blocks (a whole number of [`BLOCK_BYTES`]) as f32 values, in order. Code 8 reads as
/// -0, as transformers reads it (ggml's integer codes make it +0: the same value in every product).
pub fn dequantize_ggml(blocks: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(blocks.len() / BLOCK_BYTES * BLOCK_VALUES);
    for block in blocks.chunks_exact(BLOCK_BYTES) {
        let (power, codes) = (power(block[0]), &block[1..]);
        let value = |code: u8| (VALUES[code as usize] as f64 * power) as f32;
        out.extend(codes.iter().map(|&byte| value(byte & 0x0F)));
        out.extend(codes.iter().map(|&byte| value(byte >> 4)));
    }
    out
}

/// `tensors` with every `{name}_blocks` `[E, ..]` and `{name}_scales` pair replaced by one tensor per
/// expert, `{name}.{e}` in `dtype`, as the loader reads gpt-oss's unquantized stacks
/// (`crate::model::read_by_expert`): one expert's values are in f32 at a time, not a whole stack's
/// twice over (its values and their transpose). A blocks tensor without its scales (or the reverse) is
/// an error naming it.
pub fn dequantize_all(
    mut tensors: HashMap<String, Tensor>,
    dtype: DType,
) -> Result<HashMap<String, Tensor>> {
    let names: Vec<String> = tensors
        .keys()
        .filter_map(|name| name.strip_suffix("_blocks").map(str::to_string))
        .collect();
    for name in names {
        let blocks = tensors.remove(&format!("{name}_blocks")).expect("listed");
        let Some(scales) = tensors.remove(&format!("{name}_scales")) else {
            candle_core::bail!("MXFP4 tensor {name}_blocks has no {name}_scales");
        };
        for e in 0..blocks.dim(0)? {
            let expert = |tensor: &Tensor| tensor.narrow(0, e, 1);
            let values = dequantize(&expert(&blocks)?, &expert(&scales)?)?;
            tensors.insert(format!("{name}.{e}"), values.squeeze(0)?.to_dtype(dtype)?);
        }
    }
    if let Some(scales) = tensors.keys().find(|name| name.ends_with("_scales")) {
        candle_core::bail!("MXFP4 tensor {scales} has no blocks beside it");
    }
    Ok(tensors)
}

/// One pair in f32: `blocks` `[E, rows, G, B]` and `scales` `[E, rows, G]` (u8) to `[E, G·B·2, rows]`.
pub fn dequantize(blocks: &Tensor, scales: &Tensor) -> Result<Tensor> {
    if blocks.dtype() != DType::U8 || scales.dtype() != DType::U8 {
        candle_core::bail!(
            "MXFP4 blocks and scales are bytes, found {:?} and {:?}",
            blocks.dtype(),
            scales.dtype()
        );
    }
    let dims = blocks.dims().to_vec();
    if dims.len() != 4 || scales.dims() != &dims[..3] {
        candle_core::bail!(
            "MXFP4 blocks {:?} do not match scales {:?} (expected [E, rows, G, B] and [E, rows, G])",
            blocks.dims(),
            scales.dims()
        );
    }
    let (experts, rows, groups, bytes) = (dims[0], dims[1], dims[2], dims[3]);
    let device = blocks.device().clone();
    let blocks = blocks.flatten_all()?.to_vec1::<u8>()?;
    let scales = scales.flatten_all()?.to_vec1::<u8>()?;
    let mut out = Vec::with_capacity(blocks.len() * 2);
    for (block, &scale) in blocks.chunks_exact(bytes).zip(&scales) {
        let power = power(scale);
        for &byte in block {
            out.push((VALUES[(byte & 0x0F) as usize] as f64 * power) as f32);
            out.push((VALUES[(byte >> 4) as usize] as f64 * power) as f32);
        }
    }
    let columns = groups * bytes * 2;
    Tensor::from_vec(out, (experts, rows, columns), &device)?
        .transpose(1, 2)?
        .contiguous()
}
