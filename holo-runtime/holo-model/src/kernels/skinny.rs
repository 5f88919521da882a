//! Products of a few rows of f32 activations with a whole weight matrix, on the CPU: `y = x · wᵀ` for
//! `x` `[M, K]` and bf16 or f32 weights `w` `[N, K]`, accumulated in f32. This is decoding: every step
//! multiplies one row per sequence by every weight of the model.
//!
//! Such a product reads each weight once, so it should run at the speed of memory. candle's CPU matrix
//! product is made for large `M` (it packs its operands into blocks) and reaches a third of that at these
//! shapes; its bf16 is not vectorised at all. These kernels stream the weight rows instead. A bf16 value
//! is the top half of an f32, so widening it is a shift; products and sums are f32, which keeps
//! activations as exact as they are in the f32 model (only the weights are rounded).
//!
//! The kernels tile `x` by rows and `w` by rows, keeping the tile's running sums in vector registers over
//! `K`; AVX-512 or AVX2 is picked at run time, with a plain loop elsewhere. The weight rows of
//! a tile stay in the L1 cache while every group of rows of `x` passes over them; threads share the weight
//! rows out. At decoding shapes the AVX2 kernel is bound by its loads and multiply-adds rather than by
//! memory (bf16: 10–15 GB/s of weights on 2 Zen cores whose memory gives 35), so its tile shapes are chosen
//! by measurement (`x86::avx2_kernel!`).
//!
//! No backward: [`Ops::Fast`](crate::Ops::Fast) only.

use std::ops::Range;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use super::kernel::Operands;
use super::kernel::Result;

/// The most rows of `x` for which f32 weights go through these kernels; beyond, candle's blocked product
/// wins (prefill).
const MAX_F32_ROWS: usize = 16;

/// The most rows for weights of at most [`NARROW_INPUTS`] inputs. Measured with `sample_bench` (2 Zen
/// cores with AVX-512, batch 64, 64 new tokens): on SmolLM2-135M (576 inputs, 1536 for the down
/// projection) decoding took 8.8 s with 16 rows here and the rest in gemm, 7.5 s with up to 64 rows, 7.4 s
/// with up to 64 rows for 576 inputs only; on Qwen2.5-0.5B's shapes (896 and 4864 inputs) up to 64 rows
/// was 18% slower at batch 32, as was sending only the 896-input weights here, or only the small ones.
const MAX_F32_ROWS_NARROW: usize = 64;

/// See [`MAX_F32_ROWS_NARROW`].
const NARROW_INPUTS: usize = 640;

/// The fewest f32 weights worth these kernels: candle is as fast on small matrices, and faster on tiny ones.
const MIN_F32_WEIGHTS: usize = 1 << 18;

/// Below this many weights a product runs on the calling thread: splitting it costs more than it saves.
const MIN_PARALLEL_WEIGHTS: usize = 1 << 16;

/// Whether [`matmul`] should compute `x · weightᵀ` for the sampling path: bf16 weights with f32
/// activations on the CPU always (nothing else computes them), f32 weights for a few rows when the CPU
/// has AVX2; never on another device (the op has no kernel there).
pub fn suits(operands: &Operands) -> bool {
    let few_rows = operands.rows <= MAX_F32_ROWS
        || (operands.rows <= MAX_F32_ROWS_NARROW && operands.inputs <= NARROW_INPUTS);
    let f32_suits =
        Kernel::Avx2.available() && few_rows && operands.weight_elements >= MIN_F32_WEIGHTS;
    takes(operands) && (operands.weight == DType::BF16 || f32_suits)
}

/// Whether [`matmul`] can compute `x · weightᵀ` at all: f32 activations and bf16 or f32 weights on the
/// CPU, any number of rows. Batch-invariant sampling sends every product here: each output is one
/// weight row's dot product with one row of `x`, summed in an order that depends only on `K`, whatever
/// the rows around it.
pub fn takes(operands: &Operands) -> bool {
    operands.x == DType::F32
        && operands.on_cpu()
        && matches!(operands.weight, DType::BF16 | DType::F32)
}

