//! Products with a matrix kept as ggml's MXFP4 blocks (a GGUF file's experts), on the CPU: `y = x · wᵀ`
//! for f32 activations `x` `[M, K]` and `w` `[N, K]` stored as 17 bytes per 32 weights, so that
//! decoding reads 0.53 bytes a weight instead of f32's 4.
//!
//! Each block is expanded in registers to its exact values (a code of `{0, ±0.5, …, ±6}` times a power
//! of two: the dequantized matrix's very numbers) and multiplied into every row of `x`; the sums are f32,
//! in another order than a dense product's, so the two agree to rounding, not to the bit. AVX2 (with a
//! byte shuffle for the codes) is picked at run time, a plain loop elsewhere. Threads share the weight
//! rows out, as the skinny kernels do. Prefill's many rows go [`MAX_ROWS`] at a time: expanding the
//! whole matrix to f32 for each call and multiplying with candle was 2.5–3× slower on a random gpt-oss
//! (width 1,024, 16 experts, 8 sequences of 16 tokens).
//!
//! No backward: a model holding such a matrix only samples.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use super::kernel::Result;
use crate::mxfp4::{dequantize_ggml, BLOCK_BYTES, BLOCK_VALUES};

/// The most rows of `x` one pass over the blocks multiplies (the sums stay in as many vector registers'
/// worth of memory); more rows take several passes.
pub const MAX_ROWS: usize = 16;

/// Weight rows one task computes.
const ROWS_PER_TASK: usize = 32;

/// Below this many weights a product runs on the calling thread.
const MIN_PARALLEL_WEIGHTS: usize = 1 << 16;

/// A matrix `[rows, columns]` of ggml MXFP4 blocks, row after row (`columns` a multiple of 32).
#[derive(Debug)]
pub struct Mxfp4Matrix {
    rows: usize,
    columns: usize,
    /// `[rows, columns]`, as [`Weight::dims`](crate::model::Weight::dims) lends it.
    dims: [usize; 2],
    blocks: Vec<u8>,
}

impl Mxfp4Matrix {
    pub fn new(rows: usize, columns: usize, blocks: Vec<u8>) -> Result<Self> {
        if !columns.is_multiple_of(BLOCK_VALUES)
            || blocks.len() != rows * columns / BLOCK_VALUES * BLOCK_BYTES
        {
            candle_core::bail!(
                "{} bytes of MXFP4 blocks are not a [{rows}, {columns}] matrix",
                blocks.len()
            );
        }
        Ok(Mxfp4Matrix {
            rows,
            columns,
            dims: [rows, columns],
            blocks,
        })
    }

    /// `[rows, columns]`.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    pub fn bytes(&self) -> usize {
        self.blocks.len()
    }

    /// The matrix expanded to f32 on the CPU.
    pub fn dequantize(&self) -> Result<Tensor> {
        Tensor::from_vec(
            dequantize_ggml(&self.blocks),
            (self.rows, self.columns),
            &candle_core::Device::Cpu,
        )
    }

    /// `x` `[M, K]` on the CPU times this matrix transposed: `[M, N]`, in `x`'s type (computed in f32).
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let rows = x.dim(0)?;
        if rows == 0 {
            return Tensor::zeros((0, self.rows), dtype, x.device());
        }
        let parts = (0..rows)
            .step_by(MAX_ROWS)
            .map(|start| {
                x.narrow(0, start, MAX_ROWS.min(rows - start))?
                    .apply_op1_no_bwd(self)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, 0)?.to_dtype(dtype)
    }
}

/// ggml's E8M0 scale halved (`ggml_e8m0_to_fp32_half`): the codes below are doubled.
fn half_scale(scale: u8) -> f32 {
    match scale {
        0 | 1 => f32::from_bits(0x0020_0000 << scale),
        _ => f32::from_bits((scale as u32 - 1) << 23),
    }
}

