//! Products of rows of activations with a matrix kept as a GGUF file's legacy quantized blocks
//! (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), on the CPU: `y = x · wᵀ` for `x` `[M, K]` and `w` `[N, K]` stored as
//! blocks of 32 weights (an f16 scale `d`, for Q4_1 and Q5_1 an f16 minimum `m`, then the codes). This is
//! sampling from `--quantized` weights: every decoding step multiplies one row per sequence by every
//! block of the model, a prefill one row per prompt token.
//!
//! candle's product (ggml's port) rounds each row of `x` to 8-bit blocks and runs one dot product per
//! row of `x` and row of `w`, so a batch of 8 reads every block 8 times (its repacked kernels, which
//! reuse a block across rows, need rows of a multiple of 256 inputs; its Q4_1, Q5_0 and Q5_1 dot
//! products are plain loops). Here each row of `x` is rounded exactly as ggml rounds it (Q8_0, with the
//! Q8_1 block sums for the types with a minimum), so the products equal candle's up to the order of the
//! f32 sums; then tiles of weight rows × rows of `x` keep their running sums in vector registers over
//! `K`: each weight block is expanded once per tile and multiplied into every row of it, the weight rows
//! of a tile staying in the L1 cache while every group of rows of `x` passes over them.
//!
//! Every type is read the same way: a weight is `d · (c - z) + m` for an unsigned code `c` (Q8_0's
//! signed byte plus 128, Q4's nibble, Q5's nibble and fifth bit), the type's zero code `z` and minimum
//! `m` (0 without one). A block's products `Σ c · q` with the activations' bytes `q` are summed exactly
//! in 32-bit integers, from `-z · Σ q` (each row's, computed once), then scaled by the two blocks' scales
//! into f32 sums, `m · d_x · Σ q` added, as ggml does.
//!
//! AVX-512 with VNNI (`vpdpbusd`: four byte products summed into each lane by one instruction, two
//! blocks per register), AVX2 (`vpmaddubsw`, one block per register) or a plain loop is picked at run
//! time; threads share the weight rows out, as the skinny kernels do (`skinny`). Each tile asks for the
//! next tile's blocks while it works (`x86::ahead`): at one row a product is bound by reading the blocks,
//! and the CPU's prefetcher does not follow a tile's short rows.
//!
//! No backward: a product over blocks only samples (training expands them, `blocks`).

use std::ops::Range;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::f16;

use super::kernel::Result;

/// Weights per block.
const BLOCK: usize = 32;

/// Weight rows one task computes.
const COLUMNS_PER_TASK: usize = 64;

/// Below this many weights a product runs on the calling thread: splitting it costs more than it saves.
const MIN_PARALLEL_WEIGHTS: usize = 1 << 16;

/// Whether [`matmul`] computes `x · blocksᵀ` for the sampling path: blocks of a type here on the CPU,
/// f32 or bf16 activations on the CPU, any number of rows (prefill's too: on SmolLM2-135M in Q8_0, a
/// prefill of 8 prompts of 16 tokens took 2.5 s through candle's product and 0.84 s through these,
/// one thread on a loaded machine).
pub fn suits(blocks: &QTensor, x: &Tensor) -> bool {
    matches!(
        blocks.dtype(),
        GgmlDType::Q8_0 | GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1
    ) && blocks.device().is_cpu()
        && x.device().is_cpu()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
}

/// `x` `[M, K]` (f32 or bf16) times `blocks` `[N, K]` (Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1) transposed:
/// `[M, N]` in `x`'s type, computed in f32 from `x` rounded to 8 bits per block as ggml rounds it. No
/// backward: sampling only.
pub fn matmul(x: &Tensor, blocks: &QTensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (n, w_k) = blocks.shape().dims2()?;
    let dtype = blocks.dtype();
    if k != w_k || !k.is_multiple_of(BLOCK) {
        candle_core::bail!(
            "block product: x is [{m}, {k}] but the weight is {dtype:?} [{n}, {w_k}]"
        );
    }
    let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let data = blocks.data()?;
    let mut out = vec![0f32; m * n];
    let kernel = Kernel::best();
    match dtype {
        GgmlDType::Q8_0 => product::<Q8_0>(kernel, &data, &xs, m, n, k, &mut out),
        GgmlDType::Q4_0 => product::<Q4_0>(kernel, &data, &xs, m, n, k, &mut out),
        GgmlDType::Q4_1 => product::<Q4_1>(kernel, &data, &xs, m, n, k, &mut out),
        GgmlDType::Q5_0 => product::<Q5_0>(kernel, &data, &xs, m, n, k, &mut out),
        GgmlDType::Q5_1 => product::<Q5_1>(kernel, &data, &xs, m, n, k, &mut out),
        _ => candle_core::bail!("no block product of ours for {dtype:?} weights"),
    }
    Tensor::from_vec(out, (m, n), &Device::Cpu)?.to_dtype(x.dtype())
}

