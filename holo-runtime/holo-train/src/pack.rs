//! Sequences laid out for one forward pass, and where their trained tokens are.
//!
//! Two layouts (see [`Layout`]): one right-padded row per sequence, or rows of token trees in which
//! sequences that share a prefix share its tokens. The completions of a GRPO group then compute their
//! prompt once, and multi-turn rollouts their common turns: with G completions of a prompt of P tokens,
//! the pass reads P + G · C tokens instead of G · (P + C). Both give the same log-probabilities up to
//! rounding (a token's state depends only on the tokens it sees), so [`pack`] takes whichever costs
//! fewer operations by a model of the network's shapes (products per token, attention per pair of
//! tokens in a row, padding included), as long as it holds no more activations: a tree is longer than
//! its sequences, and its attention scores grow with the square of its length.
//!
//! Padded rows are kept while LoRA dropout is on: a shared prefix would share one dropout mask between
//! the sequences, where peft draws one per sequence; and for models with linear-attention layers
//! (Qwen3.5), whose recurrence runs through each sequence in order and cannot read a tree.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::batch::Sequence;
use holo_core::Allowed;
use holo_model::model::{Routes, Routing};
use holo_model::{Layout, Model, ModelConfig};

pub type Result<T> = candle_core::Result<T>;

/// Sequences laid out in rows for one forward pass, and where their trained tokens are.
pub struct Packed {
    /// `[R, T]` (u32): each row's tokens, a sequence or a tree of several.
    pub ids: Tensor,
    pub layout: Layout,
    /// `[N]` (u32): the flat position (`r · T + column`) of the hidden state predicting each trained
    /// token.
    pub rows: Tensor,
    /// `[N]` (u32): the trained tokens.
    pub targets: Tensor,
    /// What a constraint allowed at each trained token (`None` where it was drawn whole); empty when
    /// no sequence was constrained.
    pub allowed: Vec<Option<Allowed>>,
    pub tokens: usize,
    /// Per cell of `ids` (row-major): how many sequences hold that token (a tree's shared prefix, several;
    /// padding, none). The load-balancing loss weighs tokens so, as it would weigh them in one padded
    /// row per sequence.
    pub holders: Vec<f64>,
}

/// Lays out `sequences` for one pass through `model`: their trained tokens in order (sequence by
/// sequence, position by position); sequences without one are left out.
pub fn pack(sequences: &[&Sequence], model: &Model) -> Result<Packed> {
    let sequences: Vec<&Sequence> = sequences
        .iter()
        .copied()
        .filter(|s| !s.trained.is_empty())
        .collect();
    let mut packed = laid_out(&sequences, model)?;
    // Both layouts list the trained tokens sequence by sequence, position by position.
    if sequences.iter().any(|s| !s.constraints.allowed.is_empty()) {
        packed.allowed = sequences
            .iter()
            .flat_map(|s| match s.constraints.allowed.is_empty() {
                true => vec![None; s.trained.len()],
                false => s.constraints.allowed.clone(),
            })
            .collect();
    }
    Ok(packed)
}

/// [`pack`]'s layout of `sequences`, each with trained tokens: trees or padded rows.
fn laid_out(sequences: &[&Sequence], model: &Model) -> Result<Packed> {
    // Linear attention reads each sequence in order: never trees.
    if !model.has_dropout() && !model.has_linear_attention() {
        let costs = Costs::of(&model.config);
        let forest = Forest::grow(sequences, &costs);
        let width = sequences.iter().map(|s| s.ids.len()).max().unwrap_or(0);
        let (trees, rows) = (
            (forest.trees.len(), forest.width()),
            (sequences.len(), width),
        );
        if costs.work.rows(trees) < costs.work.rows(rows)
            && costs.memory.rows(trees) <= costs.memory.rows(rows)
        {
            return forest.pack(sequences, model);
        }
    }
    padded(sequences, model)
}