/// The E2M1 codes doubled (`kvalues_mxfp4`): whole numbers, so a byte shuffle looks them up.
const DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Row `n` of the matrix dotted with each of the `m` rows of `x`, into `out[r · N + n]`: the plain loop.
fn row_plain(row: &[u8], x: &[f32], m: usize, k: usize, sums: &mut [f32]) {
    let mut values = [0f32; BLOCK_VALUES];
    for (b, block) in row.chunks_exact(BLOCK_BYTES).enumerate() {
        let scale = half_scale(block[0]);
        for (i, &byte) in block[1..].iter().enumerate() {
            values[i] = DOUBLED[(byte & 0x0F) as usize] as f32 * scale;
            values[i + 16] = DOUBLED[(byte >> 4) as usize] as f32 * scale;
        }
        for (r, sum) in sums.iter_mut().enumerate().take(m) {
            let x = &x[r * k + b * BLOCK_VALUES..][..BLOCK_VALUES];
            *sum += values.iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
        }
    }
}

/// [`row_plain`] with AVX2: each block's 32 codes looked up by one shuffle per half, widened to f32 and
/// scaled (exactly: small whole numbers times a power of two), then multiplied into eight-lane sums.
///
/// # Safety
/// The CPU has AVX2 and FMA; `x` holds `m` rows of `k`; `row` is `k / 32` blocks; `m <= MAX_ROWS`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2(row: &[u8], x: &[f32], m: usize, k: usize, sums: &mut [f32]) {
    use std::arch::x86_64::*;

    let table = _mm_loadu_si128(DOUBLED.as_ptr().cast());
    let low = _mm_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); MAX_ROWS];
    for (b, block) in row.chunks_exact(BLOCK_BYTES).enumerate() {
        let scale = _mm256_set1_ps(half_scale(block[0]));
        let bytes = _mm_loadu_si128(block.as_ptr().add(1).cast());
        // Values 0–15 from the low nibbles, 16–31 from the high ones.
        let first = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low));
        let second = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        let widen =
            |codes: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), scale);
        let weights = [
            widen(first),
            widen(_mm_srli_si128(first, 8)),
            widen(second),
            widen(_mm_srli_si128(second, 8)),
        ];
        for (r, acc) in acc.iter_mut().enumerate().take(m) {
            let x = x.as_ptr().add(r * k + b * BLOCK_VALUES);
            for (part, weights) in weights.iter().enumerate() {
                *acc = _mm256_fmadd_ps(*weights, _mm256_loadu_ps(x.add(8 * part)), *acc);
            }
        }
    }
    for (sum, acc) in sums.iter_mut().zip(&acc).take(m) {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), *acc);
        *sum += lanes.iter().sum::<f32>();
    }
}

/// Whether the AVX2 kernel runs here.
fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The output pointer shared by the tasks, each of which writes its own columns.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint columns of the output, which outlives them.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The `i`-th output (a method, so that closures capture the whole `Out`, which is `Sync`).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

impl Mxfp4Matrix {
    /// `out` `[m, N]` = `x` `[m, K]` times the matrix transposed, by `plain` or AVX2.
    fn product(&self, x: &[f32], m: usize, plain: bool, out: &mut [f32]) {
        let (n, k) = (self.rows, self.columns);
        assert!(m <= MAX_ROWS && x.len() == m * k && out.len() == m * n);
        let row_bytes = k / BLOCK_VALUES * BLOCK_BYTES;
        let use_avx2 = !plain && avx2();
        let out = Out(out.as_mut_ptr());
        let task = |task: usize| {
            for row in task * ROWS_PER_TASK..((task + 1) * ROWS_PER_TASK).min(n) {
                let blocks = &self.blocks[row * row_bytes..][..row_bytes];
                let mut sums = [0f32; MAX_ROWS];
                // `use_avx2` is false but on x86-64 (`avx2`), where the kernel exists.
                if use_avx2 {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2 and FMA were detected; the lengths are checked above.
                    unsafe {
                        row_avx2(blocks, x, m, k, &mut sums)
                    };
                } else {
                    row_plain(blocks, x, m, k, &mut sums);
                }
                for (r, sum) in sums.iter().enumerate().take(m) {
                    // SAFETY: `row` is this task's alone and `r · n + row` lies within `out`.
                    unsafe { *out.at(r * n + row) = *sum };
                }
            }
        };
        let tasks = n.div_ceil(ROWS_PER_TASK);
        if n * k < MIN_PARALLEL_WEIGHTS {
            (0..tasks).for_each(task);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(tasks, |tasks| tasks.for_each(task));
        }
    }
}