/// A block type: its bytes and how its 32 weights are coded. A weight is `d · (code - ZERO) + m`.
trait Format {
    /// Bytes per block.
    const BYTES: usize;
    /// The code of a zero weight (before the minimum).
    const ZERO: i32;
    /// Where the block's f16 minimum `m` is, for the types that have one.
    const MIN: Option<usize>;
    /// The 32 codes of `block`, in the weights' order.
    fn codes(block: &[u8]) -> [u8; BLOCK];
}

/// An f16 at `block[at..at + 2]`, widened.
fn half_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// The nibbles of `bytes` (16 of them): weights 0–15 from the low ones, 16–31 from the high.
fn nibbles(bytes: &[u8]) -> [u8; BLOCK] {
    let mut codes = [0u8; BLOCK];
    for (j, &byte) in bytes[..BLOCK / 2].iter().enumerate() {
        codes[j] = byte & 0x0F;
        codes[j + BLOCK / 2] = byte >> 4;
    }
    codes
}

/// [`nibbles`] with each weight's fifth bit from the 32 bits at `high` (bit `j` for weight `j`).
fn fives(high: &[u8], bytes: &[u8]) -> [u8; BLOCK] {
    let bits = u32::from_le_bytes([high[0], high[1], high[2], high[3]]);
    let mut codes = nibbles(bytes);
    for (j, code) in codes.iter_mut().enumerate() {
        *code |= (((bits >> j) & 1) as u8) << 4;
    }
    codes
}

// ggml's names for its types.
/// `d`, 32 signed bytes (the code is the byte plus 128).
#[allow(non_camel_case_types)]
struct Q8_0;
/// `d`, 16 bytes of nibbles, zero at 8.
#[allow(non_camel_case_types)]
struct Q4_0;
/// `d`, `m`, 16 bytes of nibbles.
#[allow(non_camel_case_types)]
struct Q4_1;
/// `d`, the fifth bits, 16 bytes of nibbles, zero at 16.
#[allow(non_camel_case_types)]
struct Q5_0;
/// `d`, `m`, the fifth bits, 16 bytes of nibbles.
#[allow(non_camel_case_types)]
struct Q5_1;

/// What the kernels need of a block type: its layout, and on x86 its codes as vectors.
#[cfg(target_arch = "x86_64")]
trait Block: x86::Codes {}
#[cfg(target_arch = "x86_64")]
impl<F: x86::Codes> Block for F {}
#[cfg(not(target_arch = "x86_64"))]
trait Block: Format {}
#[cfg(not(target_arch = "x86_64"))]
impl<F: Format> Block for F {}

impl Format for Q8_0 {
    const BYTES: usize = 34;
    const ZERO: i32 = 128;
    const MIN: Option<usize> = None;
    fn codes(block: &[u8]) -> [u8; BLOCK] {
        std::array::from_fn(|j| block[2 + j] ^ 0x80)
    }
}

impl Format for Q4_0 {
    const BYTES: usize = 18;
    const ZERO: i32 = 8;
    const MIN: Option<usize> = None;
    fn codes(block: &[u8]) -> [u8; BLOCK] {
        nibbles(&block[2..])
    }
}

impl Format for Q4_1 {
    const BYTES: usize = 20;
    const ZERO: i32 = 0;
    const MIN: Option<usize> = Some(2);
    fn codes(block: &[u8]) -> [u8; BLOCK] {
        nibbles(&block[4..])
    }
}

impl Format for Q5_0 {
    const BYTES: usize = 22;
    const ZERO: i32 = 16;
    const MIN: Option<usize> = None;
    fn codes(block: &[u8]) -> [u8; BLOCK] {
        fives(&block[2..], &block[6..])
    }
}

impl Format for Q5_1 {
    const BYTES: usize = 24;
    const ZERO: i32 = 0;
    const MIN: Option<usize> = Some(2);
    fn codes(block: &[u8]) -> [u8; BLOCK] {
        fives(&block[4..], &block[8..])
    }
}

