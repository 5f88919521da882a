//! Keys and values: per layer ([`LayerCache`], written in place while decoding) and per batch
//! ([`KvCache`]: rows prefilled from earlier sequences, selected, appended, trimmed).
//!
//! A batch's rows share one axis of columns, right-aligned. A layer with an attention window keeps
//! only the columns some row can still read ([`KvCache::trim`]): its first [`LayerCache::front`]
//! columns are gone, so a long sequence holds about `window` columns there instead of all of them.

use super::*;

/// Keys and values of one layer, `[B, kv_heads, S, head_dim]`; or, in a linear-attention layer, its
/// states.
#[derive(Debug, Default)]
pub struct LayerCache {
    keys_values: Option<(Tensor, Tensor)>,
    /// A linear-attention layer's states after each row's last token: the convolution's last inputs
    /// `[B, channels, K - 1]` and the delta rule's `[B, value_heads, key_dim, value_dim]` (see
    /// `delta.rs`).
    pub(super) state: Option<(Tensor, Tensor)>,
    /// Buffers `[B, kv_heads, capacity, head_dim]` whose first `S` columns are `keys_values` (views of
    /// them), so that a decoding step writes its column in place: concatenating copied the whole cache
    /// at every step, for every layer. Only this cache writes into them; a clone starts without.
    /// [`KvCache::capacity`] counts them.
    room: Option<(Tensor, Tensor)>,
    /// The layer's attention window ([`crate::config::LayerSpec::window`]).
    window: Option<usize>,
    /// Leading columns of the batch that this layer no longer holds: no row can read them through its
    /// window any more ([`KvCache::trim`]). The first held column is the batch's column `front`.
    front: usize,
}

impl Clone for LayerCache {
    fn clone(&self) -> Self {
        LayerCache {
            keys_values: self.keys_values.clone(),
            state: self.state.clone(),
            room: None,
            window: self.window,
            front: self.front,
        }
    }
}

impl LayerCache {
    /// Leading columns of the batch this layer no longer holds (see [`KvCache::trim`]): a pass's mask
    /// for this layer covers the columns from here on ([`Model::frame`]).
    pub(crate) fn front(&self) -> usize {
        self.front
    }

    /// Columns held per row.
    fn held(&self) -> usize {
        self.keys_values
            .as_ref()
            .map_or(0, |(k, _)| k.dim(2).unwrap_or(0))
    }

    /// Drops the held columns before the batch's column `front` and frees them: what is kept is copied
    /// into buffers of its own, with room for `room` more columns.
    fn drop_until(&mut self, front: usize, room: usize) -> Result<()> {
        let Some((k, v)) = self.keys_values.take() else {
            self.front = front;
            return Ok(());
        };
        let kept = k.dim(2)? - (front - self.front);
        let (k, v) = (
            k.narrow(2, front - self.front, kept)?,
            v.narrow(2, front - self.front, kept)?,
        );
        self.front = front;
        if self.room.is_none() {
            // Concatenating caches (a graph, a GPU) hold no buffers: a copy frees the dropped columns.
            self.set(Some((k.contiguous()?, v.contiguous()?)));
            return Ok(());
        }
        let capacity = (kept + room).next_multiple_of(16);
        let copy = |t: &Tensor| -> Result<Tensor> {
            let (batch, heads, _, dim) = t.dims4()?;
            let buffer = Tensor::zeros((batch, heads, capacity, dim), t.dtype(), t.device())?;
            buffer.slice_set(&t.contiguous()?, 2, 0)?;
            Ok(buffer)
        };
        let (room_k, room_v) = (copy(&k)?, copy(&v)?);
        self.keys_values = Some((room_k.narrow(2, 0, kept)?, room_v.narrow(2, 0, kept)?));
        self.room = Some((room_k, room_v));
        Ok(())
    }

    pub(super) fn append(&mut self, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let joined = match self.keys_values.take() {
            None => (k.contiguous()?, v.contiguous()?),
            // A differentiable pass keeps its graph through the cached keys: no writes in place. (On a
            // GPU, where nothing here has been measured, the cache concatenates too.)
            Some((old_k, old_v)) if k.track_op() || v.track_op() || !k.device().is_cpu() => {
                self.room = None;
                (
                    Tensor::cat(&[&old_k, &k], 2)?,
                    Tensor::cat(&[&old_v, &v], 2)?,
                )
            }
            Some((old_k, old_v)) => self.write_in_place((&old_k, &old_v), (&k, &v))?,
        };
        self.keys_values = Some(joined.clone());
        Ok(joined)
    }

