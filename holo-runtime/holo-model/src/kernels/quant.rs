//! Products of a few rows of activations with a matrix kept as a GGUF file's Q8_0 blocks, on the CPU:
//! `y = x · wᵀ` for `x` `[M, K]` and `w` `[N, K]` stored as 34 bytes per 32 weights (an f16 scale, then
//! 32 signed bytes). This is decoding from `--quantized` weights: every step multiplies one row per
//! sequence by every block of the model.
//!
//! candle's product (ggml's port) quantizes each row of `x` to Q8_0 and runs one dot product per row of
//! `x` and row of `w`, so a batch of 8 reads every block 8 times; its repacked kernels, which reuse a
//! block across rows, need rows of a multiple of 256 inputs. Here each row of `x` is quantized exactly as
//! ggml does (so the products equal candle's up to the order of the f32 sums), then tiles of weight rows
//! × rows of `x` keep their running sums in vector registers over `K`: each weight block is loaded once
//! per tile and multiplied into every row of it, the weight rows of a tile staying in the L1 cache while
//! every group of rows of `x` passes over them. A block's 32 byte products are summed exactly in 32-bit
//! integers, then scaled by the two blocks' scales into f32 sums, as ggml does.
//!
//! AVX-512 with VNNI (`vpdpbusd`, 4 byte products summed per lane in one instruction, two blocks per
//! register), AVX2 (`vpmaddubsw` with ggml's sign trick, one block per register) or a plain loop is
//! picked at run time; threads share the weight rows out, as the skinny kernels do (`skinny`).
//!
//! No backward: a product over blocks only samples (training expands them, `blocks`).

use std::ops::Range;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use super::kernel::Result;

/// Values per Q8_0 block.
const BLOCK: usize = 32;

/// Bytes per Q8_0 block: the f16 scale, then the 32 values.
const BLOCK_BYTES: usize = 2 + BLOCK;

/// The most rows of `x` these kernels take: decoding's batches. Prefill's many rows keep candle's path.
pub const MAX_ROWS: usize = 32;

/// Weight rows one task computes.
const COLUMNS_PER_TASK: usize = 64;

/// Below this many weights a product runs on the calling thread: splitting it costs more than it saves.
const MIN_PARALLEL_WEIGHTS: usize = 1 << 16;

/// Whether [`matmul`] computes `x · blocksᵀ` for the sampling path: Q8_0 blocks on the CPU, f32 or bf16
/// activations on the CPU, at most [`MAX_ROWS`] of them (after flattening `x` to `[rows, K]`).
pub fn suits(blocks: &QTensor, x: &Tensor) -> bool {
    let rows = x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1);
    blocks.dtype() == GgmlDType::Q8_0
        && blocks.device().is_cpu()
        && x.device().is_cpu()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && rows <= MAX_ROWS
}

/// `x` `[M, K]` (f32 or bf16) times the Q8_0 `blocks` `[N, K]` transposed: `[M, N]` in `x`'s type,
/// computed in f32 from `x` rounded to Q8_0 as ggml rounds it. No backward: sampling only.
pub fn matmul(x: &Tensor, blocks: &QTensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (n, w_k) = blocks.shape().dims2()?;
    if blocks.dtype() != GgmlDType::Q8_0 || k != w_k || !k.is_multiple_of(BLOCK) {
        candle_core::bail!(
            "Q8_0 product: x is [{m}, {k}] but the weight is {:?} [{n}, {w_k}]",
            blocks.dtype()
        );
    }
    let dtype = x.dtype();
    let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let data = blocks.data()?;
    let mut out = vec![0f32; m * n];
    product(Kernel::best(), &data, &xs, m, n, k, &mut out);
    Tensor::from_vec(out, (m, n), &Device::Cpu)?.to_dtype(dtype)
}

/// The rows of `x` rounded to Q8_0 blocks as ggml rounds them for a product with Q8_0 weights
/// (`quantize_row_q8_0`): per block `d = max |x| / 127`, values `round(x / d)`, and `d` kept as f16.
struct Rows {
    /// `[m, stride · 32]`: the values, plus 128 (as unsigned bytes) for the VNNI kernel, whose
    /// instruction multiplies unsigned bytes by signed ones.
    values: Vec<u8>,
    /// `[m, stride]`: each block's scale (the f16 widened).
    scales: Vec<f32>,
    /// Blocks per row: `K / 32`, rounded up to even for the VNNI kernel, which reads two at a time (the
    /// extra block meets zero weights).
    stride: usize,
}