/// The rows of `x` rounded to 8 bits per block as ggml rounds them for these products
/// (`quantize_row_q8_0`, and `quantize_row_q8_1`'s sums): per block `d = max |x| / 127`, values
/// `round(x / d)`, `d` kept as f16.
struct Rows {
    /// `[m, stride · 32]`: the values.
    values: Vec<i8>,
    /// `[m, stride]`: each block's `d`, widened.
    scales: Vec<f32>,
    /// `[m, stride]`: each block's `d · Σ q` as Q8_1 keeps it (f16, from the f16 sum), what a weight
    /// block's minimum multiplies.
    sums: Vec<f32>,
    /// `[m, stride, 8]`: where the integer sums of the SIMD kernels start, `-z · Σ q` over each group
    /// of 4 values (a lane of `vpdpbusd` and of `vpmaddubsw` then `vpmaddwd`).
    starts: Vec<i32>,
    /// Blocks per row: `K / 32`, rounded up to even for the VNNI kernel, which reads two at a time (the
    /// extra block meets zero weights).
    stride: usize,
}

impl Rows {
    fn new(x: &[f32], m: usize, k: usize, zero: i32, kernel: Kernel) -> Rows {
        let blocks = k / BLOCK;
        let stride = match kernel {
            Kernel::Avx512Vnni => blocks.next_multiple_of(2),
            _ => blocks,
        };
        let mut values = vec![0i8; m * stride * BLOCK];
        let mut scales = vec![0f32; m * stride];
        let mut sums = vec![0f32; m * stride];
        let mut starts = vec![0i32; m * stride * 8];
        for row in 0..m {
            for block in 0..blocks {
                let xs: &[f32; BLOCK] = x[row * k + block * BLOCK..][..BLOCK].try_into().unwrap();
                let at = row * stride + block;
                let qs: &mut [i8; BLOCK] = (&mut values[at * BLOCK..][..BLOCK]).try_into().unwrap();
                let d = match kernel {
                    // SAFETY: both kernels run only where the CPU has AVX2.
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx512Vnni | Kernel::Avx2 => unsafe { x86::round(xs, qs) },
                    _ => round(xs, qs),
                };
                let d = f16::from_f32(d);
                scales[at] = d.to_f32();
                let mut total = 0;
                for (lane, four) in qs.chunks_exact(4).enumerate() {
                    let lane_sum: i32 = four.iter().map(|&q| i32::from(q)).sum();
                    starts[at * 8 + lane] = -zero * lane_sum;
                    total += lane_sum;
                }
                sums[at] = (f16::from_f32(total as f32) * d).to_f32();
            }
        }
        Rows {
            values,
            scales,
            sums,
            starts,
            stride,
        }
    }
}

/// One block of activations `xs` rounded to 8 bits into `qs` as ggml's `quantize_row_q8_0_ref` rounds
/// it: `d = max |x| / 127`, each value `round(x / d)` (halves away from zero) as `x` times `1 / d`. `d`,
/// before it is rounded to f16.
fn round(xs: &[f32; BLOCK], qs: &mut [i8; BLOCK]) -> f32 {
    let amax = xs.iter().fold(0f32, |amax, x| amax.max(x.abs()));
    let d = amax / 127.0;
    let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, x) in qs.iter_mut().zip(xs) {
        *q = (x * inverse).round() as i8;
    }
    d
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

