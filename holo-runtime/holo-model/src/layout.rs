//! Where the tokens of a pass without a cache sit, and which tokens each one attends to.
//!
//! Training and scoring passes read whole sequences. [`Layout::causal`] lays them out one per row,
//! padded, each token seeing the real tokens of its row up to itself, as transformers does.
//! [`Layout::trees`] packs sequences that share prefixes into one row as a tree of tokens: a shared
//! prefix (the prompt of a GRPO group, say) is computed once, and each token sees only its ancestors and
//! itself, at its depth as position. A token's hidden state depends only on the tokens it sees and on
//! their positions, so both layouts give the same states, up to rounding.

use candle_core::{DType, Device, Tensor};

use crate::kernels::kernel::Result;

/// The positions and the attention mask of a pass over `[B, T]` tokens without a cache.
#[derive(Debug, Clone)]
pub struct Layout {
    /// `[B, T]` (u32): each token's position in its own sequence, which the rotary embedding reads.
    pub positions: Tensor,
    /// `[B, 1, T, T]` (f32, additive): 0 where the query (third axis) sees the key (last axis), −∞
    /// elsewhere. Every token sees itself, so padding stays finite.
    pub mask: Tensor,
    /// `[B, T]` (u8): 1 on real tokens, for rows of sequences; `None` for trees, which linear-attention
    /// layers cannot read (they run through each sequence in order).
    pub real: Option<Tensor>,
    /// The routing of a mixture-of-experts model's pass: replayed choices, and the record of those
    /// made (see [`crate::routing::Routing`]); `None` routes by the routers.
    pub routing: Option<std::sync::Arc<crate::routing::Routing>>,
    /// Where a mixture-of-experts model's layers leave their share of the load-balancing loss
    /// ([`crate::balance::Balance`]); `None` computes none.
    pub balance: Option<std::sync::Arc<crate::balance::Balance>>,
}

impl Layout {
    /// This layout with its mixture layers routed by `routing` (replaying, or recording).
    pub fn with_routing(self, routing: std::sync::Arc<crate::routing::Routing>) -> Layout {
        Layout {
            routing: Some(routing),
            ..self
        }
    }

    /// This layout with its mixture layers' load-balancing loss gathered in `balance`.
    pub fn with_balance(self, balance: std::sync::Arc<crate::balance::Balance>) -> Layout {
        Layout {
            balance: Some(balance),
            ..self
        }
    }

    /// Rows of left- or right-padded sequences: `key_mask` `[B, T]` is 1 on real tokens; each token sees
    /// the real tokens of its row up to itself, and its position counts the real tokens before it.
    pub fn causal(key_mask: &Tensor) -> Result<Layout> {
        let (batch, len) = key_mask.dims2()?;
        Ok(Layout {
            positions: positions_from_mask(key_mask)?,
            mask: attention_mask(key_mask, batch, 0, len, candle_core::DType::F32)?,
            real: Some(key_mask.to_dtype(DType::U8)?),
            routing: None,
            balance: None,
        })
    }

    /// Rows of token trees: `parents[b][t]` is the column of token `t`'s parent in row `b`, `None` for a
    /// root, and comes before `t`. A token sees its ancestors and itself, and its position is its depth.
    /// Rows shorter than the longest are padded with columns that see only themselves, at position 0.
    pub fn trees(parents: &[Vec<Option<usize>>], device: &Device) -> Result<Layout> {
        let batch = parents.len();
        let width = parents.iter().map(Vec::len).max().unwrap_or(0);
        let mut positions = vec![0u32; batch * width];
        let mut mask = vec![f32::NEG_INFINITY; batch * width * width];
        for (b, row) in parents.iter().enumerate() {
            let mask = &mut mask[b * width * width..(b + 1) * width * width];
            let positions = &mut positions[b * width..(b + 1) * width];
            for t in 0..width {
                match row.get(t).copied().flatten() {
                    Some(parent) if parent >= t => candle_core::bail!(
                        "token {t} of row {b} has parent {parent}, which does not come before it"
                    ),
                    // What the parent sees (columns before it), and the parent.
                    Some(parent) => {
                        mask.copy_within(parent * width..parent * width + t, t * width);
                        positions[t] = positions[parent] + 1;
                    }
                    None => {}
                }
                mask[t * width + t] = 0.0;
            }
        }
        Ok(Layout {
            positions: Tensor::from_vec(positions, (batch, width), device)?,
            mask: Tensor::from_vec(mask, (batch, 1, width, width), device)?,
            real: None,
            routing: None,
            balance: None,
        })
    }
}

