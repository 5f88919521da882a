//! bf16 weights with f32 arithmetic on the CPU: `y = x · wᵀ` for f32 activations `x` `[M, K]` and bf16
//! weights `w` `[N, K]`, accumulated in f32.
//!
//! Decoding a batch reads every weight once per token, so on the CPU it runs at the speed of memory, not
//! of arithmetic: weights half the size of f32 make it up to twice as fast, and halve the model's
//! memory. candle's CPU matrix product has no bf16, so this is our own kernel. A bf16 value is the top
//! half of an f32, so widening it is a shift; products and sums are f32, which keeps activations as
//! exact as they are in the f32 model (only the weights are rounded).
//!
//! The kernel tiles `x` by 4 rows and `w` by 4 rows: 16 running sums of 16 lanes over `K`, written so
//! that the compiler vectorizes them, in three builds picked at run time (AVX-512, AVX2 with FMA, and
//! plain). The 4 weight rows of a tile stay in the L1 cache while every 4-row block of `x` passes over
//! them; threads share the weight rows out.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use super::model::Result;

/// `x` `[M, K]` (f32) times `weight` `[N, K]` (bf16) transposed: `[M, N]` (f32). No backward: sampling
/// only.
pub fn matmul(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if x.dtype() != DType::F32 || weight.dtype() != DType::BF16 {
        candle_core::bail!(
            "bf16 weight product of {:?} activations and {:?} weights (expected f32 and bf16)",
            x.dtype(),
            weight.dtype()
        );
    }
    x.contiguous()?
        .apply_op2_no_bwd(&weight.contiguous()?, &Bf16WeightMatmul)
}

struct Bf16WeightMatmul;

impl CustomOp2 for Bf16WeightMatmul {
    fn name(&self) -> &'static str {
        "bf16-weight-matmul"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k) = x_layout.shape().dims2()?;
        let (n, w_k) = w_layout.shape().dims2()?;
        if k != w_k {
            candle_core::bail!("bf16 weight product: x is [{m}, {k}] but the weight is [{n}, {w_k}]");
        }
        let (CpuStorage::F32(x), CpuStorage::BF16(w)) = (x, w) else {
            candle_core::bail!("bf16 weight product needs f32 activations and bf16 weights");
        };
        let (Some((x_start, x_end)), Some((w_start, w_end))) =
            (x_layout.contiguous_offsets(), w_layout.contiguous_offsets())
        else {
            candle_core::bail!("bf16 weight product needs contiguous operands");
        };
        let mut out = vec![0f32; m * n];
        product(&x[x_start..x_end], &w[w_start..w_end], m, n, k, &mut out);
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }
}

const LANES: usize = 16;
/// Rows of `x` and of `w` in one tile.
const TILE: usize = 4;
/// Output columns (weight rows) one task computes.
const COLUMNS_PER_TASK: usize = 64;

/// The output pointer shared by the tasks, each of which writes its own columns.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint columns of the output, which outlives them.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

fn product(x: &[f32], w: &[bf16], m: usize, n: usize, k: usize, out: &mut [f32]) {
    // bf16 is a transparent u16 wrapper; the bits are what the kernel widens.
    let w: &[u16] = bytemuck_u16(w);
    let out_ptr = Out(out.as_mut_ptr());
    let tasks = n.div_ceil(COLUMNS_PER_TASK);
    (0..tasks).into_par_iter().for_each(|task| {
        let columns = task * COLUMNS_PER_TASK..((task + 1) * COLUMNS_PER_TASK).min(n);
        let out = out_ptr;
        // SAFETY: `columns` are this task's alone and lie inside `out` ([m, n]).
        unsafe { columns_dispatch(x, w, m, n, k, columns, out) }
    });
}

fn bytemuck_u16(w: &[bf16]) -> &[u16] {
    // SAFETY: `half::bf16` is `#[repr(transparent)]` over `u16`.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u16>(), w.len()) }
}