/// `x` `[M, K]` (f32) times `weight` `[N, K]` (bf16 or f32) transposed: `[M, N]` (f32). No backward:
/// sampling only.
pub fn matmul(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if x.dtype() != DType::F32 || !matches!(weight.dtype(), DType::BF16 | DType::F32) {
        candle_core::bail!(
            "skinny product of {:?} activations and {:?} weights (expected f32, and bf16 or f32)",
            x.dtype(),
            weight.dtype()
        );
    }
    x.contiguous()?
        .apply_op2_no_bwd(&weight.contiguous()?, &SkinnyMatmul)
}

struct SkinnyMatmul;

impl CustomOp2 for SkinnyMatmul {
    fn name(&self) -> &'static str {
        "skinny-matmul"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, n, k) = product_dims("skinny", x_layout, w_layout)?;
        let (Some((x_start, x_end)), Some((w_start, w_end))) =
            (x_layout.contiguous_offsets(), w_layout.contiguous_offsets())
        else {
            candle_core::bail!("skinny product needs contiguous operands");
        };
        let CpuStorage::F32(x) = x else {
            candle_core::bail!("skinny product needs f32 activations");
        };
        let x = &x[x_start..x_end];
        let mut out = vec![0f32; m * n];
        match w {
            CpuStorage::BF16(w) => {
                // SAFETY: `half::bf16` is `#[repr(transparent)]` over `u16`; its bits are what the
                // kernels widen.
                let w = unsafe {
                    std::slice::from_raw_parts(w[w_start..w_end].as_ptr().cast::<u16>(), n * k)
                };
                product(Weights::Bf16(w), x, m, n, k, &mut out);
            }
            CpuStorage::F32(w) => product(Weights::F32(&w[w_start..w_end]), x, m, n, k, &mut out),
            _ => candle_core::bail!("skinny product needs bf16 or f32 weights"),
        }
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }
}

/// `(M, N, K)` of `x` `[M, K]` times `w` `[N, K]` transposed, or an error naming the `product` whose
/// operands do not fit.
pub(crate) fn product_dims(
    product: &str,
    x_layout: &Layout,
    w_layout: &Layout,
) -> Result<(usize, usize, usize)> {
    let (m, k) = x_layout.shape().dims2()?;
    let (n, w_k) = w_layout.shape().dims2()?;
    if k != w_k {
        candle_core::bail!("{product} product: x is [{m}, {k}] but the weight is [{n}, {w_k}]");
    }
    Ok((m, n, k))
}

/// Output columns (weight rows) one task computes.
const COLUMNS_PER_TASK: usize = 64;

/// The output pointer shared by the tasks, each of which writes its own columns.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint columns of the output, which outlives them.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// The weights `[N, K]`: bf16 (as bits) or f32.
#[derive(Clone, Copy)]
enum Weights<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

impl Weights<'_> {
    fn len(&self) -> usize {
        match self {
            Weights::Bf16(w) => w.len(),
            Weights::F32(w) => w.len(),
        }
    }
}

/// The kernels, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Avx512,
    Avx2,
    Plain,
}

impl Kernel {
    fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma")
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
        [Kernel::Avx512, Kernel::Avx2, Kernel::Plain]
            .into_iter()
            .find(|kernel| kernel.available())
            .unwrap_or(Kernel::Plain)
    }
}

fn product(w: Weights, x: &[f32], m: usize, n: usize, k: usize, out: &mut [f32]) {
    product_with(Kernel::best(), w, x, m, n, k, out)
}

fn product_with(
    kernel: Kernel,
    w: Weights,
    x: &[f32],
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
) {
    assert!(kernel.available(), "{kernel:?} does not run on this CPU");
    assert!(x.len() == m * k && w.len() == n * k && out.len() == m * n);
    let out = Out(out.as_mut_ptr());
    let task = |task: usize| {
        let columns = task * COLUMNS_PER_TASK..((task + 1) * COLUMNS_PER_TASK).min(n);
        // SAFETY: the lengths are checked above, `columns` are this task's alone, and the kernel is
        // available.
        unsafe { columns_with(kernel, w, x, m, n, k, columns, out) }
    };
    let tasks = n.div_ceil(COLUMNS_PER_TASK);
    if n * k < MIN_PARALLEL_WEIGHTS {
        (0..tasks).for_each(task);
    } else {
        // On candle's pool, as the layer's other operations (see `matrix`).
        candle_core::utils::barrier_pool().execute_chunked(tasks, |tasks| tasks.for_each(task));
    }
}