impl Rows {
    fn new(x: &[f32], m: usize, k: usize, kernel: Kernel) -> Rows {
        let blocks = k / BLOCK;
        let (stride, offset) = match kernel {
            Kernel::Avx512Vnni => (blocks.next_multiple_of(2), 0x80),
            _ => (blocks, 0),
        };
        let mut values = vec![0u8; m * stride * BLOCK];
        let mut scales = vec![0f32; m * stride];
        for row in 0..m {
            for block in 0..blocks {
                let xs = &x[row * k + block * BLOCK..][..BLOCK];
                let amax = xs.iter().fold(0f32, |amax, x| amax.max(x.abs()));
                let d = amax / 127.0;
                let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
                scales[row * stride + block] = half::f16::from_f32(d).to_f32();
                let at = (row * stride + block) * BLOCK;
                for (value, x) in values[at..at + BLOCK].iter_mut().zip(xs) {
                    *value = ((x * inverse).round() as i8 as u8) ^ offset;
                }
            }
        }
        Rows {
            values,
            scales,
            stride,
        }
    }
}

/// The output pointer shared by the tasks, each of which writes its own columns.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint columns of the output, which outlives them.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// The kernels, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Avx512Vnni,
    Avx2,
    Plain,
}

impl Kernel {
    fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            Kernel::Plain => true,
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best kernel on this CPU.
    fn best() -> Kernel {
        [Kernel::Avx512Vnni, Kernel::Avx2, Kernel::Plain]
            .into_iter()
            .find(|kernel| kernel.available())
            .unwrap_or(Kernel::Plain)
    }
}

/// `out` `[m, n]` = `x` `[m, k]` times the Q8_0 blocks `w` (`n` rows of `k / 32` blocks) transposed.
fn product(kernel: Kernel, w: &[u8], x: &[f32], m: usize, n: usize, k: usize, out: &mut [f32]) {
    assert!(kernel.available(), "{kernel:?} does not run on this CPU");
    assert!(k.is_multiple_of(BLOCK));
    assert!(x.len() == m * k && w.len() == n * k / BLOCK * BLOCK_BYTES && out.len() == m * n);
    let rows = Rows::new(x, m, k, kernel);
    let out = Out(out.as_mut_ptr());
    let task = |task: usize| {
        let columns = task * COLUMNS_PER_TASK..((task + 1) * COLUMNS_PER_TASK).min(n);
        // SAFETY: the lengths are checked above, `columns` are this task's alone, and the kernel is
        // available.
        unsafe { columns_with(kernel, w, &rows, m, n, k / BLOCK, columns, out) }
    };
    let tasks = n.div_ceil(COLUMNS_PER_TASK);
    if n * k < MIN_PARALLEL_WEIGHTS {
        (0..tasks).for_each(task);
    } else {
        // On candle's pool, as the layer's other operations (see `kernel`).
        candle_core::utils::barrier_pool().execute_chunked(tasks, |tasks| tasks.for_each(task));
    }
}

/// # Safety
/// `w` holds `n` rows of `blocks` Q8_0 blocks, `rows` `m` rows quantized for `kernel`, `out` points to
/// `[m, n]`; `columns` lie within `0..n` and are written by no one else while this runs; `kernel` is
/// available.
#[allow(clippy::too_many_arguments)]
unsafe fn columns_with(
    kernel: Kernel,
    w: &[u8],
    rows: &Rows,
    m: usize,
    n: usize,
    blocks: usize,
    columns: Range<usize>,
    out: Out,
) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni => x86::columns_vnni(w, rows, m, n, blocks, columns, out),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => x86::columns_avx2(w, rows, m, n, blocks, columns, out),
        _ => plain(w, rows, m, n, blocks, columns, out),
    }
}

