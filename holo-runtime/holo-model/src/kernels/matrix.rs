//! Matrix products of 2-D f32 or f64 tensors on the CPU: gemm, one block of the output per thread of
//! candle's barrier pool.
//!
//! candle's own product runs gemm on rayon's threads, while candle's element-wise operations (and our
//! kernels, `kernel::for_each_chunk`) run on its barrier pool. A layer alternates between the two, so
//! each pool's threads spin or sleep while the other's work, and wake late when their turn comes: on 2
//! cores, a Qwen2.5-0.5B-shaped GRPO step spent a quarter of its forward and backward CPU time spinning,
//! yielding or idle. Products of the training passes and of prefill come here instead, so one pool
//! runs the whole layer.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, WithDType};

use super::kernel::Result;

/// `a` `[M, K]` times `b` `[K, N]`: `[M, N]`, with no gradient. Contiguous or transposed f32 or f64
/// tensors on the CPU take [`product`]; anything else candle's product.
pub(crate) fn multiply(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.rank() == 2 && b.rank() == 2 && super::kernel::takes(a, &[b]) {
        a.apply_op2_no_bwd(b, &Multiply)
    } else {
        a.matmul(b)
    }
}

struct Multiply;

impl CustomOp2 for Multiply {
    fn name(&self) -> &'static str {
        "pooled-matmul"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        a_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        storage_product((a, a_layout, false), (b, b_layout, false))
    }
}

/// The product of two 2-D CPU storages read through their layouts, each transposed when its flag says
/// so: f32 or f64, both of one type.
pub(crate) fn storage_product(
    (a, a_layout, a_transposed): (&CpuStorage, &Layout, bool),
    (b, b_layout, b_transposed): (&CpuStorage, &Layout, bool),
) -> Result<(CpuStorage, Shape)> {
    fn operands<'a, T>(
        (a, a_layout, a_transposed): (&'a [T], &Layout, bool),
        (b, b_layout, b_transposed): (&'a [T], &Layout, bool),
    ) -> Result<(Operand<'a, T>, Operand<'a, T>)> {
        let a = Operand::of(a, a_layout)?.transposed_if(a_transposed);
        let b = Operand::of(b, b_layout)?.transposed_if(b_transposed);
        if a.columns != b.rows {
            candle_core::bail!(
                "matrix product of [{}, {}] and [{}, {}]",
                a.rows,
                a.columns,
                b.rows,
                b.columns
            )
        }
        Ok((a, b))
    }
    let product = match (a, b) {
        (CpuStorage::F32(a), CpuStorage::F32(b)) => {
            let (a, b) = operands((a, a_layout, a_transposed), (b, b_layout, b_transposed))?;
            let shape = Shape::from((a.rows, b.columns));
            (CpuStorage::F32(product(a, b)), shape)
        }
        (CpuStorage::F64(a), CpuStorage::F64(b)) => {
            let (a, b) = operands((a, a_layout, a_transposed), (b, b_layout, b_transposed))?;
            let shape = Shape::from((a.rows, b.columns));
            (CpuStorage::F64(product(a, b)), shape)
        }
        _ => candle_core::bail!("matrix product of {:?} and {:?}", a.dtype(), b.dtype()),
    };
    Ok(product)
}

/// A matrix read in place: its values from its first element on, its shape, and its strides.
struct Operand<'a, T> {
    values: &'a [T],
    rows: usize,
    columns: usize,
    row_stride: isize,
    column_stride: isize,
}

impl<'a, T> Operand<'a, T> {
    /// The 2-D tensor with `layout` over `storage`.
    fn of(storage: &'a [T], layout: &Layout) -> Result<Self> {
        let (rows, columns) = layout.shape().dims2()?;
        let strides = layout.stride();
        Ok(Self {
            values: &storage[layout.start_offset()..],
            rows,
            columns,
            row_stride: strides[0] as isize,
            column_stride: strides[1] as isize,
        })
    }

    /// The same values read as the transposed matrix when `transposed`.
    fn transposed_if(self, transposed: bool) -> Self {
        if !transposed {
            return self;
        }
        Self {
            rows: self.columns,
            columns: self.rows,
            row_stride: self.column_stride,
            column_stride: self.row_stride,
            ..self
        }
    }

    /// The row-major matrix `[rows, columns]` in `values`.
    #[cfg(test)]
    fn dense(values: &'a [T], rows: usize, columns: usize) -> Self {
        Self {
            values,
            rows,
            columns,
            row_stride: columns as isize,
            column_stride: 1,
        }
    }
}

/// Products smaller than this (`M·N·K`) run on the calling thread: gemm's own threading threshold.
const SERIAL_LIMIT: usize = 48 * 48 * 256;

/// Block edges fall on multiples of this many rows or columns (gemm's widest f32 micro-kernel tile).
const ALIGN: usize = 64;

/// `a` `[M, K]` times `b` `[K, N]`, row-major `[M, N]`: the output split along its longer side into one
/// block per thread of candle's barrier pool, each block a single-threaded gemm.
fn product<T: WithDType>(a: Operand<'_, T>, b: Operand<'_, T>) -> Vec<T> {
    let (m, k, n) = (a.rows, a.columns, b.columns);
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    let blocks = if m * n * k < SERIAL_LIMIT {
        1
    } else {
        threads.min(m.max(n).div_ceil(ALIGN))
    };
    product_in_blocks(a, b, blocks)
}