impl CustomOp1 for Mxfp4Matrix {
    fn name(&self) -> &'static str {
        "mxfp4-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (m, k) = layout.shape().dims2()?;
        let (CpuStorage::F32(x), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("an MXFP4 product needs contiguous f32 activations");
        };
        if k != self.columns || m > MAX_ROWS {
            candle_core::bail!(
                "an MXFP4 product of [{m}, {k}] activations with a [{}, {}] matrix (at most {MAX_ROWS} rows)",
                self.rows,
                self.columns
            );
        }
        let mut out = vec![0f32; m * self.rows];
        self.product(&x[start..end], m, false, &mut out);
        Ok((CpuStorage::F32(out), Shape::from((m, self.rows))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Random blocks whose scales span ggml's subnormal halves (0, 1) to large powers.
    fn matrix(rows: usize, columns: usize, seed: u64) -> Mxfp4Matrix {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut blocks = Vec::new();
        for block in 0..rows * columns / BLOCK_VALUES {
            blocks.push(match block % 7 {
                0 => (block % 2) as u8,
                _ => rng.random_range(118..136),
            });
            blocks.extend((0..16).map(|_| rng.random::<u8>()));
        }
        Mxfp4Matrix::new(rows, columns, blocks).unwrap()
    }

    #[test]
    fn mxfp4_products_are_the_dequantized_matrixs_to_rounding() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for (rows, columns) in [(40, 64), (300, 256)] {
            let packed = matrix(rows, columns, rows as u64);
            let dense = packed.dequantize().unwrap();
            for m in [1, 3, MAX_ROWS, 2 * MAX_ROWS + 4] {
                let x: Vec<f32> = (0..m * columns)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let x = Tensor::from_vec(x, (m, columns), &Device::Cpu).unwrap();
                let expected: Vec<Vec<f32>> =
                    x.matmul(&dense.t().unwrap()).unwrap().to_vec2().unwrap();
                // Each sum's rounding is bounded by the sum of its terms' magnitudes.
                let magnitudes: Vec<f32> = x
                    .abs()
                    .unwrap()
                    .matmul(&dense.abs().unwrap().t().unwrap())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let mut results = vec![packed.matmul(&x).unwrap().to_vec2::<f32>().unwrap()];
                if m <= MAX_ROWS {
                    let mut plain = vec![0f32; m * rows];
                    let flat: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
                    packed.product(&flat, m, true, &mut plain);
                    results.push(plain.chunks(rows).map(<[f32]>::to_vec).collect());
                }
                for got in results {
                    for ((g, e), bound) in got
                        .iter()
                        .flatten()
                        .zip(expected.iter().flatten())
                        .zip(&magnitudes)
                    {
                        assert!(
                            (g - e).abs() <= 1e-5 * bound,
                            "[{rows}, {columns}], m = {m}: {g} against {e} (terms {bound})"
                        );
                    }
                }
            }
            // bf16 activations come back bf16.
            let x = Tensor::ones((2, columns), DType::BF16, &Device::Cpu).unwrap();
            assert_eq!(packed.matmul(&x).unwrap().dtype(), DType::BF16);
        }
    }

    #[test]
    fn half_scales_are_ggmls() {
        // ggml_e8m0_to_fp32_half: 2^(e − 128), subnormal for e < 2.
        for e in 0..=254u8 {
            assert_eq!(half_scale(e) as f64, 2f64.powi(e as i32 - 128), "{e}");
        }
    }
}