/// A block's f16 scale, widened.
fn scale(block: &[u8]) -> f32 {
    half::f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// One weight row and one row of `x` at a time, each block's products summed in integers.
#[allow(clippy::too_many_arguments)]
unsafe fn plain(
    w: &[u8],
    rows: &Rows,
    m: usize,
    n: usize,
    blocks: usize,
    columns: Range<usize>,
    out: Out,
) {
    let row_bytes = blocks * BLOCK_BYTES;
    for column in columns {
        let w_row = &w[column * row_bytes..][..row_bytes];
        for row in 0..m {
            let mut total = 0f32;
            for (b, block) in w_row.chunks_exact(BLOCK_BYTES).enumerate() {
                let at = row * rows.stride + b;
                let xs = &rows.values[at * BLOCK..][..BLOCK];
                let dot: i32 = block[2..]
                    .iter()
                    .zip(xs)
                    .map(|(&w, &x)| i32::from(w as i8) * i32::from(x as i8))
                    .sum();
                total += dot as f32 * (scale(block) * rows.scales[at]);
            }
            *out.0.add(row * n + column) = total;
        }
    }
}

/// The kernels with AVX-512 VNNI (tiles of 4 rows of `x` × 4 weight rows, two blocks per step) and AVX2
/// (tiles of 4 × 2, one block per step). Each tile keeps its `R × C` running sums in registers over `K`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // index loops over constant-size tiles unroll into registers
mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{scale, Out, Rows, BLOCK, BLOCK_BYTES};

    /// Tiles of 4 rows of `x` by 4 weight rows over `columns`, then the leftover rows and columns.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) unsafe fn columns_vnni(
        w: &[u8],
        rows: &Rows,
        m: usize,
        n: usize,
        blocks: usize,
        columns: Range<usize>,
        out: Out,
    ) {
        let mut column = columns.start;
        while column + 4 <= columns.end {
            let mut row = 0;
            while row + 4 <= m {
                tile_vnni::<4, 4>(w, rows, n, blocks, row, column, out);
                row += 4;
            }
            for row in row..m {
                tile_vnni::<1, 4>(w, rows, n, blocks, row, column, out);
            }
            column += 4;
        }
        for column in column..columns.end {
            let mut row = 0;
            while row + 4 <= m {
                tile_vnni::<4, 1>(w, rows, n, blocks, row, column, out);
                row += 4;
            }
            for row in row..m {
                tile_vnni::<1, 1>(w, rows, n, blocks, row, column, out);
            }
        }
    }

    /// Rows `row..row + R` of `x` against weight rows `column..column + C`, two blocks per step.
    ///
    /// `vpdpbusd` multiplies unsigned bytes by signed ones, so `x` comes offset by 128 (`Rows`): each
    /// lane's sum starts at `-128 · Σ w` of its four weights, computed once per weight block for all
    /// the tile's rows, and ends at the exact `Σ x · w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    #[inline]
    unsafe fn tile_vnni<const R: usize, const C: usize>(
        w: &[u8],
        rows: &Rows,
        n: usize,
        blocks: usize,
        row: usize,
        column: usize,
        out: Out,
    ) {
        let row_bytes = blocks * BLOCK_BYTES;
        let w_rows = w.as_ptr().add(column * row_bytes);
        let x_values = rows.values.as_ptr().add(row * rows.stride * BLOCK);
        let x_scales = rows.scales.as_ptr().add(row * rows.stride);
        // The scales of two blocks spread over the register's halves.
        let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let offset = _mm512_set1_epi8(-128);
        let mut sums = [[_mm512_setzero_ps(); C]; R];
        let mut weights = [_mm512_setzero_si512(); C];
        let mut starts = [_mm512_setzero_si512(); C];
        let mut w_scales = [_mm512_setzero_ps(); C];
        let mut b = 0;
        while b < blocks {
            let pair = b + 1 < blocks;
            for j in 0..C {
                let first = w_rows.add(j * row_bytes + b * BLOCK_BYTES);
                let second = first.add(BLOCK_BYTES);
                let low = _mm256_loadu_si256(first.add(2).cast());
                let (high, high_scale) = if pair {
                    (
                        _mm256_loadu_si256(second.add(2).cast()),
                        u16::from_le_bytes([*second, *second.add(1)]),
                    )
                } else {
                    (_mm256_setzero_si256(), 0)
                };
                weights[j] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high);
                starts[j] = _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, weights[j]),
                );
                let low_scale = u16::from_le_bytes([*first, *first.add(1)]);
                let two = _mm_cvtph_ps(_mm_cvtsi32_si128(
                    (i32::from(high_scale) << 16) | i32::from(low_scale),
                ));
                w_scales[j] = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(two));
            }
            for i in 0..R {
                let xs = _mm512_loadu_si512(x_values.add((i * rows.stride + b) * BLOCK).cast());
                let two = _mm_castpd_ps(_mm_load_sd(
                    x_scales.add(i * rows.stride + b).cast::<f64>(),
                ));
                let x_scale = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(two));
                for j in 0..C {
                    let dot = _mm512_dpbusd_epi32(starts[j], xs, weights[j]);
                    sums[i][j] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(dot),
                        _mm512_mul_ps(w_scales[j], x_scale),
                        sums[i][j],
                    );
                }
            }
            b += 2;
        }
        for i in 0..R {
            for j in 0..C {
                *out.0.add((row + i) * n + column + j) = _mm512_reduce_add_ps(sums[i][j]);
            }
        }
    }

    /// Tiles of 4 rows of `x` by 2 weight rows over `columns`, then the leftover rows and columns.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn columns_avx2(
        w: &[u8],
        rows: &Rows,
        m: usize,
        n: usize,
        blocks: usize,
        columns: Range<usize>,
        out: Out,
    ) {
        let mut column = columns.start;
        while column + 2 <= columns.end {
            let mut row = 0;
            while row + 4 <= m {
                tile_avx2::<4, 2>(w, rows, n, blocks, row, column, out);
                row += 4;
            }
            for row in row..m {
                tile_avx2::<1, 2>(w, rows, n, blocks, row, column, out);
            }
            column += 2;
        }
        for column in column..columns.end {
            let mut row = 0;
            while row + 4 <= m {
                tile_avx2::<4, 1>(w, rows, n, blocks, row, column, out);
                row += 4;
            }
            for row in row..m {
                tile_avx2::<1, 1>(w, rows, n, blocks, row, column, out);
            }
        }
    }

    /// Rows `row..row + R` of `x` against weight rows `column..column + C`, one block per step.
    ///
    /// `vpmaddubsw` multiplies unsigned bytes by signed ones into pairs summed in 16 bits, so (as ggml)
    /// it takes `|w|` and `x` with `w`'s sign: at most 2 · 128 · 127, which does not saturate.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile_avx2<const R: usize, const C: usize>(
        w: &[u8],
        rows: &Rows,
        n: usize,
        blocks: usize,
        row: usize,
        column: usize,
        out: Out,
    ) {
        let row_bytes = blocks * BLOCK_BYTES;
        let w_rows = w.as_ptr().add(column * row_bytes);
        let x_values = rows.values.as_ptr().add(row * rows.stride * BLOCK);
        let x_scales = rows.scales.as_ptr().add(row * rows.stride);
        let ones = _mm256_set1_epi16(1);
        let mut sums = [[_mm256_setzero_ps(); C]; R];
        let mut signs = [_mm256_setzero_si256(); C];
        let mut magnitudes = [_mm256_setzero_si256(); C];
        let mut w_scales = [0f32; C];
        for b in 0..blocks {
            for j in 0..C {
                let block = w_rows.add(j * row_bytes + b * BLOCK_BYTES);
                signs[j] = _mm256_loadu_si256(block.add(2).cast());
                magnitudes[j] = _mm256_sign_epi8(signs[j], signs[j]);
                w_scales[j] = scale(std::slice::from_raw_parts(block, 2));
            }
            for i in 0..R {
                let xs = _mm256_loadu_si256(x_values.add((i * rows.stride + b) * BLOCK).cast());
                let x_scale = *x_scales.add(i * rows.stride + b);
                for j in 0..C {
                    let pairs = _mm256_maddubs_epi16(magnitudes[j], _mm256_sign_epi8(xs, signs[j]));
                    let dot = _mm256_madd_epi16(pairs, ones);
                    sums[i][j] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(dot),
                        _mm256_set1_ps(w_scales[j] * x_scale),
                        sums[i][j],
                    );
                }
            }
        }
        for i in 0..R {
            for j in 0..C {
                let halves = _mm_add_ps(
                    _mm256_castps256_ps128(sums[i][j]),
                    _mm256_extractf128_ps::<1>(sums[i][j]),
                );
                let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
                *out.0.add((row + i) * n + column + j) =
                    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps::<1>(pairs, pairs)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::sines;

    /// Against candle's product of the same blocks (`QTensor` as a `CustomOp1`: ggml's `vec_dot` per row
    /// of `x` and weight row, after rounding `x` to Q8_0 as `Rows` does), for every kernel this CPU runs,
    /// at decoding's batch sizes, widths of 1 to 48 blocks (odd and even counts: the VNNI kernel's last
    /// single block) and odd numbers of weight rows (the tiles' leftover columns; also what keeps
    /// candle off its repacked kernels, which round `x` to Q8_K instead).
    ///
    /// Both sum the same per-block terms `dot · d_w · d_x` (the integer dots exact, each scale product
    /// rounded once), in different orders: by the usual bound on a sum of `B` terms in f32, each differs
    /// from the exact sum by at most `(B + 2) · u · Σ |term|` (u = 2⁻²⁴, the `+ 2` for the rounding of
    /// each term), so the two by at most twice that; the test allows `2 (B + 2) · ε · Σ |term|` with
    /// `ε = 2u`, still a millionth of the outputs' size at these widths, while a wrong block or scale
    /// misses by the outputs' own size.
    #[test]
    fn equals_candles_q8_0_product() {
        for (k, n) in [(32, 1), (96, 7), (576, 67), (1536, 13)] {
            let weight = sines((n, k), 0.37, DType::F32);
            let blocks = QTensor::quantize(&weight, GgmlDType::Q8_0).unwrap();
            let data = blocks.data().unwrap().into_owned();
            let dequantized = blocks.dequantize(&Device::Cpu).unwrap();
            let w_abs = dequantized
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for m in [1, 2, 3, 8, 17, 32] {
                let x = sines((m, k), 0.11, DType::F32);
                let expected = x
                    .apply_op1_no_bwd(&blocks)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let rounded = Rows::new(&xs, m, k, Kernel::Plain);
                let terms = |row: usize, column: usize| -> f32 {
                    (0..k)
                        .map(|at| {
                            let value = rounded.values[row * k + at] as i8;
                            let x = f32::from(value).abs() * rounded.scales[row * k / BLOCK + at / BLOCK];
                            x * w_abs[column * k + at]
                        })
                        .sum()
                };
                let bound = 2.0 * (k / BLOCK + 2) as f32 * f32::EPSILON;
                for kernel in [Kernel::Avx512Vnni, Kernel::Avx2, Kernel::Plain] {
                    if !kernel.available() {
                        eprintln!("{kernel:?} does not run on this CPU: not compared");
                        continue;
                    }
                    let mut out = vec![f32::NAN; m * n];
                    product(kernel, &data, &xs, m, n, k, &mut out);
                    for row in 0..m {
                        for column in 0..n {
                            let (got, want) = (out[row * n + column], expected[row * n + column]);
                            let allowed = bound * terms(row, column);
                            assert!(
                                (got - want).abs() <= allowed,
                                "{kernel:?} [{m}, {k}] x [{n}, {k}] at ({row}, {column}): {got} vs \
                                 {want} (allowed {allowed})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Through the tensor entry: bf16 activations come back bf16, and other block types, more rows
    /// than decoding's or a width that is not the weight's are not taken or refused.
    #[test]
    fn takes_decoding_rows_of_q8_0_blocks_only() {
        let weight = sines((5, 64), 0.3, DType::F32);
        let q8 = QTensor::quantize(&weight, GgmlDType::Q8_0).unwrap();
        let q4 = QTensor::quantize(&weight, GgmlDType::Q4_0).unwrap();
        let x = sines((3, 64), 0.2, DType::BF16);
        assert!(suits(&q8, &x));
        assert!(!suits(&q4, &x));
        assert!(!suits(&q8, &sines((MAX_ROWS + 1, 64), 0.2, DType::F32)));
        let got = matmul(&x, &q8).unwrap();
        assert_eq!((got.dtype(), got.dims()), (DType::BF16, &[3, 5][..]));
        let error = matmul(&sines((3, 32), 0.2, DType::F32), &q8).unwrap_err();
        assert!(error.to_string().contains("[3, 32]"), "{error}");
    }
}