/// [`product`] in `blocks` blocks, which the pool's threads take as they come free.
fn product_in_blocks<T: WithDType>(a: Operand<'_, T>, b: Operand<'_, T>, blocks: usize) -> Vec<T> {
    let (m, k, n) = (a.rows, a.columns, b.columns);
    if m == 0 || n == 0 || k == 0 {
        return vec![T::zero(); m * n];
    }
    let along_rows = m >= n;
    let extent = if along_rows { m } else { n };
    let edge = |block: usize| (extent.div_ceil(ALIGN) * block / blocks * ALIGN).min(extent);
    let mut out = Vec::<T>::with_capacity(m * n);
    let (out_at, a_at, b_at) = (
        out.as_mut_ptr() as usize,
        a.values.as_ptr() as usize,
        b.values.as_ptr() as usize,
    );
    let run = |block: usize| {
        let (start, end) = (edge(block), edge(block + 1));
        if start == end {
            return;
        }
        let (out_ptr, a_ptr, b_ptr) = (out_at as *mut T, a_at as *const T, b_at as *const T);
        // SAFETY: blocks cover disjoint rows (or columns) of `out`, which has room for `m·n` values and
        // outlives every block; `a` and `b` address their values through their own strides from their
        // first element, inside the storages they were read from.
        unsafe {
            let (rows, columns, out_ptr, a_ptr, b_ptr) = if along_rows {
                let (skip_out, skip_a) = (start * n, start as isize * a.row_stride);
                (
                    end - start,
                    n,
                    out_ptr.add(skip_out),
                    a_ptr.offset(skip_a),
                    b_ptr,
                )
            } else {
                let skip_b = start as isize * b.column_stride;
                (
                    m,
                    end - start,
                    out_ptr.add(start),
                    a_ptr,
                    b_ptr.offset(skip_b),
                )
            };
            gemm::gemm(
                rows,
                columns,
                k,
                out_ptr,
                1,
                n as isize,
                false,
                a_ptr,
                a.column_stride,
                a.row_stride,
                b_ptr,
                b.column_stride,
                b.row_stride,
                T::zero(),
                T::one(),
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    };
    if blocks == 1 {
        run(0);
    } else {
        // Runs inline when called from one of the pool's own threads.
        candle_core::utils::barrier_pool().execute_chunked(blocks, |blocks| blocks.for_each(run));
    }
    // SAFETY: the blocks wrote every one of the `m·n` values (gemm without reading `out`).
    unsafe { out.set_len(m * n) };
    out
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::testing::{max_difference, sines};

    /// Split along rows and along columns, below and above the serial limit, with ragged blocks and
    /// transposed operands: candle's product.
    #[test]
    fn products_are_candles_in_every_split() {
        for (m, k, n) in [
            (3, 5, 7),
            (200, 96, 70),
            (70, 96, 200),
            (130, 300, 129),
            (1, 1, 1),
        ] {
            for dtype in [DType::F64, DType::F32] {
                let tolerance = if dtype == DType::F64 { 1e-12 } else { 1e-4 };
                let a = sines((m, k), 0.37, dtype);
                let b = sines((k, n), 0.11, dtype);
                let b_transposed = sines((n, k), 0.11, dtype);
                for (a, b) in [
                    (a.clone(), b.clone()),
                    (a.clone(), b_transposed.t().unwrap()),
                    (sines((k, m), 0.23, dtype).t().unwrap(), b.clone()),
                ] {
                    let ours = multiply(&a, &b).unwrap();
                    let candles = a.matmul(&b).unwrap();
                    assert_eq!(ours.dims(), &[m, n]);
                    let difference = max_difference(&ours, &candles);
                    assert!(
                        difference < tolerance,
                        "{m} {k} {n} {dtype:?}: {difference}"
                    );
                }
            }
        }
    }

    /// gemm's cache blocking follows each block's shape, so the last bits depend on the number of
    /// blocks (the pool's size), but never on timing: one split gives the same bits every time.
    #[test]
    fn a_split_gives_the_same_bits_every_time() {
        for (m, k, n) in [(300, 200, 150), (150, 200, 300), (120, 896, 4864)] {
            let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).sin()).collect();
            let in_blocks = |blocks| {
                product_in_blocks(
                    Operand::dense(&a, m, k),
                    Operand::dense(&b, n, k).transposed_if(true),
                    blocks,
                )
            };
            let whole = in_blocks(1);
            for blocks in [2, 3] {
                let split = in_blocks(blocks);
                assert!(split == in_blocks(blocks), "{m} {k} {n} in {blocks} blocks");
                let difference = whole
                    .iter()
                    .zip(&split)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f32::max);
                assert!(
                    difference < 1e-3,
                    "{m} {k} {n} in {blocks} blocks: {difference}"
                );
            }
        }
    }

    #[test]
    fn empty_products_are_zeros() {
        let a = Tensor::zeros((4, 0), DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap();
        let out = multiply(&a, &b).unwrap();
        assert_eq!(out.dims(), &[4, 3]);
        assert_eq!(out.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }
}