/// `layout` with the sequences' recorded routes replayed, for a mixture-of-experts model when some
/// sequence carries them: `place(s, position)` is the flat index (`row · width + column`) of token
/// `position` of sequence `s` in the pass of `cells` tokens; a token no sequence recorded is routed
/// by the router. Where sequences share a token (a tree's prefix), the first one's routes are taken.
fn replayed(
    layout: Layout,
    sequences: &[&Sequence],
    cells: usize,
    place: impl Fn(usize, usize) -> usize,
    config: &ModelConfig,
) -> Result<Layout> {
    if config.experts.is_none() || sequences.iter().all(|s| s.routes.is_none()) {
        return Ok(layout);
    }
    let mut tokens: Vec<&[u32]> = vec![&[]; cells];
    for (s, sequence) in sequences.iter().enumerate() {
        let Some(routes) = &sequence.routes else {
            continue;
        };
        for (position, routes) in routes.iter().enumerate().take(sequence.ids.len()) {
            let cell = &mut tokens[place(s, position)];
            if cell.is_empty() {
                *cell = routes;
            }
        }
    }
    let routes = Routes::from_tokens(tokens.into_iter(), config)?;
    Ok(layout.with_routing(Arc::new(Routing::replay(routes))))
}

/// One right-padded row per sequence.
fn padded(sequences: &[&Sequence], model: &Model) -> Result<Packed> {
    let device = model.device();
    let width = sequences
        .iter()
        .map(|s| s.ids.len())
        .max()
        .unwrap_or(0)
        .max(2);
    let rows_count = sequences.len();
    let mut ids = vec![0u32; rows_count * width];
    let mut mask = vec![0u8; rows_count * width];
    let mut rows = Vec::new();
    let mut targets = Vec::new();
    for (s, sequence) in sequences.iter().enumerate() {
        ids[s * width..s * width + sequence.ids.len()].copy_from_slice(&sequence.ids);
        mask[s * width..s * width + sequence.ids.len()].fill(1);
        for &position in &sequence.trained {
            rows.push((s * width + position - 1) as u32);
            targets.push(sequence.ids[position]);
        }
    }
    let holders = mask.iter().map(|&real| f64::from(real)).collect();
    let mask = Tensor::from_vec(mask, (rows_count, width), device)?;
    let layout = replayed(
        Layout::causal(&mask)?,
        sequences,
        rows_count * width,
        |s, position| s * width + position,
        &model.config,
    )?;
    finish(
        ids,
        (rows_count, width),
        layout,
        (rows, targets),
        holders,
        device,
    )
}

fn finish(
    ids: Vec<u32>,
    shape: (usize, usize),
    layout: Layout,
    (rows, targets): (Vec<u32>, Vec<u32>),
    holders: Vec<f64>,
    device: &Device,
) -> Result<Packed> {
    let tokens = rows.len();
    Ok(Packed {
        ids: Tensor::from_vec(ids, shape, device)?,
        layout,
        rows: Tensor::from_vec(rows, tokens, device)?,
        targets: Tensor::from_vec(targets, tokens, device)?,
        allowed: Vec::new(),
        tokens,
        holders,
    })
}

/// What one decoder layer costs per token and per (query, key) pair of a row.
struct Cost {
    per_token: u128,
    per_pair: u128,
}

impl Cost {
    /// `count` rows of `width` tokens.
    fn rows(&self, (count, width): (usize, usize)) -> u128 {
        let width = width as u128;
        count as u128 * (width * self.per_token + width * width * self.per_pair)
    }

    /// A row of `size` tokens growing by `added`.
    fn growth(&self, size: usize, added: usize) -> u128 {
        self.rows((1, size + added)) - self.rows((1, size))
    }
}

/// The two costs [`pack`] compares layouts by.
struct Costs {
    /// Multiply-adds: the projections and the MLP per token; per pair, over all heads, the scores, the
    /// weighted sum of values and [`PAIR_PASSES`] for the element-wise passes over the scores.
    work: Cost,
    /// Activations (values) alive while a layer's backward runs, by an estimate: per token its input
    /// kept for every layer, and one layer's normed inputs, projections, MLP activations and their
    /// gradients; per pair, over all heads, the scores, the attention weights and their gradient.
    memory: Cost,
}

/// What the element-wise passes over one head's attention scores (scale, mask, softmax, and their
/// backwards) cost, in multiply-adds of a product: they run at memory speed. Fitted on the tiny Qwen2's
/// GRPO step (`benches/grpo_compare.py`), where padded rows of 33 tokens and trees of 145 took the same
/// time; it matters only for models this small, where attention is a large part of a layer.
const PAIR_PASSES: u128 = 64;

