//! What our fused CPU kernels (`head`, `rope`, `softmax`, the layer backward's row sums) share: which
//! tensors they take ([`takes`]), the arithmetic of both precisions ([`Real`]), reading a contiguous
//! storage ([`contiguous`]), splitting work across threads ([`for_each_chunk`]), and the attention
//! kernels' (`invariant`, `flash`) checked operands ([`AttentionOperands`]).
//!
//! Threads: candle runs element-wise operations of 64K elements or more on its barrier pool, whose
//! workers spin for a while after each operation before they sleep. A kernel of ours that used rayon
//! instead woke a second set of threads beside those spinning ones, which on a 2-core machine made a
//! small model's training step slower than running the kernel on one thread. So our kernels use
//! candle's pool, at candle's threshold, as our matrix products do (`matrix`).

use candle_core::{CpuStorage, DType, DeviceLocation, Layout, Storage, Tensor, WithDType};

pub type Result<T> = candle_core::Result<T>;

/// Which implementation of RMSNorm, RoPE and softmax a forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ops {
    /// Fused kernels without backward: sampling.
    Fast,
    /// [`Ops::Fast`] whose results for a sequence do not depend on the other sequences of its batch, on
    /// the CPU with f32 or bf16 weights: every product goes through the row-by-row kernel
    /// (`local/skinny.rs`) and attention visits each query's own keys in order (`local/invariant.rs`).
    /// Batch-invariant sampling ([`Limits::batch_invariant`](crate::Limits::batch_invariant)).
    Invariant,
    /// Basic tensor ops with backward: training.
    Differentiable,
}

/// What the choice of a product depends on: where the operands live, their types and sizes, and whether
/// the weight is trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operands {
    pub location: DeviceLocation,
    /// The activations' type.
    pub x: DType,
    /// The weight's type.
    pub weight: DType,
    /// Rows of `x` (sequences in a decoding step, tokens in a prefill).
    pub rows: usize,
    /// Columns of `x`: the weight's inputs.
    pub inputs: usize,
    /// Elements of the weight.
    pub weight_elements: usize,
    /// The weight is a variable, or computed from one: its gradient is wanted.
    pub trained: bool,
}

/// Whether our kernels take `xs` with `others`: f32, or f64, all of one type, on the CPU (elsewhere
/// candle's operations run).
pub(crate) fn takes(xs: &Tensor, others: &[&Tensor]) -> bool {
    xs.device().is_cpu()
        && matches!(xs.dtype(), DType::F32 | DType::F64)
        && others.iter().all(|other| other.dtype() == xs.dtype())
}

/// The arithmetic both precisions share.
pub(crate) trait Real:
    WithDType
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::AddAssign
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::MulAssign
    + std::ops::Div<Output = Self>
    + std::ops::DivAssign
    + std::ops::Neg<Output = Self>
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn max(self, other: Self) -> Self;
}

macro_rules! real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
        }
    };
}
real!(f32);
real!(f64);

/// The `T` values a contiguous `layout` of `storage` covers; `what` names the operation in the error.
pub(crate) fn contiguous<'a, T: WithDType>(
    storage: &'a CpuStorage,
    layout: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    let values = T::cpu_storage_as_slice(storage)?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&values[start..end]),
        None => candle_core::bail!("{what} of a non-contiguous tensor"),
    }
}

/// Below this many elements of work a kernel runs on the calling thread (candle's `PAR_ELEMWISE_MIN`).
const MIN_PARALLEL: usize = 64 * 1024;

/// About this many elements of work per unit handed to a thread (candle's `PAR_ELEMWISE_CHUNK`).
const ELEMENTS_PER_UNIT: usize = 16 * 1024;

/// Calls `work(index, chunk)` for every `chunk` of `out.chunks_mut(size)`, each of which costs about
/// `cost` elements of work, on candle's thread pool when they add up to enough.
pub(crate) fn for_each_chunk<T: Send>(
    out: &mut [T],
    size: usize,
    cost: usize,
    work: impl Fn(usize, &mut [T]) + Sync,
) {
    let (size, cost) = (size.max(1), cost.max(1));
    let chunks = out.len().div_ceil(size);
    if chunks.saturating_mul(cost) < MIN_PARALLEL {
        out.chunks_mut(size)
            .enumerate()
            .for_each(|(index, chunk)| work(index, chunk));
        return;
    }
    let per_unit = (ELEMENTS_PER_UNIT / cost).max(1);
    let (len, start) = (out.len(), out.as_mut_ptr() as usize);
    candle_core::utils::barrier_pool().execute_chunked(chunks.div_ceil(per_unit), |units| {
        for unit in units {
            for index in unit * per_unit..((unit + 1) * per_unit).min(chunks) {
                let offset = index * size;
                let chunk_len = size.min(len - offset);
                // SAFETY: every index is visited once, and its chunk `[offset, offset + chunk_len)` lies
                // inside `out`, which stays borrowed mutably until every unit has finished.
                let chunk = unsafe {
                    std::slice::from_raw_parts_mut((start as *mut T).add(offset), chunk_len)
                };
                work(index, chunk);
            }
        }
    });
}