    /// `old` followed by `new`, as views of the buffers, which `new` is written into (grown first when
    /// they have no room for it).
    pub(super) fn write_in_place(
        &mut self,
        (old_k, old_v): (&Tensor, &Tensor),
        (k, v): (&Tensor, &Tensor),
    ) -> Result<(Tensor, Tensor)> {
        let cached = old_k.dim(2)?;
        let needed = cached + k.dim(2)?;
        let (room_k, room_v) = match self.room.take() {
            Some((room_k, room_v)) if room_k.dim(2)? >= needed => (room_k, room_v),
            _ => {
                // Room for an eighth more (at least 16 columns): a sequence's cache is copied once
                // every `needed / 8` steps instead of at every step, and no more than an eighth of it
                // is allocated unused.
                let capacity = (needed + needed / 8).next_multiple_of(16);
                let grown = |old: &Tensor| -> Result<Tensor> {
                    let (batch, heads, _, dim) = old.dims4()?;
                    let room =
                        Tensor::zeros((batch, heads, capacity, dim), old.dtype(), old.device())?;
                    room.slice_set(&old.contiguous()?, 2, 0)?;
                    Ok(room)
                };
                (grown(old_k)?, grown(old_v)?)
            }
        };
        room_k.slice_set(&k.contiguous()?, 2, cached)?;
        room_v.slice_set(&v.contiguous()?, 2, cached)?;
        let joined = (room_k.narrow(2, 0, needed)?, room_v.narrow(2, 0, needed)?);
        self.room = Some((room_k, room_v));
        Ok(joined)
    }

    /// Replaces the cached keys and values (the buffers no longer hold them).
    pub(super) fn set(&mut self, keys_values: Option<(Tensor, Tensor)>) {
        self.keys_values = keys_values;
        self.room = None;
    }

    /// Keeps the given rows, in that order, with the buffers' spare columns when there are buffers.
    pub(super) fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        if let Some((conv, rule)) = self.state.take() {
            self.state = Some((conv.index_select(rows, 0)?, rule.index_select(rows, 0)?));
        }
        let Some((k, v)) = self.keys_values.take() else {
            return Ok(());
        };
        match self.room.take() {
            Some((room_k, room_v)) => {
                let cached = k.dim(2)?;
                let (room_k, room_v) =
                    (room_k.index_select(rows, 0)?, room_v.index_select(rows, 0)?);
                self.keys_values =
                    Some((room_k.narrow(2, 0, cached)?, room_v.narrow(2, 0, cached)?));
                self.room = Some((room_k, room_v));
            }
            None => self.set(Some((k.index_select(rows, 0)?, v.index_select(rows, 0)?))),
        }
        Ok(())
    }
}

/// What one layer keeps of one sequence.
#[derive(Debug, Clone)]
pub enum LayerSequence {
    /// Keys and values `[1, kv_heads, n - skipped, head_dim]` of the sequence's positions
    /// `skipped..n`: a layer with a `window` drops the first positions once no later query reads them
    /// ([`KvCache::trim`]); a layer without keeps them all (`skipped` 0).
    KeysValues {
        keys: Tensor,
        values: Tensor,
        skipped: usize,
        window: Option<usize>,
    },
    /// A linear-attention layer's states after the sequence's last token (see [`LayerCache`]), with one
    /// row.
    State(Tensor, Tensor),
}

impl LayerSequence {
    /// Whether the layer can start a prompt that shares the first `length` of the sequence's `whole`
    /// tokens: a state only when it shares them all; keys and values when they hold every position the
    /// prompt's first new token (at position `length`) reads, `length + 1 - window ..` for a window.
    pub fn starts(&self, length: usize, whole: usize) -> bool {
        match self {
            LayerSequence::KeysValues {
                skipped, window, ..
            } => *skipped == 0 || window.is_some_and(|window| length + 1 >= skipped + window),
            LayerSequence::State(..) => length == whole,
        }
    }

    /// What the layer keeps of the sequence's first `length` of its `whole` tokens; `None` when it
    /// cannot start such a prompt ([`LayerSequence::starts`]).
    pub fn prefix(&self, length: usize, whole: usize) -> Result<Option<LayerSequence>> {
        if !self.starts(length, whole) {
            return Ok(None);
        }
        Ok(Some(match self {
            LayerSequence::KeysValues {
                keys,
                values,
                skipped,
                window,
            } => {
                // A windowed layer's first new query reads no position before `length + 1 - window`.
                let kept = length - skipped;
                LayerSequence::KeysValues {
                    keys: keys.narrow(2, 0, kept)?,
                    values: values.narrow(2, 0, kept)?,
                    skipped: *skipped,
                    window: *window,
                }
            }
            LayerSequence::State(..) => self.clone(),
        }))
    }
}