impl Costs {
    fn of(config: &ModelConfig) -> Costs {
        let value = |n: usize| n as u128;
        let (hidden, head_dim, inner) = (
            value(config.hidden_size),
            value(config.head_dim),
            value(config.intermediate_size),
        );
        let (heads, kv_heads) = (
            value(config.num_attention_heads),
            value(config.num_key_value_heads),
        );
        let projected = head_dim * (2 * heads + 2 * kv_heads);
        Costs {
            work: Cost {
                per_token: hidden * projected + 3 * hidden * inner,
                per_pair: heads * (2 * head_dim + PAIR_PASSES),
            },
            memory: Cost {
                per_token: value(config.num_hidden_layers) * hidden
                    + 2 * (2 * hidden + projected + 3 * inner),
                per_pair: 3 * heads,
            },
        }
    }
}

/// The column a root's parent stands for in [`Tree::children`].
const ROOT: usize = usize::MAX;

/// Sequences sharing one row: each distinct prefix is one token (column) of the row.
#[derive(Default)]
struct Tree {
    ids: Vec<u32>,
    parents: Vec<Option<usize>>,
    /// The column of the child of (parent column or [`ROOT`], token).
    children: HashMap<(usize, u32), usize>,
}

impl Tree {
    /// How many leading tokens of `ids` the tree holds already.
    fn shared(&self, ids: &[u32]) -> usize {
        let mut column = ROOT;
        for (depth, &id) in ids.iter().enumerate() {
            match self.children.get(&(column, id)) {
                Some(&child) => column = child,
                None => return depth,
            }
        }
        ids.len()
    }

    /// Adds the prefixes of `ids` the tree lacks; returns the column of each token of `ids`.
    fn insert(&mut self, ids: &[u32]) -> Vec<usize> {
        let mut path = Vec::with_capacity(ids.len());
        let mut column = ROOT;
        for &id in ids {
            let next = self.ids.len();
            let child = *self.children.entry((column, id)).or_insert(next);
            if child == next {
                self.ids.push(id);
                self.parents.push((column != ROOT).then_some(column));
            }
            path.push(child);
            column = child;
        }
        path
    }
}

/// Sequences placed in trees, and where each sequence's tokens are.
struct Forest {
    trees: Vec<Tree>,
    /// Per sequence: its tree and the column of each of its tokens.
    places: Vec<(usize, Vec<usize>)>,
}

impl Forest {
    /// Places each sequence, in order, in the tree it adds the least work to, or in a tree of its own
    /// when that is less work or when joining would hold more activations than a tree of its own.
    fn grow(sequences: &[&Sequence], costs: &Costs) -> Forest {
        let mut forest = Forest {
            trees: Vec::new(),
            places: Vec::with_capacity(sequences.len()),
        };
        for sequence in sequences {
            let alone = (1, sequence.ids.len());
            let best = forest
                .trees
                .iter()
                .enumerate()
                .filter_map(|(t, tree)| {
                    let added = sequence.ids.len() - tree.shared(&sequence.ids);
                    let size = tree.ids.len();
                    (costs.memory.growth(size, added) <= costs.memory.rows(alone))
                        .then(|| (costs.work.growth(size, added), t))
                })
                .min();
            let tree = match best {
                Some((growth, t)) if growth < costs.work.rows(alone) => t,
                _ => {
                    forest.trees.push(Tree::default());
                    forest.trees.len() - 1
                }
            };
            let path = forest.trees[tree].insert(&sequence.ids);
            forest.places.push((tree, path));
        }
        forest
    }

    /// The longest row.
    fn width(&self) -> usize {
        self.trees.iter().map(|t| t.ids.len()).max().unwrap_or(0)
    }