/// `out` `[m, n]` = `x` `[m, k]` times the blocks `w` (`n` rows of `k / 32` blocks of `F`) transposed.
fn product<F: Block>(
    kernel: Kernel,
    w: &[u8],
    x: &[f32],
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
) {
    assert!(kernel.available(), "{kernel:?} does not run on this CPU");
    assert!(k.is_multiple_of(BLOCK));
    assert!(x.len() == m * k && w.len() == n * k / BLOCK * F::BYTES && out.len() == m * n);
    let rows = Rows::new(x, m, k, F::ZERO, kernel);
    let out = Out(out.as_mut_ptr());
    let task = |task: usize| {
        let columns = task * COLUMNS_PER_TASK..((task + 1) * COLUMNS_PER_TASK).min(n);
        // SAFETY: the lengths are checked above, `columns` are this task's alone, and the kernel is
        // available.
        unsafe { columns_with::<F>(kernel, w, &rows, m, n, k / BLOCK, columns, out) }
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
/// `w` holds `n` rows of `blocks` blocks of `F`, `rows` `m` rows rounded for `kernel` and `F`, `out`
/// points to `[m, n]`; `columns` lie within `0..n` and are written by no one else while this runs;
/// `kernel` is available.
#[allow(clippy::too_many_arguments)]
unsafe fn columns_with<F: Block>(
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
        Kernel::Avx512Vnni => x86::columns_vnni::<F>(w, rows, m, n, blocks, columns, out),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => x86::columns_avx2::<F>(w, rows, m, n, blocks, columns, out),
        _ => plain::<F>(w, rows, m, n, blocks, columns, out),
    }
}

/// One weight row and one row of `x` at a time, each block's products summed in integers.
#[allow(clippy::too_many_arguments)]
unsafe fn plain<F: Block>(
    w: &[u8],
    rows: &Rows,
    m: usize,
    n: usize,
    blocks: usize,
    columns: Range<usize>,
    out: Out,
) {
    let row_bytes = blocks * F::BYTES;
    for column in columns {
        let w_row = &w[column * row_bytes..][..row_bytes];
        for row in 0..m {
            let mut total = 0f32;
            for (b, block) in w_row.chunks_exact(F::BYTES).enumerate() {
                let at = row * rows.stride + b;
                let xs = &rows.values[at * BLOCK..][..BLOCK];
                let dot: i32 = F::codes(block)
                    .iter()
                    .zip(xs)
                    .map(|(&c, &q)| (i32::from(c) - F::ZERO) * i32::from(q))
                    .sum();
                total += dot as f32 * (half_at(block, 0) * rows.scales[at]);
                if let Some(min) = F::MIN {
                    total += half_at(block, min) * rows.sums[at];
                }
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

    use super::{half_at, Format, Out, Rows, BLOCK, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};

    /// [`super::round`] in vector lanes, to the same bytes: `round` there is `roundf`, halves away from
    /// zero, where the lanes' own rounding takes halves to even, so each value is truncated and moved
    /// one away from zero where what was cut off is at least a half (`v - trunc(v)` is exact in f32).
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn round(xs: &[f32; BLOCK], qs: &mut [i8; BLOCK]) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let parts: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xs.as_ptr().add(8 * i)));
        let magnitudes = parts.map(|part| _mm256_andnot_ps(sign, part));
        let most = _mm256_max_ps(
            _mm256_max_ps(magnitudes[0], magnitudes[1]),
            _mm256_max_ps(magnitudes[2], magnitudes[3]),
        );
        let most = _mm_max_ps(
            _mm256_castps256_ps128(most),
            _mm256_extractf128_ps::<1>(most),
        );
        let most = _mm_max_ps(most, _mm_movehl_ps(most, most));
        let amax = _mm_cvtss_f32(_mm_max_ss(most, _mm_shuffle_ps::<1>(most, most)));
        let d = amax / 127.0;
        let inverse = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let whole = parts.map(|part| {
            let v = _mm256_mul_ps(part, inverse);
            let cut = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
            let rest = _mm256_andnot_ps(sign, _mm256_sub_ps(v, cut));
            let away = _mm256_and_ps(
                _mm256_cmp_ps::<_CMP_GE_OQ>(rest, half),
                _mm256_or_ps(one, _mm256_and_ps(sign, v)),
            );
            _mm256_cvtps_epi32(_mm256_add_ps(cut, away))
        });
        // Each 8 lanes to 8 bytes, in order: pack to 16 bits, then to 8, then undo the packs'
        // interleaving of 128-bit halves.
        let low = _mm256_packs_epi32(whole[0], whole[1]);
        let high = _mm256_packs_epi32(whole[2], whole[3]);
        let bytes = _mm256_packs_epi16(low, high);
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(qs.as_mut_ptr().cast(), bytes);
        d
    }

    // The blocks' codes (and the AVX2 kernel's rows) are loaded with `lddqu`, the same unaligned load
    // as `_mm_loadu_si128` / `_mm256_loadu_si256` on these CPUs; those are written in the standard
    // library as a copy that a build with debug assertions (the dev profile's, which builds holo-model
    // at opt-level 3 with them) checks for overlap at every call, in the innermost loop.

    /// A block type's codes as vectors.
    pub(super) trait Codes: Format {
        /// The 32 codes of the block at `block`, in the weights' order.
        ///
        /// # Safety
        /// `block` points to a whole block and the CPU has AVX2.
        unsafe fn codes256(block: *const u8) -> __m256i;

        /// The codes of the blocks at `first` and `second` (or zero codes without a second) side by
        /// side.
        ///
        /// # Safety
        /// The pointers point to whole blocks and the CPU has AVX-512F and BW.
        #[inline(always)]
        unsafe fn codes512(first: *const u8, second: Option<*const u8>) -> __m512i {
            let high = match second {
                Some(second) => Self::codes256(second),
                None => _mm256_setzero_si256(),
            };
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(Self::codes256(first)), high)
        }
    }

    /// The 16 bytes at `bytes` split into their nibbles: weights 0–15 low, 16–31 high.
    #[inline(always)]
    unsafe fn nibbles256(bytes: *const u8) -> __m256i {
        let packed = _mm_lddqu_si128(bytes.cast());
        let low = _mm_set1_epi8(0x0F);
        _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16::<4>(packed), low),
            _mm_and_si128(packed, low),
        )
    }

    /// 16 where bit `j` of the 4 bytes at `high` is set, for each byte `j`.
    #[inline(always)]
    unsafe fn fifth_bits256(high: *const u8) -> __m256i {
        let bits = _mm256_set1_epi32(i32::from_le_bytes([
            *high,
            *high.add(1),
            *high.add(2),
            *high.add(3),
        ]));
        // Byte `j` takes byte `j / 8` of the bits (each 128-bit half holds all four), then its bit
        // `j % 8`.
        let spread = _mm256_shuffle_epi8(
            bits,
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    impl Codes for Q8_0 {
        #[inline(always)]
        unsafe fn codes256(block: *const u8) -> __m256i {
            _mm256_xor_si256(
                _mm256_lddqu_si256(block.add(2).cast()),
                _mm256_set1_epi8(-128),
            )
        }
    }

    impl Codes for Q4_0 {
        #[inline(always)]
        unsafe fn codes256(block: *const u8) -> __m256i {
            nibbles256(block.add(2))
        }
    }

    impl Codes for Q4_1 {
        #[inline(always)]
        unsafe fn codes256(block: *const u8) -> __m256i {
            nibbles256(block.add(4))
        }
    }

    impl Codes for Q5_0 {
        #[inline(always)]
        unsafe fn codes256(block: *const u8) -> __m256i {
            _mm256_or_si256(nibbles256(block.add(6)), fifth_bits256(block.add(2)))
        }
    }

    impl Codes for Q5_1 {
        #[inline(always)]
        unsafe fn codes256(block: *const u8) -> __m256i {
            _mm256_or_si256(nibbles256(block.add(8)), fifth_bits256(block.add(4)))
        }
    }

    /// The f16s at `first + at` and `second + at` (0 without a second), widened into lanes 0 and 1.
    ///
    /// # Safety
    /// The pointers point to whole blocks and the CPU has F16C.
    #[inline(always)]
    unsafe fn halves_at(first: *const u8, second: Option<*const u8>, at: usize) -> __m512 {
        let bits =
            |block: *const u8| i32::from(u16::from_le_bytes([*block.add(at), *block.add(at + 1)]));
        let high = second.map_or(0, bits);
        _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((high << 16) | bits(first))))
    }

    /// The f16 at `block + at`, widened.
    #[inline(always)]
    unsafe fn half(block: *const u8, at: usize) -> f32 {
        half_at(std::slice::from_raw_parts(block.add(at), 2), 0)
    }

    /// Asks for the cache lines that the same step of the next tile of weight rows will read, `tile`
    /// bytes past `block`: the two lines from `block` on, of the 68 bytes a step reads of a row (two
    /// blocks; the AVX2 kernel asks at every other block), whose third line, if any, the next step
    /// asks for.
    ///
    /// A tile reads its `C` rows side by side, each only `K / 32` blocks long (612 bytes for 576
    /// inputs), which the CPU's own prefetcher follows poorly: without this, one row of SmolLM2's
    /// products read its Q8_0 blocks at about 1 GB/s on a loaded 2-core Xeon; with it, at 2–3.5 GB/s
    /// (`[1, 576] × [1536, 576]ᵀ` 600 → 350 µs, the head's `× [49152, 576]ᵀ` 20–27 → 10–13 ms; eight
    /// rows 1.1–1.7 → 0.9 ms and 37–46 → 29–32 ms).
    #[inline(always)]
    unsafe fn ahead(block: *const u8, tile: usize) {
        // Past the last tile this asks for lines beyond the weights, which a prefetch may (it never
        // faults); `wrapping_add` keeps the pointer arithmetic defined.
        let at = block.wrapping_add(tile);
        _mm_prefetch::<_MM_HINT_T0>(at.cast());
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(64).cast());
    }

    /// Tiles of 4 rows of `x` by 4 weight rows over `columns`, then the leftover rows and columns.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) unsafe fn columns_vnni<F: Codes>(
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
                tile_vnni::<F, 4, 4>(w, rows, n, blocks, row, column, out);
                row += 4;
            }
            for row in row..m {
                tile_vnni::<F, 1, 4>(w, rows, n, blocks, row, column, out);
            }
            column += 4;
        }
        for column in column..columns.end {
            let mut row = 0;
            while row + 4 <= m {
                tile_vnni::<F, 4, 1>(w, rows, n, blocks, row, column, out);
                row += 4;
            }
            for row in row..m {
                tile_vnni::<F, 1, 1>(w, rows, n, blocks, row, column, out);
            }
        }
    }

    /// Rows `row..row + R` of `x` against weight rows `column..column + C`, two blocks per step.
    ///
    /// `vpdpbusd` multiplies unsigned bytes (the weights' codes) by signed ones (`x`'s values) and adds
    /// each lane's four products to its sum, which starts at the row's `-z · Σ q` (`Rows::starts`).
    /// The minimums' products, one per block, go into the first lane of the block's half.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni,f16c")]
    #[inline]
    unsafe fn tile_vnni<F: Codes, const R: usize, const C: usize>(
        w: &[u8],
        rows: &Rows,
        n: usize,
        blocks: usize,
        row: usize,
        column: usize,
        out: Out,
    ) {
        let row_bytes = blocks * F::BYTES;
        let w_rows = w.as_ptr().add(column * row_bytes);
        let at = row * rows.stride;
        let (x_values, x_scales) = (
            rows.values.as_ptr().add(at * BLOCK),
            rows.scales.as_ptr().add(at),
        );
        let (x_sums, x_starts) = (rows.sums.as_ptr().add(at), rows.starts.as_ptr().add(at * 8));
        // The scales of two blocks spread over the register's halves.
        let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let mut sums = [[_mm512_setzero_ps(); C]; R];
        let mut codes = [_mm512_setzero_si512(); C];
        let mut w_scales = [_mm512_setzero_ps(); C];
        let mut w_mins = [_mm512_setzero_ps(); C];
        let mut b = 0;
        while b < blocks {
            let pair = b + 1 < blocks;
            for j in 0..C {
                let first = w_rows.add(j * row_bytes + b * F::BYTES);
                ahead(first, C * row_bytes);
                let second = first.add(F::BYTES);
                let second = pair.then_some(second);
                codes[j] = F::codes512(first, second);
                w_scales[j] = _mm512_permutexvar_ps(halves, halves_at(first, second, 0));
                if let Some(min) = F::MIN {
                    w_mins[j] =
                        _mm512_maskz_permutexvar_ps(0x0101, halves, halves_at(first, second, min));
                }
            }
            for i in 0..R {
                let at = i * rows.stride + b;
                let xs = _mm512_loadu_si512(x_values.add(at * BLOCK).cast());
                let start = _mm512_loadu_si512(x_starts.add(at * 8).cast());
                let two = _mm_castpd_ps(_mm_load_sd(x_scales.add(at).cast::<f64>()));
                let x_scale = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(two));
                let x_sum = if F::MIN.is_some() {
                    let two = _mm_castpd_ps(_mm_load_sd(x_sums.add(at).cast::<f64>()));
                    _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(two))
                } else {
                    _mm512_setzero_ps()
                };
                for j in 0..C {
                    let dot = _mm512_dpbusd_epi32(start, codes[j], xs);
                    sums[i][j] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(dot),
                        _mm512_mul_ps(w_scales[j], x_scale),
                        sums[i][j],
                    );
                    if F::MIN.is_some() {
                        sums[i][j] = _mm512_fmadd_ps(w_mins[j], x_sum, sums[i][j]);
                    }
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
    pub(super) unsafe fn columns_avx2<F: Codes>(
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
                tile_avx2::<F, 4, 2>(w, rows, n, blocks, row, column, out);
                row += 4;
            }
            for row in row..m {
                tile_avx2::<F, 1, 2>(w, rows, n, blocks, row, column, out);
            }
            column += 2;
        }
        for column in column..columns.end {
            let mut row = 0;
            while row + 4 <= m {
                tile_avx2::<F, 4, 1>(w, rows, n, blocks, row, column, out);
                row += 4;
            }
            for row in row..m {
                tile_avx2::<F, 1, 1>(w, rows, n, blocks, row, column, out);
            }
        }
    }

    /// Rows `row..row + R` of `x` against weight rows `column..column + C`, one block per step.
    ///
    /// `vpmaddubsw` multiplies unsigned bytes by signed ones into pairs summed in 16 bits, which
    /// saturate past 32767: codes of at most 31 (Q4, Q5) go in as they are, from the row's `-z · Σ q`;
    /// Q8_0's go as ggml's do, `|w|` times `x` with `w`'s sign (at most 2 · 128 · 127).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile_avx2<F: Codes, const R: usize, const C: usize>(
        w: &[u8],
        rows: &Rows,
        n: usize,
        blocks: usize,
        row: usize,
        column: usize,
        out: Out,
    ) {
        let signed = F::ZERO == 128;
        let row_bytes = blocks * F::BYTES;
        let w_rows = w.as_ptr().add(column * row_bytes);
        let at = row * rows.stride;
        let (x_values, x_scales) = (
            rows.values.as_ptr().add(at * BLOCK),
            rows.scales.as_ptr().add(at),
        );
        let (x_sums, x_starts) = (rows.sums.as_ptr().add(at), rows.starts.as_ptr().add(at * 8));
        let ones = _mm256_set1_epi16(1);
        let mut sums = [[_mm256_setzero_ps(); C]; R];
        let mut mins = [[0f32; C]; R];
        let mut codes = [_mm256_setzero_si256(); C];
        let mut magnitudes = [_mm256_setzero_si256(); C];
        let mut w_scales = [0f32; C];
        let mut w_mins = [0f32; C];
        for b in 0..blocks {
            for j in 0..C {
                let block = w_rows.add(j * row_bytes + b * F::BYTES);
                if b % 2 == 0 {
                    ahead(block, C * row_bytes);
                }
                codes[j] = F::codes256(block);
                if signed {
                    // The signed weights, and their magnitudes.
                    codes[j] = _mm256_xor_si256(codes[j], _mm256_set1_epi8(-128));
                    magnitudes[j] = _mm256_sign_epi8(codes[j], codes[j]);
                }
                w_scales[j] = half(block, 0);
                if let Some(min) = F::MIN {
                    w_mins[j] = half(block, min);
                }
            }
            for i in 0..R {
                let at = i * rows.stride + b;
                let xs = _mm256_lddqu_si256(x_values.add(at * BLOCK).cast());
                let x_scale = *x_scales.add(at);
                for j in 0..C {
                    let dot = if signed {
                        let pairs =
                            _mm256_maddubs_epi16(magnitudes[j], _mm256_sign_epi8(xs, codes[j]));
                        _mm256_madd_epi16(pairs, ones)
                    } else {
                        let start = _mm256_lddqu_si256(x_starts.add(at * 8).cast());
                        let pairs = _mm256_maddubs_epi16(codes[j], xs);
                        _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), start)
                    };
                    sums[i][j] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(dot),
                        _mm256_set1_ps(w_scales[j] * x_scale),
                        sums[i][j],
                    );
                    if F::MIN.is_some() {
                        mins[i][j] += w_mins[j] * *x_sums.add(at);
                    }
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
                    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps::<1>(pairs, pairs)))
                        + mins[i][j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::sines;

    /// Against candle's product of the same blocks (`QTensor` as a `CustomOp1`: ggml's `vec_dot` per
    /// row of `x` and weight row, after rounding `x` as `Rows` does), for each type here and every
    /// kernel this CPU runs (the plain loop too), at decoding's batch sizes, widths of 1 to 48 blocks
    /// (odd and even counts: the VNNI kernel's last single block) and odd numbers of weight rows (the
    /// tiles' leftover columns; also what keeps candle off its repacked kernels, which round `x` to
    /// Q8_K instead).
    ///
    /// Both sum the same integer products `(c - z) · q`, exactly within each group of four values (a
    /// vector lane), then each lane's sum times `d_w · d_x` (the scale product rounded once) over the
    /// blocks in f32, then the lanes, and for Q4_1 and Q5_1 the terms `m · s_x`, in different orders.
    /// By the usual bound on a sum in f32, each differs from the exact sum by at most
    /// `(B + 6) · u · Σ |term|` for `B` blocks (each lane sums `B` terms, each term rounded twice, the
    /// lanes added in 4 levels; u = 2⁻²⁴), `Σ |term|` at most `Σ |(c - z) · q| · d_w · d_x + Σ |m · s_x|`,
    /// so the two by at most twice that; the test allows `2 (2B + 8) · ε` times that sum (ε = 2u, twice
    /// the bound again), at these widths under a ten-thousandth of the outputs' size, while a wrong code,
    /// scale or minimum misses by the outputs' own size.
    #[test]
    fn equals_candles_products() {
        fn check<F: Block>(dtype: GgmlDType) {
            for (k, n) in [(32, 1), (96, 7), (576, 67), (1536, 13)] {
                let weight = sines((n, k), 0.37, DType::F32);
                let blocks = QTensor::quantize(&weight, dtype).unwrap();
                let data = blocks.data().unwrap().into_owned();
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
                    let rounded = Rows::new(&xs, m, k, F::ZERO, Kernel::Plain);
                    let magnitude = |row: usize, column: usize| -> f32 {
                        let w_row = &data[column * k / BLOCK * F::BYTES..][..k / BLOCK * F::BYTES];
                        w_row
                            .chunks_exact(F::BYTES)
                            .enumerate()
                            .map(|(b, block)| {
                                let at = row * k / BLOCK + b;
                                let xs = &rounded.values[at * BLOCK..][..BLOCK];
                                let products: i32 = F::codes(block)
                                    .iter()
                                    .zip(xs)
                                    .map(|(&c, &q)| ((i32::from(c) - F::ZERO) * i32::from(q)).abs())
                                    .sum();
                                let min = F::MIN
                                    .map_or(0.0, |min| half_at(block, min) * rounded.sums[at]);
                                (products as f32 * half_at(block, 0) * rounded.scales[at]).abs()
                                    + min.abs()
                            })
                            .sum()
                    };
                    let bound = 2.0 * (2 * k / BLOCK + 8) as f32 * f32::EPSILON;
                    for kernel in [Kernel::Avx512Vnni, Kernel::Avx2, Kernel::Plain] {
                        if !kernel.available() {
                            eprintln!("{kernel:?} does not run on this CPU: not compared");
                            continue;
                        }
                        let mut out = vec![f32::NAN; m * n];
                        product::<F>(kernel, &data, &xs, m, n, k, &mut out);
                        for row in 0..m {
                            for column in 0..n {
                                let (got, want) =
                                    (out[row * n + column], expected[row * n + column]);
                                let allowed = bound * magnitude(row, column);
                                assert!(
                                    (got - want).abs() <= allowed,
                                    "{dtype:?} {kernel:?} [{m}, {k}] x [{n}, {k}] at ({row}, \
                                     {column}): {got} vs {want} (allowed {allowed})"
                                );
                            }
                        }
                    }
                }
            }
        }
        check::<Q8_0>(GgmlDType::Q8_0);
        check::<Q4_0>(GgmlDType::Q4_0);
        check::<Q4_1>(GgmlDType::Q4_1);
        check::<Q5_0>(GgmlDType::Q5_0);
        check::<Q5_1>(GgmlDType::Q5_1);
    }

    /// The vector rounding gives the plain loop's bytes and scale for every block: ties (a value whose
    /// `x / d` ends in exactly one half, rounded away from zero there, to even in the lanes' own
    /// rounding), zeros, a block of zeros, a block whose largest value is negative, and sines.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_rounding_is_the_plain_rounding() {
        if !Kernel::Avx2.available() {
            eprintln!("no AVX2 on this CPU: nothing to compare");
            return;
        }
        // With max |x| = 127, d = 1: x / d is x, and ±0.5, ±2.5, ±125.5 are ties.
        let ties: [f32; BLOCK] = std::array::from_fn(|j| match j {
            0 => 127.0,
            _ => (j as f32 - 16.0) * if j % 2 == 0 { 1.0 } else { 7.75 } + 0.5,
        });
        let mut blocks = vec![ties, ties.map(|x| -x), [0.0; BLOCK]];
        blocks.push(std::array::from_fn(|j| {
            if j == 5 {
                -3.0
            } else {
                j as f32 * 0.01
            }
        }));
        let waves = sines((16, BLOCK), 0.7, DType::F32)
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>();
        for wave in waves.unwrap().chunks_exact(BLOCK) {
            blocks.push(wave.try_into().unwrap());
        }
        for xs in &blocks {
            let (mut plain, mut vector) = ([0i8; BLOCK], [0i8; BLOCK]);
            let d = round(xs, &mut plain);
            // SAFETY: AVX2 is checked above.
            let vector_d = unsafe { x86::round(xs, &mut vector) };
            assert_eq!((vector_d.to_bits(), vector), (d.to_bits(), plain), "{xs:?}");
        }
        // The ties did round away from zero: 2.5 to 3, -2.5 to -3 (not 2 and -2, to even).
        let mut qs = [0i8; BLOCK];
        round(&ties, &mut qs);
        assert_eq!((ties[18], qs[18], ties[2], qs[2]), (2.5, 3, -13.5, -14));
    }

    /// Through the tensor entry: bf16 activations come back bf16; k-quants are not taken and a width
    /// that is not the weight's is refused.
    #[test]
    fn takes_the_types_it_covers() {
        let weight = sines((5, 64), 0.3, DType::F32);
        let q8 = QTensor::quantize(&weight, GgmlDType::Q8_0).unwrap();
        let q4k = QTensor::quantize(&sines((5, 256), 0.3, DType::F32), GgmlDType::Q4K).unwrap();
        let x = sines((3, 64), 0.2, DType::BF16);
        assert!(suits(&q8, &x) && suits(&q8, &sines((300, 64), 0.2, DType::F32)));
        assert!(!suits(&q4k, &sines((3, 256), 0.2, DType::F32)));
        let got = matmul(&x, &q8).unwrap();
        assert_eq!((got.dtype(), got.dims()), (DType::BF16, &[3, 5][..]));
        let error = matmul(&sines((3, 32), 0.2, DType::F32), &q8).unwrap_err();
        assert!(error.to_string().contains("[3, 32]"), "{error}");
    }
}