/// # Safety
/// `columns` must be within `0..n` and written by no one else while this runs.
unsafe fn columns_dispatch(
    x: &[f32],
    w: &[u16],
    m: usize,
    n: usize,
    k: usize,
    columns: std::ops::Range<usize>,
    out: Out,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return columns_avx512(x, w, m, n, k, columns, out);
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return columns_avx2(x, w, m, n, k, columns, out);
        }
    }
    columns_generic::<false>(x, w, m, n, k, columns, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn columns_avx512(
    x: &[f32],
    w: &[u16],
    m: usize,
    n: usize,
    k: usize,
    columns: std::ops::Range<usize>,
    out: Out,
) {
    columns_generic::<true>(x, w, m, n, k, columns, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn columns_avx2(
    x: &[f32],
    w: &[u16],
    m: usize,
    n: usize,
    k: usize,
    columns: std::ops::Range<usize>,
    out: Out,
) {
    columns_generic::<true>(x, w, m, n, k, columns, out)
}

/// Output columns `columns` of every row. `FMA` fuses multiply and add (only where the CPU has it:
/// elsewhere `mul_add` is a slow library call).
#[inline(always)]
unsafe fn columns_generic<const FMA: bool>(
    x: &[f32],
    w: &[u16],
    m: usize,
    n: usize,
    k: usize,
    columns: std::ops::Range<usize>,
    out: Out,
) {
    let mut column = columns.start;
    while column < columns.end {
        let width = (columns.end - column).min(TILE);
        let mut row = 0;
        while row < m {
            let height = (m - row).min(TILE);
            match (height, width) {
                (4, 4) => tile::<FMA, 4, 4>(x, w, n, k, row, column, out),
                (h, 4) => {
                    for r in row..row + h {
                        tile::<FMA, 1, 4>(x, w, n, k, r, column, out);
                    }
                }
                (h, c) => {
                    for r in row..row + h {
                        for col in column..column + c {
                            tile::<FMA, 1, 1>(x, w, n, k, r, col, out);
                        }
                    }
                }
            }
            row += height;
        }
        column += width;
    }
}

#[inline(always)]
fn widen(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[inline(always)]
fn multiply_add<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Rows `row..row + R` of `x` against weight rows `column..column + C`: `R × C` outputs.
#[inline(always)]
unsafe fn tile<const FMA: bool, const R: usize, const C: usize>(
    x: &[f32],
    w: &[u16],
    n: usize,
    k: usize,
    row: usize,
    column: usize,
    out: Out,
) {
    let x_rows: [&[f32]; R] = std::array::from_fn(|i| &x[(row + i) * k..(row + i + 1) * k]);
    let w_rows: [&[u16]; C] = std::array::from_fn(|j| &w[(column + j) * k..(column + j + 1) * k]);
    let mut sums = [[[0f32; LANES]; C]; R];
    let main = k - k % LANES;
    let mut at = 0;
    while at < main {
        let widened: [[f32; LANES]; C] =
            std::array::from_fn(|j| std::array::from_fn(|l| widen(w_rows[j][at + l])));
        for i in 0..R {
            let xs = &x_rows[i][at..at + LANES];
            for j in 0..C {
                for l in 0..LANES {
                    sums[i][j][l] = multiply_add::<FMA>(xs[l], widened[j][l], sums[i][j][l]);
                }
            }
        }
        at += LANES;
    }
    for i in 0..R {
        for j in 0..C {
            let mut total = sums[i][j].iter().sum::<f32>();
            for at in main..k {
                total = multiply_add::<FMA>(x_rows[i][at], widen(w_rows[j][at]), total);
            }
            // SAFETY: the caller owns column `column + j` of every row.
            *out.0.add((row + i) * n + column + j) = total;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Against candle's f32 product of the same (bf16-rounded) weights, over shapes that exercise every
    /// tail: rows and columns not multiples of 4, `K` not a multiple of 16.
    #[test]
    fn equals_the_f32_product_of_the_rounded_weights() {
        let device = Device::Cpu;
        for (m, n, k) in [(1, 1, 1), (3, 5, 7), (4, 4, 16), (8, 130, 40), (9, 67, 33), (2, 300, 896)] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &device).unwrap();
            let weight = Tensor::randn(0f32, 0.5, (n, k), &device)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let expected = x
                .matmul(&weight.to_dtype(DType::F32).unwrap().t().unwrap())
                .unwrap();
            let got = matmul(&x, &weight).unwrap();
            assert_eq!(got.dims(), &[m, n]);
            let diff = (got - &expected)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let scale = expected.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff <= 1e-5 * scale.max(1.0), "[{m}, {k}] x [{n}, {k}]: {diff}");
        }
    }

    #[test]
    fn refuses_other_dtypes_and_shapes() {
        let device = Device::Cpu;
        let x = Tensor::zeros((2, 3), DType::F32, &device).unwrap();
        let f32_weight = Tensor::zeros((4, 3), DType::F32, &device).unwrap();
        assert!(matmul(&x, &f32_weight).is_err());
        let wrong_k = Tensor::zeros((4, 5), DType::BF16, &device).unwrap();
        let error = matmul(&x, &wrong_k).unwrap_err().to_string();
        assert!(error.contains("[2, 3]") && error.contains("[4, 5]"), "{error}");
    }
}
