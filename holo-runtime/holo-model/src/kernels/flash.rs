//! Prefill's attention on the CPU in f32: blocks of queries against tiles of keys with an online softmax
//! (flash attention's), so that a long prompt's scores are never held whole.
//!
//! The composed attention (`Attention::attend` with candle's operations) formed every score of a pass at
//! once, `[B, heads, T, S]`: 512 MiB per layer for 1,024 new tokens over 8,192 keys with 16 heads, written
//! and read again by the scaling, the mask, the softmax (a scalar `exp` per score) and the weighted sum,
//! with every key after a causal query's own computed only to be masked away. Here one unit of work is
//! one key head's query heads at a block of positions (their rows stacked, so each tile of keys is read
//! once for all of them, without copying keys per query head), which visits only the columns its mask
//! rows leave open, a tile at a time: the products through gemm, the exponentials in vector lanes, and
//! per row a running maximum and sum that rescale what the earlier tiles added.

use candle_core::{Layout, Tensor};

use super::kernel::{f32_values, for_each_chunk, AttentionOperands, Result};

/// Query positions per block. A key head's `G` query heads make `G · QUERIES` rows of each product.
const QUERIES: usize = 32;

/// Keys per tile: the tile's scores (`G · QUERIES × KEYS`), keys and values stay within L2.
const KEYS: usize = 256;

/// Softmax attention of `q` `[B, H, T, D]` over `k` and `v` `[B, KV, S, D]` (query head `h` reads key
/// head `h / (H / KV)`) under the additive `mask` `[B, 1, T, S]` (−∞ hides a key), with scores scaled by
/// `scale` and, with a `cap`, soft-capped to `cap · tanh(score / cap)` before the mask (Gemma 2):
/// `[B, T, H · D]`. With `sinks` `[H]`, head `h`'s sink joins each of its rows in the softmax
/// and takes its share of the weight to nothing (gpt-oss). A query whose keys are all hidden gets zeros.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    (scale, cap): (f64, Option<f64>),
    sinks: Option<&Tensor>,
) -> Result<Tensor> {
    let operands = AttentionOperands::new("blocked", q, k, v, mask, sinks)?;
    let (batch, heads, kv_heads, len, keys, dim) = operands.shape;
    let group = heads / kv_heads;
    let (q, k, v, mask) = (&operands.q, &operands.k, &operands.v, &operands.mask);
    let (q_guard, q_layout) = q.storage_and_layout();
    let (k_guard, k_layout) = k.storage_and_layout();
    let (v_guard, v_layout) = v.storage_and_layout();
    let (mask_guard, mask_layout) = mask.storage_and_layout();
    let inputs = Inputs {
        q: &f32_values(&q_guard)?[q_layout.start_offset()..],
        k: Rows::of(f32_values(&k_guard)?, k_layout),
        v: Rows::of(f32_values(&v_guard)?, v_layout),
        mask: &f32_values(&mask_guard)?[mask_layout.start_offset()..],
        sinks: operands.sinks.as_deref(),
        scale: scale as f32,
        cap: cap.map(|cap| cap as f32),
        shape: Shape {
            heads,
            group,
            len,
            keys,
            dim,
        },
    };
    // One unit per row of the batch, key head and block of positions: its `G · QUERIES` rows of `D`.
    let blocks = len.div_ceil(QUERIES);
    let unit = group * QUERIES * dim;
    let mut units = vec![0f32; batch * kv_heads * blocks * unit];
    for_each_chunk(
        &mut units,
        unit,
        group * QUERIES * keys * dim,
        |index, out| {
            let (b, kv_head, block) = (
                index / (kv_heads * blocks),
                (index / blocks) % kv_heads,
                index % blocks,
            );
            inputs.block(b, kv_head, block * QUERIES, out);
        },
    );
    drop((q_guard, k_guard, v_guard, mask_guard));
    // The units' rows (head by head, position by position) put in `[B, T, H, D]`.
    let mut out = vec![0f32; batch * len * heads * dim];
    for (index, unit) in units.chunks(unit).enumerate() {
        let (b, kv_head, block) = (
            index / (kv_heads * blocks),
            (index / blocks) % kv_heads,
            index % blocks,
        );
        let (start, count) = (block * QUERIES, QUERIES.min(len - block * QUERIES));
        for (row, values) in unit.chunks(dim).take(group * count).enumerate() {
            let (h, t) = (kv_head * group + row / count, start + row % count);
            out[((b * len + t) * heads + h) * dim..][..dim].copy_from_slice(values);
        }
    }
    Tensor::from_vec(out, (batch, len, heads * dim), q.device())
}