/// What each layer keeps of one sequence.
pub type SequenceCache = Vec<LayerSequence>;

/// Whether a sequence's cache can start a prompt that shares its first `length` of `whole` tokens:
/// not a part of it when a layer keeps a state (which holds the whole sequence), nor a part whose
/// window reaches back into positions a windowed layer dropped.
pub fn starts(layers: &SequenceCache, length: usize, whole: usize) -> bool {
    layers.iter().all(|layer| layer.starts(length, whole))
}

/// One batch of [`Model::forward_segments`]: token ids and positions `[B, T]`, the key mask over its
/// cached columns and the `T` new ones, and its cache.
pub struct Segment<'c> {
    pub input_ids: Tensor,
    pub positions: Tensor,
    pub key_mask: Tensor,
    pub cache: &'c mut KvCache,
    /// Each row's sequence length as transformers' forward over it would see it, which picks
    /// LongRoPE's short or long factors ([`Model::long_rope_context`]): a prompt's whole length while
    /// its chunks are prefilled, since transformers runs it in one pass. `None`: each row's last
    /// position in this pass, + 1.
    pub lengths: Option<Vec<usize>>,
}

/// The key/value cache of a batch, one entry per layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub(super) layers: Vec<LayerCache>,
}

/// Columns a windowed layer lets go of at once: what [`KvCache::trim`] drops is copied out of the
/// buffers, so it waits for an eighth of the window (at most 64 columns) to be droppable, which costs a
/// copy of the window every `window / 8` steps and holds at most that many columns more.
pub fn trim_block(window: usize) -> usize {
    (window / 8).clamp(1, 64)
}

impl KvCache {
    pub fn new(config: &ModelConfig) -> Self {
        KvCache {
            layers: config
                .layers
                .iter()
                .map(|spec| LayerCache {
                    window: spec.window.filter(|_| !spec.linear),
                    ..LayerCache::default()
                })
                .collect(),
        }
    }