    /// The rows of the trees (the `sequences` [`Forest::grow`] placed).
    fn pack(self, sequences: &[&Sequence], model: &Model) -> Result<Packed> {
        let device = model.device();
        let width = self.width().max(2);
        let mut ids = vec![0u32; self.trees.len() * width];
        for (t, tree) in self.trees.iter().enumerate() {
            ids[t * width..t * width + tree.ids.len()].copy_from_slice(&tree.ids);
        }
        let mut rows = Vec::new();
        let mut targets = Vec::new();
        for (sequence, (tree, path)) in sequences.iter().zip(&self.places) {
            for &position in &sequence.trained {
                rows.push((tree * width + path[position - 1]) as u32);
                targets.push(sequence.ids[position]);
            }
        }
        let parents: Vec<Vec<Option<usize>>> = self.trees.into_iter().map(|t| t.parents).collect();
        let places = &self.places;
        let place = |s: usize, position: usize| places[s].0 * width + places[s].1[position];
        let mut holders = vec![0.0; parents.len() * width];
        for (s, sequence) in sequences.iter().enumerate() {
            for position in 0..sequence.ids.len() {
                holders[place(s, position)] += 1.0;
            }
        }
        let layout = replayed(
            Layout::trees(&parents, device)?,
            sequences,
            parents.len() * width,
            place,
            &model.config,
        )?;
        finish(
            ids,
            (parents.len(), width),
            layout,
            (rows, targets),
            holders,
            device,
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use candle_core::{DType, Device, IndexOp, Tensor};
    use rand::{Rng, SeedableRng};

    use super::*;
    use holo_model::config::Arch;
    use holo_model::model::LoraConfig;
    use holo_model::testing::{config, max_abs, max_difference, random_model};
    use holo_model::Ops;

    /// A sequence of `ids` trained at the positions `trained`, without sampling log-probabilities.
    pub(crate) fn sequence(ids: &[u32], trained: std::ops::Range<usize>) -> Sequence {
        Sequence {
            ids: ids.to_vec(),
            trained: trained.collect(),
            sampling_logprobs: Vec::new(),
            routes: None,
            constraints: Default::default(),
        }
    }

    /// A group of three completions of one prompt (the third twice, the last one's end again as an
    /// earlier one's), another prompt's completion, and a context with nothing trained.
    fn group() -> Vec<Sequence> {
        let prompt = [5u32, 6, 7, 8, 9, 10];
        let with = |tail: &[u32]| [&prompt[..], tail].concat();
        vec![
            sequence(&with(&[11, 12, 13]), 6..9),
            sequence(&with(&[11, 14]), 6..8),
            sequence(&with(&[15, 16, 17, 18]), 6..10),
            sequence(&[20, 21, 22, 23, 24], 3..5),
            sequence(&with(&[15, 16, 17, 18]), 6..10),
            sequence(&with(&[30]), 6..6),
        ]
    }

    fn picked(model: &Model, packed: &Packed) -> Tensor {
        let hidden = model
            .forward_hidden_in(&packed.ids, &packed.layout, Ops::Differentiable)
            .unwrap();
        let (batch, len, size) = hidden.dims3().unwrap();
        hidden
            .reshape((batch * len, size))
            .unwrap()
            .index_select(&packed.rows, 0)
            .unwrap()
    }

    /// The constraints' masks come out in the targets' order (here in trees), with `None` at the
    /// tokens drawn whole; with no mask anywhere there are none.
    #[test]
    fn masks_line_up_with_the_targets() {
        let mut sequences = group();
        let model = random_model(&config(Arch::Qwen2), DType::F64);
        let unmasked: Vec<&Sequence> = sequences.iter().collect();
        assert!(pack(&unmasked, &model).unwrap().allowed.is_empty());
        // The second completion's first token may only be its target; the fourth's two only token 0.
        sequences[1].constraints.allowed = vec![Some(Allowed::of(&[11], 64)), None];
        sequences[3].constraints.allowed = vec![Some(Allowed::of(&[0], 64)); 2];
        let sequences: Vec<&Sequence> = sequences.iter().collect();
        let packed = pack(&sequences, &model).unwrap();
        let targets: Vec<u32> = packed.targets.to_vec1().unwrap();
        assert_eq!(packed.allowed.len(), targets.len());
        let masked: Vec<(usize, bool)> = packed
            .allowed
            .iter()
            .enumerate()
            .filter_map(|(index, allowed)| {
                let allowed = allowed.as_ref()?;
                Some((index, allowed.contains(targets[index] as usize)))
            })
            .collect();
        // Trained tokens: the first completion's 3, the second's 2, the third's 4, the fourth's 2.
        assert_eq!(masked, [(3, true), (9, false), (10, false)]);
    }

    #[test]
    fn a_group_shares_its_prompt_in_one_tree() {
        let sequences = group();
        let sequences: Vec<&Sequence> = sequences.iter().collect();
        let model = random_model(&config(Arch::Qwen2), DType::F64);
        let packed = pack(&sequences, &model).unwrap();
        // The prompt (6), the completions' distinct tokens (3 + 1 + 4), the other prompt's row (5).
        assert_eq!(packed.ids.dims(), [2, 14]);
        assert_eq!(
            packed.ids.i(0).unwrap().to_vec1::<u32>().unwrap(),
            [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
        );
        assert_eq!(
            packed.layout.positions.to_vec2::<u32>().unwrap()[0],
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 7, 6, 7, 8, 9]
        );
        // Each trained token is predicted by the column of the token before it.
        let expected_rows = [
            [5, 6, 7].as_slice(),
            &[5, 6],
            &[5, 10, 11, 12],
            &[14 + 2, 14 + 3],
            &[5, 10, 11, 12],
        ]
        .concat();
        assert_eq!(packed.rows.to_vec1::<u32>().unwrap(), expected_rows);
        assert_eq!(
            packed.targets.to_vec1::<u32>().unwrap(),
            [11, 12, 13, 11, 14, 15, 16, 17, 18, 23, 24, 15, 16, 17, 18]
        );
        assert_eq!(packed.tokens, 15);
    }

    /// On Qwen2, and on Gemma 2 with soft-caps small enough to bend its scores and logits (the cap is
    /// applied before the tree's mask, and differentiated in the written-out backward).
    #[test]
    fn trees_and_padded_rows_give_the_same_states_and_gradients() {
        let sequences = group();
        let sequences: Vec<&Sequence> =
            sequences.iter().filter(|s| !s.trained.is_empty()).collect();
        let mut capped = config(Arch::Gemma2);
        capped.variant.attention_softcap = Some(0.5);
        capped.variant.final_softcap = Some(1.0);
        for config in [config(Arch::Qwen2), capped] {
            trees_match_padded_rows(&sequences, &config);
        }
    }

    fn trees_match_padded_rows(sequences: &[&Sequence], config: &ModelConfig) {
        let sequences = sequences.to_vec();
        let base = random_model(config, DType::F64);
        let (model, vars) = base.trainable().unwrap();
        let device = Device::Cpu;
        let costs = Costs::of(&model.config);
        let trees = Forest::grow(&sequences, &costs)
            .pack(&sequences, &model)
            .unwrap();
        let rows = padded(&sequences, &model).unwrap();
        assert_eq!(trees.ids.dim(0).unwrap(), 2);
        assert_eq!(
            trees.targets.to_vec1::<u32>().unwrap(),
            rows.targets.to_vec1::<u32>().unwrap()
        );
        let (tree_states, row_states) = (picked(&model, &trees), picked(&model, &rows));
        assert!(max_difference(&tree_states, &row_states) < 1e-12);

        // A loss that weighs every picked state differently, through activation recomputation.
        let weights = Tensor::arange(0f64, tree_states.elem_count() as f64, &device)
            .unwrap()
            .reshape(tree_states.shape())
            .unwrap()
            .sin()
            .unwrap();
        let gradients = |packed: &Packed| {
            let (_, grads) = model
                .backward_recomputed_with_head(&packed.ids, &packed.layout, &[], |hidden| {
                    let (batch, len, size) = hidden.dims3()?;
                    let states = hidden
                        .reshape((batch * len, size))?
                        .index_select(&packed.rows, 0)?;
                    (states * &weights)?.sum_all()
                })
                .unwrap();
            grads
        };
        let (tree_grads, row_grads) = (gradients(&trees), gradients(&rows));
        for (name, var) in &vars {
            let (a, b) = (
                tree_grads.get(var.as_tensor()).unwrap(),
                row_grads.get(var.as_tensor()).unwrap(),
            );
            let (scale, difference) = (max_abs(b), max_difference(a, b));
            assert!(
                difference <= 1e-10 * scale.max(1.0),
                "{}: {name}: {difference} of {scale}",
                config.arch
            );
        }
    }

    /// Random groups of sequences that share prefixes of random lengths (whole sequences included):
    /// every layout [`pack`] may choose scores each trained token as the padded rows do.
    #[test]
    fn any_sharing_scores_as_padded_rows_do() {
        let model = random_model(&config(Arch::Llama), DType::F64);
        let costs = Costs::of(&model.config);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for _ in 0..20 {
            let mut sequences: Vec<Sequence> = Vec::new();
            for _ in 0..rng.random_range(1..7) {
                // A prefix of an earlier sequence (all of it, or none), then new tokens.
                let mut ids = match sequences.last() {
                    Some(earlier) if rng.random_bool(0.7) => {
                        earlier.ids[..rng.random_range(0..=earlier.ids.len())].to_vec()
                    }
                    _ => Vec::new(),
                };
                let extra = rng.random_range(0..6).max(2usize.saturating_sub(ids.len()));
                ids.extend((0..extra).map(|_| rng.random_range(0..37u32)));
                let first = rng.random_range(1..ids.len());
                sequences.push(sequence(&ids, first..ids.len()));
            }
            let sequences: Vec<&Sequence> = sequences.iter().collect();
            let trees = Forest::grow(&sequences, &costs)
                .pack(&sequences, &model)
                .unwrap();
            let rows = padded(&sequences, &model).unwrap();
            assert_eq!(
                trees.targets.to_vec1::<u32>().unwrap(),
                rows.targets.to_vec1::<u32>().unwrap()
            );
            let difference = max_difference(&picked(&model, &trees), &picked(&model, &rows));
            assert!(difference < 1e-12, "{difference}");
        }
    }

    /// Qwen2.5-0.5B's shapes, 16 completions of 256 tokens after a prompt of 512: by work alone one tree
    /// of 4608 tokens would do, but its attention scores would outgrow the activations of padded rows;
    /// the trees stop at 8 completions (2560 tokens), where a ninth would add more activations than a
    /// row of its own.
    #[test]
    fn trees_stop_growing_where_their_attention_would_hold_more_than_padded_rows() {
        let config = ModelConfig {
            hidden_size: 896,
            intermediate_size: 4864,
            num_hidden_layers: 24,
            num_attention_heads: 14,
            num_key_value_heads: 2,
            head_dim: 64,
            ..config(Arch::Qwen2)
        };
        let prompt: Vec<u32> = (0..512).collect();
        let sequences: Vec<Sequence> = (0..16u32)
            .map(|c| {
                let completion = (0..256).map(|t| 1000 + c * 256 + t);
                let ids: Vec<u32> = prompt.iter().copied().chain(completion).collect();
                sequence(&ids, 512..768)
            })
            .collect();
        let sequences: Vec<&Sequence> = sequences.iter().collect();
        let costs = Costs::of(&config);
        let forest = Forest::grow(&sequences, &costs);
        let sizes: Vec<usize> = forest.trees.iter().map(|t| t.ids.len()).collect();
        assert_eq!(sizes, [2560, 2560]);
        let (trees, rows) = ((2, 2560), (16, 768));
        assert!(costs.memory.rows(trees) <= costs.memory.rows(rows));
        assert!(costs.work.rows(trees) < costs.work.rows(rows));
        // Work alone would have grown one tree of all 16.
        assert!(costs.work.growth(4352, 256) < costs.work.rows((1, 768)));
    }

    #[test]
    fn sequences_without_a_shared_prefix_stay_in_padded_rows() {
        let sequences = [sequence(&[1, 2, 3, 4], 1..4), sequence(&[5, 6, 7], 1..3)];
        let sequences: Vec<&Sequence> = sequences.iter().collect();
        let model = random_model(&config(Arch::Qwen2), DType::F32);
        let packed = pack(&sequences, &model).unwrap();
        assert_eq!(packed.ids.dims(), [2, 4]);
        assert_eq!(packed.rows.to_vec1::<u32>().unwrap(), [0, 1, 2, 4, 5]);
    }

    #[test]
    fn lora_dropout_keeps_padded_rows() {
        let sequences = group();
        let sequences: Vec<&Sequence> = sequences.iter().collect();
        let base = random_model(&config(Arch::Qwen2), DType::F32);
        for (dropout, rows) in [(0.0, 2), (0.1, 5)] {
            let lora = LoraConfig {
                dropout,
                ..LoraConfig::default()
            };
            let (model, _) = base.with_lora(&lora).unwrap();
            assert_eq!(pack(&sequences, &model).unwrap().ids.dim(0).unwrap(), rows);
        }
    }
}
