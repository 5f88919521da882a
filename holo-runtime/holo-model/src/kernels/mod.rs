//! Our own CPU kernels, where candle's are missing a backward or are slower at the shapes this project
//! runs: what they share (`kernel`: the operations' types, reading storages, splitting work over
//! threads), the fused output head (`head`), rotary embeddings (`rope`) and softmax (`softmax`) with
//! their backward, matrix products (`matrix`, `product`) and decoding's few-rows products
//! (`skinny`), the differentiable product with a frozen matrix in a GGUF file's quantized blocks
//! (`blocks`, QLoRA's base), sampling's few-rows products with Q8_0 blocks (`quant`), products with MXFP4
//! blocks as a GGUF file keeps experts (`mxfp4`), batch-invariant
//! attention (`invariant`), and prefill's attention in blocks of queries and tiles of keys (`flash`).
//! Nothing here knows the decoder: the model calls them, never the other way.

pub(crate) mod blocks;
pub(crate) mod delta;
pub(crate) mod flash;
pub mod head;
pub(crate) mod invariant;
pub(crate) mod kernel;
pub(crate) mod matrix;
pub mod mxfp4;
pub(crate) mod product;
pub(crate) mod quant;
pub(crate) mod rope;
pub(crate) mod skinny;
pub(crate) mod softmax;