    /// Columns allocated per row, in the layer that allocates the most: [`KvCache::len`] and the spare
    /// columns that decoding steps write into, less what windowed layers dropped.
    pub fn capacity(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|layer| layer.room.as_ref().or(layer.keys_values.as_ref()))
            .map(|(keys, _)| keys.dim(2).unwrap_or(0))
            .max()
            .unwrap_or(0)
    }

    /// Bytes the cache holds: keys and values with their spare columns, and linear-attention states.
    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.layers
            .iter()
            .map(|layer| {
                let keys_values = layer
                    .room
                    .as_ref()
                    .or(layer.keys_values.as_ref())
                    .map_or(0, |(k, v)| size(k) + size(v));
                let state = layer
                    .state
                    .as_ref()
                    .map_or(0, |(conv, rule)| size(conv) + size(rule));
                keys_values + state
            })
            .sum()
    }

    /// Columns each attention layer holds per row (0 for a linear-attention layer): a windowed layer's
    /// stay within its window and [`trim_block`] once trimmed, however long the rows.
    pub fn held(&self) -> Vec<usize> {
        self.layers.iter().map(LayerCache::held).collect()
    }

    /// Cached positions (columns), counted by the attention layers' keys (with the columns windowed
    /// layers dropped).
    pub fn len(&self) -> usize {
        self.layers
            .iter()
            .find(|layer| layer.keys_values.is_some())
            .map_or(0, |layer| layer.front + layer.held())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts the cache from earlier sequences: row `b` gets `reused[b]`'s keys and values (each layer
    /// `[1, kv_heads, n, head_dim]`), right-aligned in `width` columns (zeros before, masked by the caller),
    /// or only zeros; a linear-attention layer gets the sequence's states, or zero states. A windowed
    /// layer starts at the first column a row holds: a row that dropped positions
    /// ([`LayerSequence::KeysValues`]'s `skipped`) gets zeros in their place, which its window hides.
    pub fn prefill(
        &mut self,
        reused: &[Option<(usize, SequenceCache)>],
        width: usize,
        model: &Model,
    ) -> Result<()> {
        let config = &model.config;
        let shape = |n: usize| (1, config.num_key_value_heads, n, config.head_dim);
        for (l, layer) in self.layers.iter_mut().enumerate() {
            if let Mixer::Linear(linear) = &model.layers[l].mixer {
                let (mut convs, mut rules) = (Vec::new(), Vec::new());
                for row in reused {
                    let (conv, rule) = match row.as_ref().map(|(_, layers)| &layers[l]) {
                        Some(LayerSequence::State(conv, rule)) => (conv.clone(), rule.clone()),
                        Some(LayerSequence::KeysValues { .. }) => {
                            candle_core::bail!(
                                "keys and values cached for linear-attention layer {l}"
                            )
                        }
                        None => linear.zero_states(1, model.dtype(), model.device())?,
                    };
                    convs.push(conv);
                    rules.push(rule);
                }
                layer.state = Some((Tensor::cat(&convs, 0)?, Tensor::cat(&rules, 0)?));
                continue;
            }
            // Each row's first held column: its padding, then the positions its layer dropped, come
            // before it.
            let mut rows = Vec::with_capacity(reused.len());
            for row in reused {
                rows.push(match row {
                    Some((length, layers)) => match &layers[l] {
                        LayerSequence::KeysValues {
                            keys,
                            values,
                            skipped,
                            ..
                        } => Some((width - length + skipped, keys, values)),
                        LayerSequence::State(..) => {
                            candle_core::bail!("a state cached for attention layer {l}")
                        }
                    },
                    None => None,
                });
            }
            let front = rows
                .iter()
                .map(|row| row.as_ref().map_or(width, |(first, ..)| *first))
                .min()
                .unwrap_or(width);
            let mut keys = Vec::with_capacity(rows.len());
            let mut values = Vec::with_capacity(rows.len());
            for row in rows {
                let (first, k, v) = match row {
                    Some((first, k, v)) => (first, Some(k), Some(v)),
                    None => (width, None, None),
                };
                let zeros = Tensor::zeros(shape(first - front), model.dtype(), model.device())?;
                let aligned = |part: Option<&Tensor>| match part {
                    Some(part) if first > front => Tensor::cat(&[&zeros, part], 2),
                    Some(part) => Ok(part.clone()),
                    None => Ok(zeros.clone()),
                };
                keys.push(aligned(k)?);
                values.push(aligned(v)?);
            }
            layer.set(Some((Tensor::cat(&keys, 0)?, Tensor::cat(&values, 0)?)));
            layer.front = front;
        }
        Ok(())
    }

    /// Row `row`'s keys and values at the columns its `key_mask` marks real, per layer
    /// `[1, kv_heads, n, head_dim]` (less the positions a windowed layer dropped), and its states in
    /// linear-attention layers.
    pub fn row(&self, row: usize, key_mask: &[u8]) -> Result<SequenceCache> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            if let Some((conv, rule)) = &layer.state {
                layers.push(LayerSequence::State(
                    conv.narrow(0, row, 1)?.contiguous()?,
                    rule.narrow(0, row, 1)?.contiguous()?,
                ));
                continue;
            }
            let Some((k, v)) = &layer.keys_values else {
                candle_core::bail!("the cache holds nothing yet");
            };
            let skipped = key_mask[..layer.front].iter().filter(|&&m| m != 0).count();
            let columns: Vec<u32> = (layer.front..key_mask.len())
                .filter(|&column| key_mask[column] != 0)
                .map(|column| (column - layer.front) as u32)
                .collect();
            let columns = Tensor::new(columns.as_slice(), k.device())?;
            let pick = |t: &Tensor| -> Result<Tensor> {
                t.narrow(0, row, 1)?
                    .contiguous()?
                    .index_select(&columns, 2)?
                    .contiguous()
            };
            layers.push(LayerSequence::KeysValues {
                keys: pick(k)?,
                values: pick(v)?,
                skipped,
                window: layer.window,
            });
        }
        Ok(layers)
    }

    /// Adds `other`'s rows after this cache's, right-aligned: the narrower of the two gets zero columns in
    /// front (which the callers' key masks must mark as padding), and in a windowed layer the side that
    /// dropped more gets zeros where it dropped them (which the windows hide).
    pub fn append_rows(&mut self, other: KvCache) -> Result<()> {
        let (width, other_width) = (self.len(), other.len());
        let width_joined = width.max(other_width);
        for (layer, other) in self.layers.iter_mut().zip(other.layers) {
            layer.state = match (layer.state.take(), other.state) {
                (Some((conv, rule)), Some((other_conv, other_rule))) => Some((
                    Tensor::cat(&[conv, other_conv], 0)?,
                    Tensor::cat(&[rule, other_rule], 0)?,
                )),
                (ours, theirs) => ours.or(theirs),
            };
            // Each side's first held column in the joined columns.
            let first = layer.front + width_joined - width;
            let other_first = other.front + width_joined - other_width;
            let front = first.min(other_first);
            let (joined, front) = match (layer.keys_values.take(), other.keys_values) {
                (None, theirs) => (theirs, other.front),
                (ours, None) => (ours, layer.front),
                (Some((k, v)), Some((other_k, other_v))) => {
                    let ahead = |t: Tensor, n: usize| -> Result<Tensor> {
                        if n == 0 {
                            return Ok(t);
                        }
                        let (b, heads, _, dim) = t.dims4()?;
                        let zeros = Tensor::zeros((b, heads, n, dim), t.dtype(), t.device())?;
                        Tensor::cat(&[&zeros, &t], 2)
                    };
                    let (pad, other_pad) = (first - front, other_first - front);
                    let joined = (
                        Tensor::cat(&[ahead(k, pad)?, ahead(other_k, other_pad)?], 0)?,
                        Tensor::cat(&[ahead(v, pad)?, ahead(other_v, other_pad)?], 0)?,
                    );
                    (Some(joined), front)
                }
            };
            layer.set(joined);
            layer.front = front;
        }
        Ok(())
    }

    /// Drops the first `columns` columns of every row (padding that no row needs any more).
    pub fn drop_front(&mut self, columns: usize) -> Result<()> {
        if columns == 0 {
            return Ok(());
        }
        for layer in &mut self.layers {
            if let Some((k, v)) = layer.keys_values.take() {
                // A windowed layer may have dropped some of them already.
                let dropped = columns.saturating_sub(layer.front);
                let kept = k.dim(2)? - dropped;
                layer.set(Some((
                    k.narrow(2, dropped, kept)?,
                    v.narrow(2, dropped, kept)?,
                )));
                layer.front = layer.front.saturating_sub(columns);
            }
        }
        Ok(())
    }

    /// Lets each windowed layer drop the leading columns that no row can read any more: before every
    /// row's queries to come, which start at the position after its last real column, go back no
    /// further than `window - 1` positions. `key_masks` are the rows' masks over [`KvCache::len`]
    /// columns. Nothing is dropped before [`trim_block`] columns are droppable; what is dropped is freed.
    pub fn trim(&mut self, key_masks: &[&[u8]]) -> Result<()> {
        // The rows' masks are read once per window size, not once per layer.
        let mut droppable_by_window: Vec<(usize, usize)> = Vec::new();
        for layer in &mut self.layers {
            let Some(window) = layer.window else {
                continue;
            };
            if layer.keys_values.is_none() || key_masks.is_empty() {
                continue;
            }
            let droppable = match droppable_by_window.iter().find(|(w, _)| *w == window) {
                Some(&(_, droppable)) => droppable,
                None => {
                    let droppable = key_masks
                        .iter()
                        .map(|mask| unreadable(mask, window))
                        .min()
                        .unwrap_or(0);
                    droppable_by_window.push((window, droppable));
                    droppable
                }
            };
            let block = trim_block(window);
            if droppable >= layer.front + block {
                layer.drop_until(droppable, block)?;
            }
        }
        Ok(())
    }

    /// Keeps only the given rows of the batch, in that order.
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        for layer in &mut self.layers {
            layer.select_rows(rows)?;
        }
        Ok(())
    }
}