/// The sizes one unit of work needs.
#[derive(Clone, Copy)]
struct Shape {
    heads: usize,
    group: usize,
    len: usize,
    keys: usize,
    dim: usize,
}

/// Keys or values read in place: `[B, KV, S, D]` with rows of `D` contiguous and any strides above.
struct Rows<'a> {
    values: &'a [f32],
    start: usize,
    strides: [usize; 3],
}

impl<'a> Rows<'a> {
    fn of(values: &'a [f32], layout: &Layout) -> Self {
        let stride = layout.stride();
        Rows {
            values,
            start: layout.start_offset(),
            strides: [stride[0], stride[1], stride[2]],
        }
    }

    /// Row `s` of key head `h` of batch row `b` onwards, and the distance between rows.
    fn at(&self, b: usize, h: usize, s: usize) -> (&'a [f32], usize) {
        let offset = self.start + b * self.strides[0] + h * self.strides[1] + s * self.strides[2];
        (&self.values[offset..], self.strides[2])
    }
}

struct Inputs<'a> {
    q: &'a [f32],
    k: Rows<'a>,
    v: Rows<'a>,
    mask: &'a [f32],
    sinks: Option<&'a [f32]>,
    scale: f32,
    cap: Option<f32>,
    shape: Shape,
}

impl Inputs<'_> {
    /// The attention of key head `kv_head`'s query heads at positions `start..` (a block, or what is
    /// left of the sequence) of batch row `b`, into `out`: `G` heads' rows of `D`, one head after the
    /// other, each head's positions in order.
    fn block(&self, b: usize, kv_head: usize, start: usize, out: &mut [f32]) {
        let Shape {
            heads,
            group,
            len,
            keys,
            dim,
        } = self.shape;
        let count = QUERIES.min(len - start);
        let rows = group * count;
        let out = &mut out[..rows * dim];
        let mask_row = |position: usize| &self.mask[(b * len + start + position) * keys..][..keys];
        // The columns any of the block's mask rows leaves open; the rest is never read.
        let (mut first, mut end) = (keys, 0);
        for position in 0..count {
            let row = mask_row(position);
            if let Some(open) = row.iter().position(|&bias| bias != f32::NEG_INFINITY) {
                first = first.min(open);
                end = end.max(
                    keys - row
                        .iter()
                        .rev()
                        .position(|&b| b != f32::NEG_INFINITY)
                        .unwrap_or(0),
                );
            }
        }
        let mut queries = Vec::with_capacity(rows * dim);
        for head in 0..group {
            let h = kv_head * group + head;
            queries
                .extend_from_slice(&self.q[((b * heads + h) * len + start) * dim..][..count * dim]);
        }
        // Each row's running maximum and sum of exponentials; a sink is a first key of its own.
        let mut maxima = vec![f32::NEG_INFINITY; rows];
        let mut sums = vec![0f32; rows];
        if let Some(sinks) = self.sinks {
            for row in 0..rows {
                maxima[row] = sinks[kv_head * group + row / count];
                sums[row] = 1.0;
            }
        }
        let mut scores = vec![0f32; rows * KEYS];
        let mut tile = first;
        while tile < end {
            let width = KEYS.min(end - tile);
            let scores = &mut scores[..rows * width];
            let (k, k_stride) = self.k.at(b, kv_head, tile);
            // SAFETY: `queries` is `[rows, D]` row-major; the tile's keys are `width` rows of `D`
            // values `k_stride` apart from the start of `k`, inside its storage; `scores` has room
            // for `[rows, width]`.
            unsafe {
                gemm::gemm(
                    rows,
                    width,
                    dim,
                    scores.as_mut_ptr(),
                    1,
                    width as isize,
                    false,
                    queries.as_ptr(),
                    1,
                    dim as isize,
                    k.as_ptr(),
                    k_stride as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            for (row, scores) in scores.chunks_mut(width).enumerate() {
                let bias = &mask_row(row % count)[tile..][..width];
                let tile_max = form_scores(scores, bias, self.scale, self.cap);
                let max = maxima[row].max(tile_max);
                if max == f32::NEG_INFINITY {
                    // Every key so far hidden: nothing to weigh yet.
                    scores.fill(0.0);
                    continue;
                }
                let kept = (maxima[row] - max).exp();
                if kept != 1.0 {
                    for value in &mut out[row * dim..][..dim] {
                        *value *= kept;
                    }
                }
                sums[row] = sums[row] * kept + exp_shifted(scores, max);
                maxima[row] = max;
            }
            let (v, v_stride) = self.v.at(b, kv_head, tile);
            // SAFETY: `scores` is `[rows, width]` row-major; the tile's values are `width` rows of `D`
            // values `v_stride` apart from the start of `v`; `out` is `[rows, D]`.
            unsafe {
                gemm::gemm(
                    rows,
                    dim,
                    width,
                    out.as_mut_ptr(),
                    1,
                    dim as isize,
                    true,
                    scores.as_ptr(),
                    1,
                    width as isize,
                    v.as_ptr(),
                    1,
                    v_stride as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            tile += width;
        }
        for (row, out) in out.chunks_mut(dim).enumerate() {
            let sum = sums[row];
            for value in out.iter_mut() {
                *value = if sum > 0.0 { *value / sum } else { 0.0 };
            }
        }
    }
}

/// One row's scores of a tile, formed in place from its products `q · k`: scaled, soft-capped where the
/// family caps them, then the additive mask's `bias`. Every score attention weighs is formed here.
/// Returns the row's maximum.
fn form_scores(scores: &mut [f32], bias: &[f32], scale: f32, cap: Option<f32>) -> f32 {
    let mut max = f32::NEG_INFINITY;
    match cap {
        None => {
            for (score, &bias) in scores.iter_mut().zip(bias) {
                *score = *score * scale + bias;
                max = max.max(*score);
            }
        }
        Some(cap) => {
            for (score, &bias) in scores.iter_mut().zip(bias) {
                *score = cap * (*score * scale / cap).tanh() + bias;
                max = max.max(*score);
            }
        }
    }
    max
}

/// Sets each score `x` to `exp(x − shift)` and returns their sum: the exponentials in 16 lanes (AVX-512,
/// or AVX2), where a scalar `exp` per score cost as much as the products that formed them.
fn exp_shifted(scores: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F.
            return unsafe { exp_shifted_avx512(scores, shift) };
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { exp_shifted_avx2(scores, shift) };
        }
    }
    exp_shifted_lanes(scores, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(scores: &mut [f32], shift: f32) -> f32 {
    exp_shifted_lanes(scores, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(scores: &mut [f32], shift: f32) -> f32 {
    exp_shifted_lanes(scores, shift)
}

/// [`exp_shifted`] written lane by lane for the compiler to vectorise in each caller's instructions.
#[inline(always)]
fn exp_shifted_lanes(scores: &mut [f32], shift: f32) -> f32 {
    const LANES: usize = 16;
    let mut sums = [0f32; LANES];
    let mut chunks = scores.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (score, sum) in chunk.iter_mut().zip(&mut sums) {
            *score = exp(*score - shift);
            *sum += *score;
        }
    }
    let mut total = 0.0;
    for score in chunks.into_remainder() {
        *score = exp(*score - shift);
        total += *score;
    }
    sums.iter().sum::<f32>() + total
}

/// `e^x` for `x ≤ 0` within a relative 2⁻²² (Cephes' `expf`), without branches: `x = n ln 2 + r` with
/// `|r| ≤ ln 2 / 2`, `e^r` by its polynomial, `2^n` written into the exponent's bits. Below −87 (where
/// `e^x` leaves f32's normal numbers), and at −∞ (a hidden key), exactly 0.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, the first with few enough bits that `n · LN2_HIGH` is exact.
    const LN2_HIGH: f32 = 0.693_359_4;
    const LN2_LOW: f32 = -2.121_944_4e-4;
    // Adding 1.5 · 2²³ rounds to an integer, which then sits in the low bits of the sum's mantissa.
    const ROUND: f32 = 12_582_912.0;
    const LOWEST: f32 = -87.0;
    let clamped = x.max(LOWEST);
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = clamped - n * LN2_HIGH - n * LN2_LOW;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    // `shifted`'s bits are ROUND's plus n; n + 127 shifted into the exponent is 2ⁿ.
    let two_n = f32::from_bits(
        shifted
            .to_bits()
            .wrapping_sub(ROUND.to_bits())
            .wrapping_add(127)
            << 23,
    );
    if x < LOWEST {
        0.0
    } else {
        e_r * two_n
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::{attention, exp, exp_shifted, KEYS, QUERIES};
    use crate::testing::{mask, max_difference, sines};

    /// A prefill chunk as the cache hands it over: more positions than a block and more keys than a
    /// tile (both ragged), 4 query heads over 2 key heads of 20 (vector lanes and a tail), keys and
    /// values views of a cache with spare columns, row 1 left-padded; causal, or within a window of
    /// 40 positions (whole tiles skipped). Against the batch-invariant kernel, which visits each
    /// query's keys one at a time, with and without sinks, with and without a soft-cap.
    #[test]
    fn equals_attention_one_key_at_a_time() {
        let (batch, heads, kv_heads, dim) = (2, 4, 2, 20);
        let (cached, len) = (KEYS + 45, 2 * QUERIES + 7);
        let keys = cached + len;
        let q = sines((batch, heads, len, dim), 0.37, DType::F32);
        let room = |scale| sines((batch, kv_heads, keys + 9, dim), scale, DType::F32);
        let (k, v) = (room(0.11), room(0.53));
        let (k, v) = (k.narrow(2, 0, keys).unwrap(), v.narrow(2, 0, keys).unwrap());
        assert!(!k.is_contiguous());
        let causal = |b: usize, t: usize, s: usize| (b == 1 && s < 30) || s > cached + t;
        let windowed = |b: usize, t: usize, s: usize| causal(b, t, s) || s + 40 <= cached + t;
        let sinks = Tensor::new(&[0.5f32, -1.0, 2.0, 0.0], &Device::Cpu).unwrap();
        for hidden in [&causal as &dyn Fn(usize, usize, usize) -> bool, &windowed] {
            let mask = mask(batch, len, keys, hidden);
            for sinks in [None, Some(&sinks)] {
                // A cap small enough that tanh bends every score.
                for cap in [None, Some(0.5)] {
                    let ours = attention(&q, &k, &v, &mask, (0.3, cap), sinks).unwrap();
                    let theirs =
                        crate::kernels::invariant::attention(&q, &k, &v, &mask, (0.3, cap), sinks)
                            .unwrap();
                    assert!(
                        max_difference(&ours, &theirs) < 1e-5,
                        "sinks {sinks:?}, cap {cap:?}"
                    );
                }
            }
        }
    }

    /// A query whose keys are all hidden (a padding row's) gets zeros, not the NaN of 0 / 0.
    #[test]
    fn a_query_with_every_key_hidden_gets_zeros() {
        let (heads, len, keys, dim) = (2, 3, 5, 8);
        let q = sines((1, heads, len, dim), 0.37, DType::F32);
        let k = sines((1, heads, keys, dim), 0.11, DType::F32);
        let mask = mask(1, len, keys, |_, t, s| t == 0 || s > t);
        let out = attention(&q, &k, &k, &mask, (0.5, None), None).unwrap();
        let values = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(values[..heads * dim].iter().all(|&x| x == 0.0));
        assert!(values[heads * dim..]
            .iter()
            .all(|x| x.is_finite() && *x != 0.0));
    }

    #[test]
    fn exponentials_are_within_a_relative_2_to_the_minus_22() {
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let (ours, exact) = (exp(x) as f64, (x as f64).exp());
            assert!(
                (ours - exact).abs() <= 2.0 * f32::EPSILON as f64 * exact,
                "e^{x}: {ours} against {exact}"
            );
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        // In lanes and a tail, with the sum.
        let mut scores: Vec<f32> = (0..37).map(|i| i as f32 * 0.25 - 9.0).collect();
        let sum = exp_shifted(&mut scores, 0.5);
        for (i, &score) in scores.iter().enumerate() {
            let exact = (i as f64 * 0.25 - 9.5).exp();
            assert!((score as f64 - exact).abs() <= 2.0 * f32::EPSILON as f64 * exact);
        }
        let exact: f64 = (0..37).map(|i| (i as f64 * 0.25 - 9.5).exp()).sum();
        assert!((sum as f64 - exact).abs() < 1e-6 * exact);
    }
}