/// Positions `[B, T]` (u32) counting each row's real tokens from 0 (`key_mask` `[B, T]`, 1 for real
/// tokens, left or right padding), as transformers derives them from the attention mask; 0 on padding.
pub fn positions_from_mask(key_mask: &Tensor) -> Result<Tensor> {
    let rows = key_mask.to_dtype(DType::U8)?.to_vec2::<u8>()?;
    let (batch, len) = (rows.len(), rows.first().map_or(0, Vec::len));
    let mut positions = Vec::with_capacity(batch * len);
    for row in rows {
        let mut next = 0u32;
        for real in row {
            positions.push(if real == 0 { 0 } else { next });
            next += u32::from(real != 0);
        }
    }
    Tensor::from_vec(positions, (batch, len), key_mask.device())
}

/// Additive mask `[B, 1, T, S]`: query `t` (column `cached + t`) sees real keys up to its own column,
/// and always itself, so padding rows stay finite.
pub(crate) fn attention_mask(
    key_mask: &Tensor,
    batch: usize,
    cached: usize,
    len: usize,
    dtype: DType,
) -> Result<Tensor> {
    let keys = cached + len;
    let (mask_batch, mask_keys) = key_mask.dims2()?;
    if mask_batch != batch || mask_keys != keys {
        candle_core::bail!(
            "key mask is [{mask_batch}, {mask_keys}], expected [{batch}, {keys}] ({cached} cached + {len} new)"
        );
    }
    let real = key_mask.to_dtype(DType::U8)?.to_vec2::<u8>()?;
    let mut values = vec![0f32; batch * len * keys];
    for (row, real) in real.iter().enumerate() {
        for t in 0..len {
            let column = cached + t;
            let offset = (row * len + t) * keys;
            for (s, &is_real) in real.iter().enumerate() {
                if s != column && (s > column || is_real == 0) {
                    values[offset + s] = f32::NEG_INFINITY;
                }
            }
        }
    }
    Tensor::from_vec(values, (batch, 1, len, keys), key_mask.device())?.to_dtype(dtype)
}