/// The leading columns of a row's `key_mask` that its next queries cannot read through a `window`:
/// padding, and real columns `window` or more positions before the next position (the count of real
/// columns), as [`crate::layout::window_mask`] hides them.
fn unreadable(key_mask: &[u8], window: usize) -> usize {
    let next = key_mask.iter().filter(|&&m| m != 0).count();
    let mut position = 0;
    key_mask
        .iter()
        .take_while(|&&m| {
            if m == 0 {
                return true;
            }
            position += 1;
            position - 1 + window <= next
        })
        .count()
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    /// `[batch, 2 heads, columns, 3]` with values that say where they are, offset by `start`.
    fn columns(batch: usize, count: usize, start: usize) -> Tensor {
        let values: Vec<f32> = (0..batch * 2 * count * 3)
            .map(|i| (start * 1000 + i) as f32)
            .collect();
        Tensor::from_vec(values, (batch, 2, count, 3), &Device::Cpu).unwrap()
    }

    fn same(a: &Tensor, b: &Tensor) -> bool {
        a.dims() == b.dims()
            && a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                == b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Appends in place hold what concatenation would, across growth, row selection, dropped columns
    /// and clones, and never change what an earlier step was given.
    #[test]
    fn appending_in_place_holds_what_concatenating_would() {
        let mut cache = LayerCache::default();
        let mut expected = columns(3, 5, 0);
        cache.append(expected.clone(), expected.clone()).unwrap();
        let mut earlier: Vec<(Tensor, Tensor)> = Vec::new();
        for step in 1..40 {
            let new = columns(expected.dim(0).unwrap(), 1, step);
            let (k, v) = cache.append(new.clone(), new.clone()).unwrap();
            expected = Tensor::cat(&[&expected, &new], 2).unwrap();
            assert!(same(&k, &expected) && same(&v, &expected), "step {step}");
            earlier.push((k.copy().unwrap(), k));
            if step == 20 {
                // A clone appends on its own: the original's buffers are not its to write (nor the
                // clone's the original's, which writes the same column next).
                let mut clone = cache.clone();
                let other = columns(3, 1, 999);
                let (theirs, _) = clone.append(other.clone(), other).unwrap();
                earlier.push((theirs.copy().unwrap(), theirs));
            }
            if step == 25 {
                let rows = Tensor::new(&[2u32, 0], &Device::Cpu).unwrap();
                for (copy, view) in earlier.drain(..) {
                    assert!(
                        same(&copy, &view),
                        "a later step changed an earlier step's keys"
                    );
                }
                cache.select_rows(&rows).unwrap();
                expected = expected.index_select(&rows, 0).unwrap();
            }
            if step == 30 {
                let kept = expected.dim(2).unwrap() - 4;
                let (k, v) = cache.keys_values.take().unwrap();
                cache.set(Some((
                    k.narrow(2, 4, kept).unwrap(),
                    v.narrow(2, 4, kept).unwrap(),
                )));
                expected = expected.narrow(2, 4, kept).unwrap();
            }
        }
        for (copy, view) in &earlier {
            assert!(
                same(copy, view),
                "a later step changed an earlier step's keys"
            );
        }
        assert!(cache.room.is_some(), "decoding steps write in place");
        let capacity = cache.room.as_ref().unwrap().0.dim(2).unwrap();
        let cached = expected.dim(2).unwrap();
        assert!(
            capacity >= cached && capacity <= cached + cached / 8 + 16,
            "{capacity} for {cached}"
        );
        let tracked = candle_core::Var::from_tensor(&columns(2, 1, 0)).unwrap();
        let mut cache = LayerCache::default();
        cache.append(columns(2, 2, 0), columns(2, 2, 0)).unwrap();
        let (k, _) = cache
            .append(tracked.as_tensor().clone(), columns(2, 1, 0))
            .unwrap();
        assert!(k.track_op() && cache.room.is_none(), "a graph is kept");
        assert_eq!(k.dtype(), DType::F32);
    }

    /// A row's leading columns that its window no longer reads: padding, and real columns at least
    /// `window` positions before its next query, up to the first column it still reads.
    #[test]
    fn a_row_cannot_read_what_its_window_left_behind() {
        // Positions 0, 1, 2, padding, 3, 4; the next query is at 5 and reads 3 and 4 with a window of 3.
        let mask = [0, 0, 1, 1, 1, 0, 1, 1];
        assert_eq!(unreadable(&mask, 3), 6);
        assert_eq!(unreadable(&mask, 1), 8);
        assert_eq!(unreadable(&mask, 5), 3);
        assert_eq!(unreadable(&mask, 6), 2);
        assert_eq!(unreadable(&[1, 1], 8), 0);
        // Kept positions 4.. of 10: a prompt sharing `length` of them reads back to `length + 1 - 3`.
        let kept = LayerSequence::KeysValues {
            keys: columns(1, 6, 0),
            values: columns(1, 6, 0),
            skipped: 4,
            window: Some(3),
        };
        assert!(kept.starts(10, 10) && kept.starts(6, 10));
        assert!(!kept.starts(5, 10), "position 3 was dropped");
        let prefix = kept.prefix(6, 10).unwrap().unwrap();
        let LayerSequence::KeysValues { keys, skipped, .. } = prefix else {
            panic!("keys and values")
        };
        assert_eq!((keys.dim(2).unwrap(), skipped), (2, 4));
        assert!(kept.prefix(5, 10).unwrap().is_none());
    }
}
