//! Splitting our element-wise kernels across threads the way candle splits its own.
//!
//! candle runs element-wise operations of 64K elements or more on its barrier pool, whose workers spin
//! for a while after each operation before they sleep. A kernel of ours that used rayon instead woke a
//! second set of threads beside those spinning ones, which on a 2-core machine made a small model's
//! training step slower than running the kernel on one thread. So our kernels use candle's pool, at
//! candle's threshold.

/// Below this many elements of work a kernel runs on the calling thread (candle's `PAR_ELEMWISE_MIN`).
const MIN_PARALLEL: usize = 64 * 1024;

/// About this many elements of work per unit handed to a thread (candle's `PAR_ELEMWISE_CHUNK`).
const ELEMENTS_PER_UNIT: usize = 16 * 1024;

/// Calls `work(index, chunk)` for every `chunk` of `out.chunks_mut(size)`, each of which costs about
/// `cost` elements of work, on candle's thread pool when they add up to enough.
pub(super) fn for_each_chunk<T: Send>(
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
