//! Attention whose result for a query depends only on that query and its own keys: the attention of
//! batch-invariant sampling ([`Ops::Invariant`](crate::Ops::Invariant)), on the CPU in f32.
//!
//! Batched attention pads each sequence's keys to the longest of the batch and multiplies the padded
//! matrices: masked keys add exact zeros, but where the real ones fall in the vector lanes and blocks of
//! the sums moves with the padding, and so do the last bits. Here each query visits its unmasked keys
//! in order, one at a time: its scores (a dot product in 8 lanes, the lanes summed in a fixed order),
//! their maximum, the exponentials summed in key order, and the values weighted in key order. Padding,
//! the other sequences of the batch and how a prompt is split into prefill chunks then change nothing.

use candle_core::Tensor;

use super::kernel::{f32_values, for_each_chunk, AttentionOperands, Result};

/// Softmax attention of `q` `[B, H, T, D]` over `k` and `v` `[B, KV, S, D]` (query head `h` reads key
/// head `h / (H / KV)`) under the additive `mask` `[B, 1, T, S]` (−∞ hides a key), with scores scaled by
/// `scale` and, with a `cap`, soft-capped to `cap · tanh(score / cap)` before the mask: `[B, T, H · D]`. CPU, f32. With `sinks` `[H]`, head `h`'s sink joins each of its rows in
/// the softmax and takes its share of the weight to nothing (gpt-oss).
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    (scale, cap): (f64, Option<f64>),
    sinks: Option<&Tensor>,
) -> Result<Tensor> {
    let operands = AttentionOperands::new("batch-invariant", q, k, v, mask, sinks)?;
    let (batch, heads, kv_heads, len, keys, dim) = operands.shape;
    let group = heads / kv_heads;
    let sinks = operands.sinks.as_deref();
    let (q, k, v, mask) = (&operands.q, &operands.k, &operands.v, &operands.mask);
    let (q_guard, q_layout) = q.storage_and_layout();
    let (k_guard, k_layout) = k.storage_and_layout();
    let (v_guard, v_layout) = v.storage_and_layout();
    let (mask_guard, mask_layout) = mask.storage_and_layout();
    let q_values = &f32_values(&q_guard)?[q_layout.start_offset()..];
    let mask_values = &f32_values(&mask_guard)?[mask_layout.start_offset()..];
    let (k_values, v_values) = (f32_values(&k_guard)?, f32_values(&v_guard)?);
    // The offset of key (or value) `s` of key head `h` of row `b`.
    let at = |layout: &candle_core::Layout, b: usize, h: usize, s: usize| {
        let stride = layout.stride();
        layout.start_offset() + b * stride[0] + h * stride[1] + s * stride[2]
    };
    let scale = scale as f32;
    let cap = cap.map(|cap| cap as f32);

    // Output `[B, T, H, D]`, one query's `D` values per chunk.
    let mut out = vec![0f32; batch * len * heads * dim];
    for_each_chunk(&mut out, dim, keys * dim * 2, |index, out| {
        let (b, t, h) = (index / (len * heads), (index / heads) % len, index % heads);
        let query = &q_values[((b * heads + h) * len + t) * dim..][..dim];
        let mask_row = &mask_values[(b * len + t) * keys..][..keys];
        let kv_head = h / group;
        let mut scores: Vec<(usize, f32)> = Vec::with_capacity(keys);
        let mut max = f32::NEG_INFINITY;
        for (s, &bias) in mask_row.iter().enumerate() {
            if bias == f32::NEG_INFINITY {
                continue;
            }
            let key = &k_values[at(k_layout, b, kv_head, s)..][..dim];
            let score = dot(query, key) * scale;
            let score = match cap {
                Some(cap) => cap * (score / cap).tanh(),
                None => score,
            };
            let score = score + bias;
            max = max.max(score);
            scores.push((s, score));
        }
        let sink = sinks.as_ref().map(|sinks| sinks[h]);
        if let Some(sink) = sink {
            max = max.max(sink);
        }
        let mut total = sink.map_or(0.0, |sink| (sink - max).exp());
        for (_, score) in &mut scores {
            *score = (*score - max).exp();
            total += *score;
        }
        for &(s, weight) in &scores {
            let value = &v_values[at(v_layout, b, kv_head, s)..][..dim];
            for (out, &value) in out.iter_mut().zip(value) {
                *out += weight * value;
            }
        }
        for out in out.iter_mut() {
            *out /= total;
        }
    });
    drop((q_guard, k_guard, v_guard, mask_guard));
    Tensor::from_vec(out, (batch, len, heads * dim), q.device())
}