/// # Safety
/// `x` is `[m, k]`, `w` `[n, k]`, `out` points to `[m, n]`; `columns` lie within `0..n` and are written
/// by no one else while this runs; `kernel` is available.
#[allow(clippy::too_many_arguments)]
unsafe fn columns_with(
    kernel: Kernel,
    w: Weights,
    x: &[f32],
    m: usize,
    n: usize,
    k: usize,
    columns: Range<usize>,
    out: Out,
) {
    match (kernel, w) {
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx512, Weights::Bf16(w)) => x86::columns_avx512(x, w, m, n, k, columns, out),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx512, Weights::F32(w)) => x86::columns_avx512(x, w, m, n, k, columns, out),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, Weights::Bf16(w)) => x86::columns_avx2_bf16(x, w, m, n, k, columns, out),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, Weights::F32(w)) => x86::columns_avx2_f32(x, w, m, n, k, columns, out),
        (_, Weights::Bf16(w)) => plain(x, w, m, n, k, columns, out, widen),
        (_, Weights::F32(w)) => plain(x, w, m, n, k, columns, out, |w| w),
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn plain<W: Copy>(
    x: &[f32],
    w: &[W],
    m: usize,
    n: usize,
    k: usize,
    columns: Range<usize>,
    out: Out,
    to_f32: impl Fn(W) -> f32,
) {
    for column in columns {
        let w_row = &w[column * k..(column + 1) * k];
        for row in 0..m {
            let x_row = &x[row * k..(row + 1) * k];
            let total = x_row
                .iter()
                .zip(w_row)
                .map(|(&x, &w)| x * to_f32(w))
                .sum::<f32>();
            *out.0.add(row * n + column) = total;
        }
    }
}

