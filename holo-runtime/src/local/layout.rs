//! Where the tokens of a pass without a cache sit, and which tokens each one attends to.
//!
//! Training and scoring passes read whole sequences. [`Layout::causal`] lays them out one per row,
//! padded, each token seeing the real tokens of its row up to itself, as transformers does.
//! [`Layout::trees`] packs sequences that share prefixes into one row as a tree of tokens: a shared
//! prefix (the prompt of a GRPO group, say) is computed once, and each token sees only its ancestors and
//! itself, at its depth as position. A token's hidden state depends only on the tokens it sees and on
//! their positions, so both layouts give the same states, up to rounding.

use candle_core::{Device, Tensor};

use super::model::{attention_mask, positions_from_mask, Result};

/// The positions and the attention mask of a pass over `[B, T]` tokens without a cache.
#[derive(Debug, Clone)]
pub struct Layout {
    /// `[B, T]` (u32): each token's position in its own sequence, which the rotary embedding reads.
    pub positions: Tensor,
    /// `[B, 1, T, T]` (f32, additive): 0 where the query (third axis) sees the key (last axis), −∞
    /// elsewhere. Every token sees itself, so padding stays finite.
    pub mask: Tensor,
}

impl Layout {
    /// Rows of left- or right-padded sequences: `key_mask` `[B, T]` is 1 on real tokens; each token sees
    /// the real tokens of its row up to itself, and its position counts the real tokens before it.
    pub fn causal(key_mask: &Tensor) -> Result<Layout> {
        let (batch, len) = key_mask.dims2()?;
        Ok(Layout {
            positions: positions_from_mask(key_mask)?,
            mask: attention_mask(key_mask, batch, 0, len, candle_core::DType::F32)?,
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
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::Layout;

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
    fn a_parent_after_its_child_is_refused() {
        let error = Layout::trees(&[vec![Some(1), None]], &Device::Cpu).unwrap_err();
        assert!(
            error.to_string().contains("token 0 of row 0 has parent 1"),
            "{error}"
        );
    }
}