/// [`for_each_chunk`] over two buffers at once: `work(index, a_chunk, b_chunk)` for the `index`-th chunk
/// of `a` (of `a_size`) and of `b` (of `b_size`), which must have as many chunks.
pub(crate) fn for_each_chunk_pair<T: Send>(
    (a, a_size): (&mut [T], usize),
    (b, b_size): (&mut [T], usize),
    cost: usize,
    work: impl Fn(usize, &mut [T], &mut [T]) + Sync,
) {
    let (a_size, b_size) = (a_size.max(1), b_size.max(1));
    let chunks = a.len().div_ceil(a_size);
    assert_eq!(
        chunks,
        b.len().div_ceil(b_size),
        "two buffers of as many chunks"
    );
    let (b_len, b_start) = (b.len(), b.as_mut_ptr() as usize);
    for_each_chunk(a, a_size, cost, |index, a_chunk| {
        let offset = index * b_size;
        // SAFETY: `for_each_chunk` visits every index once, so each chunk `[offset, offset + len)` of
        // `b` is borrowed by one call, and `b` stays borrowed mutably until they have all returned.
        let b_chunk = unsafe {
            std::slice::from_raw_parts_mut(
                (b_start as *mut T).add(offset),
                b_size.min(b_len - offset),
            )
        };
        work(index, a_chunk, b_chunk);
    });
}

/// Attention's operands as the CPU attention kernels (`invariant`, `flash`) read them: checked to be
/// f32 on the CPU with matching shapes, queries and mask contiguous, keys and values with contiguous
/// rows of `D` (a cache's views keep their own strides above that), sinks as values.
pub(crate) struct AttentionOperands {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub mask: Tensor,
    pub sinks: Option<Vec<f32>>,
    /// `(B, H, KV, T, S, D)`: batch, query heads, key heads, queries, keys, head size.
    pub shape: (usize, usize, usize, usize, usize, usize),
}

impl AttentionOperands {
    /// `q` `[B, H, T, D]`, `k` and `v` `[B, KV, S, D]`, `mask` `[B, 1, T, S]`, `sinks` `[H]`; `kernel`
    /// names the caller in errors.
    pub(crate) fn new(
        kernel: &str,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        sinks: Option<&Tensor>,
    ) -> Result<Self> {
        let (batch, heads, len, dim) = q.dims4()?;
        let (_, kv_heads, keys, _) = k.dims4()?;
        if [q, k, v, mask]
            .iter()
            .any(|t| t.dtype() != DType::F32 || !t.device().is_cpu())
        {
            candle_core::bail!("{kernel} attention runs on the CPU in f32");
        }
        if v.dims4()? != (batch, kv_heads, keys, dim)
            || mask.dims4()? != (batch, 1, len, keys)
            || heads % kv_heads != 0
        {
            candle_core::bail!(
                "{kernel} attention: q {:?}, k {:?}, v {:?}, mask {:?}",
                q.dims(),
                k.dims(),
                v.dims(),
                mask.dims()
            );
        }
        let sinks = match sinks {
            Some(sinks) => Some(sinks.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        let rows_of = |t: &Tensor| -> Result<Tensor> {
            match t.stride()[3] {
                1 => Ok(t.clone()),
                _ => t.contiguous(),
            }
        };
        Ok(AttentionOperands {
            q: q.contiguous()?,
            k: rows_of(k)?,
            v: rows_of(v)?,
            mask: mask.contiguous()?,
            sinks,
            shape: (batch, heads, kv_heads, len, keys, dim),
        })
    }
}

/// The f32 values of a CPU storage ([`AttentionOperands`] checked the type).
pub(crate) fn f32_values(storage: &Storage) -> Result<&[f32]> {
    match storage {
        Storage::Cpu(CpuStorage::F32(values)) => Ok(values.as_slice()),
        _ => candle_core::bail!("expected f32 values on the CPU"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_is_visited_once_small_or_large() {
        for (len, size) in [(10, 3), (MIN_PARALLEL + 7, 5), (3 * MIN_PARALLEL, 40_000)] {
            let mut out = vec![0u32; len];
            for_each_chunk(&mut out, size, size, |index, chunk| {
                assert!(chunk.len() == size || (index + 1) * size >= len);
                for value in chunk.iter_mut() {
                    *value += index as u32 + 1;
                }
            });
            for (position, value) in out.iter().enumerate() {
                assert_eq!(*value, (position / size) as u32 + 1, "{len} {size}");
            }
        }
    }
}