/// `Σ a · b` in 8 lanes, the lanes summed pairwise, then the tail: an order that depends only on the
/// length.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let (a_tail, b_tail) = (a_chunks.remainder(), b_chunks.remainder());
    for (a, b) in a_chunks.zip(b_chunks) {
        for lane in 0..8 {
            lanes[lane] += a[lane] * b[lane];
        }
    }
    let mut total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (a, b) in a_tail.iter().zip(b_tail) {
        total += a * b;
    }
    total
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::attention;
    use crate::testing::{mask, max_difference, sines};

    /// The reference: softmax(cap(q kᵀ · scale) + mask) v with candle's operations, grouped query heads
    /// repeated.
    fn reference(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        (scale, cap): (f64, Option<f64>),
    ) -> Tensor {
        let (batch, heads, len, dim) = q.dims4().unwrap();
        let group = heads / k.dim(1).unwrap();
        let repeat = |t: &Tensor| {
            let (b, kv, s, d) = t.dims4().unwrap();
            t.unsqueeze(2)
                .unwrap()
                .expand((b, kv, group, s, d))
                .unwrap()
                .reshape((b, kv * group, s, d))
                .unwrap()
        };
        let scores = (q.matmul(&repeat(k).t().unwrap()).unwrap() * scale).unwrap();
        let scores = match cap {
            Some(cap) => ((scores / cap).unwrap().tanh().unwrap() * cap).unwrap(),
            None => scores,
        };
        let scores = scores.broadcast_add(mask).unwrap();
        let weights = candle_nn::ops::softmax_last_dim(&scores).unwrap();
        weights
            .matmul(&repeat(v).contiguous().unwrap())
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((batch, len, heads * dim))
            .unwrap()
    }

    #[test]
    fn equals_softmax_attention() {
        // 4 query heads over 2 key heads, head size 20 (8-lane chunks and a tail), padding on the left of
        // row 1, causal queries.
        let (batch, heads, kv_heads, len, keys, dim) = (2, 4, 2, 3, 7, 20);
        let q = sines((batch, heads, len, dim), 0.37, DType::F32);
        let k = sines((batch, kv_heads, keys, dim), 0.11, DType::F32);
        let v = sines((batch, kv_heads, keys, dim), 0.53, DType::F32);
        let mask = mask(batch, len, keys, |b, t, s| {
            (b == 1 && s < 2) || s > keys - len + t
        });
        // Without a soft-cap, and with one small enough that tanh bends every score.
        for cap in [None, Some(0.5)] {
            let ours = attention(&q, &k, &v, &mask, (0.3, cap), None).unwrap();
            let theirs = reference(&q, &k, &v, &mask, (0.3, cap));
            assert!(max_difference(&ours, &theirs) < 1e-5, "{cap:?}");
        }
        let capped = attention(&q, &k, &v, &mask, (0.3, Some(0.5)), None).unwrap();
        let uncapped = reference(&q, &k, &v, &mask, (0.3, None));
        assert!(
            max_difference(&capped, &uncapped) > 1e-2,
            "the cap changes the output"
        );
    }

    /// With a sink per head, a key of score `sink` and value zero joins each row: the reference over keys
    /// with one more column, whose value is zero and whose score the mask sets to the sink.
    #[test]
    fn sinks_take_their_share_of_the_weight() {
        let (batch, heads, kv_heads, len, keys, dim) = (2, 4, 2, 3, 7, 20);
        let q = sines((batch, heads, len, dim), 0.37, DType::F32);
        let k = sines((batch, kv_heads, keys, dim), 0.11, DType::F32);
        let v = sines((batch, kv_heads, keys, dim), 0.53, DType::F32);
        let hidden = |b: usize, t: usize, s: usize| (b == 1 && s < 2) || s > keys - len + t;
        let sinks = Tensor::new(&[0.5f32, -1.0, 2.0, 0.0], &Device::Cpu).unwrap();
        let ours = attention(
            &q,
            &k,
            &v,
            &mask(batch, len, keys, hidden),
            (0.3, None),
            Some(&sinks),
        )
        .unwrap();
        // The extra key: zero, so that its score is the mask's entry, which is the head's sink; the
        // reference's mask has one head, so each head is computed alone.
        let zero_key = Tensor::zeros((batch, kv_heads, 1, dim), DType::F32, &Device::Cpu).unwrap();
        let k_sunk = Tensor::cat(&[&k, &zero_key], 2).unwrap();
        let v_sunk = Tensor::cat(&[&v, &zero_key], 2).unwrap();
        let group = heads / kv_heads;
        let per_head: Vec<Tensor> = (0..heads)
            .map(|h| {
                let sink = sinks.get(h).unwrap().to_scalar::<f32>().unwrap();
                let values: Vec<f32> = (0..batch * len * (keys + 1))
                    .map(|i| {
                        let (b, t, s) = (
                            i / (len * (keys + 1)),
                            (i / (keys + 1)) % len,
                            i % (keys + 1),
                        );
                        match s == keys {
                            true => sink,
                            false if hidden(b, t, s) => f32::NEG_INFINITY,
                            false => 0.0,
                        }
                    })
                    .collect();
                let mask =
                    Tensor::from_vec(values, (batch, 1, len, keys + 1), &Device::Cpu).unwrap();
                let kv = |t: &Tensor| t.narrow(1, h / group, 1).unwrap();
                reference(
                    &q.narrow(1, h, 1).unwrap(),
                    &kv(&k_sunk),
                    &kv(&v_sunk),
                    &mask,
                    (0.3, None),
                )
            })
            .collect();
        let theirs = Tensor::stack(&per_head, 2)
            .unwrap()
            .reshape((batch, len, heads * dim))
            .unwrap();
        assert!(max_difference(&ours, &theirs) < 1e-5);
        let without = attention(
            &q,
            &k,
            &v,
            &mask(batch, len, keys, hidden),
            (0.3, None),
            None,
        )
        .unwrap();
        assert!(
            max_difference(&ours, &without) > 1e-2,
            "the sinks changed nothing"
        );
    }

    /// A row's output is the same, bit for bit, alone or in a batch where other rows are longer, its
    /// keys padded on either side, and its cache a view with spare columns.
    #[test]
    fn a_row_gives_the_same_bits_whatever_its_batch_and_padding() {
        let (heads, kv_heads, dim, own) = (2, 1, 16, 5);
        let q = sines((1, heads, 1, dim), 0.29, DType::F32);
        let k = sines((1, kv_heads, own, dim), 0.17, DType::F32);
        let v = sines((1, kv_heads, own, dim), 0.41, DType::F32);
        let alone = attention(
            &q,
            &k,
            &v,
            &mask(1, 1, own, |_, _, _| false),
            (0.25, None),
            None,
        )
        .unwrap();

        // In a batch of 3 with 9 key columns: row 1 is ours, padded by 3 columns on the left and 1 on
        // the right, inside buffers of 12 columns.
        let (batch, columns, room) = (3, 9, 12);
        let other = |scale| sines((batch, kv_heads, room, dim), scale, DType::F32);
        let place = |buffer: Tensor, ours: &Tensor| {
            buffer
                .slice_assign(&[1..2, 0..kv_heads, 3..3 + own, 0..dim], ours)
                .unwrap()
                .narrow(2, 0, columns)
                .unwrap()
        };
        let (k_batch, v_batch) = (place(other(0.7), &k), place(other(0.9), &v));
        assert!(!k_batch.is_contiguous());
        let q_batch = Tensor::cat(
            &[
                &sines((1, heads, 1, dim), 0.5, DType::F32),
                &q,
                &sines((1, heads, 1, dim), 0.6, DType::F32),
            ],
            0,
        )
        .unwrap();
        let batch_mask = mask(batch, 1, columns, |b, _, s| {
            b == 1 && !(3..3 + own).contains(&s)
        });
        let batched = attention(
            &q_batch,
            &k_batch,
            &v_batch,
            &batch_mask,
            (0.25, None),
            None,
        )
        .unwrap();
        let ours = batched.narrow(0, 1, 1).unwrap();
        assert_eq!(
            ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            alone.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        // The batched reference (padded products) is close but need not be identical.
        let reference = reference(&q_batch, &k_batch, &v_batch, &batch_mask, (0.25, None));
        assert!(max_difference(&batched, &reference) < 1e-5);
    }

    #[test]
    fn refuses_other_types() {
        let q = Tensor::zeros((1, 1, 1, 4), DType::F64, &Device::Cpu).unwrap();
        let mask = Tensor::zeros((1, 1, 1, 1), DType::F64, &Device::Cpu).unwrap();
        let error = attention(&q, &q, &q, &mask, (1.0, None), None).unwrap_err();
        assert!(error.to_string().contains("CPU in f32"), "{error}");
    }
}