/// The additive mask `[B, 1, T, S - front]` (f32) of `T` queries after `cached` columns, over only the
/// key columns `front..S` (`S = cached + T`) that a layer of the pass holds ([`crate::model::LayerCache`]):
/// query `t` (column `cached + t`, at position `positions[b][t]`) sees the real keys (`real[b]`, 1 on
/// real columns) up to its own column, always itself, and with a `window` only keys fewer than `window`
/// positions before its own. These are [`attention_mask`]'s columns with [`window_mask`] applied, from
/// `front` on, without building the columns before it: a decoding step of a long sequence builds a
/// window's width for a windowed layer, not the whole sequence's.
pub(crate) fn held_mask(
    real: &[Vec<u8>],
    positions: &[Vec<u32>],
    cached: usize,
    front: usize,
    window: Option<usize>,
    device: &Device,
) -> Result<Tensor> {
    let (batch, len) = (positions.len(), positions.first().map_or(0, Vec::len));
    let keys = cached + len;
    if real.len() != batch || real.iter().any(|row| row.len() != keys) || front > keys {
        candle_core::bail!(
            "key mask of {} rows, expected {batch} rows of {keys} columns ({cached} cached + {len} new) \
             held from column {front}",
            real.len()
        );
    }
    let width = keys - front;
    let mut values = vec![f32::NEG_INFINITY; batch * len * width];
    let mut key_positions = Vec::with_capacity(width);
    for (b, (real, queries)) in real.iter().zip(positions).enumerate() {
        // A real key's position counts the real columns before it, padding's is 0 (as
        // `positions_from_mask` gives them): only the window reads them.
        if window.is_some() {
            let mut next = real[..front].iter().filter(|&&m| m != 0).count();
            key_positions.clear();
            key_positions.extend(real[front..].iter().map(|&m| match m {
                0 => 0,
                _ => {
                    next += 1;
                    next - 1
                }
            }));
        }
        for (t, &query) in queries.iter().enumerate() {
            let column = cached + t;
            let row = &mut values[(b * len + t) * width..][..width];
            // Keys after the query's column stay hidden; the real ones up to it and itself are seen.
            let seen = (column + 1).saturating_sub(front);
            for (value, &m) in row[..seen].iter_mut().zip(&real[front..]) {
                if m != 0 {
                    *value = 0.0;
                }
            }
            if column >= front {
                row[column - front] = 0.0;
            }
            if let Some(window) = window {
                for (value, &key) in row[..seen].iter_mut().zip(&key_positions) {
                    if key + window <= query as usize {
                        *value = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
    Tensor::from_vec(values, (batch, 1, len, width), device)
}

/// `mask` `[B, 1, T, S]` (additive) with the keys `window` or more positions before their query hidden
/// too: sliding-window attention, where a query at position `p` sees keys at `p - window + 1 ..= p`
/// (transformers' `sliding_window_overlay` over each row's positions). `positions` `[B, T]` are the
/// queries', `key_positions` `[B, S]` the keys'.
pub(crate) fn window_mask(
    mask: &Tensor,
    positions: &Tensor,
    key_positions: &Tensor,
    window: usize,
) -> Result<Tensor> {
    let (batch, _, len, keys) = mask.dims4()?;
    let queries = positions.to_dtype(DType::U32)?.to_vec2::<u32>()?;
    let key_positions = key_positions.to_dtype(DType::U32)?.to_vec2::<u32>()?;
    let mut values = mask.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    for b in 0..batch {
        for (t, &query) in queries[b].iter().enumerate() {
            let row = &mut values[(b * len + t) * keys..(b * len + t + 1) * keys];
            for (value, &key) in row.iter_mut().zip(&key_positions[b]) {
                if key as usize + window <= query as usize {
                    *value = f32::NEG_INFINITY;
                }
            }
        }
    }
    Tensor::from_vec(values, (batch, 1, len, keys), mask.device())?.to_dtype(mask.dtype())
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::{attention_mask, held_mask, positions_from_mask, window_mask, Layout};

    fn seen(layout: &Layout) -> Vec<Vec<Vec<u8>>> {
        let mask = layout.mask.squeeze(1).unwrap().to_vec3::<f32>().unwrap();
        mask.iter()
            .map(|row| {
                row.iter()
                    .map(|keys| keys.iter().map(|&k| u8::from(k == 0.0)).collect())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn a_tree_token_sees_its_ancestors_and_itself_at_its_depth() {
        // Row 0: a prompt (0, 1) with two continuations (2, 3) and (4); row 1: a chain of two, padded.
        let parents = vec![
            vec![None, Some(0), Some(1), Some(2), Some(1)],
            vec![None, Some(0)],
        ];
        let layout = Layout::trees(&parents, &Device::Cpu).unwrap();
        assert_eq!(
            layout.positions.to_vec2::<u32>().unwrap(),
            [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
        );
        assert_eq!(
            seen(&layout),
            [
                vec![
                    vec![1, 0, 0, 0, 0],
                    vec![1, 1, 0, 0, 0],
                    vec![1, 1, 1, 0, 0],
                    vec![1, 1, 1, 1, 0],
                    vec![1, 1, 0, 0, 1],
                ],
                vec![
                    vec![1, 0, 0, 0, 0],
                    vec![1, 1, 0, 0, 0],
                    vec![0, 0, 1, 0, 0],
                    vec![0, 0, 0, 1, 0],
                    vec![0, 0, 0, 0, 1],
                ],
            ]
        );
    }

    #[test]
    fn chains_are_the_causal_layout_of_right_padded_rows() {
        let parents = vec![vec![None, Some(0), Some(1)], vec![None, Some(0)]];
        let trees = Layout::trees(&parents, &Device::Cpu).unwrap();
        let key_mask = Tensor::new(&[[1u8, 1, 1], [1, 1, 0]], &Device::Cpu).unwrap();
        let causal = Layout::causal(&key_mask).unwrap();
        assert_eq!(
            trees.positions.to_vec2::<u32>().unwrap(),
            causal.positions.to_vec2::<u32>().unwrap()
        );
        // The padding column differs (causal padding also sees the real tokens); the real ones agree.
        let (trees, causal) = (seen(&trees), seen(&causal));
        assert_eq!(trees[0], causal[0]);
        assert_eq!(trees[1][..2], causal[1][..2]);
    }

    #[test]
    fn held_masks_are_the_whole_masks_columns_from_the_front() {
        // Three new columns after six cached: a left-padded row, and a row with padding between a
        // reused prefix and its prompt and a padding query.
        let real = vec![
            vec![0u8, 0, 1, 1, 1, 1, 1, 1, 1],
            vec![1, 1, 0, 1, 1, 1, 0, 1, 1],
        ];
        let (cached, len) = (6, 3);
        let key_mask = Tensor::new(real.clone(), &Device::Cpu).unwrap();
        let key_positions = positions_from_mask(&key_mask).unwrap();
        let positions = key_positions.narrow(1, cached, len).unwrap();
        let queries = positions.to_vec2::<u32>().unwrap();
        let whole = attention_mask(&key_mask, 2, cached, len, DType::F32).unwrap();
        for window in [None, Some(1), Some(2), Some(4), Some(9)] {
            let expected = match window {
                None => whole.clone(),
                Some(window) => window_mask(&whole, &positions, &key_positions, window).unwrap(),
            };
            for front in 0..=cached + len {
                let held = held_mask(&real, &queries, cached, front, window, &Device::Cpu).unwrap();
                let expected = expected.narrow(3, front, cached + len - front).unwrap();
                assert_eq!(
                    held.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    expected.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    "window {window:?}, front {front}"
                );
            }
        }
    }

    #[test]
    fn a_parent_after_its_child_is_refused() {
        let error = Layout::trees(&[vec![Some(1), None]], &Device::Cpu).unwrap_err();
        assert!(
            error.to_string().contains("token 0 of row 0 has parent 1"),
            "{error}"
        );
    }
}