fn widen(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// The kernels with AVX-512 (16 lanes, tiles of 4 × 4, bf16 and f32) and AVX2 (8 lanes, 16 vector
/// registers, tiles of 8 × 1 to 1 × 4, bf16 and f32). Each tile keeps its `R × C` running sums in registers
/// over `K`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // index loops over constant-size tiles unroll into registers
mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{widen, Out};

    /// A weight type the AVX-512 kernel reads 16 at a time as f32.
    pub(crate) trait Wide: Copy {
        /// 16 weights from `p` as f32.
        ///
        /// # Safety
        /// `p` points to 16 readable weights and the CPU has AVX-512F.
        unsafe fn load16(p: *const Self) -> __m512;
        fn to_f32(self) -> f32;
    }

    /// bf16 bits: widened by a shift.
    impl Wide for u16 {
        #[inline(always)]
        unsafe fn load16(p: *const u16) -> __m512 {
            let bits = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
        }

        fn to_f32(self) -> f32 {
            widen(self)
        }
    }

    impl Wide for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }

        fn to_f32(self) -> f32 {
            self
        }
    }

    /// Tiles of 4 rows of `x` by 4 weight rows over `columns`, then the leftover rows and columns.
    ///
    /// While a group of 4 weight rows is multiplied by every row of `x`, the next group is prefetched,
    /// a few cache lines per step of the tiles' loop: without it a group's first tile waited on memory
    /// and its other tiles (on weights by then in cache) left memory idle, so that at 16 rows of `x`
    /// the kernel read f32 weights at half the rate it reads them for one row.
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) unsafe fn columns_avx512<W: Wide>(
        x: &[f32],
        w: &[W],
        m: usize,
        n: usize,
        k: usize,
        columns: Range<usize>,
        out: Out,
    ) {
        if m == 1 && k * std::mem::size_of::<W>() >= LONG_ROW {
            return row_avx512(x, w, k, columns, out);
        }
        let tiles = m / 4 + m % 4;
        let mut column = columns.start;
        while column + 4 <= columns.end {
            let next_rows = n.saturating_sub(column + 4).min(4);
            let lines = (next_rows * k * std::mem::size_of::<W>()).div_ceil(LINE);
            let next = Ahead {
                start: w.as_ptr().add((column + 4).min(n) * k).cast::<i8>(),
                lines: lines.div_ceil(tiles.max(1)),
                total: lines,
            };
            let mut row = 0;
            let mut tile = 0;
            while row + 4 <= m {
                tile_avx512::<W, 4, 4>(x, w, n, k, row, column, out, next.part(tile));
                row += 4;
                tile += 1;
            }
            while row < m {
                tile_avx512::<W, 1, 4>(x, w, n, k, row, column, out, next.part(tile));
                row += 1;
                tile += 1;
            }
            column += 4;
        }
        for column in column..columns.end {
            for row in 0..m {
                tile_avx512::<W, 1, 1>(x, w, n, k, row, column, out, Ahead::NONE);
            }
        }
    }

    /// How far ahead of its loads [`row_avx512`] prefetches each weight row, in bytes. Measured with
    /// `skinny_bench` at Olmo-3-7B's shapes (f32, one core of a Xeon with a 48 KiB L1 and 2 MiB L2): 15–15.7
    /// GB/s of weights with 2 KiB into L1, 14–15 with 1 or 3–4 KiB or with 8 weight rows a tile, 12–14 into L2
    /// only, against 12–13 with no prefetch or with the many-rows kernel's of the next group of rows.
    const ROW_AHEAD: usize = 2048;

    /// The fewest bytes of a weight row for which one row of `x` goes through [`row_avx512`]. In shorter
    /// rows a line [`ROW_AHEAD`] bytes ahead is mostly in the next weight row of the tile, already being
    /// read: at SmolLM2-135M's head (576 inputs) one row read 11 GB/s of f32 weights that way, against
    /// 14–19 with [`columns_avx512`]'s prefetch of the next group's rows.
    const LONG_ROW: usize = 4 * ROW_AHEAD;

    /// One row of `x` against weight rows `columns`, 4 at a time, each weight row prefetched
    /// [`ROW_AHEAD`] bytes ahead of its loads. At one row nothing is reused: the kernel is a stream of
    /// weights, and [`columns_avx512`]'s prefetch of the next group's rows (64 KiB ahead at `K` = 4096, more
    /// than L1 holds) left a core reading f32 weights at 12.5 GB/s where torch's reads 16.5. The sums are
    /// those of [`tile_avx512`], in the same order.
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn row_avx512<W: Wide>(x: &[f32], w: &[W], k: usize, columns: Range<usize>, out: Out) {
        let mut column = columns.start;
        while column + 4 <= columns.end {
            row_tile_avx512::<W, 4>(x, w, k, column, out);
            column += 4;
        }
        for column in column..columns.end {
            row_tile_avx512::<W, 1>(x, w, k, column, out);
        }
    }

    /// Row 0 of `x` against weight rows `column..column + C`, prefetching each [`ROW_AHEAD`] bytes
    /// ahead, once per cache line.
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    unsafe fn row_tile_avx512<W: Wide, const C: usize>(
        x: &[f32],
        w: &[W],
        k: usize,
        column: usize,
        out: Out,
    ) {
        let (x_row, w_rows) = (x.as_ptr(), w.as_ptr().add(column * k));
        let mut sums = [_mm512_setzero_ps(); C];
        let main = k - k % 16;
        // Loads of 16 weights per cache line: 1 for f32, 2 for bf16.
        let steps_per_line = (LINE / (16 * std::mem::size_of::<W>())).max(1);
        let mut step = 0;
        let mut at = 0;
        while at < main {
            if step % steps_per_line == 0 {
                for j in 0..C {
                    // Wrapping: past the last row the address is never read (a prefetch does not fault).
                    let ahead = w_rows.add(j * k + at).cast::<i8>().wrapping_add(ROW_AHEAD);
                    _mm_prefetch::<_MM_HINT_T0>(ahead);
                }
            }
            let xs = _mm512_loadu_ps(x_row.add(at));
            for j in 0..C {
                sums[j] = _mm512_fmadd_ps(xs, W::load16(w_rows.add(j * k + at)), sums[j]);
            }
            at += 16;
            step += 1;
        }
        for j in 0..C {
            let mut total = _mm512_reduce_add_ps(sums[j]);
            for at in main..k {
                total = (*x_row.add(at)).mul_add((*w_rows.add(j * k + at)).to_f32(), total);
            }
            *out.0.add(column + j) = total;
        }
    }

    /// The bytes of a cache line.
    const LINE: usize = 64;

    /// Cache lines to prefetch from `start`: a tile's share of the next weight rows, `lines` of them
    /// (fewer at the end of `total`).
    #[derive(Clone, Copy)]
    struct Ahead {
        start: *const i8,
        lines: usize,
        total: usize,
    }

    impl Ahead {
        const NONE: Ahead = Ahead {
            start: std::ptr::null(),
            lines: 0,
            total: 0,
        };

        /// The share of tile `tile`, which prefetches lines `tile · lines ..` of the whole.
        fn part(self, tile: usize) -> Ahead {
            let first = (tile * self.lines).min(self.total);
            let lines = self.lines.min(self.total - first);
            Ahead {
                // Wrapping: an empty share may point past the weights; it is never read.
                start: self.start.wrapping_add(first * LINE),
                lines,
                total: lines,
            }
        }
    }

    /// Rows `row..row + R` of `x` against weight rows `column..column + C`, prefetching `ahead`'s lines
    /// a few per step of `K`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    unsafe fn tile_avx512<W: Wide, const R: usize, const C: usize>(
        x: &[f32],
        w: &[W],
        n: usize,
        k: usize,
        row: usize,
        column: usize,
        out: Out,
        ahead: Ahead,
    ) {
        let (x_rows, w_rows) = (x.as_ptr().add(row * k), w.as_ptr().add(column * k));
        let mut sums = [[_mm512_setzero_ps(); C]; R];
        let mut widened = [_mm512_setzero_ps(); C];
        let main = k - k % 16;
        let per_step = ahead.lines.div_ceil((main / 16).max(1));
        let mut fetched = 0;
        let mut at = 0;
        while at < main {
            for _ in 0..per_step {
                if fetched < ahead.lines {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.start.add(fetched * LINE));
                    fetched += 1;
                }
            }
            for j in 0..C {
                widened[j] = W::load16(w_rows.add(j * k + at));
            }
            for i in 0..R {
                let xs = _mm512_loadu_ps(x_rows.add(i * k + at));
                for j in 0..C {
                    sums[i][j] = _mm512_fmadd_ps(xs, widened[j], sums[i][j]);
                }
            }
            at += 16;
        }
        for i in 0..R {
            for j in 0..C {
                let mut total = _mm512_reduce_add_ps(sums[i][j]);
                for at in main..k {
                    total = (*x_rows.add(i * k + at))
                        .mul_add((*w_rows.add(j * k + at)).to_f32(), total);
                }
                *out.0.add((row + i) * n + column + j) = total;
            }
        }
    }

    /// The largest `K` for which 8 rows of `x` (`8 · K` f32) stay in a 32 KiB L1 cache.
    const L1_ROWS_K: usize = 1024;

    /// An AVX2 kernel for weights of type `$w`, each loaded 8 at a time from pointer `$p` by `$load` and
    /// widened one at a time by `$scalar`.
    ///
    /// Rows of `x` go in groups against every column of the task. Tiles of `R` rows × `C` weight rows keep
    /// `R × C` sums in registers over `K`, loading each `x` vector once for `C` products and each weight
    /// vector once for `R`. 8 × 1 loads (and widens) weights least and keeps 8 sums in flight, but reads 8
    /// vectors of `x` per weight vector: the best while those rows stay in L1 (measured on Zen at
    /// Qwen2.5-0.5B's shapes, bf16: 14–15 GB/s of weights against 10–11 for 4 × 3); beyond, 4 × 3 reads `x`
    /// a third as often (down-projection, `K` = 4864: 14.6 GB/s against 8.2). Fewer rows take more
    /// columns, to keep enough independent sums in flight.
    macro_rules! avx2_kernel {
        ($columns:ident, $rows:ident, $tile:ident, $w:ty, |$p:ident| $load:expr, $scalar:expr) => {
            #[target_feature(enable = "avx2,fma")]
            pub(crate) unsafe fn $columns(
                x: &[f32],
                w: &[$w],
                m: usize,
                n: usize,
                k: usize,
                columns: Range<usize>,
                out: Out,
            ) {
                let mut row = 0;
                while row < m {
                    let columns = columns.clone();
                    row += match m - row {
                        8.. if k <= L1_ROWS_K => $rows::<8, 1>(x, w, n, k, row, columns, out),
                        4.. => $rows::<4, 3>(x, w, n, k, row, columns, out),
                        2 | 3 => $rows::<2, 4>(x, w, n, k, row, columns, out),
                        _ => $rows::<1, 4>(x, w, n, k, row, columns, out),
                    };
                }
            }

            /// Rows `row..row + R` over `columns`, `C` at a time; returns `R`.
            #[target_feature(enable = "avx2,fma")]
            #[inline]
            unsafe fn $rows<const R: usize, const C: usize>(
                x: &[f32],
                w: &[$w],
                n: usize,
                k: usize,
                row: usize,
                columns: Range<usize>,
                out: Out,
            ) -> usize {
                let mut column = columns.start;
                while column + C <= columns.end {
                    $tile::<R, C>(x, w, n, k, row, column, out);
                    column += C;
                }
                for column in column..columns.end {
                    $tile::<R, 1>(x, w, n, k, row, column, out);
                }
                R
            }

            /// Rows `row..row + R` of `x` against weight rows `column..column + C`.
            #[target_feature(enable = "avx2,fma")]
            #[inline]
            unsafe fn $tile<const R: usize, const C: usize>(
                x: &[f32],
                w: &[$w],
                n: usize,
                k: usize,
                row: usize,
                column: usize,
                out: Out,
            ) {
                let (x_rows, w_rows) = (x.as_ptr().add(row * k), w.as_ptr().add(column * k));
                let mut sums = [[_mm256_setzero_ps(); C]; R];
                let mut loaded = [_mm256_setzero_ps(); C];
                let main = k - k % 8;
                let mut at = 0;
                while at < main {
                    for j in 0..C {
                        let $p = w_rows.add(j * k + at);
                        loaded[j] = $load;
                    }
                    for i in 0..R {
                        let xs = _mm256_loadu_ps(x_rows.add(i * k + at));
                        for j in 0..C {
                            sums[i][j] = _mm256_fmadd_ps(xs, loaded[j], sums[i][j]);
                        }
                    }
                    at += 8;
                }
                for i in 0..R {
                    for j in 0..C {
                        let halves = _mm_add_ps(
                            _mm256_castps256_ps128(sums[i][j]),
                            _mm256_extractf128_ps::<1>(sums[i][j]),
                        );
                        let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
                        let mut total =
                            _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps::<1>(pairs, pairs)));
                        for at in main..k {
                            let scalar = $scalar(*w_rows.add(j * k + at));
                            total = (*x_rows.add(i * k + at)).mul_add(scalar, total);
                        }
                        *out.0.add((row + i) * n + column + j) = total;
                    }
                }
            }
        };
    }

    avx2_kernel!(
        columns_avx2_bf16,
        rows_avx2_bf16,
        tile_avx2_bf16,
        u16,
        |p| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p.cast())
        ))),
        widen
    );

    avx2_kernel!(
        columns_avx2_f32,
        rows_avx2_f32,
        tile_avx2_f32,
        f32,
        |p| _mm256_loadu_ps(p),
        |w: f32| w
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use half::bf16;

    /// Against candle's f32 product of the same weights (bf16-rounded, and f32), over shapes that
    /// exercise every tile and tail: no rows, rows in groups of 8, 4, 2 and 1, columns not multiples of
    /// the tiles (the prefetch of a last, partial group), `K` not a multiple of 16, and `K` past the L1
    /// bound.
    #[test]
    fn equals_the_f32_product() {
        let device = Device::Cpu;
        for (m, n, k) in [
            (0, 5, 7),
            (1, 1, 1),
            (1, 7, 2100),
            (3, 5, 7),
            (4, 4, 16),
            (8, 130, 40),
            (9, 67, 33),
            (2, 300, 896),
            (15, 37, 1000),
            (12, 29, 1100),
        ] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &device).unwrap();
            let bf16_weight = Tensor::randn(0f32, 0.5, (n, k), &device)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let f32_weight = Tensor::randn(0f32, 0.5, (n, k), &device).unwrap();
            for weight in [bf16_weight, f32_weight] {
                let dtype = weight.dtype();
                let expected = x
                    .matmul(&weight.to_dtype(DType::F32).unwrap().t().unwrap())
                    .unwrap();
                let got = matmul(&x, &weight).unwrap();
                assert_eq!(got.dims(), &[m, n]);
                let expected = expected.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let scale = expected.iter().fold(1f32, |max, v| max.max(v.abs()));
                let close = |got: &[f32], label: &str| {
                    for (i, (a, b)) in got.iter().zip(&expected).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 * scale,
                            "{label} {dtype:?} [{m}, {k}] x [{n}, {k}] at {i}: {a} vs {b}"
                        );
                    }
                };
                close(
                    &got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    "matmul",
                );
                let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let bits: Vec<u16>;
                let floats: Vec<f32>;
                let weights = if dtype == DType::BF16 {
                    bits = weight
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<bf16>()
                        .unwrap()
                        .iter()
                        .map(|w| w.to_bits())
                        .collect();
                    Weights::Bf16(&bits)
                } else {
                    floats = weight.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    Weights::F32(&floats)
                };
                for kernel in [Kernel::Avx512, Kernel::Avx2, Kernel::Plain] {
                    if kernel.available() {
                        let mut out = vec![f32::NAN; m * n];
                        product_with(kernel, weights, &xs, m, n, k, &mut out);
                        close(&out, &format!("{kernel:?}"));
                    }
                }
            }
        }
    }

    /// One row's outputs are the very sums the many-rows tiles compute for a row (the last of 5 goes
    /// through a tile of one row): only the prefetch differs. Weight rows not a multiple of the tiles,
    /// `K` not a multiple of 16 and weight rows long enough for the one-row kernel (f32; bf16 too at
    /// `K` = 4100) or not (bf16 at `K` = 1200).
    #[test]
    fn one_row_sums_as_many_rows_do() {
        for (m, n, k) in [(5, 11, 1200), (5, 6, 4100)] {
            one_row_sums_as_many_rows_do_at(m, n, k);
        }
    }

    fn one_row_sums_as_many_rows_do_at(m: usize, n: usize, k: usize) {
        let xs: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let floats: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0)
            .collect();
        let bits: Vec<u16> = floats
            .iter()
            .map(|&w| bf16::from_f32(w).to_bits())
            .collect();
        for weights in [Weights::F32(&floats), Weights::Bf16(&bits)] {
            for kernel in [Kernel::Avx512, Kernel::Avx2, Kernel::Plain] {
                if kernel.available() {
                    let mut many = vec![f32::NAN; m * n];
                    product_with(kernel, weights, &xs, m, n, k, &mut many);
                    let mut one = vec![f32::NAN; n];
                    product_with(kernel, weights, &xs[(m - 1) * k..], 1, n, k, &mut one);
                    let last = &many[(m - 1) * n..];
                    assert!(
                        one.iter()
                            .zip(last)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{kernel:?}: {one:?} vs {last:?}"
                    );
                }
            }
        }
    }

    /// f32 weights: up to 16 decoding rows, or 64 against weights of few inputs; gemm beyond.
    #[test]
    fn f32_weights_take_the_rows_they_were_measured_for() {
        if !Kernel::Avx2.available() {
            eprintln!("skipped: f32 weights go through these kernels only with AVX2");
            return;
        }
        let operands = |rows, inputs| Operands {
            location: candle_core::DeviceLocation::Cpu,
            x: DType::F32,
            weight: DType::F32,
            rows,
            inputs,
            weight_elements: inputs * 1536,
            trained: false,
        };
        for (rows, inputs, suited) in [
            (1, 896, true),
            (16, 4864, true),
            (17, 896, false),
            (64, 576, true),
            (65, 576, false),
            (64, 641, false),
        ] {
            assert_eq!(suits(&operands(rows, inputs)), suited, "{rows} × {inputs}");
        }
    }

    #[test]
    fn refuses_other_dtypes_and_shapes() {
        let device = Device::Cpu;
        let x = Tensor::zeros((2, 3), DType::F32, &device).unwrap();
        let f16_weight = Tensor::zeros((4, 3), DType::F16, &device).unwrap();
        assert!(matmul(&x, &f16_weight).is_err());
        let wrong_k = Tensor::zeros((4, 5), DType::BF16, &device).unwrap();
        let error = matmul(&x, &wrong_k).unwrap_err().to_string();
        assert!(
            error.contains("[2, 3]") && error.contains("[4, 5]"),
            "{error}"
        );
    }
}
